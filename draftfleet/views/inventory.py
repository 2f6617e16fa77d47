"""``draftfleet inventory``: the seed's pivot question, answered exactly from the store.

How many responses and tokens each dataset has (split by backend and token source), what is left
of its budget, what the rest will cost at each configured cloud price, and whether the records
are sound: schema, ids inside the vocabulary, stopped responses ending with the end-of-turn id,
truncations, the same prompt under several keys, and the round-trip mismatch share (below).
Tokens are counted as the seed's script did, in the target tokenizer's unit: ``completion_tokens``,
falling back to ``len(output_ids)``; budgets count the same unit. A cloud provider counts with its
own tokenizer: its ``usage.completion_tokens`` is shown beside ours, with the difference.
A corrupt file is reported, never fatal.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated

import msgspec
import redis

from draftfleet.identity import prompt_key
from draftfleet.producer.enqueue import prompt_messages
from draftfleet.producer.readers import Rejection, read_prompts
from draftfleet.queues import next_answers
from draftfleet.schemas.config import DatasetConfig, FleetConfig
from draftfleet.schemas.records import GenerationSettings, ResponseRecord
from draftfleet.store import Store, open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.versions import Selection, select
from draftfleet.ledger import BudgetUse
from draftfleet.views.plan import (Activity, DatasetPlan, StoreFigures, activities, budget_from_store,
                                  merge_activity, note_activity, plan_from_store)

_decode = msgspec.json.Decoder(ResponseRecord).decode
_msg_encoder = msgspec.json.Encoder()
PARALLEL_FROM = 5000  # files; below this a process pool costs more than it saves


class Split(msgspec.Struct, kw_only=True):
    backend: str
    backend_kind: str
    token_source: str
    responses: int = 0
    turns: int = 0  # regenerated answers: a conversation's turns, one per single-turn response
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cost_usd: float = 0.0
    provider_responses: int = 0  # records that carry the provider's own completion_tokens
    provider_completion_tokens: int = 0  # the provider's count, over those records
    provider_difference: int = 0  # our (target-tokenizer) tokens minus the provider's, same records


ROUNDTRIP_MEANING = (
    "share of exact records whose output ids change when decoded to text and encoded again; "
    "such records cannot be rebuilt from their text alone (BPE merges across boundaries: the seed saw "
    "0.5-6.5%); the stored ids stay exact"
)


class Validation(msgspec.Struct, kw_only=True):
    schema_errors: int = 0
    unreadable_files: list[str] = []
    ids_out_of_vocab: int | None = None
    stop_without_eot: int | None = None
    truncated: int = 0
    duplicate_prompts: int = 0
    roundtrip_checked: int = 0  # exact records sampled
    roundtrip_mismatched: int = 0  # of those, records whose ids do not survive decode -> encode
    roundtrip_mismatch_share: float | None = None  # roundtrip_mismatched / roundtrip_checked


class HiddenInventory(msgspec.Struct, kw_only=True):
    """The latest capture version of a dataset: its layers, and what its files hold (``hidden.py``)."""

    version: int
    layer_ids: list[int]
    units: int  # record turns of the dataset
    files: int
    turns: int = 0  # record turns the files hold (a conversation captured once: all of its turns)
    tokens: int
    bytes: int
    dtype: str = "bfloat16"
    bytes_per_token: float = 0.0  # what the files hold a token (the dtype's figure while there are none)
    projected_bytes: int = 0  # what the turns not captured yet and the budget left will take, in this dtype
    verified: int | None = None  # --verify: files whose header and tensors match their seal (None: not read)
    unsealed: int = 0  # --verify: files without a seal, of a version made before seals: not checked
    bad_files: list[str] = []  # --verify: each file changed since it was stored (seal wrong or removed), or unreadable


class DatasetInventory(msgspec.Struct, kw_only=True):
    dataset: str
    version: int | None = None  # the dataset version counted (None: every version, or no manifest)
    settings: GenerationSettings | None = None  # that version's generation settings
    other_versions: int = 0  # records of the dataset's other versions, not counted here (the budget figures do)
    responses: int
    conversations: int  # responses that are multi-turn conversations (``turns = "all"``)
    turns: int  # regenerated answers in all responses
    completion_tokens: int
    prompt_tokens: int
    mean_tokens: float | None
    by_source: list[Split]
    budget_tokens: int | None
    share_done: float | None  # of the budget, spent as admission counts it (``budget``)
    remaining_tokens: int | None  # of the budget
    budget: BudgetUse | None = None  # spent (every version's records, paid turns not stored yet) and left
    prompts_left: int | None = None  # prompts of the dataset file with no result (None: file not read)
    spend_usd: float
    cost_to_finish_usd: dict[str, float]
    validation: Validation
    hidden_states: HiddenInventory | None = None
    activity: list[Activity] = []
    plan: DatasetPlan | None = None  # set by the commands that can read the fleet's Redis too (plan.py)


def record_tokens(rec: ResponseRecord) -> int:
    """The seed's count: completion_tokens, falling back to the length of output_ids."""
    return rec.completion_tokens or len(rec.output_ids)


