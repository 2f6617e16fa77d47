"""Run-time changes (issue 14): budgets and datasets change while the fleet runs, no restart.

``enqueue`` publishes each dataset's settings in Redis (assign.py); running workers, the
reconciler and status read them within seconds. Real Redis, real worker processes, the emulator.
"""

from __future__ import annotations

import json

import httpx
import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import WAIT, Ledger
from draftfleet.schemas.config import load_config
from draftfleet.views.status import snapshot
from draftfleet.store import Store, open_store

from .conftest import free_port, run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _chat_rows, _enqueue

pytestmark = pytest.mark.slow


def _tokens(store: Store, dataset: str) -> int:
    return sum(rec.completion_tokens for rec in store.records(dataset))


def _settled(r, dataset: str) -> bool:
    return not list(r.scan_iter(rk.claim(dataset, "*")))


def test_budget_lowered_then_raised_while_the_worker_runs(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                          workers):
    emu = emulator_factory(single_stream_tps=40, ceiling_tps=100000, length="uniform:20:40", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(400))

    def config(budget: int):
        return write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=4,
                            datasets=[{"name": "ds", "path": str(data), "max_tokens": 64, "budget_tokens": budget}])

    path = config(1_000_000)
    store = open_store(load_config(path))
    r = redis_server.client()
    ledger = Ledger(r)
    worker = workers.start(path, "gpu", "--url", emu.url, redis_url=redis_server.url)
    assert _enqueue(path, redis_server.url)[0]["queued"] == 400
    wait_until(lambda: len(store.keys("ds")) >= 12, 60, 0.1, workers.logs())

    # lowered: the running worker closes the dataset at the new budget (about 10 s of work ahead)
    low = ledger.dataset_totals("ds")["completion_tokens"] + 1500
    _enqueue(config(low), redis_server.url)
    published_at = _tokens(store, "ds")  # (past `low` already if enqueue was slow to start)
    wait_until(lambda: ledger.closed_at("ds") is not None, 60, 0.1, f"the dataset to close\n{workers.logs()}")
    wait_until(lambda: _settled(r, "ds"), 20, 0.1, "in-flight work to end")
    assert ledger.closed_at("ds") == low and r.llen(rk.queue("ds")) == 0
    at_low = _tokens(store, "ds")
    assert low - 64 < at_low <= max(low, published_at) + 4 * 64  # 4 admitted before may finish
    left = 400 - len(store.keys("ds"))

    # raised: enqueue reopens it and the same worker goes on, to the new budget, not the old one
    high = at_low + 1500
    again = _enqueue(config(high), redis_server.url)[0]
    assert not again["closed"] and again["queued"] == left
    wait_until(lambda: ledger.closed_at("ds") == high, 90, 0.2, f"the dataset to close at {high}\n{workers.logs()}")
    wait_until(lambda: _settled(r, "ds"), 20, 0.1, "in-flight work to end")
    total = _tokens(store, "ds")
    assert high - 64 < total <= high + 64, (total, high)
    assert worker.poll() is None and total == ledger.dataset_totals("ds")["completion_tokens"]


