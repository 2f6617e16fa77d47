"""The README's first command: the demo tells the product's story on the embedded defaults (the GPU
under a budget, the plan, the pivot, the cloud finishing, the inventory) and leaves nothing running."""

from __future__ import annotations

import json
import re
import time

import pytest

from draftfleet.devtools.demo import CHAT_BUDGET

from .conftest import run_cli

pytestmark = pytest.mark.slow


def test_the_demo_tells_the_story_and_keeps_the_store(tmp_path):
    started = time.monotonic()
    res = run_cli("demo", "--store", str(tmp_path / "demo"), "--json", timeout=180)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    inventory = {row["dataset"]: row for row in report["inventory"]}
    # the GPU generated first, the cloud finished after the pivot: both sides on both datasets
    for row in inventory.values():
        assert {side.split()[0] for side in row["by_side"]} == {"sglang", "openrouter"}, row
        assert row["valid"]
    assert inventory["instruct"]["responses"] == 40 and not inventory["instruct"]["closed"]
    chat = inventory["chat"]
    assert chat["closed"] and chat["responses"] < 40  # closed at its budget, the rest skipped
    assert CHAT_BUDGET * 0.85 <= chat["completion_tokens"] <= CHAT_BUDGET * 1.1
    for p in report["plan"]:  # draftfleet plan's, before the pivot: the GPU's time, the cloud's price
        assert p["state"] == "open" and p["remaining_tokens"] > 0, p
        sides = {side["kind"]: side for side in p["sides"]}
        assert sides["gpu"]["time_s"] > 0 and sides["gpu"]["cost_usd"] == 0
        assert sides["cloud"]["usd_per_mtok"] > 0 and sides["cloud"]["price_source"] == "configured"
    assert report["pivot"]["drained"] and report["pivot"]["assignment"] == {"chat": ["cloud"], "instruct": ["cloud"]}
    assert report["cloud"]["cost_usd"] > 0
    store = tmp_path / "demo" / "store"
    assert len(list((store / "instruct").glob("*/*.json"))) == 40
    assert (tmp_path / "demo" / "fleet.toml").exists()
    assert not (store / "_redis" / "redis.url").exists()  # the embedded Redis was stopped
    assert took < 120


def test_the_demo_says_what_happened_and_what_to_type_next(tmp_path):
    res = run_cli("demo", timeout=180, env={"COLUMNS": "100"})
    assert res.returncode == 0, res.stderr[-3000:]
    text = " ".join(res.stdout.split())  # as read, whatever the wrapping
    for step in ("1. GPU", "2. The plan", "3. Pivot", "4. The cloud finished", "5. The inventory"):
        assert step in text, step
    assert f"chat's budget is {CHAT_BUDGET:,} tokens" in text
    assert "draftfleet pivot --dataset chat --dataset instruct --to cloud" in text
    for name in ("chat", "instruct"):
        assert re.search(rf"{name}: \d+ responses, [\d,]+ tokens", text), name
    assert "nothing is left running" in text
    assert re.search(r"next: draftfleet demo --store \S+", text)
