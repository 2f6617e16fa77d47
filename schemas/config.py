"""The fleet configuration: one ``fleet.toml`` decoded into typed Structs.

Errors name the key at fault (``datasets[1].max_tokens``) and the file. Relative paths are
resolved against the file's folder, so a config works from any working directory. API keys
never live here: a cloud backend names the *environment variable* that holds its key.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import ClassVar, Literal

import msgspec

from draftfleet.schemas.records import GenerationSettings

MAX_LINE_BYTES = 4 * 1024 * 1024
"""``[[datasets]].max_line_bytes``'s default: a dataset line or JSON-array item over it is quarantined."""
MAX_RETRY_WAIT_S = 600.0  # the longest a server's Retry-After is honoured between two attempts
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A configuration problem, with the file and the key at fault in its message."""


class FleetSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the fleet keeps its state and which target model it generates for.

    ``visibility_timeout_s`` must exceed the longest a task can hold its message: Redis
    redelivers an unacked message older than it, counting from reservation, to any worker.
    """

    store: str
    model: str
    tokenizer: str | None = None
    tokenizer_use_fast: bool = True
    tokenizer_trust_remote_code: bool = False
    end_of_turn: str | None = None
    # What the model writes before and after its reasoning, where the chat template cannot tell
    # (it drops reasoning from history turns); default "<think>", "</think>" when both are tokens.
    reasoning_markers: tuple[str, str] | None = None
    redis_url: str | None = None
    visibility_timeout_s: int = 6 * 3600
    max_attempts: int = 6

    def __post_init__(self) -> None:
        if self.reasoning_markers is not None and not all(self.reasoning_markers):
            raise ValueError("reasoning_markers must be two non-empty strings")


class StoreS3Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[store.s3]``: how to reach the bucket of an ``s3://bucket/prefix`` store. Each unset
    value comes from boto3's usual sources (``AWS_ENDPOINT_URL``, ``AWS_REGION``); credentials
    only from those (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, or ``profile``'s entry in
    ``~/.aws/credentials``), never from this file."""

    endpoint: str | None = None  # e.g. http://127.0.0.1:8333 (SeaweedFS), https://<account>.r2.cloudflarestorage.com
    region: str | None = None
    profile: str | None = None


class StoreSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    s3: StoreS3Section = msgspec.field(default_factory=StoreS3Section)


class FieldMap(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which columns hold the prompt, for files whose shape is not detected on its own."""

    messages: str | None = None
    prompt: str | None = None
    instruction: str | None = None
    input: str | None = None
    system: str | None = None
    id: str | None = None


# How a budget ends (draftfleet/ledger.py): "exact" never goes above it (the last answers are cut at
# what is left); "whole" keeps every answer whole and may end over it by less than one answer.
BudgetRule = Literal["exact", "whole"]


class DatasetConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    path: str
    # None: parquet by the name (.parquet, .pq), else JSON read by its content: a JSON array when it
    # starts with "[", JSON Lines otherwise; gzip and zstd by their magic bytes.
    format: Literal["jsonl", "json", "parquet"] | None = None
    fields: FieldMap = msgspec.field(default_factory=FieldMap)
    budget_tokens: int | None = None
    budget_rule: BudgetRule = "exact"
    max_tokens: int = 4096
    temperature: float = 0.7
    top_p: float = 1.0
    system_prompt: str | None = None
    # "all": regenerate every assistant turn of a conversation, one task per conversation (README,
    # "Multi-turn datasets"); "first": answer the turns before the first assistant turn only.
    turns: Literal["first", "all"] = "first"
    # A line (or array item) over this is quarantined, never held whole (producer/readers.py).
    max_line_bytes: int = MAX_LINE_BYTES

    def settings(self, model: str) -> GenerationSettings:
        return GenerationSettings(
            model=model,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            system_prompt=self.system_prompt,
            turns=self.turns,
        )

    @property
    def file_format(self) -> str:
        if self.format:
            return self.format
        return "parquet" if self.path.endswith((".parquet", ".pq")) else "jsonl"


Engine = Literal["sglang", "vllm"]
ENGINE_LABELS: dict[Engine, str] = {"sglang": "SGLang", "vllm": "vLLM"}


