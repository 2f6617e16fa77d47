"""The emulator's batch APIs, over loopback HTTP: the OpenAI shape's statuses, files, validation,
cancel and expiry the fleet's batch path will meet on OpenAI-compatible providers, and OpenRouter's
inline shape (field order, limits, validation after acceptance, results inline, no cancel)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from draftfleet.devtools.samples import build_tokenizer

KEY = "sk-emulator-batch-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "test/model"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("emulator_batch") / "tok")


@pytest.fixture
def make(emulator_factory):
    """An emulator with a key and the given batch timings (model seconds; time_scale 0.05)."""

    def start(**fields):
        fields.setdefault("model", MODEL)
        fields.setdefault("api_key", KEY)
        fields.setdefault("time_scale", 0.05)
        fields.setdefault("length", "fixed:12")
        return emulator_factory(**fields)

    return start


def line(custom_id: str, content: str | None = None, **overrides) -> dict:
    row = {"custom_id": custom_id, "method": "POST", "url": CHAT,
           "body": {"model": MODEL, "messages": [{"role": "user", "content": content or f"prompt {custom_id}"}],
                    "max_tokens": 64}}
    row.update(overrides)
    return row


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def upload(client: httpx.Client, content: bytes) -> str:
    r = client.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                    files={"file": ("input.jsonl", content, "application/jsonl")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "file" and body["purpose"] == "batch" and body["bytes"] == len(content)
    return body["id"]


def create(client: httpx.Client, file_id: str) -> dict:
    r = client.post("/v1/batches", headers=AUTH,
                    json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def poll(client: httpx.Client, batch_id: str, until: set[str], timeout: float = 10.0) -> tuple[dict, list[str]]:
    """The batch once its status is in ``until``, and every status seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/v1/batches/{batch_id}", headers=AUTH)
        assert r.status_code == 200, r.text
        batch = r.json()
        if not seen or seen[-1] != batch["status"]:
            seen.append(batch["status"])
        if batch["status"] in until:
            return batch, seen
        assert time.monotonic() < deadline, f"batch stuck in {batch['status']}"
        time.sleep(0.01)


