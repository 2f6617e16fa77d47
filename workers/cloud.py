"""The cloud backend: OpenAI-compatible chat completions (OpenRouter and the like) over httpx.

The API returns text; it is re-tokenized with the target tokenizer (``retokenized``) while the
provider's own counts and its real cost (OpenRouter ``usage.cost``) are kept beside ours.
OpenRouter reports errors three ways: an HTTP status, HTTP 200 with an ``error`` body, or a
choice with ``finish_reason: "error"``; all three are classified the same (a null ``error`` in a
success is no error). A 402 for the in-flight budget is transient (it carries Retry-After); out of
credits or a key limit halts. A 403 fails the prompt only when it is moderation (its metadata
names ``reasons``/``flagged_input``); a permission or guardrail block halts, as does a
``max_tokens`` over the model's limit (a setting, not the prompt). ``max_tokens`` is always sent:
OpenRouter reserves input + max_tokens per open request.
The API key lives only in the client's headers: it is scrubbed from anything we report.
"""

from __future__ import annotations

import httpx
import msgspec

from draftfleet.broker import redact
from draftfleet.http import make_client
from draftfleet.schemas.config import CloudBackend
from draftfleet.schemas.records import Message, PromptTask, Usage
from draftfleet.tokenizer import TargetTokenizer, TemplateError, TokenizerError
from draftfleet.workers.backends import BackendError, Generation, Halt, Permanent, Transient, parse_retry_after

_TRANSIENT_CODES = {408, 429, 500, 502, 503, 504, 520, 522, 524, 529}
_TRANSIENT_402 = {"openrouter_in_flight_budget", "in_flight_budget_exhausted"}


def _message(m: Message) -> dict:
    """A chat message as sent. An earlier answer of the conversation carries its reasoning as
    OpenRouter returned it (``reasoning``): the provider renders it with the model's own template,
    which keeps or drops it as the model expects (Kimi-K2.5 blanks it, Qwen3 drops it from earlier
    turns), as the GPU path's render of the same history does."""
    out = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        out["reasoning"] = m.reasoning
    return out


