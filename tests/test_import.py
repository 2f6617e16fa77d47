"""Import of an earlier pipeline's output: how lines without a finish_reason are classified."""

from __future__ import annotations

import json
import time

import pytest

from draftfleet.identity import settings_id
from draftfleet.producer.importer import import_file
from draftfleet.schemas.config import DatasetConfig
from draftfleet.schemas.records import DatasetManifest
from draftfleet.store import open_store

from tests.conftest import run_cli, write_config, write_jsonl

MAX_TOKENS = 40


def _lines(tok) -> list[dict]:
    body = tok.encode_text("def f(x): return x")
    long_body = (body * 10)[:MAX_TOKENS]
    msgs = lambda i: [{"role": "user", "content": f"prompt {i}"}]  # noqa: E731
    return [
        {"messages": msgs(0), "output_ids": body + [tok.eot_id]},             # ends in end-of-turn: stop
        {"messages": msgs(1), "output_ids": body},                            # far below max_tokens, no eot
        {"messages": msgs(2), "output_ids": long_body},                       # max_tokens long, no eot
        {"messages": msgs(3), "output_ids": body, "finish_reason": "length"},  # the file says so
        {"messages": msgs(4), "output": "def g(): pass"},                     # text only, short
    ]


def _setup(tmp_path):
    ds = DatasetConfig(name="ds", path=str(tmp_path / "prompts.jsonl"), max_tokens=MAX_TOKENS)
    settings = ds.settings("test/chatml")
    manifest = DatasetManifest(name="ds", version=1, settings=settings, settings_id=settings_id(settings),
                               budget_tokens=None, created_at=time.time())
    return ds, manifest


@pytest.mark.parametrize("rule, want", [
    ("max-tokens", ["stop", "stop", "length", "length", "stop"]),
    ("end-of-turn", ["stop", "length", "length", "length", "stop"]),
])
def test_finish_rule_decides_lines_without_finish_reason(tmp_path, target_tokenizer, rule, want):
    tok = target_tokenizer
    ds, manifest = _setup(tmp_path)
    raw = write_jsonl(tmp_path / "raw.jsonl", _lines(tok))
    store = open_store(tmp_path / "store")
    summary = import_file(raw, ds, manifest, store, tok, finish_rule=rule)
    assert summary.imported == 5 and summary.finish_rule == rule
    by_source = {r.source: r for r in store.records("ds")}
    got = [by_source[f"raw.jsonl:{i}"].finish_reason for i in range(1, 6)]
    assert got == want
    assert [by_source[f"raw.jsonl:{i}"].truncated for i in range(1, 6)] == [w == "length" for w in want]
    if rule == "max-tokens":
        assert summary.finish_decided == {"end_of_turn": {"stop": 1}, "max_tokens": {"stop": 2, "length": 1},
                                          "file": {"length": 1}}
    else:
        assert summary.finish_decided == {"end_of_turn": {"stop": 1, "length": 2}, "max_tokens": {"stop": 1},
                                          "file": {"length": 1}}
    # ids are stored as the file had them: nothing appended to a line classified as stopped
    assert by_source["raw.jsonl:2"].output_ids == tok.encode_text("def f(x): return x")


def test_import_summary_names_the_rule_and_its_counts(tmp_path, target_tokenizer, tokenizer_dir, redis_server):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    config = write_config(tmp_path, tokenizer=tokenizer_dir,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": MAX_TOKENS}])
    raw = write_jsonl(tmp_path / "raw.jsonl", _lines(target_tokenizer))
    env = {"REDIS_URL": redis_server.url, "COLUMNS": "200"}
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "ds", env=env)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert ("finish reasons (rule max-tokens): 1 by the end-of-turn id (stop 1); "
            f"3 by length against max_tokens {MAX_TOKENS} (length 1, stop 2); "
            "1 from the file's finish_reason (length 1)") in text, text
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "ds", "--finish-rule", "end-of-turn",
                  "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["finish_rule"] == "end-of-turn"
