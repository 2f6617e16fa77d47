"""A worker's leases of a budget (workers/leases.py) against a real Redis: one script admits many
tasks, each slot is taken out once, and nothing a lease holds outlives it (issue 32: admission was
one script a task, most of what a budgeted result cost the shared Redis)."""

from __future__ import annotations

import secrets

import pytest

from draftfleet import redis_keys as rk
from draftfleet.claims import Claims
from draftfleet.ledger import ADMITTED, CLOSED, NO_LEASE, Ledger
from draftfleet.ledger_scripts import LEASE
from draftfleet.workers import leases as leases_mod
from draftfleet.workers.leases import Leases

from .test_ledger import _rec

CAP = 100


@pytest.fixture(autouse=True)
def _counters_built(redis_server):
    redis_server.client().set(rk.COUNTERS_BUILT, "empty store")


def _book(r, inflight: int = 4) -> tuple[Ledger, Claims, Leases]:
    ledger, claims = Ledger(r), Claims(r, "lease@test")
    return ledger, claims, Leases(ledger, claims, inflight)


def _agg(r) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(rk.reserved_sum("ds")).items()}


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
    assert _agg(r)["cc"] == 8 * CAP and r.hget(rk.reservations("ds"), lease.name).decode().startswith("0:")
    assert _held_lease_claims(r) == [lease.name]
    keys = [secrets.token_hex(32) for _ in range(8)]
    for i, key in enumerate(keys[:5]):
        book.hand(lease)
        assert ledger.count_batch([(_rec(key, 10 + i), "t", lease.name, lease.cap)]) == 1
        book.counted(lease)
        assert _agg(r)["cc"] == (8 - i - 1) * CAP
    for key in keys[5:]:
        book.hand(lease)
    ledger.count_batch([(_rec(k, 10), "t", lease.name, lease.cap) for k in keys[5:]])
    for _ in keys[5:]:
        book.counted(lease)
    assert not r.hlen(rk.reservations("ds")) and not r.exists(rk.reserved_sum("ds"))
    assert not _held_lease_claims(r) and (lease.claim, lease.token) not in claims._held
    assert ledger.dataset_totals("ds")["responses"] == 8


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
    assert lease.retired and _agg(r)["cc"] == CAP  # seven slots back, the running one held
    book.done(lease)
    assert not r.hlen(rk.reservations("ds")) and not _held_lease_claims(r)


def test_a_dataset_no_longer_consumed_gives_its_lease_back_at_once(redis_server):
    """Drained, pivoted away or paused: the worker's lease of that dataset ends when it stops
    consuming it, not LEASE_S later, so its unused slots are the other kind's budget at once."""
    r = redis_server.client()
    _, _, book = _book(r)
    lease = book.admit("ds", CAP, 10**6)
    other = book.admit("other", CAP, 10**6)
    book.retire({"ds", "other"})
    assert not lease.retired and not other.retired
    book.retire({"other"})  # ds drained: its running task keeps one slot until it ends
    assert lease.retired and _agg(r)["cc"] == CAP and not other.retired
    book.hand(lease)
    Ledger(r).count_batch([(_rec(secrets.token_hex(32), 7), "t", lease.name, lease.cap)])
    book.counted(lease)
    assert not r.hexists(rk.reservations("ds"), lease.name) and _held_lease_claims(r) == []


def test_no_lease_near_the_budget_nor_once_closed(redis_server):
    """A lease takes at most half the room phase (1) still gives, in slots of a task's cap; with less
    than two slots' worth, or closed, nothing is granted and tasks are admitted one by one."""
    r = redis_server.client()
    ledger, _, book = _book(r, inflight=64)
    verdict, slots = ledger.lease("ds", rk.LEASE_PREFIX + "a", "w:1:a", 60, 2_000, 128, CAP)
    assert verdict == ADMITTED and 1 < slots <= 2_000 // (2 * CAP)
    verdict, slots2 = ledger.lease("ds", rk.LEASE_PREFIX + "b", "w:1:b", 60, 2_000, 128, CAP)
    assert verdict == ADMITTED and slots2 <= (2_000 - slots * CAP) // (2 * CAP)
    assert ledger.lease("ds", rk.LEASE_PREFIX + "c", "w:1:c", 60, 3 * CAP, 128, CAP) == (NO_LEASE, 0)
    assert not r.exists(rk.claim("ds", rk.LEASE_PREFIX + "c"))  # refused: its claim let go in the same step
    assert book.admit("ds", CAP, 3 * CAP) is None  # the worker admits one by one, and asks again later
    r.set(rk.closed("ds"), 10)
    assert ledger.lease("ds", rk.LEASE_PREFIX + "d", "w:1:d", 60, 10**6, 128, CAP)[0] == CLOSED


def test_a_dead_workers_lease_lapses_with_its_claim(redis_server):
    """The lease's reservation belongs to its claim: the claim gone (its worker killed), admission's
    due pass drops it, and the budget's room comes back."""
    r = redis_server.client()
    ledger = Ledger(r)
    name = rk.LEASE_PREFIX + "dead"
    assert ledger.lease("ds", name, "w:1:x", 60, 10**6, 8, CAP) == (ADMITTED, 8)
    r.delete(rk.claim("ds", name))
    r.zadd(rk.reservations_due("ds"), {name: 0})  # due now, as it is a claim TTL later
    assert ledger.claim_admit("ds", "k", "w:2:y", 60, 10**6, 50, CAP) == ADMITTED
    assert not r.hexists(rk.reservations("ds"), name) and _agg(r)["cc"] == 0


def test_a_lease_admits_nothing_once_redis_lost_its_state_or_the_budget_moved(redis_server):
    """Taken before a flush (the claims' STATE marker moved) or under another budget, a lease admits
    no more: the next task gets a new lease, on counters rebuilt from the store."""
    r = redis_server.client()
    _, claims, book = _book(r)
    first = book.admit("ds", CAP, 10**6)
    second = book.admit("ds", CAP, 10**6 - 1)
    assert second is not first and first.retired  # the budget changed: a new lease
    claims._state_seen = b"another stamp"  # what the beat records after Redis lost its state
    third = book.admit("ds", CAP, 10**6 - 1)
    assert third is not second and second.retired and third.state == b"another stamp"
    for lease in (first, second):  # their tasks end: their claims go, also one the beat put back
        r.set(lease.claim, lease.token)
        book.done(lease)
    assert _held_lease_claims(r) == [third.name]
    r.delete(rk.COUNTERS_BUILT)  # lost: nothing admitted on counters the store does not vouch for
    book.retire({"ds"})
    assert book.admit("ds", CAP - 1, 10**6 - 1) is None