class CloudChat:
    kind = "cloud"

    def __init__(self, name: str, cfg: CloudBackend, tokenizer: TargetTokenizer, api_key: str):
        self.name = name
        self.cfg = cfg
        self.concurrency = cfg.concurrency
        self.endpoint = redact(cfg.base_url.rstrip("/"))
        self.tokenizer = tokenizer
        self._secret = api_key
        headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json", **cfg.headers}
        self.client = make_client(
            cfg.concurrency,
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.request_timeout_s,
            base_url=cfg.base_url.rstrip("/"),
            headers=headers,
            trust_env=True,
        )

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    def _classify(self, status: int, error: dict, retry_after: float | None, error_type: object = None) -> Exception:
        """The fate an OpenRouter error decides (``error_type``: the body's canonical top-level one)."""
        code = error.get("code", status)
        try:
            code = int(code)
        except (TypeError, ValueError):
            code = status
        message = self._scrub(str(error.get("message", "")))[:300]
        meta = error.get("metadata") if isinstance(error.get("metadata"), dict) else {}
        if retry_after is None:  # an in-body error says when to try again in its metadata
            retry_after = parse_retry_after(str(meta.get("retry_after_seconds") or ""))
        # The precise error type: top level (OpenRouter's canonical field), in the metadata, or as a string code.
        kinds = {str(k) for k in (error_type, meta.get("error_type"), error.get("type"), error.get("code")) if k}
        if "max_tokens_exceeded" in kinds:
            return Halt("max_tokens_exceeded", f"{self.name}: max_tokens is over {self.cfg.model}'s output limit "
                        f"(400 max_tokens_exceeded: {message}): lower datasets[].max_tokens for this backend")
        if "insufficient_quota" in kinds:  # OpenAI's "no credits" is a 429 that no wait cures: as a 402
            return Halt("payment_required", f"{self.name}: the account's quota is used up ({status} "
                        f"insufficient_quota): {message}")
        if code == 401:
            return Halt("unauthorized", f"{self.name}: the API key was refused (401): {message}")
        if code == 402:
            source = str(meta.get("limit_source", "")) + " " + str(meta.get("reason", ""))
            if any(t in source for t in _TRANSIENT_402):
                return Transient("in_flight_budget", message, retry_after)
            return Halt("payment_required", f"{self.name}: payment required (402, {source.strip() or 'credits'}): {message}")
        if code == 404:
            return Halt("not_found", f"{self.name}: model or endpoint not found (404): {message}")
        if code in _TRANSIENT_CODES or code >= 500:
            return Transient(f"http_{code}", message, retry_after)
        if code == 403:
            if "reasons" in meta or "flagged_input" in meta:
                return Permanent("moderation", f"{message} (reasons: {meta.get('reasons')})")
            kind = ", ".join(sorted(kinds - {"403"})) or "permission denied or guardrail block"
            return Halt("forbidden", f"{self.name}: the API refused this key or its guardrail blocked the request "
                        f"(403, {kind}): {message}: check the key's permissions and guardrails")
        return Permanent(f"http_{code}", message)

    def generate(self, task: PromptTask) -> Generation:
        s = task.settings
        body = {
            **self.cfg.extra_body,
            "model": self.cfg.model,
            "messages": [_message(m) for m in task.messages],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        try:
            resp = self.client.post("/chat/completions", content=msgspec.json.encode(body))
        except httpx.TimeoutException:
            raise Transient("timeout", f"{self.name} did not answer in time") from None
        except httpx.TransportError as exc:
            raise Transient("connection", f"{self.name}: {type(exc).__name__}") from None
        retry_after = parse_retry_after(resp.headers.get("retry-after"))
        try:
            out = msgspec.json.decode(resp.content)
        except msgspec.DecodeError:
            if resp.status_code != 200:
                raise self._classify(resp.status_code, {"message": resp.text[:200]}, retry_after) from None
            raise Transient("bad_body", "response is not JSON") from None
        if not isinstance(out, dict):
            raise Transient("bad_body", "response is not a JSON object")
        error = out.get("error")
        if resp.status_code != 200 or error is not None:
            err = error if isinstance(error, dict) else {"message": str(error or resp.text[:200])}
            raise self._classify(resp.status_code, err, retry_after, out.get("error_type"))
        usage = self._usage(out.get("usage") or {})
        try:
            return self._answer(task, out, usage, retry_after)
        except BackendError as exc:  # billed all the same (an empty answer, one not re-tokenizable), unless
            # nothing was generated (OpenRouter's zero completion insurance bills such answers nothing)
            if usage.cost_usd is not None or usage.completion_tokens:
                exc.paid_usd = self._cost(usage, usage.prompt_tokens, usage.completion_tokens)[0]
            raise

    def _answer(self, task: PromptTask, out: dict, usage: Usage, retry_after: float | None) -> Generation:
        """The generation in a 200 answer, or the error it holds."""
        choices = out.get("choices") or []
        if not choices:
            raise Transient("bad_body", "no choices in the response")
        choice = choices[0]
        finish = choice.get("finish_reason") or choice.get("native_finish_reason") or ""
        if finish == "error":
            raise self._classify(200, choice.get("error") or {"code": 502, "message": "finish_reason error"}, retry_after)
        if finish == "content_filter":
            raise Permanent("content_filter", "the provider filtered the answer")
        message = choice.get("message") or {}
        text = message.get("content") or ""
        reasoning = message.get("reasoning") or message.get("reasoning_content") or None
        if not text and not reasoning:
            raise Transient("empty_response", f"finish_reason {finish!r} with no content")
        stopped = finish in ("stop", "eos", "end_turn")
        try:
            ids = self.tokenizer.completion_ids(task.messages, text, reasoning, stopped=stopped)
        except TemplateError as exc:  # every answer would fail alike: a setting must change
            raise Halt("chat_template", str(exc)) from None
        except TokenizerError as exc:
            raise Permanent("retokenize", str(exc)) from None
        truncated = finish == "length"
        if len(ids) > task.settings.max_tokens:
            # The provider counts with its own tokenizer: in the target's, the answer may run past
            # the max_tokens it was asked with (what the budget reserved for it). It is cut there, so
            # no answer counts more than was reserved, and stored as cut; its text is the cut ids'.
            ids = ids[:task.settings.max_tokens]
            text, reasoning = self.tokenizer.split_reasoning(task.messages, ids)
            stopped, truncated = False, True
        prompt_ids = self.tokenizer.prompt_ids(task.messages)
        ours_prompt = len(prompt_ids)
        cost, source = self._cost(usage, usage.prompt_tokens or ours_prompt, usage.completion_tokens or len(ids))
        return Generation(
            text=text,
            reasoning=reasoning,
            output_ids=ids,
            prompt_ids=prompt_ids,
            prompt_tokens=ours_prompt,
            finish_reason="stop" if stopped else ("length" if truncated else str(finish)),
            truncated=truncated,
            token_source="retokenized",
            usage=usage,
            cost_usd=float(cost),
            cost_source=source,
            model=str(out.get("model") or self.cfg.model),
        )

    def _cost(self, usage: Usage, prompt_tokens: int, completion_tokens: int) -> tuple[float, str]:
        """What an answer was billed, and by whose figure: the provider's own cost when it reports
        one, else the configured prices for these counts."""
        if usage.cost_usd is not None:
            # BYOK: usage.cost is only OpenRouter's fee; the provider bills its own charge too.
            return usage.cost_usd + ((usage.is_byok and usage.upstream_cost_usd) or 0.0), "provider"
        if self.cfg.price_input_per_mtok or self.cfg.price_output_per_mtok:
            return (prompt_tokens * self.cfg.price_input_per_mtok / 1e6
                    + completion_tokens * self.cfg.price_output_per_mtok / 1e6), "price_table"
        return 0.0, "none"

    @staticmethod
    def _usage(u: dict) -> Usage:
        def num(d: dict, k: str) -> int:
            v = d.get(k) if isinstance(d, dict) else None
            return int(v) if isinstance(v, (int, float)) else 0

        cost = u.get("cost")
        upstream = (u.get("cost_details") or {}).get("upstream_inference_cost") if isinstance(u.get("cost_details"), dict) else None
        return Usage(
            prompt_tokens=num(u, "prompt_tokens"),
            completion_tokens=num(u, "completion_tokens"),
            cached_tokens=num(u.get("prompt_tokens_details") or {}, "cached_tokens"),
            reasoning_tokens=num(u.get("completion_tokens_details") or {}, "reasoning_tokens"),
            cost_usd=float(cost) if isinstance(cost, (int, float)) else None,
            upstream_cost_usd=float(upstream) if isinstance(upstream, (int, float)) else None,
            is_byok=u.get("is_byok") if isinstance(u.get("is_byok"), bool) else None,
        )

    def close(self) -> None:
        self.client.close()
