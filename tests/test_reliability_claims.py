"""What RELIABILITY.md claims and the fault suite did not enforce (issue 12).

Each test here fails when the behaviour it names is removed from the product: the backoff's
Retry-After floor and its cap, the heartbeat that re-creates a lost claim but never takes one from
another holder, the transient in-flight 402 that is retried (not a pause), the failed prompts
that ``failures`` lists and ``enqueue --retry-failed`` sends again, and a store that is really full.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from draftfleet import redis_keys as rk
from draftfleet.identity import prompt_key, settings_id
from draftfleet.schemas.config import MAX_RETRY_WAIT_S, load_config
from draftfleet.schemas.records import Message, PromptTask
from draftfleet.store import open_store

from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_faults import _events, _setup, _start, _workers_up, assert_exactly_once
from .test_fleet import KEY_ENV, _enqueue

KEY = KEY_ENV["DRAFTFLEET_TEST_KEY"]


# -- the backoff -------------------------------------------------------------------------------
def test_backoff_never_goes_below_retry_after():
    from draftfleet.workers.backends import backoff_s

    for attempt in range(1, 12):
        for retry_after in (0.5, 3.0, 45.0, 200.0):
            delays = [backoff_s(attempt, retry_after) for _ in range(200)]
            assert min(delays) >= retry_after, (attempt, retry_after, min(delays))
    # a Retry-After past the longest honoured wait is cut to it, never ignored
    assert {backoff_s(1, 10_000.0) for _ in range(50)} == {MAX_RETRY_WAIT_S}


def test_backoff_is_capped_and_jittered():
    from draftfleet.workers.backends import backoff_s

    for attempt in range(1, 30):
        delays = [backoff_s(attempt, None) for _ in range(300)]
        ceiling = min(60.0, 2.0 ** (attempt - 1))
        assert 0 <= min(delays) and max(delays) <= ceiling, (attempt, max(delays))
        assert max(delays) > 0.5 * ceiling  # full jitter spreads over the whole range
    assert max(backoff_s(40, None) for _ in range(300)) <= 60.0


# -- an in-process worker runtime --------------------------------------------------------------
@pytest.fixture
def runtime(tmp_path, redis_server, tokenizer_dir, target_tokenizer, emulator_factory, monkeypatch):
    """A worker's Runtime in this process: the cloud backend against the emulator, a real Redis."""
    from draftfleet.workers import tasks
    from draftfleet.workers.app import make_app
    from draftfleet.workers.cloud import CloudChat

    emu = emulator_factory(time_scale=0, api_key=KEY, retry_after_s=0.3)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    cfg = load_config(write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, max_attempts=6,
                                   datasets=[{"name": "ds", "path": str(data), "max_tokens": 16}]))
    backend = CloudChat("cloudy", cfg.cloud("cloudy"), target_tokenizer, KEY)
    app = make_app(redis_server.url, 3600)
    tasks.register(app)
    rt = tasks.Runtime(app, cfg, open_store(cfg), redis_server.client(), backend, "claims@test", ["ds"], 1.0)
    tasks.install(rt)
    settings = cfg.dataset("ds").settings(cfg.fleet.model)

    def prompt(i: int) -> PromptTask:
        messages = [Message(role="user", content=f"prompt {i}")]
        return PromptTask(key=prompt_key("ds", messages, settings), dataset="ds", source=f"d.jsonl:{i}",
                          messages=messages, settings=settings, settings_id=settings_id(settings), enqueued_at=0.0)

    rt.emu, rt.prompt = emu, prompt  # type: ignore[attr-defined]
    yield rt
    rt.stop()
    backend.close()


def test_heartbeat_recreates_a_lost_claim_and_never_takes_one_from_its_new_holder(runtime):
    from draftfleet.claims import CLAIM_TTL_S

    r = runtime.r
    task = runtime.prompt(1)
    token = runtime.acquire(task)
    claim = rk.claim("ds", task.key)
    assert r.get(claim) == token.encode()

    r.delete(claim)  # Redis restarted empty: the claim is gone while the task still runs
    runtime.heartbeat()
    assert r.get(claim) == token.encode() and 0 < r.ttl(claim) <= CLAIM_TTL_S

    r.set(claim, "survivor@host:7:abc", ex=100)  # it lapsed and another worker took the key
    for _ in range(3):
        runtime.heartbeat()
    assert r.get(claim) == b"survivor@host:7:abc" and r.ttl(claim) <= 100

    runtime.release(task, token)  # and the release leaves the new holder's claim alone
    assert r.get(claim) == b"survivor@host:7:abc"


