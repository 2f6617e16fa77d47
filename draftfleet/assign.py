"""Which worker kinds consume which dataset, kept in Redis so a restart cannot undo a pivot.

Celery's ``add_consumer``/``cancel_consumer`` live only in a worker's memory: a GPU worker
restarted after a pivot would start eating the pivoted queue again. Workers therefore read this
assignment at start and every second, consume only what is assigned to their kind, and put back
(without starting it) any task of a dataset no longer assigned to them.
"""

from __future__ import annotations

import redis

from draftfleet import redis_keys as rk

KINDS = ("gpu", "cloud")


NOBODY = "none"  # stored when a dataset is assigned to no kind (drained, nothing took over)


def kinds_for(r: redis.Redis, dataset: str) -> set[str]:
    """The kinds allowed on a dataset (both when nothing was said; empty when drained by all)."""
    members = {m.decode() if isinstance(m, bytes) else m for m in r.smembers(rk.assignment(dataset))}
    return (members - {NOBODY}) if members else set(KINDS)


def assign(r: redis.Redis, dataset: str, kinds: set[str]) -> None:
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"kinds must be a subset of {KINDS}, got {sorted(kinds)}")
    pipe = r.pipeline()
    pipe.delete(rk.assignment(dataset))
    pipe.sadd(rk.assignment(dataset), *(sorted(kinds) or [NOBODY]))
    pipe.execute()


def assigned(r: redis.Redis, datasets: list[str], kind: str) -> set[str]:
    """Of ``datasets``, those a worker of ``kind`` may consume now."""
    pipe = r.pipeline(transaction=False)
    for d in datasets:
        pipe.smembers(rk.assignment(d))
    out = set()
    for d, members in zip(datasets, pipe.execute()):
        names = {m.decode() if isinstance(m, bytes) else m for m in members}
        if not names or kind in names:
            out.add(d)
    return out
