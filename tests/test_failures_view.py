"""``draftfleet failures`` explains: the whole reason (wrapped, never cut), whether a retry can help,
and the lines the readers quarantined, per dataset with their reasons."""

from __future__ import annotations

import json

import pytest

from draftfleet.store import open_store
from draftfleet.views.failures import retry_verdict

from .conftest import run_cli, wait_until, write_config, write_jsonl

# What the engines and providers answer (vLLM's and OpenRouter's 400 for a prompt over the context).
VLLM_400 = ("This model's maximum context length is 2048 tokens. However, your prompt has 2100 tokens and you "
            "requested 64 output tokens (2164 in all). Please reduce the length of the input prompt.")


@pytest.mark.parametrize("kind, reason, retry", [
    ("http_400", VLLM_400, "no"),
    ("context_length", "The input (300 tokens) is longer than the model's context length (256 tokens).", "no"),
    ("chat_template", "Conversation roles must alternate user/assistant", "no"),
    ("moderation", "flagged (reasons: ['hate'])", "no"),
    ("http_422", "unknown field", "no"),
    ("http_500", "Internal Server Error", "yes"),
    ("http_429", "rate limited", "yes"),
    ("timeout", "did not answer in time", "yes"),
    ("finish_abort", "aborted", "yes"),
    ("content_filter", "the provider filtered the answer", "maybe"),
    ("retokenize", "cannot re-tokenize", "maybe"),
])
def test_retry_verdicts(kind, reason, retry):
    assert retry_verdict(kind, reason)[0] == retry


@pytest.mark.slow
def test_failures_shows_the_whole_reason_whether_a_retry_helps_and_the_quarantine(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(time_scale=0, context_length=120, length="fixed:8")
    long_prompt = " ".join(f"word{i}" for i in range(300))
    data = write_jsonl(tmp_path / "data" / "p.jsonl", [
        {"prompt": "short one"}, {"prompt": long_prompt}, {"text": "no prompt column"}, {"prompt": "short two"}])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 16}])
    env = {"REDIS_URL": redis_server.url, "COLUMNS": "80"}
    res = run_cli("enqueue", "--config", str(config), env=env)
    assert res.returncode == 0, res.stderr
    store = open_store(tmp_path / "store")
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 2 and len(store.failures("ds")) == 1, 90, 0.2, workers.logs())

    [row] = json.loads(run_cli("failures", "--config", str(config), "--json", env=env).stdout)
    assert (row["source"], row["kind"], row["retry"]) == ("p.jsonl:2", "context_length", "no")
    reason = row["reason"]
    assert "longer than the model's context length (120 tokens)" in reason and len(reason) > 80

    res = run_cli("failures", "--config", str(config), env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80
    flat = " ".join(x.strip() for x in lines)
    for word in reason.split():  # the whole reason, wrapped: every word of it is there
        assert word in flat, word
    assert "1 will fail again: over the model's context with max_tokens;" in flat
    assert "lower the dataset's max_tokens" in flat
    assert "draftfleet enqueue --retry-failed re-sends all 1, also the 1 that will fail again: fix those first" in flat
    assert "quarantined lines (1)" in flat and "missing_field" in flat
    assert "p.jsonl:3: no prompt found" in flat
    assert "kept verbatim in" in flat and str(store.quarantine_path("ds")) in "".join(x.strip() for x in lines)