def _prompt_hash(rec: ResponseRecord) -> str:
    return hashlib.sha1(_msg_encoder.encode([rec.settings_id, rec.messages])).hexdigest()


def _vocab_decoder(vocab_size: int):
    """A decoder of ResponseRecord whose output_ids must lie in [0, vocab_size): the check runs
    inside msgspec's decoding instead of a Python pass over every id."""
    fields = []
    for f in msgspec.structs.fields(ResponseRecord):
        typ = list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]] if f.name == "output_ids" else f.type
        default = f.default if f.default is not msgspec.NODEFAULT else (
            msgspec.field(default_factory=f.default_factory) if f.default_factory is not msgspec.NODEFAULT
            else msgspec.NODEFAULT)
        fields.append((f.name, typ) if default is msgspec.NODEFAULT else (f.name, typ, default))
    checked = msgspec.defstruct("CheckedRecord", fields, kw_only=True, frozen=True)
    return msgspec.json.Decoder(checked).decode


class _Partial(msgspec.Struct):
    """What one process found in its share of the files; merged by :func:`inventory_dataset`."""

    splits: dict[str, Split]
    prompts: dict[str, int]
    conversations: int = 0
    truncated: int = 0
    out_of_vocab: int = 0
    stop_without_eot: int = 0
    schema_errors: int = 0
    other_versions: int = 0
    other_tokens: int = 0  # theirs: the budget counts every version's records
    unreadable: list[str] = []
    sample: list[list[int]] = []
    intervals: dict[str, list[tuple[float, float]]] = {}  # backend -> its requests' (start, end), not imported
    activity: dict[str, Activity] = {}