def download(client: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    r = client.get(f"/v1/files/{file_id}/content", headers=AUTH)
    assert r.status_code == 200, r.text
    return [json.loads(row) for row in r.text.splitlines()]


def test_batch_end_to_end_answers_each_request_once_like_chat_completions(make) -> None:
    emu = make(batch_validating_s=0.5, batch_request_s=0.2, batch_finalizing_s=0.5)
    ids = [f"req-{i}" for i in range(6)]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl([line(i) for i in ids])))
        assert batch["status"] == "validating" and batch["object"] == "batch"
        assert batch["completion_window"] == "24h" and batch["endpoint"] == CHAT
        assert 4319 <= batch["expires_at"] - batch["created_at"] <= 4321  # "24h" in model time, scaled
        done, seen = poll(client, batch["id"], {"completed"})
        assert seen[0] == "validating" and seen[-1] == "completed"
        assert set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
        assert "in_progress" in seen
        assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert done["error_file_id"] is None and done["errors"] is None
        for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
            assert done[stamp] is not None
        out = download(client, done["output_file_id"])
        assert sorted(row["custom_id"] for row in out) == sorted(ids)
        # the same messages answered synchronously: the same body shape and the same text
        sync = client.post(CHAT, headers=AUTH, json=line("req-0")["body"]).json()
    by_id = {row["custom_id"]: row for row in out}
    for row in out:
        assert row["error"] is None and row["id"].startswith("batch_req_")
        response = row["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert set(body["usage"]) == set(sync["usage"])
    first = by_id["req-0"]["response"]["body"]
    assert first["choices"][0]["message"]["content"] == sync["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] == sync["usage"]["completion_tokens"]
    assert first["usage"]["cost"] == pytest.approx(sync["usage"]["cost"] * 0.5)  # the batch price
    stats = emu.stats()["batch"]
    assert stats["submitted"] == {i: 1 for i in ids}
    assert stats["answered"] == {i: 1 for i in ids}
    assert stats["by_status"] == {"completed": 1}
    assert emu.stats()["by_endpoint"]["/v1/batches/{id}"] >= 2


def test_batch_list_and_file_retrieve(make) -> None:
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        file_id = upload(client, jsonl([line("a")]))
        assert client.get(f"/v1/files/{file_id}", headers=AUTH).json()["id"] == file_id
        batch = create(client, file_id)
        listed = client.get("/v1/batches", headers=AUTH).json()
        assert listed["object"] == "list" and [b["id"] for b in listed["data"]] == [batch["id"]]
        assert listed["data"][0]["status"] == "completed"  # time_scale 0: at once


def test_the_batch_list_pages_newest_first_as_openais_does(make) -> None:
    """``limit`` 1-100, default 20; ``after`` the last id of the page before; ``has_more``; a limit out
    of range is a 400 naming it. A client that reads the first page alone misses older batches."""
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        file_id = upload(client, jsonl([line("a")]))
        made = [create(client, file_id)["id"] for _ in range(25)]
        first = client.get("/v1/batches", headers=AUTH).json()
        assert [b["id"] for b in first["data"]] == made[::-1][:20] and first["has_more"] is True
        assert first["last_id"] == made[5]
        rest = client.get("/v1/batches", headers=AUTH, params={"after": first["last_id"], "limit": 100}).json()
        assert [b["id"] for b in rest["data"]] == made[4::-1] and rest["has_more"] is False
        for bad in ("0", "101", "x"):
            r = client.get("/v1/batches", headers=AUTH, params={"limit": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


@pytest.mark.parametrize(("rows", "code", "error_line"), [
    ([line("a"), line("a")], "duplicate_custom_id", 2),
    ([line("a"), b"{not json"], "invalid_json_line", 2),
    ([line("a", url="/v1/embeddings")], "url_mismatch", 1),
    ([line("a", method="GET")], "invalid_method", 1),
    ([line("a"), {**line("b"), "body": {**line("b")["body"], "model": "other/model"}}], "model_mismatch", 2),
    ([{**line("a"), "body": {**line("a")["body"], "model": "other/model"}}], "model_not_found", 1),
    ([{"method": "POST", "url": CHAT, "body": line("a")["body"]}], "missing_required_parameter", 1),
    ([], "empty_file", None),
])
def test_a_bad_input_file_fails_the_batch_with_openai_errors(make, rows, code, error_line) -> None:
    emu = make(batch_validating_s=0.2)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl(rows)))
        assert batch["status"] == "validating"  # the file is checked after the create answers
        failed, seen = poll(client, batch["id"], {"failed", "completed"})
    assert failed["status"] == "failed" and "in_progress" not in seen
    assert failed["errors"]["object"] == "list"
    assert [(e["code"], e["line"]) for e in failed["errors"]["data"]][:1] == [(code, error_line)]
    assert failed["failed_at"] is not None and failed["output_file_id"] is None
    assert failed["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert emu.stats()["batch"]["answered"] == {}


def test_too_many_requests_and_too_large_a_file_are_refused(make) -> None:
    emu = make(time_scale=0, batch_max_requests=2, batch_max_file_bytes=10_000)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl([line("a"), line("b"), line("c")])))
        batch, _ = poll(client, batch["id"], {"failed"})
        assert batch["errors"]["data"][0]["code"] == "too_many_tasks"
        r = client.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                        files={"file": ("big.jsonl", b"x" * 10_001)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_create_is_strict_about_its_arguments(make) -> None:
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        file_id = upload(client, jsonl([line("a")]))
        base = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        for body, param in [({**base, "completion_window": "1h"}, "completion_window"),
                            ({**base, "endpoint": "/v1/unknown"}, "endpoint"),
                            ({k: v for k, v in base.items() if k != "input_file_id"}, "input_file_id")]:
            r = client.post("/v1/batches", headers=AUTH, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = client.post("/v1/batches", headers=AUTH, json={**base, "model": MODEL})
        assert r.status_code == 400 and "Unrecognized request argument" in r.json()["error"]["message"]
        r = client.post("/v1/batches", headers=AUTH, json={**base, "input_file_id": "file-missing"})
        assert r.status_code == 404
        r = client.post("/v1/files", headers=AUTH, data={"purpose": "fine-tune"},
                        files={"file": ("x.jsonl", jsonl([line("a")]))})
        assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
        r = client.post("/v1/files", headers={**AUTH, "Content-Type": "application/json"}, content=b"{}")
        assert r.status_code == 400
        assert client.get("/v1/batches/batch_missing", headers=AUTH).status_code == 404
        assert client.delete("/v1/batches", headers=AUTH).status_code == 405


def test_cancel_keeps_what_completed_and_returns_the_rest_as_cancelled(make) -> None:
    emu = make(batch_validating_s=0, batch_request_s=1.0, batch_cancelling_s=1.0)  # a request per 50 ms
    ids = [f"c-{i}" for i in range(40)]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl([line(i) for i in ids])))
        running, _ = poll(client, batch["id"], {"in_progress"})
        while running["request_counts"]["completed"] < 3:
            time.sleep(0.02)
            running = client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()
        r = client.post(f"/v1/batches/{batch['id']}/cancel", headers=AUTH)
        assert r.status_code == 200 and r.json()["status"] == "cancelling"
        assert r.json()["cancelling_at"] is not None
        cancelled, seen = poll(client, batch["id"], {"cancelled"})
        assert seen[0] == "cancelling"
        out = download(client, cancelled["output_file_id"])
        errors = download(client, cancelled["error_file_id"])
        again = client.post(f"/v1/batches/{batch['id']}/cancel", headers=AUTH)
    done = {row["custom_id"] for row in out}
    assert 3 <= len(done) < len(ids)
    assert all(row["response"]["status_code"] == 200 for row in out)
    assert {row["custom_id"] for row in errors} == set(ids) - done
    assert all(row["response"] is None and row["error"]["code"] == "batch_cancelled" for row in errors)
    assert cancelled["request_counts"] == {"total": 40, "completed": len(done), "failed": 40 - len(done)}
    assert cancelled["cancelled_at"] is not None
    assert again.status_code == 400  # a cancelled batch cannot be cancelled again
    assert emu.stats()["batch"]["answered"] == {i: 1 for i in done}


def test_unfinished_requests_expire_with_the_window(make) -> None:
    emu = make(batch_validating_s=0, batch_request_s=1.0, batch_window_s=4.5)  # 4 of 10 fit in the window
    ids = [f"e-{i}" for i in range(10)]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl([line(i) for i in ids])))
        expired, _ = poll(client, batch["id"], {"expired", "completed"})
        out = download(client, expired["output_file_id"])
        errors = download(client, expired["error_file_id"])
    assert expired["status"] == "expired" and expired["expired_at"] is not None
    assert [row["custom_id"] for row in out] == ids[:4]
    assert [row["custom_id"] for row in errors] == ids[4:]
    assert all(row["error"]["code"] == "batch_expired" for row in errors)
    assert expired["request_counts"] == {"total": 10, "completed": 4, "failed": 6}


