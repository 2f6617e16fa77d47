"""Give a dead worker's messages back to their queues long before the visibility timeout.

kombu's Redis transport keeps every delivered, unacknowledged message in the ``unacked`` hash
(delivery time in ``unacked_index``) and hands it out again only once it is older than the
visibility timeout, 6 hours by default: a worker killed with 128 prompts in flight would leave
them idle that long. But a worker running a prompt holds the key's claim and refreshes it every
``claim_ttl / 6`` seconds, so a message delivered more than ``grace_s`` ago, not waiting for its
countdown, whose key has no claim, is held by nobody: it goes back to its queue, with the same
moves and the same ``redelivered`` flag kombu's own restore uses, in one Lua script that checks
the entry is unchanged and the claim still absent. If the key was stored before its holder died,
the worker that gets the copy only counts it (idempotently) and acknowledges: that also repairs
a count lost when Redis went away between the store and the count.
Capture tasks (``workers/capture.py``) work the same way, with their unit's claim
(``rk.capture_claim``): a copy whose unit has a file is acknowledged as done.

Worst case (a holder cut off from Redis for longer than the claim TTL) this is a redelivery
while the first copy still runs, the case the visibility timeout produces anyway: the claim and
the write-once store keep it to one stored, once-counted result.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.store import StoreError, check_key, check_name

_CAPTURE_UNIT = re.compile(r"^[0-9a-f]{64}\.(?:\d+|conversation)\.v\d+$")

# KEYS: unacked, unacked_index, claim, queue; ARGV: tag, entry as read, payload to push.
_RESTORE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[4], ARGV[3])
return 1
"""


class _Headers(msgspec.Struct):
    id: str = ""
    eta: str | None = None


class _Envelope(msgspec.Struct):
    headers: _Headers = msgspec.field(default_factory=_Headers)


_entry = msgspec.json.Decoder(tuple[_Envelope, str, str])


def _eta_s(eta: str | None) -> float:
    if not eta:
        return 0.0
    try:
        return datetime.fromisoformat(eta).timestamp()
    except ValueError:
        return 0.0


def _claim_of(routing_key: str, task_id: str) -> str:
    """The claim a running copy of this message holds: a prompt's, or a capture unit's."""
    if routing_key.startswith(rk.CAPTURE_QUEUE_PREFIX):
        dataset = check_name(routing_key[len(rk.CAPTURE_QUEUE_PREFIX):])
        if not _CAPTURE_UNIT.match(task_id):
            raise StoreError(f"not a capture unit {task_id!r}")
        return rk.capture_claim(dataset, task_id)
    return rk.claim(check_name(rk.dataset_of_queue(routing_key) or ""), check_key(task_id))


def _redelivered(raw: bytes) -> bytes:
    """The payload as kombu restores it: the message, flagged redelivered."""
    payload, _exchange, _routing_key = msgspec.json.decode(raw)
    if isinstance(payload.get("headers"), dict):
        payload["headers"]["redelivered"] = True
    info = payload.get("properties", {}).get("delivery_info")
    if isinstance(info, dict):
        info["redelivered"] = True
    return msgspec.json.encode(payload)


class Recovery:
    """One sweep over ``unacked`` at a time, fleet-wide (a lock in Redis)."""

    def __init__(self, r: redis.Redis, grace_s: float):
        self.r = r
        self.grace_s = grace_s
        self._restore = r.register_script(_RESTORE)

    def sweep(self, now: float | None = None) -> int:
        """Give orphaned messages of the dataset and capture queues back; returns how many."""
        now = time.time() if now is None else now
        candidates = []
        for tag, raw in self.r.hscan_iter(rk.UNACKED, count=1000):
            try:
                env, _exchange, routing_key = _entry.decode(raw)
                claim = _claim_of(routing_key, env.headers.id)
            except (msgspec.DecodeError, StoreError):
                continue  # not one of our tasks: kombu's visibility timeout handles it
            if _eta_s(env.headers.eta) > now - self.grace_s:
                continue  # a deferred task waiting for its countdown in some worker
            candidates.append((tag, raw, claim, routing_key))
        if not candidates:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for tag, *_ in candidates:
            pipe.zscore(rk.UNACKED_INDEX, tag)
        delivered_at = pipe.execute()
        restored = 0
        for (tag, raw, claim, queue), at in zip(candidates, delivered_at):
            if at is None or float(at) > now - self.grace_s:
                continue  # just delivered: its worker is about to claim it
            restored += self._restore(keys=[rk.UNACKED, rk.UNACKED_INDEX, claim, queue],
                                      args=[tag, raw, _redelivered(raw)])
        return restored

    def maybe_sweep(self, token: str, interval_s: float) -> int:
        """Sweep if no worker of the fleet did in the last ``interval_s`` seconds."""
        if not self.r.set(rk.RECOVERY_LOCK, token, nx=True, ex=max(1, int(interval_s))):
            return 0
        return self.sweep()
