"""``draftfleet worker batch``: finish datasets through a provider's batch API, at about half price.

It takes prompts from its datasets' queues as a cloud worker does (it follows the cloud kind's
assignment, so ``pivot --to gpu`` and ``drain --kind cloud`` move it too), but many at a time: each
is claimed and admitted under the budget's rule (its reservation is its max_tokens as sent, less
near the end) and holds its worst cost at the batch price against the spend cap. Then, in order:

1. the batch is recorded in the store (``_batches/open/<id>.json``: every task, what it was
   granted and held, the digest of its request line), before anything else;
2. each prompt's grant moves from its claim's reservation to a hold no claim keeps (the ledger's
   ``paid_tokens``, mark "b"), so a worker's death, a lapsed claim or a Redis flush (the rebuild
   makes it again from the store) never frees it while the provider may still answer;
3. the messages are acknowledged and the claims let go;
4. the batch is submitted, its metadata carrying the fleet's id: a worker restarted between
   submitting and recording the provider's id finds it there instead of submitting it again.

Open batches are polled every ``batch_poll_s`` by any batch worker of their backend (one at a time:
a lock in Redis). A finished batch's answers are stored write-once (``retokenized``, the provider's
usage and cost, else the batch prices) and counted, which turns each hold into what it made; a
request that failed for a reason outside the prompt (expired, cancelled, a 5xx, a 429) goes back to
its queue with its attempt counted, one the prompt itself caused becomes a failure record. A batch
whose dataset is no longer the cloud's is cancelled where the API can (OpenAI's shape); what
completed is stored, the rest goes back to the queue for whoever has the dataset now. A batch that
cannot be cancelled (OpenRouter) is waited for, and shown.

``enqueue`` skips the prompts of open batches (``Store.batched_keys``): none is queued, submitted
or paid twice, whatever Redis loses.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import msgspec
import redis
from kombu.exceptions import OperationalError

from draftfleet import redis_keys as rk
from draftfleet.assign import assigned
from draftfleet.batches import publish
from draftfleet.claims import CLAIM_TTL_S
from draftfleet.conversation import single_record
from draftfleet.ledger import ADMITTED, CLAIMED, LOST, REFUSED, WAIT, Admission, SpendHold
from draftfleet.schemas.config import MAX_RETRY_WAIT_S
from draftfleet.schemas.records import BatchRecord, BatchRequest, FailureRecord, PromptTask, ResponseRecord, WorkerReport
from draftfleet.store import StoreError, check_key, check_name
from draftfleet.store.base import new_batch_id
from draftfleet.workers.backends import BackendError, Halt, Permanent, Transient
from draftfleet.workers.batch_api import BatchRefused, BatchResult, BatchState
from draftfleet.workers.consumer import MAX_MESSAGE_BYTES, dead_letter
from draftfleet.workers.runtime import Runtime, worst_prompt_tokens
from draftfleet.workers.tasks import _asked, _count_existing, _turn

log = logging.getLogger("draftfleet.worker")

IDLE_S = 1.0
ERROR_WAIT_S = 5.0
LOCK_S = 600  # a batch's poll lock outlives any poll (storing a finished batch's answers included)
_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class _Taken(msgspec.Struct):
    """A prompt collected for the next batch: its message (unacknowledged), claim and holds."""

    message: object
    task: PromptTask
    token: str | None
    granted: int
    hold_micro: int
    reserved: bool


class _StopCollecting(Exception):
    """The dataset gives nothing more for now (admission waits, the budget is reached, the cap)."""


def request_body(cfg, task: PromptTask, max_tokens: int) -> dict:
    """The chat-completions body a batch line carries, the cloud worker's own (CloudChat.generate)."""
    from draftfleet.workers.cloud import _message

    s = task.settings
    return {**cfg.extra_body, "model": cfg.model, "messages": [_message(m) for m in task.messages],
            "max_tokens": max_tokens, "temperature": s.temperature, "top_p": s.top_p}


