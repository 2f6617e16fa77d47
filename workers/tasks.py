"""The one task: generate a prompt, store it once, count it once.

Delivery semantics. A message is acknowledged only after its result is stored (or its failure
recorded), so a lost worker costs a redelivery. Redelivered copies are harmless: a claim in Redis
(``SET NX`` with a TTL the holder keeps refreshing) keeps a twin from generating the same key at
the same time, the store is looked at once under it, and the store's write-once ``link`` plus the
ledger's counted set make sure one result is stored and counted once. A stored single answer is
counted in the worker's next batch (``tally.py``), after its message is acknowledged: its claim and
reservation stay held until then, and what a killed worker leaves uncounted the reconciler counts.
Every HTTP call has its own timeout, all well below the visibility timeout (the threads pool has no
task time limits).
A dead worker's messages come back once its claims lapse (``recovery.py``, run by every live
worker's heartbeat), not only after the visibility timeout. A task that meets an error of Redis
or of the store outside its own retries goes back to its queue: it is never acknowledged as done.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis
from celery import Celery
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

from draftfleet import redis_keys as rk
from draftfleet.conversation import answers, conversation_record, history, runs, single_record
from draftfleet.ledger import ADMITTED, LOST, REFUSED, WAIT, Admission
from draftfleet.schemas.records import FailureRecord, PromptTask, ResponseRecord, Turn, TurnProgress
from draftfleet.store import StoreError, check_key, check_name
from draftfleet.workers.backends import BackendError, Generation, Halt, Permanent, Transient, backoff_s
from draftfleet.workers.consumer import dead_letter
from draftfleet.workers.engine import EngineClient, ServerDown
from draftfleet.workers.runtime import Runtime

log = logging.getLogger("draftfleet.worker")

STORE_ATTEMPTS = 8
INFRA_RETRY_S = 5.0


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


class Spending:
    """What a task's paid requests hold against its backend's spend cap (``Runtime.hold_spend``):
    each hold is let go once its request's cost is in the spend (its record counted, its turn
    prepaid, its charge kept), never before; a task that ends otherwise leaves them to the
    reconciler, which charges a dead task's holds at what they held."""

    def __init__(self, token: str):
        self.token = token
        self.turn: int | None = None  # the conversation's turn being asked (None: a single answer)
        self.holds: list = []


def _ask(rt: Runtime, task: PromptTask, asked: PromptTask | None, spending: Spending | None = None) -> Generation:
    """One attempt. An answer billed but unusable (empty, not re-tokenizable) goes to the spend
    before its error is handled: no record will carry its cost. On a capped backend the request
    holds the most it can cost first, and near the cap is asked with the max_tokens that fit."""
    sent = asked or task
    hold = rt.hold_spend(task, sent, spending.token, spending.turn) if spending is not None else None
    if hold is not None and hold.max_tokens < sent.settings.max_tokens:
        sent = _asked(sent, hold.max_tokens)
    try:
        gen = rt.backend.generate(sent)
    except BackendError as exc:
        if exc.paid_usd:
            rt.charge(task, rt.backend.name, exc.paid_usd, exc.reason)
            rt.ledger.event(task.dataset, f"paid_unused:{exc.reason}")
        if hold is not None:  # its cost, if any, is in the spend now
            rt.release_spend([hold])
        raise
    if hold is not None:
        spending.holds.append(hold)
    return gen


def _generate(rt: Runtime, task: PromptTask, reasons: list[str], asked: PromptTask | None = None,
              spending: Spending | None = None) -> tuple[Generation | None, int, float]:
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
            if spending is None:
                rt.check_spend()
            return _ask(rt, task, asked, spending), attempt, time.monotonic() - t0
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


