"""A loopback server that stands in for SGLang GPUs and an OpenAI-compatible cloud.

Tests, benchmarks and the demo point the fleet at it instead of a real SGLang server or
OpenRouter. It speaks the same protocols (SGLang's native ``/generate``, OpenAI's
``/v1/chat/completions`` with OpenRouter's usage and error shapes; see FORMATS.md), answers a
prompt with the same token ids every time, models how continuous batching shares decode
throughput among running requests, and injects the faults real backends produce (429, 5xx,
402, hangs, bodies cut short, aborts) at rates that can change while it runs.

It is a minimal HTTP/1.1 server on asyncio streams (request line, headers, Content-Length
bodies, keep-alive), built on the standard library, msgspec and tokenizers only, so that it
costs little CPU per request next to the client it is measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import logging
import math
import random
import signal
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
from tokenizers import Tokenizer

__all__ = ["FAULT_KINDS", "GENERATION_PATHS", "Emulator", "EmulatorConfig", "serve"]

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/chat/completions")
"""The endpoints that generate, count as open requests and take faults."""

FAULT_KINDS = ("429", "500", "503", "402", "200_error", "abort", "hang", "cut")
"""Fault kinds; each has a field ``rate_<kind>``. A request draws at most one, in this order."""

_IMMEDIATE_FAULTS = frozenset({"429", "500", "503", "402", "200_error", "abort"})
_MAX_HEAD = 1 << 20
_MAX_BODY = 64 << 20
_DISCONNECT_CHECK_S = 1.0  # how often to look for clients gone away (SGLang aborts their requests too)


class EmulatorConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the emulator serves and how; every field can change at run time.

    Times are model seconds; wall time is model time times ``time_scale`` (0 answers at once,
    skipping the batch model). ``hang_s`` and ``retry_after_s`` are wall seconds.
    """

    tokenizer: str  # a tokenizer folder holding tokenizer.json, or the file itself
    model: str = "draftfleet/emulated"
    end_of_turn: str = "<|im_end|>"
    seed: int = 0
    # Completion length in tokens, end-of-turn included: fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA.
    length: str = "lognormal:200:0.6"
    reasoning_rate: float = 0.0  # share of chat completions that also carry message.reasoning
    reasoning_length: str = "lognormal:120:0.5"
    # Continuous batching: each running request decodes at min(single_stream_tps, ceiling_tps / n).
    single_stream_tps: float = 90.0
    ceiling_tps: float = 5000.0
    max_running: int = 256  # requests beyond it wait for a slot
    ttft_s: float = 0.05  # prefill delay, drawn uniformly from [0, ttft_s] per request
    time_scale: float = 1.0
    # Cloud side: key checked on /v1/chat/completions (None: any bearer key), prices in USD.
    api_key: str | None = None
    price_input_per_mtok: float = 0.6
    price_output_per_mtok: float = 2.5
    # Faults, as probabilities per request (see FAULT_KINDS).
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_503: float = 0.0
    rate_402: float = 0.0
    rate_200_error: float = 0.0
    rate_abort: float = 0.0
    rate_hang: float = 0.0
    rate_cut: float = 0.0
    retry_after_s: float = 1.0  # Retry-After on 429 and 503 (sent as "1", or "0.5" for fast tests)
    hang_s: float = 3600.0  # how long a hung request is held before it is answered
    fault_endpoints: tuple[str, ...] = GENERATION_PATHS

    def __post_init__(self) -> None:
        _length_sampler(self.length)
        _length_sampler(self.reasoning_length)
        for name in ("reasoning_rate", *(f"rate_{kind}" for kind in FAULT_KINDS)):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        for name in ("single_stream_tps", "ceiling_tps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("ttft_s", "time_scale", "hang_s", "retry_after_s", "price_input_per_mtok",
                     "price_output_per_mtok"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        unknown = set(self.fault_endpoints) - set(GENERATION_PATHS)
        if unknown:
            raise ValueError(f"fault_endpoints: unknown {sorted(unknown)}; known: {list(GENERATION_PATHS)}")


def _length_sampler(spec: str) -> Callable[[random.Random], int]:
    """Parse a length distribution (``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA``)."""
    kind, *args = spec.split(":")
    try:
        nums = [float(a) for a in args]
    except ValueError:
        nums = []
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
        n = int(nums[0])
        return lambda rng: n
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
        lo, hi = int(nums[0]), int(nums[1])
        return lambda rng: rng.randint(lo, hi)
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        sigma = nums[1]
        mu = math.log(nums[0]) - sigma * sigma / 2  # so that the mean is MEAN
        return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))
    raise ValueError(f"length {spec!r}: expected fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA")


