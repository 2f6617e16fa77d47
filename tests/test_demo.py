"""The README's first command: the demo runs the whole fleet and leaves nothing running."""

from __future__ import annotations

import json

import pytest

from .conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_produces_on_both_sides_and_keeps_the_store(tmp_path):
    res = run_cli("demo", "--store", str(tmp_path / "demo"), "--json", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)["rows"]
    by_dataset: dict[str, int] = {}
    for row in rows:
        by_dataset[row["dataset"]] = by_dataset.get(row["dataset"], 0) + row["responses"]
    assert by_dataset == {"chat": 40, "instruct": 40}
    backends = {row["backend"].split()[0] for row in rows}
    assert backends == {"sglang", "openrouter"}
    assert all(row["completion_tokens"] > 0 for row in rows)
    store = tmp_path / "demo" / "store"
    assert len(list((store / "chat").glob("*/*.json"))) == 40
    assert (tmp_path / "demo" / "fleet.toml").exists()
    # the embedded Redis was stopped: its URL file is gone
    assert not (store / "_redis" / "redis.url").exists()
