"""Provider batch APIs (issue 43): ``draftfleet worker batch`` on the emulator's batch shapes, with a
real Redis, real worker processes and the store. Each prompt is submitted once and stored once,
whatever happens to the worker or to Redis; budgets and caps hold as for the other workers."""

from __future__ import annotations

import json
import signal

import httpx
import msgspec
import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger
from draftfleet.store import open_store
from draftfleet.store.folder import FileStore

from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _enqueue

FAST = dict(single_stream_tps=5000, ceiling_tps=100000, ttft_s=0.0, batch_validating_s=0.2, batch_request_s=0.02,
            batch_finalizing_s=0.2, batch_cancelling_s=0.2, price_input_per_mtok=1.0, price_output_per_mtok=2.0,
            api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])


def _rows(n: int, tag: str = "b") -> list[dict]:
    return [{"id": i, "messages": [{"role": "user", "content": f"{tag} question {i}: explain it"}]} for i in range(n)]


def _setup(tmp_path, emu, tokenizer_dir, n: int, *, shape: str = "openai", batch_size: int = 50, extra: str = "",
           dataset: dict | None = None, length: str | None = None):
    data = write_jsonl(tmp_path / "d.jsonl", _rows(n))
    ds = {"name": "ds", "path": str(data), "max_tokens": 64, **(dataset or {})}
    cloud = (f'batch = "{shape}"\nbatch_size = {batch_size}\nbatch_poll_s = 0.3\nbatch_collect_s = 0.3\n' + extra)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[ds], cloud_extra=cloud)
    # The emulator's batch APIs serve its one model; OpenRouter's lives under /api/v1.
    text = config.read_text().replace('model = "vendor/model"', 'model = "test/chatml"')
    if shape == "openrouter":
        text = text.replace(f'base_url = "{emu.url}/v1"', f'base_url = "{emu.url}/api/v1"')
    config.write_text(text)
    return config


def _stored(tmp_path) -> FileStore:
    return FileStore(tmp_path / "store")


def _submitted(emu) -> dict[str, int]:
    return emu.stats()["batch"]["submitted"]


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_a_batch_worker_finishes_a_dataset_once_at_the_batch_price(tmp_path, redis_server, tokenizer_dir,
                                                                   emulator_factory, workers, shape):
    emu = emulator_factory(length="fixed:20", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 30, shape=shape, batch_size=12)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == 30 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w)
    submitted = _submitted(emu)
    assert len(submitted) == 30 and set(submitted.values()) == {1}
    records = list(store.records("ds"))
    assert {r.token_source for r in records} == {"retokenized"} and {r.backend for r in records} == {"cloudy"}
    ledger = Ledger(redis_server.client())
    totals = ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == sum(r.completion_tokens for r in records)
    assert totals.get("paid_tokens", 0) == 0  # every batch hold became what its answer made
    # The provider's own cost, at half the per-token price.
    for r in records:
        full = r.usage.prompt_tokens * 1.0 / 1e6 + r.usage.completion_tokens * 2.0 / 1e6
        assert r.cost_source == "provider" and r.cost_usd == pytest.approx(full / 2, rel=1e-6)
    assert ledger.spend_usd("cloudy") == pytest.approx(sum(r.cost_usd for r in records), abs=30e-6)  # micro-USD each
    closed = store.batches(closed=True)
    assert len(closed) == 3 and all(b.closed and b.status == "completed" for b in closed)
    # enqueue again: nothing to queue
    again = _enqueue(config, redis_server.url)
    assert again[0]["queued"] == 0 and again[0]["already_done"] == 30


