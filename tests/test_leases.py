"""A worker's leases of a budget (workers/leases.py) against a real Redis: one script admits many
tasks, each slot is taken out once however often its count is sent, a budget change retires every
lease before it admits again, and nothing a lease holds outlives it (issues 32 and 41).

Each test guards a line of the lease code whose weakening once passed every test (issue 41): a
lease granted with too little room, its size blind to the committed tokens or to the half-room
margin, the LEASE script not scheduling its due time, a return under another token, MOST_SLOTS
ignored, a count given up not marking the lease stuck, a dataset dropped without its lease retired.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from draftfleet import redis_keys as rk
from draftfleet.claims import Claims
from draftfleet.ledger import ADMITTED, CLOSED, NO_LEASE, Ledger
from draftfleet.ledger_scripts import LEASE
from draftfleet.workers import leases as leases_mod
from draftfleet.workers.leases import MOST_SLOTS, Leases
from draftfleet.workers.runtime import Runtime
from draftfleet.workers.tally import Tally

from .test_ledger import _rec

CAP = 100


@pytest.fixture(autouse=True)
def _counters_built(redis_server):
    redis_server.client().set(rk.COUNTERS_BUILT, "empty store")


def _book(r, inflight: int = 4) -> tuple[Ledger, Claims, Leases]:
    ledger, claims = Ledger(r), Claims(r, "lease@test")
    return ledger, claims, Leases(ledger, claims, inflight)


def _reserved(r) -> int:
    return int(r.hget(rk.reserved_sum("ds"), "r") or 0)


def _held_lease_claims(r) -> list[str]:
    prefix = rk.claim("ds", "")
    return [k.decode()[len(prefix):] for k in r.scan_iter(match=prefix + "*") if rk.is_lease(k.decode()[len(prefix):])]


def test_one_script_admits_a_lease_of_tasks_and_each_count_takes_its_slot_out(redis_server):
    """Eight tasks from one LEASE: the lease reserves eight caps, each counted result takes one out,
    and the last count drops the reservation and the lease's claim (the worker forgets it)."""
    r = redis_server.client()
    ledger, claims, book = _book(r)
    r.script_load(LEASE)  # (else redis-py's first EVALSHA meets NOSCRIPT and is sent again)
    before = r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    taken = [book.admit("ds", CAP, 10**6) for _ in range(8)]
    assert all(lease is taken[0] for lease in taken) and taken[0].free == 0 and taken[0].retired
    lease = taken[0]
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] - before == 1  # one script for eight admissions
    assert _reserved(r) == 8 * CAP and r.hget(rk.reservations("ds"), lease.name).decode() == f"{8 * CAP}:{lease.token}"
    assert _held_lease_claims(r) == [lease.name]
    keys = [secrets.token_hex(32) for _ in range(8)]
    for i, key in enumerate(keys[:5]):
        book.hand(lease)
        assert ledger.count_batch([(_rec(key, 10 + i), "t", lease.name, lease.cap)]) == 1
        book.counted(lease)
        assert _reserved(r) == (8 - i - 1) * CAP
    for key in keys[5:]:
        book.hand(lease)
    ledger.count_batch([(_rec(k, 10), "t", lease.name, lease.cap) for k in keys[5:]])
    for _ in keys[5:]:
        book.counted(lease)
    assert not r.hlen(rk.reservations("ds")) and not r.exists(rk.reserved_sum("ds"))
    assert not _held_lease_claims(r) and (lease.claim, lease.token) not in claims._held
    assert not list(r.scan_iter(match=rk.lease_taken_prefix("ds") + "*"))  # its taken-out set went with it
    assert ledger.dataset_totals("ds")["responses"] == 8


def test_a_count_sent_twice_takes_its_slots_out_once(redis_server):
    """A batch that ran in Redis but whose reply was lost is sent again by the tally: a lease of
    8 x 100, 4 results counted twice, still reserves the 4 slots not used (issue 41: it reserved
    none, and the worker went on admitting on slots Redis no longer held)."""
    r = redis_server.client()
    ledger, _, book = _book(r)
    lease = book.admit("ds", CAP, 10**6)
    results = [(_rec(secrets.token_hex(32), 30), "t", lease.name, lease.cap) for _ in range(4)]
    assert ledger.count_batch(results) == 4
    assert ledger.count_batch(results) == 0  # the retry: counted once, slots out once
    assert ledger.count_batch(results[1:3]) == 0
    assert _reserved(r) == 4 * CAP and ledger.dataset_totals("ds")["completion_tokens"] == 120