class BatchWorker:
    def __init__(self, rt: Runtime, api, connection):
        self.rt = rt
        self.api = api
        self.name = rt.backend.name
        self.cfg = rt.cfg.clouds[self.name]
        self.conn = connection
        self._polled: dict[str, float] = {}
        self._told: set[str] = set()  # batches said once to be waited for (not cancellable)
        self._unlock = rt.r.register_script(_UNLOCK)
        self._cache: dict[str, BatchRecord] = {}
        self._listed_at = 0.0

    # -- the loop ----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                busy = self.cycle()
            except Halt as exc:
                self.rt.pause(exc.reason, str(exc), ready=exc.ready)
                busy = False
            except (redis.RedisError, OperationalError, OSError, StoreError, Transient, BatchRefused) as exc:
                wait = ERROR_WAIT_S  # a 429's Retry-After is a floor, as for the cloud worker
                if isinstance(exc, Transient) and exc.retry_after:
                    wait = max(wait, min(exc.retry_after, MAX_RETRY_WAIT_S))
                log.warning("%s batch worker: %s: %s; again in %.0fs", self.name, type(exc).__name__, exc, wait)
                stop.wait(wait)
                continue
            except Exception:  # a bug must not end the worker: its batches are in the store, tried again
                log.exception("%s batch worker: unexpected error; again in %.0fs", self.name, ERROR_WAIT_S)
                stop.wait(ERROR_WAIT_S)
                continue
            if not busy:
                stop.wait(IDLE_S)

    def cycle(self) -> bool:
        """Advance the open batches, then collect and submit new ones: whether a batch was submitted."""
        rt = self.rt
        rt.refresh()
        for batch in self._open():
            if batch.backend == self.name:
                self.advance(batch)
        if rt.paused:
            return False
        busy = False
        for dataset in sorted(rt.allowed):
            if any(s.turns == "all" for s in rt._dataset_settings(dataset)[:1]):
                continue  # conversations answer turn by turn, each on the last: not for a batch
            busy |= self.collect(dataset)
        return busy

    def _open(self) -> list[BatchRecord]:
        """The open batches of every backend: the store's, listed again every ``batch_poll_s`` (a
        bucket's listing and each batch's thousands of tasks are not read every second), with this
        worker's own changes meanwhile."""
        now = time.monotonic()
        if now >= self._listed_at:
            self._cache = {b.id: b for b in self.rt.store.batches()}
            self._listed_at = now + self.cfg.batch_poll_s
        return list(self._cache.values())

    # -- collecting and submitting -----------------------------------------------------------
    def collect(self, dataset: str) -> bool:
        rt = self.rt
        batch_id = new_batch_id()
        if not rt.r.llen(rk.queue(dataset)):
            return False
        # The API is asked first (a list of batches): a refused key or no credits (401, 402) halts the
        # worker before it takes a message, which stays queued, as with the cloud worker.
        self.api.find(batch_id)
        taken: list[_Taken] = []
        batched = {q.task.key for b in self._open() if b.dataset == dataset for q in b.open_requests()}
        deadline = time.monotonic() + self.cfg.batch_collect_s
        channel = self.conn.default_channel
        queue = rk.queue(dataset)
        try:
            while len(taken) < self.cfg.batch_size:
                message = channel.basic_get(queue, no_ack=False)
                if message is None:
                    if not taken or time.monotonic() >= deadline:
                        break
                    time.sleep(0.2)
                    continue
                got = self._take(message, dataset, queue, batch_id, batched)
                if got is not None:
                    taken.append(got)
                    batched.add(got.task.key)
        except _StopCollecting:
            pass
        except BaseException:
            self._give_back(taken, batch_id)
            raise
        if not taken:
            return False
        if not assigned(rt.r, [dataset], rt.kind):  # drained or pivoted while collecting: nothing submitted
            log.info("%s: %s is no longer the cloud's: %d collected prompts go back to the queue", self.name,
                     dataset, len(taken))
            self._give_back(taken, batch_id)
            return False
        self.submit(dataset, batch_id, taken)
        return True

    def _take(self, message, dataset: str, queue: str, batch_id: str, batched: set[str]) -> _Taken | None:
        """Claim, admit and hold one message's prompt, or deal with the message (None)."""
        rt = self.rt
        try:
            # JSON only, never pickle (what the Celery app accepts): checked before anything is decoded
            if message.content_type != "application/json":
                raise ValueError(f"content type {message.content_type!r}: the fleet accepts JSON only")
            if len(message.body or b"") > MAX_MESSAGE_BYTES:
                raise ValueError(f"message of {len(message.body)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
            args, kwargs, _embed = message.decode()
            if (message.headers or {}).get("task") != rk.TASK_NAME or len(args) != 1 or kwargs:
                raise msgspec.ValidationError("expected one argument, the prompt")
            task = msgspec.convert(args[0], PromptTask)
            check_name(task.dataset)
            check_key(task.key)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is no task of ours: kept, with why
            dead_letter(rt.r, queue=queue, reason=f"not a valid task: {exc}", body=message.body, worker=rt.hostname)
            message.ack()
            return None
        if (problem := rt.refuse(task, queue)) is not None:
            dead_letter(rt.r, queue=queue, reason=problem, body=message.body, worker=rt.hostname)
            message.ack()
            return None
        if task.key in batched:  # an open batch holds it: this copy is one too many
            message.ack()
            return None
        if rt.store.has(dataset, task.key):
            _count_existing(rt, task, set_aside=False)
            message.ack()
            return None
        budget = rt.budgets.get(dataset)
        want = task.settings.max_tokens
        admission: Admission | None = None

        def take(token: str) -> bool:
            nonlocal admission
            admission = rt.ledger.claim_admit(dataset, task.key, token, CLAIM_TTL_S, budget, want)
            return admission.verdict != CLAIMED

        token = rt.claims.acquire(rk.claim(dataset, task.key), dataset, take if budget is not None else None)
        if token is None:  # a twin runs it now: it may die, so the message stays
            message.reject(requeue=True)
            raise _StopCollecting
        granted = want
        if admission is not None:
            verdict = admission.verdict
            if verdict == ADMITTED:
                granted = min(want, admission.granted or want)
            else:
                rt.release(task, token)
                if verdict == REFUSED or verdict not in (WAIT, LOST):
                    purged = rt.ledger.purge_closed(dataset) if verdict == REFUSED else 0
                    rt.ledger.event(dataset, "skipped:budget", 1 + (purged or 0))
                    message.ack()
                else:
                    if verdict == LOST:
                        rt.counters_known()
                    message.reject(requeue=True)
                raise _StopCollecting
        hold_micro = 0
        if rt.spend_cap is not None:
            hold_micro, granted = self._hold_spend(task, token, granted, batch_id, message, admission is not None)
        return _Taken(message=message, task=task, token=token, granted=granted, hold_micro=hold_micro,
                      reserved=admission is not None)

    def _hold_spend(self, task: PromptTask, token: str, granted: int, batch_id: str, message,
                    reserved: bool) -> tuple[int, int]:
        """Hold the request's worst cost at the batch price (as a cloud request holds at its own)."""
        rt = self.rt
        pin, pout = self.cfg.batch_prices()
        if not (pin or pout):  # no prices to bound a request by: the spend is checked before it
            try:
                rt.check_spend()
            except Halt:
                self._let_go(task, token, reserved)
                message.reject(requeue=True)
                raise
            return 0, granted
        verdict, hold = rt.ledger.spend_hold(
            self.name, task.dataset, task.key, None, rk.batch_token(batch_id), worst_prompt_tokens(task) * pin, pout,
            granted, rt.spend_cap, hold_id=rk.batch_hold_id(task.dataset, task.key, batch_id))
        if verdict == ADMITTED and hold is not None:
            return hold.micro_usd, min(granted, hold.max_tokens)
        self._let_go(task, token, reserved)
        message.reject(requeue=True)
        if verdict == LOST:
            rt.counters_known()
            raise _StopCollecting
        if verdict == WAIT:
            raise _StopCollecting
        raise Halt("spend_cap", f"{self.name} has spent ${rt.ledger.spend_usd(self.name):.2f} of its max_spend_usd "
                   f"${rt.spend_cap:.2f} (less than 1% of it left, with what open batches hold): raise it to go on")

    def _let_go(self, task: PromptTask, token: str, reserved: bool) -> None:
        if reserved:
            self.rt.ledger.release(task.dataset, task.key, token)
        self.rt.release(task, token)

    def _give_back(self, taken: list[_Taken], batch_id: str) -> None:
        """Collected prompts not recorded in a batch: their holds go, their messages back to the queue."""
        for t in taken:
            try:
                if t.hold_micro:
                    self._release_hold(t.task.key, t.task.dataset, batch_id)
                if t.token is not None:
                    self._let_go(t.task, t.token, t.reserved)
                t.message.reject(requeue=True)
            except Exception as exc:  # noqa: BLE001 - its claim lapses; recovery gives the message back
                log.warning("%s: giving %s back: %s", self.name, t.task.key[:12], exc)

    def submit(self, dataset: str, batch_id: str, taken: list[_Taken]) -> None:
        rt = self.rt
        now = time.time()
        requests = []
        for t in taken:
            line = msgspec.json.encode({"custom_id": t.task.key, "body": request_body(self.cfg, t.task, t.granted)})
            requests.append(BatchRequest(task=t.task, granted=t.granted, hold_micro_usd=t.hold_micro,
                                         digest=hashlib.sha256(line).hexdigest()))
        batch = BatchRecord(id=batch_id, backend=self.name, shape=self.cfg.batch, dataset=dataset, model=self.cfg.model,
                            window=self.cfg.completion_window, worker=rt.hostname, submitted_at=now, updated_at=now,
                            cancellable=self.api.cancellable, requests=requests)
        lock = rk.batch_lock(batch_id)  # held until it is submitted: no other batch worker polls it meanwhile
        try:
            rt.r.set(lock, rt.hostname, ex=LOCK_S)
            rt.store.put_batch(batch)  # 1. recorded: from here on the store holds these prompts
            publish(rt.r, batch)
            self._keep(batch)
        except BaseException:
            self._give_back(taken, batch_id)
            raise
        for t in taken:  # 2. each grant held by the batch, not by a claim (one round trip); 3. the messages done
            claim = rk.claim(dataset, t.task.key)
            rt.ledger.batch_take(dataset, t.task.key, t.granted, t.token, t.reserved)
            rt.claims.forget([(claim, t.token)])
            rt.claims.finish(dataset)
            t.message.ack()
        log.info("%s: batch %s of %d prompts of %s recorded; submitting", self.name, batch_id, len(taken), dataset)
        try:
            self._submit(batch)
        finally:
            self._unlock(keys=[lock], args=[rt.hostname])

    def _submit(self, batch: BatchRecord) -> None:
        """Submit a recorded batch (4.), unless the provider has it already (a restart)."""
        found = self.api.find(batch.id, since=batch.submitted_at)
        if found:
            self._save(batch, provider_id=found, status="validating")
            return
        lines = [(q.task.key, request_body(self.cfg, q.task, q.granted)) for q in batch.open_requests()]
        try:
            provider_id, file_id = self.api.submit(batch.id, self.cfg.model, lines)
        except BatchRefused as exc:
            log.error("%s refused batch %s of %s: %s; its %d prompts go back to their queue", self.name, batch.id,
                      batch.dataset, exc, len(lines))
            self._close_all(self._save(batch, status="refused", error=str(exc)[:1000]), "batch_refused")
            return
        self._save(batch, provider_id=provider_id, input_file_id=file_id, status="validating")
        log.info("%s: batch %s submitted as %s (%d prompts, window %s)", self.name, batch.id, provider_id, len(lines),
                 batch.window)

    def _save(self, batch: BatchRecord, **changes) -> BatchRecord:
        batch = msgspec.structs.replace(batch, updated_at=time.time(), **changes)
        self.rt.store.put_batch(batch)
        publish(self.rt.r, batch)
        self._keep(batch)
        return batch

    def _keep(self, batch: BatchRecord) -> None:
        if batch.closed:
            self._cache.pop(batch.id, None)
        else:
            self._cache[batch.id] = batch

    # -- open batches ------------------------------------------------------------------------
    def advance(self, batch: BatchRecord) -> None:
        """Poll a batch when due (one worker at a time); store its answers once it has ended."""
        now = time.monotonic()
        if now < self._polled.get(batch.id, 0.0):
            return
        lock = rk.batch_lock(batch.id)
        if not self.rt.r.set(lock, self.rt.hostname, nx=True, ex=LOCK_S):
            return
        self._polled[batch.id] = now + self.cfg.batch_poll_s
        try:
            fresh = self.rt.store.open_batch(batch.id)  # another worker may have advanced or closed it
            if fresh is None:
                self._cache.pop(batch.id, None)
                self.rt.r.hdel(rk.BATCHES, batch.id)
                return
            self._keep(fresh)
            publish(self.rt.r, fresh)  # (again, after Redis lost it)
            self._advance(fresh)
        finally:
            self._unlock(keys=[lock], args=[self.rt.hostname])

    def _advance(self, batch: BatchRecord) -> None:
        if not batch.provider_id:
            if self.rt.paused:  # a pause (401, 402, the cap...) holds submissions: this one goes after it
                return
            if batch.dataset not in self.rt.allowed and not self.api.find(batch.id, since=batch.submitted_at):
                log.warning("%s: %s is no longer the cloud's: batch %s was never submitted; its %d prompts go back "
                            "to their queue", self.name, batch.dataset, batch.id, len(batch.open_requests()))
                self._close_all(self._save(batch, status="not_submitted"), "pivoted_before_submission", attempt=False)
                return
            self._submit(batch)
            return
        if batch.dataset not in self.rt.allowed and not batch.cancel_requested:
            batch = self._cancel(batch)
        state = self.api.poll(batch.provider_id)
        if (state.status, state.completed, state.failed) != (batch.status, batch.completed, batch.failed):
            batch = self._save(batch, status=state.status, completed=state.completed, failed=state.failed,
                               error=state.error or batch.error)
        if state.terminal:
            if not self.rt.counters_known():
                return  # the rebuild from the store holds what this batch holds: count after it
            self.finish(batch, state)

    def _cancel(self, batch: BatchRecord) -> BatchRecord:
        if self.api.cancellable:
            log.warning("%s: %s is no longer the cloud's: cancelling batch %s (%s); what completed is stored, the "
                        "rest goes back to the queue", self.name, batch.dataset, batch.id, batch.provider_id)
            try:
                self.api.cancel(batch.provider_id)
            except BatchRefused as exc:  # it ended meanwhile (a terminal batch cannot be cancelled)
                log.info("%s: batch %s was not cancelled: %s", self.name, batch.id, exc)
        elif batch.id not in self._told:
            self._told.add(batch.id)
            log.warning("%s: %s is no longer the cloud's, but batch %s (%s) cannot be cancelled: waiting for it "
                        "(draftfleet status shows it)", self.name, batch.dataset, batch.id, batch.provider_id)
        return self._save(batch, cancel_requested=True)

    def finish(self, batch: BatchRecord, state: BatchState) -> None:
        """Store, count, send back or fail each open request; then the batch holds nothing. Its
        stored answers are counted together (``Ledger.count_batch_answers``), before the batch is
        closed: a crash between leaves it open, and the next pass finds each answer stored as ours
        and counts it then (once)."""
        results = {r.custom_id: r for r in state.results or []}
        done: list[BatchRequest] = []
        to_count: list[tuple[ResponseRecord, SpendHold | None]] = []
        for q in batch.requests:
            if q.state == "open":
                result = results.get(q.task.key) or BatchResult(q.task.key, 0, None, f"batch_{state.status}",
                                                                state.error or f"the batch ended {state.status}")
                q = self._settle(batch, q, result, to_count)
            done.append(q)
        self.rt.ledger.count_batch_answers(to_count)
        stored = sum(q.state == "stored" for q in done)
        returned = sum(q.state == "returned" for q in done)
        self._save(batch, requests=done, closed=True)
        (log.error if state.status == "failed" else log.info)(
            "%s: batch %s (%s) of %s %s%s: %d stored, %d back to the queue, %d failed", self.name, batch.id,
            batch.provider_id, batch.dataset, state.status, f" ({state.error})" if state.error else "", stored,
            returned, len(done) - stored - returned)

    def _settle(self, batch: BatchRecord, q: BatchRequest, result: BatchResult,
                to_count: list[tuple[ResponseRecord, SpendHold | None]]) -> BatchRequest:
        rt = self.rt
        if result.status_code == 200 and result.body is not None:
            try:
                return self._store(batch, q, result.body, to_count)
            except (Permanent, Halt) as exc:
                return self._fail(batch, q, exc.reason, str(exc))
            except Transient as exc:
                return self._send_back(batch, q, exc.reason, str(exc))
        if result.status_code:
            body = result.body or {}
            err = body.get("error") if isinstance(body.get("error"), dict) else {"message": str(body)[:300]}
            fate = rt.backend._classify(result.status_code, err, None, body.get("error_type"))
            if isinstance(fate, Permanent):
                return self._fail(batch, q, fate.reason, str(fate))
            return self._send_back(batch, q, getattr(fate, "reason", f"http_{result.status_code}"), str(fate))
        return self._send_back(batch, q, result.error_code or "no_result", result.error_message)

    def _store(self, batch: BatchRecord, q: BatchRequest, body: dict,
               to_count: list[tuple[ResponseRecord, SpendHold | None]]) -> BatchRequest:
        """Store the answer write-once; ours (also one stored before a restart) goes to ``to_count``
        with its spend hold, counted with the batch's others (:meth:`finish`)."""
        rt = self.rt
        task = q.task
        usage = rt.backend._usage(body.get("usage") or {})
        try:
            gen = rt.backend._answer(_asked(task, q.granted), body, usage, None)
        except BackendError as exc:  # billed all the same (empty, not re-tokenizable), unless nothing was made
            if usage.cost_usd is not None or usage.completion_tokens:
                paid = self._cost(usage, None)[0]
                rt.charge(task, self.name, paid, exc.reason)
                rt.ledger.event(task.dataset, f"paid_unused:{exc.reason}")
            raise
        cost, source = self._cost(usage, gen)
        gen = msgspec.structs.replace(gen, cost_usd=cost, cost_source=source)
        latency = max(0.0, time.time() - batch.submitted_at)
        record = msgspec.structs.replace(single_record(task, _turn(rt, gen, 1 + task.batch_attempts, latency, [])),
                                         batch_id=batch.id)
        stored = rt.store.put(record, writer=f"{batch.id}:{task.key}")
        if not stored:
            kept = rt.store.get(task.dataset, task.key)
            stored = kept.output_ids == record.output_ids and kept.backend == record.backend and kept.text == record.text
            record = kept if stored else record
        if stored:  # ours: counted once with the batch's others, its grant then what it made, its hold gone
            hold = (SpendHold(rk.batch_hold_id(task.dataset, task.key, batch.id), rk.batch_token(batch.id), 0, 0)
                    if rt.spend_cap is not None else None)
            to_count.append((record, hold))
            return msgspec.structs.replace(q, state="stored")
        # a twin stored the key meanwhile: ours was paid all the same
        rt.charge(task, self.name, cost, "twin_stored")
        rt.ledger.batch_unhold(task.dataset, task.key)
        rt.ledger.count(rt.store.get(task.dataset, task.key), rate=False)
        self._release_hold(task.key, task.dataset, batch.id)
        return msgspec.structs.replace(q, state="stored")

    def _cost(self, usage, gen) -> tuple[float, str]:
        """The provider's reported cost where it reports one, else the batch prices."""
        if usage.cost_usd is not None:
            return usage.cost_usd + ((usage.is_byok and usage.upstream_cost_usd) or 0.0), "provider"
        pin, pout = self.cfg.batch_prices()
        if pin or pout:
            return ((usage.prompt_tokens or (gen.prompt_tokens if gen else 0)) * pin / 1e6
                    + (usage.completion_tokens or (len(gen.output_ids) if gen else 0)) * pout / 1e6), "price_table"
        return 0.0, "none"

    def _release_hold(self, key: str, dataset: str, batch_id: str) -> None:
        """Let go of the request's spend hold (its cost is in the spend, or it was never billed)."""
        if self.rt.spend_cap is not None:
            self.rt.ledger.spend_release(self.name, SpendHold(rk.batch_hold_id(dataset, key, batch_id),
                                                              rk.batch_token(batch_id), 0, 0))

    def _send_back(self, batch: BatchRecord, q: BatchRequest, reason: str, detail: str,
                   attempt: bool = True) -> BatchRequest:
        """Not the prompt's fault: back to its queue with its attempt counted (a failure once they run
        out); ``attempt=False``: it was never asked (a batch not submitted)."""
        rt = self.rt
        task = q.task
        attempts = task.batch_attempts + attempt
        if attempt and attempts >= rt.cfg.fleet.max_attempts:
            return self._fail(batch, q, reason, f"{attempts} batches: {detail}")
        again = msgspec.structs.replace(task, batch_attempts=attempts)
        rt.app.send_task(rk.TASK_NAME, args=[msgspec.to_builtins(again)], queue=rk.queue(task.dataset), task_id=task.key)
        rt.ledger.event(task.dataset, "retry:" + (reason if reason.startswith("batch_") else f"batch_{reason}"))
        rt.ledger.batch_unhold(task.dataset, task.key)
        self._release_hold(task.key, task.dataset, batch.id)
        return msgspec.structs.replace(q, state="returned", reason=f"{reason}: {detail}"[:300])

    def _fail(self, batch: BatchRecord, q: BatchRequest, reason: str, detail: str) -> BatchRequest:
        rt = self.rt
        task = q.task
        rt.store.put_failure(FailureRecord(
            key=task.key, dataset=task.dataset, source=task.source, reason=detail[:1000], error_kind=reason,
            attempts=task.batch_attempts + 1, backend=self.name, worker=rt.hostname, failed_at=time.time(), task=task))
        rt.ledger.event(task.dataset, f"failed:{reason}")
        rt.ledger.batch_unhold(task.dataset, task.key)
        self._release_hold(task.key, task.dataset, batch.id)
        log.error("%s %s failed in batch %s: %s", task.dataset, task.source, batch.id, detail[:300])
        return msgspec.structs.replace(q, state="failed", reason=f"{reason}: {detail}"[:300])

    def _close_all(self, batch: BatchRecord, reason: str, attempt: bool = True) -> None:
        done = [self._send_back(batch, q, reason, batch.error, attempt) if q.state == "open" else q
                for q in batch.requests]
        self._save(batch, requests=done, closed=True)


class BatchRuntime(Runtime):
    """A cloud worker's runtime (the cloud's assignment, budgets, claims), reported as kind ``batch``:
    ``status`` and ``plan`` tell it from a cloud worker of the same backend (its answers come in hours)."""

    def heartbeat(self) -> None:
        self.claims.beat(WorkerReport(
            hostname=self.hostname, kind="batch", backend=self.backend.name, endpoint=self.backend.endpoint,
            datasets=sorted(self.allowed), follows=sorted(self.datasets), queues=sorted(self.consuming),
            slots=self.cfg.clouds[self.backend.name].batch_size, paused=self.paused), mark_state=True)


def run_batch_worker(cfg, backend_name: str | None, *, datasets=None, redis_url: str | None = None,
                     name: str | None = None, loglevel: str = "INFO") -> None:
    """Run a batch worker in the foreground until SIGTERM or Ctrl-C (open batches stay open: the
    next batch worker of the backend, or this one restarted, goes on polling them)."""
    import signal
    import socket

    from draftfleet.broker import check_version, connect, redact, resolve_redis_url
    from draftfleet.schemas.config import ConfigError
    from draftfleet.store import open_store
    from draftfleet.tokenizer import TargetTokenizer
    from draftfleet.workers.app import make_app
    from draftfleet.workers.batch_api import batch_client
    from draftfleet.workers.cloud import CloudChat
    from draftfleet.workers.tasks import install
    from draftfleet.workers.worker import cloud_api_key, refuse_duplicate_name, setup_logging, worker_datasets

    setup_logging(loglevel)
    names = worker_datasets(cfg, datasets)
    batched = sorted(n for n, c in cfg.clouds.items() if c.batch)
    if not backend_name:
        if len(batched) != 1:
            raise ConfigError(f"{cfg.path}: a batch worker needs --backend NAME, one of the backends with a batch "
                              "API: " + (", ".join(batched) or 'none (set batch = "openrouter" or "openai")'))
        backend_name = batched[0]
    cb = cfg.cloud(backend_name)
    if cb.batch is None:
        raise ConfigError(f"{cfg.path}: backends.{backend_name} has no batch API: set batch = \"openrouter\" or "
                          "\"openai\" (the provider's wire shape)")
    broker_url = resolve_redis_url(redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    hostname = f"{name or 'batch-' + backend_name}@{socket.gethostname()}"
    r = connect(broker_url)
    check_version(r)
    refuse_duplicate_name(r, hostname)
    key = cloud_api_key(cfg, backend_name)
    chat = CloudChat(backend_name, cb, TargetTokenizer.from_config(cfg.fleet), key)
    api = batch_client(backend_name, cb, key)
    app = make_app(broker_url, cfg.fleet.visibility_timeout_s)
    store = open_store(cfg)
    store.prepare()
    rt = BatchRuntime(app, cfg, store, r, chat, hostname, names, cb.pause_s, follow_all=not datasets)
    install(rt)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.warning("%s: stopping (open batches stay open; a batch worker of %s goes on polling them)", hostname,
                    backend_name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rt.start()
    log.info("batch worker %s: backend %s (%s batches of up to %d), datasets %s, broker %s", hostname, backend_name,
             cb.batch, cb.batch_size, ",".join(names), redact(broker_url))
    try:
        with app.connection_for_read() as conn:
            BatchWorker(rt, api, conn).run(stop)
    finally:
        rt.stop()
        api.close()
        chat.close()
