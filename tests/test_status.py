"""``draftfleet status``: an ETA from the run's real age, readable at 80 columns and in a pipe."""

from __future__ import annotations

import io
import json
import time

import msgspec
import pytest
from rich.console import Console

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import WorkerReport
from draftfleet.store import open_store
from draftfleet.claims import worker_reports
from draftfleet.views.status import BackendRow, DatasetRow, Snapshot, SpendRow, WorkerRow, render, snapshot

from tests.conftest import run_cli, wait_until, write_config, write_jsonl
from tests.test_fleet import _chat_rows, _enqueue
from tests.test_inventory import _rec


def _config(tmp_path, tokenizer_dir, budget=100_000):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    return write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url="http://127.0.0.1:9",
                        datasets=[{"name": "ds", "path": str(data), "budget_tokens": budget},
                                  {"name": "other", "path": str(data)}])


def test_rate_and_eta_from_the_runs_real_age(tmp_path, redis_server, tokenizer_dir):
    """A run two minutes old: its rate is over two minutes (not ten), and its ETA ends when the
    prompts run out (5 left, 100 tokens each), long before the budget does."""
    cfg = load_config(_config(tmp_path, tokenizer_dir))
    r = redis_server.client()
    ledger = Ledger(r)
    now = time.time()
    for i in range(12):  # 1,200 tokens over the last 120 s
        assert ledger.count(_rec(i, [5] * 100), now=now - 120 + i * 10)
    for i in range(5):
        r.rpush(rk.queue("ds"), b"{}")
    report = WorkerReport(hostname="gpu-0", kind="gpu", backend="sglang", datasets=["ds"], at=now)  # a live worker
    r.set(rk.worker_report("gpu-0"), msgspec.json.encode(report), ex=60)
    d = snapshot(cfg, r, ["ds"]).datasets[0]
    assert 1200 / 131 <= d.tps_10m <= 1200 / 119  # the old 10-minute window said 2.0
    assert d.eta_s is not None and 500 / (1200 / 119) - 1 <= d.eta_s <= 500 / (1200 / 131) + 1
    assert not d.finished and not d.closed

    r.delete(rk.queue("ds"))  # every prompt has its outcome: finished, no ETA
    d = snapshot(cfg, r, ["ds"]).datasets[0]
    assert d.finished and d.eta_s is None
    r.rpush(rk.queue("ds"), b"{}")
    r.set(rk.closed("ds"), 1200)  # closed at its budget: no ETA, even with prompts queued
    d = snapshot(cfg, r, ["ds"]).datasets[0]
    assert d.closed and d.eta_s is None


def _crowded() -> Snapshot:
    backends = [BackendRow(backend="openrouter-kimi-k2.5", responses=1_234_567, completion_tokens=9_876_543_210,
                           cost_usd=123_456.78, tps_1m=12_345.6, tps_10m=98_765.4),
                BackendRow(backend="sglang", responses=99_999, completion_tokens=5_432_109, cost_usd=0.0,
                           tps_1m=4321.0, tps_10m=4000.0)]
    ds = DatasetRow(dataset="B3_magicoder_evol_instruct_110k_v2", assigned=["cloud", "gpu"], queue_depth=1_048_576,
                    held=12_345, inflight=256, responses=1_334_566, completion_tokens=9_881_975_319,
                    budget_tokens=10_000_000_000, share_done=0.9882, remaining_tokens=118_024_681, closed=False,
                    finished=False, tps_1m=16_666.6, tps_10m=102_765.4, eta_s=1148.0, backends=backends, retries=77_777,
                    failures=3)
    workers = [WorkerRow(hostname=f"sglang-30000@gpu-node-{i:03d}.cluster.example.org", kind="gpu", backend="sglang",
                         endpoint="http://10.20.30.40:30000", datasets=["B3_magicoder_evol_instruct_110k_v2"],
                         inflight=128, slots=128, paused=None, waiting="server http://10.20.30.40:30000" if i else None,
                         age_s=1.0) for i in range(2)]
    return Snapshot(at=time.time(), workers=workers, datasets=[ds],
                    spend=[SpendRow(backend="openrouter-kimi-k2.5", spent_usd=123_456.78, cap_usd=250_000.0)])


def test_render_fits_80_columns_without_cutting_numbers():
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=False, color_system=None).print(render(_crowded()))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    cells = set(text.split())
    for number in ("1.05M", "256", "1.33M", "9.88G", "10G", "99%", "103k", "19m08s", "1.23M", "12,346", "98,765",
                   "99,999", "5.43M", "4,321", "4,000", "123k", "250k", "77,777", "128/128"):
        assert number in cells, (number, text)
    assert "waiting for" in text and "(cloud,gpu)" in text


def test_status_cli_piped_and_for_one_dataset(tmp_path, redis_server, tokenizer_dir):
    config = _config(tmp_path, tokenizer_dir)
    ledger = Ledger(redis_server.client())
    for i in range(3):
        ledger.count(_rec(i, [5] * 123_456))
    env = {"REDIS_URL": redis_server.url}
    env_no_columns = {k: v for k, v in env.items()}
    res = run_cli("status", "--config", str(config), env=env_no_columns)  # stdout is a pipe
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout and max(len(x) for x in res.stdout.splitlines()) <= 80
    assert "370k" in res.stdout.split()
    res = run_cli("status", "--config", str(config), "--dataset", "other", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert [d["dataset"] for d in json.loads(res.stdout)["datasets"]] == ["other"]
    res = run_cli("status", "--config", str(config), "--dataset", "nope", env=env)
    assert res.returncode != 0 and "nope" in res.stderr
    assert msgspec.json.decode(run_cli("status", "--config", str(config), "--json", env=env).stdout)["datasets"]


@pytest.mark.slow
def test_in_flight_is_shown_within_a_second_not_at_the_next_heartbeat(tmp_path, redis_server, tokenizer_dir,
                                                                       emulator_factory, workers):
    """A GPU worker (production claim TTL: heartbeats 20 s apart) opens 64 requests of ~4 s: status
    shows 64 in flight about half a second (one poll) after the server holds them, and 0 as soon
    after the last one ends. Before, the count came only with the heartbeat: 0 for the first 20 s."""
    emu = emulator_factory(single_stream_tps=50, ceiling_tps=1_000_000, length="fixed:200", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(64))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=64,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 256}])
    cfg = load_config(config)
    r = redis_server.client()
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url, env={"DRAFTFLEET_CLAIM_TTL_S": "120"})
    wait_until(lambda: worker_reports(r), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)

    def shown_within(count: int, started: float) -> float:
        while True:
            snap = snapshot(cfg, r, ["ds"])
            if [w.inflight for w in snap.workers] == [count] and snap.datasets[0].inflight == count:
                return time.monotonic() - started
            assert time.monotonic() - started < 10, (count, snap.workers, workers.logs())
            time.sleep(0.05)

    wait_until(lambda: emu.stats()["open"] == 64, 30, 0.02, workers.logs())
    rise = shown_within(64, time.monotonic())
    store = open_store(cfg)
    wait_until(lambda: len(store.keys("ds")) == 64 and not list(r.scan_iter(rk.claim("ds", "*"))), 60, 0.02,
               workers.logs())
    fall = shown_within(0, time.monotonic())
    print(f"\nin flight shown {rise:.2f} s after the server held 64, 0 shown {fall:.2f} s after the last ended")
    assert rise <= 2.0 and fall <= 2.0  # one poll is 0.5 s; the heartbeat, 20 s (slack for a loaded machine)
    res = run_cli("status", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert [w["inflight"] for w in json.loads(res.stdout)["workers"]] == [0]