class _Vocab:
    """The tokenizer, its end-of-turn id, and the ids that decode alone to clean printable text.

    Byte-level BPE has tokens holding part of a UTF-8 sequence; drawn at random they decode to
    U+FFFD, so completions are drawn from the clean pool only and decode back without loss.
    """

    def __init__(self, path: str, end_of_turn: str) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(file))
        eot = self.tokenizer.token_to_id(end_of_turn)
        if eot is None:
            raise ValueError(f"end-of-turn token {end_of_turn!r} is not in {file}")
        self.eot: int = eot
        special = {i for i, tok in self.tokenizer.get_added_tokens_decoder().items() if tok.special}
        ids = [i for i in range(self.tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
        texts = self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
        self.pool = [i for i, text in zip(ids, texts, strict=True) if text and _clean(text)]
        if not self.pool:
            raise ValueError(f"{file}: no token decodes to clean text")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


def _clean(text: str) -> bool:
    return "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text)


class _Batcher:
    """Continuous batching in virtual time.

    Every decoding request advances at the same rate, which changes as requests join and
    leave, so the batcher keeps one number: the progress (tokens) a request decoding since the
    start would have made. A request joining at progress P with N tokens to go is done at
    P + N; one timer wakes at the earliest such point and is re-aimed on every change. That is
    exact where a fixed tick is not, and costs O(log n) per request rather than O(n) per tick.
    """

    def __init__(self, rate: Callable[[int], float]) -> None:
        self._rate = rate  # tokens per wall second for each of n decoding requests
        self._loop = asyncio.get_running_loop()
        self._progress = 0.0
        self._stamp = self._loop.time()
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    async def decode(self, n_tokens: int) -> None:
        """Return once ``n_tokens`` have been decoded at the batch's changing rate."""
        self._advance()
        entry = (self._progress + n_tokens, next(self._seq), self._loop.create_future())
        heapq.heappush(self._heap, entry)
        self._aim()
        try:
            await entry[2]
        except asyncio.CancelledError:
            if entry in self._heap:
                self._advance()
                self._heap.remove(entry)
                heapq.heapify(self._heap)
                self._aim()
            raise

    def sync(self) -> None:
        """Bank progress at the current rate and re-aim the timer (call around a rate change)."""
        self._advance()
        self._finish_due()
        self._aim()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _advance(self) -> None:
        now = self._loop.time()
        if self._heap:
            if now > self._stamp:
                self._progress += (now - self._stamp) * self._rate(len(self._heap))
        else:
            self._progress = 0.0  # only differences matter; keeps it finite and precise
        self._stamp = now

    def _finish_due(self) -> None:
        while self._heap and self._heap[0][0] <= self._progress + 1e-6:
            fut = heapq.heappop(self._heap)[2]
            if not fut.done():
                fut.set_result(None)

    def _aim(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._heap:
            delay = (self._heap[0][0] - self._progress) / self._rate(len(self._heap))
            self._timer = self._loop.call_later(max(delay, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.sync()


class _Reply(NamedTuple):
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    cut: bool = False  # announce the whole body, send half, close


class _HttpError(Exception):
    """A request the emulator refuses, with the reply to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.reply = _Reply(status, _error_body(status, message))


class _SamplingParams(msgspec.Struct):
    max_new_tokens: int = 128  # SGLang's default


class _GenerateRequest(msgspec.Struct):
    """One SGLang ``/generate`` request (batches, a list of prompts, are refused)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: _SamplingParams = msgspec.field(default_factory=_SamplingParams)
    rid: str | None = None


class _ChatRequest(msgspec.Struct):
    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_encode = msgspec.json.Encoder().encode
_encode_sorted = msgspec.json.Encoder(order="sorted").encode
_decode_generate = msgspec.json.Decoder(_GenerateRequest).decode
_decode_chat = msgspec.json.Decoder(_ChatRequest).decode
_decode_any = msgspec.json.decode

_REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 404: "Not Found",
    405: "Method Not Allowed", 413: "Content Too Large", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
    503: "Service Unavailable",
}
_FAULT_ERRORS = {  # kind: (HTTP status, error code, message, metadata)
    "429": (429, 429, "Rate limit exceeded (emulated)", None),
    "500": (500, 500, "Internal server error (emulated)", None),
    "503": (503, 503, "No available provider (emulated)", None),
    "402": (402, 402, "Insufficient credits", {"limit_source": "openrouter_credits"}),
    "200_error": (200, 502, "Provider returned error (emulated)", None),
}


def _error_body(code: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    """OpenRouter's error shape: ``{"error": {"code", "message", "metadata"?}}``."""
    error: dict[str, Any] = {"code": code, "message": message}
    if metadata is not None:
        error["metadata"] = metadata
    return _encode({"error": error})


def _json(obj: Any) -> _Reply:
    return _Reply(200, _encode(obj))


def _chatml(messages: list[dict[str, Any]]) -> str:
    """Render messages as ChatML with the generation prompt, to count prompt tokens."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', '')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


T = TypeVar("T")
_Handler = Callable[[dict[str, str], bytes, float], Awaitable[_Reply]]


class _App:
    """The emulator on one event loop: HTTP server, batch slots and scheduler, faults, stats."""

    def __init__(self, config: EmulatorConfig) -> None:
        self._vocab = _Vocab(config.tokenizer, config.end_of_turn)
        self._chance = random.Random(f"chance:{config.seed}")  # faults and prefill jitter
        self._apply(config)
        self._routes: dict[str, tuple[str, _Handler]] = {
            "/generate": ("POST", self._generate),
            "/v1/chat/completions": ("POST", self._chat),
            "/health": ("GET", self._health),
            "/health_generate": ("GET", self._health),
            "/get_model_info": ("GET", self._model_info),
            "/get_server_info": ("GET", self._server_info),
            "/v1/models": ("GET", self._models),
            "/emulator/stats": ("GET", self._stats_route),
            "/emulator/reset_stats": ("POST", self._reset_route),
            "/emulator/config": ("POST", self._config_route),
        }
        self._server: asyncio.Server | None = None
        self._batcher: _Batcher | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._inflight: dict[asyncio.Task[Any], asyncio.StreamReader] = {}
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._running = 0
        self._open = 0
        self._ids = itertools.count(1)
        self.url = ""
        self.reset_stats()

    # --- configuration and stats -------------------------------------------------------

    def _apply(self, config: EmulatorConfig) -> None:
        self.config = config
        self._length = _length_sampler(config.length)
        self._reasoning_length = _length_sampler(config.reasoning_length)
        rates = [(kind, getattr(config, f"rate_{kind}")) for kind in FAULT_KINDS]
        self._fault_table = [(kind, rate) for kind, rate in rates if rate > 0]

    def update(self, fields: dict[str, Any]) -> EmulatorConfig:
        """Validate and apply a subset of config fields (raises ValueError when invalid)."""
        try:
            config = msgspec.convert({**msgspec.structs.asdict(self.config), **fields}, EmulatorConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None
        if (config.tokenizer, config.end_of_turn) != (self.config.tokenizer, self.config.end_of_turn):
            self._vocab = _Vocab(config.tokenizer, config.end_of_turn)
        if self._batcher is not None:
            self._batcher.sync()  # bank progress made at the old rate
        self._apply(config)
        if self._batcher is not None:
            self._batcher.sync()
        self._admit()
        return config

    def reset_stats(self) -> None:
        self._counts: Counter[str] = Counter()
        self._by_endpoint: Counter[str] = Counter()
        self._by_status: Counter[str] = Counter()
        self._faults: Counter[str] = Counter({kind: 0 for kind in FAULT_KINDS})
        self._peak_running = self._running
        self._max_open = self._open

    def stats(self) -> dict[str, Any]:
        return {
            "requests_total": self._counts["requests_total"],
            "by_endpoint": dict(self._by_endpoint),
            "by_status": dict(self._by_status),
            "open": self._open,
            "max_concurrent_open": self._max_open,
            "running": self._running,
            "peak_running": self._peak_running,
            "waiting": len(self._waiting),
            "completed": self._counts["completed"],
            "tokens_generated": self._counts["tokens_generated"],
            "prompt_tokens": self._counts["prompt_tokens"],
            "faults": dict(self._faults),
            "unauthorized": self._counts["unauthorized"],
            "disconnected": self._counts["disconnected"],
        }

    # --- server lifecycle --------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        self._batcher = _Batcher(self._rate)
        self._server = await asyncio.start_server(self._connection, host, port, limit=_MAX_HEAD, backlog=4096)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._watcher = asyncio.create_task(self._watch_disconnects())

    async def close(self) -> None:
        """Stop listening and end every connection, hung requests included."""
        if self._server is not None:
            self._server.close()
        tasks = [*self._connections, *([self._watcher] if self._watcher is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._batcher is not None:
            self._batcher.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _watch_disconnects(self) -> None:
        """Cancel generation requests whose client went away, as SGLang aborts them."""
        while True:
            await asyncio.sleep(_DISCONNECT_CHECK_S)
            for task, reader in list(self._inflight.items()):
                if reader.at_eof():
                    self._counts["disconnected"] += 1
                    task.cancel()

    # --- HTTP/1.1 ------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    writer.write(_head(_Reply(431), keep_alive=False))
                    return
                try:
                    method, path, headers, keep_alive = _parse_head(head)
                    length = _content_length(headers)
                except _HttpError as exc:
                    writer.write(_head(exc.reply, keep_alive=False) + exc.reply.body)
                    return
                body = await reader.readexactly(length) if length else b""
                reply = await self._dispatch(method, path, headers, body, task, reader)
                self._by_status[str(reply.status)] += 1
                if reply.cut:
                    writer.write(_head(reply, keep_alive=True) + reply.body[: len(reply.body) // 2])
                    await writer.drain()
                    return
                writer.write(_head(reply, keep_alive) + reply.body)
                await writer.drain()
                if not keep_alive:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _dispatch(
        self, method: str, path: str, headers: dict[str, str], body: bytes,
        task: asyncio.Task[Any], reader: asyncio.StreamReader,
    ) -> _Reply:
        """Route a request; generation requests count as open and can be cancelled on disconnect."""
        t0 = time.monotonic()
        self._counts["requests_total"] += 1
        route = self._routes.get(path)
        self._by_endpoint[path if route else "other"] += 1
        if route is None:
            return _Reply(404, _error_body(404, f"no route {path}"))
        if method != route[0]:
            return _Reply(405, _error_body(405, f"{path} takes {route[0]}"))
        generating = path in GENERATION_PATHS
        if generating:
            self._inflight[task] = reader
            self._open += 1
            self._max_open = max(self._max_open, self._open)
        try:
            return await route[1](headers, body, t0)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return _Reply(400, _error_body(400, str(exc)))
        except Exception as exc:  # an emulator bug: answer, and leave the traceback in the log
            log.exception("emulator: %s %s failed", method, path)
            return _Reply(500, _error_body(500, f"emulator error: {exc!r}"))
        finally:
            if generating:
                self._open -= 1
                self._inflight.pop(task, None)

    # --- generation ----------------------------------------------------------------------

    def _draw(self, key: bytes, cap: int | None, reasoning: bool) -> tuple[list[int], list[int], bool]:
        """The deterministic completion of a prompt: reasoning ids, answer ids, whether it stopped.

        All lengths are drawn before any id, so a lower cap yields a prefix of the same ids.
        The answer ends with the end-of-turn id when it stopped; a capped one does not.
        """
        digest = hashlib.blake2b(b"%d\0" % self.config.seed + key, digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest))
        n_answer = self._length(rng)
        thinks = reasoning and rng.random() < self.config.reasoning_rate
        n_reasoning = self._reasoning_length(rng) if thinks else 0
        room = n_reasoning + n_answer if cap is None else max(cap, 0)
        pool = self._vocab.pool
        reasoning_ids = rng.choices(pool, k=min(n_reasoning, room))
        room -= len(reasoning_ids)
        answer = rng.choices(pool, k=min(n_answer - 1, room))
        stopped = n_answer <= room
        if stopped:
            answer.append(self._vocab.eot)
        return reasoning_ids, answer, stopped

    def _fault(self, path: str) -> str | None:
        """Draw this request's fault, if any (not tied to the prompt: faults come by chance)."""
        if not self._fault_table or path not in self.config.fault_endpoints:
            return None
        u = self._chance.random()
        edge = 0.0
        for kind, rate in self._fault_table:
            edge += rate
            if u < edge:
                self._faults[kind] += 1
                return kind
        return None

    def _fault_reply(self, kind: str) -> _Reply:
        status, code, message, metadata = _FAULT_ERRORS[kind]
        headers = (("Retry-After", f"{self.config.retry_after_s:g}"),) if status in (429, 503) else ()
        return _Reply(status, _error_body(code, message, metadata), headers)

    def _rate(self, n_decoding: int) -> float:
        """Tokens per wall second for each of ``n_decoding`` requests."""
        cfg = self.config
        if cfg.time_scale == 0:
            return math.inf
        return min(cfg.single_stream_tps, cfg.ceiling_tps / n_decoding) / cfg.time_scale

    async def _occupy(self, n_tokens: int) -> None:
        """Wait for a batch slot, prefill, then decode ``n_tokens`` at the batch's shared rate."""
        if self.config.time_scale == 0:
            return
        await self._acquire()
        try:
            prefill = self._chance.uniform(0.0, self.config.ttft_s) * self.config.time_scale
            if prefill > 0:
                await asyncio.sleep(prefill)
            assert self._batcher is not None
            await self._batcher.decode(n_tokens)
        finally:
            self._running -= 1
            self._admit()

    async def _acquire(self) -> None:
        if self._running < self.config.max_running and not self._waiting:
            self._take_slot()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiting.remove(fut)
            else:  # granted a slot, then cancelled before using it
                self._running -= 1
                self._admit()
            raise

    def _take_slot(self) -> None:
        self._running += 1
        self._peak_running = max(self._peak_running, self._running)

    def _admit(self) -> None:
        while self._waiting and self._running < self.config.max_running:
            fut = self._waiting.popleft()
            if not fut.done():
                self._take_slot()
                fut.set_result(None)

    def _account(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._counts["completed"] += 1
        self._counts["prompt_tokens"] += prompt_tokens
        self._counts["tokens_generated"] += completion_tokens

    async def _generate(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """SGLang ``/generate``: exact output ids, the end-of-turn id last when it stopped."""
        req = _decode_generate(body)
        if req.input_ids is not None:
            key = b"i" + _encode(req.input_ids)
            prompt_tokens = len(req.input_ids)
        elif req.text is not None:
            key = b"t" + req.text.encode()
            prompt_tokens = self._vocab.count(req.text)
        else:
            raise ValueError("either text or input_ids must be given")
        rid = req.rid or uuid.uuid4().hex
        fault = self._fault("/generate")
        if fault == "abort":
            return _json({
                "text": "", "output_ids": [],
                "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": "Abort request (emulated)"},
                    "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
                    "e2e_latency": time.monotonic() - t0,
                },
            })
        if fault in _IMMEDIATE_FAULTS:
            return self._fault_reply(fault)
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        max_new = req.sampling_params.max_new_tokens
        _, ids, stopped = self._draw(key, max_new, reasoning=False)
        await self._occupy(len(ids))
        self._account(prompt_tokens, len(ids))
        if stopped:
            finish: dict[str, Any] = {"type": "stop", "matched": self._vocab.eot}
        else:
            finish = {"type": "length", "length": max_new}
        payload = {
            "text": self._vocab.decode(ids[:-1] if stopped else ids),
            "output_ids": ids,
            "meta_info": {
                "id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": time.monotonic() - t0,
            },
        }
        return _Reply(200, _encode(payload), cut=fault == "cut")

    async def _chat(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """OpenAI chat completions with OpenRouter's usage accounting and error shapes."""
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            self._counts["unauthorized"] += 1
            return _Reply(401, _error_body(401, "No auth credentials found"))
        if self.config.api_key is not None and auth[7:].strip() != self.config.api_key:
            self._counts["unauthorized"] += 1
            return _Reply(401, _error_body(401, "User not found."))
        req = _decode_chat(body)
        if not req.messages:
            raise ValueError("messages must not be empty")
        prompt_tokens = self._vocab.count(_chatml(req.messages))
        model = req.model or self.config.model
        created = int(time.time())
        gen_id = f"gen-{created}-{next(self._ids)}"
        fault = self._fault("/v1/chat/completions")
        if fault == "abort":  # OpenRouter reports a mid-generation failure as finish_reason "error"
            return _json(self._completion(gen_id, created, model, "", None, "error", prompt_tokens, 0, 0))
        if fault in _IMMEDIATE_FAULTS:
            return self._fault_reply(fault)
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        cap = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        reasoning_ids, answer, stopped = self._draw(b"m" + _encode_sorted(req.messages), cap, reasoning=True)
        n = len(reasoning_ids) + len(answer)
        await self._occupy(n)
        self._account(prompt_tokens, n)
        content = self._vocab.decode(answer[:-1] if stopped else answer)
        reasoning = self._vocab.decode(reasoning_ids) if reasoning_ids else None
        payload = self._completion(
            gen_id, created, model, content, reasoning, "stop" if stopped else "length",
            prompt_tokens, n, len(reasoning_ids),
        )
        return _Reply(200, _encode(payload), cut=fault == "cut")

    def _completion(
        self, gen_id: str, created: int, model: str, content: str, reasoning: str | None,
        finish_reason: str, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning"] = reasoning
        price_in, price_out = self.config.price_input_per_mtok, self.config.price_output_per_mtok
        cost = prompt_tokens * price_in / 1e6 + completion_tokens * price_out / 1e6
        return {
            "id": gen_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "cost": cost, "is_byok": False,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "cost_details": {"upstream_inference_cost": None},
            },
        }

    # --- the other routes ----------------------------------------------------------------

    async def _health(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        return _Reply(200)

    async def _model_info(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        cfg = self.config
        return _json({"model_path": cfg.model, "tokenizer_path": cfg.tokenizer, "is_generation": True})

    async def _server_info(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        cfg = self.config
        return _json({
            "version": "draftfleet-emulator", "model_path": cfg.model, "tokenizer_path": cfg.tokenizer,
            "max_running_requests": cfg.max_running, "skip_tokenizer_init": False,
            "emulator": {"single_stream_tps": cfg.single_stream_tps, "ceiling_tps": cfg.ceiling_tps,
                         "time_scale": cfg.time_scale, "length": cfg.length},
        })

    async def _models(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        model = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "draftfleet-emulator"}
        return _json({"object": "list", "data": [model]})

    async def _stats_route(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        return _json(self.stats())

    async def _reset_route(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self.reset_stats()
        return _json(self.stats())

    async def _config_route(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        fields = _decode_any(body) if body else {}
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object of config fields")
        config = msgspec.structs.asdict(self.update(fields))
        if config["api_key"] is not None:
            config["api_key"] = "<set>"  # keys never leave in a response
        return _json(config)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str], bool]:
    """Request line and headers: method, path (query dropped), lower-cased headers, keep-alive."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpError(400, "malformed request line")
    method, target, version = parts
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return method, target.split("?", 1)[0], headers, keep_alive


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _HttpError(501, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _HttpError(400, "bad Content-Length") from None
    if not 0 <= length <= _MAX_BODY:
        raise _HttpError(413, "request body too large")
    return length


def _head(reply: _Reply, keep_alive: bool) -> bytes:
    """Status line and headers; the body announced is always the whole of ``reply.body``."""
    lines = [
        f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, '')}",
        "Content-Type: application/json",
        f"Content-Length: {len(reply.body)}",
    ]
    lines.extend(f"{name}: {value}" for name, value in reply.headers)
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Emulator:
    """The emulator on a daemon thread with its own event loop, for tests and benchmarks.

    ``with Emulator(config) as emu: httpx.post(emu.url + "/generate", ...)``. ``stats``,
    ``update`` and ``reset_stats`` may be called from any thread.
    """

    def __init__(self, config: EmulatorConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self._app = _App(config)
        self._host = host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` once started."""
        return self._app.url

    @property
    def config(self) -> EmulatorConfig:
        return self._app.config

    def start(self) -> Emulator:
        """Start serving; returns once the socket listens."""
        if self._thread is not None:
            raise RuntimeError("emulator already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name="draftfleet-emulator", daemon=True
        )
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._app.start(self._host, self._port))
        except BaseException as exc:
            failure.append(exc)
            loop.close()
            ready.set()
            return
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
            loop.run_until_complete(self._app.close())
        finally:
            loop.close()

    def stop(self) -> None:
        """Close every connection (hung requests too) and end the thread."""
        if self._thread is None:
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None
        self._loop = None

    def stats(self) -> dict[str, Any]:
        """Counters: see ``GET /emulator/stats``."""
        return self._call(self._app.stats)

    def reset_stats(self) -> None:
        self._call(self._app.reset_stats)

    def update(self, **fields: Any) -> EmulatorConfig:
        """Change any config fields while running (ValueError when invalid)."""
        return self._call(lambda: self._app.update(fields))

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the emulator's loop (its state belongs to that thread)."""
        loop = self._loop
        if loop is None or threading.current_thread() is self._thread:
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result()

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config: EmulatorConfig, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Serve in the foreground until SIGINT or SIGTERM; prints the URL once listening."""

    async def main() -> None:
        app = _App(config)
        await app.start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(app.url, flush=True)
        try:
            await stop.wait()
        finally:
            await app.close()

    asyncio.run(main())