def _wait_open(store, pred=lambda b: bool(b.provider_id), timeout: float = 30, what=""):
    wait_until(lambda: any(pred(b) for b in store.batches()), timeout, 0.1, what)
    return [b for b in store.batches() if pred(b)]


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_kill_9_with_a_batch_open_then_a_restart_submits_nothing_twice(tmp_path, redis_server, tokenizer_dir,
                                                                        emulator_factory, workers, shape):
    """The batch worker dies (SIGKILL) while its batch runs at the provider; its claims lapse, the
    recovery sweeps run. A new batch worker finds the open batch in the store, polls it and stores its
    answers: each prompt submitted once and stored once, the budget's holds settled."""
    emu = emulator_factory(length="fixed:20", **{**FAST, "batch_request_s": 0.3})
    config = _setup(tmp_path, emu, tokenizer_dir, 16, shape=shape, batch_size=16, dataset={"budget_tokens": 5000})
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    (batch,) = _wait_open(store, what=workers.logs)
    ledger = Ledger(redis_server.client())
    assert ledger.dataset_totals("ds")["paid_tokens"] == 16 * 64  # held by the batch, not by claims
    snap = run_cli("status", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    (shown,) = msgspec.json.decode(snap.stdout)["batches"]
    assert shown["provider_id"] == batch.provider_id and shown["prompts"] == 16 and shown["backend"] == "cloudy"
    text = run_cli("status", "--config", str(config), env={"REDIS_URL": redis_server.url, "COLUMNS": "200"}).stdout
    assert "open provider batches" in text and batch.provider_id in text
    from draftfleet.schemas.config import load_config
    from draftfleet.views.metrics import FleetCollector

    families = {f.name: f for f in FleetCollector(load_config(str(config)), redis_server.client()).collect()}
    assert [(s.labels, s.value) for s in families["draftfleet_batches_open"].samples] == [
        ({"dataset": "ds", "backend": "cloudy"}, 1)]
    workers.stop(w, signal.SIGKILL)
    # enqueue while the batch is open and its worker dead: none of its prompts is queued again
    out = _enqueue(config, redis_server.url)
    assert out[0]["queued"] == 0 and out[0]["in_batch"] == 16
    w2 = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    wait_until(lambda: len(store.keys("ds")) == 16 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w2)
    assert set(_submitted(emu).values()) == {1} and len(_submitted(emu)) == 16
    assert set(emu.stats()["batch"]["answered"].values()) == {1}
    totals = ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == sum(r.completion_tokens for r in store.records("ds"))
    assert totals.get("paid_tokens", 0) == 0


@pytest.mark.parametrize("later", [0, 120])
def test_a_restart_between_recording_and_submitting_finds_the_batch_at_the_provider(tmp_path, redis_server,
                                                                                     tokenizer_dir, emulator_factory,
                                                                                     later):
    """The provider has the batch (submitted with the fleet's id in its metadata) but the store's record
    has no provider id (the worker died before writing it): the next worker finds it and never submits it
    again, also when ``later`` batches made since on the account (newest first) put it past the list's
    first page."""
    from draftfleet.schemas.config import load_config
    from draftfleet.workers.batch import BatchWorker, request_body
    from draftfleet.workers.batch_api import batch_client

    emu = emulator_factory(length="fixed:20", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 4, batch_size=4)
    _enqueue(config, redis_server.url)
    cfg = load_config(str(config))
    store = open_store(cfg)
    # a worker collected and recorded a batch, submitted it, and died before recording the provider's id
    rt, conn = _runtime(cfg, store, redis_server)
    worker = BatchWorker(rt, batch_client("cloudy", cfg.cloud("cloudy"), KEY_ENV["DRAFTFLEET_TEST_KEY"]), conn)
    real_submit = worker._submit
    worker._submit = lambda batch: None
    assert worker.collect("ds")
    (batch,) = store.batches()
    assert not batch.provider_id and batch.status == "submitting"
    worker.api.submit(batch.id, cfg.cloud("cloudy").model,
                      [(q.task.key, request_body(cfg.cloud("cloudy"), q.task, q.granted)) for q in batch.requests])
    if later:  # someone else's batches on the account, made after ours (one file, many batches)
        with httpx.Client(base_url=emu.url, headers={"Authorization": f"Bearer {KEY_ENV['DRAFTFLEET_TEST_KEY']}"},
                          timeout=10) as client:
            line = {"custom_id": "other", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": cfg.cloud("cloudy").model, "messages": [{"role": "user", "content": "x"}],
                             "max_tokens": 4}}
            up = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("o.jsonl", json.dumps(line).encode() + b"\n", "application/jsonl")})
            for _ in range(later):
                assert client.post("/v1/batches", json={"input_file_id": up.json()["id"], "completion_window": "24h",
                                                        "endpoint": "/v1/chat/completions"}).status_code == 200
    worker._submit = real_submit
    wait_until(lambda: (worker.cycle(), not store.batches())[1], 30, 0.3)
    ours = {k: n for k, n in _submitted(emu).items() if k != "other"}
    assert set(ours.values()) == {1} and len(ours) == 4
    assert len(store.keys("ds")) == 4
    rt.stop()