def _scan(store: Store, paths: list[str], vocab_size: int | None, eot_id: int | None, sample_records: int,
          sample_tokens: int, settings_id: str | None = None) -> _Partial:
    """Count the records at ``paths`` (those of the version ``settings_id`` names, when given)."""
    checked = _vocab_decoder(vocab_size) if vocab_size else None
    part = _Partial(splits={}, prompts={})
    sampled_tokens = 0
    for path, data in store.read_many(paths):
        if isinstance(data, OSError):
            part.schema_errors += 1
            part.unreadable.append(f"{path}: {data.strerror or data}")
            continue
        try:
            rec = checked(data) if checked else _decode(data)
        except msgspec.ValidationError as exc:
            if checked is None or "output_ids" not in str(exc):
                part.schema_errors += 1
                part.unreadable.append(f"{path}: schema: {exc}")
                continue
            part.out_of_vocab += 1
            rec = _decode(data)
        except msgspec.DecodeError as exc:
            part.schema_errors += 1
            part.unreadable.append(f"{path}: {exc}")
            continue
        if settings_id is not None and rec.settings_id != settings_id:
            part.other_versions += 1
            part.other_tokens += record_tokens(rec)
            continue
        label = f"{rec.backend}\x00{rec.backend_kind}\x00{rec.token_source}"
        sp = part.splits.get(label)
        if sp is None:
            sp = part.splits[label] = Split(backend=rec.backend, backend_kind=rec.backend_kind,
                                            token_source=rec.token_source)
        sp.responses += 1
        sp.turns += len(rec.turns) or 1
        part.conversations += bool(rec.turns)
        sp.completion_tokens += record_tokens(rec)
        sp.prompt_tokens += rec.prompt_tokens
        sp.cost_usd += rec.cost_usd
        if rec.usage.completion_tokens:
            sp.provider_responses += 1
            sp.provider_completion_tokens += rec.usage.completion_tokens
            sp.provider_difference += record_tokens(rec) - rec.usage.completion_tokens
        note_activity(part.activity, part.intervals, rec, record_tokens(rec))
        h = _prompt_hash(rec)
        part.prompts[h] = part.prompts.get(h, 0) + 1
        part.truncated += rec.truncated
        ids = rec.output_ids
        if eot_id is not None and ids and rec.finish_reason == "stop" and ids[-1] != eot_id:
            part.stop_without_eot += 1
        if (eot_id is not None and rec.token_source == "exact" and ids and len(part.sample) < sample_records
                and sampled_tokens < sample_tokens):
            body = ids[:-1] if ids[-1] == eot_id else ids
            part.sample.append(body)
            sampled_tokens += len(body)
    return part