def test_a_paid_count_whose_reply_is_lost_frees_no_slot(redis_server, monkeypatch):
    """A paid result is counted at once; when that call fails it may have landed all the same, so
    its slot is neither freed for another task nor given back (``Leases.lost``): the worker can
    never spend a slot Redis took out. The lease's claim goes at its end (the due pass drops the
    rest)."""
    r = redis_server.client()
    ledger, claims, book = _book(r)
    lease = book.admit("ds", CAP, 10**6)
    tally = Tally(ledger, claims, book)  # unstarted: every result is counted at once, as a paid one

    def lands_then_fails(results, now=None):
        Ledger.count_batch(ledger, results)
        raise __import__("redis").ConnectionError("reply lost")

    monkeypatch.setattr(ledger, "count_batch", lands_then_fails)
    rec = _rec(secrets.token_hex(32), 40)
    token = claims.acquire(rk.claim("ds", rec.key), "ds")
    book.hand(lease)
    with pytest.raises(Exception):
        tally.add(rec, rk.claim("ds", rec.key), token, lease)
    book.unhand(lease)
    book.lost(lease)
    assert lease.free == 7 and lease.running == 0 and lease.stuck
    assert _reserved(r) == 7 * CAP  # Redis took the slot out: the worker holds seven, not eight
    book.retire(set())
    assert not r.hexists(rk.reservations("ds"), lease.name) and not _held_lease_claims(r)


def test_a_task_that_stores_nothing_frees_its_slot_and_unused_slots_go_back(redis_server, monkeypatch):
    """A freed slot serves the next task; a lease past LEASE_S admits no more, its free slots go back
    at once, and its claim goes once its last running task ends."""
    r = redis_server.client()
    ledger, claims, book = _book(r)
    lease = book.admit("ds", CAP, 10**6)
    book.done(lease)  # a duplicate, a failure: nothing counted
    assert book.admit("ds", CAP, 10**6) is lease and lease.free == 7 and lease.running == 1
    monkeypatch.setattr(leases_mod, "LEASE_S", 0.0)
    book.retire({"ds"})
    assert lease.retired and _reserved(r) == CAP  # seven slots back, the running one held
    book.done(lease)
    assert not r.hlen(rk.reservations("ds")) and not _held_lease_claims(r)


