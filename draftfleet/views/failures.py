"""What did not make it, and what to do about it: prompts whose retries ran out, and input lines
the readers quarantined, read from the store alone.

A failure's kind says whether sending the prompt again can help: a passing error (a timeout, a
5xx, a 429) may well succeed next time; a prompt over the model's context, or one the chat template
refuses, fails the same way every time, and ``enqueue --retry-failed`` would only pay for it again.
"""

from __future__ import annotations

import re
from collections import Counter

import msgspec

from draftfleet.store import Store

# How engines and providers word a prompt over the context (vLLM, SGLang, OpenAI, OpenRouter).
_CONTEXT = re.compile(r"maximum context length|context length|context window|prompt is too long|"
                      r"longer than the model|exceeds the model", re.I)
_PASSING = {"timeout", "connection", "bad_body", "empty_response", "abort", "internal", "in_flight_budget",
            "server_down"}


class FailureRow(msgspec.Struct, kw_only=True):
    dataset: str
    key: str
    source: str
    kind: str
    attempts: int
    reason: str  # whole: the engine's message often carries the token counts
    retry: str  # "yes", "maybe" or "no": can enqueue --retry-failed help?
    advice: str


class QuarantineRow(msgspec.Struct, kw_only=True):
    dataset: str
    kind: str
    lines: int
    first: str  # the first such line's message (file, line, field, reason)
    file: str  # the quarantine file, which keeps every line verbatim


def retry_verdict(kind: str, reason: str) -> tuple[str, str]:
    """Whether sending the prompt again can succeed, and what to do instead when it cannot."""
    if kind == "context_length" or _CONTEXT.search(reason):
        return "no", ("over the model's context with max_tokens; lower the dataset's max_tokens "
                      "(enqueue --new-version) or leave the prompt out")
    if kind == "chat_template":
        return "no", "the chat template refuses these messages; change the row or the template"
    if kind == "moderation":
        return "no", "the provider's moderation refused the prompt; a GPU worker may answer it"
    if kind == "content_filter":
        return "maybe", "the provider filtered this answer; a new sample may pass"
    if kind == "retokenize":
        return "maybe", "the target tokenizer could not re-tokenize this cloud answer; a new one, or a GPU's, may do"
    code = int(kind[5:]) if kind.startswith("http_") and kind[5:].isdigit() else None
    if code is not None and (code in (408, 409, 425, 429) or code >= 500):
        return "yes", f"a passing error (HTTP {code})"
    if code is not None:
        return "no", f"the server refused the request (HTTP {code}); change the settings it names"
    if kind in _PASSING or kind.startswith(("finish_", "hidden_states")):
        return "yes", "a passing error"
    return "maybe", "an error of unknown kind; see its reason"


def failure_rows(store: Store, datasets: list[str]) -> list[FailureRow]:
    rows = []
    for name in datasets:
        for f in store.failures(name):
            retry, advice = retry_verdict(f.error_kind, f.reason)
            rows.append(FailureRow(dataset=f.dataset, key=f.key, source=f.source, kind=f.error_kind,
                                   attempts=f.attempts, reason=f.reason, retry=retry, advice=advice))
    return rows


def quarantine_rows(store: Store, datasets: list[str]) -> list[QuarantineRow]:
    """Each dataset's quarantined lines by kind, with the first one's message."""
    rows = []
    for name in datasets:
        counts: Counter[str] = Counter()
        first: dict[str, str] = {}
        for e in store.quarantined(name):
            counts[e.kind] += 1
            first.setdefault(e.kind, e.message)
        path = store.quarantine_location(name)
        rows += [QuarantineRow(dataset=name, kind=k, lines=n, first=first[k], file=path)
                 for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return rows
