"""The GPU backend: SGLang's native ``/generate`` with exact token ids.

The prompt goes in as ``input_ids`` built with the target tokenizer's chat template, so the ids
the model saw are the ids we record. SGLang's own ``output_ids`` are stored (``exact``); when the
server omits the matched end-of-turn id from them, it is appended so every stopped record ends
with it. Many requests are kept open at once by the worker's threads: SGLang batches them.
"""

from __future__ import annotations

import time

import httpx
import msgspec

from draftfleet.broker import redact
from draftfleet.http import make_client
from draftfleet.schemas.config import SGLangBackend as SGLangSettings
from draftfleet.schemas.records import PromptTask, Usage
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.backends import Generation, Permanent, Transient, parse_retry_after

_decode = msgspec.json.decode


class ServerDown(Transient):
    """The server does not answer at all: the prompt is not at fault, so it is never failed."""


class SGLangClient:
    kind = "gpu"

    def __init__(self, url: str, settings: SGLangSettings, tokenizer: TargetTokenizer, *, inflight: int, name: str = "sglang"):
        self.name = name
        self.url = url.rstrip("/")
        self.endpoint = redact(self.url)
        self.concurrency = inflight
        self.tokenizer = tokenizer
        self.client = make_client(
            inflight,
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.request_timeout_s,
            base_url=self.url,
        )
        self.model = ""

    def healthy(self) -> bool:
        """Whether the server answers ``/health`` now (a paused worker resumes as soon as it does)."""
        try:
            return self.client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ``/health`` (attach mode), then learn its model path."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client.get("/health", timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerDown("server_down", f"{self.url} did not answer /health within {timeout:.0f}s")
            time.sleep(1.0)
        try:
            info = self.client.get("/get_model_info", timeout=10.0).json()
            self.model = str(info.get("model_path") or "")
        except (httpx.HTTPError, ValueError):
            self.model = ""

    def generate(self, task: PromptTask) -> Generation:
        s = task.settings
        input_ids = self.tokenizer.prompt_ids(task.messages)
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stop_token_ids": [self.tokenizer.eot_id],
            },
        }
        try:
            resp = self.client.post("/generate", content=msgspec.json.encode(body), headers={"content-type": "application/json"})
        except httpx.ConnectError as exc:
            raise ServerDown("server_down", f"{self.url}: {exc}") from None
        except httpx.TimeoutException:
            raise Transient("timeout", f"{self.url} did not answer in time") from None
        except httpx.TransportError as exc:
            raise Transient("connection", f"{self.url}: {type(exc).__name__}") from None
        if resp.status_code >= 500 or resp.status_code in (408, 429):
            raise Transient(f"http_{resp.status_code}", resp.text[:200], parse_retry_after(resp.headers.get("retry-after")))
        if resp.status_code != 200:
            raise Permanent(f"http_{resp.status_code}", resp.text[:300])
        try:
            out = _decode(resp.content)
        except msgspec.DecodeError:
            raise Transient("bad_body", "response is not JSON") from None
        if isinstance(out, list):  # a batch answer to a single prompt: take its only element
            out = out[0] if out else {}
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        ftype = finish.get("type") if isinstance(finish, dict) else str(finish)
        if ftype == "abort":
            raise Transient("abort", str(finish.get("message", ""))[:200])
        ids = out.get("output_ids") or out.get("token_ids") or meta.get("output_ids")
        if not isinstance(ids, list):
            raise Transient("bad_body", "no output_ids in the response (is this SGLang's /generate?)")
        ids = [int(i) for i in ids]
        if ftype == "stop":
            matched = finish.get("matched")
            if isinstance(matched, int) and (not ids or ids[-1] != matched):
                ids.append(matched)
        elif ftype != "length":
            raise Transient("finish_" + str(ftype), "unexpected finish_reason")
        prompt_tokens = int(meta.get("prompt_tokens") or len(input_ids))
        return Generation(
            text=str(out.get("text", "")),
            output_ids=ids,
            prompt_tokens=prompt_tokens,
            finish_reason=ftype,
            truncated=ftype == "length",
            token_source="exact",
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=int(meta.get("completion_tokens") or len(ids)),
                cached_tokens=int(meta.get("cached_tokens") or 0),
            ),
            cost_usd=0.0,
            cost_source="none",
            model=self.model or s.model,
        )

    def close(self) -> None:
        self.client.close()
