"""The two wire shapes of provider batch APIs, behind one small interface (ops/batch-apis.md).

OpenAI's (OpenAI, Azure, Together, Groq and others): upload a JSONL file to ``/files``, create a
batch naming it, poll, download the output and error files; cancellable. OpenRouter's: one
``POST /batches`` with the requests inline (``endpoint`` and ``model`` serialized before
``requests``: the server stream-parses the body), results inline once the batch is terminal; no
cancel is documented, so its batches are waited for. Both carry the fleet's own batch id in
``metadata``, so that a worker restarted between submitting and recording the provider's id finds
its batch instead of submitting it again.

HTTP errors are the cloud worker's (``CloudChat._classify``): 401 and a 402 for credits halt,
429 and 5xx are retried with Retry-After; a 4xx on submit is the batch's own fault
(:class:`BatchRefused`): its prompts go back to their queues with the reason.
"""

from __future__ import annotations

import json
import logging

import httpx
import msgspec

from draftfleet.http import make_client
from draftfleet.schemas.config import CloudBackend
from draftfleet.workers.backends import Halt, Permanent, Transient, parse_retry_after
from draftfleet.workers.cloud import CloudChat

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
CHAT_ENDPOINT = "/v1/chat/completions"
FIND_PAGES = 100  # pages of 100 batches find() reads at most, back to the batch's recording
FIND_SKEW_S = 3600.0  # the provider's clock against ours: pages are read this far before the recording

log = logging.getLogger("draftfleet.worker")


class BatchRefused(Exception):
    """The provider refused the batch as a whole (validation): nothing of it runs."""


class BatchResult(msgspec.Struct, frozen=True):
    """One request's outcome: the endpoint's answer (``status_code``, ``body``) or an error
    outside HTTP (``error_code``: batch_expired, batch_cancelled, request_timeout...)."""

    custom_id: str
    status_code: int = 0
    body: dict | None = None
    error_code: str = ""
    error_message: str = ""


class BatchState(msgspec.Struct, frozen=True):
    status: str
    completed: int = 0
    failed: int = 0
    error: str = ""  # why a failed batch failed
    results: list[BatchResult] | None = None  # once terminal

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class _Client:
    """What both shapes share: an httpx client with the key (never shown), the cloud's error rules."""

    cancellable = True

    def __init__(self, name: str, cfg: CloudBackend, api_key: str):
        self.name = name
        self.cfg = cfg
        self.path = (cfg.batch_path or "/batches").rstrip("/")
        self._errors = CloudChat.__new__(CloudChat)  # only its error rules (_classify, _scrub)
        self._errors.name, self._errors.cfg, self._errors._secret = name, cfg, api_key
        self.client = make_client(4, connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.request_timeout_s,
                                  base_url=cfg.base_url.rstrip("/"),
                                  headers={"authorization": f"Bearer {api_key}", **cfg.headers}, trust_env=True)

    def _call(self, method: str, url: str, **kw) -> httpx.Response:
        try:
            resp = self.client.request(method, url, **kw)
        except httpx.TimeoutException:
            raise Transient("timeout", f"{self.name}'s batch API did not answer in time") from None
        except httpx.TransportError as exc:
            raise Transient("connection", f"{self.name}: {type(exc).__name__}") from None
        if resp.status_code < 300:
            return resp
        retry_after = parse_retry_after(resp.headers.get("retry-after"))
        try:
            out = resp.json()
        except ValueError:
            out = {}
        err = out.get("error") if isinstance(out, dict) else None
        err = err if isinstance(err, dict) else {"message": resp.text[:300]}
        fate = self._errors._classify(resp.status_code, err, retry_after, out.get("error_type") if isinstance(out, dict) else None)
        if isinstance(fate, (Permanent,)) or (isinstance(fate, Halt) and resp.status_code == 404):
            raise BatchRefused(f"{self.name}: {method} {url}: {fate}")
        raise fate

    def _json(self, resp: httpx.Response) -> dict:
        try:
            out = resp.json()
        except ValueError:
            raise Transient("bad_body", f"{self.name}'s batch API answered no JSON") from None
        if not isinstance(out, dict):
            raise Transient("bad_body", f"{self.name}'s batch API answered no JSON object")
        return out

    def find(self, local_id: str, since: float | None = None) -> str | None:
        """The provider's id of the batch this fleet submitted as ``local_id``, if any. The list is
        the account's, newest first, a page at a time (OpenAI's ``after``/``has_more``; OpenRouter's
        is one page): with ``since`` (when the batch was recorded, before it was sent) the pages are
        followed back to batches created before it (less :data:`FIND_SKEW_S` for the clocks), so that
        batches made since by anyone on the account do not hide ours; without, the first page only
        (a look at the API, or a batch just made)."""
        params: dict[str, object] = {"limit": 100}
        for _ in range(FIND_PAGES):
            out = self._json(self._call("GET", self.path, params=params))
            page = [b for b in out.get("data") or [] if isinstance(b, dict)]
            for b in page:
                if (b.get("metadata") or {}).get("draftfleet_batch") == local_id:
                    return str(b.get("id"))
            last = out.get("last_id") or (page[-1].get("id") if page else None)
            oldest = min((b["created_at"] for b in page if isinstance(b.get("created_at"), (int, float))), default=None)
            if (since is None or not out.get("has_more") or not last
                    or (oldest is not None and oldest < since - FIND_SKEW_S)):
                return None
            params = {"limit": 100, "after": last}
        log.warning("%s: batch %s not found in the account's last %d batches; taken as never submitted",
                    self.name, local_id, FIND_PAGES * 100)
        return None

    def close(self) -> None:
        self.client.close()


