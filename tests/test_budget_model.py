"""A model of the fleet's budget against the real Redis scripts (issue 41, item 5).

Hypothesis drives random interleavings of what a fleet does to one dataset's budget: workers admit
tasks through the worker's own path (a lease's slot, else one by one: ``Runtime.claim_admit``) or
alone (as a conversation does), answers of any length up to what each task was granted, counts
with their replies lost and sent again, counts given up (stored, never counted), tasks ending with
nothing stored, workers killed (their claims lapse) right after storing, time passing (the due
pass looks at every reservation), FLUSHALL and the rebuild from the store, the budget raised,
lowered and closed, leases retired by the worker's watch, drains, the reconciler's pass, and
provider batches (issue 43): admitted tasks moved into a batch (their grants held with no claim),
its answers counted (or stored and never counted: the batch worker died), its requests sent back,
and its holds made again from the store after a flush. Answers may be paid (a cloud backend with a
spend cap): the request holds its worst cost first, and the tally's batch lets the hold go in the
step that puts the cost in the spend, with the same lost replies and retries.

Beside it, the truth: what the store holds and what each live task may still make. After every
step, while the counters are the store's: no key counted twice and the counters equal what the
records hold (each backend's spend too: what its counted records cost, once); spent + held covers
what was billed; a counted answer holds nothing; Redis's counted + reserved covers the truth (stored + what live tasks may still
make), so admission can never grant room that is spent; and at each admission the truth plus the
grant fits the budget in force. At the end every task is finished, the reconciler runs, and tasks
are admitted and answered in full until the dataset closes: stored is within the floor (1% of the
budget, never more than a task's max_tokens) below the budget, never above the budget in force at
the last admission.

``DRAFTFLEET_MODEL_EXAMPLES`` / ``DRAFTFLEET_MODEL_STEPS`` size it: CI runs a small profile, ``python
-m bench budgets`` a long one.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from draftfleet import redis_keys as rk
from draftfleet.claims import Claims
from draftfleet.ledger import ADMITTED, CLOSED, LOST, REFUSED, WAIT, Ledger, floor_tokens, publish_value
from draftfleet.reconcile import Reconciler
from draftfleet.schemas.records import (BatchRecord, BatchRequest, GenerationSettings, Message, PromptTask,
                                       ResponseRecord, Usage, WorkerReport)
from draftfleet.store.base import new_batch_id
from draftfleet.store.folder import FileStore
from draftfleet.workers.leases import Leases
from draftfleet.workers.runtime import Runtime
from draftfleet.workers.tally import Tally

DS = "ds"
EXAMPLES = int(os.environ.get("DRAFTFLEET_MODEL_EXAMPLES", "60"))
STEPS = int(os.environ.get("DRAFTFLEET_MODEL_STEPS", "50"))
WORKERS = 3


PER_TOKEN = 2.0  # a paid answer's micro-USD per output token (its prompt: PROMPT_MICRO)
PROMPT_MICRO = 50


def _record(key: str, tokens: int, backend: str, cost_usd: float = 0.0) -> ResponseRecord:
    return ResponseRecord(
        key=key, dataset=DS, source="model:1", settings_id="s", messages=[Message(role="user", content="q")],
        system_prompt_used=False, text="t", output_ids=[7] * tokens, prompt_tokens=3, completion_tokens=tokens,
        finish_reason="length", truncated=False, backend=backend, backend_kind="gpu", model="m", token_source="exact",
        usage=Usage(), cost_usd=cost_usd, cost_source="provider" if cost_usd else "none", latency_s=0.01,
        attempts=1, worker=backend, created_at=time.time())


@dataclass
class Task:
    key: str
    worker: int
    token: str
    granted: int
    lease: object | None  # workers.leases.Lease
    budget: int  # the budget in force when it was admitted


class Worker:
    """One worker process as the budget sees it: its claims, its leases and its tally (no thread:
    counted when the model says), and the runtime's admission path run on them."""

    def __init__(self, r, ledger: Ledger, n: int):
        self.name = f"w{n}-{os.urandom(3).hex()}"
        self.claims = Claims(r, self.name)
        self.leases = Leases(ledger, self.claims, inflight=4)
        self.tally = Tally(ledger, self.claims, self.leases)
        self.rt = SimpleNamespace(leases=self.leases, claims=self.claims, ledger=ledger, r=r)
        self.beat()

    def beat(self) -> None:
        self.claims.beat(WorkerReport(hostname=self.name, kind="gpu", backend=self.name), mark_state=True)