def test_a_lease_return_under_another_token_takes_nothing(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    name = rk.LEASE_PREFIX + "mine"
    assert ledger.lease("ds", name, "w:1:mine", 60, 10**6, 8, CAP)[:2] == (ADMITTED, 8)
    ledger.lease_return("ds", name, "w:1:other", 8 * CAP)
    assert _reserved(r) == 8 * CAP and r.exists(rk.claim("ds", name))
    ledger.lease_return("ds", name, "w:1:mine", 3 * CAP)
    assert _reserved(r) == 5 * CAP
    ledger.lease_return("ds", name, "w:1:mine", 5 * CAP)
    assert not r.hexists(rk.reservations("ds"), name) and not r.exists(rk.claim("ds", name))


def _runtime(r, book: Leases, claims: Claims, ledger: Ledger, allowed: set[str]) -> Runtime:
    """A runtime's admission and steering alone (no Celery, backend or store)."""
    rt = object.__new__(Runtime)
    rt.r, rt.ledger, rt.claims, rt.leases = r, ledger, claims, book
    rt._lock, rt.held, rt.paused, rt._consumer = threading.Lock(), {}, None, None
    rt.allowed, rt.published_budgets = set(allowed), {}
    return rt


def test_a_dataset_no_longer_consumed_gives_its_lease_back_at_once(redis_server):
    """Drained, pivoted away or paused: the worker's lease of that dataset ends when the runtime
    stops consuming it, not LEASE_S later, so its unused slots are the other kind's budget at once."""
    r = redis_server.client()
    ledger, claims, book = _book(r)
    rt = _runtime(r, book, claims, ledger, {"ds", "other"})
    lease = book.admit("ds", CAP, 10**6)
    other = book.admit("other", CAP, 10**6)
    rt.sync()
    assert not lease.retired and not other.retired
    rt.allowed = {"other"}  # ds drained: its running task keeps one slot until it ends
    rt.sync()
    assert lease.retired and _reserved(r) == CAP and not other.retired
    book.hand(lease)
    ledger.count_batch([(_rec(secrets.token_hex(32), 7), "t", lease.name, lease.cap)])
    book.counted(lease)
    assert not r.hexists(rk.reservations("ds"), lease.name) and _held_lease_claims(r) == []


def test_a_lease_takes_half_the_room_left_after_committed_and_reserved_tokens(redis_server):
    """n slots of a task's max_tokens, n = half of budget - committed - reserved, in slots: exactly,
    so neither the counted tokens nor the reservations of others nor the half can be left out."""
    r = redis_server.client()
    ledger = Ledger(r)
    assert ledger.count(_rec("done", 600))  # committed
    r.set(rk.claim("ds", "running"), "w", ex=60)
    assert ledger.admit("ds", "running", "w", 5_000, 400).granted == 400  # reserved
    verdict, slots, _ = ledger.lease("ds", rk.LEASE_PREFIX + "a", "w:1:a", 60, 5_000, 128, CAP)
    assert (verdict, slots) == (ADMITTED, (5_000 - 600 - 400) // (2 * CAP))
    verdict, slots2, _ = ledger.lease("ds", rk.LEASE_PREFIX + "b", "w:1:b", 60, 5_000, 128, CAP)
    assert (verdict, slots2) == (ADMITTED, (5_000 - 600 - 400 - slots * CAP) // (2 * CAP))


def test_no_lease_near_the_budget_nor_once_closed(redis_server):
    """With less than two slots' worth in half the room, or closed, nothing is granted and tasks are
    admitted one by one (the budget's last stretch is admitted task by task)."""
    r = redis_server.client()
    ledger, _, book = _book(r, inflight=64)
    assert ledger.lease("ds", rk.LEASE_PREFIX + "c", "w:1:c", 60, 4 * CAP - 1, 128, CAP)[:2] == (NO_LEASE, 0)
    assert not r.exists(rk.claim("ds", rk.LEASE_PREFIX + "c"))  # refused: its claim let go in the same step
    assert ledger.lease("ds", rk.LEASE_PREFIX + "e", "w:1:e", 60, 4 * CAP, 128, CAP)[:2] == (ADMITTED, 2)
    assert book.admit("ds", CAP, 5 * CAP) is None  # the worker admits one by one, and asks again later
    r.set(rk.closed("ds"), 10)
    assert ledger.lease("ds", rk.LEASE_PREFIX + "d", "w:1:d", 60, 10**6, 128, CAP)[0] == CLOSED


def test_a_whole_answers_dataset_takes_no_lease(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    r.hset(rk.BUDGETS, "ds", "100000 whole")
    assert ledger.lease("ds", rk.LEASE_PREFIX + "w", "w:1:w", 60, 10**5, 8, CAP) == (ADMITTED, 0, "100000 whole")


def test_a_lease_asks_for_at_most_most_slots(redis_server):
    r = redis_server.client()
    _, _, book = _book(r, inflight=10_000)
    assert book.slots == MOST_SLOTS
    lease = book.admit("ds", 1, 10**9)
    assert lease.free == MOST_SLOTS - 1 and _reserved(r) == MOST_SLOTS


def test_a_dead_workers_lease_lapses_with_its_claim(redis_server):
    """The lease's reservation belongs to its claim: the claim gone (its worker killed), admission's
    due pass buries it at the claim's TTL (LEASE scheduled it then), and once the store is counted
    (the results its tasks stored are in the totals) the budget's room comes back."""
    r = redis_server.client()
    ledger = Ledger(r)
    name = rk.LEASE_PREFIX + "dead"
    assert ledger.lease("ds", name, "w:1:x", 1, 10**6, 8, CAP)[:2] == (ADMITTED, 8)
    r.delete(rk.claim("ds", name))
    r.set(rk.claim("ds", "k"), "w:2:y", ex=60)
    ledger.admit("ds", "k", "w:2:y", 10**6, 50)
    assert r.hexists(rk.reservations("ds"), name)  # not due yet
    time.sleep(1.1)
    ledger.release("ds", "k", "w:2:y")
    r.set(rk.claim("ds", "k2"), "w:2:z", ex=60)
    assert ledger.claim_admit("ds", "k3", "w:2:q", 60, 10**6, 50).verdict == ADMITTED
    assert r.hget(rk.reservations("ds"), name) == f"{8 * CAP}:".encode() and _reserved(r) == 8 * CAP + 50
    assert ledger.settle_dead("ds", ledger.now_ms()) == 1  # as the reconciler does, after counting the store
    assert not r.hexists(rk.reservations("ds"), name) and _reserved(r) == 50


def test_a_count_the_tally_gives_up_on_marks_the_lease_stuck_and_its_claim_goes(redis_server):
    """A batch that fails for a bug: its records are stored (the reconciler counts them) but their
    slots were not taken out, so the lease is stuck: at its end its claim is deleted, and the due
    pass drops what its reservation still holds."""
    r = redis_server.client()
    ledger, claims, book = _book(r)
    tally = Tally(ledger, claims, book)
    lease = book.admit("ds", CAP, 10**6)
    rec = _rec(secrets.token_hex(32), 10)
    token = claims.acquire(rk.claim("ds", rec.key), "ds")
    book.hand(lease)
    tally._abandon([(rec, rk.claim("ds", rec.key), token, lease)])
    assert lease.stuck
    book.retire(set())
    assert not r.exists(lease.claim) and (lease.claim, lease.token) not in claims._held


def test_a_changed_budget_retires_every_lease_before_it_admits_again(redis_server):
    """The budget cut to 50 while a lease of 128 slots is held: the next task of that lease claims
    its key with a read of the budget as published, finds it changed, and is admitted alone; the
    lease's unused slots go back at once (issue 41: 127 of 128 slots were admitted after the cut).
    Raised, or removed, the same. The runtime's watch retires an idle lease too."""
    r = redis_server.client()
    ledger, claims, book = _book(r, inflight=64)
    rt = _runtime(r, book, claims, ledger, {"ds"})
    r.hset(rk.BUDGETS, "ds", str(10**6))

    def task(key: str):
        return type("T", (), {"dataset": "ds", "key": key, "settings": type("S", (), {"max_tokens": CAP})()})()

    token, admission, lease = rt.claim_admit(task("a"), 10**6)
    assert lease is not None and admission.granted == CAP and lease.free == 127
    r.hset(rk.BUDGETS, "ds", "50")  # lowered
    token, admission, second = rt.claim_admit(task("b"), 10**6)
    assert token is not None and admission is None and second is None  # admitted alone by the task
    assert lease.retired and _reserved(r) == CAP  # the running one's slot, the rest back
    got = ledger.admit("ds", "b", token, 10**6, CAP)
    assert got.verdict != ADMITTED  # 50 left is less than what is in flight: it waits
    # an idle lease: retired by the one-second watch once the published budget moved
    r.hset(rk.BUDGETS, "other", str(10**6))
    idle = book.admit("other", CAP, 10**6)
    book.retire({"ds", "other"}, {"other": str(10**6)})
    assert not idle.retired
    book.retire({"ds", "other"}, {"other": str(2 * 10**6)})
    assert idle.retired


def test_a_lease_admits_nothing_once_redis_lost_its_state(redis_server):
    """Taken before a flush (the claims' STATE marker moved), a lease admits no more: the next task
    gets a new lease, on counters rebuilt from the store."""
    r = redis_server.client()
    _, claims, book = _book(r)
    first = book.admit("ds", CAP, 10**6)
    claims._state_seen = b"another stamp"  # what the beat records after Redis lost its state
    second = book.admit("ds", CAP, 10**6)
    assert second is not first and first.retired and second.state == b"another stamp"
    r.set(first.claim, first.token)  # its task ends: its claim goes, also one the beat put back
    book.done(first)
    assert _held_lease_claims(r) == [second.name]
    r.delete(rk.COUNTERS_BUILT)  # lost: nothing admitted on counters the store does not vouch for
    book.retire(set())
    assert book.admit("ds", CAP - 1, 10**6) is None
