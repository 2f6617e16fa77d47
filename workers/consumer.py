"""How a worker takes messages off Redis: Celery's consumer and kombu's Redis transport, two gaps closed.

Poison messages. Whatever a queue holds that is not one of our tasks goes to the dead-letter
list, with the reason; Celery's own built-in tasks too (``celery.accumulate``, ``celery.map``...:
a worker runs only the fleet's). Celery drops such messages with a log line (a body that does
not decode, a content type other than JSON, a message without a task header or for an unknown
task) and never calls the task, so the consumer below also writes each to
``draftfleet:dead_letter``. A pickled message is refused by kombu's ``accept`` check before anything is deserialized: only
its raw bytes are previewed. Messages over :data:`MAX_MESSAGE_BYTES` are refused undecoded. One
case kills a stock worker: a list item kombu cannot read as a message (not JSON, or JSON but no
envelope); kombu fails on it inside the event loop ("Unrecoverable error"). The transport below
dead-letters it and goes on.

Redis going away. kombu pops a message (BRPOP), then records it as unacknowledged (HSET) in a
second step (kombu#305): a message popped just before the connection dropped is in neither
place, only in this process. The transport keeps such a message and pushes it back onto its
queue as soon as Redis answers again (a copy that was recorded after all is one more
redelivery, which the claim and the store absorb). And when the connection drops while a BRPOP
is pending, Celery collects the connection and then closes it again; kombu 5.7's channel close
first reads the pending BRPOP, which raises on the dead socket and leaves the channel
half-closed, and the second close rebuilds a connection pool from a transport already detached
from its connection (``AttributeError: 'NoneType' object has no attribute 'hostname'``): the
worker exits, with status 0. The channel below drains that read without letting the error stop
the close; the unacknowledged messages stay in Redis for ``recovery.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import time
from queue import Empty

import msgspec
import redis
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from kombu.utils import json as kombu_json

from draftfleet import redis_keys as rk
from draftfleet.broker import connect
from draftfleet.schemas.records import DeadLetter

log = logging.getLogger("draftfleet.worker")

# Celery registers its built-in tasks (celery.accumulate, celery.map, celery.backend_cleanup, ...) in
# every app; a worker runs only tasks whose name starts with this.
FLEET_TASK_PREFIX = "draftfleet."
# Four times the reader's 4 MiB line limit: JSON escapes non-ASCII text, up to 3x its UTF-8 size.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
PREVIEW_CHARS = 2000


def preview(body: object) -> str:
    """At most PREVIEW_CHARS of a body, as text; bytes are never deserialized, only shown."""
    if body is None:
        return ""
    if isinstance(body, (bytes, bytearray, memoryview)):
        text = bytes(body[: PREVIEW_CHARS * 4]).decode("utf-8", errors="backslashreplace")
    elif isinstance(body, str):
        text = body
    else:
        try:
            text = msgspec.json.encode(body).decode()
        except (TypeError, msgspec.EncodeError):
            text = repr(body)
    return text[:PREVIEW_CHARS]


def dead_letter(r: redis.Redis, *, queue: str, reason: str, body: object, worker: str) -> None:
    """Keep a refused message, with why, on the fleet's dead-letter list."""
    entry = DeadLetter(queue=queue, reason=reason, body_preview=preview(body), received_at=time.time(), worker=worker)
    r.lpush(rk.DEAD_LETTER, msgspec.json.encode(entry))
    log.error("dead-lettered a message from %s: %s", queue, reason)


class Consumer(CeleryConsumer):
    """Celery's consumer, dead-lettering every message it would otherwise drop."""

    _redis: redis.Redis | None = None

    def _dead_letter(self, message, reason: str) -> None:
        if self._redis is None:
            self._redis = connect(self.app.conf.broker_url)
        queue = (message.delivery_info or {}).get("routing_key") or "?"
        try:
            dead_letter(self._redis, queue=queue, reason=reason, body=message.body, worker=self.hostname)
        except redis.RedisError as exc:
            log.error("could not dead-letter a message from %s (%s): %s", queue, reason, exc)

    def create_task_handler(self, *args, **kwargs):
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message):
            size = len(message.body or b"")
            name = (message.headers or {}).get("task")
            if size > MAX_MESSAGE_BYTES:
                reason = f"message of {size} bytes is over the {MAX_MESSAGE_BYTES}-byte limit"
            elif isinstance(name, str) and name in self.app.tasks and not name.startswith(FLEET_TASK_PREFIX):
                reason = f"not a fleet task {name!r}: workers run only draftfleet's own tasks"
            else:
                return handle(message)
            self._dead_letter(message, reason)
            message.ack_log_error(log, self.connection_errors)
            return None

        return on_task_received

    def on_decode_error(self, message, exc):
        self._dead_letter(message, f"body does not decode as {message.content_type}: {exc}")
        super().on_decode_error(message, exc)

    def on_unknown_message(self, body, message):
        self._dead_letter(message, "not a task message (no task header)")
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc):
        name = (message.headers or {}).get("task")
        self._dead_letter(message, f"unknown task {name!r}")
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc):
        self._dead_letter(message, f"refused: {exc}")
        super().on_invalid_task(body, message, exc)