def _store(rt: Runtime, record: ResponseRecord, token: str) -> bool:
    """Write the record, retrying while the store is unwritable; never acknowledge an unstored result.
    Every try writes as the task (``token``, its claim's): a try whose write was stored though its
    answer was lost (and every retry of it refused) is found as this task's own by the next, not a twin's."""
    for attempt in range(1, STORE_ATTEMPTS + 1):
        try:
            return rt.store.put(record, writer=token)
        except StoreError as exc:
            rt.ledger.event(record.dataset, "retry:store_error")
            log.error("cannot store %s/%s (attempt %d/%d): %s", record.dataset, record.key, attempt, STORE_ATTEMPTS, exc)
            if attempt == STORE_ATTEMPTS:
                raise Reject(f"store unwritable: {exc}", requeue=True) from None
            time.sleep(min(30.0, 2.0 ** attempt))
    return False


def _admit(rt: Runtime, task: PromptTask, token: str, turns_left: int = 1,
           admission: Admission | None = None) -> int | None:
    """Reserve the most the task can make (its max_tokens x the ``turns_left`` of a conversation):
    the tokens it may make now (less than that near the end: what is left of the budget, which
    becomes its max_tokens), or None once the budget is reached (task skipped).

    Where what is in flight may still come back short, admission waits. A task told to wait does
    not keep its slot meanwhile: it goes back to its queue (unstarted), and this worker leaves the
    dataset's queue alone for a moment, so its other datasets go on.
    """
    want = task.settings.max_tokens * turns_left
    budget = rt.budgets.get(task.dataset)
    if budget is None and admission is None:
        return want
    if admission is None:  # not taken with the claim (Runtime.claim_admit): admit now
        admission = rt.ledger.admit(task.dataset, task.key, token, budget, want)
    if admission.verdict == LOST and rt.counters_known():  # rebuilt from the store just now: admission runs on them
        admission = rt.ledger.admit(task.dataset, task.key, token, budget, want)
    verdict = admission.verdict
    if verdict == LOST:  # another process rebuilds the counters: nothing is admitted on lost ones
        rt.hold(task.dataset)
        raise Reject(f"{task.dataset}: admission waits for the counters to be rebuilt from the store", requeue=True)
    if verdict == ADMITTED:
        return min(want, admission.granted or want)
    if verdict == WAIT:
        if admission.buried:  # some of what is in flight is dead tasks': count the store, free the rest
            rt.settle_buried(task.dataset)
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
    return None


def _asked(task: PromptTask, max_tokens: int) -> PromptTask:
    """The task as sent to the backend with ``max_tokens`` (what admission granted, when less than
    its dataset's): the answer stops there. Its key and record keep the dataset's settings."""
    if max_tokens >= task.settings.max_tokens:
        return task
    return msgspec.structs.replace(task, settings=msgspec.structs.replace(task.settings, max_tokens=max(1, max_tokens)))


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


