"""What every backend returns and raises, and the retry policy they share.

A backend turns one prompt into one :class:`Generation` or raises one of three errors, which
decide the fate of the task: :class:`Transient` is retried with backoff (honouring Retry-After),
:class:`Permanent` becomes a failure record, :class:`Halt` stops the worker consuming and leaves
the task queued (bad key, no credits: a person must act; nothing is burned into failures).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec

from draftfleet.schemas.config import MAX_RETRY_WAIT_S
from draftfleet.schemas.records import BackendKind, PromptTask, TokenSource, Usage


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    reasoning: str | None = None
    output_ids: list[int]
    prompt_ids: list[int] = []  # the target template's render of the messages (what an engine received)
    prompt_tokens: int
    finish_reason: str
    truncated: bool
    token_source: TokenSource
    usage: Usage
    cost_usd: float
    cost_source: Literal["provider", "price_table", "none"]
    model: str


class BackendError(Exception):
    """What a backend raises. ``paid_usd``: what the attempt was billed although its answer cannot
    be used (empty, or not re-tokenizable): the spend, and its cap, must see it all the same."""

    paid_usd: float = 0.0


class Transient(BackendError):
    """Worth another try: 429, 5xx, timeouts, dropped connections, aborted generations."""

    def __init__(self, reason: str, detail: str = "", retry_after: float | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.retry_after = retry_after


class Permanent(BackendError):
    """This prompt cannot succeed as sent (400 invalid request, 403 moderation)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Halt(BackendError):
    """The backend cannot serve anything until a person acts (401 bad key, 402 out of credits).

    ``ready``, when given, tells cheaply whether the cause is gone (a key accepted again), so the
    paused worker resumes at once instead of after its whole pause.
    """

    def __init__(self, reason: str, detail: str = "", ready: Callable[[], bool] | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.ready = ready


class Backend(Protocol):
    name: str
    kind: BackendKind
    concurrency: int
    endpoint: str  # the server URL or API base URL, shown by status (never holds a secret)

    def generate(self, task: PromptTask) -> Generation: ...

    def close(self) -> None: ...


def backoff_s(attempt: int, retry_after: float | None, base: float = 1.0, cap: float = 60.0) -> float:
    """Exponential backoff with full jitter; a server's Retry-After is a floor, never shortened."""
    delay = random.uniform(0, min(cap, base * 2 ** (attempt - 1)))
    if retry_after is not None:
        delay = max(delay, min(retry_after, MAX_RETRY_WAIT_S))
    return delay


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # HTTP-date form: fall back to our own backoff
