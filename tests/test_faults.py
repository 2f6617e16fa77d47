"""The fault suite: nothing lost, nothing counted twice (issue 5; results in RELIABILITY.md).

Real Redis, real worker processes, the emulator on loopback. Workers run with
``DRAFTFLEET_CLAIM_TTL_S=6``: a dead worker's claims lapse, and its messages come back, in
seconds instead of minutes. Every test ends on the same check: each prompt has exactly one
result, nothing failed, nothing is left queued or unacknowledged, and the counters equal the store.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from draftfleet import redis_keys as rk
from draftfleet.devtools.emulator import Emulator, EmulatorConfig
from draftfleet.ledger import Ledger, micro_usd
from draftfleet.queues import queued_keys
from draftfleet.schemas.config import load_config
from draftfleet.store import Store, open_store

from .conftest import RedisServer, free_port, run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _enqueue

pytestmark = pytest.mark.slow

CLAIM_ENV = {"DRAFTFLEET_CLAIM_TTL_S": "6"}
FIELDS = ("responses", "prompt_tokens", "completion_tokens", "cost_micro_usd")
CLOUD_ENV = {**KEY_ENV, **CLAIM_ENV}


def _rows(n: int, tag: str = "p") -> list[dict]:
    return [{"prompt": f"{tag} prompt {i}: write a function"} for i in range(n)]


def _events(r, dataset: str) -> Counter:
    return Counter({k.decode(): int(v) for k, v in r.hgetall(rk.events(dataset)).items()})


def _workers_up(r, n: int) -> bool:
    return len(list(r.scan_iter(rk.worker_report("*")))) >= n


def _report(r, name_prefix: str) -> dict:
    for key in r.scan_iter(rk.worker_report(name_prefix + "*")):
        raw = r.get(key)
        if raw:
            return json.loads(raw)
    return {}


def _sums(records) -> dict[str, dict[str, int]]:
    """What the counters must hold for these records, per backend."""
    want: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for rec in records:
        w = want[rec.backend]
        w["responses"] += 1
        w["prompt_tokens"] += rec.prompt_tokens
        w["completion_tokens"] += rec.completion_tokens
        w["cost_micro_usd"] += micro_usd(rec.cost_usd)
    return dict(want)


def _counters(r, dataset: str) -> dict[str, dict[str, int]]:
    return {b: {f: t.get(f, 0) for f in FIELDS} for b, t in Ledger(r).totals(dataset).items()}


def assert_exactly_once(store: Store, r, dataset: str, n: int, timeout: float = 30) -> list:
    """Each of the n prompts has one result, none failed, none left in Redis; counters = store."""
    records = list(store.records(dataset))
    sources = Counter(rec.source for rec in records)
    assert len(records) == n and len(sources) == n and set(sources.values()) == {1}, sources.most_common(3)
    assert not store.failures(dataset)
    wait_until(lambda: not queued_keys(r, dataset), timeout, 0.2, "queue and unacked to empty")
    wait_until(lambda: not list(r.scan_iter(rk.claim(dataset, "*"))), timeout, 0.2, "claims to be released")
    assert _counters(r, dataset) == _sums(records)
    assert r.scard(rk.counted_set(dataset)) == n
    return records


def assert_counted_once(store: Store, r, dataset: str) -> int:
    """Before any reconcile pass: every counted key is stored, and the counters are exactly the sums
    over the counted keys' records (a key counted twice, or a count without a record, shows here;
    a reconcile pass would hide it). Returns how many keys are counted."""
    counted = {k.decode() for k in r.smembers(rk.counted_set(dataset))}
    assert counted <= store.keys(dataset), "counted keys missing from the store"
    got = {b: t for b, t in _counters(r, dataset).items() if any(t.values())}
    assert got == _sums(store.get(dataset, key) for key in counted)
    return len(counted)


def _keys(config: Path) -> list[str]:
    """Every prompt key of the dataset, as enqueue makes them."""
    from draftfleet.identity import prompt_key
    from draftfleet.producer.enqueue import prompt_messages
    from draftfleet.producer.readers import PromptRow, read_prompts

    cfg = load_config(config)
    ds = cfg.dataset("ds")
    settings = open_store(cfg).manifest("ds").settings
    return [prompt_key("ds", prompt_messages(ds, row), settings) for row in read_prompts(ds) if isinstance(row, PromptRow)]


def _setup(tmp_path, tokenizer_dir, emu_url: str, n: int, **config) -> tuple[Path, Store]:
    data = write_jsonl(tmp_path / "d.jsonl", _rows(n))
    max_tokens = config.pop("max_tokens", 64)
    path = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu_url,
                        datasets=[{"name": "ds", "path": str(data), "max_tokens": max_tokens}], **config)
    return path, open_store(load_config(path))


def _start(workers, config, kind: str, name: str, redis_url: str, emu_url: str, *extra: str):
    if kind == "gpu":
        return workers.start(config, "gpu", "--url", emu_url, "--name", name, *extra, redis_url=redis_url, env=CLAIM_ENV)
    return workers.start(config, "cloud", "--backend", "cloudy", "--name", name, *extra, redis_url=redis_url,
                         env=CLOUD_ENV)


# -- 1. SIGKILL mid-flight -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpu", "cloud"])
def test_worker_killed_mid_flight_loses_nothing(kind, tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                workers):
    # each answer takes ~2 s, so the killed worker holds 16 requests open
    emu = emulator_factory(single_stream_tps=20, ceiling_tps=100000, length="fixed:40", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 60, inflight=16, concurrency=16)
    r = redis_server.client()
    victim = _start(workers, config, kind, "victim", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: emu.stats()["open"] >= 16, 30, 0.05, f"16 requests open\n{workers.logs()}")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    held = r.hlen(rk.UNACKED)
    assert held >= 16, "the killed worker's messages stay unacknowledged"
    stored_at_kill = len(store.keys("ds"))

    survivor = _start(workers, config, kind, "survivor", redis_server.url, emu.url)
    wait_until(lambda: len(store.keys("ds")) == 60, 60, 0.2, f"60 results\n{workers.logs()}")
    workers.assert_alive(survivor)
    assert_exactly_once(store, r, "ds", 60)
    # the killed requests were generated again, and the survivor said it gave them back
    generated = emu.stats()["by_endpoint"].get("/generate" if kind == "gpu" else "/v1/chat/completions")
    assert generated >= 60 + 16 and stored_at_kill < 60  # the 16 cut requests ran again
    assert "held by no live worker back to their queues" in workers.logs(tail=None)


# -- 2 and 3. Redis restarted ----------------------------------------------------------------------


def test_redis_restarted_empty_then_enqueue_restores_exactly_the_missing(tmp_path, redis_server, tokenizer_dir,
                                                                          emulator_factory, workers):
    # 3 s an answer: the requests open at the restart are still open a heartbeat later
    emu = emulator_factory(single_stream_tps=30, ceiling_tps=100000, length="fixed:90", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 60, inflight=8, concurrency=8, max_tokens=128)
    r = redis_server.client()
    gpu = _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)
    cloud = _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 2), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) >= 12 and emu.stats()["open"] >= 8, 60, 0.05, workers.logs())

    # The requests open now stay open until the enqueue below has counted them as in flight: on a loaded
    # machine its start alone can outlast a 3 s answer (CI saw in_flight == 0 once).
    emu.update(single_stream_tps=0.5)
    redis_server.restart(keep_data=False)  # SIGKILL, append-only files removed: queues, claims, counters gone
    r = redis_server.client()
    assert not r.exists(rk.queue("ds"))
    # the heartbeats put back the claims of the requests still open (nothing else could make one:
    # no task is queued yet)
    wait_until(lambda: len(list(r.scan_iter(rk.claim("ds", "*")))) >= 8, 15, 0.05,
               f"the lost claims re-created\n{workers.logs()}")
    summary = _enqueue(config, redis_server.url)[0]
    emu.update(single_stream_tps=30)
    # queued: every key not stored, not already back in the queue (a message a worker popped as
    # Redis died is given back by that worker, as soon as it reconnects) and not held by a worker
    assert summary["queued"] + summary["already_done"] + summary["already_queued"] + summary["in_flight"] == 60
    assert summary["already_done"] >= 12 and summary["already_queued"] <= 2 and summary["in_flight"] >= 1
    every = set(_keys(config))
    wait_until(lambda: store.keys("ds") | queued_keys(r, "ds") == every, 20, 0.05, "every key stored or queued")

    wait_until(lambda: len(store.keys("ds")) == 60, 60, 0.2, f"60 results\n{workers.logs()}")
    workers.assert_alive(gpu, cloud)
    logs = workers.logs(tail=None)
    assert logs.count("Connected to") >= 4  # each worker connected again on its own
    # the open requests were not sent again (in flight): nothing was generated twice
    wait_until(lambda: not queued_keys(r, "ds"), 30, 0.2, "the last copies to finish")
    calls = emu.stats()["by_endpoint"]
    assert calls.get("/generate", 0) + calls.get("/v1/chat/completions", 0) == 60
    # count-once, before any reconcile: what was counted since the restart is counted once
    assert assert_counted_once(store, r, "ds") >= 60 - summary["already_done"]
    # the counters lost with Redis are rebuilt from the store by the reconciler
    res = run_cli("reconcile", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    records = assert_exactly_once(store, r, "ds", 60)
    assert {rec.backend for rec in records} == {"sglang", "cloudy"}


def test_a_redis_error_reply_to_the_consumer_does_not_end_the_worker(tmp_path, redis_server, tokenizer_dir,
                                                                     emulator_factory, workers):
    # A Redis that answers the waiting BRPOP with an error (CLIENT UNBLOCK ... ERROR here; a failover's
    # "UNBLOCKED ... master -> replica", a restart's error replies in the field) raised a ResponseError,
    # which Celery counts as a channel error, not a connection error: "Unrecoverable error", and the
    # worker exited (status 0, so a supervisor would not even restart it). It reconnects instead.
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="fixed:20", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 20, inflight=8, concurrency=8)
    r = redis_server.client()
    gpu = _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())

    def unblock() -> bool:  # the idle consumer waits in BRPOP; answer it with an error
        return any(r.execute_command("CLIENT", "UNBLOCK", c["id"], "ERROR") for c in r.client_list()
                   if c["cmd"] in ("brpop", "blpop"))

    wait_until(unblock, 30, 0.02, lambda: f"the consumer waiting in BRPOP\n{workers.logs()}")
    wait_until(lambda: "ResponseError" in workers.logs(tail=None), 10, 0.1, workers.logs)
    time.sleep(1.0)  # an exit takes a moment
    workers.assert_alive(gpu)
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 20, 60, 0.2, lambda: f"20 results\n{workers.logs()}")
    workers.assert_alive(gpu)
    assert_exactly_once(store, r, "ds", 20)
    assert "Unrecoverable error" not in workers.logs(tail=None)


def test_redis_restarted_with_its_data_the_run_goes_on(tmp_path, tokenizer_dir, emulator_factory, workers):
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    try:
        emu = emulator_factory(single_stream_tps=30, ceiling_tps=100000, length="fixed:30", ttft_s=0.0,
                               api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
        config, store = _setup(tmp_path, tokenizer_dir, emu.url, 60, inflight=8, concurrency=8)
        r = server.client()
        gpu = _start(workers, config, "gpu", "gpu", server.url, emu.url)
        cloud = _start(workers, config, "cloud", "cloud", server.url, emu.url)
        wait_until(lambda: _workers_up(r, 2), 60, 0.1, workers.logs())
        _enqueue(config, server.url)
        wait_until(lambda: len(store.keys("ds")) >= 12 and emu.stats()["open"] >= 8, 60, 0.05, workers.logs())
        server.stop()  # SIGKILL: the append-only file has everything but the last second
        time.sleep(2)
        server.start()
        # no enqueue: the queue, the unacked messages and the counters come back from disk
        wait_until(lambda: len(store.keys("ds")) == 60, 60, 0.2, f"60 results\n{workers.logs()}")
        workers.assert_alive(gpu, cloud)
        r = server.client()
        wait_until(lambda: not queued_keys(r, "ds"), 30, 0.2, "the queue and unacked to empty")
        # count-once, before any reconcile: a count lost in the last second is missing (the
        # reconciler adds it), but nothing is counted twice and nothing counted is unstored
        assert assert_counted_once(store, r, "ds") >= 60 - 16
        res = run_cli("reconcile", "--config", str(config), "--json", env={"REDIS_URL": server.url})
        assert res.returncode == 0, res.stderr
        assert_exactly_once(store, r, "ds", 60)
    finally:
        workers.stop_all()
        server.stop()


# -- 4. a flaky API --------------------------------------------------------------------------------


def test_api_errors_hangs_and_cut_bodies_are_retried_and_counted(tmp_path, redis_server, tokenizer_dir,
                                                                 emulator_factory, workers):
    # 150 prompts: a fault kind drawn only on one path (429 comes from the cloud alone) must happen there for
    # sure; with 60, when the GPU worker took most of them, the cloud's ~25 requests drew no 429 once in CI
    n = 150
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:40", ttft_s=0.0, seed=11,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], rate_429=0.1, rate_500=0.08, rate_503=0.08,
                           rate_hang=0.04, rate_cut=0.08, retry_after_s=0.5, hang_s=5.0)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, n, inflight=8, concurrency=8, max_attempts=10,
                           sglang_timeout_s=2.0, cloud_timeout_s=2.0)
    r = redis_server.client()
    _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)
    _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 2), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == n, 240, 0.2, lambda: f"{n} results\n{workers.logs()}")
    records = assert_exactly_once(store, r, "ds", n)

    faults = emu.stats()["faults"]
    events = _events(r, "ds")
    print("faults drawn:", faults, "records by backend:", {b: sum(rec.backend == b for rec in records)
                                                           for b in ("sglang", "cloudy")})
    # every fault the API produced was retried once, under its own reason
    assert events["retry:http_429"] == faults["429"] > 0
    assert events["retry:http_500"] == faults["500"] > 0
    assert events["retry:http_503"] == faults["503"] > 0
    assert events["retry:timeout"] == faults["hang"] > 0
    assert events["retry:connection"] == faults["cut"] > 0
    assert sum(rec.attempts - 1 for rec in records) == sum(faults.values())
    assert not [e for e in events if e.startswith("failed:")]
    assert {rec.backend for rec in records} == {"sglang", "cloudy"}


# -- 5. 402 and 401 mid-run ------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["402", "401"])
def test_cloud_stops_on_402_or_401_mid_run_and_resumes(fault, tmp_path, redis_server, tokenizer_dir,
                                                       emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=30, ceiling_tps=100000, length="fixed:20", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 40, concurrency=4)
    r = redis_server.client()
    _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) >= 8, 60, 0.1, workers.logs())

    if fault == "402":
        emu.update(rate_402=1.0)  # out of credits
    else:
        emu.update(api_key="a-rotated-key")  # the key in the environment is revoked
    reason = "payment_required" if fault == "402" else "unauthorized"
    wait_until(lambda: _report(r, "cloud@").get("paused") == reason, 30, 0.1, f"a pause\n{workers.logs()}")
    # requests already past the key check finish; the others go back to the queue: the store plus
    # what Redis holds is every prompt
    wait_until(lambda: len(store.keys("ds") | queued_keys(r, "ds")) == 40 and not r.hlen(rk.UNACKED), 30, 0.1,
               f"every task back in the queue\n{workers.logs()}")
    stored = store.keys("ds")
    time.sleep(5)  # two pause periods: the worker tries again, is refused again, stores nothing
    assert store.keys("ds") == stored and len(stored) < 40
    assert not store.failures("ds") and not [e for e in _events(r, "ds") if e.startswith("failed:")]

    emu.update(rate_402=0.0, api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])  # credits topped up, key restored
    wait_until(lambda: len(store.keys("ds")) == 40, 60, 0.2, f"40 results after resume\n{workers.logs()}")
    assert_exactly_once(store, r, "ds", 40)
    logs = workers.logs(tail=None)
    assert f"STOPPED CONSUMING draftfleet.ds: {reason}" in logs and "resuming after a pause" in logs
    assert KEY_ENV["DRAFTFLEET_TEST_KEY"] not in logs


# -- 6. the SGLang server dies mid-batch -----------------------------------------------------------


def test_sglang_server_dies_mid_batch_and_comes_back(tmp_path, redis_server, tokenizer_dir, workers):
    port = free_port()
    settings = dict(tokenizer=str(tokenizer_dir), model="test/chatml", single_stream_tps=20, ceiling_tps=100000,
                    length="fixed:40", ttft_s=0.0)
    emu = Emulator(EmulatorConfig(**settings), port=port).start()
    try:
        config, store = _setup(tmp_path, tokenizer_dir, emu.url, 40, inflight=16, max_attempts=3)
        r = redis_server.client()
        gpu = _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)
        wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
        _enqueue(config, redis_server.url)
        wait_until(lambda: len(store.keys("ds")) >= 4 and emu.stats()["open"] >= 16, 30, 0.05, workers.logs())
        emu.stop()  # the server dies with 16 requests in flight

        wait_until(lambda: _report(r, "gpu@").get("paused") == "server_down", 60, 0.2, f"a pause\n{workers.logs()}")
        wait_until(lambda: len(store.keys("ds") | queued_keys(r, "ds")) == 40 and not r.hlen(rk.UNACKED), 30, 0.1,
                   f"every task back in the queue\n{workers.logs()}")
        assert not store.failures("ds")
        events = _events(r, "ds")
        assert events["retry:connection"] > 0 and events["retry:server_down"] > 0

        emu = Emulator(EmulatorConfig(**settings), port=port).start()  # restarted (a supervisor, an operator)
        # the worker probes /health every second: it resumes within seconds, not after its 30 s pause
        wait_until(lambda: _report(r, "gpu@").get("paused") is None, 10, 0.1, f"a resume\n{workers.logs()}")
        wait_until(lambda: len(store.keys("ds")) == 40, 60, 0.2, f"40 results\n{workers.logs()}")
        workers.assert_alive(gpu)
        assert_exactly_once(store, r, "ds", 40)
        logs = workers.logs(tail=None)
        assert "STOPPED CONSUMING draftfleet.ds: server_down" in logs and "resuming after a pause" in logs
    finally:
        emu.stop()


# -- 7. the store cannot be written ----------------------------------------------------------------


def test_unwritable_store_is_retried_never_acked_as_done(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                         workers):
    emu = emulator_factory(time_scale=0)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 10)
    r = redis_server.client()
    _enqueue(config, redis_server.url)
    # a file wherever a shard folder must go: every write fails with ENOTDIR, also as root
    blockers = [store.root / "ds" / f"{i:02x}" for i in range(256)]
    for b in blockers:
        b.write_text("not a folder")
    _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)
    wait_until(lambda: _events(r, "ds")["retry:store_error"] >= 20, 60, 0.2, f"store retries\n{workers.logs()}")
    logs = workers.logs(tail=None)
    # the worker says why, naming the path at fault
    assert re.search(r"cannot store ds/\w+ \(attempt 1/\d+\): cannot write \S+/ds/(\w\w)/\w+\.json: \S+/ds/\1: File exists",
                     logs), logs[-3000:]
    # nothing is stored, counted or acknowledged: every task is still held, unacked
    assert not store.keys("ds") and not r.exists(rk.counted_set("ds"))
    assert len(queued_keys(r, "ds")) == 10 and r.hlen(rk.UNACKED) == 10

    for b in blockers:  # the operator frees the store
        b.unlink()
    wait_until(lambda: len(store.keys("ds")) == 10, 60, 0.2, f"10 results\n{workers.logs()}")
    assert_exactly_once(store, r, "ds", 10)
    assert emu.stats()["by_endpoint"]["/generate"] == 10  # kept in memory while retrying: not generated again


def test_store_gives_up_by_requeueing_and_says_why(tmp_path, monkeypatch, caplog):
    """After its last attempt the task goes back to the queue (Reject requeue), never acked as done."""
    import errno
    from types import SimpleNamespace

    from celery.exceptions import Reject

    from draftfleet.workers import tasks

    from .test_core import _record

    def no_space(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", no_space)
    monkeypatch.setattr(tasks.time, "sleep", lambda s: None)
    events = Counter()
    rt = SimpleNamespace(store=open_store(tmp_path), ledger=SimpleNamespace(event=lambda d, name: events.update([name])))
    with pytest.raises(Reject) as exc:
        tasks._store(rt, _record("ef" * 32), "edge@test:1:0")
    assert exc.value.requeue and "No space left on device" in str(exc.value.reason)
    assert events["retry:store_error"] == tasks.STORE_ATTEMPTS
    assert "No space left on device" in caplog.text and not list(tmp_path.rglob("*.json"))


# -- 8. poison messages ----------------------------------------------------------------------------


class _Bomb:
    """Unpickling this creates a file: the proof that a pickled message is never deserialized."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_poison_messages_are_dead_lettered_and_the_worker_goes_on(tmp_path, redis_server, tokenizer_dir,
                                                                  emulator_factory, workers):
    from kombu import Exchange, Queue

    from draftfleet.workers.app import make_app
    from draftfleet.workers.consumer import MAX_MESSAGE_BYTES

    emu = emulator_factory(time_scale=0)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 5)
    r = redis_server.client()
    q = rk.queue("ds")
    marker = tmp_path / "unpickled"
    app = make_app(redis_server.url, 7200)
    ex = Exchange(q, type="direct")
    head = {"lang": "py", "argsrepr": "", "kwargsrepr": "", "origin": "test"}

    def publish(body, content_type, task=rk.TASK_NAME):
        headers = {**head, "id": uuid.uuid4().hex, **({"task": task} if task else {})}
        with app.connection_for_write() as conn:
            conn.Producer().publish(body, exchange=ex, routing_key=q, declare=[Queue(q, ex, routing_key=q)],
                                    content_type=content_type, headers=headers,
                                    content_encoding="utf-8" if "json" in content_type else "binary")

    r.lpush(q, b"this is not a kombu message")
    r.lpush(q, b"42")
    r.lpush(q, b'{"an": "object without an envelope"}')
    publish(b"{not json", "application/json")
    publish(pickle.dumps(([{"bomb": _Bomb(marker)}], {}, {})), "application/x-python-serialize")
    publish(json.dumps([[{"x": 1}], {}, {}]), "application/json", task=None)
    publish(json.dumps([[{"x": 1}], {}, {}]), "application/json", task="someone.elses_task")
    publish(json.dumps([[], {}, {}]), "application/json")
    publish(json.dumps([[{"key": "ab" * 32, "dataset": "ds"}], {}, {}]), "application/json")
    huge = json.dumps([[{"key": "cd" * 32, "dataset": "ds", "source": "x" * (MAX_MESSAGE_BYTES + 1024)}], {}, {}])
    publish(huge, "application/json")
    _enqueue(config, redis_server.url)
    worker = _start(workers, config, "gpu", "gpu", redis_server.url, emu.url)

    wait_until(lambda: len(store.keys("ds")) == 5, 60, 0.2, f"5 results\n{workers.logs()}")
    wait_until(lambda: r.llen(rk.DEAD_LETTER) == 10, 30, 0.2, f"10 dead letters\n{workers.logs()}")
    workers.assert_alive(worker)
    entries = [json.loads(x) for x in r.lrange(rk.DEAD_LETTER, 0, -1)]
    reasons = [e["reason"] for e in entries]
    expected = [
        "body does not decode as application/json",
        "message of ",
        "not a kombu message (a JSON int, not a message envelope)",
        "not a kombu message (no properties.delivery_tag)",
        "not a kombu message (not JSON",
        "not a task message (no task header)",
        "not a valid task: Object missing required field",
        "not a valid task: expected one argument, the prompt",
        "refused: Refusing to deserialize untrusted content of type pickle",
        "unknown task 'someone.elses_task'",
    ]
    assert len(reasons) == len(expected), reasons
    for want in expected:
        assert sum(got.startswith(want) for got in reasons) == 1, (want, reasons)
    assert all(e["queue"] == q and len(e["body_preview"]) <= 2000 for e in entries)
    assert not marker.exists()  # the pickle was refused, never loaded
    assert_exactly_once(store, r, "ds", 5)


