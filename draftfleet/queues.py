"""Reading the queues straight from Redis (Flower only lists queues some worker consumes).

Every task is sent with its prompt key as the Celery task id, so the keys waiting in a queue, or
delivered and not yet acknowledged (kombu keeps those in its ``unacked`` hash until the ack),
can be listed from message headers alone, without decoding bodies. ``enqueue`` uses this to skip
keys already queued; nothing else needs to be remembered, so nothing can go stale.
"""

from __future__ import annotations

import base64
import time

import msgspec
import redis
from kombu.compression import decompress

from draftfleet import redis_keys as rk
from draftfleet.conversation import answers
from draftfleet.schemas.records import PromptTask


class _Headers(msgspec.Struct):
    id: str = ""


class _Envelope(msgspec.Struct):
    headers: _Headers = msgspec.field(default_factory=_Headers)


_env = msgspec.json.Decoder(_Envelope)
_unacked = msgspec.json.Decoder(tuple[_Envelope, str, str])


def waiting_ids(r: redis.Redis, queue: str, batch: int = 5000) -> set[str]:
    """Task ids of the messages waiting in ``queue`` (not those a worker holds), read in batches."""
    ids: set[str] = set()
    start = 0
    while True:
        chunk = r.lrange(queue, start, start + batch - 1)
        for raw in chunk:
            try:
                ids.add(_env.decode(raw).headers.id)
            except msgspec.DecodeError:
                continue  # a poison message: the worker dead-letters it
        if len(chunk) < batch:
            break
        start += batch
    ids.discard("")
    return ids


class _Message(msgspec.Struct):
    body: str = ""
    headers: dict = {}
    properties: dict = {}
    content_type: str = msgspec.field(default="application/json", name="content-type")


def next_task(r: redis.Redis, dataset: str) -> PromptTask | None:
    """The task a worker takes next from the dataset's queue (kombu publishes with LPUSH, and
    consumes and gives back with BRPOP and RPUSH: the right end), or None (empty, or not a task)."""
    raw = r.lindex(rk.queue(dataset), -1)
    if raw is None:
        return None
    try:
        m = msgspec.json.decode(raw, type=_Message)
        body = base64.b64decode(m.body) if m.properties.get("body_encoding") == "base64" else m.body.encode()
        if m.headers.get("compression"):
            body = decompress(body, m.headers["compression"])
        args = msgspec.json.decode(body)[0]  # Celery's protocol 2: [args, kwargs, embed]
        return msgspec.convert(args[0], PromptTask)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError, KeyError):
        return None


def next_answers(r: redis.Redis, dataset: str) -> int:
    """How many answers the dataset's next task asks for (``conversation.answers``; 1 when the
    queue holds none): the turns admission reserves for when it comes."""
    task = next_task(r, dataset)
    return answers(task) if task is not None else 1


def queued_keys(r: redis.Redis, dataset: str, batch: int = 5000) -> set[str]:
    """Keys of a dataset waiting in its queue or held unacked by some worker."""
    q = rk.queue(dataset)
    keys = waiting_ids(r, q, batch)
    for _tag, raw in r.hscan_iter(rk.UNACKED, count=1000):
        try:
            env, _exchange, routing_key = _unacked.decode(raw)
        except msgspec.DecodeError:
            continue
        if routing_key == q:
            keys.add(env.headers.id)
    keys.discard("")
    return keys


def claimed_keys(r: redis.Redis, dataset: str) -> set[str]:
    """Keys a running worker is generating now (it holds their claims)."""
    prefix = rk.claim(dataset, "")
    keys = {k.decode()[len(prefix):] for k in r.scan_iter(match=prefix + "*", count=1000)}
    return {k for k in keys if not rk.is_lease(k)}


def claimed_units(r: redis.Redis, dataset: str) -> set[str]:
    """Capture units (``<key>.<turn>.v<version>``) a running capture worker holds now."""
    prefix = rk.capture_claim(dataset, "")
    return {k.decode()[len(prefix):] for k in r.scan_iter(match=prefix + "*", count=1000)}


def await_lost_claims(r: redis.Redis) -> bool:
    """When Redis lost its state (``rk.STATE`` gone, or stamped less than ``STATE_SETTLE_S`` ago),
    wait until running workers have put back the claims of what they are generating, so that it is
    not sent again; True if it waited.

    The first worker (or enqueue) to find the marker gone stamps it with Redis's clock; every live
    worker looks every ``STATE_POLL_S`` and beats at once under a stamp it has not beaten under
    (claims first), so ``STATE_SETTLE_S`` after the stamp every one of them has. A marker found
    already stamped is not enough: the other workers may not have seen it yet.
    """
    left = lost_claims_settle_s(r)
    if left <= 0:
        return False
    time.sleep(left)
    return True


def lost_claims_settle_s(r: redis.Redis) -> float:
    """How long from now until the claims lost with Redis's state are back (0: none lost, or back
    already); stamps the marker when it is gone, as :func:`await_lost_claims` does. A caller with
    work to do meanwhile (``draftfleet capture`` scanning the store) waits only for the rest."""
    raw = r.get(rk.STATE)
    if raw is None:
        r.set(rk.STATE, rk.state_stamp(r), nx=True)
        raw = r.get(rk.STATE)
    try:
        stamp = float(raw or 0)
    except ValueError:
        stamp = 0.0
    sec, usec = r.time()
    return max(0.0, stamp + rk.STATE_SETTLE_S - (sec + usec / 1e6))


def depth(r: redis.Redis, dataset: str) -> int:
    """Messages waiting in a dataset's queue (not counting those workers hold)."""
    return int(r.llen(rk.queue(dataset)))


def held(r: redis.Redis) -> dict[str, int]:
    """Messages delivered to some worker and not yet acknowledged, by dataset (one scan of ``unacked``)."""
    counts: dict[str, int] = {}
    for _tag, raw in r.hscan_iter(rk.UNACKED, count=1000):
        try:
            _env_, _exchange, routing_key = _unacked.decode(raw)
        except msgspec.DecodeError:
            continue
        name = rk.dataset_of_queue(routing_key)
        if name:
            counts[name] = counts.get(name, 0) + 1
    return counts
