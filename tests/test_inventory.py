"""Inventory validation on a hand-made store: each problem is found, counted once, never fatal."""

from __future__ import annotations

import time

import msgspec
import pytest

from draftfleet.views.inventory import run_inventory
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import open_store


def _rec(i: int, ids: list[int], *, finish="stop", prompt=None, source="exact", backend="sglang",
         usage: Usage | None = None, dataset="ds") -> ResponseRecord:
    return ResponseRecord(
        key=f"{i:064x}", dataset=dataset, source=f"f.jsonl:{i}", settings_id="s",
        messages=[Message(role="user", content=prompt or f"prompt {i}")], system_prompt_used=False, text="t",
        output_ids=ids, prompt_tokens=7, completion_tokens=len(ids), finish_reason=finish,
        truncated=finish == "length", backend=backend, backend_kind="gpu" if source == "exact" else "cloud",
        model="m", token_source=source, usage=usage or Usage(), cost_usd=0.01 if backend != "sglang" else 0.0,
        cost_source="none", latency_s=0.1, attempts=1, worker="w", created_at=time.time(),
    )


@pytest.mark.parametrize("processes", [1, 2])
def test_validation_counts_each_problem(tmp_path, target_tokenizer, processes):
    tok = target_tokenizer
    store = open_store(tmp_path)
    good = tok.encode_text("def f(x): return x") + [tok.eot_id]
    records = [_rec(i, good) for i in range(10)]
    records += [
        _rec(10, [tok.vocab_size + 5] + good),                # an id outside the vocabulary
        _rec(11, good[:-1]),                                  # says stop, lacks the end-of-turn
        _rec(12, good[:-1], finish="length"),                 # truncated (fine: no end-of-turn expected)
        _rec(13, good, prompt="prompt 1"),                    # the same prompt as record 1, another key
        _rec(14, good, source="retokenized", backend="cloudy"),
    ]
    for rec in records:
        assert store.put(rec)
    (tmp_path / "ds" / "ff").mkdir()
    (tmp_path / "ds" / "ff" / ("f" * 64 + ".json")).write_bytes(msgspec.json.encode(records[0])[:50])  # cut off
    inv = run_inventory(tmp_path, datasets=["ds"], tokenizer=tok, processes=processes)[0]
    v = inv.validation
    assert (v.ids_out_of_vocab, v.stop_without_eot, v.truncated, v.duplicate_prompts, v.schema_errors) == (1, 1, 1, 1, 1)
    assert "ffffffff" in v.unreadable_files[0]
    assert inv.responses == 15 and inv.completion_tokens == sum(len(r.output_ids) for r in records)
    split = {(s.backend, s.token_source): s.responses for s in inv.by_source}
    assert split == {("sglang", "exact"): 14, ("cloudy", "retokenized"): 1}
    assert v.roundtrip_checked == 14 and v.roundtrip_mismatch_share is not None
    assert inv.budget_tokens is None and inv.cost_to_finish_usd == {}


def test_store_alone_reads_budgets_from_manifests(tmp_path):
    from draftfleet.schemas.records import DatasetManifest, GenerationSettings

    store = open_store(tmp_path)
    settings = GenerationSettings(model="m", max_tokens=10, temperature=0.0, top_p=1.0)
    store.write_manifest(DatasetManifest(name="ds", version=1, settings=settings, settings_id="s",
                                         budget_tokens=1000, created_at=time.time()))
    store.put(_rec(1, [5] * 100))
    inv = run_inventory(tmp_path)[0]
    assert (inv.budget_tokens, inv.remaining_tokens, inv.share_done) == (1000, 900, 0.1)
    assert inv.validation.ids_out_of_vocab is None  # no tokenizer: that check is left out, not faked


