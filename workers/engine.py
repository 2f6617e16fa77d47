"""What the GPU engine clients (SGLang, vLLM) share: one pooled HTTP client that carries the
server's API key, the health and readiness probes, and how an engine's HTTP answers map onto the
retry policy of ``backends.py``.

Failures are sorted by whose fault they are. A refused connection means the server is gone
(:class:`ServerDown`: retried, then the worker pauses; the prompt is never failed), and so does an
engine that answers that it died (:class:`EngineDead`: vLLM's ``EngineDeadError``, as HTTP 500, after
which its server exits); other 5xx, 408/429,
timeouts and cut connections are worth another try; 401/403 (a wrong key) and 404 (a wrong URL or
model) pause the worker until a person acts; any other 4xx is this prompt's fault (context too
long, a bad parameter) and fails it with the engine's own message.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import ClassVar, Protocol

import httpx
import msgspec

from draftfleet.broker import redact
from draftfleet.http import make_client
from draftfleet.schemas.config import ConfigError, Engine, EngineBackend
from draftfleet.schemas.records import PromptTask, Usage
from draftfleet.tokenizer import TargetTokenizer, TemplateError, TokenizerError
from draftfleet.workers.backends import Generation, Halt, Permanent, Transient, parse_retry_after

_decode = msgspec.json.decode
log = logging.getLogger("draftfleet.engine")
# vLLM's words when its engine core died (vllm.v1.engine.exceptions.EngineDeadError): the API server
# answers HTTP 500 {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for
# the root cause.", "type": "InternalServerError"}} and then shuts down.
_DEAD = re.compile(r"EngineDeadError|EngineCore encountered an issue")
_SAID = threading.Lock()  # guards EngineClient._said_pid


class ServerDown(Transient):
    """The server does not answer at all: the prompt is not at fault, so it is never failed."""


class EngineDead(ServerDown):
    """The engine answered that it died: a server going away (retried, then the worker pauses),
    never the prompt's fault nor a setting."""


class EngineProcess(Protocol):
    """A launched server (``launcher.EngineServer``): what its death was."""

    def death(self): ...


def engine_api_key(engine: Engine, settings: EngineBackend) -> str | None:
    """The server's ``--api-key``, read from the variable ``api_key_env`` names (None: no key)."""
    if settings.api_key_env is None:
        return None
    key = os.environ.get(settings.api_key_env, "")
    if not key:
        raise ConfigError(
            f"backends.{engine}.api_key_env: the environment variable {settings.api_key_env} is not set "
            "(it must hold the server's --api-key)"
        )
    return key


def error_message(resp: httpx.Response, limit: int = 300) -> str:
    """The engine's own words from an error body: ``{"error": {"message"}}`` (vLLM, SGLang),
    ``{"message"}`` (older vLLM) or ``{"detail"}`` (FastAPI), else the raw text."""
    try:
        body = _decode(resp.content)
    except msgspec.DecodeError:
        return resp.text[:limit]
    if isinstance(body, dict):
        err = body.get("error")
        for msg in (err.get("message") if isinstance(err, dict) else err, body.get("message"), body.get("detail")):
            if isinstance(msg, str) and msg:
                return msg[:limit]
    return resp.text[:limit]


