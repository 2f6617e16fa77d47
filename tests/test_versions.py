"""Versions of a dataset (issue 21, item 2): after ``enqueue --new-version`` the old version's
records stay in the store, and export, capture, the hidden-state export and inventory take the
current version unless ``--version N`` or ``--all-versions`` says otherwise; each names it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftfleet.conversation import record_turns
from draftfleet.export import features
from draftfleet.hidden import HiddenStore, encode_safetensors
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.versions import select

from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_hidden import _model

pytestmark = pytest.mark.slow


def test_a_new_version_is_exported_captured_and_counted_alone(tmp_path, redis_server, tokenizer_dir,
                                                              emulator_factory, workers):
    """4 two-turn rows generated with turns "first" (version 1), then "all" (version 2): 8 records
    in the store. Each reader takes version 2's 4 by default (before: 8 conversations, every first
    user turn twice), version 1's with --version 1, all 8 with --all-versions."""
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:20", ttft_s=0.0)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"row {i} first"},
                                          {"role": "assistant", "content": "old"},
                                          {"role": "user", "content": f"row {i} second"}]} for i in range(4)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    model = _model(tmp_path / "model")

    def config(turns: str):
        path = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                            datasets=[{"name": "ds", "path": str(data), "max_tokens": 32, "turns": turns}])
        with open(path, "a") as fh:
            # a unit a turn, as the counts below (a conversation captured once: test_capture_conversations.py)
            fh.write(f'\n[capture]\nmodel_path = "{model}"\nconversations = false\n')
        return path

    env = {"REDIS_URL": redis_server.url}
    path = config("first")
    store = open_store(load_config(path))
    assert run_cli("enqueue", "--config", str(path), env=env).returncode == 0
    workers.start(path, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, workers.logs())
    path = config("all")
    res = run_cli("enqueue", "--config", str(path), "--new-version", env=env)
    assert res.returncode == 0, res.stderr
    wait_until(lambda: len(store.keys("ds")) == 8, 60, 0.2, workers.logs())
    workers.stop_all()

    def export(*flags):
        out = tmp_path / ("out" + "".join(flags))
        res = run_cli("export", "--config", str(path), "-f", "sharegpt", "--out", str(out), "--json", *flags, env=env)
        assert res.returncode == 0, res.stderr
        [manifest] = json.loads(res.stdout)
        convs = [json.loads(x) for x in (out / "ds.sharegpt.jsonl").read_text().splitlines()]
        return manifest, convs

    manifest, convs = export()
    firsts = [c["conversations"][0]["content"] for c in convs]
    assert len(convs) == 4 and sorted(firsts) == [f"row {i} first" for i in range(4)]  # each once
    assert all(sum(t["role"] == "assistant" for t in c["conversations"]) == 2 for c in convs)
    assert (manifest["version"], manifest["settings"]["turns"], manifest["other_versions"]) == (2, "all", 4)
    manifest, convs = export("--version", "1")
    assert len(convs) == 4 and (manifest["version"], manifest["settings"]["turns"]) == (1, "first")
    assert all(sum(t["role"] == "assistant" for t in c["conversations"]) == 1 for c in convs)
    manifest, convs = export("--all-versions")
    assert len(convs) == 8 and manifest["version"] is None and manifest["other_versions"] == 0
    res = run_cli("export", "--config", str(path), "-f", "raw", "--out", str(tmp_path / "x"), "--version", "3", env=env)
    assert res.returncode == 1 and "has versions 1 to 2, not 3" in res.stderr

    def inventory(*flags):
        res = run_cli("inventory", "--config", str(path), "--json", *flags, env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)[0]

    inv = inventory()
    assert (inv["version"], inv["responses"], inv["conversations"], inv["turns"], inv["other_versions"]) == (2, 4, 4, 8, 4)
    assert inventory("--version", "1")["turns"] == 4 and inventory("--all-versions")["turns"] == 12

    def capture(*flags):
        res = run_cli("capture", "--config", str(path), "--json", *flags, env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)[0]

    c = capture()
    assert (c["dataset_version"], c["units"], c["queued"]) == (2, 8, 8)  # version 2's turns, not version 1's
    c = capture("--all-versions")
    assert (c["dataset_version"], c["units"], c["queued"], c["already_queued"]) == (None, 12, 4, 8)

    # every turn of both versions captured: the hidden-state exports' rows are version 2's 8 turns
    # (the rows speculators and specforge write; writing them needs torch, tests/engines does)
    hidden = HiddenStore(store)
    for rec in store.records("ds"):
        for turn, t in enumerate(record_turns(rec)):
            ids = np.arange(t.prompt_tokens + len(t.output_ids), dtype=np.int64)
            hidden.put("ds", 1, rec.key, turn, encode_safetensors({"token_ids": ("I64", ids)},
                                                                  {"prompt_len": str(t.prompt_tokens)}, seal=True))
    def chosen(flags) -> list:  # the records an export of these flags takes, in its order
        return sorted(filter(select(store, "ds", **dict(flags)).takes, store.records("ds")), key=features.export_order)

    rows = {flags: len(features._rows(hidden, chosen(flags), "ds", 1)[0])
            for flags in ((), (("version", 1),), (("all_versions", True),))}
    assert rows == {(): 8, (("version", 1),): 4, (("all_versions", True),): 12}