def _runtime(cfg, store, redis_server):
    from draftfleet.tokenizer import TargetTokenizer
    from draftfleet.workers.app import make_app
    from draftfleet.workers.cloud import CloudChat
    from draftfleet.workers.runtime import Runtime
    from draftfleet.workers.tasks import install

    chat = CloudChat("cloudy", cfg.cloud("cloudy"), TargetTokenizer.from_config(cfg.fleet), KEY_ENV["DRAFTFLEET_TEST_KEY"])
    app = make_app(redis_server.url, cfg.fleet.visibility_timeout_s)
    rt = Runtime(app, cfg, store, redis_server.client(), chat, "batch-test@here", ["ds"], 2.0)
    install(rt)
    return rt, app.connection_for_read()


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_flushall_with_a_batch_open_keeps_its_holds_and_stores_each_answer_once(tmp_path, redis_server,
                                                                                 tokenizer_dir, emulator_factory,
                                                                                 workers, shape):
    """Redis loses everything while a batch runs: the rebuild from the store holds its prompts' grants
    again (the budget), enqueue queues none of them, and its answers are stored and counted once."""
    from draftfleet.reconcile import ensure_counters

    emu = emulator_factory(length="fixed:20", **{**FAST, "batch_request_s": 0.3})
    config = _setup(tmp_path, emu, tokenizer_dir, 12, shape=shape, batch_size=12, dataset={"budget_tokens": 2000})
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    _wait_open(store, what=workers.logs)
    r = redis_server.client()
    r.flushall()
    assert ensure_counters(store, r, wait=True)
    ledger = Ledger(r)
    if store.batches():  # still open: the rebuild holds its grants again
        assert ledger.dataset_totals("ds").get("paid_tokens", 0) == 12 * 64
    out = _enqueue(config, redis_server.url)
    assert out[0]["queued"] == 0
    wait_until(lambda: len(store.keys("ds")) == 12 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w)
    assert set(_submitted(emu).values()) == {1} and len(_submitted(emu)) == 12
    totals = ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == sum(r.completion_tokens for r in store.records("ds")) == 12 * 20
    assert totals.get("paid_tokens", 0) == 0 and totals["responses"] == 12


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_a_budget_is_never_passed_and_filled_within_one_percent(tmp_path, redis_server, tokenizer_dir,
                                                                emulator_factory, workers, shape):
    """Batches admit as every worker does (the budget's rule): each request reserved at the max_tokens it
    is sent with; answers shorter than that free room for the next batch."""
    emu = emulator_factory(length="lognormal:30:0.8", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 200, shape=shape, batch_size=20, dataset={"budget_tokens": 1500})
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    r = redis_server.client()
    ledger = Ledger(r)
    wait_until(lambda: ledger.closed_at("ds") is not None and not store.batches(), 90, 0.3, workers.logs)
    workers.assert_alive(w)
    stored = sum(rec.completion_tokens for rec in store.records("ds"))
    assert 0.99 * 1500 <= stored <= 1500
    assert ledger.dataset_totals("ds")["completion_tokens"] == stored
    assert set(_submitted(emu).values()) == {1}


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_a_spend_cap_is_never_passed_at_the_batch_price(tmp_path, redis_server, tokenizer_dir, emulator_factory,
                                                        workers, shape):
    """Each request holds its worst cost at the batch price (half the configured prices) before the batch
    is submitted; near the cap it is sent with the max_tokens that fit."""
    emu = emulator_factory(length="fixed:50", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 80, shape=shape, batch_size=10, dataset={"max_tokens": 64},
                    extra="max_spend_usd = 0.002\n")
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    ledger = Ledger(redis_server.client())
    wait_until(lambda: "spend_cap" in workers.logs(tail=None) and not store.batches(), 90, 0.3, workers.logs)
    workers.assert_alive(w)
    spent = ledger.spend_usd("cloudy")
    assert 0.0015 < spent <= 0.002 and ledger.spend_held_usd("cloudy") == 0
    # at the full price the same answers would have cost twice as much: more were made for the money
    assert len(store.keys("ds")) > 0.002 / (2 * (50 * 2.0 + 20 * 1.0) / 1e6)


