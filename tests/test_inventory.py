"""Inventory validation on a hand-made store: each problem is found, counted once, never fatal."""

from __future__ import annotations

import time

import msgspec
import pytest

from draftfleet.inventory import run_inventory
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import Store


def _rec(i: int, ids: list[int], *, finish="stop", prompt=None, source="exact", backend="sglang") -> ResponseRecord:
    return ResponseRecord(
        key=f"{i:064x}", dataset="ds", source=f"f.jsonl:{i}", settings_id="s",
        messages=[Message(role="user", content=prompt or f"prompt {i}")], system_prompt_used=False, text="t",
        output_ids=ids, prompt_tokens=7, completion_tokens=len(ids), finish_reason=finish,
        truncated=finish == "length", backend=backend, backend_kind="gpu" if source == "exact" else "cloud",
        model="m", token_source=source, usage=Usage(), cost_usd=0.01 if backend != "sglang" else 0.0,
        cost_source="none", latency_s=0.1, attempts=1, worker="w", created_at=time.time(),
    )


@pytest.mark.parametrize("processes", [1, 2])
def test_validation_counts_each_problem(tmp_path, target_tokenizer, processes):
    tok = target_tokenizer
    store = Store(tmp_path)
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
    assert v.roundtrip_checked == 14 and v.roundtrip_share is not None
    assert inv.budget_tokens is None and inv.cost_to_finish_usd == {}


def test_store_alone_reads_budgets_from_manifests(tmp_path):
    from draftfleet.schemas.records import DatasetManifest, GenerationSettings

    store = Store(tmp_path)
    settings = GenerationSettings(model="m", max_tokens=10, temperature=0.0, top_p=1.0)
    store.write_manifest(DatasetManifest(name="ds", version=1, settings=settings, settings_id="s",
                                         budget_tokens=1000, created_at=time.time()))
    store.put(_rec(1, [5] * 100))
    inv = run_inventory(tmp_path)[0]
    assert (inv.budget_tokens, inv.remaining_tokens, inv.share_done) == (1000, 900, 0.1)
    assert inv.validation.ids_out_of_vocab is None  # no tokenizer: that check is left out, not faked
