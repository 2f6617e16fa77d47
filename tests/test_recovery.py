"""recovery.py against a real Redis, with unacknowledged messages made by kombu itself."""

from __future__ import annotations

import json
import threading
import time

import pytest

from draftfleet import redis_keys as rk
from draftfleet.recovery import Recovery
from draftfleet.workers.app import make_app

KEY = "ab" * 32


@pytest.fixture
def app(redis_server):
    return make_app(redis_server.url, 7200)


def _hold(app, r, key: str = KEY, age_s: float = 60.0, **options) -> str:
    """Send a task, take it off its queue without acking (as a worker does), backdate its delivery."""
    app.send_task(rk.TASK_NAME, args=[{"key": key}], queue=rk.queue("ds"), task_id=key, **options)
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get(rk.queue("ds"), no_ack=False)
        assert message is not None
        tag = message.delivery_tag
        conn.default_channel.qos._delivered.clear()  # this "worker" dies: nothing restores at close
    r.zadd(rk.UNACKED_INDEX, {tag: time.time() - age_s})
    return tag


def test_orphan_goes_back_to_its_queue_once_flagged_redelivered(app, redis_server):
    r = redis_server.client()
    _hold(app, r)
    assert r.hlen(rk.UNACKED) == 1 and not r.llen(rk.queue("ds"))
    assert Recovery(r, grace_s=30).sweep() == 1
    assert not r.hlen(rk.UNACKED) and not r.zcard(rk.UNACKED_INDEX)
    [raw] = r.lrange(rk.queue("ds"), 0, -1)
    payload = json.loads(raw)
    assert payload["headers"]["id"] == KEY and payload["headers"]["redelivered"] is True
    assert payload["properties"]["delivery_info"]["redelivered"] is True
    assert Recovery(r, grace_s=30).sweep() == 0


@pytest.mark.parametrize("case", ["claimed", "just delivered", "waiting for its countdown", "not a dataset queue"])
def test_held_messages_stay_where_they_are(case, app, redis_server):
    r = redis_server.client()
    if case == "claimed":
        _hold(app, r)
        r.set(rk.claim("ds", KEY), "a live worker", ex=60)
    elif case == "just delivered":
        _hold(app, r, age_s=1)
    elif case == "waiting for its countdown":
        _hold(app, r, countdown=600)
    else:
        app.send_task(rk.TASK_NAME, args=[{}], queue=rk.QUEUE_PREFIX + "_reconcile", task_id=KEY)
        with app.connection_for_write() as conn:
            assert conn.default_channel.basic_get(rk.QUEUE_PREFIX + "_reconcile", no_ack=False) is not None
            conn.default_channel.qos._delivered.clear()
        [tag] = r.hkeys(rk.UNACKED)
        r.zadd(rk.UNACKED_INDEX, {tag: time.time() - 60})
    assert Recovery(r, grace_s=30).sweep() == 0
    assert r.hlen(rk.UNACKED) == 1


def test_concurrent_sweeps_restore_each_message_once(app, redis_server):
    r = redis_server.client()
    keys = [f"{i:064x}" for i in range(40)]
    for key in keys:
        _hold(app, r, key)
    results: list[int] = []
    barrier = threading.Barrier(4)

    def sweep():
        barrier.wait()
        results.append(Recovery(redis_server.client(), grace_s=30).sweep())

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 40 and r.llen(rk.queue("ds")) == 40 and not r.hlen(rk.UNACKED)
    assert sorted(json.loads(m)["headers"]["id"] for m in r.lrange(rk.queue("ds"), 0, -1)) == sorted(keys)


def test_a_message_acked_meanwhile_is_not_restored(app, redis_server):
    r = redis_server.client()
    tag = _hold(app, r)
    recovery = Recovery(r, grace_s=30)
    raw = r.hget(rk.UNACKED, tag)
    r.hdel(rk.UNACKED, tag)  # its worker acked between the scan and the move
    assert recovery._restore(keys=[rk.UNACKED, rk.UNACKED_INDEX, rk.claim("ds", KEY), rk.queue("ds")],
                             args=[tag, raw, raw]) == 0
    assert not r.llen(rk.queue("ds"))


def test_one_sweep_per_interval_across_the_fleet(redis_server):
    r = redis_server.client()
    assert Recovery(r, grace_s=30).maybe_sweep("worker-a", 5) == 0
    assert r.get(rk.RECOVERY_LOCK) == b"worker-a" and 0 < r.ttl(rk.RECOVERY_LOCK) <= 5
    assert Recovery(r, grace_s=30).maybe_sweep("worker-b", 5) == 0
    assert r.get(rk.RECOVERY_LOCK) == b"worker-a"
