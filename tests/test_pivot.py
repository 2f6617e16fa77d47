"""Operating the fleet (issue 4): status, drain, pivot mid-run, restarts after a pivot, metrics."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from draftfleet import redis_keys as rk
from draftfleet.assign import kinds_for
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store

from .conftest import free_port, run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _chat_rows, _enqueue

pytestmark = pytest.mark.slow


def _two_workers(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, n=120, **emu):
    emu_fields = dict(single_stream_tps=60, ceiling_tps=100000, length="uniform:10:40", ttft_s=0.0,
                      api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    emu_fields.update(emu)
    e = emulator_factory(**emu_fields)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(n))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=e.url, inflight=8, concurrency=4,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64, "budget_tokens": 10_000_000}])
    gpu = workers.start(config, "gpu", "--url", e.url, redis_url=redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2, 60, 0.1, workers.logs())
    return e, config, gpu


def test_pivot_mid_run_loses_nothing_and_gpu_takes_nothing_after(tmp_path, redis_server, tokenizer_dir,
                                                                 emulator_factory, workers):
    emu, config, gpu = _two_workers(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers)
    env = {"REDIS_URL": redis_server.url}
    _enqueue(config, redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) >= 20, 60, 0.1, workers.logs())

    res = run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "cloud", "--json", env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["drain"]["drained"] and out["drain"]["assignment"] == {"ds": ["cloud"]}
    gpu_requests_at_drain = emu.stats()["by_endpoint"].get("/generate", 0)
    gpu_records_at_drain = sum(1 for rec in store.records("ds") if rec.backend == "sglang")
    inv = out["inventory"][0]
    # the drained side's figures in the printed inventory are final; the cloud's keep growing
    gpu_split = [s for s in inv["by_source"] if s["backend"] == "sglang"]
    assert gpu_split[0]["responses"] == gpu_records_at_drain > 0

    wait_until(lambda: len(store.keys("ds")) == 120, 120, 0.2, f"120 results\n{workers.logs()}")
    records = list(store.records("ds"))
    assert len(records) == 120 and len(Counter(r.source for r in records)) == 120
    assert emu.stats()["by_endpoint"].get("/generate", 0) == gpu_requests_at_drain  # nothing after the drain
    assert sum(1 for rec in records if rec.backend == "sglang") == gpu_records_at_drain
    res = run_cli("inventory", "--config", str(config), "--json", env=env)
    inv = json.loads(res.stdout)[0]
    assert sum(s["responses"] for s in inv["by_source"]) == inv["responses"] == 120
    assert {s["backend"] for s in inv["by_source"]} == {"sglang", "cloudy"}

    # a GPU worker restarted after the pivot does not eat the pivoted queue
    workers.stop(gpu)
    _enqueue(config, redis_server.url)  # nothing missing: nothing queued
    r = redis_server.client()
    assert kinds_for(r, "ds") == {"cloud"}
    before = emu.stats()["by_endpoint"].get("/generate", 0)
    for row in _chat_rows(10, tag="late"):
        with open(tmp_path / "d.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:gpu*"))) + len(list(r.scan_iter("draftfleet:worker:sglang*"))) >= 1,
               60, 0.1, workers.logs())
    assert _enqueue(config, redis_server.url)[0]["queued"] == 10
    wait_until(lambda: len(store.keys("ds")) == 130, 60, 0.2, workers.logs())
    assert emu.stats()["by_endpoint"].get("/generate", 0) == before

    # and pivot --to gpu gives the queue back
    res = run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "gpu", "--json", env=env)
    assert json.loads(res.stdout)["drain"]["assignment"] == {"ds": ["gpu"]}
    for row in _chat_rows(5, tag="back"):
        with open(tmp_path / "d.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
    cloud_before = emu.stats()["by_endpoint"].get("/v1/chat/completions", 0)
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 135, 60, 0.2, workers.logs())
    assert emu.stats()["by_endpoint"].get("/v1/chat/completions", 0) == cloud_before


def test_drain_waits_for_started_work_and_status_reports(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                         workers):
    emu, config, _ = _two_workers(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, n=60,
                                  single_stream_tps=30)
    env = {"REDIS_URL": redis_server.url}
    _enqueue(config, redis_server.url)
    wait_until(lambda: emu.stats()["running"] >= 4, 30, 0.05)

    t0 = time.monotonic()
    res = run_cli("status", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    kinds = sorted(w["kind"] for w in snap["workers"])
    assert kinds == ["cloud", "gpu"]
    ds = snap["datasets"][0]
    assert ds["dataset"] == "ds" and ds["queue_depth"] + ds["inflight"] + ds["responses"] <= 60
    assert ds["budget_tokens"] == 10_000_000 and snap["spend"][0]["backend"] == "cloudy"
    assert time.monotonic() - t0 < 10  # a subprocess, imports included

    res = run_cli("drain", "--config", str(config), "--kind", "gpu", "--json", env=env)
    assert res.returncode == 0, res.stderr
    drained = json.loads(res.stdout)["drain"]
    assert drained["drained"] and drained["assignment"] == {"ds": ["cloud"]}
    r = redis_server.client()
    holders = [v.decode() for k in r.scan_iter(rk.claim("ds", "*")) if (v := r.get(k))]
    assert not [h for h in holders if h.startswith("sglang")]
    res = run_cli("status", "--config", str(config), env=env)
    assert "cloud" in res.stdout and "ds" in res.stdout


def test_reconciler_worker_serves_metrics(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(time_scale=0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(10))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    _enqueue(config, redis_server.url)
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) == 10, 60, 0.2, workers.logs())
    r = redis_server.client()
    r.hincrby(rk.totals("ds", "sglang"), "completion_tokens", 999)  # drift for the periodic task to fix
    port = free_port()
    workers.start(config, "reconciler", "--interval", "1", "--metrics-port", str(port), redis_url=redis_server.url)

    def fixed() -> bool:
        total = sum(rec.completion_tokens for rec in store.records("ds"))
        return int(r.hget(rk.totals("ds", "sglang"), "completion_tokens")) == total

    wait_until(fixed, 60, 0.3, f"the periodic reconcile\n{workers.logs()}")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'draftfleet_queue_depth{dataset="ds"} 0.0' in text
    assert 'draftfleet_responses_total{backend="sglang",dataset="ds"} 10.0' in text