class EngineClient:
    """An engine server for one GPU worker; subclasses send the request and read the answer.

    Many requests are kept open at once by the worker's threads, one pooled connection each:
    the engine batches them (continuous batching).
    """

    kind = "gpu"
    engine: ClassVar[Engine]
    health_path: ClassVar[str] = "/health"
    auth_probe_path: ClassVar[str]  # a cheap GET that needs the key (never /health*)
    # A probe slower than this counts as a failure. SGLang's /health runs a one-token generation
    # and takes up to 20 s under load, so its client raises this.
    health_timeout_s: ClassVar[float] = 10.0

    # The server this worker launched (None: attached by URL, its log is the server's own): what
    # its death was goes into the errors, and once per server process into the log in full.
    process: EngineProcess | None = None
    _said_pid: int | None = None

    def __init__(self, url: str, settings: EngineBackend, tokenizer: TargetTokenizer, *, inflight: int,
                 name: str | None = None):  # fmt: skip
        self.name = name or self.engine
        self.url = url.rstrip("/")
        self.endpoint = redact(self.url)
        self.concurrency = inflight
        self.tokenizer = tokenizer
        key = engine_api_key(self.engine, settings)
        self.client = make_client(
            inflight,
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.request_timeout_s,
            base_url=self.url,
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        self.model = ""

    def healthy(self) -> bool:
        """Whether the server answers its health check now (a paused worker resumes as soon as it does)."""
        try:
            return self.client.get(self.health_path, timeout=self.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers its health check, then learn the model it serves."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise ServerDown("server_down", f"{self.endpoint} did not answer {self.health_path} within {timeout:.0f}s")
            time.sleep(1.0)
        self.model = self.model_name()

    def model_name(self) -> str:
        """The model the server says it serves ("" when it does not say)."""
        raise NotImplementedError

    def post(self, path: str, body: dict) -> object:
        """POST ``body`` as JSON and return the decoded answer, or raise what the failure means."""
        try:
            resp = self.client.post(path, content=msgspec.json.encode(body), headers={"content-type": "application/json"})
        except httpx.ConnectError as exc:
            raise ServerDown("server_down", self.gone(f"{self.endpoint}: {exc}")) from None
        except httpx.TimeoutException:
            raise Transient("timeout", f"{self.endpoint} did not answer in time") from None
        except httpx.TransportError as exc:
            raise Transient("connection", f"{self.endpoint}: {type(exc).__name__}") from None
        status = resp.status_code
        if status >= 500 or status in (408, 429):
            message = error_message(resp, 200)
            if status == 500 and _DEAD.search(message):
                raise EngineDead("engine_dead", self.gone(f"{self.endpoint} answered that its engine died ({message})"))
            raise Transient(f"http_{status}", message, parse_retry_after(resp.headers.get("retry-after")))
        if status in (401, 403):
            raise Halt(f"http_{status}", f"{self.endpoint} refused the worker's key ({error_message(resp, 200)}): "
                       f"check backends.{self.engine}.api_key_env against the server's --api-key",
                       ready=self.authorized)
        if status == 404:  # a wrong URL or a model the server no longer serves: never one prompt's fault
            raise Halt("http_404", f"{self.endpoint}{path}: {error_message(resp, 200)}")
        if status != 200:
            raise self.rejected(resp)
        try:
            return _decode(resp.content)
        except msgspec.DecodeError:
            raise Transient("bad_body", "response is not JSON") from None

    def gone(self, what: str) -> str:
        """``what``, with the launched server's exit (the signal named) and the line of its log where
        the engine died; the first time for each server process, that and the log's last lines are
        logged in one line."""
        death = self.process.death() if self.process is not None else None
        if death is None or (death.code is None and not death.clue):  # not dead (starting again): nothing to add
            return what
        with _SAID:  # the worker's request threads meet the death at once: one says it
            first, self._said_pid = death.pid != self._said_pid, death.pid
        if first:
            log.error("%s died: %s", self.endpoint, death.line())
        return f"{what}: {death.headline()}"

    def rejected(self, resp: httpx.Response) -> Exception:
        """What a 4xx refusal of a request means: by default this prompt's fault (too long, ...)."""
        return Permanent(f"http_{resp.status_code}", error_message(resp))

    def authorized(self) -> bool:
        """Whether the server takes the worker's key now: a path behind the key answers other than
        401/403 (health paths need no key, so they cannot tell)."""
        try:
            return self.client.get(self.auth_probe_path, timeout=self.health_timeout_s).status_code not in (401, 403)
        except httpx.HTTPError:
            return False

    def prompt_ids(self, task: PromptTask) -> list[int]:
        """The ids the engine receives. Messages the chat template refuses fail this prompt; a
        template that does not parse pauses the worker (every prompt would fail alike)."""
        try:
            return self.tokenizer.prompt_ids(task.messages)
        except TemplateError as exc:
            raise Halt("chat_template", str(exc)) from None
        except TokenizerError as exc:
            raise Permanent("chat_template", str(exc)) from None

    def exact(self, task: PromptTask, prompt_ids: list[int], ids: list[int], finish: str, *, prompt_tokens: int,
              completion_tokens: int, cached_tokens: int) -> Generation:  # fmt: skip
        """One answer as the engine gave it: its ids stored as they are (``exact``), the text decoded
        from them and split at the template's reasoning markers."""
        text, reasoning = self.tokenizer.split_reasoning(task.messages, ids)
        return Generation(
            text=text,
            reasoning=reasoning,
            output_ids=ids,
            prompt_ids=prompt_ids,
            prompt_tokens=prompt_tokens,
            finish_reason=finish,
            truncated=finish == "length",
            token_source="exact",
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens),
            cost_usd=0.0,
            cost_source="none",
            model=self.model or task.settings.model,
        )

    def get_json(self, path: str) -> object:
        """GET ``path`` and decode it; None on any failure (for informational endpoints)."""
        try:
            resp = self.client.get(path, timeout=10.0)
            return _decode(resp.content) if resp.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError):
            return None

    def close(self) -> None:
        self.client.close()
