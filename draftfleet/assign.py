"""The live dataset settings, kept in Redis: which worker kinds consume which dataset, and the
settings each dataset was last enqueued with. Nothing here needs a restart to take effect.

Celery's ``add_consumer``/``cancel_consumer`` live only in a worker's memory: a GPU worker
restarted after a pivot would start eating the pivoted queue again. Workers therefore read this
assignment at start and every second, consume only what is assigned to their kind, and put back
(without starting it) any task of a dataset no longer assigned to them.

``enqueue`` publishes each dataset's manifest (its settings and ``budget_tokens``) here. Workers
read it on the same one-second poll (a worker started without ``--dataset`` follows every
published dataset), budget admission reads the budget inside its own script, and the
reconciler and status list and budget datasets from it; the config file is where a dataset
starts, not where running processes look. Redis can lose this: the processes keep what they
last read (or their config's figures), and the next ``enqueue`` publishes it again.
"""

from __future__ import annotations

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import DatasetManifest
from draftfleet.store import StoreError, check_name

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


_manifest = msgspec.json.Decoder(DatasetManifest)


def publish(r: redis.Redis, manifest: DatasetManifest) -> None:
    """Make a dataset's settings (its manifest) live for every running process; its budget too,
    on its own (``rk.BUDGETS``, with its rule), for admission to read on every task without the
    manifest, and for every worker's lease to be retired by before it admits again."""
    from draftfleet.ledger import publish_value  # (ledger imports the schemas this module does)

    budget = publish_value(manifest.budget_tokens, manifest.budget_rule)
    pipe = r.pipeline(transaction=True)
    pipe.hset(rk.DATASETS, manifest.name, msgspec.json.encode(manifest))
    pipe.hset(rk.BUDGETS, manifest.name, budget)
    pipe.execute()


def published(r: redis.Redis) -> dict[str, DatasetManifest]:
    """Every published dataset's manifest, by name (an unreadable entry, or one whose name is not
    a safe dataset name, is left out: names become queue names and store folders)."""
    out = {}
    for field, raw in r.hgetall(rk.DATASETS).items():
        try:
            manifest = _manifest.decode(raw)
            if field.decode() != check_name(manifest.name):
                continue
        except (msgspec.DecodeError, UnicodeDecodeError, StoreError):
            continue
        out[manifest.name] = manifest
    return out


def live_budgets(cfg: FleetConfig, r: redis.Redis) -> dict[str, int | None]:
    """Datasets and their budgets as the fleet runs them now: the config's, then those enqueued
    since; a published budget wins over the config's."""
    live = published(r)
    out = {d.name: (live[d.name].budget_tokens if d.name in live else d.budget_tokens) for d in cfg.datasets}
    for name in sorted(live.keys() - out.keys()):
        out[name] = live[name].budget_tokens
    return out
