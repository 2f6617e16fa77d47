"""A worker's queues follow what it wants, whatever order its changes reach the consumer in.

Pauses, resumes, admission holds and assignment changes come from several threads (task threads,
the pause's probe, the assignment watcher), and only the consumer's own thread may change what it
consumes: changes are handed to it with ``call_soon``. Celery documents that "callback ordering
is not guaranteed" there, and kombu's event loop keeps the callbacks in a set. A pause whose
cause clears at once (a key fixed, a server back within a probe) used to hand over a cancel and
an add of the same queue together; run add first (a no-op: still consuming), then cancel, the
worker stopped consuming for good while it believed it consumed.

The worker here is a real Celery worker (threads pool, the fleet's consumer and transport) in
this process, on a real Redis, its backend the cloud client on the emulator over loopback.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
from celery.contrib.testing.worker import start_worker

from draftfleet import redis_keys as rk
from draftfleet.identity import prompt_key, settings_id
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import Message, PromptTask
from draftfleet.store import open_store

from .conftest import wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV

QUEUE = rk.queue("ds")


@pytest.fixture
def worker(tmp_path, redis_server, tokenizer_dir, target_tokenizer, emulator_factory):
    """A real worker consuming dataset ``ds``, its Runtime attached to its consumer."""
    from draftfleet.workers import tasks
    from draftfleet.workers.app import make_app
    from draftfleet.workers.cloud import CloudChat

    emu = emulator_factory(time_scale=0, length="uniform:3:10", api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    cfg = load_config(write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                                   datasets=[{"name": "ds", "path": str(data), "max_tokens": 16}]))
    store = open_store(cfg)
    store.prepare()
    backend = CloudChat("cloudy", cfg.cloud("cloudy"), target_tokenizer, KEY_ENV["DRAFTFLEET_TEST_KEY"])
    app = make_app(redis_server.url, 3600)
    app.conf.worker_consumer = "draftfleet.workers.consumer:Consumer"
    app.conf.broker_transport = "draftfleet.workers.consumer:Transport"
    tasks.register(app)
    rt = tasks.Runtime(app, cfg, store, redis_server.client(), backend, "consuming@test", ["ds"], 60.0)
    tasks.install(rt)
    settings = cfg.dataset("ds").settings(cfg.fleet.model)

    def send(n: int, tag: str) -> list[str]:
        keys = []
        for i in range(n):
            messages = [Message(role="user", content=f"{tag} {i}")]
            task = PromptTask(key=prompt_key("ds", messages, settings), dataset="ds", source=f"d.jsonl:{i}",
                              messages=messages, settings=settings, settings_id=settings_id(settings),
                              enqueued_at=time.time())
            app.send_task(rk.TASK_NAME, args=[msgspec.to_builtins(task)], queue=QUEUE, task_id=task.key)
            keys.append(task.key)
        return keys

    try:
        with start_worker(app, pool="threads", concurrency=2, queues=rt.initial_queues(), perform_ping_check=False,
                          loglevel="WARNING", shutdown_timeout=30) as w:
            rt.attach(w.consumer)  # what the worker_ready signal does in `draftfleet worker`
            try:
                yield SimpleNamespace(rt=rt, consumer=w.consumer, store=store, send=send)
            finally:
                rt.stop()
    finally:
        backend.close()


def _on_loop(consumer, fn) -> None:
    """Run ``fn`` on the consumer's own thread (where Celery applies queue changes) and wait for it."""
    done = threading.Event()
    box = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box.append(exc)
        finally:
            done.set()

    consumer.call_soon(run)
    assert done.wait(10), "the consumer's loop did not run the callback"
    if box:
        raise box[0]


def _consuming(consumer) -> set[str]:
    out: set[str] = set()
    _on_loop(consumer, lambda: out.update(q.name for q in consumer.task_consumer.queues
                                          if consumer.task_consumer.consuming_from(q.name)))
    return out


def test_pause_and_resume_handed_over_in_reverse_order_still_consume(worker, monkeypatch) -> None:
    """The consumer's loop runs the resume's change before the pause's: the worker consumes."""
    consumer, rt = worker.consumer, worker.rt
    assert _consuming(consumer) == {QUEUE}
    for _ in range(3):
        handed: list = []
        monkeypatch.setattr(consumer, "call_soon", lambda fn, *a, **kw: handed.append((fn, a, kw)))
        rt.pause("http_401", "the key was refused")
        rt.resume()  # the probe answered at once
        monkeypatch.undo()
        assert handed, "pause and resume hand their changes to the consumer's thread"
        _on_loop(consumer, lambda: [fn(*a, **kw) for fn, a, kw in reversed(handed)])
        assert rt.paused is None
        wait_until(lambda: _consuming(consumer) == {QUEUE}, 5, 0.05, "the worker to consume its queue again")
    keys = worker.send(4, "after flaps")
    wait_until(lambda: set(keys) <= set(worker.store.keys("ds")), 30, 0.1, "the tasks sent after the pauses")


def test_pauses_that_clear_at_once_never_stop_the_worker(worker) -> None:
    """Many pauses that clear within the same instant, from several threads, as tasks run."""
    consumer, rt = worker.consumer, worker.rt
    first = worker.send(6, "before")

    def flap(n: int) -> None:
        for _ in range(n):
            rt.pause("server_down", "connection refused")
            rt.resume()

    threads = [threading.Thread(target=flap, args=(100,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rt.resume()
    wait_until(lambda: _consuming(consumer) == {QUEUE}, 10, 0.1, "the worker to consume its queue once calm")
    later = worker.send(6, "after")
    wait_until(lambda: set(first + later) <= set(worker.store.keys("ds")), 60, 0.1, "every task sent")