def test_a_pivot_to_gpu_cancels_the_open_batch_stores_what_completed_and_hands_back_the_rest(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    """OpenAI's shape can cancel: what completed before the cancel is stored from the batch, the rest
    comes back as ``batch_cancelled`` and goes to the GPU worker that has the dataset now; none twice."""
    emu = emulator_factory(length="fixed:20", **{**FAST, "batch_request_s": 1.0})
    config = _setup(tmp_path, emu, tokenizer_dir, 20, batch_size=20)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    _wait_open(store, lambda b: b.completed >= 2, 30, workers.logs)
    res = run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "gpu", "--json",
                  env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    (warning,) = [w for k, w in msgspec.json.decode(res.stdout)["warnings"].items() if k.startswith("batch:")]
    assert "is cancelled by its batch worker" in warning
    g = workers.start(config, "gpu", redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 20 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w, g)
    (batch,) = store.batches(closed=True)
    assert batch.status == "cancelled" and batch.cancel_requested
    records = list(store.records("ds"))
    from_batch = {r.key for r in records if r.backend == "cloudy"}
    answered = {k for k, n in emu.stats()["batch"]["answered"].items() if n}
    assert 2 <= len(from_batch) < 20 and from_batch == answered
    assert {r.backend for r in records if r.key not in from_batch} == {"sglang"}
    assert {q.state for q in batch.requests} == {"stored", "returned"}
    assert set(_submitted(emu).values()) == {1}
    ledger = Ledger(redis_server.client())
    wait_until(lambda: ledger.dataset_totals("ds")["responses"] == 20, 10)  # the GPU worker's tally
    assert ledger.dataset_totals("ds").get("paid_tokens", 0) == 0


def test_request_errors_go_back_to_the_queue_and_are_answered_by_a_later_batch(tmp_path, redis_server, tokenizer_dir,
                                                                               emulator_factory, workers):
    """A 500 inside a batch is not the prompt's fault: it goes back to its queue with its attempt
    counted (``retry:batch_http_500``), and a later batch answers it; each is stored once."""
    emu = emulator_factory(length="fixed:20", rate_batch_request_error=0.3, **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 20, batch_size=20)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) + len(store.failures("ds")) == 20 and not store.batches(), 90, 0.3,
               workers.logs)
    workers.assert_alive(w)
    ledger = Ledger(redis_server.client())
    assert ledger.events("ds").get("retry:batch_http_500", 0) > 0
    submitted = _submitted(emu)
    assert max(submitted.values()) > 1  # sent again in a later batch
    assert set(emu.stats()["batch"]["answered"].values()) == {1}  # but answered once
    assert len(store.batches(closed=True)) >= 2
    for f in store.failures("ds"):  # retries ran out (4 attempts): a failure record, never lost
        assert f.error_kind == "http_500" and f.attempts == 4


