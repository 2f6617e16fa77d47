"""Fast counters in Redis, updated exactly once per stored key.

Counting is idempotent: a Lua script adds the key to the dataset's counted set and bumps the
totals only if it was not there, so a redelivered task, or a worker that stored a record and died
before counting it (the next copy finds the record and counts it), never counts twice.
The store stays the truth: the reconciler rebuilds these from it.
"""

from __future__ import annotations

import redis

from . import redis_keys as rk
from .schemas.records import ResponseRecord

_COUNT_ONCE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'responses', 1)
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'completion_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[2], 'cost_micro_usd', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'cost_micro_usd', ARGV[4])
return 1
"""


def micro_usd(cost: float) -> int:
    return int(round(cost * 1_000_000))


class Ledger:
    def __init__(self, client: redis.Redis):
        self.r = client
        self._count = client.register_script(_COUNT_ONCE)

    def count(self, record: ResponseRecord) -> bool:
        """Add a stored record to the totals; False if it was already counted."""
        added = self._count(
            keys=[rk.counted_set(record.dataset), rk.totals(record.dataset, record.backend), rk.spend(record.backend)],
            args=[record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd)],
        )
        return bool(added)

    def event(self, dataset: str, name: str, n: int = 1) -> None:
        """Count a retry or failure by reason (``retry:http_429``, ``failed:timeout``...)."""
        self.r.hincrby(rk.events(dataset), name, n)

    def spend_usd(self, backend: str) -> float:
        return int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0) / 1_000_000

    def totals(self, dataset: str) -> dict[str, dict[str, int]]:
        """Counters of one dataset, by backend."""
        out: dict[str, dict[str, int]] = {}
        prefix = rk.totals(dataset, "")
        for key in self.r.scan_iter(match=rk.totals_pattern(dataset), count=500):
            name = key.decode() if isinstance(key, bytes) else key
            out[name[len(prefix):]] = {k.decode(): int(v) for k, v in self.r.hgetall(key).items()}
        return out
