"""The one task: generate a prompt, store it once, count it once.

Delivery semantics. A message is acknowledged only after its result is stored (or its failure
recorded), so a lost worker costs a redelivery. Redelivered copies are harmless: the store is
checked first, a claim in Redis (``SET NX`` with a TTL the holder keeps refreshing) keeps a twin
from generating the same key at the same time, and the store's write-once ``link`` plus the
ledger's counted set make sure one result is stored and counted once. Every HTTP call has its
own timeout, all well below the visibility timeout (the threads pool has no task time limits).
A dead worker's messages come back once its claims lapse (``recovery.py``, run by every live
worker's heartbeat), not only after the visibility timeout. A task that meets an error of Redis
or of the store outside its own retries goes back to its queue: it is never acknowledged as done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import redis
from celery import Celery
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

from draftfleet import redis_keys as rk
from draftfleet.assign import assigned, published
from draftfleet.claims import Claims
from draftfleet.conversation import answers, conversation_record, history, runs, single_record
from draftfleet.identity import task_problem
from draftfleet.ledger import ADMITTED, LOST, REFUSED, WAIT, Ledger
from draftfleet.reconcile import ensure_counters
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import (ChargeRecord, FailureRecord, GenerationSettings, PromptTask, ResponseRecord,
                                        Turn, TurnProgress, WorkerReport)
from draftfleet.store import Store, StoreError, check_key, check_name, new_charge_id
from draftfleet.workers.backends import Backend, BackendError, Generation, Halt, Permanent, Transient, backoff_s
from draftfleet.workers.consumer import dead_letter
from draftfleet.workers.engine import EngineClient, ServerDown

log = logging.getLogger("draftfleet.worker")

ASSIGNMENT_POLL_S = 1.0
ADMISSION_WAIT_S = 1.0
IDLE_QUEUE = rk.QUEUE_PREFIX + "_idle"
STORE_ATTEMPTS = 8
INFRA_RETRY_S = 5.0


class Runtime:
    """Per-process worker state: the backend, the store, Redis, its claims and its queues."""

    def __init__(self, app: Celery, cfg: FleetConfig, store: Store, r: redis.Redis, backend: Backend,
                 hostname: str, datasets: list[str], pause_s: float, follow_all: bool = False):
        self.app = app
        self.cfg = cfg
        self.store = store
        self.r = r
        self.ledger = Ledger(r)
        self.backend = backend
        self.kind = backend.kind
        self.hostname = hostname
        self.datasets = datasets
        self.pause_s = pause_s
        self.claims = Claims(r, hostname)
        self._lock = threading.Lock()
        self.paused: str | None = None
        self._stop = threading.Event()
        self.follow_all = follow_all  # started without --dataset: follows every dataset enqueued
        self.budgets: dict[str, int | None] = {d.name: d.budget_tokens for d in cfg.datasets}
        self.held: dict[str, float] = {}  # dataset -> when this worker takes its tasks again
        self.allowed: set[str] = set()
        self.refresh()
        self.consuming: set[str] = {rk.queue(d) for d in self.allowed}
        self._consumer = None
        self.spend_cap = cfg.clouds[backend.name].max_spend_usd if backend.kind == "cloud" else None
        self._settings: dict[str, list[GenerationSettings]] = {}

    def refuse(self, task: PromptTask, queue: str) -> str | None:
        """Why this worker must not run ``task`` at all (dead-lettered, never requeued): a dataset
        it does not know, a task on another dataset's queue, or content that does not give its key
        under the dataset's settings (its manifest's, or the config's before the first enqueue)."""
        if task.dataset not in self.datasets:
            return f"unknown dataset {task.dataset!r}: this worker runs {', '.join(self.datasets)}"
        if queue != rk.queue(task.dataset):
            return f"a task of dataset {task.dataset!r} on queue {queue}"
        problem = task_problem(task, self._dataset_settings(task.dataset))
        if problem is not None:  # a --new-version enqueue may have changed the manifest since
            problem = task_problem(task, self._dataset_settings(task.dataset, reread=True))
        return None if problem is None else f"forged or stale task: {problem}"

    def _dataset_settings(self, dataset: str, reread: bool = False) -> list[GenerationSettings]:
        if reread or dataset not in self._settings:
            manifest = self.store.manifest(dataset)
            configured = [d.settings(self.cfg.fleet.model) for d in self.cfg.datasets if d.name == dataset]
            self._settings[dataset] = [manifest.settings, *manifest.previous] if manifest is not None else configured
        return self._settings[dataset]

    def initial_queues(self) -> list[str]:
        """The ``-Q`` list: assigned queues, or an idle queue so the worker can start and wait."""
        return sorted(self.consuming) or [IDLE_QUEUE]

    # -- claims and heartbeat --------------------------------------------------------------
    def acquire(self, task: PromptTask) -> str | None:
        """Claim the task's key; returns the claim's token (one per task), None if a twin holds it."""
        return self.claims.acquire(rk.claim(task.dataset, task.key), task.dataset)

    def release(self, task: PromptTask, token: str) -> None:
        self.claims.release(rk.claim(task.dataset, task.key), task.dataset, token)

    def _beat(self) -> None:
        """A heartbeat every HEARTBEAT_S, at once when Redis lost its state (``Claims.beat_until``)."""
        self.claims.beat_until(self._stop, self.heartbeat)

    def heartbeat(self) -> None:
        """Refresh held claims and publish this worker's report (read by ``draftfleet status``)."""
        self.claims.beat(WorkerReport(
            hostname=self.hostname, kind=self.backend.kind, backend=self.backend.name, endpoint=self.backend.endpoint,
            datasets=sorted(self.allowed), follows=sorted(self.datasets), queues=sorted(self.consuming),
            slots=self.backend.concurrency,
            paused=self.paused,
        ), mark_state=True)

    def start(self) -> None:
        self.heartbeat()
        threading.Thread(target=self._beat, name="draftfleet-heartbeat", daemon=True).start()

    def attach(self, consumer) -> None:
        """Called once Celery's consumer is ready: from now on the assignment steers it."""
        self._consumer = consumer
        threading.Thread(target=self._watch, name="draftfleet-assignment", daemon=True).start()

    @property
    def stopping(self) -> bool:
        """Shutting down: what the worker's tasks cannot finish goes back to the queue, never fails."""
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.claims.withdraw()

    # -- consuming: assignment and pauses --------------------------------------------------
    def refresh(self) -> None:
        """Read the live dataset settings (assign.py): the datasets followed, their budgets, and
        which of them this kind may consume now. Nothing needs a restart."""
        live = published(self.r)
        if self.follow_all:
            for name in sorted(live.keys() - set(self.datasets)):
                log.warning("following dataset %s (enqueued while this worker runs)", name)
                self.datasets = [*self.datasets, name]
        for name in self.datasets:
            if name in live:
                self.budgets[name] = live[name].budget_tokens
        self.allowed = assigned(self.r, self.datasets, self.kind)

    def _watch(self) -> None:
        while not self._stop.wait(ASSIGNMENT_POLL_S):
            before = self.allowed
            try:
                self.refresh()
            except redis.RedisError:
                continue  # keep the last known settings while Redis is away
            self.sync()
            if self.allowed != before:
                self.heartbeat()  # status shows the change now, not at the next beat

    def hold(self, dataset: str) -> None:
        """Leave a dataset's queue alone for ``ADMISSION_WAIT_S`` (its admission waits for what is
        in flight), so the slots go to the worker's other datasets meanwhile."""
        with self._lock:
            self.held[dataset] = time.monotonic() + ADMISSION_WAIT_S
        self.sync()

    def sync(self) -> None:
        """Make the consumer follow the assignment (nothing while paused, no held dataset).

        Only the consumer's own thread may change its queues, so the change is handed to it. The
        calls come from several threads, and Celery runs what it is handed in no set order (kombu's
        event loop keeps it in a set): a pause that cleared at once had its cancel run after the
        resume's add, and the worker stopped consuming for good. So what is handed over is not a
        change but :meth:`_apply`, which compares the queues wanted when it runs with the ones the
        consumer has: whatever the order, the last one leaves the consumer as wanted.
        """
        now = time.monotonic()
        with self._lock:
            held = {d for d, until in self.held.items() if until > now}
            self.consuming = set() if self.paused else {rk.queue(d) for d in self.allowed - held}
        consumer = self._consumer
        if consumer is not None:
            consumer.call_soon(self._apply)

    def _apply(self) -> None:
        """On the consumer's thread: add and cancel queues until it consumes what is wanted now."""
        consumer = self._consumer
        queues = getattr(consumer, "task_consumer", None)
        if queues is None:  # the connection is being set up again: the watch's next sync applies it
            return
        with self._lock:
            wanted = set(self.consuming)
        actual = {q.name for q in queues.queues if queues.consuming_from(q.name)} - {IDLE_QUEUE}
        for q in sorted(wanted - actual):
            log.warning("now consuming %s", q)
            consumer.add_task_queue(q)
        for q in sorted(actual - wanted):
            log.warning("no longer consuming %s", q)
            consumer.cancel_task_queue(q)

    def pause(self, reason: str, detail: str, ready: Callable[[], bool] | None = None) -> None:
        """Stop consuming (tasks stay queued); try again after ``pause_s``, or once ``ready()``."""
        with self._lock:
            if self.paused:
                return
            self.paused = reason
        banner = "=" * 72
        log.error("%s\nSTOPPED CONSUMING %s: %s\n%s\nTasks stay queued; nothing is marked failed. "
                  "Retrying in %.0fs%s.\n%s", banner, ", ".join(sorted(self.consuming)), reason, detail,
                  self.pause_s, ", or as soon as the server answers" if ready else "", banner)
        self.sync()
        self.heartbeat()
        threading.Thread(target=self._wait_to_resume, args=(ready,), name="draftfleet-pause", daemon=True).start()

    def _wait_to_resume(self, ready: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + self.pause_s
        while time.monotonic() < deadline and not (ready is not None and ready()):
            if self._stop.wait(min(1.0, self.pause_s)):
                return
        self.resume()

    def resume(self) -> None:
        with self._lock:
            if not self.paused:
                return
            self.paused = None
        log.warning("resuming after a pause")
        self.sync()
        self.heartbeat()

    def counters_known(self) -> bool:
        """Whether the counters are the store's, rebuilding them here when no other process is
        (``reconcile.ensure_counters``): False while another one rebuilds them."""
        return ensure_counters(self.store, self.r, wait=False)

    def charge(self, task: PromptTask, backend: str, cost_usd: float, reason: str) -> None:
        """A generation paid for that no record will carry: kept in the store, then into the spend."""
        if not cost_usd:
            return
        charge = ChargeRecord(id=new_charge_id(), backend=backend, cost_usd=cost_usd, dataset=task.dataset,
                              key=task.key, reason=reason, worker=self.hostname, at=time.time())
        self.store.put_charge(charge)
        self.ledger.charge(charge)

    def check_spend(self) -> None:
        """A cloud backend stops at its spend cap; the queue keeps what is left. A spend Redis lost
        is no spend: the worker waits (paused) until the counters are rebuilt from the store."""
        if self.spend_cap is not None:
            spent = self.ledger.spend_known(self.backend.name)
            if spent is None and self.counters_known():
                spent = self.ledger.spend_known(self.backend.name)
            if spent is None:
                raise Halt("counters_rebuilding", "Redis lost the spend counters; another process is rebuilding "
                           "them from the store", ready=self.ledger.counters_built)
            if spent >= self.spend_cap:
                raise Halt("spend_cap", f"{self.backend.name} has spent ${spent:.2f} of its "
                           f"max_spend_usd ${self.spend_cap:.2f}: raise it in the config to go on")


_runtime: Runtime | None = None


def install(rt: Runtime) -> None:
    global _runtime
    _runtime = rt


def runtime() -> Runtime:
    if _runtime is None:
        raise RuntimeError("draftfleet worker runtime not installed")
    return _runtime


# -- the task --------------------------------------------------------------------------------
def _queue(task_self) -> str:
    return (task_self.request.delivery_info or {}).get("routing_key", "?")


def _dead_letter(rt: Runtime, payload: object, reason: str, queue: str) -> str:
    dead_letter(rt.r, queue=queue, reason=reason, body=payload, worker=rt.hostname)
    return "dead_letter"


def _count_existing(rt: Runtime, task: PromptTask, set_aside: bool) -> str | None:
    """The key has a file: count its record (once) and return ``duplicate``.

    A file that cannot be read (empty, corrupt, a dangling link) is no result: None, and with
    ``set_aside`` (only while holding the key's claim) the file is moved aside so the key is
    generated again.
    """
    try:
        record = rt.store.get(task.dataset, task.key)
    except (FileNotFoundError, msgspec.DecodeError) as exc:
        if set_aside:
            moved = rt.store.set_aside(task.dataset, task.key)
            log.warning("%s %s: the stored record cannot be read (%s); moved to %s, generating it again",
                        task.dataset, task.source, exc, moved)
            rt.ledger.event(task.dataset, "set_aside:unreadable")
        return None
    rt.ledger.count(record)
    return "duplicate"


def _defer(task_self, task: PromptTask) -> str:
    """A twin holds the claim: send the task back for later (it may die; then we run it)."""
    later = msgspec.structs.replace(task, deferrals=task.deferrals + 1)
    task_self.app.send_task(
        rk.TASK_NAME, args=[msgspec.to_builtins(later)], queue=rk.queue(task.dataset),
        task_id=task.key, countdown=min(60, 5 * 2 ** min(task.deferrals, 4)),
    )
    runtime().ledger.event(task.dataset, "deferred:claimed")
    return "deferred"


def _fail(rt: Runtime, task: PromptTask, reason: str, detail: str, attempts: int) -> str:
    rt.store.put_failure(FailureRecord(
        key=task.key, dataset=task.dataset, source=task.source, reason=detail[:1000], error_kind=reason,
        attempts=attempts, backend=rt.backend.name, worker=rt.hostname, failed_at=time.time(), task=task,
    ))
    if rt.store.has(task.dataset, task.key):  # a twin stored it meanwhile: the prompt is done
        rt.store.clear_failure(task.dataset, task.key)
    rt.ledger.event(task.dataset, f"failed:{reason}")
    log.error("%s %s failed after %d attempt(s): %s", task.dataset, task.source, attempts, detail[:300])
    return "failed"


def _ask(rt: Runtime, task: PromptTask, asked: PromptTask | None) -> Generation:
    """One attempt. An answer billed but unusable (empty, not re-tokenizable) goes to the spend
    before its error is handled: no record will carry its cost."""
    try:
        return rt.backend.generate(asked or task)
    except BackendError as exc:
        if exc.paid_usd:
            rt.charge(task, rt.backend.name, exc.paid_usd, exc.reason)
            rt.ledger.event(task.dataset, f"paid_unused:{exc.reason}")
        raise


def _generate(rt: Runtime, task: PromptTask, reasons: list[str],
              asked: PromptTask | None = None) -> tuple[Generation | None, int, float]:
    """Run the backend with retries (their reasons appended to ``reasons``) on ``asked`` (a
    conversation's turn: the task with its history), else on ``task``, which failures name.

    Returns (the generation, or None if the prompt failed; attempts; latency of the last attempt).
    """
    last: Transient | None = None
    started = time.monotonic()
    for attempt in range(1, rt.cfg.fleet.max_attempts + 1):
        if rt.paused:
            raise Reject(f"worker paused: {rt.paused}", requeue=True)
        t0 = time.monotonic()
        try:
            rt.check_spend()
            return _ask(rt, task, asked), attempt, time.monotonic() - t0
        except Halt as exc:
            rt.pause(exc.reason, str(exc), ready=exc.ready)
            raise Reject(exc.reason, requeue=True) from None
        except Permanent as exc:
            _fail(rt, task, exc.reason, str(exc), attempt)
            return None, attempt, time.monotonic() - started
        except Transient as exc:
            last = exc
        except Exception as exc:  # a bug must not lose the prompt: retry, then record it
            if not rt.stopping:
                log.exception("unexpected error generating %s", task.source)
            last = Transient("internal", f"{type(exc).__name__}: {exc}")
        if rt.stopping:  # a shutdown closes the backend under running requests: not the prompt's fault
            raise Reject(f"worker shutting down ({last.reason})", requeue=True)
        rt.ledger.event(task.dataset, f"retry:{last.reason}")
        reasons.append(last.reason)
        if attempt < rt.cfg.fleet.max_attempts:
            delay = backoff_s(attempt, last.retry_after)
            log.warning("%s %s: %s; retry %d in %.1fs", task.dataset, task.source, last, attempt, delay)
            time.sleep(delay)
    assert last is not None
    if isinstance(last, ServerDown):
        # The server is gone, not the prompt: keep the task queued for when it is back.
        rt.pause("server_down", str(last), ready=rt.backend.healthy if isinstance(rt.backend, EngineClient) else None)
        raise Reject("server down", requeue=True)
    _fail(rt, task, last.reason, str(last), rt.cfg.fleet.max_attempts)
    return None, rt.cfg.fleet.max_attempts, time.monotonic() - started


def _store(rt: Runtime, record: ResponseRecord) -> bool:
    """Write the record, retrying while the store is unwritable; never acknowledge an unstored result."""
    for attempt in range(1, STORE_ATTEMPTS + 1):
        try:
            return rt.store.put(record)
        except StoreError as exc:
            rt.ledger.event(record.dataset, "retry:store_error")
            log.error("cannot store %s/%s (attempt %d/%d): %s", record.dataset, record.key, attempt, STORE_ATTEMPTS, exc)
            if attempt == STORE_ATTEMPTS:
                raise Reject(f"store unwritable: {exc}", requeue=True) from None
            time.sleep(min(30.0, 2.0 ** attempt))
    return False


def _admit(rt: Runtime, task: PromptTask, token: str, turns_left: int = 1, turns: int = 1) -> bool:
    """Reserve the dataset's expected tokens; False once its budget is reached (task skipped).

    A conversation reserves for the ``turns_left`` of its ``turns`` still to come: the dataset's
    mean per record (a whole conversation) scaled to them, and up to ``max_tokens`` each.

    Near the budget, admission waits until what is in flight settles. A task told to wait does
    not keep its slot meanwhile: it goes back to its queue (unstarted), and this worker leaves the
    dataset's queue alone for a moment, so its other datasets go on.
    """
    budget = rt.budgets.get(task.dataset)
    if budget is None:
        return True
    expected = rt.ledger.reservation(task.dataset, task.settings.max_tokens, turns, turns_left)
    verdict = rt.ledger.admit(task.dataset, task.key, token, budget, expected, task.settings.max_tokens * turns_left)
    if verdict == LOST and rt.counters_known():  # rebuilt from the store just now: admission runs on them
        expected = rt.ledger.reservation(task.dataset, task.settings.max_tokens, turns, turns_left)
        verdict = rt.ledger.admit(task.dataset, task.key, token, budget, expected,
                                  task.settings.max_tokens * turns_left)
    if verdict == LOST:  # another process rebuilds the counters: nothing is admitted on lost ones
        rt.hold(task.dataset)
        raise Reject(f"{task.dataset}: admission waits for the counters to be rebuilt from the store", requeue=True)
    if verdict == ADMITTED:
        return True
    if verdict == WAIT:
        rt.hold(task.dataset)
        raise Reject(f"{task.dataset}: admission waits for what is in flight", requeue=True)
    if verdict == REFUSED:
        purged = rt.ledger.purge_closed(task.dataset)
        if purged is None:  # an enqueue reopened it meanwhile (a raised budget): its tasks stay
            raise Reject(f"{task.dataset} was reopened", requeue=True)
        log.warning("%s reached its budget of %s tokens: closed; %d queued tasks purged", task.dataset,
                    rt.ledger.closed_at(task.dataset), purged)
        rt.ledger.event(task.dataset, "skipped:budget", purged)
    rt.ledger.event(task.dataset, "skipped:budget")
    return False


def _progress(rt: Runtime, task: PromptTask) -> list[Turn]:
    """The completed turns of a conversation an earlier attempt started ([] for a single turn)."""
    if task.settings.turns != "all":
        return []
    kept = rt.store.progress(task.dataset, task.key)
    return list(kept.turns) if kept is not None else []


def _turn(rt: Runtime, gen: Generation, attempts: int, latency: float, reasons: list[str]) -> Turn:
    """One generated answer as this worker stores it (a conversation's turn, or a prompt's answer)."""
    return Turn(
        prompt_ids=gen.prompt_ids, output_ids=gen.output_ids, text=gen.text, reasoning=gen.reasoning,
        finish_reason=gen.finish_reason, truncated=gen.truncated, prompt_tokens=gen.prompt_tokens,
        completion_tokens=len(gen.output_ids), backend=rt.backend.name, backend_kind=rt.backend.kind,
        model=gen.model, token_source=gen.token_source, usage=gen.usage, cost_usd=gen.cost_usd,
        cost_source=gen.cost_source, latency_s=round(latency, 4), attempts=attempts, worker=rt.hostname,
        created_at=time.time(), retry_reasons=reasons,
    )


def _conversation(rt: Runtime, task: PromptTask, done: list[Turn], held_since: float) -> ResponseRecord | None:
    """Answer a conversation's user turns in order, each asked with the history of the fleet's own
    answers (``draftfleet.conversation``); None if a turn failed.

    Each completed turn is kept in the store before the next is asked, so a worker's death, a
    pause or a retry resumes at the next turn and never pays for a completed one twice; its cost
    goes to the spend and its tokens against the budget as soon as it is paid (``Ledger.prepay``),
    also if a later turn fails or the conversation is handed back. A turn
    cut at ``max_tokens`` ends the conversation: later turns would build on a cut answer. A
    conversation that has started finishes on the worker that holds it, also after a pivot or
    drain (or goes back to its queue whole, its completed turns kept, when the worker pauses or stops).

    The visibility timeout. The config checks that one turn's worst case (``longest_task_s``:
    every attempt timing out, the longest Retry-After between them) fits in the visibility
    timeout, but a conversation's turns are as many as its dataset row has, known only per row.
    So the message is not held for the whole conversation: before asking another turn, a
    conversation whose message (held since ``held_since``) could outlive the visibility timeout
    during that turn's worst case goes back to its queue, its completed turns kept, and the next
    delivery (a fresh visibility window) resumes at that turn. Every delivery asks at least one
    turn, so a conversation always advances, and no delivery holds its message past the timeout
    (Redis would hand it to a second worker meanwhile, celery#5935).
    """
    parts = runs(task.messages)
    asked = 0
    while len(done) < len(parts) and not (done and done[-1].truncated):
        if asked and time.monotonic() - held_since + rt.cfg.longest_task_s() >= rt.cfg.fleet.visibility_timeout_s:
            rt.ledger.event(task.dataset, "handed_back:visibility_timeout")
            log.info("%s %s: turn %d of %d could outlive the visibility timeout: back to the queue, %d turns kept",
                     task.dataset, task.source, len(done) + 1, len(parts), len(done))
            raise Reject("conversation handed back before the visibility timeout", requeue=True)
        reasons: list[str] = []
        gen, attempts, latency = _generate(rt, task, reasons, msgspec.structs.replace(
            task, messages=history(task.messages, done)))
        asked += 1
        if gen is None:
            return None
        try:
            rt.ledger.prepay(task.dataset, task.key, len(done), rt.backend.name, gen.cost_usd, len(gen.output_ids))
        except redis.RedisError as exc:  # left unmarked, the turn counts when its record is (or the reconciler marks it)
            log.warning("%s %s: turn %d not counted as paid yet: %s", task.dataset, task.source, len(done) + 1, exc)
        done.append(_turn(rt, gen, attempts, latency, reasons))
        if len(done) < len(parts) and not gen.truncated:
            rt.store.put_progress(TurnProgress(key=task.key, dataset=task.dataset, turns=done))
    return conversation_record(task, done, rt.hostname)


def execute(task_self, payload: object) -> str:
    """Body of the Celery task; returns what happened (``stored``, ``duplicate``, ``failed``...)."""
    rt = runtime()
    held_since = time.monotonic()  # the message was reserved a moment before (one per slot: prefetch 1)
    queue = _queue(task_self)
    try:
        task = msgspec.convert(payload, PromptTask)
        check_name(task.dataset)
        check_key(task.key)
    except (msgspec.ValidationError, StoreError) as exc:
        return _dead_letter(rt, payload, f"not a valid task: {exc}", queue)
    if (problem := rt.refuse(task, queue)) is not None:
        return _dead_letter(rt, payload, problem, queue)
    if rt.store.has(task.dataset, task.key) and (done := _count_existing(rt, task, set_aside=False)):
        return done
    if task.dataset not in rt.allowed:
        # Drained or pivoted away from this kind: back to the queue, not started.
        raise Reject(f"{task.dataset} is not assigned to {rt.kind} workers", requeue=True)
    token = rt.acquire(task)
    if token is None:
        return _defer(task_self, task)
    try:
        # finished by a twin between our check and claim (or unreadable: set aside, generated)
        if rt.store.has(task.dataset, task.key) and (done := _count_existing(rt, task, set_aside=True)):
            return done
        turns, done = answers(task), _progress(rt, task)
        if not _admit(rt, task, token, turns - len(done), turns):
            if not done:
                return "skipped"
            # The budget stops a conversation some turns of which are paid. It has no result yet: its
            # turns stay kept (and spent from the budget), and once the budget is raised, enqueue
            # queues it again (it has no record) and it goes on at its next turn. Stored as it is,
            # it could never be finished: a key's result is written once.
            rt.ledger.event(task.dataset, "stopped:budget")
            log.warning("%s %s: the budget stops the conversation after %d of %d turns: its turns are kept, to go "
                        "on when the budget is raised", task.dataset, task.source, len(done), turns)
            return "stopped"
        if task.settings.turns == "all":
            record = _conversation(rt, task, done, held_since)
            if record is None:
                return "failed"
        else:
            reasons: list[str] = []
            gen, attempts, latency = _generate(rt, task, reasons)
            if gen is None:
                return "failed"
            record = single_record(task, _turn(rt, gen, attempts, latency, reasons))
        stored = _store(rt, record)
        if record.turns:
            rt.store.clear_progress(task.dataset, task.key)
        if not stored:
            # A twin stored the key while we generated; ours was paid for all the same (a
            # conversation's turns are in the spend already: added as they were paid).
            if not record.turns:
                rt.charge(task, record.backend, record.cost_usd, "twin_stored")
            return _count_existing(rt, task, set_aside=False) or "duplicate"
        rt.ledger.count(record)
        if record.truncated:
            rt.ledger.event(task.dataset, "truncated")
        log.info("stored %s %s: %d tokens from %s in %.2fs (%s, attempt %d%s)", task.dataset, task.source,
                 record.completion_tokens, record.backend, record.latency_s, record.finish_reason, record.attempts,
                 f", {len(record.turns)} turns" if record.turns else "")
        return "stored"
    finally:
        try:
            rt.ledger.release(task.dataset, task.key, token)
        finally:  # also when Redis is away: a claim left in our set would be refreshed forever
            rt.release(task, token)


def register(app: Celery) -> None:
    """Register the task on ``app`` (acks late; a lost worker's message goes back to the queue)."""
    from celery.signals import worker_ready

    @worker_ready.connect(weak=False)
    def _ready(sender=None, **_):
        if _runtime is not None:
            _runtime.attach(sender)

    # shared=False: registered on this app only (Celery would add it to every app made later).
    @app.task(name=rk.TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
              shared=False)
    def generate(self, *args, **kwargs):
        rt = runtime()
        try:
            if len(args) != 1 or kwargs:
                return _dead_letter(rt, [list(args), kwargs], "not a valid task: expected one argument, the prompt",
                                    _queue(self))
            return execute(self, args[0])
        except (redis.RedisError, OperationalError, OSError, StoreError) as exc:
            # Redis (as a client, or as the broker a deferred copy is sent through) or the store
            # failed outside the retries. Celery would record a failure and acknowledge: the
            # prompt goes back to its queue instead, after a pause so that a lasting fault does
            # not spin.
            log.error("%s: %s: %s; the task goes back to its queue in %.0fs", _queue(self), type(exc).__name__, exc,
                      INFRA_RETRY_S)
            time.sleep(INFRA_RETRY_S)
            raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from None