def test_a_batch_that_fails_validation_says_why_and_returns_its_prompts(tmp_path, redis_server, tokenizer_dir,
                                                                        emulator_factory, workers):
    """The provider refuses the whole file (more requests than it takes): the batch ends ``failed``,
    the worker says why and names the backend, and its prompts come back; once their attempts run out
    they are failures with the reason, nothing stored, nothing paid."""
    emu = emulator_factory(length="fixed:20", batch_max_requests=5, **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 8, batch_size=8)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.failures("ds")) == 8, 60, 0.3, workers.logs)
    workers.assert_alive(w)
    closed = store.batches(closed=True)
    assert {b.status for b in closed} == {"failed"} and all(b.error for b in closed)
    logs = workers.logs(tail=None)
    assert "cloudy: batch" in logs and "of ds failed (" in logs
    assert not store.keys("ds") and Ledger(redis_server.client()).spend_usd("cloudy") == 0
    assert all(f.attempts == 4 and f.error_kind.startswith("batch_failed") for f in store.failures("ds"))
    assert Ledger(redis_server.client()).dataset_totals("ds").get("paid_tokens", 0) == 0


def test_two_batch_workers_share_the_queue_and_the_polling_without_a_prompt_twice(tmp_path, redis_server,
                                                                                  tokenizer_dir, emulator_factory,
                                                                                  workers):
    emu = emulator_factory(length="fixed:20", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 40, batch_size=7, dataset={"budget_tokens": 100_000})
    a = workers.start(config, "batch", "--backend", "cloudy", "--name", "a", redis_url=redis_server.url, env=KEY_ENV)
    b = workers.start(config, "batch", "--backend", "cloudy", "--name", "b", redis_url=redis_server.url, env=KEY_ENV)
    wait_until(lambda: workers.logs(tail=None).count("batch worker ") >= 2, 30, 0.2, workers.logs)
    _enqueue(config, redis_server.url)  # both are up: they race on the queue and on polling each batch
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == 40 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(a, b)
    assert set(_submitted(emu).values()) == {1} and len(_submitted(emu)) == 40
    assert set(emu.stats()["batch"]["answered"].values()) == {1}
    closed = store.batches(closed=True)
    assert sum(len(c.requests) for c in closed) == 40  # each prompt in one batch (of either worker)
    totals = Ledger(redis_server.client()).dataset_totals("ds")
    assert totals["responses"] == 40 and totals.get("paid_tokens", 0) == 0 and totals.get("batch_held", 0) == 0


def test_a_refused_key_pauses_the_batch_worker_before_it_takes_a_prompt(tmp_path, redis_server, tokenizer_dir,
                                                                         emulator_factory, workers):
    """401 from the batch API: the worker halts as the cloud worker does (paused, nothing failed), before
    any message is taken: the queue keeps every prompt, no batch is recorded, and the key never shows."""
    emu = emulator_factory(length="fixed:20", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 6, batch_size=6)
    _enqueue(config, redis_server.url)
    wrong = {"DRAFTFLEET_TEST_KEY": "a-wrong-key-999"}
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=wrong)
    wait_until(lambda: "STOPPED CONSUMING" in workers.logs(tail=None), 30, 0.2, workers.logs)
    workers.assert_alive(w)
    r = redis_server.client()
    assert r.llen(rk.queue("ds")) == 6 and not r.hlen(rk.UNACKED)
    store = _stored(tmp_path)
    assert not store.batches() and not store.failures("ds") and not _submitted(emu)
    assert "unauthorized" in workers.logs(tail=None) and "a-wrong-key-999" not in workers.logs(tail=None)


def test_a_thinking_models_batch_answers_carry_the_target_templates_ids(tmp_path, redis_server, tokenizer_dir,
                                                                        target_tokenizer, emulator_factory, workers):
    """Training data is the product: a batch answer's reasoning and text are re-tokenized as the cloud
    worker's are, through the target's own template (the think block where the template puts it)."""
    emu = emulator_factory(**{**FAST, "think": ("<think>\n", "\n</think>\n\n"), "reasoning_rate": 1.0,
                              "split_rate": 0.0, "length": "uniform:5:40", "reasoning_length": "uniform:5:40"})
    config = _setup(tmp_path, emu, tokenizer_dir, 10, batch_size=10, dataset={"max_tokens": 200})
    _enqueue(config, redis_server.url)
    workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == 10 and not store.batches(), 60, 0.3, workers.logs)
    for rec in store.records("ds"):
        assert rec.reasoning and rec.text and "<think>" not in rec.text + rec.reasoning
        stopped = rec.finish_reason == "stop"
        assert target_tokenizer.completion_ids(rec.messages, rec.text, rec.reasoning, stopped=stopped) == rec.output_ids
        assert rec.completion_tokens == len(rec.output_ids) <= 200


