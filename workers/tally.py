"""Counting a worker's stored results in batches: one step in Redis per batch, not three per result.

Why. One Redis serves the whole fleet, and what a stored result costs it bounds how many GPUs it
serves (issue 32, ops/scaling.md). Counted one at a time, a result cost a script with a dozen
counter writes, a second to settle its budget reservation and a third to release its claim. The
tally gathers what the worker stores over ``LINGER_S`` (at most ``MOST`` results) and counts it
with one ``COUNT_BATCH``: each result counted once, its reservation settled and its claim
released in that step, the counters written once per batch.

What stays true. A result is still counted only once it is stored, but no longer before its
message is acknowledged: the task returns at once (its slot takes the next prompt), and its claim
and reservation stay held, refreshed by the heartbeat, until the batch lands, so a budget never
sees less in flight than there is and a twin waits. A worker killed before its batch lands leaves
records stored and not counted: the reconciler counts them, as it counts any record the store has
and Redis lacks, and their claims and reservations lapse. A clean stop counts what is pending
first. While Redis is away a batch waits and is tried again. A paid result whose request held its
worst cost against a spend cap (``Ledger.spend_hold``) is counted in the batch like any other, its
holds let go in the same step as its cost enters the spend: until then the cap counts the hold,
which is never less than the cost, so the linger cannot let the spend pass the cap. A paid result
that held nothing while its backend has a cap (no prices configured: the cap is checked against the
spend before each request) is counted at once, so that the check sees it before the worker's next
request; so is every result of a runtime that was never started (a task run in-process).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from draftfleet.claims import Claims
from draftfleet.ledger import Ledger, SpendHold
from draftfleet.schemas.records import ResponseRecord
from draftfleet.workers.leases import Lease, Leases

log = logging.getLogger("draftfleet.worker")

LINGER_S = 0.5  # a GPU worker stores ~25 results a second: about a dozen a batch
MOST = 256
CLOSE_ATTEMPTS = 3


def _entry(e: tuple) -> tuple[ResponseRecord, str, str, Lease | None, tuple[SpendHold, ...]]:
    """A pending result: (record, claim key, token, the lease it was admitted under, its spend
    holds); given with the first four alone, it has no holds."""
    return e if len(e) == 5 else (*e, ())


class Tally:
    """The worker's results stored and not yet counted, counted by one thread in batches."""

    def __init__(self, ledger: Ledger, claims: Claims, leases: Leases, linger_s: float = LINGER_S):
        self.ledger = ledger
        self.claims = claims
        self.leases = leases
        self.linger_s = linger_s
        self._cond = threading.Condition()
        self._pending: list[tuple[ResponseRecord, str, str, Lease | None, tuple[SpendHold, ...]]] = []  # (record,
        # claim key, token, the lease it was admitted under, its spend holds), as stored
        self._since = 0.0  # when the oldest pending result came
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="draftfleet-tally", daemon=True)
        self._thread.start()

    def add(self, record: ResponseRecord, claim_key: str, token: str, lease: Lease | None = None,
            holds: list[SpendHold] | tuple[SpendHold, ...] = (), at_once: bool | None = None) -> None:
        """Count ``record`` (stored, a single answer) and release its claim, in the next batch;
        ``holds``, its request's spend holds, go in the same step as its cost enters the spend.
        ``at_once`` (default: a paid one that held nothing) counts it before its task returns, so
        that a spend cap checked against the spend alone sees it before this worker's next request
        (a batch's linger would let such a worker overspend); so is every one while unstarted. Then
        a Redis error reaches the caller, whose claim is still its own. A result admitted under
        ``lease`` takes its slot out of it with the count."""
        holds = tuple(holds)
        if at_once is None:
            at_once = bool(record.cost_usd) and not holds
        if self._thread is None or at_once:
            self._land([(record, claim_key, token, lease, holds)], retry=False)
            self.claims.finish(record.dataset)
            return
        self.claims.finish(record.dataset)
        with self._cond:
            if not self._pending:  # the linger starts: the thread waits for it to pass, or for MOST
                self._since = time.monotonic()
                self._cond.notify()
            self._pending.append((record, claim_key, token, lease, holds))
            if len(self._pending) == MOST:
                self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self, timeout_s: float = 15.0) -> None:
        """Count what is pending now (a clean stop), then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                deadline = self._since + self.linger_s
                while len(self._pending) < MOST and not self._closed and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                batch, self._pending = self._pending[:MOST], self._pending[MOST:]
                self._since = time.monotonic()
            try:
                self._land(batch, retry=True)
            except Exception:  # a bug must not stop the counting, nor hold claims and reservations for ever
                log.exception("counting %d stored result(s) failed: the reconciler counts them from the store",
                              len(batch))
                self._abandon(batch)

    def _abandon(self, batch: list[tuple]) -> None:
        """Let go of the claims ``batch`` holds. Its records are stored, maybe not counted: their
        reservations are not released (that would give their room back before the tokens are in
        the totals) but buried once the claims are gone, and freed after the reconciler, or a worker
        whose admission waits on them, has counted the store (``Ledger.settle_dead``). Their spend
        holds stay too: the reconciler lets a dead claim's hold go once its key is counted
        (``Reconciler.settle_spend_holds``)."""
        batch = [_entry(e) for e in batch]
        for *_, lease, _ in batch:
            if lease is not None:  # its slot goes with the lease, whose claim the worker then deletes
                self.leases.counted(lease, lost=True)
        self.claims.forget([(key, token) for _, key, token, _, _ in batch])
        self.claims.drop([(key, token) for _, key, token, _, _ in batch])

    def _land(self, batch: list[tuple], retry: bool) -> None:
        """One ``COUNT_BATCH`` per backend in ``batch``; while Redis is away, again after a pause
        (only a few times once closing: what is left, the reconciler counts)."""
        batch = [_entry(e) for e in batch]
        by_backend: dict[str, list[tuple]] = {}
        for record, _, token, lease, holds in batch:
            if holds:
                result = (record, token, "" if lease is None else lease.name, 0 if lease is None else lease.cap,
                          list(holds))
            else:
                result = (record, token) if lease is None else (record, token, lease.name, lease.cap)
            by_backend.setdefault(record.backend, []).append(result)
        given_up: set[str] = set()  # backends whose results may not be counted: their slots are not known out
        for backend, results in by_backend.items():
            attempt, delay = 0, 0.5
            while True:
                attempt += 1
                try:
                    self.ledger.count_batch(results)
                    break
                except redis.RedisError as exc:
                    if not retry:
                        raise
                    if self._closed and attempt >= CLOSE_ATTEMPTS:
                        log.warning("%d stored result(s) not counted (%s): the reconciler counts them from the store",
                                    len(results), exc)
                        given_up.add(backend)
                        break
                    log.warning("counting %d stored result(s) failed (%s); again in %.1fs", len(results), exc, delay)
                    time.sleep(delay)
                    delay = min(10.0, delay * 2)
        self.claims.forget([(key, token) for _, key, token, _, _ in batch])
        for record, _, _, lease, _ in batch:
            if lease is not None:
                self.leases.counted(lease, lost=record.backend in given_up)
