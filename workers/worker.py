"""Starting a worker process: pick the backend, load the tokenizer, run Celery's threads pool.

One GPU worker per engine server, SGLang or vLLM (attached by URL, or launched here for one GPU
or TP group); any number of cloud workers per API. Concurrency is the number of requests kept in
flight: one Celery thread each, sharing one pooled HTTP client sized to match.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.broker import check_version, connect, redact, resolve_redis_url
from draftfleet.schemas.config import ENGINE_LABELS, ConfigError, Engine, FleetConfig
from draftfleet.schemas.records import WorkerReport
from draftfleet.store import open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.app import make_app
from draftfleet.workers.backends import Backend
from draftfleet.workers.cloud import CloudChat
from draftfleet.workers.engine import EngineClient
from draftfleet.workers.sglang import SGLangClient
from draftfleet.workers.runtime import Runtime
from draftfleet.workers.tasks import install, register
from draftfleet.workers.vllm import VLLMClient

log = logging.getLogger("draftfleet.worker")

ENGINE_CLIENTS: dict[Engine, type[EngineClient]] = {"sglang": SGLangClient, "vllm": VLLMClient}


class _CeleryTaskLines(logging.Filter):
    """Celery's per-task lines, reshaped for a fleet that logs its own line per prompt.

    The "received" and "succeeded" lines repeat the task's (long) argument and say nothing the
    worker's own ``stored ...`` line does not: they are kept only at DEBUG. A rejected task is a
    pause or a requeue (the task goes back to its queue), which Celery logs as a WARNING with a
    traceback: it is kept as one INFO line without it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from celery.app import trace

        if record.msg in (trace.LOG_RECEIVED, trace.LOG_SUCCESS):
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        if record.msg == trace.LOG_REJECTED:
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    # httpx logs every request at INFO: too loud for thousands of requests a minute.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    quiet = _CeleryTaskLines()
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).addFilter(quiet)


def cloud_api_key(cfg: FleetConfig, name: str) -> str:
    env = cfg.cloud(name).api_key_env
    key = os.environ.get(env, "")
    if not key:
        raise ConfigError(f"backend {name!r}: the environment variable {env} is not set (it must hold the API key)")
    return key


def worker_datasets(cfg: FleetConfig, datasets: Sequence[str] | None) -> list[str]:
    names = list(datasets) if datasets else [d.name for d in cfg.datasets]
    for n in names:
        cfg.dataset(n)
    if not names:
        raise ConfigError(f"{cfg.path}: no datasets to consume")
    return names


def refuse_duplicate_name(r, hostname: str) -> None:
    """Two live workers with one name would share a Celery identity and a status report."""
    raw = r.get(rk.worker_report(hostname))
    if raw is None:
        return
    pid = msgspec.json.decode(raw).get("pid")
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError, PermissionError):
        return  # a report left by a worker that is gone
    raise ConfigError(f"a worker named {hostname} is already running (pid {pid}): give this one --name")


def announce_waiting(r, hostname: str, kind: str, backend: str, endpoint: str, datasets: list[str],
                     what: str, every_s: float = 5.0) -> Callable[[], None]:
    """Publish this worker's report as ``waiting`` for ``what`` until the returned function is called.

    A GPU worker waits minutes for its server (a large model loads for 10-30): ``status`` shows it
    waiting instead of not at all. The report has a TTL, so a worker that dies waiting drops out.
    """
    stop = threading.Event()

    def publish() -> None:
        report = WorkerReport(hostname=hostname, kind=kind, backend=backend, endpoint=endpoint,
                              datasets=sorted(datasets), waiting=what, pid=os.getpid(), at=time.time())
        try:
            r.set(rk.worker_report(hostname), msgspec.json.encode(report), ex=int(3 * every_s))
        except redis.RedisError as exc:
            log.warning("cannot publish the waiting report: %s", exc)

    def loop() -> None:
        while not stop.wait(every_s):
            publish()

    publish()
    thread = threading.Thread(target=loop, name="draftfleet-waiting", daemon=True)
    thread.start()

    def done() -> None:
        stop.set()
        thread.join()

    return done


