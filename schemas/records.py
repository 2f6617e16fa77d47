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
# The ``worker`` of a record brought in by ``draftfleet import``: made elsewhere, earlier (no backend's rate).
IMPORTED_BY = "import"
BackendKind = Literal["gpu", "cloud"]


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """One chat turn of a prompt.

    In a task, an ``assistant`` message with empty content only marks where the target answers
    (multi-turn datasets); the dataset's own answers are never kept. ``reasoning`` is set on the
    fleet's regenerated answers when they become the history of the next turn.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    reasoning: str | None = None


class GenerationSettings(msgspec.Struct, frozen=True):
    """The settings that define what a response *is*: they enter every prompt key."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    system_prompt: str | None = None
    # "first": answer the turns before the first assistant turn; "all": regenerate every assistant
    # turn of the conversation. Left out of the key while it is the default (identity.py).
    turns: Literal["first", "all"] = "first"


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
    row_id: str | None = None  # the row's own id in the dataset (not part of the key)
    batch_attempts: int = 0  # provider batches it came back from (expired, an error): workers/batch.py


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """The backend's own accounting, kept beside ours (cloud counts use the provider's tokenizer)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = None
    upstream_cost_usd: float | None = None
    is_byok: bool | None = None


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """An answer and what it took: the fields a :class:`Turn` and a :class:`ResponseRecord` share.

    ``output_ids`` run through the end-of-turn token when the generation stopped; for ``exact``
    answers they are the engine's own ids, for ``retokenized`` ones the target tokenizer's encoding
    of the returned text. A thinking model's reasoning is in ``reasoning``, its answer in ``text``,
    for both kinds.
    """

    output_ids: list[int]
    text: str
    reasoning: str | None = None
    finish_reason: str
    truncated: bool
    prompt_tokens: int
    completion_tokens: int
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


class Turn(Answer, frozen=True, kw_only=True):
    """One regenerated assistant turn of a conversation (datasets with ``turns = "all"``).

    ``prompt_ids`` are the target template's render of the conversation so far with the fleet's
    own earlier answers (what an engine received). Each turn keeps the backend that made it: a
    conversation may move between workers.
    """

    prompt_ids: list[int]


class TurnProgress(msgspec.Struct, frozen=True, kw_only=True):
    """The completed turns of a conversation still being generated, kept in the store so that a
    worker's death or a retry never pays for a completed turn twice."""

    schema_version: int = SCHEMA_VERSION
    key: str
    dataset: str
    turns: list[Turn]


class ResponseRecord(Answer, frozen=True, kw_only=True):
    """The one stored result of a prompt: ``<store>/<dataset>/<key[:2]>/<key>.json``.

    Its :class:`Answer` fields are the prompt's answer; ``completion_tokens`` is ``len(output_ids)``.

    A conversation (``turns`` non-empty) holds every regenerated turn; the top-level answer
    fields are its last turn's, and the counts, cost, usage and attempts are the sums over its
    turns. A turn cut by ``max_tokens`` ends the conversation: ``truncated`` is then true and the
    conversation has fewer turns than user turns.
    """

    schema_version: int = SCHEMA_VERSION
    key: str
    dataset: str
    source: str
    settings_id: str
    messages: list[Message]
    system_prompt_used: bool
    row_id: str | None = None  # the row's own id in the dataset
    turns: list[Turn] = []
    # the provider batch that made it (``draftfleet worker batch``): its cost is the batch price and its
    # latency the time since the batch was submitted, so plan and inventory keep it off the sync side's.
    # Unset (not null) on every other record: absent from its JSON, so records written before it
    # encode to the same bytes (falsy either way: readers test ``getattr(rec, "batch_id", None)``)
    batch_id: str | None | msgspec.UnsetType = msgspec.UNSET


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


class ChargeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A generation paid for that no stored record carries (a twin stored the key first; an answer
    billed but unusable): kept in the store under its ``id`` so that a spend rebuilt from the store
    after Redis lost its counters still holds it, and counted once into the spend by that id."""

    schema_version: int = SCHEMA_VERSION
    id: str  # <ns since the epoch>-<random hex>: unique, and the store's order
    backend: str
    cost_usd: float
    dataset: str
    key: str
    reason: str  # twin_stored, or the backend's error kind (empty_answer, not_retokenizable...)
    worker: str
    at: float


BatchRequestState = Literal["open", "stored", "returned", "failed"]


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of a provider batch, as the batch worker holds it in the store: the task (so a
    restart, or a fleet whose Redis was flushed, can store its answer or send it back without the
    queue), what admission granted it (its max_tokens as sent, held against the budget until it is
    counted) and the most it can cost at the batch price (held against the spend cap)."""

    task: PromptTask
    granted: int
    hold_micro_usd: int = 0
    digest: str  # sha256 of the request line as submitted
    state: BatchRequestState = "open"
    reason: str = ""  # why it was returned or failed


class BatchRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A batch submitted to a provider's batch API: ``<store>/_batches/<id>.json``, written before
    its prompts' messages are acknowledged, replaced whole as it advances. While it is open its
    prompts are held by it (``enqueue`` and the rebuild after a Redis flush read it): nothing is
    submitted twice and its reservations outlive Redis. ``provider_id`` is empty until the provider
    accepted it; a worker restarted before that finds it by ``id`` in the batch's metadata first."""

    schema_version: int = SCHEMA_VERSION
    id: str  # b<ns>-<hex>: the fleet's own, sent as metadata
    backend: str
    shape: Literal["openrouter", "openai"]
    dataset: str
    model: str
    provider_id: str = ""
    input_file_id: str = ""
    status: str = "submitting"  # the provider's status once submitted
    window: str = "24h"
    worker: str
    submitted_at: float
    updated_at: float
    completed: int = 0  # the provider's request counts
    failed: int = 0
    cancel_requested: bool = False
    cancellable: bool = True
    closed: bool = False  # every request stored, returned or failed: it holds nothing any more
    error: str = ""
    requests: list[BatchRequest] = []

    def open_requests(self) -> list[BatchRequest]:
        return [q for q in self.requests if q.state == "open"]


class BatchSummary(msgspec.Struct, frozen=True, kw_only=True):
    """An open provider batch as ``status`` and ``plan`` show it (``rk.BATCHES``, kept by the batch
    workers at each poll; the store's :class:`BatchRecord` is the truth)."""

    id: str
    backend: str
    dataset: str
    provider_id: str
    status: str
    prompts: int
    granted_tokens: int  # what its prompts hold against the budget
    completed: int
    failed: int
    submitted_at: float
    updated_at: float
    window: str
    cancellable: bool
    cancel_requested: bool
    held_prompts: int = 0  # its prompts not answered yet: neither queued nor stored, the plan's "left" all the same


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a running worker publishes each heartbeat at ``rk.worker_report`` (a TTL of three
    beats: a killed worker drops out); ``draftfleet status`` and ``pivot`` read it."""

    hostname: str
    kind: str  # gpu, cloud or capture
    backend: str
    endpoint: str = ""
    datasets: list[str] = []  # those it may consume now (followed and assigned to its kind)
    follows: list[str] = []  # every dataset it follows, assigned to its kind or not (a pivot's target)
    queues: list[str] = []  # consumed now
    inflight: dict[str, int] = {}  # dataset -> tasks running
    slots: int = 0
    paused: str | None = None  # why it stopped consuming
    waiting: str | None = None  # starting up: waiting for its server (what it waits for)
    pid: int = 0
    at: float = 0.0  # when it was published


class DatasetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's decision on a dataset, kept in the store (``_log/<dataset>.jsonl``) for the
    report's timelines: a pivot or drain (``assigned``: the kinds that consume it from then on), or
    a budget that ``enqueue`` published (``budget_tokens``)."""

    at: float
    dataset: str
    kind: Literal["assign", "budget"]
    assigned: list[str] | None = None
    budget_tokens: int | None = None
    note: str = ""  # the command that did it: pivot, drain or enqueue


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
    budget_rule: Literal["exact", "whole"] = "exact"  # schemas.config.BudgetRule (draftfleet/ledger.py)


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


CONVERSATION = -1  # the turn of a capture unit that is a whole conversation (hidden.py)


def turn_name(turn: int) -> str:
    """A capture unit's turn as files, task ids and logs name it (``CONVERSATION``: ``conversation``)."""
    return "conversation" if turn == CONVERSATION else str(int(turn))


class CaptureTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One hidden-state capture: the Celery payload of ``draftfleet.capture``.

    The unit is (record key, turn): the worker reads the stored record and feeds the engine exactly
    its ids; turn ``CONVERSATION``: the whole conversation once (its turns' ids prefix each other).
    At-least-once like generation; the store keeps one file per (version, key, turn).
    """

    dataset: str
    key: str
    turn: int
    version: int
    v: int = SCHEMA_VERSION

    @property
    def unit(self) -> str:
        """The unit's name: its Celery task id and its claim's (``<key>.<turn>.v<version>``)."""
        return f"{self.key}.{turn_name(self.turn)}.v{self.version}"


class CaptureManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The settings one capture version of a dataset was made with; every file of it shares them.

    ``layer_ids`` are vLLM's (id k: the residual stream entering decoder layer k; the last id,
    the number of layers, is the last layer's output before the final norm)."""

    schema_version: int = SCHEMA_VERSION
    dataset: str
    version: int
    model: str
    model_config_sha256: str
    num_layers: int
    hidden_size: int
    layer_ids: list[int]
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"  # float8: + a float32 scale per token
    created_at: float
    # "conversation": a conversation whose turns' ids prefix each other is one file; "turn": a file
    # per turn (versions made before, or [capture] conversations = false)
    units: Literal["turn", "conversation"] = "turn"
    # The seal every file of the version carries (hidden.SEAL: sha256 over its header and data); a
    # file without a good one is bad. 0: a version made before seals, whose files may carry none.
    seal: int = 0


class EngineContract(msgspec.Struct, frozen=True, kw_only=True):
    """What the fleet's connector (``workers/vllm_connector.py``) was configured with inside the
    engine, written into every file it writes (safetensors metadata ``draftfleet_contract``).

    The engine's own account of what it computed: a server started with other layer ids or
    another model writes states of the same shape, so only this tells them apart."""

    layer_ids: list[int]
    hidden_size: int
    num_layers: int
    dtype: str
    model: str  # the engine's model path or name (informational: identity is the config's hash)
    model_config_sha256: str  # of the model folder's config.json, as CaptureManifest's