def test_store_alone_shows_no_share_done(tmp_path):
    """``--store`` alone reads the budget from the manifest but no dataset file, so it cannot know
    whether the prompts run out first: a finished 4-prompt dataset under a 100,000-token budget is
    not "0.2% done". It says the budget and what is left of it, no percentage, and why."""
    from draftfleet.identity import settings_id
    from draftfleet.schemas.records import DatasetManifest, GenerationSettings
    from tests.conftest import run_cli

    store = open_store(tmp_path)
    settings = GenerationSettings(model="m", max_tokens=100, temperature=0.0, top_p=1.0)
    sid = settings_id(settings)
    store.write_manifest(DatasetManifest(name="ds", version=1, settings=settings, settings_id=sid,
                                         budget_tokens=100_000, created_at=time.time()))
    for i in range(4):
        assert store.put(msgspec.structs.replace(_rec(i, [5] * 50), settings_id=sid))
    res = run_cli("inventory", "--store", str(tmp_path), env={"COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "budget 100,000, 99,800 remaining; no % done: the prompts left are not known" in text, text
    assert "--store alone reads no dataset file" in text and "0.2% done" not in text, text


def test_provider_count_beside_ours_per_backend(tmp_path, redis_server):
    """A cloud record counts target-tokenizer tokens (budgets use them) and keeps the provider's own
    completion_tokens; the inventory shows both and the difference, per backend."""
    from draftfleet.ledger import Ledger

    store = open_store(tmp_path)
    recs = [_rec(i, [5] * 10, source="retokenized", backend="cloudy", usage=Usage(completion_tokens=8))
            for i in range(3)]
    recs.append(_rec(3, [5] * 10, source="retokenized", backend="cloudy"))  # the provider said nothing
    recs += [_rec(4 + i, [5] * 6, usage=Usage(completion_tokens=6)) for i in range(2)]
    ledger = Ledger(redis_server.client())
    for rec in recs:
        assert store.put(rec) and ledger.count(rec)
    inv = run_inventory(tmp_path)[0]
    split = {s.backend: s for s in inv.by_source}
    cloud, gpu = split["cloudy"], split["sglang"]
    assert (cloud.completion_tokens, cloud.provider_responses, cloud.provider_completion_tokens,
            cloud.provider_difference) == (40, 3, 24, 6)
    assert (gpu.completion_tokens, gpu.provider_completion_tokens, gpu.provider_difference) == (12, 12, 0)
    # the budget counts the target tokenizer's tokens, not the provider's
    assert ledger.dataset_totals("ds")["completion_tokens"] == 52 == inv.completion_tokens


def test_roundtrip_figure_is_named_and_explained(tmp_path, target_tokenizer, tokenizer_dir):
    """The round-trip figure is a share of records (not of ids), named so in JSON and explained in text."""
    import json

    from tests.conftest import run_cli

    tok = target_tokenizer
    store = open_store(tmp_path)
    good = tok.encode_text("def f(x): return x") + [tok.eot_id]
    natural = tok.encode_text("def return")
    split_ids = tok.encode_text("d") + tok.encode_text("ef return")  # ids no tokenizer would make
    assert split_ids != natural and tok.decode(split_ids) == tok.decode(natural)
    for i in range(3):
        store.put(_rec(i, good))
    store.put(_rec(3, split_ids + [tok.eot_id]))
    v = run_inventory(tmp_path, tokenizer=tok)[0].validation
    assert (v.roundtrip_checked, v.roundtrip_mismatched, v.roundtrip_mismatch_share) == (4, 1, 0.25)
    res = run_cli("inventory", "--store", str(tmp_path), "--tokenizer", str(tokenizer_dir), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["validation"]["roundtrip_mismatch_share"] == 0.25
    res = run_cli("inventory", "--store", str(tmp_path), "--tokenizer", str(tokenizer_dir), env={"COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "round-trip mismatch share 25.0% (1 of 4 exact records)" in text
    assert "share of exact records whose output ids change when decoded to text and encoded again" in text


def test_cost_to_finish_is_zero_when_no_prompts_remain(tmp_path, tokenizer_dir):
    from draftfleet.identity import prompt_key
    from draftfleet.schemas.config import load_config
    from tests.conftest import write_config, write_jsonl

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url="http://127.0.0.1:9",
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 100, "budget_tokens": 100000}])
    cfg = load_config(config)
    settings = cfg.dataset("ds").settings(cfg.fleet.model)
    store = open_store(cfg)

    def put(i):
        msgs = [Message(role="user", content=f"q{i}")]
        rec = _rec(i, [5] * 50, prompt=f"q{i}")
        store.put(msgspec.structs.replace(rec, key=prompt_key("ds", msgs, settings)))

    for i in range(3):
        put(i)
    inv = run_inventory(cfg.fleet.store, cfg)[0]
    # one prompt left: its cost, not the budget's 99,850 tokens' worth
    assert inv.prompts_left == 1 and inv.remaining_tokens == 100000 - 150
    assert inv.cost_to_finish_usd["cloudy"] == round((50 * 2.0 + 7 * 1.0) / 1e6, 4) == 0.0001  # not rounded to 0
    put(3)
    inv = run_inventory(cfg.fleet.store, cfg)[0]
    assert inv.prompts_left == 0 and inv.cost_to_finish_usd == {"cloudy": 0.0}
