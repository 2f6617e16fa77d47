"""A generation worker's own state, one per process: its backend, store, Redis, claims and queues.

What it guarantees. Everything an operator changes while the fleet runs is read live: the
datasets followed, their budgets and which worker kinds may consume them (``assign.py``, every
``ASSIGNMENT_POLL_S``), the pauses (a dead server, a bad key, a spend cap) and the holds (a dataset
whose admission waits); the consumer is steered to what is wanted now whatever order Celery runs
the changes in. A cloud backend stops at its spend cap, checked against counters the store
vouches for (``reconcile.ensure_counters``), never against a spend Redis lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from celery import Celery

from draftfleet import redis_keys as rk
from draftfleet.assign import assigned, published
from draftfleet.claims import CLAIM_TTL_S, Claims
from draftfleet.identity import task_problem
from draftfleet.ledger import ADMITTED, CLAIMED, LOST, WAIT, Admission, Ledger, SpendHold, micro_usd, publish_value
from draftfleet.reconcile import Reconciler, ensure_counters
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import ChargeRecord, GenerationSettings, PromptTask, ResponseRecord, WorkerReport
from draftfleet.store import Store, new_charge_id
from draftfleet.workers.backends import Backend, Halt
from draftfleet.workers.leases import Lease, Leases
from draftfleet.workers.tally import Tally

log = logging.getLogger("draftfleet.worker")

ASSIGNMENT_POLL_S = 1.0
ADMISSION_WAIT_S = 1.0
IDLE_QUEUE = rk.QUEUE_PREFIX + "_idle"


def worst_prompt_tokens(task: PromptTask) -> int:
    """The most tokens any tokenizer can make of ``task``'s prompt: its bytes (a byte-level BPE
    never makes more tokens than bytes), plus a chat template's allowance per message and for the
    generation prompt."""
    texts = [m.content or "" for m in task.messages] + [getattr(m, "reasoning", None) or "" for m in task.messages]
    system = task.settings.system_prompt or ""
    return sum(len(t.encode()) for t in (*texts, system)) + 16 * (len(task.messages) + 2)


SETTLE_EVERY_S = 10  # a worker's own pass over the store for buried reservations, at most this often a dataset


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
        self.leases = Leases(self.ledger, self.claims, backend.concurrency)
        self.tally = Tally(self.ledger, self.claims, self.leases)
        self._lock = threading.Lock()
        self.paused: str | None = None
        self._stop = threading.Event()
        self.follow_all = follow_all  # started without --dataset: follows every dataset enqueued
        self.budgets: dict[str, int | None] = {d.name: d.budget_tokens for d in cfg.datasets}
        self.published_budgets: dict[str, str] = {}  # dataset -> its budget as rk.BUDGETS holds it (leases are checked by it)
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

    def claim_admit(self, task: PromptTask, budget: int) -> tuple[str | None, Admission | None, Lease | None]:
        """Claim a single answer's key and admit it under its budget: (the claim's token, None when a
        twin holds it; the admission, None when the caller must still admit it; the lease it was
        admitted under). A slot of this worker's lease (workers/leases.py) needs only the claim,
        read in one round trip with the budget as published: a lease granted under another budget
        admits nothing (the task is admitted alone). Without a lease, claim and admission go in
        one round trip (``Ledger.claim_admit``)."""
        admission: Admission | None = None
        max_tokens = task.settings.max_tokens
        key = rk.claim(task.dataset, task.key)
        lease = self.leases.admit(task.dataset, max_tokens, budget)
        if lease is not None:
            published = ""

            def claim_reading_budget(token: str) -> bool:
                nonlocal published
                pipe = self.r.pipeline(transaction=False)
                pipe.set(key, token, nx=True, ex=CLAIM_TTL_S)
                pipe.hget(rk.BUDGETS, task.dataset)
                took, value = pipe.execute()
                published = value.decode() if value else ""
                return bool(took)

            token = self.claims.acquire(key, task.dataset, claim_reading_budget)
            if token is None:
                self.leases.done(lease)
                return None, None, None
            if not self.leases.still_good(lease, published):
                return token, None, None
            return token, Admission(ADMITTED, max_tokens, published), lease

        def take(token: str) -> bool:
            nonlocal admission
            admission = self.ledger.claim_admit(task.dataset, task.key, token, CLAIM_TTL_S, budget, max_tokens)
            return admission.verdict != CLAIMED

        return self.claims.acquire(key, task.dataset, take), admission, None

    def release(self, task: PromptTask, token: str) -> None:
        self.claims.release(rk.claim(task.dataset, task.key), task.dataset, token)

    def finish(self, record: ResponseRecord, token: str, lease: Lease | None,
               holds: list[SpendHold] | tuple[SpendHold, ...] = ()) -> None:
        """The stored single answer is counted, its reservation settled (or its lease's slot taken
        out), its spend ``holds`` let go (in the step its cost enters the spend) and its claim
        released in the tally's next batch (workers/tally.py): until then the cap counts the holds.
        A paid one on a capped backend whose cost its holds do not cover (it held nothing: no
        prices, the cap is checked against the spend, :meth:`check_spend`; or the provider billed
        more than the configured prices) is counted now, so that the cap sees it before this
        worker's next request: when that fails, it may have landed all the same, so its lease's
        slot is neither freed nor given back (``Leases.lost``)."""
        if lease is not None:
            self.leases.hand(lease)
        at_once = (self.spend_cap is not None and bool(record.cost_usd)
                   and micro_usd(record.cost_usd) > sum(h.micro_usd for h in holds))
        try:
            self.tally.add(record, rk.claim(record.dataset, record.key), token, lease, holds=holds, at_once=at_once)
        except BaseException:
            if lease is not None:
                self.leases.unhand(lease)
                self.leases.lost(lease)
            raise

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
        self.tally.start()
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
        self.leases.retire(set())  # the unused slots of its leases go back
        self.tally.close()  # what this worker stored is counted before it goes
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
                self.published_budgets[name] = publish_value(live[name].budget_tokens, live[name].budget_rule)
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
            consumed = set() if self.paused else self.allowed - held
        self.leases.retire(consumed, self.published_budgets)  # what it no longer takes, it reserves no budget for
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

    def settle_buried(self, dataset: str) -> None:
        """Admission waits on reservations of dead tasks (buried: their claims lapsed, their answers
        maybe stored, not counted): count the store and free the rest now, in the background, as the
        reconciler's pass would (a fleet may run none). One worker of the fleet at a time, at most
        every ``SETTLE_EVERY_S`` a dataset."""
        try:
            if not self.r.set(rk.settling(dataset), self.hostname, nx=True, ex=SETTLE_EVERY_S):
                return
        except redis.RedisError:
            return

        def run() -> None:
            try:
                drift = Reconciler(self.store, self.r).reconcile(dataset)
                if drift.stale_reservations:
                    log.info("%s: freed %d reservation(s) of dead tasks once the store was counted", dataset,
                             drift.stale_reservations)
            except Exception as exc:  # noqa: BLE001 - the reconciler's next pass does it
                log.warning("%s: counting the store for the reservations of dead tasks failed: %s", dataset, exc)

        threading.Thread(target=run, name="draftfleet-settle", daemon=True).start()

    def charge(self, task: PromptTask, backend: str, cost_usd: float, reason: str) -> None:
        """A generation paid for that no record will carry: kept in the store, then into the spend."""
        if not cost_usd:
            return
        charge = ChargeRecord(id=new_charge_id(), backend=backend, cost_usd=cost_usd, dataset=task.dataset,
                              key=task.key, reason=reason, worker=self.hostname, at=time.time())
        self.store.put_charge(charge)
        self.ledger.charge(charge)

    def hold_spend(self, task: PromptTask, sent: PromptTask, token: str, turn: int | None) -> SpendHold | None:
        """Before a paid request on a capped backend whose prices are configured: hold the most it
        can cost (``Ledger.spend_hold``), so that requests in flight can never take the spend past
        the cap; near the cap the hold's max_tokens is less than ``sent``'s (the request is asked
        with it). None where nothing is held: no cap, or no prices to bound a request by (then the
        spend is checked before it, :meth:`check_spend`). Raises ``Halt`` as check_spend does, and
        while what is in flight may still come in cheaper (paused until it has)."""
        if self.spend_cap is None:
            return None
        prices = self.cfg.clouds[self.backend.name]
        if not (prices.price_input_per_mtok or prices.price_output_per_mtok):
            self.check_spend()
            return None
        # $/Mtok is micro-USD per token. A prompt is never more tokens than its bytes (byte-level
        # BPE) plus its template's few per message: the provider's own count cannot pass that.
        prompt = worst_prompt_tokens(sent) * prices.price_input_per_mtok
        name = self.backend.name
        verdict, hold = self.ledger.spend_hold(name, task.dataset, task.key, turn, token, prompt,
                                               prices.price_output_per_mtok, sent.settings.max_tokens, self.spend_cap)
        if verdict == LOST and self.counters_known():
            verdict, hold = self.ledger.spend_hold(name, task.dataset, task.key, turn, token, prompt,
                                                   prices.price_output_per_mtok, sent.settings.max_tokens, self.spend_cap)
        if verdict == ADMITTED:
            return hold
        if verdict == LOST:
            raise Halt("counters_rebuilding", "Redis lost the spend counters; another process is rebuilding "
                       "them from the store", ready=self.ledger.counters_built)
        spent = self.ledger.spend_usd(name)
        if verdict == WAIT:
            raise Halt("spend_cap_in_flight", f"{name} has spent ${spent:.2f} of its max_spend_usd "
                       f"${self.spend_cap:.2f}, ${self.ledger.spend_held_usd(name):.2f} more held by requests in "
                       "flight: waiting for them, which may cost less than they can",
                       ready=lambda: self.ledger.spend_held_usd(name) == 0)
        raise Halt("spend_cap", f"{name} has spent ${spent:.2f} of its max_spend_usd ${self.spend_cap:.2f} "
                   "(less than 1% of it left): raise it in the config to go on")

    def release_spend(self, holds: list[SpendHold]) -> None:
        """Let go of ``holds`` once their requests' costs are in the spend (or were never billed)."""
        while holds:
            self.ledger.spend_release(self.backend.name, holds[-1])
            holds.pop()

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