def test_a_pickled_or_forged_message_is_dead_lettered_never_decoded(tmp_path, redis_server, tokenizer_dir,
                                                                     emulator_factory, workers):
    """The batch worker reads messages itself (kombu's basic_get): it refuses what the Celery app refuses,
    a pickle before anything is unpickled, and a task forged for another dataset's queue."""
    import base64
    import json
    import pickle

    emu = emulator_factory(length="fixed:20", **FAST)
    config = _setup(tmp_path, emu, tokenizer_dir, 3, batch_size=10)
    _enqueue(config, redis_server.url)
    r = redis_server.client()
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    raw = r.lindex(rk.queue("ds"), 0)
    envelope = json.loads(raw)
    pickled = {**envelope, "content-type": "application/x-python-serialize",
               "body": base64.b64encode(pickle.dumps(Boom())).decode()}
    r.lpush(rk.queue("ds"), json.dumps(pickled))
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == 3 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w)
    assert not marker.exists()
    letters = [msgspec.json.decode(x) for x in r.lrange(rk.DEAD_LETTER, 0, -1)]
    assert any("JSON only" in d["reason"] for d in letters)


def test_requests_the_window_did_not_reach_expire_back_to_the_queue(tmp_path, redis_server, tokenizer_dir,
                                                                    emulator_factory, workers):
    """A batch whose window ends first: what completed is stored, the expired requests go back to the
    queue (``retry:batch_expired``) and a later batch answers them; none is stored twice."""
    emu = emulator_factory(length="fixed:20", **{**FAST, "batch_request_s": 0.5, "batch_window_s": 2.0})
    config = _setup(tmp_path, emu, tokenizer_dir, 10, batch_size=10)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == 10 and not store.batches(), 90, 0.3, workers.logs)
    workers.assert_alive(w)
    first = store.batches(closed=True)[0]
    assert first.status == "expired" and {q.state for q in first.requests} == {"stored", "returned"}
    assert Ledger(redis_server.client()).events("ds").get("retry:batch_expired", 0) > 0
    assert set(emu.stats()["batch"]["answered"].values()) == {1}
    assert Ledger(redis_server.client()).dataset_totals("ds")["responses"] == 10



def test_a_pivot_waits_for_an_openrouter_batch_it_cannot_cancel_and_shows_it(tmp_path, redis_server, tokenizer_dir,
                                                                             emulator_factory, workers):
    """OpenRouter documents no cancel: the pivot says the batch is waited for, status shows it, its
    answers are stored when it ends, and the GPUs make only what was still queued; none twice."""
    emu = emulator_factory(length="fixed:20", **{**FAST, "batch_request_s": 0.5})
    config = _setup(tmp_path, emu, tokenizer_dir, 14, shape="openrouter", batch_size=8)
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    (batch,) = _wait_open(store, what=workers.logs)
    res = run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "gpu", "--json",
                  env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    warnings = [v for k, v in msgspec.json.decode(res.stdout)["warnings"].items() if k.startswith("batch:")]
    assert any("cannot be cancelled" in v for v in warnings)
    g = workers.start(config, "gpu", redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 14 and not store.batches(), 60, 0.3, workers.logs)
    workers.assert_alive(w, g)
    closed = {b.id: b for b in store.batches(closed=True)}
    assert closed[batch.id].status == "completed" and closed[batch.id].cancel_requested
    records = list(store.records("ds"))
    from_batches = {r.key for r in records if r.backend == "cloudy"}
    assert {q.task.key for q in closed[batch.id].requests} <= from_batches
    assert {r.backend for r in records if r.key not in from_batches} <= {"sglang"}
    assert set(_submitted(emu).values()) == {1} and "cannot be cancelled" in workers.logs(tail=None)
