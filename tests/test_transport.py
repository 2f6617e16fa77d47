"""The worker's kombu transport (workers/consumer.py) builds one redis-py client per connection pool.

kombu's Redis channel made a new ``redis.Redis`` for every group of commands it sent (each
delivery's unacked bookkeeping, each ack, each publish), and redis-py 8 fills 169 response
callbacks into every new client: about 1 ms of CPU each on a busy core, three a message, a third
of a capture worker's CPU per unit (BENCHMARKS.md, capture). Real Redis, real kombu messages.
"""

from __future__ import annotations

import redis
from kombu import Connection

from draftfleet.workers.consumer import Transport


def _count_clients(monkeypatch) -> list[int]:
    built = [0]
    init = redis.Redis.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counting)
    return built


def test_messages_and_acks_share_one_client_per_pool(redis_server, monkeypatch):
    built = _count_clients(monkeypatch)
    with Connection(redis_server.url, transport=Transport) as conn:
        queue = conn.SimpleQueue("draftfleet.transport-test")
        for i in range(30):
            queue.put({"n": i})
        got = []
        for _ in range(30):
            message = queue.get(timeout=5)
            got.append(message.payload["n"])
            message.ack()
        queue.close()
    assert sorted(got) == list(range(30))
    assert redis_server.client().llen("draftfleet.transport-test") == 0
    assert not redis_server.client().hlen("unacked")  # every ack reached Redis
    # 30 publishes, 30 deliveries and 30 acks: a handful of clients (channels, BRPOP's own), not ~90
    assert built[0] <= 6, built[0]


def test_a_new_pool_gets_a_new_client(redis_server):
    with Connection(redis_server.url, transport=Transport) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as again:
            assert again is first and first.connection_pool is channel.pool
        channel._pool = None  # as kombu drops it when the connection is lost
        with channel.conn_or_acquire() as after:
            assert after is not first and after.connection_pool is channel.pool
            assert after.ping()