class OpenAIBatches(_Client):
    """The file-based shape: ``/files`` + ``/batches``, output and error files as JSONL."""

    def submit(self, local_id: str, model: str, requests: list[tuple[str, dict]]) -> tuple[str, str]:
        lines = b"".join(msgspec.json.encode({"custom_id": cid, "method": "POST", "url": CHAT_ENDPOINT, "body": body})
                         + b"\n" for cid, body in requests)
        up = self._json(self._call("POST", "/files", data={"purpose": "batch"},
                                   files={"file": (f"{local_id}.jsonl", lines, "application/jsonl")}))
        file_id = str(up.get("id") or "")
        if not file_id:
            raise Transient("bad_body", f"{self.name}: the file upload answered no id")
        out = self._json(self._call("POST", self.path, json={
            "input_file_id": file_id, "endpoint": CHAT_ENDPOINT, "completion_window": self.cfg.completion_window,
            "metadata": {"draftfleet_batch": local_id}}))
        return str(out["id"]), file_id

    def poll(self, provider_id: str) -> BatchState:
        out = self._json(self._call("GET", f"{self.path}/{provider_id}"))
        status = str(out.get("status"))
        counts = out.get("request_counts") or {}
        errors = list(dict.fromkeys(  # one line per distinct reason (a bad file repeats one per line)
            str(e.get("message", "")) for e in ((out.get("errors") or {}).get("data") or []) if isinstance(e, dict)))
        results = None
        if status in TERMINAL:
            results = []
            for fid in (out.get("output_file_id"), out.get("error_file_id")):
                if fid:
                    results += self._lines(str(fid))
        return BatchState(status, int(counts.get("completed") or 0), int(counts.get("failed") or 0),
                          "; ".join(errors)[:1000], results)

    def _lines(self, file_id: str) -> list[BatchResult]:
        resp = self._call("GET", f"/files/{file_id}/content")
        out = []
        for raw in resp.content.splitlines():
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            out.append(_result(line))
        return out

    def cancel(self, provider_id: str) -> None:
        self._call("POST", f"{self.path}/{provider_id}/cancel")


class OpenRouterBatches(_Client):
    """The inline shape: requests in the body (after ``endpoint`` and ``model``), results inline."""

    cancellable = False  # no cancel endpoint is documented (ops/batch-apis.md)

    def submit(self, local_id: str, model: str, requests: list[tuple[str, dict]]) -> tuple[str, str]:
        # Field order matters: dicts keep insertion order, and msgspec writes them in it.
        body = {"endpoint": CHAT_ENDPOINT, "model": model, "completion_window": self.cfg.completion_window,
                "metadata": {"draftfleet_batch": local_id},
                "requests": [{"custom_id": cid, "body": b} for cid, b in requests]}
        out = self._json(self._call("POST", self.path, content=msgspec.json.encode(body),
                                    headers={"content-type": "application/json"}))
        return str(out["id"]), ""

    def poll(self, provider_id: str) -> BatchState:
        out = self._json(self._call("GET", f"{self.path}/{provider_id}"))
        status = str(out.get("status"))
        counts = out.get("request_counts") or {}
        error = out.get("error")
        results = None
        if status in TERMINAL:
            results = [_result(r) for r in out.get("results") or [] if isinstance(r, dict)]
        return BatchState(status, int(counts.get("completed") or 0), int(counts.get("failed") or 0),
                          str((error or {}).get("message", "") if isinstance(error, dict) else error or "")[:1000],
                          results)

    def cancel(self, provider_id: str) -> None:
        raise NotImplementedError("OpenRouter documents no batch cancel")


def _result(line: dict) -> BatchResult:
    cid = str(line.get("custom_id") or "")
    resp = line.get("response")
    if isinstance(resp, dict):
        body = resp.get("body")
        return BatchResult(cid, int(resp.get("status_code") or 200), body if isinstance(body, dict) else None)
    err = line.get("error") if isinstance(line.get("error"), dict) else {}
    return BatchResult(cid, 0, None, str(err.get("code") or "error"), str(err.get("message") or "")[:300])


def batch_client(name: str, cfg: CloudBackend, api_key: str) -> OpenAIBatches | OpenRouterBatches:
    if cfg.batch == "openai":
        return OpenAIBatches(name, cfg, api_key)
    if cfg.batch == "openrouter":
        return OpenRouterBatches(name, cfg, api_key)
    raise ValueError(f"backend {name!r} has no batch API (batch = \"openrouter\" or \"openai\")")