def _conversation(rt: Runtime, task: PromptTask, done: list[Turn], held_since: float,
                  granted: int, spending: Spending | None = None) -> ResponseRecord | None:
    """Answer a conversation's user turns in order, each asked with the history of the fleet's own
    answers (``draftfleet.conversation``); None if a turn failed. ``granted``: the tokens admission
    reserved for the turns left; each turn is asked with at most what is left of it, so the
    conversation never makes more (near the budget's end a turn is cut there, and ends it).

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
        if spending is not None:
            spending.turn = len(done)
        gen, attempts, latency = _generate(rt, task, reasons, _asked(msgspec.structs.replace(
            task, messages=history(task.messages, done)), granted), spending)
        asked += 1
        if gen is None:
            return None
        granted -= len(gen.output_ids)
        try:
            rt.ledger.prepay(task.dataset, task.key, len(done), rt.backend.name, gen.cost_usd, len(gen.output_ids))
            if spending is not None:  # the turn's cost is in the spend: its hold goes
                rt.release_spend(spending.holds)
        except redis.RedisError as exc:  # left unmarked, the turn counts when its record is (or the reconciler marks it)
            log.warning("%s %s: turn %d not counted as paid yet: %s", task.dataset, task.source, len(done) + 1, exc)
        turn = _turn(rt, gen, attempts, latency, reasons)
        if granted <= 0 and len(done) + 1 < len(parts):  # the budget's grant is spent: the conversation ends cut here
            turn = msgspec.structs.replace(turn, truncated=True)
        done.append(turn)
        if len(done) < len(parts) and not turn.truncated:
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
    if task.dataset not in rt.allowed:
        # Drained or pivoted away from this kind: back to the queue, not started.
        raise Reject(f"{task.dataset} is not assigned to {rt.kind} workers", requeue=True)
    # A single answer with a budget is claimed and admitted in one round trip; a conversation
    # reserves for the turns it has left, known from its kept progress, read under its claim.
    budget = rt.budgets.get(task.dataset)
    admission, lease = None, None
    if budget is not None and task.settings.turns != "all":
        token, admission, lease = rt.claim_admit(task, budget)
    else:
        token = rt.acquire(task)
    if token is None:
        return _defer(task_self, task)
    handed = False  # to the tally, which releases the claim and the reservation with the count
    uncertain = False  # counting failed under it: its lease's slot may be out already (Leases.lost)
    try:
        # The one look at the store, under the claim: stored already (a redelivery, or a twin
        # that finished before our claim), or unreadable (set aside, generated again).
        if rt.store.has(task.dataset, task.key) and (done := _count_existing(rt, task, set_aside=True)):
            return done
        turns, done = answers(task), _progress(rt, task)
        granted = _admit(rt, task, token, turns - len(done), admission)
        if granted is None:
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
        spending = Spending(token) if rt.spend_cap is not None else None
        if task.settings.turns == "all":
            record = _conversation(rt, task, done, held_since, granted, spending)
            if record is None:
                return "failed"
        else:
            reasons: list[str] = []
            gen, attempts, latency = _generate(rt, task, reasons, _asked(task, granted), spending)
            if gen is None:
                return "failed"
            record = single_record(task, _turn(rt, gen, attempts, latency, reasons))
        stored = _store(rt, record, token)
        if record.turns:
            rt.store.clear_progress(task.dataset, task.key)
        if not stored:
            # A twin stored the key while we generated; ours was paid for all the same (a
            # conversation's turns are in the spend already: added as they were paid).
            if not record.turns:
                rt.charge(task, record.backend, record.cost_usd, "twin_stored")
            if spending is not None:  # its cost is in the spend (charged, or its turns prepaid)
                rt.release_spend(spending.holds)
            return _count_existing(rt, task, set_aside=False) or "duplicate"
        if record.turns:
            rt.ledger.count(record)
            if record.truncated:
                rt.ledger.event(task.dataset, "truncated")
        else:  # counted with the worker's next batch, its event too (workers/tally.py)
            holds = list(spending.holds) if spending is not None else []
            try:
                # its spend holds go with its count, in the step its cost enters the spend
                rt.finish(record, token, lease, holds)
            except BaseException:  # (a count at once that failed: its holds stay, for the reconciler)
                uncertain = True
                raise
            handed = True
            if spending is not None:
                spending.holds.clear()  # the tally's now
        if spending is not None:  # a conversation's turns are in the spend (prepaid, counted): its holds go
            rt.release_spend(spending.holds)
        log.info("stored %s %s: %d tokens from %s in %.2fs (%s, attempt %d%s)", task.dataset, task.source,
                 record.completion_tokens, record.backend, record.latency_s, record.finish_reason, record.attempts,
                 f", {len(record.turns)} turns" if record.turns else "")
        return "stored"
    finally:
        if not handed:
            try:
                if lease is None:
                    rt.ledger.release(task.dataset, task.key, token)
                elif not uncertain:  # its slot is free for the next task (workers/leases.py)
                    rt.leases.done(lease)
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
