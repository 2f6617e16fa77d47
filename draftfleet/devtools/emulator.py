"""A loopback server that stands in for SGLang GPUs and an OpenAI-compatible cloud.

Tests, benchmarks and the demo point the fleet at it instead of a real SGLang server or
OpenRouter. It speaks the same protocols (SGLang's native ``/generate``, OpenAI's
``/v1/chat/completions`` with OpenRouter's usage and error shapes), answers a
prompt with the same token ids every time, models how continuous batching shares decode
throughput among running requests, and injects the faults real backends produce (429, 5xx,
402, 403, hangs, bodies cut short, aborts) at rates that can change while it runs.

It is as strict as the real servers (sglang 0.5.23, OpenRouter): unknown sampling keys, input
beyond the context length and a missing ``--api-key`` bearer are refused with their status codes
and error bodies; a generation stops only on the request's stop ids and the model's EOS; the
output ids are the tokenizer's encoding of natural text, a few of them split as sampled models
split words, so decode -> encode round trips as often as a real model's output does.

It is a minimal HTTP/1.1 server on asyncio streams (request line, headers, Content-Length
bodies, keep-alive), built on the standard library, msgspec and tokenizers only, so that it
costs little CPU per request next to the client it is measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
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

__all__ = ["FAULT_KINDS", "FAULT_PATHS", "GENERATION_PATHS", "SGLANG_SAMPLING_KEYS", "Emulator", "EmulatorConfig", "serve"]

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/chat/completions")
"""The endpoints that generate, count as open requests and take faults."""

FAULT_KINDS = ("429", "500", "503", "402", "402_inflight", "403", "moderation", "200_error", "abort", "empty", "hang",
               "cut")
"""Fault kinds; each has a field ``rate_<kind>``. A request draws at most one, in this order, among
the kinds its endpoint really produces (``FAULT_PATHS``)."""

_SGLANG, _CHAT = GENERATION_PATHS
FAULT_PATHS: dict[str, frozenset[str]] = {
    # SGLang itself never sends 429 (RELIABILITY.md, fault 4): on /generate it comes only from a proxy (``proxy``).
    "429": frozenset({_CHAT}),
    "500": frozenset(GENERATION_PATHS),
    "503": frozenset(GENERATION_PATHS),
    "402": frozenset({_CHAT}),
    "402_inflight": frozenset({_CHAT}),
    "403": frozenset({_CHAT}),
    "moderation": frozenset({_CHAT}),
    "200_error": frozenset({_CHAT}),
    "abort": frozenset(GENERATION_PATHS),
    "empty": frozenset({_CHAT}),
    "hang": frozenset(GENERATION_PATHS),
    "cut": frozenset(GENERATION_PATHS),
}
"""Where each fault kind can happen: OpenRouter's payment, permission and in-body errors never
come from SGLang."""

# The keys SGLang's /generate accepts in sampling_params (sglang 0.5.23, api/v1/api_types.py
# SamplingParams: "unknown keys rejected" with HTTP 400).
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)
_SGLANG_PATHS = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"})
_DEPRECATED = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}

_MAX_HEAD = 1 << 20
_MAX_BODY = 64 << 20
_DISCONNECT_CHECK_S = 1.0  # how often to look for clients gone away (SGLang aborts their requests too)


class EmulatorConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the emulator serves and how; every field can change at run time.

    Times are model seconds; wall time is model time times ``time_scale`` (0 answers at once,
    skipping the batch model). ``hang_s``, ``health_s`` and ``retry_after_s`` are wall seconds.
    """

    tokenizer: str  # a tokenizer folder holding tokenizer.json, or the file itself
    model: str = "draftfleet/emulated"
    end_of_turn: str = "<|im_end|>"  # what the model writes when its turn ends
    eos_token: str | None = None  # the model's EOS, a stop token on every request (None: end_of_turn)
    seed: int = 0
    # Completion length in tokens, end-of-turn included: fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA.
    length: str = "lognormal:200:0.6"
    reasoning_rate: float = 0.0  # share of completions that reason first (chat: message.reasoning)
    reasoning_length: str = "lognormal:120:0.5"
    # /generate of a thinking model: what it writes before and after its reasoning, in one sequence
    # with the answer (Qwen3: ["<think>\n", "\n</think>\n\n"]; Kimi-K2.5, whose generation prompt
    # already opened the block: ["", "</think>"]). None: /generate never reasons.
    think: tuple[str, str] | None = None
    # Share of completions in which the model writes one word split into tokens its tokenizer would
    # not choose, as sampled models do: their ids do not survive decode -> encode (the seed: 0.5-6.5%).
    split_rate: float = 0.03
    context_length: int = 32768  # input + max_new_tokens (SGLang) or max_tokens (chat) beyond it: 400
    max_output_tokens: int | None = None  # the cloud model's output cap: a larger max_tokens is a 400
    # Continuous batching: each running request decodes at min(single_stream_tps, ceiling_tps / n).
    single_stream_tps: float = 90.0
    ceiling_tps: float = 5000.0
    max_running: int = 256  # requests beyond it wait for a slot
    ttft_s: float = 0.05  # prefill delay, drawn uniformly from [0, ttft_s] per request
    time_scale: float = 1.0
    # SGLang side: --api-key (every path but /health*, /ready, /metrics needs it); still warming
    # up (/health answers 503); how long a /health probe takes (it runs a one-token generation).
    sglang_api_key: str | None = None
    loading: bool = False
    health_s: float = 0.0
    proxy: bool = False  # a proxy in front of /generate: 429s there, and Retry-After on its 429/503
    # Cloud side: key checked on /v1/chat/completions (None: any bearer key), prices in USD.
    api_key: str | None = None
    byok: bool = False  # usage as OpenRouter reports a bring-your-own-key request
    price_input_per_mtok: float = 0.6
    price_output_per_mtok: float = 2.5
    # Faults, as probabilities per request (see FAULT_KINDS and FAULT_PATHS).
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_503: float = 0.0
    rate_402: float = 0.0
    rate_402_inflight: float = 0.0
    rate_403: float = 0.0
    rate_moderation: float = 0.0
    rate_200_error: float = 0.0
    rate_abort: float = 0.0
    rate_empty: float = 0.0  # chat: tokens generated and billed, the message empty (hidden reasoning)
    rate_hang: float = 0.0
    rate_cut: float = 0.0
    retry_after_s: float = 1.0  # Retry-After (sent as "1", or "0.5" for fast tests) and retry_after_seconds
    hang_s: float = 3600.0  # how long a hung request is held before it is answered
    fault_endpoints: tuple[str, ...] = GENERATION_PATHS
    # OpenAI-shaped batch API (emulator_batch.py), in model seconds: validating, then the requests one
    # after another, finalizing; "24h" lasts batch_window_s (unfinished requests then expire); a cancel
    # stays cancelling for batch_cancelling_s. Limits are OpenAI's (50,000 requests, 200 MB per file).
    batch_validating_s: float = 1.0
    batch_request_s: float = 0.05
    batch_finalizing_s: float = 1.0
    batch_cancelling_s: float = 1.0
    batch_window_s: float = 86400.0
    batch_max_requests: int = 50_000
    batch_max_file_bytes: int = 200_000_000
    batch_price_factor: float = 0.5  # the batch price as a share of price_*_per_mtok, in usage.cost
    rate_batch_request_error: float = 0.0  # share of batch requests answered 500 in the error file
    # Faults of the batch endpoints themselves (emulator_batch.py, BATCH_FAULT_CALLS and _KINDS), none
    # by default: "CALL:KIND[:N]" (the next N calls of CALL, default 1) or "CALL:KIND:P%" (each call
    # with chance P%), e.g. ("create:429:2", "create:lost", "content:503", "get:500:10%"). Entries of
    # one call take turns in order: each call draws from the first one still armed. Setting the field
    # (update) arms it afresh. 429 and 503 carry Retry-After: retry_after_s; "hang" holds the reply
    # hang_s after the call is applied.
    batch_faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _length_sampler(self.length)
        _length_sampler(self.reasoning_length)
        for name in ("reasoning_rate", "split_rate", "rate_batch_request_error",
                     *(f"rate_{kind}" for kind in FAULT_KINDS)):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        for name in ("single_stream_tps", "ceiling_tps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("ttft_s", "time_scale", "hang_s", "health_s", "retry_after_s", "price_input_per_mtok",
                     "price_output_per_mtok", "batch_validating_s", "batch_request_s", "batch_finalizing_s",
                     "batch_cancelling_s", "batch_window_s", "batch_price_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.batch_max_requests < 1 or self.batch_max_file_bytes < 1:
            raise ValueError("batch_max_requests and batch_max_file_bytes must be at least 1")
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        if self.context_length < 2:
            raise ValueError("context_length must be at least 2")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")
        if self.batch_faults:
            from draftfleet.devtools.emulator_batch import parse_batch_faults

            parse_batch_faults(self.batch_faults)  # a ValueError naming the bad entry
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


# Words the emulated model writes with: prose about code and data, as the fleet's prompts ask for.
_LEXICON = tuple("""
the a of to and in is it that for on with as this be are or from at an not have but can will you we
your when which each one all if then so more than into out only also just how what why where first
next last new same other some many few every most both here there now use used using make makes write
writes read reads call calls return returns run runs keep keeps take takes give gives show shows find
finds check checks start starts stop stops need needs code function value list string number python
class object method test data file line error loop index array map filter query model token train batch
queue worker budget cloud server request response result record field key table step case type name
path time memory cache speed order count size length input output example simple fast small large
""".split())
_FILLERS = (" the", " a", " and", " to", " of", " it", " is", " in")  # when no word is one token
_SENTENCE_ENDS = (".", ".", ".", ".", "?", ":")


class _Vocab:
    """The tokenizer, its end-of-turn and EOS ids, and a speaker of natural text.

    Completions are ids of real text (sentences of common words), each the tokenizer's own
    encoding of that text, so they decode and re-encode as a model's output does; ``split``
    makes the few that a sampled model writes in a split the tokenizer would not choose.
    """

    def __init__(self, path: str, end_of_turn: str, eos_token: str | None) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(file))
        self.eot: int = self._special(end_of_turn, file)
        self.eos: int = self._special(eos_token, file) if eos_token is not None else self.eot
        costs = self.tokenizer.encode_batch([" " + w for w in _LEXICON], add_special_tokens=False)
        self._cost = {w: len(e.ids) for w, e in zip(_LEXICON, costs, strict=True)}
        self._long = [w for w in _LEXICON if len(w) >= 4]
        # Words of one token each, to top a completion up to its exact length.
        self._fillers = [" " + w for w in _LEXICON if self._cost[w] == 1] or list(_FILLERS)

    def _special(self, token: str, file: Path) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise ValueError(f"token {token!r} is not in {file}")
        return tid

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _prose(self, rng: random.Random, n: int, lead_space: bool) -> Any:
        """The encoding of sentences at least ``n`` tokens long."""
        text = ""
        while True:
            budget = 0
            while budget < n + 8:
                words = rng.choices(_LEXICON, k=rng.randint(4, 16))
                budget += sum(self._cost[w] for w in words) + 1
                sentence = " " + words[0].capitalize() + "".join(
                    (", " if rng.random() < 0.08 else " ") + w for w in words[1:]) + rng.choice(_SENTENCE_ENDS)
                if text and rng.random() < 0.15:
                    sentence = "\n\n" + sentence[1:]
                text += sentence
            encoding = self.tokenizer.encode(text if lead_space else text[1:], add_special_tokens=False)
            if len(encoding.ids) >= n:
                return encoding

    def natural(self, rng: random.Random, n: int, lead_space: bool = False) -> list[int]:
        """``n`` ids of natural text, the tokenizer's own encoding of it (ends on a whole word)."""
        if n <= 0:
            return []
        ids: list[int] = []
        for _ in range(8):
            encoding = self._prose(rng, n, lead_space)
            ids, words = encoding.ids, encoding.word_ids
            cut = n  # back off to a word boundary, then top up with short words
            while 0 < cut < len(ids) and words[cut] is not None and words[cut] == words[cut - 1]:
                cut -= 1
            text = self.tokenizer.decode(ids[:cut], skip_special_tokens=False)
            text += "".join(rng.choice(self._fillers) for _ in range(n - cut))
            if not lead_space:
                text = text.lstrip(" ")
            out = self._encode(text)
            if len(out) == n:
                return out
        return ids[:n]

    def thinking(self, markers: tuple[str, str], reasoning: list[int], answer: list[int], canonical: bool) -> list[int]:
        """A thinking model's output: ``open reasoning close answer`` as one text, the tokenizer's own
        encoding of it (markers that are special tokens become their ids). An answer holding an
        unnatural split (not ``canonical``) keeps its ids after the encoded think block."""
        raw = self.tokenizer.decode
        text = markers[0] + raw(reasoning, skip_special_tokens=False) + markers[1]
        if canonical:
            return self._encode(text + raw(answer, skip_special_tokens=False))
        return self._encode(text) + answer

    def split(self, rng: random.Random) -> list[int] | None:
        """A word written in two pieces the tokenizer would merge differently (not its own encoding)."""
        for _ in range(32):
            word = " " + rng.choice(self._long)
            cut = rng.randint(2, len(word) - 1)
            ids = self._encode(word[:cut]) + self._encode(word[cut:])
            if ids != self._encode(word):
                return ids
        return None


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
    drop: bool = False  # close the connection without a reply (the request may have been applied)


