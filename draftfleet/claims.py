"""Claims: which task, in which worker, runs a unit of work now.

A task claims its unit (a generation key, a capture unit) with ``SET NX`` and a TTL, under a
token of its own, ``<hostname>:<pid>:<random>`` (``rk.claim_holder`` reads the worker from it;
two copies of a unit in one process hold distinct tokens). The worker's heartbeat refreshes
every claim it holds: a refresh re-creates a claim Redis lost, but never takes one that another
holder has taken since; a claim released while the beat ran is deleted again, so it does not
hold the unit from every worker for a TTL. A release deletes the claim only under its own token.
A dead worker's claims lapse after at most ``CLAIM_TTL_S``; ``recovery.py``, run by every live
worker's beat, then gives its messages back to their queues.

What runs now is shown without waiting for a beat: :meth:`Claims.show_running`, called twice a
second, publishes the worker's report again only when its in-flight counts changed, so a worker
costs Redis at most one write per call however many requests start and end meanwhile.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.recovery import Recovery
from draftfleet.schemas.records import WorkerReport

log = logging.getLogger("draftfleet.worker")

# The heartbeat refreshes claims six times a TTL. DRAFTFLEET_CLAIM_TTL_S shortens it (fault tests).
CLAIM_TTL_S = max(6, int(os.environ.get("DRAFTFLEET_CLAIM_TTL_S", "120")))
HEARTBEAT_S = CLAIM_TTL_S / 6
_report_decoder = msgspec.json.Decoder(WorkerReport)

_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


class Claims:
    """The claims one worker process holds, and how many of its tasks run per dataset."""

    def __init__(self, r: redis.Redis, hostname: str):
        self.r = r
        self.hostname = hostname
        self.token = f"{hostname}:{os.getpid()}"  # the process's; each claim adds a random part
        self.recovery = Recovery(r, grace_s=CLAIM_TTL_S)
        self._refresh = r.register_script(_REFRESH)
        self._release = r.register_script(_RELEASE)
        self._lock = threading.Lock()
        self._state_seen: bytes | None = None  # the rk.STATE marker as this worker last put its claims under it
        self._held: set[tuple[str, str]] = set()  # (claim key, the holding task's token)
        self.inflight: dict[str, int] = {}  # dataset -> tasks holding a claim
        self._publish = threading.Lock()  # one report written at a time: the last one is the newest
        self._report: WorkerReport | None = None  # the report last published
        self._withdrawn = False  # stopped cleanly: no beat still under way brings the report back

    @property
    def state_seen(self) -> bytes | None:
        """``rk.STATE`` as this worker last put its claims under it: it moves when Redis lost its state."""
        return self._state_seen

    def new_token(self) -> str:
        """A claim token of this process: ``<hostname>:<pid>:<random>``."""
        return f"{self.token}:{secrets.token_hex(6)}"

    def hold(self, key: str, token: str) -> None:
        """Refresh ``key``, claimed in Redis under ``token`` by a larger step (a lease of a budget,
        workers/leases.py), with every beat until :meth:`forget`; it counts as no running task."""
        with self._lock:
            self._held.add((key, token))

    def acquire(self, key: str, dataset: str, take: Callable[[str], bool] | None = None) -> str | None:
        """Claim ``key`` for one task of ``dataset``: its token, or None when another task holds it.
        ``take(token)`` claims it in Redis when that is part of a larger step (the ledger's
        claim and admission in one round trip); else a ``SET NX`` with the TTL."""
        token = self.new_token()
        if not (take(token) if take is not None else self.r.set(key, token, nx=True, ex=CLAIM_TTL_S)):
            return None
        with self._lock:
            self._held.add((key, token))
            self.inflight[dataset] = self.inflight.get(dataset, 0) + 1
        return token

    def release(self, key: str, dataset: str, token: str) -> None:
        with self._lock:
            self._held.discard((key, token))
            self.inflight[dataset] -= 1
        self._delete([(key, token)])

    def finish(self, dataset: str) -> None:
        """A task of ``dataset`` ended with its result handed to the tally (workers/tally.py): it
        runs no more, but its claim stays held, and refreshed, until the tally's batch releases it
        in Redis (then :meth:`forget`)."""
        with self._lock:
            self.inflight[dataset] -= 1

    def forget(self, claims: list[tuple[str, str]]) -> None:
        """(claim key, token) pairs released in Redis by a larger step (the tally's batch): no
        longer held, so no beat refreshes them again."""
        with self._lock:
            self._held.difference_update(claims)

    def drop(self, claims: list[tuple[str, str]]) -> None:
        """Delete (claim key, token) pairs in Redis, each only under its own token."""
        self._delete(claims)

    def running(self) -> dict[str, int]:
        """The datasets with tasks running now, and how many (a worker report's ``inflight``)."""
        with self._lock:
            return {d: n for d, n in self.inflight.items() if n}

    @contextmanager
    def refreshing(self, pipe) -> Iterator[None]:
        """Queue on ``pipe`` the refresh of every claim held (the caller executes it inside the
        block); on leaving, delete again the claims released meanwhile, which it re-created."""
        with self._lock:
            claims = list(self._held)
        try:
            for key, token in claims:  # re-created if Redis lost it, never taken from another holder
                self._refresh(keys=[key], args=[token, CLAIM_TTL_S], client=pipe)
            yield
        finally:
            with self._lock:
                released = [c for c in claims if c not in self._held]
            self._delete(released)

    def beat(self, report: WorkerReport, *, mark_state: bool = False) -> None:
        """One heartbeat of the worker: refresh its claims, publish its ``report`` with what runs
        now (``draftfleet status`` reads it; its TTL of three beats drops a killed worker), then
        give a dead worker's messages back (``recovery.py``). ``mark_state`` sets ``rk.STATE``
        after the claims: once it is back, so are they (``queues.await_lost_claims``)."""
        try:
            with self._publish:
                report = msgspec.structs.replace(report, inflight=self.running(), pid=os.getpid(), at=time.time())
                pipe = self.r.pipeline(transaction=False)
                with self.refreshing(pipe):
                    if not self._withdrawn:
                        pipe.set(rk.worker_report(self.hostname), msgspec.json.encode(report), ex=int(3 * HEARTBEAT_S))
                    if mark_state:  # the first to find it gone stamps it with Redis's clock
                        pipe.set(rk.STATE, rk.state_stamp(self.r), nx=True)
                        pipe.get(rk.STATE)
                    done = pipe.execute()
                if mark_state:
                    self._state_seen = done[-1]
                self._report = report
        except redis.RedisError as exc:
            log.warning("heartbeat to Redis failed: %s", exc)
            return
        try:
            restored = self.recovery.maybe_sweep(self.token, HEARTBEAT_S)
        except redis.RedisError as exc:
            log.warning("looking for a dead worker's messages failed: %s", exc)
            return
        if restored:
            log.warning("gave %d message(s) held by no live worker back to their queues", restored)

    def beat_until(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        """Call ``beat`` every HEARTBEAT_S until ``stop`` is set, and at once when Redis lost its state
        (``rk.STATE`` gone: restarted empty, flushed), so that the claims are back within a poll
        (``STATE_POLL_S``), before an enqueue or a capture into the emptied Redis decides what to send
        again (``queues.await_lost_claims``); in between, what runs now reaches the report within a
        poll when it changed. Every worker kind beats through this one loop."""
        due = time.monotonic() + HEARTBEAT_S
        while not stop.wait(rk.STATE_POLL_S):
            try:
                # gone, or stamped anew by another worker or an enqueue since this one's claims went back:
                # every worker puts its claims back at once, not only the first to notice
                lost = self.r.get(rk.STATE) != self._state_seen
            except redis.RedisError:
                lost = False  # the heartbeat says so when it is due
            if lost or time.monotonic() >= due:
                beat()
                due = time.monotonic() + HEARTBEAT_S
            else:
                self.show_running()

    def show_running(self) -> bool:
        """Publish the last report again with what runs now, if that changed since it was written
        (one SET, none when nothing changed); whether it wrote. Claims and recovery stay the beat's."""
        with self._publish:
            last, running = self._report, self.running()
            if last is None or running == last.inflight or self._withdrawn:
                return False
            report = msgspec.structs.replace(last, inflight=running, at=time.time())
            try:
                self.r.set(rk.worker_report(self.hostname), msgspec.json.encode(report), ex=int(3 * HEARTBEAT_S))
            except redis.RedisError:
                return False  # the next call (or beat) tries again
            self._report = report
            return True

    def withdraw(self) -> None:
        """Take the worker's report down on a clean stop (``status`` drops it at once, not at its TTL).
        After the beat under way, if any (the lock): a beat that wrote after the delete would list a
        stopped worker for three beats."""
        with self._publish:
            self._withdrawn = True
            try:
                self.r.delete(rk.worker_report(self.hostname))
            except redis.RedisError:
                pass

    def _delete(self, claims: list[tuple[str, str]]) -> None:
        for key, token in claims:
            try:
                self._release(keys=[key], args=[token])
            except redis.RedisError:
                return  # they expire on their own


def worker_reports(r: redis.Redis) -> list[WorkerReport]:
    """Every live worker's last report (``Claims.beat`` writes them; status, plan and pivot read them)."""
    keys = list(r.scan_iter(match=rk.worker_report("*"), count=500))
    values = r.mget(keys) if keys else []
    return [_report_decoder.decode(v) for v in values if v]