def inventory_dataset(
    store: Store,
    dataset: str,
    *,
    budget: int | None,
    prices: dict[str, tuple[float, float]],
    tokenizer: TargetTokenizer | None,
    roundtrip_sample: int = 200,
    roundtrip_tokens: int = 100_000,
    processes: int | None = None,
    prompt_keys: set[str] | None = None,
    records: Selection | None = None,
    max_tokens: int | None = None,
    answers: int = 1,
) -> DatasetInventory:
    """One dataset's inventory, of its current version's records unless ``records`` chooses
    (``versions.select``). Large stores are read by a process per core, split by file.
    ``max_tokens``: the dataset's as the fleet runs it (default its manifest's), for what admission
    reserves for a prompt; ``answers``: the next queued task's (``queues.next_answers``), a
    conversation's turns.

    ``prompt_keys`` (the keys of the dataset file's prompts) bound the cost to finish by the
    prompts left; without them only the budget bounds it.
    """
    records = records or select(store, dataset)
    paths = store.record_files(dataset)
    vocab = tokenizer.vocab_size if tokenizer else None
    eot = tokenizer.eot_id if tokenizer else None
    n = processes or (min(os.cpu_count() or 1, 8) if len(paths) >= PARALLEL_FROM else 1)
    if n > 1:
        chunks = [paths[i::n] for i in range(n)]
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(n, mp_context=ctx) as pool:
            parts = list(pool.map(_scan, [store] * n, chunks, [vocab] * n, [eot] * n, [roundtrip_sample // n + 1] * n,
                                  [roundtrip_tokens // n + 1] * n, [records.settings_id] * n))
    else:
        parts = [_scan(store, paths, vocab, eot, roundtrip_sample, roundtrip_tokens, records.settings_id)]

    splits: dict[str, Split] = {}
    prompts: Counter[str] = Counter()
    v = Validation(ids_out_of_vocab=0 if tokenizer else None, stop_without_eot=0 if tokenizer else None)
    sample: list[list[int]] = []
    conversations = sum(part.conversations for part in parts)
    activity: dict[str, Activity] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}
    for part in parts:
        for label, sp in part.splits.items():
            acc = splits.setdefault(label, Split(backend=sp.backend, backend_kind=sp.backend_kind,
                                                 token_source=sp.token_source))
            acc.responses += sp.responses
            acc.turns += sp.turns
            acc.completion_tokens += sp.completion_tokens
            acc.prompt_tokens += sp.prompt_tokens
            acc.cost_usd += sp.cost_usd
            acc.provider_responses += sp.provider_responses
            acc.provider_completion_tokens += sp.provider_completion_tokens
            acc.provider_difference += sp.provider_difference
        prompts.update(part.prompts)
        merge_activity(activity, intervals, part.activity, part.intervals)
        v.truncated += part.truncated
        v.schema_errors += part.schema_errors
        v.unreadable_files.extend(part.unreadable)
        if tokenizer:
            v.ids_out_of_vocab += part.out_of_vocab
            v.stop_without_eot += part.stop_without_eot
        sample.extend(part.sample)
    v.unreadable_files = sorted(v.unreadable_files)[:50]
    v.duplicate_prompts = sum(c - 1 for c in prompts.values() if c > 1)
    sample = sample[:roundtrip_sample]
    if tokenizer is not None and sample:
        v.roundtrip_checked = len(sample)
        v.roundtrip_mismatched = tokenizer.roundtrip_mismatches(sample)
        v.roundtrip_mismatch_share = round(v.roundtrip_mismatched / len(sample), 4)

    by_source = sorted(splits.values(), key=lambda s: (s.backend_kind, s.backend, s.token_source))
    responses = sum(s.responses for s in by_source)
    tokens = sum(s.completion_tokens for s in by_source)
    prompt_tokens = sum(s.prompt_tokens for s in by_source)
    mean = tokens / responses if responses else None
    # the budget's, as admission counts it: every version's records, and the paid turns not stored yet
    m = store.manifest(dataset)
    if max_tokens is None and m is not None:
        max_tokens = m.settings.max_tokens
    use = budget_from_store(budget, tokens + sum(part.other_tokens for part in parts), store.paid_tokens(dataset),
                            max_tokens, answers, m.budget_rule if m is not None else "exact")
    remaining = use.left_tokens if use else None
    prompts_left = None
    if prompt_keys is not None:
        stored = {os.path.basename(p)[:-5] for p in paths}
        prompts_left = len(prompt_keys - stored)
    cost = {}
    if mean:
        # responses still to generate: until the budget or the prompts run out, whichever is first
        bounds = [b for b in (remaining / mean if remaining is not None else None, prompts_left) if b is not None]
        if bounds:
            left = min(bounds)
            mean_prompt = prompt_tokens / responses
            for name, (p_in, p_out) in prices.items():
                cost[name] = round(left * mean * p_out / 1e6 + left * mean_prompt * p_in / 1e6, 4)
    return DatasetInventory(
        dataset=dataset, version=records.version, settings=records.settings,
        other_versions=sum(part.other_versions for part in parts), responses=responses, conversations=conversations,
        turns=sum(s.turns for s in by_source),
        completion_tokens=tokens, prompt_tokens=prompt_tokens,
        mean_tokens=round(mean, 1) if mean else None, by_source=by_source, budget_tokens=budget,
        share_done=round(use.spent_tokens / budget, 4) if budget else None, remaining_tokens=remaining, budget=use,
        prompts_left=prompts_left,
        spend_usd=round(sum(s.cost_usd for s in by_source), 4), cost_to_finish_usd=cost, validation=v,
        activity=[msgspec.structs.replace(a, provider_cost_usd=round(a.provider_cost_usd, 6))
                  for a in activities(activity, intervals)],
    )


def dataset_keys(ds: DatasetConfig, settings: GenerationSettings) -> set[str] | None:
    """The keys of the dataset file's prompts, as enqueue makes them; None if the file is unreadable."""
    keys = set()
    for item in read_prompts(ds):
        if isinstance(item, Rejection):
            if item.entry.line is None:
                return None
            continue
        keys.add(prompt_key(ds.name, prompt_messages(ds, item), settings))
    return keys


def run_inventory(
    store_root: str | Path,
    cfg: FleetConfig | None = None,
    datasets: list[str] | None = None,
    tokenizer: TargetTokenizer | None = None,
    roundtrip_sample: int = 200,
    processes: int | None = None,
    version: int | None = None,
    all_versions: bool = False,
    verify: bool = False,
    r: redis.Redis | None = None,
) -> list[DatasetInventory]:
    """Inventory of each dataset (its current version, or ``version``, or ``all_versions``);
    budgets and prices from the config, else from the manifests. A version it lacks: VersionError.
    ``verify``: read every hidden-state file of the latest capture version through its seal.
    ``r``: the fleet's Redis, for the turns of each dataset's next queued task (admission's reservation)."""
    store = open_store(cfg or store_root)
    names = datasets or (store.datasets() if cfg is None else [d.name for d in cfg.datasets])
    prices = {n: (c.price_input_per_mtok, c.price_output_per_mtok) for n, c in (cfg.clouds.items() if cfg else [])}
    out = []
    for name in names:
        manifest = store.manifest(name)
        chosen = select(store, name, version, all_versions)
        keys, max_tokens = None, manifest.settings.max_tokens if manifest else None
        if cfg is not None and any(d.name == name for d in cfg.datasets):
            ds = cfg.dataset(name)
            budget, max_tokens = ds.budget_tokens, max_tokens or ds.max_tokens
            if chosen.version is None or manifest is None or chosen.version == manifest.version:
                keys = dataset_keys(ds, manifest.settings if manifest else ds.settings(cfg.fleet.model))
        else:
            budget = manifest.budget_tokens if manifest else None
        inv = inventory_dataset(store, name, budget=budget, prices=prices, tokenizer=tokenizer,
                                roundtrip_sample=roundtrip_sample, processes=processes, prompt_keys=keys,
                                records=chosen, max_tokens=max_tokens,
                                answers=next_answers(r, name) if r is not None else 1)
        out.append(msgspec.structs.replace(inv, hidden_states=_hidden_inventory(store, inv, verify)))
    return out


def _hidden_inventory(store: Store, inv: DatasetInventory, verify: bool = False) -> HiddenInventory | None:
    """The latest capture version's files, and what the rest will take: every turn's prompt and answer
    tokens (what capture feeds the engine) not captured yet, plus the budget left with its prompts."""
    from draftfleet.hidden import measured_bytes_per_token, open_hidden, projected_bytes

    hidden = open_hidden(store)
    m = hidden.manifest(inv.dataset)
    if m is None:
        return None
    files, turns, tokens, size = hidden.turn_usage(inv.dataset, m.version)
    bpt = measured_bytes_per_token(m, tokens, size)
    fed = inv.prompt_tokens + inv.completion_tokens  # summed over a conversation's turns, as per-turn capture feeds them
    if m.units == "conversation" and turns:  # conversations captured once feed fewer: as many a turn as so far
        fed = max(tokens, round(tokens * inv.turns / turns))
    verified, unsealed, bad = hidden.verify(inv.dataset, m.version) if verify else (None, 0, [])
    return HiddenInventory(version=m.version, layer_ids=m.layer_ids, units=inv.turns, files=files, turns=turns,
                           tokens=tokens, bytes=size, dtype=m.dtype, bytes_per_token=bpt,
                           projected_bytes=projected_bytes(bpt, fed - tokens, inv.remaining_tokens, fed,
                                                           inv.completion_tokens),
                           verified=verified, unsealed=unsealed, bad_files=bad)


def plan_from_inventory(cfg: FleetConfig | None, inv: DatasetInventory, r: redis.Redis | None) -> DatasetPlan:
    """The plan from an inventory: see :func:`plan_from_store`."""
    return plan_from_store(cfg, StoreFigures(
        dataset=inv.dataset, responses=inv.responses, completion_tokens=inv.completion_tokens,
        prompt_tokens=inv.prompt_tokens, budget=inv.budget, prompts_left=inv.prompts_left,
        activity=inv.activity), r)