class EngineLaunch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How ``draftfleet worker gpu --gpu N`` launches its own engine server: one per GPU group
    of ``tp`` GPUs (SGLang's ``--tp-size``, vLLM's ``--tensor-parallel-size``), on port
    ``port_base`` + the group's first GPU index. ``python`` is the engine's interpreter (SGLang
    runs ``python -m sglang.launch_server``; vLLM the ``vllm`` script beside it), default this one's.
    """

    engine: ClassVar[Engine]
    model_path: str
    tp: int = 1
    port_base: int = 30000
    host: str = "127.0.0.1"
    extra_args: list[str] = []
    python: str | None = None
    startup_timeout_s: float = 1800.0


class SGLangLaunch(EngineLaunch, kw_only=True):
    engine: ClassVar[Engine] = "sglang"


class VLLMLaunch(EngineLaunch, kw_only=True):
    engine: ClassVar[Engine] = "vllm"
    port_base: int = 8000


class EngineBackend(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A GPU engine server (SGLang or vLLM): attached by ``urls`` or launched per GPU by ``launch``.

    ``api_key_env`` names the environment variable holding the server's ``--api-key`` (sent as
    a bearer token), never the key itself.
    """

    urls: list[str] = []
    launch: EngineLaunch | None = None
    inflight: int = 128
    request_timeout_s: float = 1800.0
    connect_timeout_s: float = 10.0
    api_key_env: str | None = None


class SGLangBackend(EngineBackend, kw_only=True):
    launch: SGLangLaunch | None = None


class VLLMBackend(EngineBackend, kw_only=True):
    launch: VLLMLaunch | None = None


# Requests per batch each wire shape accepts (ops/batch-apis.md).
BATCH_LIMITS = {"openrouter": 5_000, "openai": 50_000}


