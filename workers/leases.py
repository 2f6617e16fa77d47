"""A worker's leases of its datasets' budgets: one step in Redis admits many tasks, not one each.

Why. One Redis serves the whole fleet (issue 32, ops/scaling.md), and admitting each task of a
budgeted dataset alone cost it a script of a dozen commands: most of what a result cost. A lease
(``Ledger.lease``) reserves n slots in one step, each the most one task can make (its max_tokens);
while one is free, a task of that dataset is admitted here with its key's claim alone (a SET NX).

What it guarantees. A slot is used once: its result's count takes it out of the lease, once per
key however often the count is sent (``COUNT_BATCH``, workers/tally.py); a task that ends without a
result frees it for the next; one whose count may or may not have landed (Redis failed under it)
frees nothing, and the lease's claim is deleted at its end (admission's due pass drops what is
left). Each task a lease admits claims its key together with a read of the budget as published
(``rk.BUDGETS``, one round trip): a budget lowered, raised or removed since the lease was granted
retires it before it admits that task (the task is admitted alone), on every worker, so no task is
ever admitted on slots of a budget no longer in force. A lease admits for at most ``LEASE_S``
after it was taken, and none once the worker stops consuming the dataset (a drain, a pivot, a
pause, a stop) or Redis lost its state (the claims' ``rk.STATE`` marker moved). Its unused slots
then go back (``Ledger.lease_return``), also from the runtime's one-second watch when the budget
changed, and its claim, refreshed by the worker's beat meanwhile, is let go once the last of its
results is counted. A worker killed holding a lease: its claim lapses and admission's due pass
drops the reservation. No lease is granted where fewer than two slots fit in half the room left:
tasks are then admitted one by one (``Ledger.claim_admit``), and this worker asks again after
``RETRY_S``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import redis

from draftfleet import redis_keys as rk
from draftfleet.claims import CLAIM_TTL_S, Claims
from draftfleet.ledger import ADMITTED, Ledger

log = logging.getLogger("draftfleet.worker")

LEASE_S = 10.0  # how long a lease admits (the slots left then go back)
SLOTS_PER_REQUEST = 2  # slots asked per request the worker keeps in flight: a lease lasts two rounds of them
MOST_SLOTS = 256
RETRY_S = 2.0  # after a refusal, tasks are admitted one by one this long before a lease is asked again


class Lease:
    """One lease: its name and claim token in Redis, and its slots as this worker uses them."""

    def __init__(self, dataset: str, cap: int, name: str, token: str, slots: int, budget: str,
                 state: bytes | None):
        self.dataset = dataset
        self.cap = cap  # tokens a slot holds: its tasks' max_tokens
        self.name = name  # the reservation's field, and the claim's key suffix (rk.LEASE_PREFIX)
        self.token = token
        self.budget = budget  # as published when granted (rk.BUDGETS): a change ends the lease
        self.state = state  # rk.STATE as the worker's claims last saw it when granted
        self.taken_at = time.monotonic()
        self.free = slots  # slots no task took yet (or freed by a task that stored nothing)
        self.running = 0  # tasks admitted under it that have not ended
        self.pending = 0  # results handed to the tally, not yet counted (each takes its slot out)
        self.retired = False  # admits no more; its unused slots went back
        self.stuck = False  # slots not taken out (a return failed, a count given up): the worker deletes its claim

    @property
    def claim(self) -> str:
        return rk.claim(self.dataset, self.name)


class Leases:
    """The leases one worker process holds, one at a time per (dataset, max_tokens)."""

    def __init__(self, ledger: Ledger, claims: Claims, inflight: int):
        self.ledger = ledger
        self.claims = claims
        self.slots = max(2, min(MOST_SLOTS, SLOTS_PER_REQUEST * inflight))  # asked per lease
        self._lock = threading.Lock()
        self._current: dict[tuple[str, int], Lease] = {}
        self._retry_at: dict[tuple[str, int], float] = {}

    def admit(self, dataset: str, cap: int, budget: int) -> Lease | None:
        """A slot for one task of ``dataset`` (at most ``cap`` tokens) under the budget ``budget`` (the
        worker's reading, if none is published): the lease it was taken from, or None (admit this
        task alone). Takes a new lease when the current one is spent or stale; one thread asks Redis
        while the others wait for its lease. The caller claims the task's key with
        :meth:`still_good`'s check before it runs."""
        spent: Lease | None = None
        try:
            with self._lock:
                at = (dataset, cap)
                lease = self._current.get(at)
                if lease is not None and self._usable(lease):
                    return self._take(lease)
                if lease is not None:
                    spent = self._retire(lease)
                if time.monotonic() < self._retry_at.get(at, 0.0):
                    return None
                lease = self._grant(dataset, cap, budget)
                if lease is None:
                    self._retry_at[at] = time.monotonic() + RETRY_S
                    return None
                self._current[at] = lease
                return self._take(lease)
        finally:
            if spent is not None:
                self._give_back(spent)

    def hand(self, lease: Lease) -> None:
        """A task under ``lease`` handed its stored result to the tally: its slot is taken out when
        the result is counted (:meth:`counted`)."""
        with self._lock:
            lease.running -= 1
            lease.pending += 1

    def unhand(self, lease: Lease) -> None:
        """The tally refused a result :meth:`hand` gave it (Redis away for a paid one): its task runs on."""
        with self._lock:
            lease.pending -= 1
            lease.running += 1

    def counted(self, lease: Lease, *, lost: bool = False) -> None:
        """The tally counted a result taken under ``lease`` (``lost``: gave up counting it, its slot
        still in the lease: the lease's claim is then deleted, and the due pass drops the rest)."""
        with self._lock:
            lease.pending -= 1
            lease.stuck = lease.stuck or lost
            done = lease.retired and not lease.running and not lease.pending
        if done:
            self._end(lease)

    def done(self, lease: Lease) -> None:
        """A task under ``lease`` ended without a result to count: its slot is free again (or, the
        lease retired, goes back)."""
        with self._lock:
            lease.running -= 1
            lease.free += 1
            back = lease if lease.retired else None
        if back is not None:
            self._give_back(back)

    def still_good(self, lease: Lease, published: str) -> bool:
        """Whether ``lease`` may admit the task that just claimed its key, the budget being
        ``published`` (``rk.BUDGETS`` read in the claim's round trip): else it is retired here, its
        unused slots given back, this task's slot with them (the caller admits the task alone)."""
        if published == lease.budget:
            return True
        with self._lock:
            lease.running -= 1
            lease.free += 1
            self._retire(lease)
        self._give_back(lease)
        return False

    def lost(self, lease: Lease) -> None:
        """A result of ``lease`` whose count may or may not have landed (Redis failed under it): its
        slot is neither free nor given back (it may be out already); at the lease's end its claim is
        deleted, and admission's due pass drops whatever its reservation still holds."""
        with self._lock:
            lease.running -= 1
            lease.stuck = True
            done = lease.retired and not lease.running and not lease.pending
        if done:
            self._end(lease)

    def retire(self, consumed: set[str], budgets: dict[str, str] | None = None) -> None:
        """End the leases of datasets this worker does not consume now (drained, pivoted away, paused;
        none on a clean stop), those whose budget as published (``budgets``: dataset -> rk.BUDGETS's
        value, as the runtime read it) is not the one they were granted under, and those past
        ``LEASE_S`` or taken before Redis lost its state: their unused slots go back at once, to the
        workers that take the dataset now. Called by the runtime whenever it steers its consumer,
        at least every second, so an idle lease holds no budget."""
        budgets = budgets or {}
        with self._lock:
            ended = [self._retire(lease) for lease in list(self._current.values())
                     if lease.dataset not in consumed or not self._usable(lease)
                     or budgets.get(lease.dataset, lease.budget) != lease.budget]
        for lease in ended:
            self._give_back(lease)

    def _usable(self, lease: Lease) -> bool:
        """Under the lock: a slot free, Redis's state as when granted, and young."""
        return (lease.free > 0 and lease.state == self.claims.state_seen
                and time.monotonic() - lease.taken_at < LEASE_S)

    def _take(self, lease: Lease) -> Lease:
        """Under the lock: one slot to a task; the last one retires the lease (nothing to give back)."""
        lease.free -= 1
        lease.running += 1
        if not lease.free:
            self._retire(lease)
        return lease

    def _grant(self, dataset: str, cap: int, budget: int) -> Lease | None:
        name = rk.LEASE_PREFIX + secrets.token_hex(8)
        token = self.claims.new_token()
        state = self.claims.state_seen
        verdict, slots, published = self.ledger.lease(dataset, name, token, CLAIM_TTL_S, budget, self.slots, cap)
        if verdict != ADMITTED or not slots:
            return None
        lease = Lease(dataset, cap, name, token, slots, published, state)
        self.claims.hold(lease.claim, token)
        return lease

    def _retire(self, lease: Lease) -> Lease:
        """Under the lock: the lease admits no more; the caller gives its free slots back."""
        lease.retired = True
        if self._current.get((lease.dataset, lease.cap)) is lease:
            del self._current[lease.dataset, lease.cap]
        return lease

    def _give_back(self, lease: Lease) -> None:
        """Return the retired ``lease``'s free slots; let go of its claim once nothing of it is left."""
        with self._lock:
            n, lease.free = lease.free, 0
            done = not lease.running and not lease.pending
        if n:
            try:
                self.ledger.lease_return(lease.dataset, lease.name, lease.token, n * lease.cap)
            except redis.RedisError as exc:  # they are dropped with the lease once its claim is let go
                lease.stuck = True
                log.warning("%s: %d unused slot(s) of a lease not given back: %s", lease.dataset, n, exc)
        if done:
            self._end(lease)

    def _end(self, lease: Lease) -> None:
        """Nothing of ``lease`` is left: the script that took out its last slot let go of its claim in
        Redis, so the beat stops refreshing it. After a failed return, or when Redis lost its data
        since (no reservation was left to spend; the beat put the claim back), the claim is deleted
        here, and admission's due pass drops whatever its reservation still holds."""
        claim = [(lease.claim, lease.token)]
        self.claims.forget(claim)
        if lease.stuck or lease.state != self.claims.state_seen:
            self.claims.drop(claim)