def test_a_dataset_added_while_the_fleet_runs_is_followed(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                          workers):
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:30", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    a = {"name": "a", "path": str(write_jsonl(tmp_path / "a.jsonl", _chat_rows(10, tag="a"))), "max_tokens": 64}
    b = {"name": "b", "path": str(write_jsonl(tmp_path / "b.jsonl", _chat_rows(12, tag="b"))), "max_tokens": 64,
         "budget_tokens": 50_000}
    path = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[a])
    before = load_config(path)  # what a `status --watch` started now holds for its whole run
    old = tmp_path / "old.toml"
    old.write_text(path.read_text())
    store = open_store(before)
    r = redis_server.client()
    port = free_port()
    workers.start(path, "gpu", "--url", emu.url, redis_url=redis_server.url)  # follows every dataset
    workers.start(path, "cloud", "--backend", "cloudy", "--dataset", "a", redis_url=redis_server.url, env=KEY_ENV)
    workers.start(path, "reconciler", "--interval", "1", "--metrics-port", str(port), redis_url=redis_server.url)
    wait_until(lambda: len(list(r.scan_iter(rk.worker_report("*")))) == 2, 60, 0.1, workers.logs())
    _enqueue(path, redis_server.url)
    wait_until(lambda: len(store.keys("a")) == 10, 60, 0.2, workers.logs())

    path = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[a, b])
    assert {s["dataset"]: s["queued"] for s in _enqueue(path, redis_server.url)} == {"a": 0, "b": 12}
    wait_until(lambda: len(store.keys("b")) == 12, 60, 0.2, f"b consumed\n{workers.logs()}")
    assert {rec.backend for rec in store.records("b")} == {"sglang"}  # the cloud worker keeps to --dataset a
    reports = {w["kind"]: w for w in map(json.loads, (r.get(k) for k in r.scan_iter(rk.worker_report("*"))))}
    assert reports["cloud"]["datasets"] == ["a"] and reports["gpu"]["datasets"] == ["a", "b"]

    # counted with the worker's next batch (tally.py): moments after the last is stored
    wait_until(lambda: {d.dataset: d for d in snapshot(before, r).datasets}["b"].responses == 12, 10, 0.1, "b counted")
    rows = {d.dataset: d for d in snapshot(before, r).datasets}
    assert rows["b"].responses == 12 and rows["b"].budget_tokens == 50_000
    res = run_cli("status", "--config", str(old), "--dataset", "b", "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    assert [d["dataset"] for d in json.loads(res.stdout)["datasets"]] == ["b"]

    def metrics() -> str:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

    wait_until(lambda: 'draftfleet_responses_total{backend="sglang",dataset="b"} 12.0' in metrics(), 30, 0.5,
               f"the reconciler's metrics to show b\n{workers.logs()}")
    assert 'draftfleet_budget_tokens{dataset="b"} 50000.0' in metrics()
    # and its periodic pass reconciles b too
    r.hincrby(rk.totals("b", "sglang"), "completion_tokens", 777)
    want = _tokens(store, "b")
    wait_until(lambda: int(r.hget(rk.totals("b", "sglang"), "completion_tokens")) == want, 30, 0.3,
               f"the reconciler to correct b\n{workers.logs()}")


def test_waiting_for_admission_holds_no_slot(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    """Dataset a's budget is all reserved by work in flight elsewhere: its tasks must wait (what
    is in flight may come back short), and while they do, the worker's slots serve dataset b."""
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:30", ttft_s=0.0)
    a = {"name": "a", "path": str(write_jsonl(tmp_path / "a.jsonl", _chat_rows(6, tag="a"))), "max_tokens": 64,
         "budget_tokens": 1000}
    b = {"name": "b", "path": str(write_jsonl(tmp_path / "b.jsonl", _chat_rows(12, tag="b"))), "max_tokens": 64}
    path = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=2, datasets=[a, b])
    store = open_store(load_config(path))
    r = redis_server.client()
    ledger = Ledger(r)
    _enqueue(path, redis_server.url)
    # another worker holds admitted work of a until all of a's budget is reserved: a's tasks must wait
    outside = []
    while True:
        key = f"{len(outside):064x}"
        r.set(rk.claim("a", key), "elsewhere@host:1:x")
        if ledger.admit("a", key, "elsewhere@host:1:x", 1000, 64).verdict == WAIT:
            r.delete(rk.claim("a", key))
            break
        outside.append(key)
    assert outside

    workers.start(path, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("b")) == 12, 60, 0.2, f"b done while a waits\n{workers.logs()}")
    assert not store.keys("a") and r.llen(rk.queue("a")) + r.hlen(rk.UNACKED) > 0

    for key in outside:  # the work elsewhere ends: a's tasks are admitted
        r.delete(rk.claim("a", key))
        ledger.release("a", key, "elsewhere@host:1:x")
    wait_until(lambda: len(store.keys("a")) == 6, 60, 0.2, f"a done\n{workers.logs()}")
    assert _tokens(store, "a") <= 1000 and not store.failures("a")