# -- 9. a task longer than the visibility timeout --------------------------------------------------


def _redeliver_as_visibility_timeout(url: str) -> None:
    """What kombu does once a message is older than the visibility timeout: put it back (here at 1 s)."""
    from draftfleet.workers.app import make_app

    with make_app(url, 1).connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=None, interval=1)


def _consuming(proc) -> bool:
    """Celery's consumer of the worker ``proc`` takes messages now: its "<hostname> ready." line,
    logged once its queues are consumed. (A worker's report is published earlier: a GPU worker's
    as soon as it waits for its server, before its consumer starts.)"""
    log = Path(proc.log_path).read_text(errors="replace")
    return bool(re.search(r"/celery\.apps\.worker\] \S+ ready\.$", log, re.M))


def test_task_longer_than_visibility_timeout_runs_once(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                       workers):
    emu = emulator_factory(single_stream_tps=10, ceiling_tps=100000, length="fixed:60", ttft_s=0.0)  # 6 s each
    # the requests are held open below for as long as the second worker takes to start: a request
    # timeout well beyond that, so that no original is retried (a fifth generation)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 4, inflight=4, sglang_timeout_s=120.0)
    r = redis_server.client()
    first = _start(workers, config, "gpu", "first", redis_server.url, emu.url)
    wait_until(lambda: _consuming(first), 90, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: emu.stats()["open"] == 4, 30, 0.05, workers.logs())
    # The 4 originals must still run when their copies are handed out and reach the second
    # worker, however long that worker takes to start on a loaded machine (it took longer than the
    # 6 s they last): the emulator's clock all but stops until the copies are deferred.
    emu.update(time_scale=1e6)
    second = _start(workers, config, "gpu", "second", redis_server.url, emu.url)
    wait_until(lambda: _consuming(second), 90, 0.1, workers.logs())
    time.sleep(1.5)  # every message older than the 1 s timeout below
    _redeliver_as_visibility_timeout(redis_server.url)  # all 4 are handed out again while they run
    wait_until(lambda: _events(r, "ds")["deferred:claimed"] >= 4, 30, 0.1, f"the copies deferred\n{workers.logs()}")
    assert emu.stats()["open"] == 4 and not store.keys("ds")  # deferred while the originals run: their claims held
    emu.update(time_scale=0.1)  # the originals finish (in 0.6 s) before their copies come back (in 5 s)
    wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, workers.logs())
    assert_exactly_once(store, r, "ds", 4, timeout=60)
    assert emu.stats()["by_endpoint"]["/generate"] == 4  # the claim kept the copies from running