def test_heartbeat_never_brings_back_a_claim_released_while_it_ran(runtime, monkeypatch):
    """A pause beats at once, as the worker's other tasks hit the same fault and go back to the queue:
    a claim the beat listed, then released before its refresh reached Redis, was created again and
    held the key from every worker for CLAIM_TTL_S (its requeued task deferred meanwhile)."""
    r = runtime.r
    task = runtime.prompt(3)
    token = runtime.acquire(task)
    claim = rk.claim("ds", task.key)
    real = r.pipeline

    def pipeline(*args, **kwargs):
        pipe = real(*args, **kwargs)
        send = pipe.execute

        def execute(*a, **kw):
            runtime.release(task, token)  # the task ends (requeued) between the beat's list and its refresh
            return send(*a, **kw)

        pipe.execute = execute
        return pipe

    monkeypatch.setattr(r, "pipeline", pipeline)
    runtime.heartbeat()
    monkeypatch.undo()
    assert r.get(claim) is None
    again = runtime.acquire(task)  # the requeued task runs at once, here or on any worker
    assert again is not None and r.get(claim) == again.encode()
    runtime.release(task, again)


def test_every_billed_answer_reaches_the_spend(runtime, monkeypatch):
    """Three answers come back empty (generated and billed, the message empty) before a good one;
    another prompt's answer is refused by the target tokenizer (the prompt fails). All five were
    billed and the spend (what the cap reads) holds all five, though one record carries one cost.
    Before, it held only the stored answer's."""
    from draftfleet.ledger import micro_usd
    from draftfleet.tokenizer import TokenizerError
    from draftfleet.workers import tasks

    emu = runtime.emu

    def backoff(attempt, retry_after):  # no waiting; the empty answers stop after three
        if emu.stats()["faults"]["empty"] >= 3:
            emu.update(rate_empty=0.0)
        return 0.0

    monkeypatch.setattr(tasks, "backoff_s", backoff)
    emu.update(rate_empty=1.0)
    gen, attempts, _ = tasks._generate(runtime, runtime.prompt(1), reasons := [])
    assert gen is not None and attempts == 4 and reasons == ["empty_response"] * 3

    def refuse(*args, **kwargs):
        raise TokenizerError("parsed special tokens inside response text")

    monkeypatch.setattr(runtime.backend.tokenizer, "completion_ids", refuse)
    assert tasks._generate(runtime, runtime.prompt(2), [])[0] is None
    [failure] = runtime.store.failures("ds")
    assert failure.error_kind == "retokenize"

    stats = emu.stats()
    billed = stats["prompt_tokens"] * 0.6 / 1e6 + stats["tokens_generated"] * 2.5 / 1e6  # the emulator's prices
    assert stats["completed"] == 5 and gen.cost_usd < billed / 4
    spent = int(runtime.r.hget(rk.spend("cloudy"), "cost_micro_usd") or 0) + micro_usd(gen.cost_usd)
    assert abs(spent - micro_usd(billed)) <= 5, (spent, micro_usd(billed))  # one rounding to 1 µ$ per answer
    events = runtime.ledger.events("ds")
    assert (events["paid_unused:empty_response"], events["paid_unused:retokenize"]) == (3, 1)


