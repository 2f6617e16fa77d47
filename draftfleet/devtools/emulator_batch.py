"""The batch APIs of the emulator: OpenAI's ``/v1/files`` and ``/v1/batches``, OpenRouter's ``/api/v1/batches``.

OpenAI, Azure, Together, Groq and others sell tokens at about half price to whoever uploads a
JSONL file of requests and waits (ops/batch-apis.md has the real APIs' shapes, statuses, limits
and sources). The fleet's batch path is tested against this emulation, so it is as strict as the
real API where the fleet could go wrong: a multipart upload with ``purpose=batch`` within the size
limit; a batch naming that file, ``/v1/chat/completions`` and ``"24h"`` (unknown arguments refused);
the file checked while the batch is ``validating`` (JSON per line, unique ``custom_id``, ``POST``,
``url`` equal to the batch's endpoint, one model, the one served, at most ``batch_max_requests``
lines); a bad file makes the batch ``failed`` with ``errors.data`` entries (code, line, param,
message) and runs nothing.

Time is the emulator's model time (``time_scale``), evaluated lazily whenever a batch is looked
at: ``validating`` for ``batch_validating_s``, then ``in_progress`` one request every
``batch_request_s``, ``finalizing`` for ``batch_finalizing_s``, ``completed``. Requests not done
when ``batch_window_s`` (the "24h") ends are ``batch_expired``; a cancel stops the work at once,
stays ``cancelling`` for ``batch_cancelling_s`` and ends ``cancelled`` with what completed in the
output file and the rest ``batch_cancelled`` in the error file. Each request is answered by the
emulator's own chat-completion generator (same ids for the same messages, same usage and cost
shape as ``/v1/chat/completions``, the cost at ``batch_price_factor``), its failures as the
synchronous endpoint would answer them, inside ``response`` with their status code.

OpenRouter's inline shape lives beside it at ``/api/v1/batches`` (and the quickstart's
``/api/beta/batches``): one JSON body ``{endpoint, model, requests: [{custom_id, body}], ...}`` with
``endpoint``, ``model`` and ``callback_url`` before ``requests`` (OpenRouter stream-parses the body;
400 otherwise), at most 5,000 requests, 202 ``validating``; the requests are checked after acceptance
(a repeated custom_id, another model: ``failed`` with ``error.message``), then run on the same
schedule by the same generator at the same price, the results inline in the batch object once it
has ended. OpenRouter documents no cancel, so there is none here. The two shapes do not see each
other's batches.

Stats count submissions per ``custom_id`` (a batch created over a file or inline requests naming
it), so tests can prove a prompt was submitted once whichever shape, and answers per ``custom_id``.

Faults of the batch endpoints themselves are opt-in and scripted (``batch_faults``, none by default):
``"CALL:KIND[:N]"`` makes the next N calls of CALL (``upload``, ``create``, ``list``, ``get``,
``content``, ``cancel``; ``create`` and the others cover both shapes) answer KIND, ``"CALL:KIND:P%"``
each call with chance P%. KIND is ``429`` (Retry-After), ``500``, ``502``, ``503`` (Retry-After) or
``402`` (no credits: OpenAI's shape says so with a 429 ``insufficient_quota``), in the shape's own error
body, with nothing applied; or a reply lost after the call *was* applied (the
dangerous case: a batch created that the client never heard of): ``lost`` (the connection closed
without a reply), ``lost_502`` (a 502 answered) or ``hang`` (the reply held ``hang_s``, past the
client's timeout). Every call of the batch paths is in the stats' ``calls`` log (wall time, call,
shape, status, fault), so a test can measure how long a client waited after a 429.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import urllib.parse
import uuid
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import msgspec

from draftfleet.devtools.emulator import (
    _CHAT,
    _bearer_is,
    _chatml,
    _decode_any,
    _decode_chat,
    _encode,
    _encode_sorted,
    _error_body,
    _Handler,
    _HttpError,
    _json,
    _Reply,
)

if TYPE_CHECKING:
    from draftfleet.devtools.emulator import _App

__all__ = ["BATCH_ENDPOINTS", "BATCH_FAULT_CALLS", "BATCH_FAULT_KINDS", "OPENROUTER_MAX_REQUESTS", "BatchAPI",
           "parse_batch_faults"]

BATCH_ENDPOINTS = ("/v1/responses", "/v1/chat/completions", "/v1/embeddings", "/v1/completions", "/v1/moderations",
                   "/v1/images/generations", "/v1/images/edits", "/v1/videos")
"""The endpoints OpenAI's batch API accepts; the emulator serves only ``/v1/chat/completions``."""

_TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
_CANCELLABLE = frozenset({"validating", "in_progress", "finalizing"})
_CREATE_KEYS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
_OR_KEYS = frozenset({"endpoint", "model", "requests", "completion_window", "callback_url", "provider", "metadata"})
OPENROUTER_MAX_REQUESTS = 5_000  # per batch (OpenRouter's guide)
_OPENAI_CALLS = {("POST", "/v1/files"): "upload", ("POST", "/v1/batches"): "create", ("GET", "/v1/batches"): "list",
                 ("GET", "/v1/batches/{id}"): "get", ("GET", "/v1/files/{id}/content"): "content",
                 ("POST", "/v1/batches/{id}/cancel"): "cancel"}