def test_task_whose_claim_lapsed_is_run_twice_but_stored_and_counted_once(tmp_path, redis_server, tokenizer_dir,
                                                                          emulator_factory, workers):
    # 12 s each: the first worker's requests are still open when it is resumed, so its heartbeat
    # still holds their claims in its set when it beats again
    emu = emulator_factory(single_stream_tps=5, ceiling_tps=100000, length="fixed:60", ttft_s=0.0)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 4, inflight=4)
    r = redis_server.client()
    first = _start(workers, config, "gpu", "first", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: emu.stats()["open"] == 4, 30, 0.05, workers.logs())
    # frozen, as a worker cut off from Redis: its claims lapse while its requests go on
    first.send_signal(signal.SIGSTOP)
    try:
        _start(workers, config, "gpu", "second", redis_server.url, emu.url)
        wait_until(lambda: emu.stats()["by_endpoint"]["/generate"] == 8, 60, 0.2,
                   f"the second worker to run them again\n{workers.logs()}")
    finally:
        first.send_signal(signal.SIGCONT)
    # the first worker beats again (every second) while both still generate: the claims stay the
    # second's
    time.sleep(2.5)
    holders = [r.get(k) for k in r.scan_iter(rk.claim("ds", "*"))]
    assert len(holders) == 4 and all(h.startswith(b"second@") for h in holders), holders
    wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, workers.logs())
    time.sleep(14)  # both copies of every key have finished
    workers.assert_alive(first)
    assert_exactly_once(store, r, "ds", 4, timeout=60)
    assert emu.stats()["completed"] == 8