def _task(key: str, max_tokens: int):
    return SimpleNamespace(key=key, dataset=DS, settings=SimpleNamespace(max_tokens=max_tokens))


class BudgetModel(RuleBasedStateMachine):
    def __init__(self, r, root):
        super().__init__()
        self.r = r
        r.flushall()
        r.set(rk.COUNTERS_BUILT, "model")
        self.store = FileStore(root / os.urandom(4).hex())
        self.store.prepare()
        self.ledger = Ledger(r)
        self.keys = (f"{n:064x}" for n in itertools.count(1))
        self.tasks: list[Task] = []
        self.stored: dict[str, int] = {}  # the store's truth: key -> completion tokens
        self.peak = 0  # the highest budget in force at an admission
        self.flushed = False
        self.workers: list[Worker] = []
        self.batched: dict[str, tuple[str, int]] = {}  # key -> (its batch's id, its grant): held by a batch
        self.billed: dict[str, int] = {}  # backend -> micro-USD its paid answers cost (each billed once)
        self.costs: dict[str, tuple[str, int]] = {}  # key -> (backend, micro-USD) of a stored paid answer

    # -- set-up and helpers ---------------------------------------------------------------
    @initialize(max_tokens=st.sampled_from([1, 8, 64, 512, 16_384, 32_768]), answers=st.integers(0, 60),
                part=st.floats(0, 1))
    def setup(self, max_tokens: int, answers: int, part: float) -> None:
        """A budget of ``answers`` whole answers and a part of one more: from under one answer (5,000
        at 32,768) to sixty (the end fills the room in at most a few hundred steps)."""
        self.budget, self.max_tokens = max(1, answers * max_tokens + int(part * max_tokens)), max_tokens
        self.r.hset(rk.BUDGETS, DS, publish_value(self.budget))
        self.workers = [Worker(self.r, self.ledger, n) for n in range(WORKERS)]

    def _admitted(self, key: str, worker: int, token: str, granted: int, lease) -> None:
        assert 1 <= granted <= self.max_tokens
        event("admitted under a lease" if lease is not None else "admitted alone")
        if granted < self.max_tokens:
            event("admitted with less than max_tokens (the last stretch)")
        self.tasks.append(Task(key, worker, token, granted, lease, self.budget))
        self.peak = max(self.peak, self.budget)
        truth = sum(self.stored.values()) + self._outstanding()
        assert truth <= self.budget, f"admitted {granted} with {truth - granted} spent or in flight of {self.budget}"

    def _outstanding(self) -> int:
        return sum(t.granted for t in self.tasks) + sum(g for _, g in self.batched.values())

    def _verdict(self, w: Worker, key: str, token: str, verdict: int) -> None:
        """A task not admitted lets go of its claim; a refusal closes the dataset (purged)."""
        event(f"verdict {({WAIT: 'WAIT', REFUSED: 'REFUSED', CLOSED: 'CLOSED', LOST: 'LOST'})[verdict]}")
        w.claims.release(rk.claim(DS, key), DS, token)
        if verdict == REFUSED:
            self.ledger.purge_closed(DS)

    # -- admission --------------------------------------------------------------------------
    @precondition(lambda self: self.workers)
    @rule(worker=st.integers(0, WORKERS - 1))
    def admit_as_the_worker_does(self, worker: int) -> None:
        """``Runtime.claim_admit``: a slot of this worker's lease (claim + published budget in one
        round trip), else claim and admission in one step."""
        w, key = self.workers[worker], next(self.keys)
        token, admission, lease = Runtime.claim_admit(w.rt, _task(key, self.max_tokens), self.budget)
        assert token is not None
        if admission is None:  # the lease was granted under another budget: admitted alone
            admission = self.ledger.admit(DS, key, token, self.budget, self.max_tokens)
        if admission.verdict == ADMITTED:
            self._admitted(key, worker, token, min(self.max_tokens, admission.granted), lease)
        else:
            assert admission.verdict in (WAIT, REFUSED, CLOSED, LOST) and lease is None
            self._verdict(w, key, token, admission.verdict)

    @precondition(lambda self: self.workers)
    @rule(worker=st.integers(0, WORKERS - 1))
    def admit_alone(self, worker: int) -> None:
        """Claimed, then admitted by itself (a conversation's path; a lease refused)."""
        w, key = self.workers[worker], next(self.keys)
        token = w.claims.acquire(rk.claim(DS, key), DS)
        admission = self.ledger.admit(DS, key, token, self.budget, self.max_tokens)
        if admission.verdict == ADMITTED:
            self._admitted(key, worker, token, admission.granted, None)
        else:
            self._verdict(w, key, token, admission.verdict)

    # -- results ----------------------------------------------------------------------------
    @precondition(lambda self: self.tasks)
    @rule(which=st.integers(0, 10**6), share=st.floats(0, 1),
          fault=st.sampled_from(["none", "none", "reply_lost_sent_again", "reply_lost_given_up", "never_landed"]),
          paid=st.booleans())
    def answer(self, which: int, share: float, fault: str, paid: bool = False) -> None:
        """The task stores an answer of at most its grant; the tally counts it (or not). ``paid``:
        its request held its worst cost against its backend's spend cap first (``Ledger.spend_hold``,
        as ``Runtime.hold_spend``), billed at most that; the hold goes to the tally with the result."""
        task = self.tasks.pop(which % len(self.tasks))
        w = self.workers[task.worker]
        made = min(task.granted, int(share * (task.granted + 1)))
        holds: tuple = ()
        cost = 0
        if paid and self.ledger.counters_built():  # (on lost counters the hold is LOST: nothing is asked)
            verdict, hold = self.ledger.spend_hold(w.name, DS, task.key, None, task.token, PROMPT_MICRO, PER_TOKEN,
                                                   task.granted, 10.0**6)
            assert verdict == ADMITTED and hold.max_tokens == task.granted
            holds = (hold,)
            cost = PROMPT_MICRO // 2 + int(PER_TOKEN * made)  # billed: never more than held
            assert cost <= hold.micro_usd
            self.billed[w.name] = self.billed.get(w.name, 0) + cost
            self.costs[task.key] = (w.name, cost)
            event("a paid answer, its hold handed to the tally")
        rec = _record(task.key, made, w.name, cost / 1e6)
        assert self.store.put(rec)
        self.stored[task.key] = made
        claim = rk.claim(DS, task.key)
        if task.lease is not None:
            w.leases.hand(task.lease)
        w.claims.finish(DS)
        batch = [(rec, claim, task.token, task.lease, holds)]
        if fault == "none":
            w.tally._land(batch, retry=False)
        elif fault == "reply_lost_sent_again":  # the script ran, its reply was lost, the tally sends it again
            self.ledger.count_batch(_results(batch))
            w.tally._land(batch, retry=False)
        elif fault == "reply_lost_given_up":  # ran, reply lost, and the tally gave up on it
            self.ledger.count_batch(_results(batch))
            w.tally._abandon(batch)
        else:  # Redis failed under every try: stored, not counted, given up
            w.tally._abandon(batch)
        if holds and fault != "never_landed":  # counted: its cost is in the spend, its hold gone with it
            assert holds[0].id not in self.ledger.spend_holds(w.name), "a counted answer's hold was kept"

    @precondition(lambda self: self.tasks)
    @rule(which=st.integers(0, 10**6))
    def end_with_nothing_stored(self, which: int) -> None:
        """A task fails or is handed back: its reservation (or slot) goes back."""
        task = self.tasks.pop(which % len(self.tasks))
        w = self.workers[task.worker]
        if task.lease is not None:
            w.leases.done(task.lease)
        else:
            self.ledger.release(DS, task.key, task.token)
        w.claims.release(rk.claim(DS, task.key), DS, task.token)

    # -- provider batches (workers/batch.py) -------------------------------------------------
    @precondition(lambda self: any(t.lease is None for t in self.tasks))
    @rule(n=st.integers(1, 6))
    def submit_batch(self, n: int) -> None:
        """The batch worker's steps 1-3: the batch recorded in the store, each grant held by it (no
        claim), the task's reservation and claim let go."""
        mine = [t for t in self.tasks if t.lease is None][:n]
        batch = BatchRecord(id=new_batch_id(), backend="batchy", shape="openai", dataset=DS, model="m", worker="b",
                            submitted_at=time.time(), updated_at=time.time(),
                            requests=[BatchRequest(task=_prompt(t.key, self.max_tokens), granted=t.granted, digest="d")
                                      for t in mine])
        self.store.put_batch(batch)
        for t in mine:
            self.tasks.remove(t)
            self.batched[t.key] = (batch.id, t.granted)
            w = self.workers[t.worker]
            self.ledger.batch_take(DS, t.key, t.granted, t.token, True)  # the batch worker's one round trip
            w.claims.forget([(rk.claim(DS, t.key), t.token)])
            w.claims.finish(DS)
        event("a provider batch submitted")

    def _settle_batched(self, key: str, state: str) -> None:
        batch_id, _ = self.batched.pop(key)
        batch = self.store.open_batch(batch_id)
        done = [msgspec.structs.replace(q, state=state) if q.task.key == key else q for q in batch.requests]
        self.store.put_batch(msgspec.structs.replace(batch, requests=done,
                                                     closed=all(q.state != "open" for q in done)))

    @precondition(lambda self: self.batched)
    @rule(which=st.integers(0, 10**6), share=st.floats(0, 1), counted=st.booleans(), n=st.integers(1, 4),
          twice=st.booleans())
    def batch_answer(self, which: int, share: float, counted: bool, n: int = 1, twice: bool = False) -> None:
        """Up to ``n`` of a batch's answers, each of at most its grant, are stored, then counted together
        with the holds they replace (``count_batch_answers``; ``twice``: its reply lost and the count
        sent again); or the batch worker dies between the two (the reconciler counts them)."""
        first = sorted(self.batched)[which % len(self.batched)]
        keys = [k for k in sorted(self.batched) if self.batched[k][0] == self.batched[first][0]][:n]
        if first not in keys:
            keys[-1] = first
        recs = []
        for key in keys:
            made = min(self.batched[key][1], int(share * (self.batched[key][1] + 1)))
            rec = _record(key, made, "batchy")
            assert self.store.put(rec)
            self.stored[key] = made
            recs.append(rec)
        if not counted:
            event("batch answers stored, their worker dead before counting them")
            for key in keys:
                self.batched.pop(key)  # stored: the store's truth holds them; the batch record still says open
            return
        for _ in range(1 + twice):
            self.ledger.count_batch_answers([(rec, None) for rec in recs], most=2)
        for key in keys:
            self._settle_batched(key, "stored")

    @precondition(lambda self: self.batched)
    @rule(which=st.integers(0, 10**6))
    def batch_send_back(self, which: int) -> None:
        """Expired, cancelled, a 5xx inside the batch: its hold goes, the prompt back to the queue."""
        key = sorted(self.batched)[which % len(self.batched)]
        self.ledger.batch_unhold(DS, key)
        self._settle_batched(key, "returned")

    # -- faults -----------------------------------------------------------------------------
    @precondition(lambda self: self.workers)
    @rule(worker=st.integers(0, WORKERS - 1), stored=st.booleans())
    def kill_worker(self, worker: int, stored: bool) -> None:
        """kill -9: its claims lapse (deleted here: a TTL later), its tasks vanish; ``stored``: the
        last one had stored its answer and died before counting it."""
        w = self.workers[worker]
        mine = [t for t in self.tasks if t.worker == worker]
        if stored and mine:
            t = mine[-1]
            made = t.granted
            assert self.store.put(_record(t.key, made, w.name))
            self.stored[t.key] = made
        self.tasks = [t for t in self.tasks if t.worker != worker]
        with w.claims._lock:
            held = list(w.claims._held)
        for key, _ in held:
            self.r.delete(key)
        self.workers[worker] = Worker(self.r, self.ledger, worker)

    @rule()
    def time_passes(self) -> None:
        """A claim TTL goes by: every reservation is due, and the live workers' beats ran."""
        for w in self.workers:
            w.beat()
        entries = self.r.hkeys(rk.reservations(DS))
        if entries:
            self.r.zadd(rk.reservations_due(DS), {k: 0 for k in entries})

    @rule()
    def flushall(self) -> None:
        self.r.flushall()
        self.flushed = True

    @precondition(lambda self: self.flushed)
    @rule()
    def rebuild(self) -> None:
        """As ``Reconciler.rebuild``: the beats put the claims back, the counters come from the store,
        running tasks reserve again, then the counters are marked built."""
        for w in self.workers:
            w.beat()
        self.r.hset(rk.BUDGETS, DS, publish_value(self.budget))
        Reconciler(self.store, self.r).hold_batches()
        Reconciler(self.store, self.r).reconcile(DS)
        Reconciler(self.store, self.r).settle_spend_holds()
        self.ledger.restore(DS, self.max_tokens)
        self.r.set(rk.COUNTERS_BUILT, "model")
        self.flushed = False

    @rule(factor=st.sampled_from([0.0, 0.5, 0.9, 1.1, 2.0, 10.0]))
    def change_budget(self, factor: float) -> None:
        """The operator edits the budget (0: closes it at once); enqueue publishes it, and reopens
        the dataset when room is back."""
        budget = int(self.budget * factor) if factor else sum(self.stored.values())
        self.budget = max(1, min(budget, 150 * self.max_tokens))  # the end's fill stays a few hundred tasks
        self.r.hset(rk.BUDGETS, DS, publish_value(self.budget))
        if not self.flushed and not self.ledger.budget_use(DS, self.budget, self.max_tokens).full:
            self.ledger.reopen(DS)

    @precondition(lambda self: self.workers)
    @rule(worker=st.integers(0, WORKERS - 1), drained=st.booleans())
    def watch(self, worker: int, drained: bool) -> None:
        """The runtime's one-second watch: leases of a changed budget retire; a drain retires all."""
        w = self.workers[worker]
        w.leases.retire(set() if drained else {DS}, {DS: self.ledger.published_budget(DS)})

    @rule()
    def reconciler_pass(self) -> None:
        if not self.flushed:
            Reconciler(self.store, self.r).reconcile(DS)
            Reconciler(self.store, self.r).settle_spend_holds()

    # -- invariants -------------------------------------------------------------------------
    def _redis(self) -> tuple[int, int, dict[str, int]]:
        totals = self.ledger.dataset_totals(DS)
        held = totals.get("batch_held", 0)  # open batches' grants: in flight, beside the reservations
        counted = totals.get("completion_tokens", 0) + totals.get("paid_tokens", 0) - held
        entries = {k.decode(): int(v.decode().split(":", 1)[0]) for k, v in self.r.hgetall(rk.reservations(DS)).items()}
        return counted, int(self.r.hget(rk.reserved_sum(DS), "r") or 0) + held, entries

    @invariant()
    def counted_once_and_covered(self) -> None:
        if not self.workers or not self.ledger.counters_built():
            return
        counted, reserved, entries = self._redis()
        keys = {m.decode() for m in self.r.smembers(rk.counted_set(DS))}
        assert keys <= self.stored.keys(), "a key counted that no record holds"
        assert counted == sum(self.stored[k] for k in keys), "the counters are not what the counted records hold"
        held = self.ledger.dataset_totals(DS).get("batch_held", 0)
        assert reserved - held == sum(entries.values()), "the reserved total is not its entries' sum"
        assert held >= sum(g for _, g in self.batched.values()), "a batch's grant not held"
        truth = sum(self.stored.values()) + self._outstanding()
        if self.r.zcard(rk.reservations_dead(DS)):
            event("buried reservations held")
        assert counted + reserved >= truth, (
            f"Redis knows {counted} counted + {reserved} reserved, less than {truth} stored or in flight")
        self._spend_holds_true(keys)

    def _spend_holds_true(self, counted: set[str]) -> None:
        """Each backend's spend is what its counted records cost, once; spent + held covers what was
        billed (every paid answer is counted or still holds); a hold's total is its entries' sum."""
        for backend in {b for b, _ in self.costs.values()}:
            spent = int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0)
            held = int(self.r.hget(rk.spend_held_sum(backend), "r") or 0)
            holds = self.ledger.spend_holds(backend)
            assert held == sum(m for m, _ in holds.values()), "the held total is not its holds' sum"
            want = sum(c for k, (b, c) in self.costs.items() if b == backend and k in counted)
            assert spent == want, f"{backend}: spend {spent} µ$, its counted records cost {want}"
            if not self.flushed:  # (a flush loses the holds of what is not counted yet)
                assert spent + held >= self.billed.get(backend, 0), (
                    f"{backend}: spent {spent} + held {held} µ$, less than the {self.billed[backend]} billed")
            for hold_id in holds:
                assert hold_id.split(":")[1] not in counted, "a counted answer still holds its cost"

    def teardown(self) -> None:
        if not self.workers:
            return
        try:
            self._run_to_the_end()
        finally:
            for w in self.workers:
                w.claims.withdraw()

    def _run_to_the_end(self) -> None:
        if self.flushed:
            self.rebuild()
        for task in list(self.tasks):  # every task in flight answers in full and is counted
            self.answer(0, 1.0, "none")
        while self.batched:  # and every batch
            self.batch_answer(0, 1.0, True)
        for w in self.workers:
            w.leases.retire(set())
        self.reconciler_pass()
        for backend, billed in self.billed.items():  # every paid answer counted: its cost in the spend once, no hold
            assert self.ledger.spend_holds(backend) == {}, backend
            assert int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0) == billed, backend
        self.time_passes()
        w = self.workers[0]
        for _ in range(3 * self.budget // self.max_tokens + 100):
            key = next(self.keys)
            token = w.claims.acquire(rk.claim(DS, key), DS)
            a = self.ledger.admit(DS, key, token, self.budget, self.max_tokens)
            if a.verdict == ADMITTED:
                self._admitted(key, 0, token, a.granted, None)
                self.answer(len(self.tasks) - 1, 1.0, "none")
                continue
            self._verdict(w, key, token, a.verdict)
            if a.verdict in (REFUSED, CLOSED):
                break
            assert a.verdict == WAIT, a
            self.reconciler_pass()
            self.time_passes()
        else:
            raise AssertionError(f"the dataset never closed: {self._redis()}")
        stored = sum(self.stored.values())
        if stored > self.budget:  # the budget was lowered under what had been admitted: never above that
            assert stored <= self.peak, (stored, self.budget, self.peak)
            return
        floor = floor_tokens(self.budget, self.max_tokens)
        assert self.budget - floor < stored <= self.budget, (stored, self.budget, floor)


def _prompt(key: str, max_tokens: int) -> PromptTask:
    return PromptTask(key=key, dataset=DS, source="model:1", messages=[Message(role="user", content="q")],
                      settings=GenerationSettings(model="m", max_tokens=max_tokens, temperature=0.0, top_p=1.0),
                      settings_id="s", enqueued_at=0.0)


def _results(batch):
    """The tally's entries as ``Ledger.count_batch`` takes them (``Tally._land``'s own shape)."""
    out = []
    for rec, _, token, lease, *more in batch:
        holds = list(more[0]) if more and more[0] else []
        if holds:
            out.append((rec, token, "" if lease is None else lease.name, 0 if lease is None else lease.cap, holds))
        else:
            out.append((rec, token) if lease is None else (rec, token, lease.name, lease.cap))
    return out


def test_the_budget_holds_under_any_interleaving_of_admission_answers_and_faults(redis_server, tmp_path):
    r = redis_server.client()
    BudgetModel.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=bool(os.environ.get("CI")),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run_state_machine_as_test(lambda: BudgetModel(r, tmp_path), settings=BudgetModel.TestCase.settings)


def test_the_model_catches_a_ledger_that_frees_a_stored_answers_room(redis_server, tmp_path, monkeypatch):
    """The model is not kinder than the fleet: with the tally releasing the reservation of a record
    it stored but could not count (as it did before this issue), the model finds the budget passed,
    on the shortest way there: admit, answer, its count never landed (Redis away under every try). (A fixed sequence: a search for
    it missed now and then as the model's rules grew.)"""
    r = redis_server.client()
    monkeypatch.setitem(globals(), "event", lambda *a, **k: None)  # hypothesis's events need a hypothesis test

    def release_too(self, batch):
        for record, _, token, *_ in batch:
            self.ledger.release(record.dataset, record.key, token)
        real(self, batch)

    real = Tally._abandon
    model = BudgetModel(r, tmp_path)
    try:
        model.setup(max_tokens=64, answers=10, part=0.0)
        for mutated in (False, True):
            if mutated:
                monkeypatch.setattr(Tally, "_abandon", release_too)
            model.admit_alone(0)
            model.answer(0, 1.0, "never_landed")
            if not mutated:
                model.counted_once_and_covered()  # the real tally keeps the room held (buried) until counted
        with pytest.raises(AssertionError, match="less than"):
            model.counted_once_and_covered()
    finally:
        for w in model.workers:
            w.claims.withdraw()


def test_the_model_catches_a_rebuild_that_forgets_open_batches(redis_server, tmp_path, monkeypatch):
    """Open provider batches' grants live in Redis with no claim: a rebuild after a flush that did not
    hold them again from the store (``Reconciler.hold_batches``) would let the budget pass. The model's
    invariant says so on the shortest way there: admit, batch, flush, rebuild."""
    r = redis_server.client()
    monkeypatch.setitem(globals(), "event", lambda *a, **k: None)  # hypothesis's events need a hypothesis test
    model = BudgetModel(r, tmp_path)
    try:
        model.setup(max_tokens=64, answers=10, part=0.0)
        model.admit_alone(0)
        model.submit_batch(1)
        model.flushall()
        model.rebuild()
        model.counted_once_and_covered()  # the real rebuild holds the batch's grant again
        monkeypatch.setattr(Reconciler, "hold_batches", lambda self: 0)
        model.flushall()
        model.rebuild()
        with pytest.raises(AssertionError, match="grant not held|less than"):
            model.counted_once_and_covered()
    finally:
        for w in model.workers:
            w.claims.withdraw()