class CloudBackend(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An OpenAI-compatible chat-completions API (OpenRouter, or any such endpoint)."""

    base_url: str
    model: str
    api_key_env: str
    concurrency: int = 32
    price_input_per_mtok: float = 0.0
    price_output_per_mtok: float = 0.0
    max_spend_usd: float | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    headers: dict[str, str] = {}
    extra_body: dict[str, object] = {}
    pause_s: float = 300.0
    # The provider's batch API (``draftfleet worker batch``; ops/batch-apis.md): its wire shape, the
    # requests per batch (within the provider's limit), the window asked for, and the batch price:
    # batch_price_factor x the prices above, or prices of its own (the provider's reported cost wins).
    batch: Literal["openrouter", "openai"] | None = None
    batch_size: int = 1000
    completion_window: str = "24h"
    batch_price_factor: float = 0.5
    batch_price_input_per_mtok: float | None = None
    batch_price_output_per_mtok: float | None = None
    batch_path: str | None = None  # the batches path under base_url (default: /batches)
    batch_poll_s: float = 30.0  # how often open batches are asked for their status
    batch_collect_s: float = 5.0  # how long a batch waits for more prompts before it is submitted

    def batch_prices(self) -> tuple[float, float]:
        """$/Mtok (input, output) at the batch price."""
        f = self.batch_price_factor
        return (self.price_input_per_mtok * f if self.batch_price_input_per_mtok is None
                else self.batch_price_input_per_mtok,
                self.price_output_per_mtok * f if self.batch_price_output_per_mtok is None
                else self.batch_price_output_per_mtok)


class CaptureSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[capture]``: hidden-state capture of stored records (``draftfleet capture``, ``worker capture``).

    ``model_path`` is the target's folder (config.json, weights): its layer count gives the default
    layers, its final norm the post-norm state of SpecForge's export; default the vLLM launch's.
    ``aux_layers`` are vLLM's ids (k: the residual stream entering decoder layer k), default the
    trainers' [2, N/2, N-3]. ``storage_path`` is where the engine's connector writes each request's
    file before the worker moves it into the store: a folder both can reach (default
    ``<store>/_hidden/_incoming``). ``dtype``: ``bf16`` (the states as the engine computes them) or
    ``fp8`` (float8 e4m3 with one float32 scale per token, speculators' hs-connectors layout: about
    half the bytes; README "Hidden states" has what it costs the teacher). The engine's files are
    linked into the store, so ``storage_path`` must be on the store's file system unless ``copy``.
    ``conversations``: a new capture version takes a conversation whose every turn's prompt and answer
    ids begin the next turn's prompt once, over its last turn (one file, the history's states not
    computed and stored again per turn); the others stay per turn (``hidden.conversation_spans``).
    """

    model_path: str | None = None
    aux_layers: list[int] | None = None
    inflight: int = 16
    storage_path: str | None = None
    dtype: Literal["bf16", "fp8"] = "bf16"
    copy: bool = False  # allow a storage_path on another file system than the store (each file written twice)
    # a new version captures a conversation whose turns' ids prefix each other once (one file), not per turn
    conversations: bool = True


class FleetConfig(msgspec.Struct, kw_only=True):
    fleet: FleetSection
    datasets: list[DatasetConfig]
    sglang: SGLangBackend | None
    vllm: VLLMBackend | None = None
    clouds: dict[str, CloudBackend]
    path: str
    capture: CaptureSection = msgspec.field(default_factory=CaptureSection)
    store: StoreSection = msgspec.field(default_factory=StoreSection)

    def dataset(self, name: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise ConfigError(f"{self.path}: no dataset named {name!r} (have: {', '.join(d.name for d in self.datasets)})")

    def cloud(self, name: str) -> CloudBackend:
        if name not in self.clouds:
            have = ", ".join(self.clouds) or "none"
            raise ConfigError(f"{self.path}: no cloud backend [backends.{name}] (have: {have})")
        return self.clouds[name]

    def engine(self, name: Engine | None = None) -> tuple[Engine, EngineBackend]:
        """The GPU engine a worker uses: ``name`` (``--engine``), else the only one configured."""
        configured: dict[Engine, EngineBackend] = {n: b for n, b in (("sglang", self.sglang), ("vllm", self.vllm)) if b}
        if name is not None:
            if name not in configured:
                raise ConfigError(f"{self.path}: --engine {name}: no [backends.{name}] table")
            return name, configured[name]
        if not configured:
            raise ConfigError(f"{self.path}: a gpu worker needs a [backends.sglang] or [backends.vllm] table")
        if len(configured) > 1:
            raise ConfigError(f"{self.path}: both [backends.sglang] and [backends.vllm] are configured: "
                              "choose one with --engine sglang or --engine vllm")
        return next(iter(configured.items()))

    def longest_task_s(self) -> float:
        """Worst case a task holds its message: every attempt timing out, plus the longest wait.

        For a conversation (``turns = "all"``) this is one turn's worst case: its turns are as
        many as its row has, so a conversation goes back to its queue between turns before its
        message could outlive the visibility timeout (``workers.tasks._conversation``)."""
        timeouts = [c.request_timeout_s + c.connect_timeout_s for c in self.clouds.values()]
        timeouts += [e.request_timeout_s + e.connect_timeout_s for e in (self.sglang, self.vllm) if e]
        per_attempt = max(timeouts, default=0.0)
        return self.fleet.max_attempts * (per_attempt + MAX_RETRY_WAIT_S)


def _convert(obj: object, typ: type, where: str, path: str):
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        # msgspec reports "... - at `$.x[0].y`": turn it into the key path users wrote.
        m = re.search(r" - at `\$(.*)`$", msg)
        key = where + (m.group(1) if m else "")
        text = msg[: m.start()] if m else msg
        raise ConfigError(f"{path}: {key.lstrip('.')}: {text}") from None


def _resolve(base: Path, p: str) -> str:
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else (base / q).resolve())


ENGINE_TABLES: dict[str, type[EngineBackend]] = {"sglang": SGLangBackend, "vllm": VLLMBackend}


def _engine_backend(backends: dict, name: str, typ: type[EngineBackend], path: str) -> EngineBackend | None:
    """``[backends.sglang]`` / ``[backends.vllm]``, checked; None when the table is absent."""
    if name not in backends:
        return None
    where = f"{path}: backends.{name}"
    eb = _convert(backends[name], typ, f"backends.{name}", path)
    if eb.inflight < 1:
        raise ConfigError(f"{where}.inflight: must be at least 1")
    if eb.api_key_env is not None and not ENV_NAME_RE.match(eb.api_key_env):
        raise ConfigError(f"{where}.api_key_env: must be the NAME of an environment variable, never the key itself")
    if eb.launch is not None:
        if eb.launch.tp < 1:
            raise ConfigError(f"{where}.launch.tp: must be at least 1")
        if not 0 < eb.launch.port_base < 65536:
            raise ConfigError(f"{where}.launch.port_base: must be a TCP port (1-65535)")
        if not eb.launch.model_path:
            raise ConfigError(f"{where}.launch.model_path: must not be empty")
    return eb


def parse_config(data: dict, path: str = "fleet.toml") -> FleetConfig:
    """Validate a decoded TOML document; ``path`` is used in messages and to resolve paths."""
    base = Path(path).resolve().parent
    if "fleet" not in data:
        raise ConfigError(f"{path}: missing [fleet] table")
    unknown = set(data) - {"fleet", "datasets", "backends", "capture", "store"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}")
    fleet = _convert(data["fleet"], FleetSection, "fleet", path)
    fleet = msgspec.structs.replace(
        fleet,
        store=fleet.store if fleet.store.startswith("s3://") else _resolve(base, fleet.store),
        tokenizer=_resolve(base, fleet.tokenizer) if fleet.tokenizer else None,
    )
    datasets = _convert(data.get("datasets", []), list[DatasetConfig], "datasets", path)
    seen: set[str] = set()
    for i, ds in enumerate(datasets):
        where = f"{path}: datasets[{i}]"
        if not NAME_RE.match(ds.name) or ".." in ds.name:
            raise ConfigError(f"{where}.name: {ds.name!r} is not a safe name (letters, digits, _ . -; at most 64)")
        if ds.name in seen:
            raise ConfigError(f"{where}.name: dataset {ds.name!r} is defined twice")
        seen.add(ds.name)
        if ds.max_tokens <= 0:
            raise ConfigError(f"{where}.max_tokens: must be positive")
        if ds.max_line_bytes < 1024:
            raise ConfigError(f"{where}.max_line_bytes: must be at least 1024")
        if ds.budget_tokens is not None and ds.budget_tokens <= 0:
            raise ConfigError(f"{where}.budget_tokens: must be positive")
        if not 0.0 <= ds.temperature <= 2.0:
            raise ConfigError(f"{where}.temperature: must be within 0..2")
        if not 0.0 < ds.top_p <= 1.0:
            raise ConfigError(f"{where}.top_p: must be within (0, 1]")
    datasets = [msgspec.structs.replace(ds, path=_resolve(base, ds.path)) for ds in datasets]

    backends = data.get("backends", {})
    if not isinstance(backends, dict):
        raise ConfigError(f"{path}: backends: expected a table")
    engines = {name: _engine_backend(backends, name, typ, path) for name, typ in ENGINE_TABLES.items()}
    clouds: dict[str, CloudBackend] = {}
    for name, raw in backends.items():
        if name in ENGINE_TABLES:
            continue
        if not NAME_RE.match(name):
            raise ConfigError(f"{path}: backends.{name}: not a safe backend name")
        cb = _convert(raw, CloudBackend, f"backends.{name}", path)
        if not ENV_NAME_RE.match(cb.api_key_env):
            # Never echo the value: if it is not a variable name it may well be the key itself.
            raise ConfigError(
                f"{path}: backends.{name}.api_key_env: must be the NAME of an environment variable "
                "(e.g. OPENROUTER_API_KEY), never the key itself"
            )
        if cb.concurrency < 1:
            raise ConfigError(f"{path}: backends.{name}.concurrency: must be at least 1")
        if cb.batch is not None:
            limit = BATCH_LIMITS[cb.batch]
            if not 1 <= cb.batch_size <= limit:
                raise ConfigError(f"{path}: backends.{name}.batch_size: must be within 1..{limit} "
                                  f"(the {cb.batch} batch API's limit per batch)")
            if cb.completion_window != "24h":
                raise ConfigError(f"{path}: backends.{name}.completion_window: the {cb.batch} batch API takes only \"24h\"")
            if not 0.0 < cb.batch_price_factor <= 1.0:
                raise ConfigError(f"{path}: backends.{name}.batch_price_factor: must be within (0, 1]")
            if cb.batch_poll_s <= 0 or cb.batch_collect_s < 0:
                raise ConfigError(f"{path}: backends.{name}.batch_poll_s must be positive, batch_collect_s not negative")
        clouds[name] = cb
    capture = _convert(data.get("capture", {}), CaptureSection, "capture", path)
    if capture.inflight < 1:
        raise ConfigError(f"{path}: capture.inflight: must be at least 1")
    capture = msgspec.structs.replace(
        capture, model_path=_resolve(base, capture.model_path) if capture.model_path else None,
        storage_path=_resolve(base, capture.storage_path) if capture.storage_path else None)
    cfg = FleetConfig(fleet=fleet, datasets=datasets, sglang=engines["sglang"], vllm=engines["vllm"], clouds=clouds,
                      path=str(Path(path)), capture=capture,
                      store=_convert(data.get("store", {}), StoreSection, "store", path))
    if cfg.longest_task_s() >= fleet.visibility_timeout_s:
        raise ConfigError(
            f"{path}: fleet.visibility_timeout_s: {fleet.visibility_timeout_s}s is shorter than the longest "
            f"a task (or a conversation's turn) can run ({cfg.longest_task_s():.0f}s = max_attempts x request "
            "timeouts): Redis would hand a running task to a second worker"
        )
    return cfg


def load_config(path: str | Path) -> FleetConfig:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse_config(data, str(p))
