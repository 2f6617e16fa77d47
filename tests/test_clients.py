"""The engine and cloud clients against the emulator, as strict as the real servers: each test
is a behaviour of real SGLang or OpenRouter that the client once got wrong (the emulator copies
each one: draftfleet/devtools/emulator.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftfleet import redis_keys as rk
from draftfleet.schemas.config import CloudBackend, SGLangBackend
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.store import open_store
from draftfleet.workers.backends import Halt, Permanent, Transient
from draftfleet.workers.cloud import CloudChat
from draftfleet.workers.sglang import SGLangClient
from tests.conftest import run_cli, wait_until, write_config, write_jsonl
from tests.test_security import _dump_redis

KEY = "sk-or-v1-client-test-secret"
USER = [Message(role="user", content="explain how a queue works")]


def task(max_tokens: int = 64, text: str = "explain how a queue works") -> PromptTask:
    settings = GenerationSettings(model="test/chatml", max_tokens=max_tokens, temperature=0.7, top_p=1.0)
    return PromptTask(key="c" * 64, dataset="ds", source="f:1", messages=[Message(role="user", content=text)],
                      settings=settings, settings_id="s", enqueued_at=0.0)


@pytest.fixture
def cloud(emulator_factory, target_tokenizer):
    emu = emulator_factory(time_scale=0, api_key=KEY, length="fixed:20", retry_after_s=7)
    chat = CloudChat("cloudy", CloudBackend(base_url=emu.url + "/v1", model="vendor/model", api_key_env="K"),
                     target_tokenizer, KEY)
    yield emu, chat
    chat.close()


def test_cloud_null_error_in_a_success_is_not_an_error(cloud) -> None:
    emu, chat = cloud
    gen = chat.generate(task())
    assert gen.finish_reason == "stop" and len(gen.output_ids) == 20


def test_cloud_403_is_moderation_only_with_its_metadata(cloud) -> None:
    emu, chat = cloud
    emu.update(rate_moderation=1.0)
    with pytest.raises(Permanent) as moderated:
        chat.generate(task())
    assert moderated.value.reason == "moderation"
    emu.update(rate_moderation=0.0, rate_403=1.0)  # a guardrail or a key without permission: not the prompt's fault
    with pytest.raises(Halt) as blocked:
        chat.generate(task())
    assert blocked.value.reason == "forbidden" and "403" in str(blocked.value) and KEY not in str(blocked.value)


def test_cloud_max_tokens_exceeded_halts_naming_max_tokens(cloud) -> None:
    emu, chat = cloud
    emu.update(max_output_tokens=32)
    with pytest.raises(Halt) as exc:
        chat.generate(task(max_tokens=64))
    assert exc.value.reason == "max_tokens_exceeded" and "datasets" in str(exc.value) and "max_tokens" in str(exc.value)
    assert chat.generate(task(max_tokens=32)).output_ids


@pytest.mark.parametrize(("fault", "reason"), [("200_error", "http_502"), ("402_inflight", "in_flight_budget")])
def test_cloud_transient_errors_wait_as_long_as_they_say(cloud, fault: str, reason: str) -> None:
    """An in-body error says when to retry in metadata.retry_after_seconds; an in-flight 402 in Retry-After."""
    emu, chat = cloud
    emu.update(**{f"rate_{fault}": 1.0})
    with pytest.raises(Transient) as exc:
        chat.generate(task())
    assert exc.value.reason == reason and exc.value.retry_after == 7


def test_cloud_out_of_credits_halts(cloud) -> None:
    emu, chat = cloud
    emu.update(rate_402=1.0)
    with pytest.raises(Halt) as halted:
        chat.generate(task())
    assert halted.value.reason == "payment_required"


def test_cloud_byok_spend_adds_the_providers_charge(cloud) -> None:
    emu, chat = cloud
    emu.update(price_input_per_mtok=1000.0, price_output_per_mtok=2000.0)
    full = chat.generate(task()).cost_usd
    emu.update(byok=True)
    gen = chat.generate(task())
    assert gen.usage.is_byok and gen.usage.upstream_cost_usd == pytest.approx(full)
    assert gen.cost_usd == pytest.approx(full * 1.05)  # OpenRouter's 5% fee plus the provider's own bill


# -- SGLang ---------------------------------------------------------------------------------------

SGLANG_KEY = "sglang-client-test-secret"


def test_sglang_client_asks_model_info_not_the_deprecated_path(emulator_factory, target_tokenizer) -> None:
    emu = emulator_factory(time_scale=0)
    client = SGLangClient(emu.url, SGLangBackend(), target_tokenizer, inflight=2)
    try:
        client.wait_ready(10)
        assert client.model == "test/chatml"
        assert emu.stats()["deprecated"] == 0  # /get_model_info is deprecated in sglang 0.5.23
    finally:
        client.close()


class _OldSGLang(BaseHTTPRequestHandler):
    """An SGLang from before /model_info: only /get_model_info answers."""

    def do_GET(self) -> None:
        status, body = {"/health": (200, b""), "/get_model_info": (200, b'{"model_path": "old/model"}')}.get(
            self.path, (404, b'{"detail": "Not Found"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_sglang_client_falls_back_to_get_model_info_on_old_servers(target_tokenizer) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", SGLangBackend(), target_tokenizer, inflight=2)
    try:
        client.wait_ready(10)
        assert client.model == "old/model"
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_sglang_client_sends_the_key_and_a_refusal_halts_until_the_key_works(emulator_factory, target_tokenizer,
                                                                            monkeypatch) -> None:
    emu = emulator_factory(time_scale=0, sglang_api_key="not-the-workers-key", length="fixed:8")
    monkeypatch.setenv("H4_SGLANG_KEY", SGLANG_KEY)
    client = SGLangClient(emu.url, SGLangBackend(api_key_env="H4_SGLANG_KEY"), target_tokenizer, inflight=2)
    try:
        assert client.healthy()  # /health needs no key: the server looks fine while /generate refuses
        with pytest.raises(Halt) as refused:
            client.generate(task())
        assert refused.value.reason == "http_401" and SGLANG_KEY not in str(refused.value)
        assert refused.value.ready is not None and not refused.value.ready()
        emu.update(sglang_api_key=SGLANG_KEY)  # the operator fixes the server's --api-key (or the variable)
        assert refused.value.ready()
        assert client.generate(task()).output_ids[-1] == target_tokenizer.eot_id
    finally:
        client.close()


def test_gpu_worker_refused_by_sglang_pauses_and_resumes_once_the_key_works(tmp_path, redis_server, tokenizer_dir,
                                                                           emulator_factory, workers) -> None:
    emu = emulator_factory(time_scale=0, sglang_api_key="rotated-on-the-server", length="uniform:5:30")
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": f"explain item {i}"}]}
                                              for i in range(20)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=4,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}],
                          sglang_extra='api_key_env = "H4_SGLANG_KEY"')
    res = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    workers.start(config, "gpu", redis_url=redis_server.url, env={"H4_SGLANG_KEY": SGLANG_KEY})
    r = redis_server.client()
    wait_until(lambda: emu.stats()["unauthorized"] > 0, 60, 0.1, f"a 401\n{workers.logs()}")

    def paused() -> str | None:
        for key in r.scan_iter(rk.worker_report("*")):
            raw = r.get(key)
            if raw:
                return json.loads(raw).get("paused")
        return None

    wait_until(lambda: paused() == "http_401", 30, 0.1, f"a pause\n{workers.logs()}")
    store = open_store(str(tmp_path / "store"))
    assert not store.failures("ds") and not store.keys("ds")
    emu.update(sglang_api_key=SGLANG_KEY)
    t0 = time.monotonic()
    # resumed by its probe, well before the 30 s pause would end on its own
    wait_until(lambda: len(store.keys("ds")) == 20, 20, 0.2, f"20 results\n{workers.logs()}")
    assert time.monotonic() - t0 < 20 and not store.failures("ds")
    logs = workers.logs(tail=None)
    assert "STOPPED CONSUMING" in logs and "resuming after a pause" in logs and SGLANG_KEY not in logs
    # nor in what the fleet keeps: records, Redis (queues, reports, events)
    assert not any(SGLANG_KEY.encode() in f.read_bytes() for f in (tmp_path / "store").rglob("*") if f.is_file())
    assert SGLANG_KEY.encode() not in _dump_redis(r)


def test_sglang_client_waits_for_warm_up_and_for_a_slow_health_probe(emulator_factory, target_tokenizer) -> None:
    """/health answers 503 while SGLang warms up, and under load its one-token generation takes
    seconds (up to SGLANG_HEALTH_CHECK_TIMEOUT, 20 s): neither is a dead server."""
    emu = emulator_factory(time_scale=0, loading=True)
    client = SGLangClient(emu.url, SGLangBackend(), target_tokenizer, inflight=2)
    try:
        assert not client.healthy()
        threading.Timer(1.0, lambda: emu.update(loading=False, health_s=6.0)).start()
        t0 = time.monotonic()
        client.wait_ready(30)
        assert time.monotonic() - t0 >= 6.0 and client.model == "test/chatml"
    finally:
        client.close()


def test_sglang_max_tokens_over_the_context_halts_a_long_prompt_fails(emulator_factory, target_tokenizer) -> None:
    """SGLang refuses input + max_new_tokens over the context length with a 400. When max_tokens
    alone does not fit, every prompt of the dataset would fail: a setting, so the worker halts.
    Otherwise only this prompt is too long: it fails, under its own reason."""
    emu = emulator_factory(time_scale=0, context_length=100, length="fixed:8")
    client = SGLangClient(emu.url, SGLangBackend(), target_tokenizer, inflight=2)
    try:
        with pytest.raises(Halt) as halted:
            client.generate(task(max_tokens=128))
        assert halted.value.reason == "max_tokens_exceeded"
        assert "max_tokens" in str(halted.value) and "100" in str(halted.value)
        with pytest.raises(Permanent) as failed:
            client.generate(task(max_tokens=64, text="explain " * 60))
        assert failed.value.reason == "context_length" and "context length" in str(failed.value)
        assert client.generate(task(max_tokens=64)).output_ids
    finally:
        client.close()


def test_thinking_gpu_answer_splits_and_rebuilds_as_the_cloud_path(emulator_factory, target_tokenizer) -> None:
    """SGLang returns a thinking model's think block and answer as one sequence: the client splits
    it as the cloud APIs do, and the cloud path's ids for that (answer, reasoning) are the same ids."""
    emu = emulator_factory(time_scale=0, think=("<think>\n", "\n</think>\n\n"), reasoning_rate=1.0, split_rate=0.0,
                           length="uniform:5:40", reasoning_length="uniform:5:40")
    client = SGLangClient(emu.url, SGLangBackend(), target_tokenizer, inflight=2)
    try:
        for i in range(10):
            t = task(max_tokens=200, text=f"question {i}")
            gen = client.generate(t)
            assert gen.reasoning and gen.text and "<think>" not in gen.text + gen.reasoning
            assert target_tokenizer.completion_ids(t.messages, gen.text, gen.reasoning, stopped=True) == gen.output_ids
    finally:
        client.close()
