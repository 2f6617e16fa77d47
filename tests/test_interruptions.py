"""An operator's interruptions mid-run (issue 14): two Ctrl-C, and a FLUSHALL followed by enqueue.

Real ``draftfleet worker`` subprocesses against the emulator, a private Redis, the real CLI. Each
test ends on the fault suite's ``assert_exactly_once``.
"""

from __future__ import annotations

import signal
import time

import pytest

from draftfleet import redis_keys as rk

from .conftest import wait_until
from .test_faults import _events, _setup, _start, _workers_up, assert_exactly_once
from .test_fleet import KEY_ENV, _enqueue

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["gpu", "cloud"])
def test_two_ctrl_c_mid_run_give_the_work_back_never_fail_it(kind, tmp_path, redis_server, tokenizer_dir,
                                                             emulator_factory, workers):
    # 8 s an answer: 16 requests are open when both signals arrive
    emu = emulator_factory(single_stream_tps=20, ceiling_tps=100000, length="fixed:160", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 40, inflight=16, concurrency=16, max_tokens=256)
    r = redis_server.client()
    victim = _start(workers, config, kind, "victim", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: emu.stats()["open"] >= 16, 30, 0.05, f"16 requests open\n{workers.logs()}")
    victim.send_signal(signal.SIGINT)  # warm shutdown; Celery then invites a second Ctrl-C for a cold one
    wait_until(lambda: "Warm shutdown" in workers.logs(tail=None), 10, 0.05, workers.logs())
    time.sleep(1.0)  # an operator's pause: the worker is waiting for its running tasks by now
    victim.send_signal(signal.SIGINT)
    victim.wait(60)
    assert len(store.keys("ds")) < 40
    failed = {k: v for k, v in _events(r, "ds").items() if k.startswith("failed:")}
    assert not failed and not store.failures("ds"), (failed, workers.logs())

    _start(workers, config, kind, "survivor", redis_server.url, emu.url)
    wait_until(lambda: len(store.keys("ds")) == 40, 90, 0.2, f"40 results\n{workers.logs()}")
    assert_exactly_once(store, r, "ds", 40)
    assert not any(k.startswith("failed:") for k in _events(r, "ds"))


def test_flushall_then_enqueue_resends_nothing_running_workers_hold(tmp_path, redis_server, tokenizer_dir,
                                                                   emulator_factory, workers):
    # 5 s an answer: 16 requests are still open when the enqueue after the flush reads Redis
    emu = emulator_factory(single_stream_tps=20, ceiling_tps=100000, length="fixed:100", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 64, inflight=16, concurrency=16, max_tokens=128)
    r = redis_server.client()
    # the production claim TTL (120 s): heartbeats 20 s apart, far longer than an enqueue takes
    workers.start(config, "gpu", "--url", emu.url, "--name", "gpu", redis_url=redis_server.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) >= 16 and emu.stats()["open"] >= 16, 60, 0.05, workers.logs())
    r.flushall()  # queues, unacked messages, claims and counters: all gone
    summary = _enqueue(config, redis_server.url)[0]

    wait_until(lambda: len(store.keys("ds")) == 64, 90, 0.2, f"64 results\n{workers.logs()}")
    wait_until(lambda: emu.stats()["open"] == 0 and not r.llen(rk.queue("ds")), 60, 0.2, "every copy to run")
    generated = emu.stats()["by_endpoint"].get("/generate", 0)
    assert generated == 64, f"{generated - 64} prompts generated twice"
    # what running workers held was counted as in flight, not sent again
    assert summary["queued"] + summary["already_done"] + summary["in_flight"] == 64, summary
    assert summary["in_flight"] >= 1, summary
    # the counters lost with Redis come back from the store
    from .conftest import run_cli

    res = run_cli("reconcile", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    assert_exactly_once(store, r, "ds", 64)


def test_one_ctrl_c_on_a_multi_gpu_worker_is_one_warm_shutdown_of_each_child(tmp_path, redis_server, tokenizer_dir):
    """A terminal's Ctrl-C reaches its whole foreground job: ``worker gpu --gpu 0,1`` passes it on
    to its children, which must not get it twice (a second SIGINT is Celery's cold shutdown)."""
    import os
    import subprocess
    import sys

    from .conftest import REPO
    from .test_gpu_launch import _fake_sglang_fleet

    config, launch_env = _fake_sglang_fleet(tmp_path, tokenizer_dir, 4, "inflight = 4")[:2]
    env = {"REDIS_URL": redis_server.url, "PATH": "/usr/bin:/bin", **launch_env}
    log_path = tmp_path / "workers.log"
    with open(log_path, "wb") as log:
        # its own process group, as a shell runs a job: the test can signal the whole job at once
        parent = subprocess.Popen([sys.executable, "-m", "draftfleet", "worker", "gpu", "--config", str(config),
                                   "--gpu", "0,1"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  start_new_session=True)
    try:
        r = redis_server.client()
        logs = lambda: log_path.read_text(errors="replace")  # noqa: E731
        wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2 and logs().count(" ready.") == 2,
                   90, 0.2, f"two workers\n{logs()[-3000:]}")
        os.killpg(parent.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert parent.wait(60) == 0, logs()[-3000:]
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    text = logs()
    assert text.count("Warm shutdown (MainProcess)") == 2, text[-3000:]
    assert "Cold shutdown" not in text, text[-3000:]
