"""The capture task: a stored record turn's exact ids through vLLM's hidden-state extraction, stored once.

``draftfleet capture`` queues one :class:`CaptureTask` per (record key, turn) that has no file in
the dataset's capture version (or per conversation, captured once over its last turn, where its
turns' ids prefix each other: ``hidden.conversation_spans``, checked again here from the record);
``draftfleet worker capture`` runs them against a vLLM server started with ``extract_hidden_states``
and the fleet's connector (``capture_engine.py``, ``vllm_connector.py``). The prompt sent is the
turn's stored prompt ids followed by its output ids, never text, with ``max_tokens`` 1: vLLM's
prefill computes the state of every one of those tokens, and the connector writes them (the one
generated token is thrown away), in the version's dtype (bf16, or fp8 with a scale per token).
The file is then checked and stored by descriptor (``capture_intake.py``): the states cross the
disk once, and the network once for a bucket.

The engine is never kept waiting for the worker: ``inflight`` requests are open at once (a
semaphore around the request only), and twice as many threads run units, so that reading the
record, rendering its prompt, checking, linking and counting one unit overlaps the engine's work
on the others. The worker waits for each file on the connector's lock (``flock``), not by polling.

Delivery is at-least-once, like generation: a message is acknowledged after the file is stored
(or the unit is recorded as failed, once, after ``max_attempts``: a file refused by the check or
changed after it fails that attempt); a redelivered copy finds the file and stops. While a unit is
captured its worker holds the unit's claim in Redis (``SET NX`` with a TTL its report loop keeps
refreshing); a copy that finds the claim taken is acknowledged, since the holder's own message
comes back if the holder dies. A worker killed mid-run leaves its unit without a file, never with
a half one, and its claims lapse: any live worker's recovery sweep (``recovery.py``, the same as
generation's) gives its messages back to the queue; the next ``draftfleet capture`` would too.
The engine file of a killed worker's unit is removed by a live worker's beat once it is linked
into the store (a second name of a stored file) or ``ORPHAN_S`` old.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import msgspec
import redis
from celery import Celery
from celery.exceptions import Reject

from draftfleet import redis_keys as rk
from draftfleet.claims import Claims
from draftfleet.hidden import (CONVERSATION, DTYPES, CaptureError, Spans, capture_settings, check_storage,
                               conversation_spans, open_hidden, record_units, storage_path)
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import CaptureManifest, CaptureTask, ResponseRecord, WorkerReport, turn_name
from draftfleet.store import Store, StoreError, check_key, check_name, open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.backends import Halt, Permanent, Transient, backoff_s
from draftfleet.workers.capture_engine import (INFRA_RETRY_S, SETTINGS_HALTS, EngineGate, capture_server, check_engine,
                                               connector_folder, engine_folder, remove_connector_folder)
from draftfleet.workers.capture_intake import (ORPHAN_S, CaptureClient, Captured, UnitStore, check_states,
                                               sweep_orphans, unit_metadata, wanted_contract)
from draftfleet.workers.consumer import dead_letter
from draftfleet.workers.engine import ServerDown

log = logging.getLogger("draftfleet.capture")


class CaptureRuntime:
    """Per-process state of a capture worker."""

    def __init__(self, cfg: FleetConfig, store: Store, r: redis.Redis, client: CaptureClient, tokenizer: TargetTokenizer,
                 hostname: str, layer_ids: list[int], model_sha: str, dtype: str = "bfloat16",
                 storage: Path | None = None):
        self.cfg, self.store, self.r, self.client, self.tokenizer = cfg, store, r, client, tokenizer
        self.hidden = open_hidden(store)
        self.hostname = hostname
        self.layer_ids = layer_ids
        self.model_sha = model_sha
        self.dtype = dtype  # the manifest's name of the states' dtype this worker's engine writes
        self.storage = storage  # where the engine writes its files (swept of a killed worker's)
        self.units = UnitStore(self.hidden, copy=cfg.capture.copy, store_location=store.location)
        self.gate = EngineGate()
        self._manifests: dict[tuple[str, int], CaptureManifest] = {}
        self.claims = Claims(r, hostname)
        self._stop = threading.Event()

    def acquire(self, task: CaptureTask) -> str | None:
        """Claim the unit; its token, or None when another copy holds it."""
        return self.claims.acquire(rk.capture_claim(task.dataset, task.unit), task.dataset)

    def release(self, task: CaptureTask, token: str) -> None:
        self.claims.release(rk.capture_claim(task.dataset, task.unit), task.dataset, token)

    def start_reports(self, datasets: list[str], slots: int) -> None:
        """Every HEARTBEAT_S until :meth:`stop`, and at once when Redis lost its state, as generation
        workers do (``Claims.beat_until``): refresh the claims held (set ``rk.STATE`` after them),
        publish this worker's report (``draftfleet status`` lists it; it has a TTL, so a killed
        worker drops out) and sweep for a dead worker's messages."""

        def beat() -> None:
            self.claims.beat(WorkerReport(hostname=self.hostname, kind="capture", backend="vllm",
                                          endpoint=self.client.endpoint, datasets=sorted(datasets),
                                          queues=[rk.capture_queue(d) for d in sorted(datasets)], slots=slots),
                             mark_state=True)
            if self.storage is not None:  # and remove what killed workers left in the engine's folder
                sweep_orphans(self.storage, ORPHAN_S)

        def loop() -> None:
            beat()
            self.claims.beat_until(self._stop, beat)

        threading.Thread(target=loop, name="draftfleet-capture-report", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.claims.withdraw()

    def manifest(self, dataset: str, version: int) -> CaptureManifest | None:
        k = (dataset, version)
        if k not in self._manifests:
            m = self.hidden.manifest(dataset, version)
            if m is None:
                return None
            self._manifests[k] = m
        return self._manifests[k]

_runtime: CaptureRuntime | None = None


def install(rt: CaptureRuntime) -> None:
    global _runtime
    _runtime = rt


def _queue(task_self) -> str:
    return (task_self.request.delivery_info or {}).get("routing_key", "?")


def _event(rt: CaptureRuntime, dataset: str, field: str, tokens: int = 0) -> None:
    try:
        with rt.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(rk.capture_progress(dataset), field, 1)
            if tokens:
                pipe.hincrby(rk.capture_progress(dataset), "captured_tokens", tokens)
            pipe.execute()
    except redis.RedisError:
        pass  # progress only: the store is the truth


def execute(task_self, payload: object) -> str:
    """Body of the Celery task; returns what happened (``stored``, ``duplicate``, ``failed``...)."""
    rt = _runtime
    assert rt is not None, "capture runtime not installed"
    queue = _queue(task_self)
    try:
        task = msgspec.convert(payload, CaptureTask)
        check_name(task.dataset)
        check_key(task.key)
    except (msgspec.ValidationError, StoreError) as exc:
        dead_letter(rt.r, queue=queue, reason=f"not a valid capture task: {exc}", body=payload, worker=rt.hostname)
        return "dead_letter"
    if queue != rk.capture_queue(task.dataset):
        dead_letter(rt.r, queue=queue, reason=f"a capture of {task.dataset!r} on queue {queue}", body=payload,
                    worker=rt.hostname)
        return "dead_letter"
    m = rt.manifest(task.dataset, task.version)
    if m is None:
        dead_letter(rt.r, queue=queue, reason=f"{task.dataset} has no capture version {task.version}", body=payload,
                    worker=rt.hostname)
        return "dead_letter"
    if m.layer_ids != rt.layer_ids or m.model_config_sha256 != rt.model_sha or m.dtype != rt.dtype:
        # Another worker's settings: leave it queued for a worker that captures with the version's.
        time.sleep(INFRA_RETRY_S)
        raise Reject(f"{task.dataset} v{task.version} is captured in {m.dtype} with layers {m.layer_ids} of another "
                     f"model, layers or dtype than this worker's ({rt.dtype}, {rt.layer_ids})", requeue=True)
    if rt.hidden.has(task.dataset, task.version, task.key, task.turn):
        return "duplicate"
    try:
        record = rt.store.get(task.dataset, task.key)
    except (FileNotFoundError, msgspec.DecodeError) as exc:
        dead_letter(rt.r, queue=queue, reason=f"no readable record {task.key}: {exc}", body=payload, worker=rt.hostname)
        return "dead_letter"
    unit = _unit_ids(rt, task, record)
    if isinstance(unit, str):
        dead_letter(rt.r, queue=queue, reason=unit, body=payload, worker=rt.hostname)
        return "dead_letter"
    ids, spans = unit
    token = rt.acquire(task)
    if token is None:
        return "claimed"  # another copy runs it; if its worker dies, its own message comes back
    try:
        if rt.hidden.has(task.dataset, task.version, task.key, task.turn):  # stored between our check and claim
            return "duplicate"
        return _capture(rt, task, m, ids, spans, record.source)
    finally:
        rt.release(task, token)


def _unit_ids(rt: CaptureRuntime, task: CaptureTask, record: ResponseRecord) -> tuple[list[int], Spans] | str:
    """The ids to send for the task's unit and its answers' spans in them; why not (a string) when the
    record has no such unit: then it is dead-lettered, never captured from a guess."""
    if task.turn == CONVERSATION:
        shared = conversation_spans(record)
        return shared if isinstance(shared, tuple) else (
            f"record {task.key} is no conversation to capture once ({shared}): draftfleet capture queues its turns")
    try:
        units = record_units(record, rt.tokenizer)
    except CaptureError as exc:
        return str(exc)
    if not 0 <= task.turn < len(units):
        return f"record {task.key} has no turn {task.turn}"
    ids, prompt_len = units[task.turn]
    return ids, [(prompt_len, len(ids))]


def _capture(rt: CaptureRuntime, task: CaptureTask, m: CaptureManifest, ids: list[int], spans: Spans,
             source: str) -> str:
    """Capture one unit with retries and store it; what happened (``stored``, ``duplicate``, ``failed``).

    An attempt is the engine's file, checked, then stored: a file the engine changed after the check
    (the upload refuses it) fails that attempt like a file refused by the check, so a unit whose
    engine keeps rewriting its files fails once, after ``max_attempts``, never goes round the queue."""
    got: Captured | None = None
    failure: Exception | None = None
    stored = False
    for attempt in range(1, rt.cfg.fleet.max_attempts + 1):
        probe = rt.gate.enter()
        try:
            got = None
            try:
                try:
                    got = rt.client.capture(ids)
                    check_states(ids, got, m)
                except BaseException:
                    if got is not None:  # refused: the engine's file goes
                        got.discard()
                    raise
            except (Halt, Permanent, Transient):
                raise
            except Exception as exc:  # a bug or an unforeseen file must not ack the unit away uncounted
                log.exception("capture %s/%s turn %s: unexpected error", task.dataset, task.key, turn_name(task.turn))
                raise Transient("internal", f"{type(exc).__name__}: {exc}") from None
            rt.gate.done(probe, right=True)
        except Halt as exc:  # the server, not the unit: back to the queue for when it is fixed
            if exc.reason in SETTINGS_HALTS:
                rt.gate.wrong(probe, exc)
                raise Reject(exc.reason, requeue=True) from None  # Celery logs each; the reason is said once
            rt.gate.done(probe, right=False)
            log.error("capture %s/%s turn %s: %s; the task goes back to its queue", task.dataset, task.key,
                      turn_name(task.turn), exc)
            time.sleep(INFRA_RETRY_S)
            raise Reject(str(exc), requeue=True) from None
        except Permanent as exc:
            rt.gate.done(probe, right=got is not None)
            failure = exc
            break
        except ServerDown as exc:  # the engine died or went away, not the unit: pause, as for a wrong engine
            rt.gate.wrong(probe, exc)
            raise Reject(exc.reason, requeue=True) from None
        except Transient as exc:
            rt.gate.done(probe, right=got is not None)
            failure = exc
            _before_retry(rt, task, attempt, exc)
            continue
        except BaseException:  # a shutdown: the probe's turn goes to another thread
            rt.gate.done(probe, right=False)
            raise
        assert got is not None and got.contract is not None
        try:
            stored, failure = rt.units.store(task, got, unit_metadata(task, m, spans, got.contract)), None
            break
        except Permanent as exc:
            failure = exc
            break
        except Transient as exc:
            failure = exc
            _before_retry(rt, task, attempt, exc)
        finally:
            got.discard()
    if failure is not None:
        _event(rt, task.dataset, "failed")
        log.error("capture %s/%s turn %s failed: %s (a later draftfleet capture queues it again)", task.dataset,
                  task.key, turn_name(task.turn), failure)
        return "failed"
    if not stored:
        return "duplicate"
    _event(rt, task.dataset, "captured", len(ids))
    log.info("captured %s %s turn %s: %d tokens", task.dataset, source, turn_name(task.turn), len(ids))
    return "stored"


def _before_retry(rt: CaptureRuntime, task: CaptureTask, attempt: int, exc: Transient) -> None:
    """Say why an attempt failed and wait out its backoff, unless it was the last."""
    if attempt < rt.cfg.fleet.max_attempts:
        delay = backoff_s(attempt, exc.retry_after)
        log.warning("capture %s/%s turn %s: %s; retry %d in %.1fs", task.dataset, task.key, turn_name(task.turn),
                    exc, attempt, delay)
        time.sleep(delay)


def register(app: Celery) -> None:
    """Register the capture task on ``app`` (acks late; a lost worker's message goes back to the queue)."""

    @app.task(name=rk.CAPTURE_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def capture(self, *args, **kwargs):
        try:
            if len(args) != 1 or kwargs:
                dead_letter(_runtime.r, queue=_queue(self), reason="not a valid capture task: expected one argument",
                            body=[list(args), kwargs], worker=_runtime.hostname)
                return "dead_letter"
            return execute(self, args[0])
        except (redis.RedisError, OSError, StoreError) as exc:
            log.error("%s: %s: %s; the task goes back to its queue in %.0fs", _queue(self), type(exc).__name__, exc,
                      INFRA_RETRY_S)
            time.sleep(INFRA_RETRY_S)
            raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from None


def run_capture_worker(cfg: FleetConfig, *, url: str | None = None, gpus: list[int] | None = None,
                       slots: int | None = None, datasets: list[str] | None = None, redis_url: str | None = None,
                       name: str | None = None, loglevel: str = "INFO", ready_timeout_s: float = 600.0) -> None:
    """Run a capture worker in the foreground until it is stopped (SIGTERM: warm shutdown)."""
    import socket

    from draftfleet.broker import connect, redact, resolve_redis_url
    from draftfleet.schemas.config import ConfigError
    from draftfleet.workers.app import make_app
    from draftfleet.workers.launcher import port_for
    from draftfleet.workers.worker import announce_waiting, refuse_duplicate_name, setup_logging, worker_datasets

    setup_logging(loglevel)
    if cfg.vllm is None:
        raise ConfigError(f"{cfg.path}: a capture worker needs a [backends.vllm] table (hidden states come from vLLM)")
    model, layer_ids = capture_settings(cfg)
    broker_url = resolve_redis_url(redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    names = worker_datasets(cfg, datasets)
    if gpus is None and url is None:
        raise ConfigError("a capture worker needs --url URL (a vLLM server started for capture) or --gpu N")
    if gpus is not None and cfg.vllm.launch is None:
        raise ConfigError(f"{cfg.path}: --gpu needs [backends.vllm.launch] (model_path, port_base)")
    label = f"capture-gpu{'-'.join(map(str, gpus))}" if gpus is not None else f"capture-{url.rsplit(':', 1)[-1].strip('/')}"
    hostname = f"{name or label}@{socket.gethostname()}"
    r = connect(broker_url)
    refuse_duplicate_name(r, hostname)
    tokenizer = TargetTokenizer.from_config(cfg.fleet)
    store = open_store(cfg)
    store.prepare()
    check_storage(cfg, Path(storage_path(cfg)))  # the engine's files are linked into the store (or uploaded)
    server = client = rt = connector = None
    stop_waiting = announce_waiting(r, hostname, "capture", "vllm", redact(url) if url else f"GPU {gpus}", names,
                                    f"vLLM at {redact(url)}" if url else f"vLLM to start on GPU(s) {gpus}")
    try:
        if gpus is not None:
            launch = cfg.vllm.launch
            storage = engine_folder(cfg, label)
            connector = connector_folder()
            server = capture_server(launch, gpus, port_for(launch, gpus), layer_ids, str(storage), connector,
                                    dtype=cfg.capture.dtype)
            server.start(wait=True)
            server.supervise()
            url = server.url
        else:
            storage = Path(storage_path(cfg))
        n = slots or cfg.capture.inflight
        client = CaptureClient(url, cfg.vllm, tokenizer, inflight=n, storage=storage)
        client.process = server  # its exit and log go into what the worker says of a dead engine
        log.info("waiting for vLLM at %s", redact(url))
        client.wait_ready(ready_timeout_s)
        check_engine(client, wanted_contract(model=model, layer_ids=layer_ids, dtype=DTYPES[cfg.capture.dtype]))
        app = make_app(broker_url, cfg.fleet.visibility_timeout_s)
        app.conf.worker_consumer = "draftfleet.workers.consumer:Consumer"
        app.conf.broker_transport = "draftfleet.workers.consumer:Transport"
        register(app)
        rt = CaptureRuntime(cfg, store, r, client, tokenizer, hostname, layer_ids, model.config_sha256,
                            DTYPES[cfg.capture.dtype], storage)
        install(rt)
        stop_waiting()
        rt.start_reports(names, n)
        queues = [rk.capture_queue(d) for d in names]
        log.info("capture worker %s: layers %s in %s, %d in flight, queues %s", hostname, layer_ids, cfg.capture.dtype,
                 n, ",".join(queues))
        # twice as many threads as engine slots: one unit's record, check and link while n are in the engine
        app.worker_main(["worker", "-P", "threads", "-c", str(2 * n), "-Q", ",".join(queues), "-n", hostname,
                         "-l", loglevel.upper(), "-E", "--without-gossip", "--without-mingle"])
    finally:
        stop_waiting()
        if rt is not None:
            rt.stop()
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if connector is not None:
            remove_connector_folder(connector)
        sys.stdout.flush()