BATCH_FAULT_CALLS = ("upload", "create", "list", "get", "content", "cancel")
"""The batch calls ``batch_faults`` can hit: ``POST /v1/files``; ``POST`` of a batch (both shapes); ``GET``
of the list (both shapes, what ``find`` asks); ``GET`` of one batch (both shapes, the poll); ``GET
/v1/files/{id}/content`` (the download); ``POST /v1/batches/{id}/cancel``."""
BATCH_FAULT_KINDS = ("429", "500", "502", "503", "402", "lost", "lost_502", "hang")
"""Refused, nothing applied: 429 and 503 (with Retry-After), 500, 502, and no credits (``402``: OpenRouter's
402 "Insufficient credits"; on the OpenAI shape OpenAI's own answer, a 429 ``insufficient_quota``, no
Retry-After). Applied, the reply lost: ``lost`` (connection closed without a reply), ``lost_502``
(answered 502), ``hang`` (answered after ``hang_s``)."""
_REFUSALS = {  # kind: (status, OpenAI's message, type, code; OpenRouter's message)
    "429": (429, "Rate limit reached for requests (emulated). Please try again later.", "requests",
            "rate_limit_exceeded", "Rate limit exceeded (emulated)"),
    "500": (500, "The server had an error while processing your request. Sorry about that! (emulated)",
            "server_error", None, "Internal server error (emulated)"),
    "502": (502, "Bad gateway. (emulated)", "server_error", None, "Bad gateway (emulated)"),
    "503": (503, "The server is overloaded or not ready yet. (emulated)", "server_error", None,
            "Service unavailable (emulated)"),
    "402": (402, "You exceeded your current quota, please check your plan and billing details. (emulated)",
            "insufficient_quota", "insufficient_quota", "Insufficient credits"),
}
_UNDONE = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def _oai_error(status: int, message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> _HttpError:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return _HttpError(status, _encode({"error": {"message": message, "type": kind, "param": param, "code": code}}))


def _multipart(headers: dict[str, str], body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a ``multipart/form-data`` body: name -> (filename, content)."""
    mime, _, params = headers.get("content-type", "").partition(";")
    if mime.strip().lower() != "multipart/form-data":
        raise _oai_error(400, "Invalid file format: send multipart/form-data with the fields 'file' and 'purpose'.")
    boundary = ""
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.lower() == "boundary":
            boundary = value.strip().strip('"')
    if not boundary:
        raise _oai_error(400, "multipart/form-data without a boundary")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, content = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise _oai_error(400, "malformed multipart/form-data part")
        name = filename = None
        for line in head.decode("utf-8", "replace").split("\r\n"):
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                for item in value.split(";"):
                    k, _, v = item.strip().partition("=")
                    if k == "name":
                        name = v.strip('"')
                    elif k == "filename":
                        filename = v.strip('"')
        if name is not None:
            fields[name] = (filename, content.removesuffix(b"\r\n"))
    return fields


class _Fault(msgspec.Struct):
    """One ``batch_faults`` entry, armed: ``left`` calls to go (a count) or ``rate`` (a chance each)."""

    call: str
    kind: str
    left: int = 0
    rate: float = 0.0


def parse_batch_faults(specs: tuple[str, ...] | list[str]) -> list[_Fault]:
    """``"CALL:KIND[:N]"`` or ``"CALL:KIND:P%"`` entries, strictly (a ValueError names a bad one)."""
    out = []
    for spec in specs:
        parts = spec.split(":") if isinstance(spec, str) else []
        if len(parts) not in (2, 3) or parts[0] not in BATCH_FAULT_CALLS or parts[1] not in BATCH_FAULT_KINDS:
            raise ValueError(f"batch_faults: {spec!r} is not CALL:KIND[:N] or CALL:KIND:P% (CALL one of "
                             f"{', '.join(BATCH_FAULT_CALLS)}; KIND one of {', '.join(BATCH_FAULT_KINDS)})")
        amount = parts[2] if len(parts) == 3 else "1"
        try:
            if amount.endswith("%"):
                rate = float(amount[:-1]) / 100
                if not 0 < rate <= 1:
                    raise ValueError
                out.append(_Fault(parts[0], parts[1], rate=rate))
            else:
                left = int(amount)
                if left < 1:
                    raise ValueError
                out.append(_Fault(parts[0], parts[1], left=left))
        except ValueError:
            raise ValueError(f"batch_faults: {spec!r}: N must be a whole number of at least 1, P% within "
                             "(0%, 100%]") from None
    return out


class _File(msgspec.Struct):
    id: str
    filename: str
    purpose: str
    created_at: int
    content: bytes

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.content), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None}


def _validated(b: "_Batch", at: float, errors: list[dict[str, Any]], requests: list[tuple[str, dict[str, Any]]]) -> None:
    """A validation's end, both shapes: any error fails the batch and runs nothing; else its
    requests run from ``at``."""
    if errors:
        b.errors = errors
        b.status = "failed"
        b.stamps["failed_at"] = b.wall(at)
        return
    b.requests = requests
    b.status = "in_progress"
    b.stamps["in_progress_at"] = b.wall(at)
    b.start = at


class _Batch(msgspec.Struct):
    """One batch and its schedule, in monotonic wall seconds (``t0`` is its creation)."""

    id: str
    input_file_id: str
    endpoint: str
    metadata: dict[str, str] | None
    t0: float
    wall0: float
    validating: float  # wall seconds of each phase, fixed at creation (time_scale then)
    per_request: float
    finalizing: float
    cancelling: float
    window_end: float
    status: str = "validating"
    stamps: dict[str, int] = {}
    errors: list[dict[str, Any]] | None = None
    requests: list[tuple[str, dict[str, Any]]] = []
    start: float = 0.0  # when in_progress began
    done: int = 0
    phase_end: float = 0.0  # end of finalizing or cancelling
    lines: list[dict[str, Any]] = []  # results so far, in completion order
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    shape: str = "openai"  # or "openrouter": requests inline, results inline, no cancel
    model: str = ""  # OpenRouter's batch-level model
    inline: list[dict[str, Any]] = []  # OpenRouter's requests as submitted, checked while validating

    def wall(self, mono: float) -> int:
        return int(self.wall0 + (mono - self.t0))


class BatchAPI:
    """The files and batches of one emulator, on its event loop (no tasks: state advances when read)."""

    def __init__(self, app: _App) -> None:
        self._app = app
        self._files: dict[str, _File] = {}
        self._batches: dict[str, _Batch] = {}
        self.arm()
        self.reset_stats()

    def arm(self) -> None:
        """(Re)arm the config's ``batch_faults``: counts start again."""
        self._faults = parse_batch_faults(self._app.config.batch_faults)

    def reset_stats(self) -> None:
        self._submitted: Counter[str] = Counter()
        self._answered: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._faulted: Counter[str] = Counter()
        self._calls: deque[dict[str, Any]] = deque(maxlen=10_000)

    def stats(self) -> dict[str, Any]:
        """``submitted``: custom_id -> batches created over it; ``answered``: -> 200 answers produced."""
        for batch in self._batches.values():
            self._advance(batch, time.monotonic())
        return {
            "files": self._counts["files"], "batches": self._counts["batches"],
            "by_status": dict(Counter(b.status for b in self._batches.values())),
            "requests_completed": self._counts["completed"], "requests_failed": self._counts["failed"],
            "submitted": dict(self._submitted), "answered": dict(self._answered),
            "faults": dict(self._faulted),  # "call:kind" -> times injected
            "calls": list(self._calls),  # {at (wall s), call, shape, status (0: no reply), fault}, oldest first
        }

    # --- faults of the batch endpoints -------------------------------------------------

    def _draw_fault(self, call: str) -> str | None:
        for fault in self._faults:
            if fault.call != call:
                continue
            if fault.left:
                fault.left -= 1
                return fault.kind
            if fault.rate:
                return fault.kind if self._app._chance.random() < fault.rate else None
        return None

    def _refusal(self, kind: str, shape: str) -> _Reply:
        status, message, kind_type, code, or_message = _REFUSALS[kind]
        retry = (("Retry-After", f"{self._app.config.retry_after_s:g}"),) if status in (429, 503) else ()
        if shape == "openrouter":
            body = _error_body(status, or_message, {"limit_source": "openrouter_credits"} if kind == "402" else None)
        elif kind == "402":  # OpenAI answers an exhausted quota with a 429 of its own type
            status, retry = 429, ()
            body = _encode({"error": {"message": message, "type": kind_type, "param": None, "code": code}})
        else:
            body = _encode({"error": {"message": message, "type": kind_type, "param": None, "code": code}})
        return _Reply(status, body, retry)

    def _faulty(self, call: str, shape: str, handler: _Handler) -> _Handler:
        """``handler`` with the call logged and ``batch_faults`` applied: a refusal instead of the
        call, or the call applied and its reply lost."""

        async def run(headers: dict[str, str], body: bytes, t0: float) -> _Reply:
            entry: dict[str, Any] = {"at": time.time(), "call": call, "shape": shape, "status": 0, "fault": None}
            self._calls.append(entry)
            fault = self._draw_fault(call)
            if fault is not None:
                entry["fault"] = fault
                self._faulted[f"{call}:{fault}"] += 1
            if fault in _REFUSALS:
                reply = self._refusal(fault, shape)
                entry["status"] = reply.status
                return reply
            try:
                reply = await handler(headers, body, t0)
            except _HttpError as exc:
                reply = exc.reply
            if fault == "lost":
                return _Reply(reply.status, drop=True)
            if fault == "lost_502":
                reply = self._refusal("502", shape)
            elif fault == "hang":
                await asyncio.sleep(self._app.config.hang_s)
            entry["status"] = reply.status
            return reply

        return run

    # --- routing -----------------------------------------------------------------------

    def route(self, method: str, path: str) -> tuple[str, tuple[str, _Handler]] | None:
        """(pattern, (method, handler)) for a batch path; a known path with another method gets
        a route whose method differs, so the emulator answers 405 as for its other paths."""
        parts = path.strip("/").split("/")
        if len(parts) >= 3 and parts[0] == "api" and parts[1] in ("v1", "beta") and parts[2] == "batches":
            return self._route_openrouter(method, parts[3:])
        if len(parts) < 2 or parts[0] != "v1" or parts[1] not in ("files", "batches"):
            return None
        kind, rest = parts[1], parts[2:]
        table: dict[str, _Handler]
        if not rest:
            label = f"/v1/{kind}"
            table = ({"POST": self._upload, "GET": self._list_files} if kind == "files"
                     else {"POST": self._create, "GET": self._list_batches})
        elif len(rest) == 1 and rest[0]:
            label = f"/v1/{kind}/{{id}}"
            table = {"GET": functools.partial(self._get_file if kind == "files" else self._get_batch, rest[0])}
        elif len(rest) == 2 and kind == "files" and rest[1] == "content":
            label, table = "/v1/files/{id}/content", {"GET": functools.partial(self._content, rest[0])}
        elif len(rest) == 2 and kind == "batches" and rest[1] == "cancel":
            label, table = "/v1/batches/{id}/cancel", {"POST": functools.partial(self._cancel, rest[0])}
        else:
            return None
        if method in table:
            call = _OPENAI_CALLS.get((method, label))
            handler = table[method]
            return label, (method, self._faulty(call, "openai", handler) if call else handler)
        allowed, handler = next(iter(table.items()))
        return label, (allowed, handler)

    def _route_openrouter(self, method: str, rest: list[str]) -> tuple[str, tuple[str, _Handler]]:
        """OpenRouter's paths (``/api/v1/batches``; the quickstart's ``/api/beta/batches`` too): submit,
        list, get. No cancel is documented: ``.../cancel``, ``DELETE`` and any other path or method under
        the base answer 404 in OpenRouter's error shape, so a client that tries one learns it at once."""
        table: dict[str, _Handler] = {}
        if not rest:
            table, label = {"POST": self._or_create, "GET": self._or_list}, "/api/v1/batches"
        elif len(rest) == 1 and rest[0]:
            table, label = {"GET": functools.partial(self._or_get, rest[0])}, "/api/v1/batches/{id}"
        if method not in table:
            return "other", (method, self._or_no_route)
        call = "get" if rest else ("create" if method == "POST" else "list")
        return label, (method, self._faulty(call, "openrouter", table[method]))

    async def _or_no_route(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        raise _HttpError(404, _error_body(404, "Not Found"))

    def _or_auth(self, headers: dict[str, str]) -> None:
        """The key check of the chat endpoint, in OpenRouter's words (the key never echoed)."""
        self._app.check_key(headers)

    async def _or_create(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """Submit: ``endpoint``, ``model`` (and ``callback_url``) serialized before ``requests`` (the server
        stream-parses the body), 1 to 5,000 requests inline, each ``{custom_id: str, body: object}``; 202
        with the batch ``validating``. What the requests say is checked during validation (a repeated
        custom_id, another model: the batch fails), as OpenRouter documents."""
        self._or_auth(headers)

        def bad(message: str) -> _HttpError:
            return _HttpError(400, _error_body(400, message))

        top: list[list[tuple[str, Any]]] = [[]]

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            top[0] = items  # the outermost object closes last: its pairs are the last seen
            return dict(items)

        try:
            req = json.loads(body, object_pairs_hook=pairs)
        except ValueError:
            raise bad("The request body is not valid JSON.") from None
        if not isinstance(req, dict):
            raise bad("The request body must be a JSON object.")
        order = [key for key, _ in top[0]]
        if len(order) != len(req):
            raise bad("Duplicate fields in the request body.")
        unknown = set(req) - _OR_KEYS
        if unknown:
            raise bad(f"Unrecognized fields: {', '.join(sorted(unknown))}.")
        for key in ("endpoint", "model"):
            if not isinstance(req.get(key), str) or not req[key]:
                raise bad(f"'{key}' is required.")
        if "requests" not in req:
            raise bad("'requests' is required.")
        first = order.index("requests")
        if any(k in order[first:] for k in ("endpoint", "model", "callback_url")):
            raise bad("'endpoint', 'model' and 'callback_url' must come before 'requests' in the body.")
        if req["endpoint"] != _CHAT:
            raise bad(f"The emulator serves only {_CHAT} in batches, not {req['endpoint']}.")
        if req.get("completion_window", "24h") != "24h":
            raise bad("'completion_window' must be '24h'.")
        callback = req.get("callback_url")
        if callback is not None and not (isinstance(callback, str) and callback.startswith("https://")):
            raise bad("'callback_url' must be an https:// URL.")
        provider = req.get("provider")
        if provider is not None and not (
            isinstance(provider, dict) and set(provider) <= {"only", "allow_fallbacks"}
            and isinstance(provider.get("only", []), list) and all(isinstance(p, str) for p in provider.get("only", []))
            and isinstance(provider.get("allow_fallbacks", True), bool)):
            raise bad("'provider' takes only 'only' (a list of provider names) and 'allow_fallbacks' (a boolean).")
        metadata = req.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items())):
            raise bad("metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters.")
        requests = req["requests"]
        limit = min(OPENROUTER_MAX_REQUESTS, self._app.config.batch_max_requests)
        if not isinstance(requests, list) or not requests:
            raise bad("'requests' must be a non-empty array.")
        if len(requests) > limit:
            raise bad(f"A batch may have at most {limit} requests, not {len(requests)}.")
        for i, r in enumerate(requests):
            if not (isinstance(r, dict) and set(r) <= {"custom_id", "body"} and isinstance(r.get("custom_id"), str)
                    and isinstance(r.get("body"), dict)):
                raise bad(f"requests[{i}]: each request is {{custom_id: string, body: object}}.")
        for r in requests:
            self._submitted[r["custom_id"]] += 1
        batch = self._new_batch("", _CHAT, metadata)
        batch.shape, batch.model, batch.inline = "openrouter", req["model"], requests
        return _Reply(202, _encode(self._public_openrouter(batch)))

    async def _or_list(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """Newest first, no pagination: enough for a client to find its own batch by ``metadata``."""
        self._or_auth(headers)
        now = time.monotonic()
        data = []
        for batch in reversed(self._batches.values()):
            if batch.shape == "openrouter":
                self._advance(batch, now)
                data.append(self._public_openrouter(batch))
        return _json({"data": data})

    async def _or_get(self, batch_id: str, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._or_auth(headers)
        batch = self._batches.get(batch_id)
        if batch is None or batch.shape != "openrouter":
            raise _HttpError(404, _error_body(404, f"Batch {batch_id} not found."))
        self._advance(batch, time.monotonic())
        return _json(self._public_openrouter(batch))

    def _auth(self, headers: dict[str, str]) -> None:
        """The key check of ``/v1/chat/completions``, answered in OpenAI's words (the key never echoed)."""
        app = self._app
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            app._counts["unauthorized"] += 1
            raise _oai_error(401, "You didn't provide an API key. You need to provide your API key in an "
                                  "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        if app.config.api_key is not None and not _bearer_is(headers, app.config.api_key):
            app._counts["unauthorized"] += 1
            raise _oai_error(401, "Incorrect API key provided.", code="invalid_api_key")

    # --- files -------------------------------------------------------------------------

    async def _upload(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        fields = _multipart(headers, body)
        if "file" not in fields or fields["file"][0] is None:
            raise _oai_error(400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
        if "purpose" not in fields:
            raise _oai_error(400, "Missing required parameter: 'purpose'.", param="purpose",
                             code="missing_required_parameter")
        purpose = fields["purpose"][1].decode("utf-8", "replace").strip()
        if purpose != "batch":  # the others (fine-tune, assistants, ...) are real, but not emulated
            raise _oai_error(400, f"Invalid value for 'purpose': '{purpose}'; the emulator accepts only 'batch'.",
                             param="purpose")
        filename, content = fields["file"]
        limit = self._app.config.batch_max_file_bytes
        if len(content) > limit:
            raise _oai_error(400, f"File is too large: {len(content)} bytes; a batch input file may have at most "
                                  f"{limit} bytes.", param="file")
        file = _File(f"file-{uuid.uuid4().hex[:24]}", filename or "upload.jsonl", purpose, int(time.time()), content)
        self._files[file.id] = file
        self._counts["files"] += 1
        return _json(file.public())

    async def _list_files(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        data = [f.public() for f in reversed(self._files.values())]
        return _json({"object": "list", "data": data, "has_more": False,
                      "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    def _file(self, file_id: str) -> _File:
        file = self._files.get(file_id)
        if file is None:
            raise _oai_error(404, f"No such File object: {file_id}", param="id")
        return file

    async def _get_file(self, file_id: str, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        return _json(self._file(file_id).public())

    async def _content(self, file_id: str, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        return _Reply(200, self._file(file_id).content)

    # --- batches -----------------------------------------------------------------------

    async def _create(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        try:
            req = _decode_any(body)
        except msgspec.DecodeError:
            raise _oai_error(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(req, dict):
            raise _oai_error(400, "The request body must be a JSON object.")
        for key in req:
            if key not in _CREATE_KEYS:
                raise _oai_error(400, f"Unrecognized request argument supplied: {key}")
        for key in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(req.get(key), str):
                raise _oai_error(400, f"Missing required parameter: '{key}'.", param=key,
                                 code="missing_required_parameter")
        if req["completion_window"] != "24h":
            raise _oai_error(400, f"Invalid value for 'completion_window': '{req['completion_window']}'. "
                                  "Supported values are: '24h'.", param="completion_window", code="invalid_value")
        endpoint = req["endpoint"]
        if endpoint not in BATCH_ENDPOINTS:
            raise _oai_error(400, f"Invalid value for 'endpoint': '{endpoint}'.", param="endpoint", code="invalid_value")
        if endpoint != _CHAT:
            raise _oai_error(400, f"The emulator serves only {_CHAT} in batches, not {endpoint}.", param="endpoint")
        metadata = req.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in metadata.items())):
            raise _oai_error(400, "metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters.",
                             param="metadata")
        file = self._files.get(req["input_file_id"])
        if file is None:
            raise _oai_error(404, f"No such File object: {req['input_file_id']}", param="input_file_id")
        if file.purpose != "batch":
            raise _oai_error(400, f"File {file.id} was not uploaded with purpose 'batch'.", param="input_file_id")
        batch = self._new_batch(file.id, endpoint, metadata)
        for line in file.content.splitlines():  # what this submission names, valid or not
            try:
                row = _decode_any(line)
            except msgspec.DecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("custom_id"), str):
                self._submitted[row["custom_id"]] += 1
        return _json(self._public(batch))

    def _new_batch(self, file_id: str, endpoint: str, metadata: dict[str, str] | None) -> _Batch:
        cfg, now = self._app.config, time.monotonic()
        scale = cfg.time_scale
        batch = _Batch(
            id=f"batch_{uuid.uuid4().hex}", input_file_id=file_id, endpoint=endpoint, metadata=metadata, t0=now,
            wall0=time.time(), validating=cfg.batch_validating_s * scale, per_request=cfg.batch_request_s * scale,
            finalizing=cfg.batch_finalizing_s * scale, cancelling=cfg.batch_cancelling_s * scale,
            window_end=now + cfg.batch_window_s * scale,
        )
        batch.stamps = {"created_at": batch.wall(now), "expires_at": batch.wall(batch.window_end)}
        batch.requests, batch.lines = [], []
        self._batches[batch.id] = batch
        self._counts["batches"] += 1
        return batch

    async def _list_batches(self, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """One page, newest first, as OpenAI lists them: ``limit`` 1-100 (default 20), ``after`` the
        ``last_id`` of the page before, ``has_more`` when older batches follow."""
        self._auth(headers)
        query = urllib.parse.parse_qs(headers.get(":query", ""))
        raw = (query.get("limit") or ["20"])[-1]
        if not raw.isdigit() or not 1 <= int(raw) <= 100:
            raise _oai_error(400, f"Invalid 'limit': {raw!r}: an integer from 1 to 100.", param="limit")
        limit, after = int(raw), (query.get("after") or [None])[-1]
        now = time.monotonic()
        batches = [b for b in reversed(self._batches.values()) if b.shape == "openai"]
        if after is not None:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        data = []
        for batch in batches[:limit]:
            self._advance(batch, now)
            data.append(self._public(batch))
        return _json({"object": "list", "data": data, "has_more": len(batches) > limit,
                      "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    def _batch(self, batch_id: str) -> _Batch:
        batch = self._batches.get(batch_id)
        if batch is None or batch.shape != "openai":  # an OpenRouter batch is not cancellable through here
            raise _oai_error(404, f"No batch found with id '{batch_id}'.", param="batch_id")
        self._advance(batch, time.monotonic())
        return batch

    async def _get_batch(self, batch_id: str, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        self._auth(headers)
        return _json(self._public(self._batch(batch_id)))

    async def _cancel(self, batch_id: str, headers: dict[str, str], body: bytes, t0: float) -> _Reply:
        """Stop at once: what completed stays (the output file), the rest ends ``batch_cancelled``."""
        self._auth(headers)
        batch = self._batch(batch_id)
        if batch.status == "cancelling":
            return _json(self._public(batch))
        if batch.status not in _CANCELLABLE:
            raise _oai_error(400, f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id")
        now = time.monotonic()
        batch.status = "cancelling"
        batch.stamps["cancelling_at"] = batch.wall(now)
        batch.phase_end = now + batch.cancelling
        return _json(self._public(batch))

    def _public(self, b: _Batch) -> dict[str, Any]:
        total = len(b.requests)
        stamps = {k: b.stamps.get(k) for k in ("in_progress_at", "expires_at", "finalizing_at", "completed_at",
                                               "failed_at", "expired_at", "cancelling_at", "cancelled_at")}
        return {
            "id": b.id, "object": "batch", "endpoint": b.endpoint, "model": self._app.config.model,
            "errors": None if b.errors is None else {"object": "list", "data": b.errors},
            "input_file_id": b.input_file_id, "completion_window": "24h", "status": b.status,
            "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
            "created_at": b.stamps["created_at"], **stamps,
            "request_counts": {"total": total, "completed": b.completed, "failed": b.failed},
            "metadata": b.metadata,
        }

    def _public_openrouter(self, b: _Batch) -> dict[str, Any]:
        """OpenRouter's batch object: the results inline once it has ended (each with exactly one of
        ``response`` or ``error``), ``error.message`` when the batch failed."""
        terminal = b.status in _TERMINAL
        results = None
        if terminal:
            results = [{"custom_id": line["custom_id"], "response": {"status_code": line["response"]["status_code"],
                                                                    "body": line["response"]["body"]}}
                       if line["response"] is not None else {"custom_id": line["custom_id"], "error": line["error"]}
                       for line in b.lines]
        error = None
        if b.status == "failed":
            messages = list(dict.fromkeys(e["message"] for e in b.errors or [])) or ["validation failed"]
            more = f" (and {len(messages) - 5} more)" if len(messages) > 5 else ""
            error = {"message": "; ".join(messages[:5]) + more}
        ended = next((b.stamps.get(f"{k}_at") for k in ("completed", "failed", "expired", "cancelled")
                      if b.stamps.get(f"{k}_at")), None)
        return {
            "id": b.id, "object": "batch", "endpoint": b.endpoint, "model": b.model, "completion_window": "24h",
            "created_at": b.stamps["created_at"], "expires_at": b.stamps.get("expires_at"), "finalized_at": ended,
            "status": b.status, "provider": "emulator",
            "request_counts": {"total": len(b.inline), "completed": b.completed, "failed": b.failed},
            "error": error, "usage": None, "metadata": b.metadata, "results": results,
        }

    # --- the schedule ------------------------------------------------------------------

    def _advance(self, b: _Batch, now: float) -> None:
        """Bring ``b`` to ``now``: validate, answer the requests due, move through the statuses."""
        while True:
            if b.status == "validating":
                end = b.t0 + b.validating
                if now < end:
                    return
                (self._validate_openrouter if b.shape == "openrouter" else self._validate)(b, end)
            elif b.status == "in_progress":
                self._run(b, min(now, b.window_end))
                if b.done == len(b.requests):
                    last = b.start + b.done * b.per_request
                    b.status = "finalizing"
                    b.stamps["finalizing_at"] = b.wall(last)
                    b.phase_end = last + b.finalizing
                elif now >= b.window_end:
                    self._end(b, "expired", b.window_end)
                    return
                else:
                    return
            elif b.status in ("finalizing", "cancelling"):
                if now < b.phase_end:
                    return
                self._end(b, "completed" if b.status == "finalizing" else "cancelled", b.phase_end)
                return
            else:
                return

    def _validate(self, b: _Batch, at: float) -> None:
        """OpenAI's checks of the input file; any error fails the whole batch and runs nothing."""
        cfg = self._app.config
        errors: list[dict[str, Any]] = []
        requests: list[tuple[str, dict[str, Any]]] = []
        seen: set[str] = set()
        models: set[str] = set()

        def error(code: str, message: str, line: int | None, param: str | None = None) -> None:
            errors.append({"code": code, "message": message, "param": param, "line": line})

        content = self._files[b.input_file_id].content
        lines = content.split(b"\n")
        if lines and lines[-1].strip() == b"":
            lines.pop()  # the newline that ends the last line
        if not lines:
            error("empty_file", "The batch input file is empty.", None)
        if len(lines) > cfg.batch_max_requests:
            error("too_many_tasks", f"The batch input file has {len(lines)} requests; a batch may have at most "
                                    f"{cfg.batch_max_requests}.", None)
        for number, raw in enumerate(lines if len(lines) <= cfg.batch_max_requests else (), start=1):
            try:
                row = _decode_any(raw)
            except msgspec.DecodeError:
                row = None
            if not isinstance(row, dict):
                error("invalid_json_line", "This line is not parseable as valid JSON.", number)
                continue
            custom_id, body = row.get("custom_id"), row.get("body")
            if not isinstance(custom_id, str) or not custom_id:
                error("missing_required_parameter", "Each request needs a custom_id string.", number, "custom_id")
                continue
            if custom_id in seen:
                error("duplicate_custom_id", "The custom_id for this request is a duplicate of another request. "
                                             "The custom_id parameter must be unique for each request in a batch.",
                      number, "custom_id")
                continue
            seen.add(custom_id)
            if row.get("method") != "POST":
                error("invalid_method", "Only POST is supported for batch requests.", number, "method")
                continue
            if row.get("url") != b.endpoint:
                error("url_mismatch", f"The url of this request does not match the batch's endpoint {b.endpoint}.",
                      number, "url")
                continue
            if not isinstance(body, dict):
                error("missing_required_parameter", "Each request needs a body object.", number, "body")
                continue
            model = body.get("model")
            if not isinstance(model, str):
                error("missing_required_parameter", "The request body needs a model.", number, "body.model")
                continue
            models.add(model)
            if len(models) > 1:
                error("model_mismatch", "The model of this request differs from the model of the other requests "
                                        "in the file; a batch uses one model.", number, "body.model")
                continue
            if model != cfg.model:
                error("model_not_found", f"The model '{model}' does not exist or you do not have access to it.",
                      number, "body.model")
                continue
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                error("invalid_request", "The request body needs a non-empty messages list.", number, "body.messages")
                continue
            requests.append((custom_id, body))
        _validated(b, at, errors, requests)

    def _validate_openrouter(self, b: _Batch, at: float) -> None:
        """The checks OpenRouter makes after acceptance: the batch's model served, each custom_id
        non-empty and unique, each body's model (if named) the batch's, messages present. Any error
        fails the batch (``error.message`` names the request) and runs nothing."""
        errors: list[dict[str, Any]] = []
        requests: list[tuple[str, dict[str, Any]]] = []
        seen: set[str] = set()
        if b.model != self._app.config.model:
            errors.append({"message": f"Model '{b.model}' is not available for batches.", "line": None})
        for i, r in enumerate(b.inline if not errors else ()):
            custom_id, body = r["custom_id"], r["body"]
            where = f"requests[{i}] (custom_id {custom_id!r})"
            problem = None
            if not custom_id:
                problem = "custom_id must not be empty"
            elif custom_id in seen:
                problem = "custom_id repeats an earlier request's; each custom_id must be unique within the batch"
            elif body.get("model", b.model) != b.model:
                problem = f"the body's model {body['model']!r} differs from the batch's model {b.model!r}"
            elif not isinstance(body.get("messages"), list) or not body["messages"]:
                problem = "the body needs a non-empty messages list"
            seen.add(custom_id)
            if problem is not None:
                errors.append({"message": f"{where}: {problem}", "line": i})
                continue
            requests.append((custom_id, {**body, "model": b.model}))  # a body without a model takes the batch's
        _validated(b, at, errors, requests)

    def _run(self, b: _Batch, until: float) -> None:
        """Answer the requests whose turn has come by ``until`` (one after another, in file order)."""
        total = len(b.requests)
        due = total if b.per_request == 0 else min(total, max(0, math.floor((until - b.start) / b.per_request)))
        while b.done < due:
            custom_id, body = b.requests[b.done]
            status, answer = self._answer(body)
            line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                    "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": answer},
                    "error": None}
            b.lines.append(line)
            b.done += 1
            if status == 200:
                b.completed += 1
                self._counts["completed"] += 1
                self._answered[custom_id] += 1
            else:
                b.failed += 1
                self._counts["failed"] += 1

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One request, as ``/v1/chat/completions`` answers it (no faults but the batch's own, no queueing)."""
        app = self._app
        cfg = app.config
        if cfg.rate_batch_request_error and app._chance.random() < cfg.rate_batch_request_error:
            return 500, _decode_any(_error_body(500, "Internal server error (emulated)"))
        try:
            req = _decode_chat(_encode(body))
            prompt_tokens = app._vocab.count(_chatml(req.messages))
            cap = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
            if cfg.max_output_tokens is not None and cap is not None and cap > cfg.max_output_tokens:
                message = f"max_tokens ({cap}) exceeds the maximum output of {cfg.max_output_tokens} tokens for this model"
                return 400, _decode_any(_error_body(400, message, error_type="max_tokens_exceeded"))
            app._check_context(prompt_tokens, cap, chat=True)
        except _HttpError as exc:
            return exc.reply.status, _decode_any(exc.reply.body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return 400, _decode_any(_error_body(400, str(exc)))
        created = int(time.time())
        reasoning_ids, answer, stopped = app._draw(b"m" + _encode_sorted(req.messages), cap, reasoning=True)
        n = len(reasoning_ids) + len(answer)
        app._account(prompt_tokens, n)
        payload = app._completion(
            f"gen-{created}-{next(app._ids)}", created, req.model or cfg.model,
            app._vocab.decode(answer[:-1] if stopped else answer),
            app._vocab.decode(reasoning_ids) if reasoning_ids else None,
            "stop" if stopped else "length", prompt_tokens, n, len(reasoning_ids),
        )
        usage = payload["usage"]  # the batch price, as a provider that reports cost bills it
        usage["cost"] *= cfg.batch_price_factor
        if usage["cost_details"]["upstream_inference_cost"] is not None:
            usage["cost_details"]["upstream_inference_cost"] *= cfg.batch_price_factor
        return 200, payload

    def _end(self, b: _Batch, status: str, at: float) -> None:
        """A terminal status: unfinished requests go to the error file with the reason, files are written."""
        undone = _UNDONE.get(status)
        if undone is not None:
            code, message = undone
            for custom_id, _ in b.requests[b.done:]:
                b.lines.append({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                                "error": {"code": code, "message": message}})
                b.failed += 1
                self._counts["failed"] += 1
            b.done = len(b.requests)
        b.status = status
        b.stamps[f"{status}_at"] = b.wall(at)
        if b.shape == "openrouter":
            return  # results inline in the batch object, no files
        good: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        for line in b.lines:
            (good if line["response"] is not None and line["response"]["status_code"] == 200 else bad).append(line)
        b.output_file_id = self._write(b, "output", good)
        b.error_file_id = self._write(b, "error", bad)

    def _write(self, b: _Batch, kind: str, lines: list[dict[str, Any]]) -> str | None:
        if not lines:
            return None
        content = b"".join(_encode(line) + b"\n" for line in lines)
        file = _File(f"file-{uuid.uuid4().hex[:24]}", f"{b.id}_{kind}.jsonl", "batch_output", int(time.time()), content)
        self._files[file.id] = file
        return file.id