def run_worker(
    cfg: FleetConfig,
    kind: str,
    *,
    backend_name: str | None = None,
    engine: Engine | None = None,
    url: str | None = None,
    gpus: list[int] | None = None,
    slots: int | None = None,
    datasets: Sequence[str] | None = None,
    redis_url: str | None = None,
    name: str | None = None,
    loglevel: str = "INFO",
    ready_timeout_s: float = 600.0,
) -> None:
    """Run a worker in the foreground until it is stopped (SIGTERM: warm shutdown)."""
    setup_logging(loglevel)
    names = worker_datasets(cfg, datasets)
    if kind == "gpu":
        engine, settings = cfg.engine(engine)
        if gpus is not None and settings.launch is None:
            raise ConfigError(f"{cfg.path}: --gpu needs [backends.{engine}.launch] (model_path, tp, port_base)")
        if gpus is None and url is None:
            if not settings.urls:
                raise ConfigError(f"{cfg.path}: backends.{engine}.urls is empty: pass --url or --gpu")
            url = settings.urls[0]
        label = f"gpu{'-'.join(map(str, gpus))}" if gpus is not None else f"{engine}-{url.rsplit(':', 1)[-1].strip('/')}"
    elif kind == "cloud":
        if not backend_name:
            if len(cfg.clouds) != 1:  # the only cloud backend needs no naming
                raise ConfigError(f"{cfg.path}: a cloud worker needs --backend NAME, one of: "
                                  + (", ".join(sorted(cfg.clouds)) or "none configured ([backends.NAME] with base_url)"))
            backend_name = next(iter(cfg.clouds))
        cfg.cloud(backend_name)
        label = f"cloud-{backend_name}"
    else:
        raise ConfigError(f"unknown worker kind {kind!r}")
    # Only once the settings are known good: a worker refused for its config starts no Redis.
    broker_url = resolve_redis_url(redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    hostname = f"{name or label}@{socket.gethostname()}"
    r = connect(broker_url)
    check_version(r)
    refuse_duplicate_name(r, hostname)
    tokenizer = TargetTokenizer.from_config(cfg.fleet)

    server = None
    backend: Backend | None = None
    try:
        if kind == "gpu":
            shown = ENGINE_LABELS[engine]
            stop_waiting = announce_waiting(r, hostname, kind, engine, redact(url) if url else f"GPU {gpus}", names,
                                            f"{shown} at {redact(url)}" if url else f"{shown} to start on GPU(s) {gpus}")
            if gpus is not None:
                from draftfleet.workers.launcher import EngineServer, port_for

                server = EngineServer(settings.launch, gpus, port=port_for(settings.launch, gpus))
                server.start(wait=True)
                server.supervise()
                url = server.url
            n = slots or settings.inflight
            backend = ENGINE_CLIENTS[engine](url, settings, tokenizer, inflight=n)
            backend.process = server  # its exit and log go into the pause's reason
            log.info("waiting for %s at %s", shown, redact(url))
            backend.wait_ready(ready_timeout_s)
            stop_waiting()
            pause_s = 30.0
        else:
            cb = cfg.cloud(backend_name)
            n = slots or cb.concurrency
            backend = CloudChat(backend_name, cb, tokenizer, cloud_api_key(cfg, backend_name))
            pause_s = cb.pause_s
        app = make_app(broker_url, cfg.fleet.visibility_timeout_s)
        # Poison messages go to the dead-letter list, and a Redis outage never ends the worker (consumer.py).
        app.conf.worker_consumer = "draftfleet.workers.consumer:Consumer"
        app.conf.broker_transport = "draftfleet.workers.consumer:Transport"
        register(app)
        store = open_store(cfg)
        store.prepare()
        # Without --dataset a worker follows every dataset, also those enqueued while it runs.
        rt = Runtime(app, cfg, store, r, backend, hostname, names, pause_s, follow_all=not datasets)
        install(rt)
        rt.start()
        if server is not None:
            # The supervisor gave up restarting the engine: stop consuming rather than burn retries.
            server.on_give_up = lambda reason: rt.pause(f"{engine}_gave_up", reason)
        queues = rt.initial_queues()
        log.info("%s worker %s: %d in flight, queues %s, broker %s", kind, hostname, n, ",".join(queues),
                 redact(broker_url))
        try:
            app.worker_main([
                "worker", "-P", "threads", "-c", str(n), "-Q", ",".join(queues), "-n", hostname,
                "-l", loglevel.upper(), "-E", "--without-gossip", "--without-mingle",
            ])
        finally:
            rt.stop()
    finally:
        if backend is not None:
            backend.close()
        if server is not None:
            server.stop()

def run_gpu_workers(config_path: str, groups: list[list[int]], argv_tail: list[str]) -> int:
    """One ``worker gpu --gpu G`` process per GPU group (the default: one engine server per GPU).

    Children are independent workers; SIGTERM/SIGINT here is passed on to each (warm shutdown),
    and a child that exits is reported, not restarted (its engine supervisor already restarts the
    server; a crashing worker needs a person).
    """
    import signal
    import subprocess
    import sys

    procs = []
    for g in groups:
        cmd = [sys.executable, "-m", "draftfleet", "worker", "gpu", "--config", config_path,
               "--gpu", ",".join(map(str, g)), *argv_tail]
        # Its own process group: a terminal's Ctrl-C reaches only this process, which passes it on
        # once (a child that got it from both would take the second for Celery's cold shutdown).
        procs.append(subprocess.Popen(cmd, process_group=0))
        log.info("started the worker for GPU(s) %s (pid %d)", ",".join(map(str, g)), procs[-1].pid)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    for g, code in zip(groups, codes):
        if code:
            log.error("the worker for GPU(s) %s exited with %d", ",".join(map(str, g)), code)
    return max(codes, default=0)