def test_transient_402_waits_for_retry_after_and_never_pauses(runtime, monkeypatch):
    """OpenRouter's in-flight-budget 402 carries Retry-After: the task retries after at least that."""
    from draftfleet.workers import tasks

    waits = []
    real = tasks.backoff_s
    monkeypatch.setattr(tasks, "backoff_s", lambda attempt, retry_after: waits.append((retry_after, real(attempt, retry_after))) or waits[-1][1])
    runtime.emu.update(rate_402_inflight=1.0)
    task = runtime.prompt(2)

    def heal():  # the budget frees up after three refusals
        wait_until(lambda: runtime.emu.stats()["faults"].get("402_inflight", 0) >= 3, 30, 0.02, "three 402s")
        runtime.emu.update(rate_402_inflight=0.0)

    import threading

    t = threading.Thread(target=heal)
    t.start()
    reasons: list[str] = []
    gen, attempts, _ = tasks._generate(runtime, task, reasons)
    t.join()
    assert gen is not None and runtime.paused is None
    assert attempts >= 4 and set(reasons) == {"in_flight_budget"}
    assert len(waits) == attempts - 1 and all(ra == pytest.approx(0.3) and d >= 0.3 for ra, d in waits), waits


# -- the same, through real workers ------------------------------------------------------------
@pytest.mark.slow
def test_in_flight_402_mid_run_is_retried_not_paused(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:30", ttft_s=0.0, seed=5,
                           api_key=KEY, rate_402_inflight=0.3, retry_after_s=0.2)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 30, concurrency=8, max_attempts=12)
    r = redis_server.client()
    _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    wait_until(lambda: _workers_up(r, 1), 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 30, 90, 0.2, f"30 results\n{workers.logs()}")
    records = assert_exactly_once(store, r, "ds", 30)
    refused = emu.stats()["faults"]["402_inflight"]
    assert refused > 0 and _events(r, "ds")["retry:in_flight_budget"] == refused
    assert sum(rec.retry_reasons.count("in_flight_budget") for rec in records) == refused
    assert "STOPPED CONSUMING" not in workers.logs(tail=None)


@pytest.mark.slow
def test_failures_lists_what_ran_out_and_retry_failed_sends_it_again(tmp_path, redis_server, tokenizer_dir,
                                                                      emulator_factory, workers):
    emu = emulator_factory(time_scale=0, api_key=KEY, rate_500=1.0)
    config, store = _setup(tmp_path, tokenizer_dir, emu.url, 4, max_attempts=2)
    r = redis_server.client()
    _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    _enqueue(config, redis_server.url)
    wait_until(lambda: len(store.failures("ds")) == 4, 60, 0.2, f"4 failures\n{workers.logs()}")
    env = {"REDIS_URL": redis_server.url, "COLUMNS": "200"}

    res = run_cli("failures", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert sorted(row["source"] for row in rows) == [f"d.jsonl:{i}" for i in range(1, 5)]
    assert {(row["kind"], row["attempts"]) for row in rows} == {("http_500", 2)}
    table = run_cli("failures", "--config", str(config), env=env).stdout
    assert "failures (4)" in table and "enqueue --retry-failed" in table and "http_500" in table

    [again] = _enqueue(config, redis_server.url)  # failed prompts are not re-sent by a plain enqueue
    assert (again["queued"], again["failed_before"]) == (0, 4)
    emu.update(rate_500=0.0)
    [retried] = _enqueue(config, redis_server.url, "--retry-failed")
    assert (retried["queued"], retried["failed_before"]) == (4, 0)
    assert not store.failures("ds")  # cleared once their messages were in Redis
    wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, f"4 results\n{workers.logs()}")
    assert_exactly_once(store, r, "ds", 4)
    assert json.loads(run_cli("failures", "--config", str(config), "--json", env=env).stdout) == []