class _HttpError(Exception):
    """A request the emulator refuses, with the reply to send."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace"))
        self.reply = _Reply(status, body)


class _GenerateRequest(msgspec.Struct):
    """One SGLang ``/generate`` request (batches, a list of prompts, are refused)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    rid: str | None = None


class _SamplingParams(msgspec.Struct):
    """The sampling keys the emulator acts on (the others are accepted and ignored)."""

    max_new_tokens: int = 128  # SGLang's default
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def check(self) -> None:
        """SGLang's SamplingParams.verify, for the values the fleet sends (a ValueError: HTTP 400)."""
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")


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
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 413: "Content Too Large", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
    503: "Service Unavailable",
}
_CLOUD_FAULTS = {  # kind: (HTTP status, error code, message, metadata)
    "429": (429, 429, "Rate limit exceeded (emulated)", None),
    "500": (500, 500, "Internal server error (emulated)", None),
    "503": (503, 503, "No available provider (emulated)", None),
    "402": (402, 402, "Insufficient credits", {"limit_source": "openrouter_credits"}),
    "402_inflight": (402, 402, "In-flight budget exhausted (emulated)",
                     {"limit_source": "openrouter_in_flight_budget", "reason": "in_flight_budget_exhausted"}),
    "403": (403, 403, "Request blocked by guardrail (emulated)", None),
    "moderation": (403, 403, "emulated/model requires moderation on its input",
                   {"reasons": ["emulated"], "flagged_input": "...", "provider_name": "emulated",
                    "model_slug": "emulated/model"}),
    "200_error": (200, 502, "Provider returned error (emulated)", {"provider_name": "emulated"}),
}
_ERROR_TYPES = {"403": "permission_denied"}
_BYOK_FEE = 0.05  # OpenRouter's fee on BYOK requests, as a share of the provider's charge  # the canonical top-level error_type OpenRouter adds


