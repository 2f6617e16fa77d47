"""Drain and pivot: move datasets between worker kinds without losing or doubling anything.

``drain``: the assignment in Redis drops the kind; its workers stop consuming those queues within
a second (Celery's consumer control, not a kill), put back any task of those datasets they had
not started, and finish what they started. We then wait until no worker of that kind holds a
claim on those datasets; after that the drained side takes nothing more. ``pivot`` is a drain of
one side plus an assignment of the other; ``pivot --to gpu`` reverses it.
"""

from __future__ import annotations

import time

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.assign import KINDS, assign, kinds_for
from draftfleet.claims import worker_reports
from draftfleet.workers.runtime import ASSIGNMENT_POLL_S


class DrainResult(msgspec.Struct, kw_only=True):
    kind: str
    datasets: list[str]
    drained: bool
    waited_s: float
    still_running: int
    assignment: dict[str, list[str]]


def claims_by_kind(r: redis.Redis, datasets: list[str]) -> dict[str, int]:
    """How many claims (tasks being generated now) each worker kind holds on these datasets."""
    kind_of = {w.hostname: w.kind for w in worker_reports(r)}
    out = dict.fromkeys(KINDS, 0)
    for ds in datasets:
        prefix = rk.claim(ds, "")
        keys = [k for k in r.scan_iter(match=prefix + "*", count=1000)
                if not rk.is_lease(k.decode()[len(prefix):])]  # a worker's lease is no task
        for holder in r.mget(keys) if keys else []:
            if holder is None:
                continue
            kind = kind_of.get(rk.claim_holder(holder), "unknown")
            kind = "cloud" if kind == "batch" else kind  # a batch worker consumes the cloud's queues
            out[kind] = out.get(kind, 0) + 1
    return out


def idle_target(r: redis.Redis, kind: str, datasets: list[str]) -> dict[str, str]:
    """The datasets that no live worker of ``kind`` would take (reporting, following the dataset,
    neither paused nor waiting for its server), each with why: what a pivot to ``kind`` must warn of."""
    takers = {kind, "batch"} if kind == "cloud" else {kind}  # a batch worker takes the cloud's datasets
    reports = [w for w in worker_reports(r) if w.kind in takers]
    out = {}
    for ds in datasets:
        mine = [w for w in reports if ds in w.follows or ds in w.datasets]
        if any(not w.paused and not w.waiting for w in mine):
            continue
        if mine:
            why = "; ".join(f"{w.hostname} {'paused: ' + w.paused if w.paused else 'waiting for ' + str(w.waiting)}"
                            for w in mine)
            out[ds] = f"no live {kind} worker takes {ds} ({why})"
        else:
            out[ds] = f"no live {kind} worker takes {ds}: start one (draftfleet worker {kind} ...)"
    return out


def _wait(r: redis.Redis, kind: str, datasets: list[str], timeout_s: float, on_tick=None) -> tuple[bool, float, int]:
    started = time.monotonic()
    # Let every worker see the new assignment before trusting the claims we read.
    time.sleep(2 * ASSIGNMENT_POLL_S + 0.2)
    while True:
        running = claims_by_kind(r, datasets).get(kind, 0)
        if on_tick:
            on_tick(running)
        if running == 0:
            return True, time.monotonic() - started, 0
        if time.monotonic() - started > timeout_s:
            return False, time.monotonic() - started, running
        time.sleep(0.5)


def drain(r: redis.Redis, kind: str, datasets: list[str], timeout_s: float = 600.0, on_tick=None) -> DrainResult:
    for ds in datasets:
        assign(r, ds, kinds_for(r, ds) - {kind})
    ok, waited, running = _wait(r, kind, datasets, timeout_s, on_tick)
    return DrainResult(kind=kind, datasets=datasets, drained=ok, waited_s=round(waited, 1), still_running=running,
                       assignment={ds: sorted(kinds_for(r, ds)) for ds in datasets})


def pivot(r: redis.Redis, to: str, datasets: list[str], timeout_s: float = 600.0, on_tick=None) -> DrainResult:
    """Hand datasets to one kind: the other is drained (and waited for)."""
    if to not in KINDS:
        raise ValueError(f"--to must be one of {KINDS}")
    other = next(k for k in KINDS if k != to)
    for ds in datasets:
        assign(r, ds, {to})
    ok, waited, running = _wait(r, other, datasets, timeout_s, on_tick)
    return DrainResult(kind=other, datasets=datasets, drained=ok, waited_s=round(waited, 1), still_running=running,
                       assignment={ds: sorted(kinds_for(r, ds)) for ds in datasets})