# -- a store that is really full ---------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only; elsewhere ``store_full.py`` cannot run)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): the disk-full run needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_disk_stores_nothing_acks_nothing_then_recovers(tmp_path, small_fs, redis_server, tokenizer_dir,
                                                                emulator_factory, workers):
    emu = emulator_factory(time_scale=0, api_key=KEY)
    config, _ = _setup(tmp_path, tokenizer_dir, emu.url, 6, fleet_extra="")
    text = config.read_text().replace(f'store = "{tmp_path / "store"}"', f'store = "{small_fs / "store"}"')
    config.write_text(text)
    store = open_store(small_fs / "store")
    r = redis_server.client()
    _enqueue(config, redis_server.url)
    filler = small_fs / "filler"
    with open(filler, "wb", buffering=0) as fh:  # fill the file system to the last byte
        try:
            while fh.write(b"\0" * 4096):
                pass
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
    _start(workers, config, "cloud", "cloud", redis_server.url, emu.url)
    wait_until(lambda: _events(r, "ds")["retry:store_error"] >= 12, 90, 0.2, f"store retries\n{workers.logs()}")
    assert not store.keys("ds") and not r.scard(rk.counted_set("ds"))
    assert r.hlen(rk.UNACKED) == 6 and not r.llen(rk.queue("ds"))  # held, never acknowledged
    assert "No space left on device" in workers.logs(tail=None)
    generated = emu.stats()["by_endpoint"]["/v1/chat/completions"]
    filler.unlink()  # space again
    wait_until(lambda: len(store.keys("ds")) == 6, 90, 0.2, f"6 results\n{workers.logs()}")
    assert_exactly_once(store, r, "ds", 6)
    assert generated == emu.stats()["by_endpoint"]["/v1/chat/completions"] == 6  # kept in memory, not regenerated


def test_after_redis_lost_everything_every_worker_puts_its_claims_back_before_enqueue_decides(redis_server):
    """Two workers, each generating one prompt, when Redis comes back empty: the first to notice
    stamps the state marker, and the other must not take that marker for its own claims being back
    (before: it waited for its next heartbeat, and an enqueue in between sent its prompt again)."""
    import threading

    from draftfleet import redis_keys as rk
    from draftfleet.claims import Claims
    from draftfleet.queues import await_lost_claims, claimed_keys
    from draftfleet.schemas.records import WorkerReport

    r = redis_server.client()
    workers, stop = [], threading.Event()
    for name, key in (("fast@h", "aa" * 32), ("slow@h", "bb" * 32)):
        c = Claims(r, name)
        assert c.acquire(rk.claim("ds", key), "ds") is not None
        report = WorkerReport(hostname=name, kind="gpu", backend="sglang")
        c.beat(report, mark_state=True)
        workers.append((c, report))
    r.flushall()  # Redis back empty: queues, claims and the marker gone
    fast, fast_report = workers[0]
    fast.beat(fast_report, mark_state=True)  # the first to notice: its claim back, the marker stamped
    assert r.exists(rk.STATE) and claimed_keys(r, "ds") == {"aa" * 32}
    slow, slow_report = workers[1]
    loop = threading.Thread(target=slow.beat_until, args=(stop, lambda: slow.beat(slow_report, mark_state=True)))
    loop.start()
    try:
        assert await_lost_claims(r)  # the marker is fresh: enqueue waits for the others
        assert claimed_keys(r, "ds") == {"aa" * 32, "bb" * 32}  # the slow worker's claim is back too
        assert not await_lost_claims(r)  # settled: no wait
    finally:
        stop.set()
        loop.join(10)


def test_a_beat_under_way_when_the_worker_stops_does_not_bring_its_report_back(redis_server):
    """A clean stop takes the worker's report down (``status`` drops it at once). A heartbeat that was
    under way then, or a change of what runs, must not publish it again: before, it did, and the
    stopped worker stayed listed as live for three beats (CI saw a test wait 30 s for it to go)."""
    from draftfleet.claims import Claims
    from draftfleet.schemas.records import WorkerReport

    r = redis_server.client()
    c = Claims(r, "stopping@h")
    report = WorkerReport(hostname="stopping@h", kind="gpu", backend="vllm")
    key = rk.claim("ds", "cc" * 32)
    token = c.acquire(key, "ds")
    c.beat(report, mark_state=True)
    assert r.exists(rk.worker_report("stopping@h")) and r.exists(rk.STATE)
    c.withdraw()
    assert not r.exists(rk.worker_report("stopping@h"))
    c.beat(report, mark_state=True)  # the beat thread's last beat, after the stop
    c.release(key, "ds", token)  # a task ends: what runs changed
    c.show_running()
    assert not r.exists(rk.worker_report("stopping@h"))
    # the beat still keeps what a stopping worker's tasks hold, and the state marker
    token = c.acquire(key, "ds")
    r.delete(key)
    c.beat(report, mark_state=True)
    assert r.get(key) == token.encode() and r.exists(rk.STATE)
