"""Every message and record the fleet writes or sends, as msgspec Structs.

The prompt task is the Celery payload (JSON only); the response record is the one file the
store holds per key; the failure record is what a task leaves when its retries are exhausted.
Fields are append-only within a schema version so that old stores stay readable.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 1

TokenSource = Literal["exact", "retokenized"]
BackendKind = Literal["gpu", "cloud"]


class Message(msgspec.Struct, frozen=True):
    """One chat turn of a prompt."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class GenerationSettings(msgspec.Struct, frozen=True):
    """The settings that define what a response *is*: they enter every prompt key."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    system_prompt: str | None = None


class PromptTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One prompt to generate: the Celery task argument.

    Delivery is at-least-once; ``key`` is the idempotency key: the store keeps one result per key.
    The task never names a backend: whoever consumes the dataset's queue generates it.
    """

    key: str
    dataset: str
    source: str
    messages: list[Message]
    settings: GenerationSettings
    settings_id: str
    enqueued_at: float
    v: int = SCHEMA_VERSION
    deferrals: int = 0


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """The backend's own accounting, kept beside ours (cloud counts use the provider's tokenizer)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = None
    upstream_cost_usd: float | None = None
    is_byok: bool | None = None


class ResponseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The one stored result of a prompt: ``<store>/<dataset>/<key[:2]>/<key>.json``.

    ``output_ids`` run through the end-of-turn token when the generation stopped; for
    ``exact`` records they are SGLang's own ids, for ``retokenized`` ones the target tokenizer's
    encoding of the returned text. ``completion_tokens`` is ``len(output_ids)``.
    """

    schema_version: int = SCHEMA_VERSION
    key: str
    dataset: str
    source: str
    settings_id: str
    messages: list[Message]
    system_prompt_used: bool
    text: str
    reasoning: str | None = None
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    truncated: bool
    backend: str
    backend_kind: BackendKind
    model: str
    token_source: TokenSource
    usage: Usage
    cost_usd: float
    cost_source: Literal["provider", "price_table", "none"]
    latency_s: float
    attempts: int
    worker: str
    created_at: float
    retry_reasons: list[str] = []


class FailureRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A task whose retries ran out: kept with its task so that ``draftfleet requeue`` can resend it."""

    schema_version: int = SCHEMA_VERSION
    key: str
    dataset: str
    source: str
    reason: str
    error_kind: str
    attempts: int
    backend: str
    worker: str
    failed_at: float
    task: PromptTask


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A queue message that could not be read as a task (not JSON, wrong schema, too large)."""

    queue: str
    reason: str
    body_preview: str
    received_at: float
    worker: str


class DatasetManifest(msgspec.Struct, frozen=True, kw_only=True):
    """Per-dataset record of the content-defining settings, so a resume never mixes settings."""

    schema_version: int = SCHEMA_VERSION
    name: str
    version: int
    settings: GenerationSettings
    settings_id: str
    budget_tokens: int | None
    created_at: float
    previous: list[GenerationSettings] = []


class QuarantineEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One rejected input line, kept verbatim (``raw``, or ``raw_b64`` when it is not UTF-8).

    A line over the reader's limit is never held whole: ``raw``/``raw_b64`` then keep its first
    bytes only, and ``line_bytes`` and ``line_sha256`` identify the whole line.
    """

    file: str
    line: int | None
    field: str | None
    kind: str
    message: str
    raw: str | None = None
    raw_b64: str | None = None
    at: float
    line_bytes: int | None = None
    line_sha256: str | None = None