def test_per_request_errors_go_to_the_error_file_in_the_chat_shape(make) -> None:
    emu = make(time_scale=0, context_length=200)
    long = "word " * 200  # beyond the context length: the synchronous endpoint answers 400
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = create(client, upload(client, jsonl([line("ok"), line("long", long)])))
        batch, _ = poll(client, batch["id"], {"completed"})
        out = download(client, batch["output_file_id"])
        errors = download(client, batch["error_file_id"])
        sync = client.post(CHAT, headers=AUTH, json=line("long", long)["body"])
    assert [row["custom_id"] for row in out] == ["ok"]
    assert [row["custom_id"] for row in errors] == ["long"]
    assert errors[0]["response"]["status_code"] == 400 == sync.status_code
    assert errors[0]["response"]["body"] == sync.json()
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}


def test_the_api_key_is_checked_on_every_batch_path(make) -> None:
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        file_id = upload(client, jsonl([line("a")]))
        batch = create(client, file_id)
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            calls = [
                client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                            files={"file": ("x.jsonl", jsonl([line("b")]))}),
                client.post("/v1/batches", headers=headers,
                            json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}),
                client.get(f"/v1/batches/{batch['id']}", headers=headers),
                client.get("/v1/batches", headers=headers),
                client.post(f"/v1/batches/{batch['id']}/cancel", headers=headers),
                client.get(f"/v1/files/{file_id}/content", headers=headers),
            ]
            for r in calls:
                assert r.status_code == 401, r.text
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and "sk-wrong" not in r.text
    stats = emu.stats()
    assert stats["unauthorized"] == 12
    assert stats["batch"]["submitted"] == {"a": 1} and stats["batch"]["batches"] == 1


# --- OpenRouter's inline shape: /api/v1/batches ------------------------------------------------
OR = "/api/v1/batches"
JSON = {**AUTH, "content-type": "application/json"}


def or_request(custom_id: str, content: str | None = None, **body) -> dict:
    """One inline request; its body leaves ``model`` out (it inherits the batch's) unless given."""
    return {"custom_id": custom_id,
            "body": {"messages": [{"role": "user", "content": content or f"prompt {custom_id}"}], "max_tokens": 64,
                     **body}}