def _error_body(code: int, message: str, metadata: dict[str, Any] | None = None,
                error_type: str | None = None) -> bytes:
    """OpenRouter's error shape: ``{"error": {"code", "message", "metadata"?}, "error_type"?}``."""
    error: dict[str, Any] = {"code": code, "message": message}
    if metadata is not None:
        error["metadata"] = metadata
    body: dict[str, Any] = {"error": error}
    if error_type is not None:
        body["error_type"] = error_type
    return _encode(body)


def _sglang_error(message: str) -> bytes:
    """SGLang's answer to a ValueError in a request (HTTP 400): ``{"error": {"message"}}``."""
    return _encode({"error": {"message": message}})


def _sglang_exception(status: int, message: str, kind: str | None = None) -> bytes:
    """SGLang's ``ErrorResponse``: an HTTPException (an abort with a 5xx status) or a body
    that fails validation (``kind`` "Bad Request")."""
    return _encode({"object": "error", "message": message, "type": kind or str(status), "param": None,
                    "code": status})


def _fastapi_detail(status: int) -> bytes:
    """FastAPI's own answer for an unknown path or method: ``{"detail"}``."""
    return _encode({"detail": _REASONS[status]})


def _bearer_is(headers: dict[str, str], key: str) -> bool:
    """Whether the request carries ``Authorization: Bearer <key>`` (compared in constant time)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


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
        self._vocab = _Vocab(config.tokenizer, config.end_of_turn, config.eos_token)
        self._chance = random.Random(f"chance:{config.seed}")  # faults and prefill jitter
        self._apply(config)
        self._routes: dict[str, tuple[str, _Handler]] = {
            "/generate": ("POST", self._generate),
            "/v1/chat/completions": ("POST", self._chat),
            "/health": ("GET", self._health),
            "/health_generate": ("GET", self._health),
            "/model_info": ("GET", self._model_info),
            "/get_model_info": ("GET", self._deprecated("/get_model_info", self._model_info)),
            "/server_info": ("GET", self._server_info),
            "/get_server_info": ("GET", self._deprecated("/get_server_info", self._server_info)),
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
        # The batch API imports this module, so it is bound here, not at the top.
        from draftfleet.devtools.emulator_batch import BatchAPI

        self._batch = BatchAPI(self)
        self.reset_stats()

    # --- configuration and stats -------------------------------------------------------

    def _apply(self, config: EmulatorConfig) -> None:
        self.config = config
        self._length = _length_sampler(config.length)
        self._reasoning_length = _length_sampler(config.reasoning_length)
        self._fault_tables = {
            path: [(kind, getattr(config, f"rate_{kind}")) for kind in FAULT_KINDS
                   if getattr(config, f"rate_{kind}") > 0
                   and (path in FAULT_PATHS[kind] or (kind == "429" and config.proxy and path == _SGLANG))]
            for path in config.fault_endpoints
        }

    def update(self, fields: dict[str, Any]) -> EmulatorConfig:
        """Validate and apply a subset of config fields (raises ValueError when invalid)."""
        try:
            config = msgspec.convert({**msgspec.structs.asdict(self.config), **fields}, EmulatorConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None
        vocab = (config.tokenizer, config.end_of_turn, config.eos_token)
        if vocab != (self.config.tokenizer, self.config.end_of_turn, self.config.eos_token):
            self._vocab = _Vocab(*vocab)
        if self._batcher is not None:
            self._batcher.sync()  # bank progress made at the old rate
        self._apply(config)
        if "batch_faults" in fields:
            self._batch.arm()
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
        self._batch.reset_stats()

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
            "deprecated": self._counts["deprecated"],  # calls to a path SGLang logs as deprecated
            "dropped": self._counts["dropped"],  # connections closed without a reply (batch "lost" faults)
            "batch": self._batch.stats(),
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
                if reply.drop:
                    self._counts["dropped"] += 1
                    return
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
        except asyncio.CancelledError:
            # Closed by stop() or by the disconnect watcher: end quietly. (Python 3.11's stream
            # server logs a traceback for a connection task that ends cancelled.)
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
        label = path
        if route is None and (found := self._batch.route(method, path)) is not None:
            label, route = found  # the batch API's paths carry ids: counted by their pattern
        self._by_endpoint[label if route else "other"] += 1
        if route is None:
            return _Reply(404, _fastapi_detail(404))
        if method != route[0]:
            return _Reply(405, _fastapi_detail(405))
        key = self.config.sglang_api_key
        if key is not None and path in _SGLANG_PATHS and not _bearer_is(headers, key):
            # SGLang's --api-key (srt/utils/auth.py): only /health*, /ready and /metrics are open.
            self._counts["unauthorized"] += 1
            return _Reply(401, _encode({"error": "Unauthorized"}))
        generating = path in GENERATION_PATHS
        if generating:
            self._inflight[task] = reader
            self._open += 1
            self._max_open = max(self._max_open, self._open)
        try:
            return await route[1](headers, body, t0)
        except _HttpError as exc:
            return exc.reply
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            if path == _CHAT:
                return _Reply(400, _error_body(400, str(exc)))
            return _Reply(400, _sglang_exception(400, str(exc), "Bad Request"))
        except Exception as exc:  # an emulator bug: answer, and leave the traceback in the log
            log.exception("emulator: %s %s failed", method, path)
            return _Reply(500, _error_body(500, f"emulator error: {exc!r}"))
        finally:
            if generating:
                self._open -= 1
                self._inflight.pop(task, None)

    # --- generation ----------------------------------------------------------------------

    def _draw(self, key: bytes, cap: int | None, reasoning: bool, stops: bool = True,
              think: tuple[str, str] | None = None) -> tuple[list[int], list[int], bool]:
        """The deterministic completion of a prompt: reasoning ids, answer ids, whether it stopped.

        All lengths are drawn before any id, so a lower cap yields a prefix of the same ids. The
        answer ends with the end-of-turn id when it stopped; a capped one does not. When the
        end-of-turn id is not a stop token (``stops`` False), the model writes on past it to the cap.
        With ``think`` markers the reasoning is written inside the answer's sequence, as an engine
        returns a thinking model's output.
        """
        digest = hashlib.blake2b(b"%d\0" % self.config.seed + key, digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest))
        n_answer = self._length(rng)
        thinks = reasoning and rng.random() < self.config.reasoning_rate
        n_reasoning = self._reasoning_length(rng) if thinks else 0
        splits = rng.random() < self.config.split_rate
        vocab = self._vocab
        reasoning_ids = vocab.natural(rng, n_reasoning)
        body = self._answer(rng, n_answer - 1, splits)
        if think is not None and reasoning_ids:  # one sequence: markers, reasoning, answer
            body = vocab.thinking(think, reasoning_ids, body, canonical=not splits)
            reasoning_ids = []
        room = len(reasoning_ids) + len(body) + 1 if cap is None else max(cap, 0)
        reasoning_ids = reasoning_ids[:room]
        room -= len(reasoning_ids)
        answer = body + [vocab.eot]
        if not stops:
            answer += vocab.natural(rng, room - len(answer))
        stopped = stops and len(body) + 1 <= room
        return reasoning_ids, answer[:room], stopped

    def _answer(self, rng: random.Random, n: int, splits: bool) -> list[int]:
        """``n`` ids of natural text; with ``splits``, one word in it is split unnaturally."""
        piece = self._vocab.split(rng) if splits and n >= 4 else None
        if piece is None or len(piece) > n - 2:
            return self._vocab.natural(rng, n)
        head = rng.randint(1, n - len(piece) - 1)
        return (self._vocab.natural(rng, head) + piece
                + self._vocab.natural(rng, n - head - len(piece), lead_space=True))

    def _fault(self, path: str) -> str | None:
        """Draw this request's fault, if any (not tied to the prompt: faults come by chance)."""
        table = self._fault_tables.get(path)
        if not table:
            return None
        u = self._chance.random()
        edge = 0.0
        for kind, rate in table:
            edge += rate
            if u < edge:
                self._faults[kind] += 1
                return kind
        return None

    def _retry_after(self) -> tuple[tuple[str, str], ...]:
        return (("Retry-After", f"{self.config.retry_after_s:g}"),)

    def _cloud_fault(self, kind: str) -> _Reply:
        """OpenRouter's answer for a fault: its status, error body and headers."""
        status, code, message, metadata = _CLOUD_FAULTS[kind]
        if kind == "200_error":  # an in-body error says when to try again in its metadata
            metadata = {**(metadata or {}), "retry_after_seconds": self.config.retry_after_s}
        retry = self._retry_after() if status in (429, 503) or kind == "402_inflight" else ()
        return _Reply(status, _error_body(code, message, metadata, _ERROR_TYPES.get(kind)), retry)

    def _sglang_fault(self, kind: str) -> _Reply:
        """SGLang's answer for a fault, or its proxy's (429, and Retry-After, only with ``proxy``)."""
        proxy = self.config.proxy
        if kind == "429":
            return _Reply(429, _encode({"error": "Too Many Requests (emulated proxy)"}), self._retry_after())
        if kind == "503":  # an abort that carries a status code (scheduler shutting down, queue full)
            body = _sglang_exception(503, "Abort request with status 503 (emulated)")
            return _Reply(503, body, self._retry_after() if proxy else ())
        return _Reply(500, b"Internal Server Error")  # an unhandled exception, answered by Starlette

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

    def _check_context(self, prompt_tokens: int, max_new: int | None, chat: bool) -> None:
        """Input plus requested output beyond the context length is refused (HTTP 400)."""
        limit = self.config.context_length
        if chat:
            if prompt_tokens + (max_new or 0) > limit:
                raise _HttpError(400, _error_body(400, (
                    f"This endpoint's maximum context length is {limit} tokens. However, you requested about "
                    f"{prompt_tokens + (max_new or 0)} tokens ({prompt_tokens} of text input, {max_new or 0} "
                    "in the output). Please reduce the length of either one.")))
            return
        # SGLang's TokenizerManager._validate_one_request, in its words.
        if prompt_tokens >= limit:
            raise _HttpError(400, _sglang_error(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length ({limit} tokens)."))
        if max_new is not None and prompt_tokens + max_new > limit:
            raise _HttpError(400, _sglang_error(
                "Requested token count exceeds the model's maximum context length of "
                f"{limit} tokens. You requested a total of {prompt_tokens + max_new} tokens: {prompt_tokens} tokens "
                f"from the input messages and {max_new} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit."))

    async def _generate(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """SGLang ``/generate``: exact output ids, the matched stop id last when it stopped."""
        req = _decode_generate(body)
        unknown = [k for k in req.sampling_params if k not in SGLANG_SAMPLING_KEYS]
        if unknown:  # SGLang's contract check (serde's wording), before anything else
            listed = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
            raise _HttpError(400, _encode({"error": f"unknown field `{unknown[0]}`, expected one of {listed}"}))
        params = msgspec.convert(req.sampling_params, _SamplingParams)
        try:
            params.check()
        except ValueError as exc:
            raise _HttpError(400, _sglang_error(str(exc))) from None
        if req.input_ids is not None:
            key = b"i" + _encode(req.input_ids)
            prompt_tokens = len(req.input_ids)
        elif req.text is not None:
            key = b"t" + req.text.encode()
            prompt_tokens = self._vocab.count(req.text)
        else:
            raise _HttpError(400, _sglang_error("Either text, input_ids or input_embeds should be provided."))
        max_new = params.max_new_tokens
        self._check_context(prompt_tokens, max_new, chat=False)
        rid = req.rid or uuid.uuid4().hex
        fault = self._fault(_SGLANG)
        if fault == "abort":  # an abort without a status code: HTTP 200, finish_reason abort
            return _json({
                "text": "", "output_ids": [],
                "meta_info": {
                    "id": rid, "finish_reason": {"type": "abort", "message": "Abort request (emulated)",
                                                 "status_code": None, "err_type": None},
                    "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
                    "e2e_latency": time.monotonic() - t0,
                },
            })
        if fault in ("429", "500", "503"):
            return self._sglang_fault(fault)
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.add(self._vocab.eos)
        # The model ends its turn with end_of_turn; only a stop token ends the generation there.
        think = self.config.think
        _, ids, stopped = self._draw(key, max_new, reasoning=think is not None, stops=self._vocab.eot in stop_ids,
                                     think=think)
        await self._occupy(len(ids))
        self._account(prompt_tokens, len(ids))
        if stopped:
            finish: dict[str, Any] = {"type": "stop", "matched": self._vocab.eot}
        else:
            finish = {"type": "length", "length": max_new}
        payload = {
            "text": self._vocab.decode(ids[:-1] if stopped else ids),
            "output_ids": ids,  # sglang 0.5.23 keeps the matched stop id here; only text is trimmed
            "meta_info": {
                "id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": time.monotonic() - t0,
            },
        }
        return _Reply(200, _encode(payload), cut=fault == "cut")

    def check_key(self, headers: dict[str, str]) -> None:
        """OpenRouter's key check, in its words (the key never echoed): the chat endpoint's and the
        batch API's alike."""
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            self._counts["unauthorized"] += 1
            raise _HttpError(401, _error_body(401, "No auth credentials found"))
        if self.config.api_key is not None and not _bearer_is(headers, self.config.api_key):
            self._counts["unauthorized"] += 1
            raise _HttpError(401, _error_body(401, "User not found."))

    async def _chat(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """OpenAI chat completions with OpenRouter's usage accounting and error shapes."""
        self.check_key(headers)
        req = _decode_chat(body)
        if not req.messages:
            raise ValueError("messages must not be empty")
        prompt_tokens = self._vocab.count(_chatml(req.messages))
        cap = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        limit = self.config.max_output_tokens
        if limit is not None and cap is not None and cap > limit:
            message = f"max_tokens ({cap}) exceeds the maximum output of {limit} tokens for this model"
            return _Reply(400, _error_body(400, message, error_type="max_tokens_exceeded"))
        self._check_context(prompt_tokens, cap, chat=True)
        model = req.model or self.config.model
        created = int(time.time())
        gen_id = f"gen-{created}-{next(self._ids)}"
        fault = self._fault(_CHAT)
        if fault == "abort":  # OpenRouter reports a mid-generation failure as finish_reason "error"; its
            # zero completion insurance bills nothing for it
            return _json(self._completion(gen_id, created, model, "", None, "error", prompt_tokens, 0, 0, billed=False))
        if fault in _CLOUD_FAULTS:
            return self._cloud_fault(fault)
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        reasoning_ids, answer, stopped = self._draw(b"m" + _encode_sorted(req.messages), cap, reasoning=True)
        n = len(reasoning_ids) + len(answer)
        await self._occupy(n)
        self._account(prompt_tokens, n)
        content = self._vocab.decode(answer[:-1] if stopped else answer)
        reasoning = self._vocab.decode(reasoning_ids) if reasoning_ids else None
        if fault == "empty":  # generated and billed, nothing returned (a provider hiding the reasoning)
            content, reasoning = "", None
        payload = self._completion(
            gen_id, created, model, content, reasoning, "stop" if stopped else "length",
            prompt_tokens, n, len(reasoning_ids),
        )
        return _Reply(200, _encode(payload), cut=fault == "cut")

    def _completion(
        self, gen_id: str, created: int, model: str, content: str, reasoning: str | None,
        finish_reason: str, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int, billed: bool = True,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning"] = reasoning
        price_in, price_out = self.config.price_input_per_mtok, self.config.price_output_per_mtok
        cost = prompt_tokens * price_in / 1e6 + completion_tokens * price_out / 1e6 if billed else 0.0
        byok = self.config.byok  # the provider bills the user's own key; OpenRouter charges only its fee
        return {
            "id": gen_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "error": None,  # OpenRouter may send a null error in a successful body
            "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "cost": cost * _BYOK_FEE if byok else cost,
                "is_byok": byok, "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "cost_details": {"upstream_inference_cost": cost if byok else None},
            },
        }

    # --- the other routes ----------------------------------------------------------------

    async def _health(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """SGLang's /health and /health_generate: 503 while warming up, else a one-token generation."""
        if self.config.loading:
            return _Reply(503)
        if self.config.health_s:
            await asyncio.sleep(self.config.health_s)
        return _Reply(200)

    def _deprecated(self, path: str, handler: _Handler) -> _Handler:
        """An old path that still answers, as SGLang's does, with a warning in the log."""

        async def route(headers: dict[str, str], body: bytes, t0: float) -> _Reply:
            self._counts["deprecated"] += 1
            log.warning("Endpoint '%s' is deprecated and will be removed in a future version. "
                        "Please use '%s' instead.", path, _DEPRECATED[path])
            return await handler(headers, body, t0)

        return route

    async def _model_info(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        cfg = self.config
        return _json({"model_path": cfg.model, "served_model_name": cfg.model, "tokenizer_path": cfg.tokenizer,
                      "is_generation": True})

    async def _server_info(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        cfg = self.config
        return _json({"context_length": cfg.context_length, 
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
    """Request line and headers: method, path (the query, where one is sent, as the pseudo-header
    ``:query``, which no HTTP/1.1 header name can be), lower-cased headers, keep-alive."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpError(400, _encode({"detail": "malformed request line"}))
    method, target, version = parts
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, _encode({"detail": "malformed header line"}))
            headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    path, _, query = target.partition("?")
    if query:
        headers[":query"] = query
    return method, path, headers, keep_alive


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _HttpError(501, _encode({"detail": "chunked request bodies are not supported; send Content-Length"}))
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _HttpError(400, _encode({"detail": "bad Content-Length"})) from None
    if not 0 <= length <= _MAX_BODY:
        raise _HttpError(413, _encode({"detail": "request body too large"}))
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
