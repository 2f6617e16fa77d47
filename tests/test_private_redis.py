"""The store's private Redis on a first day: a command that fails leaves it as it found it (checked by
the server's pid), ``status`` says who keeps it up, and every command waits while it loads a large
append-only file instead of failing with LOADING."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from draftfleet import redis_keys as rk
from draftfleet.broker import STATE_DIR

from .conftest import REPO, wait_until, write_config, write_jsonl

pytestmark = pytest.mark.slow


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``draftfleet ...`` with no REDIS_URL: every command of the store uses its private Redis."""
    base = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "draftfleet", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=timeout, cwd=REPO)


def server_pids(state: Path) -> list[int]:
    """Every redis-server the store's folder has seen start, from its log (``pid=N, just started``)."""
    log = state / "redis.log"
    return [int(p) for p in re.findall(r"pid=(\d+), just started", log.read_text())] if log.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def fleet(tmp_path: Path, tokenizer_dir: Path, **kw) -> Path:
    data = write_jsonl(tmp_path / "data" / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    return write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(data)}], **kw)


def test_a_worker_refused_for_its_config_leaves_no_redis_running(tmp_path, tokenizer_dir):
    config = fleet(tmp_path, tokenizer_dir)  # no [backends.sglang]
    res = cli("worker", "gpu", "--engine", "sglang", "--config", str(config))
    assert res.returncode == 2 and "no [backends.sglang] table" in res.stderr, res.stderr
    state = tmp_path / "store" / STATE_DIR
    assert [p for p in server_pids(state) if alive(p)] == []


def test_a_worker_that_fails_after_starting_redis_stops_it(tmp_path, tokenizer_dir, emulator_factory):
    emu = emulator_factory()
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{not json")
    config = fleet(tmp_path, broken, emulator_url=emu.url)
    res = cli("worker", "gpu", "--url", emu.url, "--config", str(config))
    assert res.returncode == 1, res.stderr
    state = tmp_path / "store" / STATE_DIR
    started = server_pids(state)
    assert started, "the worker did not get as far as starting the private Redis"
    assert [p for p in started if alive(p)] == [], f"redis-server {started} left running"
    assert not (state / "redis.url").exists()


def test_a_failing_command_leaves_a_redis_someone_else_uses(tmp_path, tokenizer_dir):
    config = fleet(tmp_path, tokenizer_dir)
    assert cli("redis", "start", "--config", str(config)).returncode == 0
    state = tmp_path / "store" / STATE_DIR
    [pid] = server_pids(state)
    try:
        res = cli("worker", "gpu", "--engine", "sglang", "--config", str(config))
        assert res.returncode == 2
        assert alive(pid)  # started by `redis start`, not by the failing command
    finally:
        cli("redis", "stop", "--config", str(config))


def test_status_says_who_keeps_the_private_redis_up(tmp_path, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory()
    config = fleet(tmp_path, tokenizer_dir, emulator_url=emu.url)
    state = tmp_path / "store" / STATE_DIR
    url = cli("redis", "url", "--show-password", "--config", str(config))
    assert url.returncode == 1  # not running yet
    res = cli("status", "--config", str(config), env={"COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "started for this command, stopped again as it exits" in res.stdout
    assert not [p for p in server_pids(state) if alive(p)]
    try:
        assert cli("redis", "start", "--config", str(config)).returncode == 0
        full = cli("redis", "url", "--show-password", "--config", str(config)).stdout.strip()
        proc = workers.start(config, "cloud", "--backend", "cloudy", redis_url=full,
                             env={"DRAFTFLEET_TEST_KEY": "k"})
        r = redis.Redis.from_url(full)
        wait_until(lambda: any(r.scan_iter(match=rk.worker_report("*"))), 60, what="the worker's report")
        res = cli("status", "--config", str(config), env={"COLUMNS": "250"})
        assert res.returncode == 0, res.stderr
        [line] = [x for x in res.stdout.splitlines() if x.startswith("private Redis")]
        pid = server_pids(state)[-1]
        assert f"private Redis (pid {pid}, {state})" in line
        assert re.search(rf"kept up by worker cloud-cloudy@\S+ \(pid {proc.pid}\)", line), line
        assert "until `draftfleet redis stop`" in line
        workers.stop(proc)
        res = cli("status", "--config", str(config), env={"COLUMNS": "250"})
        assert "no draftfleet process uses it; it stays up until `draftfleet redis stop`" in res.stdout
        assert alive(pid)  # the README's stop sequence ends with `redis stop`: until then it stays
    finally:
        cli("redis", "stop", "--config", str(config))


def large_aof(path: Path, commands: int = 400_000) -> None:
    """A real append-only file as Redis writes its log (RESP): many small writes into 100 hashes, as a
    fleet's counters and claims are (Redis serves INFO, and LOADING to the rest, every 1,024 of them)."""
    def resp(*args: bytes) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

    with open(path, "wb") as fh:
        fh.write(resp(b"SELECT", b"0"))
        for start in range(0, commands, 10_000):
            fh.write(b"".join(resp(b"HSET", b"bulk:%d" % (i % 100), b"f%d" % i, b"v")
                              for i in range(start, min(commands, start + 10_000))))


def test_every_command_waits_while_redis_loads_its_append_only_file(tmp_path, tokenizer_dir):
    config = fleet(tmp_path, tokenizer_dir)
    state = tmp_path / "store" / STATE_DIR
    assert cli("redis", "start", "--config", str(config)).returncode == 0
    assert cli("redis", "stop", "--config", str(config)).returncode == 0
    shutil.rmtree(state / "appendonlydir", ignore_errors=True)  # Redis 7's layout: the legacy file is read then
    large_aof(state / "appendonly.aof")
    assert (state / "appendonly.aof").stat().st_size > 10_000_000
    try:
        for command in (["status"], ["enqueue"]):
            started = time.monotonic()
            res = cli(*command, "--config", str(config), timeout=300)
            assert res.returncode == 0, res.stderr
            assert "is loading its data set into memory" in res.stderr, res.stderr
            assert re.search(r"Redis has loaded its data set \(waited \d+\.\d s\)", res.stderr)
            assert "cannot reach Redis" not in res.stderr
            assert time.monotonic() - started < 300
        log = (state / "redis.log").read_text()
        assert log.count("DB loaded from append only file") >= 2
        # `enqueue` leaves the private Redis up for the workers (as a worker does): the test stops it
        assert cli("redis", "stop", "--config", str(config)).stdout.strip() == "stopped"
        wait_until(lambda: not [p for p in server_pids(state) if alive(p)], 30, what="the redis-servers to exit")
    finally:
        for pid in (p for p in server_pids(state) if alive(p)):  # a failed run leaves none either
            os.kill(pid, signal.SIGKILL)