def or_body(ids: list[str], *, model: str = MODEL, first: str = "endpoint", requests: list | None = None,
            **extra) -> bytes:
    """The submit body, its keys in the order written (``first="requests"`` puts them before the model)."""
    reqs = requests if requests is not None else [or_request(i) for i in ids]
    head = {"endpoint": CHAT, "model": model, **extra}
    body = {"requests": reqs, **head} if first == "requests" else {**head, "requests": reqs}
    return json.dumps(body).encode()


def or_submit(client: httpx.Client, body: bytes, base: str = OR) -> dict:
    r = client.post(base, headers=JSON, content=body)
    assert r.status_code == 202, r.text
    return r.json()


def or_poll(client: httpx.Client, batch_id: str, until: set[str], timeout: float = 10.0,
            base: str = OR) -> tuple[dict, list[str]]:
    """The batch once its status is in ``until``, and every status seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"{base}/{batch_id}", headers=AUTH)
        assert r.status_code == 200, r.text
        batch = r.json()
        if not seen or seen[-1] != batch["status"]:
            seen.append(batch["status"])
        if batch["status"] in until:
            return batch, seen
        assert batch["results"] is None, "results appear only once the batch has ended"
        assert time.monotonic() < deadline, f"batch stuck in {batch['status']}"
        time.sleep(0.01)


def test_openrouter_batch_end_to_end_results_inline_at_half_price(make) -> None:
    emu = make(batch_validating_s=0.5, batch_request_s=0.2, batch_finalizing_s=0.5)
    ids = [f"or-{i}" for i in range(5)]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = or_submit(client, or_body(ids, metadata={"draftfleet_batch": "b1"}))
        done, seen = or_poll(client, batch["id"], {"completed"})
        sync = client.post(CHAT, headers=AUTH, json={"model": MODEL, **or_request("or-0")["body"]}).json()
    assert batch["status"] == "validating" and batch["results"] is None and batch["model"] == MODEL
    assert batch["object"] == "batch" and batch["endpoint"] == CHAT and batch["completion_window"] == "24h"
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert batch["finalized_at"] is None and batch["expires_at"] >= batch["created_at"]
    assert batch["metadata"] == {"draftfleet_batch": "b1"}
    assert seen == ["validating", "in_progress", "finalizing", "completed"]
    assert set(done) == {"id", "object", "endpoint", "model", "completion_window", "created_at", "expires_at",
                         "finalized_at", "status", "request_counts", "provider", "error", "usage", "metadata",
                         "results"}
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0} and done["error"] is None
    assert done["finalized_at"] is not None
    assert [x["custom_id"] for x in done["results"]] == ids  # each answered once
    assert all(set(x) == {"custom_id", "response"} and set(x["response"]) == {"status_code", "body"}
               for x in done["results"])
    first = done["results"][0]["response"]
    assert first["status_code"] == 200 and first["body"]["model"] == MODEL
    assert first["body"]["choices"][0]["message"]["content"] == sync["choices"][0]["message"]["content"]
    assert first["body"]["usage"]["cost"] == pytest.approx(sync["usage"]["cost"] * 0.5)
    assert sync["usage"]["cost"] > 0
    stats = emu.stats()["batch"]
    assert stats["submitted"] == {i: 1 for i in ids} and stats["answered"] == {i: 1 for i in ids}
    assert stats["files"] == 0  # nothing uploaded, nothing written: the results are inline


def test_openrouter_is_served_under_the_quickstarts_beta_path_too(make) -> None:
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = or_submit(client, or_body(["b-1"]), base="/api/beta/batches")
        done, _ = or_poll(client, batch["id"], {"completed"}, base="/api/beta/batches")
        same = client.get(f"{OR}/{batch['id']}", headers=AUTH)
    assert [x["custom_id"] for x in done["results"]] == ["b-1"]
    assert same.status_code == 200 and same.json()["id"] == batch["id"]


@pytest.mark.parametrize("case, expect", [
    ("requests_first", "must come before 'requests'"),
    ("model_after", "must come before 'requests'"),
    ("callback_after", "must come before 'requests'"),
    ("too_many", "at most 5000"),
    ("empty", "non-empty"),
    ("no_model", "'model' is required"),
    ("endpoint", "serves only"),
    ("unknown_field", "Unrecognized"),
    ("duplicate_field", "Duplicate"),
    ("window", "24h"),
    ("callback_http", "https://"),
    ("provider", "'provider'"),
    ("metadata", "metadata"),
    ("custom_id_number", "custom_id: string"),
    ("no_body", "body: object"),
    ("not_json", "not valid JSON"),
])
def test_openrouter_refuses_a_bad_submission_with_400(make, case, expect) -> None:
    emu = make()
    reqs = json.dumps([or_request("a")])
    body = {
        "requests_first": or_body(["a"], first="requests"),
        "model_after": f'{{"endpoint": "{CHAT}", "requests": {reqs}, "model": "{MODEL}"}}'.encode(),
        "callback_after": or_body(["a"]).removesuffix(b"}") + b', "callback_url": "https://example.test/hook"}',
        "too_many": or_body([f"r{i}" for i in range(5001)]),
        "empty": or_body([]),
        "no_model": json.dumps({"endpoint": CHAT, "requests": [or_request("a")]}).encode(),
        "endpoint": or_body(["a"]).replace(CHAT.encode(), b"/v1/embeddings", 1),
        "unknown_field": or_body(["a"], input_file_id="file-1"),
        "duplicate_field": f'{{"endpoint": "{CHAT}", "model": "{MODEL}", "model": "{MODEL}", '
                           f'"requests": {reqs}}}'.encode(),
        "window": or_body(["a"], completion_window="48h"),
        "callback_http": or_body(["a"], callback_url="http://example.test/hook"),
        "provider": or_body(["a"], provider={"order": ["x"]}),
        "metadata": or_body(["a"], metadata={f"k{i}": "v" for i in range(17)}),
        "custom_id_number": or_body([], requests=[{"custom_id": 7, "body": or_request("a")["body"]}]),
        "no_body": or_body([], requests=[{"custom_id": "a"}]),
        "not_json": b'{"endpoint": ',
    }[case]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        r = client.post(OR, headers=JSON, content=body)
    assert r.status_code == 400 and expect in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == 400
    assert emu.stats()["batch"]["batches"] == 0 and not emu.stats()["batch"]["submitted"]


def test_openrouter_accepts_the_documented_optional_fields(make) -> None:
    emu = make(time_scale=0)
    body = or_body(["a"], completion_window="24h", callback_url="https://example.test/hook",
                   provider={"only": ["emulator"], "allow_fallbacks": False}, metadata={"k": "v"})
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = or_submit(client, body)
        done, _ = or_poll(client, batch["id"], {"completed"})
    assert done["request_counts"]["completed"] == 1


@pytest.mark.parametrize("case, expect", [
    ("duplicate", "custom_id 'x'"),
    ("model", "differs from the batch's model 'test/model'"),
    ("unserved", "Model 'other/model'"),
    ("no_messages", "messages"),
])
def test_openrouter_checks_requests_after_acceptance_and_fails_the_batch(make, case, expect) -> None:
    """Accepted (202), then validated: a repeated custom_id or a body naming another model fails it,
    with ``error.message`` saying why; nothing runs."""
    emu = make(batch_validating_s=0.2)
    body = {
        "duplicate": or_body(["x", "y", "x"]),
        "model": or_body([], requests=[or_request("x"), or_request("y", model="other/model")]),
        "unserved": or_body(["x"], model="other/model"),
        "no_messages": or_body([], requests=[or_request("x"), {"custom_id": "y", "body": {"messages": []}}]),
    }[case]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        accepted = or_submit(client, body)
        failed, seen = or_poll(client, accepted["id"], {"failed", "completed"})
    # accepted as validating; the first poll may come after the 0.2 s of validation on a loaded machine
    assert accepted["status"] == "validating" and seen in (["validating", "failed"], ["failed"]), (accepted, seen)
    assert expect in failed["error"]["message"], failed["error"]
    assert failed["results"] == [] and failed["finalized_at"] is not None
    assert failed["request_counts"]["completed"] == 0
    assert not emu.stats()["batch"]["answered"]


def test_openrouter_per_request_errors_are_responses_in_the_chat_shape(make) -> None:
    emu = make(time_scale=0, context_length=200)
    long = "word " * 200  # beyond the context length: the synchronous endpoint answers 400
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch = or_submit(client, or_body([], requests=[or_request("ok"), or_request("long", long)]))
        done, _ = or_poll(client, batch["id"], {"completed"})
        sync = client.post(CHAT, headers=AUTH, json={"model": MODEL, **or_request("long", long)["body"]})
    results = {x["custom_id"]: x for x in done["results"]}
    assert results["ok"]["response"]["status_code"] == 200
    assert results["long"]["response"]["status_code"] == 400 == sync.status_code
    assert results["long"]["response"]["body"] == sync.json() and "error" not in results["long"]
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert emu.stats()["batch"]["answered"] == {"ok": 1}


def test_openrouter_batch_request_errors_are_500_responses(make) -> None:
    emu = make(time_scale=0, rate_batch_request_error=1.0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        done, _ = or_poll(client, or_submit(client, or_body(["a", "b"]))["id"], {"completed"})
    assert [x["response"]["status_code"] for x in done["results"]] == [500, 500]
    assert done["results"][0]["response"]["body"]["error"]["code"] == 500
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


def test_openrouter_unfinished_requests_expire_with_the_window(make) -> None:
    emu = make(batch_validating_s=0, batch_request_s=1.0, batch_window_s=2.5)  # 2 of 4 fit in the window
    ids = ["a", "b", "c", "d"]
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        done, _ = or_poll(client, or_submit(client, or_body(ids))["id"], {"expired", "completed"})
    assert done["status"] == "expired" and done["finalized_at"] is not None
    assert [x["custom_id"] for x in done["results"]] == ids
    assert [x["response"]["status_code"] for x in done["results"][:2]] == [200, 200]
    assert all(set(x) == {"custom_id", "error"} and x["error"]["code"] == "batch_expired" for x in done["results"][2:])
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}


def test_openrouter_batches_have_no_cancel_route(make) -> None:
    """OpenRouter documents no cancel: its paths answer 404 in OpenRouter's shape, and the OpenAI
    shape's cancel cannot reach an OpenRouter batch either."""
    emu = make(batch_validating_s=0.1, batch_request_s=0.5)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch_id = or_submit(client, or_body(["a", "b"]))["id"]
        tries = [client.post(f"{base}/{batch_id}/cancel", headers=AUTH) for base in (OR, "/api/beta/batches")]
        tries += [client.delete(f"{OR}/{batch_id}", headers=AUTH), client.post(f"{OR}/{batch_id}", headers=AUTH)]
        for r in tries:
            assert r.status_code == 404 and r.json() == {"error": {"code": 404, "message": "Not Found"}}, r.text
        assert client.post(f"/v1/batches/{batch_id}/cancel", headers=AUTH).status_code == 404
        assert client.get(f"/v1/batches/{batch_id}", headers=AUTH).status_code == 404
        assert batch_id not in [b["id"] for b in client.get("/v1/batches", headers=AUTH).json()["data"]]
        done, _ = or_poll(client, batch_id, {"completed", "cancelled", "cancelling"})
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2