class _NotAMessage(Exception):
    def __init__(self, queue: str, reason: str, body: object):
        super().__init__(reason)
        self.queue, self.reason, self.body = queue, reason, body


def _envelope_problem(m: object) -> str | None:
    """What keeps kombu from building a message out of a decoded list item (None: nothing)."""
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, not a message envelope"
    props = m.get("properties")
    if not isinstance(props, dict) or "delivery_tag" not in props:
        return "no properties.delivery_tag"
    info = props.get("delivery_info")
    if not isinstance(info, dict) or "exchange" not in info or "routing_key" not in info:
        return "no properties.delivery_info"
    if not isinstance(m.get("headers") or {}, dict):
        return "headers is not an object"
    body = m.get("body")
    if body and props.get("body_encoding") == "base64":
        try:
            base64.b64decode(body)
        except (ValueError, TypeError):
            return "body is not base64"
    return None


# Popped off their queue, not recorded as unacknowledged: (queue, message), for the next channel.
_stranded: list[tuple[str, dict]] = []


class Channel(kombu_redis.Channel):
    _shared_client = None  # the redis-py client over ``self.pool`` (see _create_client)

    def _create_client(self, asynchronous=False):
        """kombu builds a new redis-py client for every group of commands it sends (``conn_or_acquire``:
        three a message, its ack included), and redis-py 8 fills 169 response callbacks into each: about
        1 ms of CPU every time on a busy core, a third of a capture worker's CPU per unit. A client is a
        thin, thread-safe wrapper over the channel's connection pool, so one is built per pool (a
        reconnect makes a new pool, and so a new client) and shared."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool, client = self.pool, self._shared_client
        if client is None or client.connection_pool is not pool:
            client = self._shared_client = super()._create_client()
        return client

    def _brpop_start(self, timeout=None):
        while _stranded:
            queue, message = _stranded[0]
            try:
                with self.conn_or_acquire() as client:
                    client.rpush(queue, kombu_json.dumps(message))
            except self.connection_errors:
                break
            _stranded.pop(0)
            log.warning("gave back to %s a message popped as the connection to Redis dropped", queue)
        return super()._brpop_start(timeout)

    def close(self):
        if self._in_poll and not self.closed:
            try:
                self._brpop_read()
            except (Empty, *self.connection_errors):
                pass  # the socket is gone: the close goes on
        super().close()

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except json.JSONDecodeError as exc:
            # Popped, then failed to decode: the default round-robin queue cycle has just
            # rotated the queue it came from to its end.
            items = getattr(self._queue_cycle, "items", None)
            self._dead_letter(items[-1] if items else "?", f"not a kombu message (not JSON: {exc.msg})", exc.doc)
        except _NotAMessage as exc:
            self._dead_letter(exc.queue, f"not a kombu message ({exc.reason})", exc.body)
        return True

    def _dead_letter(self, queue: str, reason: str, body: object) -> None:
        try:
            with self.conn_or_acquire() as client:
                dead_letter(client, queue=queue, reason=reason, body=body, worker=f"{socket.gethostname()}:{os.getpid()}")
        except redis.RedisError as err:
            log.error("could not dead-letter an undecodable message from %s (%s): %s", queue, reason, err)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport, but a list item it cannot read is dead-lettered, and a message
    popped as the connection dropped is kept for the next channel to give back."""

    Channel = Channel

    def _deliver(self, message, queue):
        problem = _envelope_problem(message)
        if problem is not None:
            raise _NotAMessage(queue, problem, message)
        try:
            super()._deliver(message, queue)
        except self.connection_errors:
            _stranded.append((queue, message))
            raise
