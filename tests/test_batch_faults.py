"""Faults of the provider batch endpoints themselves (the emulator's ``batch_faults``), on both wire
shapes: the batch worker follows the cloud worker's rules on them. A 429's Retry-After is a floor on
its wait; a 5xx or a timeout on create, poll or download is retried; and a submission the provider
applied but whose reply was lost (a dropped connection, a 502, a timeout) is found again by its
metadata (``find()``), never submitted twice. Each prompt is submitted once, stored once and paid once.

The first tests check the emulator's faults over HTTP; the others run a real batch worker process."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from draftfleet.devtools.emulator import EmulatorConfig
from draftfleet.ledger import Ledger

from .conftest import wait_until
from .test_batch import FAST, _setup, _stored, _submitted
from .test_fleet import KEY_ENV, _enqueue

KEY = KEY_ENV["DRAFTFLEET_TEST_KEY"]
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "test/chatml"
CHAT = "/v1/chat/completions"
ERROR_WAIT_S = 5.0  # workers/batch.py's wait after an error without a Retry-After


def _or_body(ids: list[str], local: str = "local-1") -> bytes:
    return msgspec.json.encode({"endpoint": CHAT, "model": MODEL, "metadata": {"draftfleet_batch": local},
                                "requests": [{"custom_id": c, "body": {"messages": [{"role": "user", "content": c}],
                                                                       "max_tokens": 8}} for c in ids]})


def _oai_upload(client: httpx.Client, ids: list[str]) -> httpx.Response:
    lines = b"".join(msgspec.json.encode({"custom_id": c, "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "messages": [{"role": "user", "content": c}], "max_tokens": 8}}) + b"\n" for c in ids)
    return client.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                       files={"file": ("in.jsonl", lines, "application/jsonl")})


def _oai_create(client: httpx.Client, file_id: str, local: str = "local-1") -> httpx.Response:
    return client.post("/v1/batches", headers=AUTH, json={"input_file_id": file_id, "endpoint": CHAT,
                                                          "completion_window": "24h",
                                                          "metadata": {"draftfleet_batch": local}})


# --- the emulator's faults ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["create", "create:429:0", "create:teapot", "poll:500", "create:500:x",
                                  "create:500:0%", "create:500:101%", "create:500:1:2"])
def test_batch_faults_are_refused_unless_well_formed(tokenizer_dir, spec):
    with pytest.raises(ValueError, match="batch_faults"):
        EmulatorConfig(tokenizer=str(tokenizer_dir), batch_faults=(spec,))
    EmulatorConfig(tokenizer=str(tokenizer_dir), batch_faults=("create:429:2", "get:503:50%", "content:lost"))


def test_refusals_answer_in_each_shapes_error_body_apply_nothing_and_count_down(emulator_factory):
    emu = emulator_factory(api_key=KEY, retry_after_s=3, batch_faults=(
        "create:429", "create:503", "create:500", "create:502", "create:402", "upload:429", "upload:402",
        "list:500"))
    with httpx.Client(base_url=emu.url, timeout=10) as c:
        # OpenRouter's shape: {"error": {"code", "message"}}; OpenAI's: {"error": {message, type, param, code}}
        for status, retry in ((429, "3"), (503, "3"), (500, None), (502, None)):
            r = c.post("/api/v1/batches", headers=AUTH, content=_or_body(["a"]))
            assert r.status_code == status and r.headers.get("retry-after") == retry
            assert r.json()["error"]["code"] == status and "emulated" in r.json()["error"]["message"]
        r = c.post("/api/v1/batches", headers=AUTH, content=_or_body(["a"]))
        assert r.status_code == 402 and r.json()["error"] == {
            "code": 402, "message": "Insufficient credits", "metadata": {"limit_source": "openrouter_credits"}}
        assert not _submitted(emu) and emu.stats()["batch"]["batches"] == 0  # nothing applied
        r = _oai_upload(c, ["a"])
        error = r.json()["error"]
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
        r = _oai_upload(c, ["a"])  # no credits: OpenAI's own 429, insufficient_quota, no Retry-After
        assert r.status_code == 429 and "retry-after" not in r.headers
        assert r.json()["error"]["type"] == r.json()["error"]["code"] == "insufficient_quota"
        assert c.get("/v1/batches", headers=AUTH).status_code == 500
        assert c.get("/api/v1/batches", headers=AUTH).status_code == 200  # the count is spent
        assert c.post("/api/v1/batches", headers=AUTH, content=_or_body(["a"])).status_code == 202
        file_id = _oai_upload(c, ["b"]).json()["id"]
        assert _oai_create(c, file_id).status_code == 200
    stats = emu.stats()["batch"]
    assert stats["submitted"] == {"a": 1, "b": 1}
    assert stats["faults"] == {"create:429": 1, "create:503": 1, "create:500": 1, "create:502": 1, "create:402": 1,
                               "upload:429": 1, "upload:402": 1, "list:500": 1}
    calls = stats["calls"]
    assert [(x["call"], x["shape"], x["status"], x["fault"]) for x in calls[:4]] == [
        ("create", "openrouter", 429, "429"), ("create", "openrouter", 503, "503"),
        ("create", "openrouter", 500, "500"), ("create", "openrouter", 502, "502")]
    assert all(a["at"] <= b["at"] for a, b in zip(calls, calls[1:]))
    # Setting the field again arms it afresh.
    emu.update(batch_faults=["get:503:100%"])
    with httpx.Client(base_url=emu.url, timeout=10) as c:
        assert all(c.get("/api/v1/batches/x", headers=AUTH).status_code == 503 for _ in range(3))


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_a_lost_reply_means_the_batch_was_created_and_is_listed_by_its_metadata(emulator_factory, shape):
    emu = emulator_factory(api_key=KEY, hang_s=30, batch_faults=("create:lost", "create:lost_502", "create:hang"))
    with httpx.Client(base_url=emu.url, timeout=httpx.Timeout(10, read=1)) as c:
        def create(local):
            if shape == "openrouter":
                return c.post("/api/v1/batches", headers=AUTH, content=_or_body([local], local))
            return _oai_create(c, _oai_upload(c, [local]).json()["id"], local)

        with pytest.raises(httpx.RemoteProtocolError):  # the connection closed, no reply
            create("lost")
        r = create("lost_502")
        assert r.status_code == 502 and r.json()["error"]["message"]
        with pytest.raises(httpx.ReadTimeout):  # the reply held past the client's timeout
            create("hang")
        listed = c.get("/api/v1/batches" if shape == "openrouter" else "/v1/batches", headers=AUTH).json()["data"]
    assert sorted(b["metadata"]["draftfleet_batch"] for b in listed) == ["hang", "lost", "lost_502"]
    stats = emu.stats()
    assert stats["batch"]["submitted"] == {"lost": 1, "lost_502": 1, "hang": 1} and stats["dropped"] == 1


# --- the batch worker under them --------------------------------------------------------------------


def _run(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape: str, n: int, faults: tuple[str, ...],
         timeout: float = 40, client_timeout_s: float | None = None, **emu_fields):
    """A batch worker finishing ``n`` prompts (one batch) against an emulator with ``faults``; the
    checks that hold whatever the faults: each prompt submitted, answered, stored and paid once."""
    emu = emulator_factory(length="fixed:20", **{**FAST, **emu_fields, "batch_faults": faults})
    config = _setup(tmp_path, emu, tokenizer_dir, n, shape=shape, batch_size=n, extra="max_spend_usd = 1.0\n")
    if client_timeout_s is not None:
        text = config.read_text()
        assert text.count("request_timeout_s = 10.0") == 1  # the cloud backend's
        config.write_text(text.replace("request_timeout_s = 10.0", f"request_timeout_s = {client_timeout_s}"))
    _enqueue(config, redis_server.url)
    w = workers.start(config, "batch", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    store = _stored(tmp_path)
    wait_until(lambda: len(store.keys("ds")) == n and not store.batches(), timeout, 0.2, workers.logs)
    workers.assert_alive(w)
    stats = emu.stats()["batch"]
    assert stats["faults"] == dict.fromkeys(faults, 1), stats["faults"]  # each fault fired (once)
    # Submitted once, answered once, one batch at the provider: the fleet's own.
    assert len(_submitted(emu)) == n and set(_submitted(emu).values()) == {1}
    assert set(stats["answered"].values()) == {1} and len(stats["answered"]) == n
    assert stats["batches"] == 1 and stats["by_status"] == {"completed": 1}
    (batch,) = store.batches(closed=True)
    assert batch.status == "completed" and {q.state for q in batch.requests} == {"stored"}
    listed = httpx.get(emu.url + ("/api/v1/batches" if shape == "openrouter" else "/v1/batches"), headers=AUTH).json()
    assert [b["id"] for b in listed["data"]] == [batch.provider_id]
    # Stored once, counted once, paid once; no hold left.
    records = list(store.records("ds"))
    assert len(records) == n and len({r.key for r in records}) == n
    ledger = Ledger(redis_server.client())
    totals = ledger.dataset_totals("ds")
    assert totals["responses"] == n and totals["completion_tokens"] == sum(r.completion_tokens for r in records)
    assert totals.get("paid_tokens", 0) == 0 and totals.get("batch_held", 0) == 0
    assert ledger.spend_usd("cloudy") == pytest.approx(sum(r.cost_usd for r in records), abs=n * 1e-6)
    assert ledger.spend_held_usd("cloudy") == 0
    assert not store.failures("ds")
    return emu, stats, workers.logs(tail=None)


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_a_429_on_submission_waits_its_retry_after_then_submits_once(tmp_path, redis_server, tokenizer_dir,
                                                                     emulator_factory, workers, shape):
    """The submission is refused with 429 and a Retry-After longer than the worker's own wait after an
    error: nothing reaches the provider before Retry-After has passed (the emulator's call log), then
    the batch is submitted once."""
    retry_after = ERROR_WAIT_S + 2
    emu, stats, logs = _run(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, 6,
                            ("create:429",), retry_after_s=retry_after)
    calls = stats["calls"]
    (i,) = [k for k, x in enumerate(calls) if x["fault"] == "429"]
    assert calls[i]["call"] == "create" and calls[i]["status"] == 429
    later = calls[i + 1:]
    assert later, "nothing was asked after the 429"
    waited = later[0]["at"] - calls[i]["at"]
    assert waited >= retry_after, f"asked again {waited:.2f}s after a 429 with Retry-After {retry_after}s"
    nxt = next(x for x in later if x["call"] == "create")
    assert nxt["status"] in (200, 202) and nxt["at"] - calls[i]["at"] >= retry_after
    # before the new attempt it looked for the batch at the provider (a 429 may hide nothing, but find() is asked)
    assert "list" in [x["call"] for x in later[:later.index(nxt)]]
    assert f"again in {retry_after:.0f}s" in logs


@pytest.mark.parametrize(("shape", "faults"), [
    ("openai", ("create:502", "get:503", "content:500")),
    ("openrouter", ("create:500", "get:503")),
])
def test_5xx_on_create_poll_and_download_are_retried_without_a_prompt_lost_or_twice(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, faults):
    """A 5xx on the submission (nothing applied), on a poll and on the download of the results (OpenAI's
    output file; OpenRouter's results come with the poll): each is retried; the batch is submitted once
    and its answers stored once."""
    emu, stats, logs = _run(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, 6, faults,
                            retry_after_s=0.5)
    for fault in faults:
        call, kind = fault.split(":")
        (i,) = [k for k, x in enumerate(stats["calls"]) if x["call"] == call and x["fault"] == kind]
        retried = [x for x in stats["calls"][i + 1:] if x["call"] == call]
        assert retried and retried[-1]["status"] in (200, 202)  # asked again, and answered in the end
        assert retried[0]["at"] - stats["calls"][i]["at"] >= ERROR_WAIT_S  # after the worker's own wait
    assert "Transient" in logs


@pytest.mark.parametrize(("shape", "fault"), [
    ("openai", "create:lost"), ("openrouter", "create:lost"), ("openai", "create:hang"),
    ("openrouter", "create:lost_502"),
])
def test_a_submission_applied_but_its_reply_lost_is_found_by_its_metadata_not_submitted_again(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, fault):
    """The dangerous case: the provider created the batch, the worker never heard (the connection closed,
    a 502, its read timeout). It must find the batch by the fleet's id in its metadata and poll it; one
    batch at the provider, each prompt submitted once, stored once, paid once."""
    emu, stats, logs = _run(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, 6, (fault,),
                            client_timeout_s=2.0 if fault.endswith("hang") else None, hang_s=30)
    creates = [x for x in stats["calls"] if x["call"] == "create"]
    assert len(creates) == 1  # the lost one was the only submission
    after = stats["calls"][stats["calls"].index(creates[0]) + 1:]
    assert after[0]["call"] == "list"  # found again by its metadata before anything else


@pytest.mark.parametrize("shape", ["openai", "openrouter"])
def test_no_credits_on_submission_pauses_the_worker_and_the_batch_is_submitted_once_after(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape):
    """No credits on the submission (OpenRouter's 402; OpenAI's 429 ``insufficient_quota``, which no
    wait cures) halts the worker as the cloud worker halts (paused, nothing failed); the batch, recorded
    before it was submitted, is submitted once after the pause (``pause_s``), never while it lasts."""
    emu, stats, logs = _run(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers, shape, 4,
                            ("create:402",))
    assert "STOPPED CONSUMING" in logs and "payment_required" in logs
    (i,) = [k for k, x in enumerate(stats["calls"]) if x["fault"] == "402"]
    assert stats["calls"][i]["status"] == (429 if shape == "openai" else 402)
    nxt = next(x for x in stats["calls"][i + 1:] if x["call"] == "create")
    assert nxt["at"] - stats["calls"][i]["at"] >= 2.0  # the config's pause_s
