"""A raw export imports back as the same records: provenance (token source, backend, model, cost,
usage, original source) survives ``draftfleet export -f raw`` then ``draftfleet import`` (issue 14)."""

from __future__ import annotations

import json
import time

import msgspec

from draftfleet.identity import prompt_key
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import open_store

from tests.conftest import run_cli, write_config, write_jsonl

# Differ on every import by design: who wrote the record and when.
IMPORT_SET = {"worker", "created_at"}


def _records(cfg, tok) -> list[ResponseRecord]:
    ds = cfg.dataset("rt")
    settings = ds.settings(cfg.fleet.model)
    out = []
    for i, (backend, kind, source, model) in enumerate([
        ("sglang", "gpu", "exact", cfg.fleet.model),
        ("cloudy", "cloud", "retokenized", "vendor/model"),
    ]):
        messages = [Message(role="user", content=f"question {i}: sort a list")]
        text = f"def sort_{i}(x): return sorted(x)"
        ids = tok.completion_ids(messages, text, None, stopped=True)
        out.append(ResponseRecord(
            key=prompt_key("rt", messages, settings), dataset="rt", source=f"prompts.jsonl:{i + 1}",
            settings_id="will be the manifest's", messages=messages, system_prompt_used=False, text=text,
            output_ids=ids, prompt_tokens=len(tok.prompt_ids(messages)), completion_tokens=len(ids),
            finish_reason="stop", truncated=False, backend=backend, backend_kind=kind, model=model, token_source=source,
            usage=Usage(prompt_tokens=31, completion_tokens=len(ids) + 2, cost_usd=0.00123 if kind == "cloud" else None),
            cost_usd=0.00123 if kind == "cloud" else 0.0, cost_source="provider" if kind == "cloud" else "none",
            latency_s=1.25 + i, attempts=2, retry_reasons=["http_429"], worker="w1", created_at=time.time(),
        ))
    return out


def test_raw_export_then_import_gives_back_the_records(tmp_path, tokenizer_dir, target_tokenizer):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    datasets = [{"name": "rt", "path": str(data), "max_tokens": 100}]
    config = write_config(tmp_path / "a", tokenizer=tokenizer_dir, datasets=datasets)
    cfg = load_config(config)
    store = open_store(cfg)
    # the dataset's manifest, as enqueue writes it, gives the settings id the records carry
    from draftfleet.producer.enqueue import check_manifest

    manifest = check_manifest(store, cfg, cfg.dataset("rt"), False)
    originals = [msgspec.structs.replace(r, settings_id=manifest.settings_id) for r in _records(cfg, target_tokenizer)]
    for rec in originals:
        assert store.put(rec)

    out = tmp_path / "export"
    res = run_cli("export", "--config", str(config), "--dataset", "rt", "-f", "raw", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    (raw,) = out.glob("*raw_responses.jsonl")

    config2 = write_config(tmp_path / "b", tokenizer=tokenizer_dir, datasets=datasets)
    res = run_cli("import", str(raw), "--config", str(config2), "--dataset", "rt", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert (summary["imported"], summary["exact"], summary["retokenized"]) == (2, 1, 1)

    fresh = open_store(load_config(config2))
    for rec in originals:
        back = fresh.get("rt", rec.key)
        want, got = msgspec.to_builtins(rec), msgspec.to_builtins(back)
        assert {k: got[k] for k in want if k not in IMPORT_SET} == {k: want[k] for k in want if k not in IMPORT_SET}
        assert back.worker == "import"


def test_text_only_line_is_retokenized_whatever_it_claims(tmp_path, tokenizer_dir):
    """``token_source`` is kept only beside ids: text alone is re-tokenized here, never ``exact``."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "rt", "path": str(data),
                                                                         "max_tokens": 100}])
    line = {"messages": [{"role": "user", "content": "q"}], "output": "an answer", "finish_reason": "stop",
            "token_source": "exact", "backend": "sglang", "backend_kind": "gpu", "source": "orig.jsonl:7"}
    raw = write_jsonl(tmp_path / "raw.jsonl", [line])
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "rt", "--json")
    assert res.returncode == 0, res.stderr
    (rec,) = open_store(load_config(config)).records("rt")
    assert (rec.token_source, rec.backend, rec.backend_kind, rec.source) == ("retokenized", "sglang", "gpu",
                                                                             "orig.jsonl:7")
