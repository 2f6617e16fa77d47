"""The emulator speaks SGLang's and OpenRouter's protocols, is deterministic per prompt,
models continuous batching, and produces every fault kind on demand."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from draftfleet.devtools.emulator import FAULT_KINDS, FAULT_PATHS, Emulator, EmulatorConfig
from draftfleet.devtools.samples import build_tokenizer

KEY = "sk-emulator-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "test/model", "messages": [{"role": "user", "content": "explain a queue"}]}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("emulator") / "tok")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def emulator(tokenizer_dir: Path) -> Iterator[Emulator]:
    config = EmulatorConfig(tokenizer=str(tokenizer_dir), model="test/model", api_key=KEY, time_scale=0)
    with Emulator(config) as emu:
        yield emu


@pytest.fixture
def client(emulator: Emulator) -> Iterator[httpx.Client]:
    """A client on a freshly reset emulator: default config (instant), no faults, zero stats."""
    baseline = emulator.config
    emulator.reset_stats()
    with httpx.Client(base_url=emulator.url, timeout=5) as c:
        yield c
    emulator.update(**{f: getattr(baseline, f) for f in baseline.__struct_fields__})


def generate(client: httpx.Client, max_new_tokens: int = 1000, **prompt: object) -> dict:
    r = client.post("/generate", json={**prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_is_deterministic_per_prompt(client: httpx.Client, tokenizer: Tokenizer) -> None:
    a = generate(client, input_ids=[10, 11, 12])
    assert generate(client, input_ids=[10, 11, 12])["output_ids"] == a["output_ids"]
    assert generate(client, input_ids=[10, 11, 13])["output_ids"] != a["output_ids"]
    ids = a["output_ids"]
    meta = a["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert ids[-1] == 2 and 2 not in ids[:-1]
    assert a["text"] == tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert "\ufffd" not in a["text"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(ids)
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0 and meta["id"]


def test_generate_text_counts_prompt_tokens(client: httpx.Client, tokenizer: Tokenizer) -> None:
    text = "def sort the list of python data"
    a = generate(client, text=text)
    assert generate(client, text=text)["output_ids"] == a["output_ids"]
    assert generate(client, text=text + "!")["output_ids"] != a["output_ids"]
    assert a["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text).ids)
    r = client.post("/generate", json={"text": "x", "rid": "my-rid"})
    assert r.json()["meta_info"]["id"] == "my-rid"


def test_length_cap_and_distribution(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(length="fixed:50")
    full = generate(client, input_ids=[1, 2, 3], max_new_tokens=50)
    assert len(full["output_ids"]) == 50 and full["meta_info"]["finish_reason"]["type"] == "stop"
    capped = generate(client, input_ids=[1, 2, 3], max_new_tokens=10)
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert capped["output_ids"] == full["output_ids"][:10]
    assert capped["meta_info"]["completion_tokens"] == 10
    emulator.update(length="uniform:5:8")
    lengths = {len(generate(client, input_ids=[i])["output_ids"]) for i in range(40)}
    assert lengths <= set(range(5, 9)) and len(lengths) > 1
    stats = emulator.stats()
    assert stats["completed"] == 42 and stats["by_endpoint"]["/generate"] == 42


def test_bad_requests(client: httpx.Client, emulator: Emulator) -> None:
    r = client.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]
    r = client.post("/generate", content=b"{not json")
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400
    assert client.post("/generate", json={"input_ids": [[1, 2], [3]]}).status_code == 400
    assert client.get("/generate").json() == {"detail": "Method Not Allowed"}
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    with pytest.raises(ValueError):
        emulator.update(length="gaussian:3")
    with pytest.raises(ValueError):
        emulator.update(rate_429=1.5)


def test_info_routes(client: httpx.Client, emulator: Emulator) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/model_info").json()["model_path"] == "test/model"
    assert client.get("/server_info").json()["max_running_requests"] == 256
    assert emulator.stats()["deprecated"] == 0
    # the old paths still answer, as SGLang's do, and are logged as deprecated
    assert client.get("/get_model_info").json()["model_path"] == "test/model"
    assert client.get("/get_server_info").json()["context_length"] == 32768
    assert emulator.stats()["deprecated"] == 2
    assert client.get("/v1/models").json()["data"][0]["id"] == "test/model"


def test_chat_completion_shape_and_cost(
    client: httpx.Client, emulator: Emulator, tokenizer: Tokenizer
) -> None:
    emulator.update(price_input_per_mtok=3.0, price_output_per_mtok=15.0)
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "test/model" and body["id"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert "reasoning" not in choice["message"]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cost = (usage["prompt_tokens"] * 3.0 + usage["completion_tokens"] * 15.0) / 1e6
    assert usage["cost"] == pytest.approx(cost)
    assert usage["is_byok"] is False and usage["prompt_tokens_details"]["cached_tokens"] == 0
    # The same prompt gives the same text; the content holds the answer without end-of-turn.
    again = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}, headers=AUTH).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
    content_ids = tokenizer.encode(choice["message"]["content"]).ids
    assert 2 not in content_ids
    capped = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7}, headers=AUTH).json()
    assert capped["choices"][0]["finish_reason"] == "length" and capped["usage"]["completion_tokens"] == 7


def test_chat_reasoning(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(reasoning_rate=1.0, reasoning_length="fixed:30", length="fixed:20")
    body = client.post("/v1/chat/completions", json=CHAT, headers=AUTH).json()
    message = body["choices"][0]["message"]
    assert message["reasoning"] and message["content"]
    assert body["usage"]["completion_tokens"] == 50
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 30
    # a lower cap cuts the same reasoning short
    capped = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12}, headers=AUTH).json()
    assert message["reasoning"].startswith(capped["choices"][0]["message"]["reasoning"])
    assert capped["choices"][0]["finish_reason"] == "length" and capped["usage"]["completion_tokens"] == 12


def test_chat_requires_the_key(client: httpx.Client, emulator: Emulator) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert emulator.stats()["unauthorized"] == 2


_SGLANG_REPLIES = {  # fault kind on /generate: (status, body)
    "500": (500, None),  # Starlette's plain-text answer to an unhandled exception
    "503": (503, {"object": "error", "message": "Abort request with status 503 (emulated)", "type": "503",
                  "param": None, "code": 503}),
}


@pytest.mark.parametrize("kind", ["500", "503", "abort", "cut"])
def test_generate_fault_kinds_as_sglang_sends_them(client: httpx.Client, emulator: Emulator, kind: str) -> None:
    emulator.update(**{f"rate_{kind}": 1.0}, retry_after_s=7)
    if kind == "cut":
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            client.post("/generate", json={"text": "fault"})
    else:
        r = client.post("/generate", json={"text": "fault"})
        if kind == "abort":  # an abort without a status code comes as HTTP 200
            assert r.status_code == 200
            finish = r.json()["meta_info"]["finish_reason"]
            assert finish["type"] == "abort" and finish["status_code"] is None
        else:
            status, body = _SGLANG_REPLIES[kind]
            assert r.status_code == status
            assert (r.json() if body else r.text) == (body or "Internal Server Error")
        assert "Retry-After" not in r.headers  # SGLang never sends one
    assert emulator.stats()["faults"][kind] == 1


def test_sglang_sends_no_429_unless_a_proxy_does(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(rate_429=1.0, retry_after_s=7)
    assert client.post("/generate", json={"text": "a"}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 429
    emulator.update(proxy=True, rate_429=0.0, rate_503=1.0)
    r = client.post("/generate", json={"text": "a"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "7"
    emulator.update(rate_503=0.0, rate_429=1.0)
    r = client.post("/generate", json={"text": "a"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "7"
    assert FAULT_PATHS["402"] == {"/v1/chat/completions"}


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if "/v1/chat/completions" in FAULT_PATHS[k] and k != "hang"])
def test_chat_fault_kinds(client: httpx.Client, emulator: Emulator, kind: str) -> None:
    emulator.update(**{f"rate_{kind}": 1.0}, retry_after_s=7)
    if kind == "cut":
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    else:
        r = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        if kind == "abort":  # not billed (OpenRouter's zero completion insurance)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "error"
            assert r.json()["usage"]["cost"] == 0
        elif kind == "empty":  # generated and billed, nothing in the message
            body = r.json()
            assert r.status_code == 200 and body["choices"][0]["message"]["content"] == ""
            assert body["usage"]["completion_tokens"] > 0 and body["usage"]["cost"] > 0
        else:
            error = r.json()["error"]
            status = 200 if kind == "200_error" else 403 if kind == "moderation" else int(kind[:3])
            assert r.status_code == status
            assert error["code"] == (502 if kind == "200_error" else status)
            meta = error.get("metadata") or {}
            if kind in ("429", "503", "402_inflight"):
                assert r.headers["Retry-After"] == "7"
            else:
                assert "Retry-After" not in r.headers
            if kind == "402":
                assert meta == {"limit_source": "openrouter_credits"}
            if kind == "402_inflight":
                assert meta == {"limit_source": "openrouter_in_flight_budget", "reason": "in_flight_budget_exhausted"}
            if kind == "403":  # a guardrail or permission block: no moderation metadata
                assert "reasons" not in meta and r.json()["error_type"] == "permission_denied"
            if kind == "moderation":
                assert meta["reasons"] and "flagged_input" in meta
            if kind == "200_error":
                assert meta["retry_after_seconds"] == 7
    faults = emulator.stats()["faults"]
    assert faults[kind] == 1 and sum(faults.values()) == 1


def test_hang_outlasts_client_timeout_then_is_dropped(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(rate_hang=1.0)
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json={"text": "hang"}, timeout=0.3)
    assert emulator.stats()["open"] == 1
    deadline = time.monotonic() + 3
    while emulator.stats()["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = emulator.stats()
    assert stats["open"] == 0 and stats["disconnected"] == 1 and stats["faults"]["hang"] == 1


def test_short_hang_then_answers(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(rate_hang=1.0, hang_s=0.2)
    t0 = time.monotonic()
    assert generate(client, text="slow")["output_ids"]
    assert time.monotonic() - t0 >= 0.2


def test_config_route_switches_faults(client: httpx.Client) -> None:
    assert client.post("/emulator/config", json={"rate_402": 1.0}).json()["api_key"] == "<set>"
    assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 402
    assert client.post("/emulator/config", json={"rate_402": 0.0}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
    only_chat = {"fault_endpoints": ["/v1/chat/completions"], "rate_500": 1}
    assert client.post("/emulator/config", json=only_chat).status_code == 200
    assert client.post("/generate", json={"text": "a"}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 500
    assert client.post("/emulator/config", json={"rate_500": 2}).status_code == 400
    assert client.post("/emulator/config", json={"no_such_field": 1}).status_code == 400
    stats = client.get("/emulator/stats").json()
    assert stats["faults"]["402"] == 1 and stats["faults"]["500"] == 1
    assert client.post("/emulator/reset_stats").json()["requests_total"] == 0


def test_keep_alive_and_fault_rates(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(rate_503=0.3, rate_500=0.2)
    statuses = [client.post("/generate", json={"input_ids": [i]}).status_code for i in range(400)]
    share_503, share_500 = statuses.count(503) / 400, statuses.count(500) / 400
    assert 0.2 < share_503 < 0.4 and 0.12 < share_500 < 0.28
    stats = emulator.stats()
    assert stats["faults"]["503"] == statuses.count(503) and stats["by_status"]["200"] == statuses.count(200)


def _timed_batch(url: str, n: int, **prompt: object) -> tuple[float, list[dict]]:
    limits = httpx.Limits(max_connections=n)
    with httpx.Client(base_url=url, timeout=10, limits=limits) as c, ThreadPoolExecutor(n) as pool:
        t0 = time.monotonic()
        results = list(pool.map(lambda i: generate(c, input_ids=[i], **prompt), range(n)))
        return time.monotonic() - t0, results


def test_continuous_batching_shares_throughput(tokenizer_dir: Path) -> None:
    config = EmulatorConfig(
        # Slow enough (0.4 s alone, 1.6 s for 16) that all 16 are open at once on a loaded machine.
        tokenizer=str(tokenizer_dir), length="fixed:100", single_stream_tps=250, ceiling_tps=1000, ttft_s=0
    )
    with Emulator(config) as emu:
        alone, _ = _timed_batch(emu.url, 1)
        assert 0.32 < alone < 1.2
        emu.reset_stats()
        together, results = _timed_batch(emu.url, 16)
        assert 1.0 < together < 4.8  # 16 share 1000 tok/s: 62.5 tok/s each, 1.6 s
        assert 2.5 < together / alone < 8
        assert all(len(r["output_ids"]) == 100 for r in results)
        stats = emu.stats()
        assert stats["peak_running"] == 16 and stats["max_concurrent_open"] == 16
        assert stats["running"] == 0 and stats["tokens_generated"] == 1600

        # Beyond max_running, requests wait for a slot: two waves of 4, each alone-fast.
        emu.update(max_running=4)
        emu.reset_stats()
        waves, _ = _timed_batch(emu.url, 8)
        assert 1.5 < waves / alone < 5
        stats = emu.stats()
        assert stats["peak_running"] == 4 and stats["max_concurrent_open"] == 8


def test_stop_ends_hung_requests(tokenizer_dir: Path) -> None:
    emu = Emulator(EmulatorConfig(tokenizer=str(tokenizer_dir), rate_hang=1.0)).start()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, emu.url + "/generate", json={"text": "x"}, timeout=30)
        while emu.stats()["open"] == 0:
            time.sleep(0.01)
        t0 = time.monotonic()
        emu.stop()
        with pytest.raises(httpx.HTTPError):
            pending.result(timeout=5)
        assert time.monotonic() - t0 < 2


def test_serve_runs_until_sigterm(tokenizer_dir: Path) -> None:
    code = (
        "from draftfleet.devtools.emulator import EmulatorConfig, serve; "
        f"serve(EmulatorConfig(tokenizer={str(tokenizer_dir)!r}, time_scale=0), port=0)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:")
            assert httpx.post(url + "/generate", json={"text": "hi"}).status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()


def test_all_fault_kinds_are_counted(emulator: Emulator) -> None:
    assert set(emulator.stats()["faults"]) == set(FAULT_KINDS)


# -- as strict as the real servers --------------------------------------------------------------


def test_output_ids_are_natural_text_and_round_trip_like_a_models(client: httpx.Client, emulator: Emulator,
                                                                   tokenizer: Tokenizer) -> None:
    """Ids of real text: decode -> encode gives them back, except in the few completions where
    the model split a word its own way (the seed saw 0.5-6.5% of samples differ)."""

    def mismatch_share(n: int) -> float:
        bad = 0
        for i in range(n):
            ids = generate(client, input_ids=[7, i])["output_ids"][:-1]
            bad += tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False).ids != ids
        return bad / n

    emulator.update(split_rate=0.0)
    out = generate(client, input_ids=[7, 1])
    words = out["text"].split()
    assert len(words) > 20 and sum(w.strip(".,?:").isalpha() for w in words) > 0.9 * len(words)
    assert mismatch_share(200) == 0.0
    emulator.update(split_rate=0.03)
    assert 0.005 <= mismatch_share(600) <= 0.065


def test_generation_stops_only_on_requested_ids_and_eos(client: httpx.Client, emulator: Emulator) -> None:
    # A model whose EOS is not its end-of-turn token writes past <|im_end|> unless asked to stop there.
    emulator.update(eos_token="<|endoftext|>", length="fixed:20")
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 60}}
    r = client.post("/generate", json=body).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert len(r["output_ids"]) == 60 and r["output_ids"][19] == 2  # <|im_end|> inside, then more text
    body["sampling_params"]["stop_token_ids"] = [2]
    r = client.post("/generate", json=body).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert len(r["output_ids"]) == 20 and r["output_ids"][-1] == 2  # output_ids keep the matched stop id
    emulator.update(eos_token=None)  # the end-of-turn token is the EOS: it always stops
    r = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 60}}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "stop" and len(r["output_ids"]) == 20


def test_unknown_sampling_keys_are_refused(client: httpx.Client) -> None:
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 5}})
    assert r.status_code == 400
    assert r.json()["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`")
    ok = {"max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "stop_token_ids": [2], "ignore_eos": False}
    assert client.post("/generate", json={"input_ids": [1], "sampling_params": ok}).status_code == 200
    # unknown top-level keys are ignored, as SGLang's contract says
    assert client.post("/generate", json={"input_ids": [1], "whatever": 1}).status_code == 200
    for bad in ({"top_p": 0.0}, {"temperature": -0.1}, {"max_new_tokens": -1}):  # SGLang's value checks
        r = client.post("/generate", json={"input_ids": [1], "sampling_params": bad})
        assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"]


def test_context_length_is_enforced(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(context_length=100)
    r = client.post("/generate", json={"input_ids": list(range(60)), "sampling_params": {"max_new_tokens": 41}})
    assert r.status_code == 400
    assert "maximum context length of 100 tokens" in r.json()["error"]["message"]
    r = client.post("/generate", json={"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "longer than the model's context length" in r.json()["error"]["message"]
    ok = {"input_ids": list(range(60)), "sampling_params": {"max_new_tokens": 40}}
    assert client.post("/generate", json=ok).status_code == 200
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 99}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_chat_max_tokens_over_the_models_output_cap(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(max_output_tokens=64)
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 65}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error_type"] == "max_tokens_exceeded" and "max_tokens" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64}, headers=AUTH).status_code == 200


def test_sglang_api_key_guards_everything_but_health(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(sglang_api_key="sglang-secret")
    for path in ("/generate", "/model_info", "/get_model_info", "/server_info"):
        method = client.post if path == "/generate" else client.get
        kwargs = {"json": {"input_ids": [1]}} if path == "/generate" else {}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = method(path, headers=headers, **kwargs)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert method(path, headers={"Authorization": "Bearer sglang-secret"}, **kwargs).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/health_generate").status_code == 200
    assert emulator.stats()["unauthorized"] == 8


def test_health_while_loading_and_slow_probes(client: httpx.Client, emulator: Emulator) -> None:
    emulator.update(loading=True)
    assert client.get("/health").status_code == 503 and client.get("/health_generate").status_code == 503
    assert generate(client, input_ids=[1])["output_ids"]  # warm-up requests are served meanwhile
    emulator.update(loading=False, health_s=0.3)
    t0 = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - t0 >= 0.3
    with pytest.raises(httpx.ReadTimeout):
        client.get("/health", timeout=0.1)


def test_generate_as_a_thinking_model(client: httpx.Client, emulator: Emulator, tokenizer: Tokenizer) -> None:
    """A thinking model's /generate output is one sequence: its think block, then the answer."""
    emulator.update(think=("<think>\n", "\n</think>\n\n"), reasoning_rate=1.0, split_rate=0.0,
                    reasoning_length="fixed:30", length="fixed:20")
    think, close = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    out = generate(client, input_ids=[9, 9])
    ids = out["output_ids"]
    assert ids[0] == think and ids.count(close) == 1 and ids[-1] == 2
    raw = tokenizer.decode(ids[:-1], skip_special_tokens=False)
    reasoning, _, answer = raw.removeprefix("<think>\n").partition("\n</think>\n\n")
    assert len(reasoning.split()) > 5 and len(answer.split()) > 3
    assert out["text"] == tokenizer.decode(ids[:-1], skip_special_tokens=True)  # special markers dropped
    assert tokenizer.encode(raw, add_special_tokens=False).ids == ids[:-1]  # the tokenizer's own encoding
    capped = generate(client, input_ids=[9, 9], max_new_tokens=10)
    assert capped["output_ids"] == ids[:10] and capped["meta_info"]["finish_reason"]["type"] == "length"