def test_openrouter_checks_the_api_key_in_its_error_shape(make) -> None:
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        batch_id = or_submit(client, or_body(["a"]))["id"]
        for headers, message in (({}, "No auth credentials found"),
                                 ({"Authorization": "Bearer sk-wrong-key"}, "User not found.")):
            calls = [client.post(OR, headers={**headers, "content-type": "application/json"}, content=or_body(["b"])),
                     client.get(OR, headers=headers), client.get(f"{OR}/{batch_id}", headers=headers)]
            for r in calls:
                assert r.status_code == 401 and r.json() == {"error": {"code": 401, "message": message}}, r.text
                assert "sk-wrong-key" not in r.text
    stats = emu.stats()
    assert stats["unauthorized"] == 6
    assert stats["batch"]["submitted"] == {"a": 1} and stats["batch"]["batches"] == 1


def test_openrouter_list_finds_a_batch_by_its_metadata(make) -> None:
    """After a crash the client finds its own batch again by the metadata it sent (an emulator
    assumption: OpenRouter's docs do not mention metadata)."""
    emu = make(time_scale=0)
    with httpx.Client(base_url=emu.url, timeout=5) as client:
        ours = [or_submit(client, or_body([f"{n}-a"], metadata={"draftfleet_batch": n}))["id"] for n in ("b1", "b2")]
        or_submit(client, or_body(["plain"]))
        create(client, upload(client, jsonl([line("openai-a")])))  # the OpenAI shape's batches are not listed here
        listed = client.get(OR, headers=AUTH).json()
    assert set(listed) == {"data"} and len(listed["data"]) == 3
    assert all(b["object"] == "batch" and "results" in b for b in listed["data"])
    found = [b["id"] for b in listed["data"] if (b["metadata"] or {}).get("draftfleet_batch") == "b2"]
    assert found == [ours[1]]
    assert listed["data"][0]["status"] == "completed"  # listing advances the batches like a get
