"""``draftfleet inventory``: the seed's pivot question, answered exactly from the store.

How many responses and tokens each dataset has (split by backend and token source), what is left
of its budget, what the rest will cost at each configured cloud price, and whether the records
are sound: schema, ids inside the vocabulary, stopped responses ending with the end-of-turn id,
truncations, the same prompt under several keys, and (on exact records) the share of ids that do
not survive decode -> encode unchanged. Tokens are counted as the seed's script did:
``completion_tokens``, falling back to ``len(output_ids)``. A corrupt file is reported, never fatal.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from pathlib import Path

import msgspec

from .schemas.config import FleetConfig
from .schemas.records import ResponseRecord
from .store import Store
from .tokenizer import TargetTokenizer

_decode = msgspec.json.Decoder(ResponseRecord).decode
_msg_encoder = msgspec.json.Encoder()


class Split(msgspec.Struct, kw_only=True):
    backend: str
    backend_kind: str
    token_source: str
    responses: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cost_usd: float = 0.0


class Validation(msgspec.Struct, kw_only=True):
    schema_errors: int = 0
    unreadable_files: list[str] = []
    ids_out_of_vocab: int | None = None
    stop_without_eot: int | None = None
    truncated: int = 0
    duplicate_prompts: int = 0
    roundtrip_checked: int = 0
    roundtrip_mismatch: int = 0
    roundtrip_share: float | None = None


class DatasetInventory(msgspec.Struct, kw_only=True):
    dataset: str
    responses: int
    completion_tokens: int
    prompt_tokens: int
    mean_tokens: float | None
    by_source: list[Split]
    budget_tokens: int | None
    share_done: float | None
    remaining_tokens: int | None
    spend_usd: float
    cost_to_finish_usd: dict[str, float]
    validation: Validation


def record_tokens(rec: ResponseRecord) -> int:
    """The seed's count: completion_tokens, falling back to the length of output_ids."""
    return rec.completion_tokens or len(rec.output_ids)


def _prompt_hash(rec: ResponseRecord) -> str:
    return hashlib.sha1(_msg_encoder.encode([rec.settings_id, rec.messages])).hexdigest()


def inventory_dataset(
    store: Store,
    dataset: str,
    *,
    budget: int | None,
    prices: dict[str, tuple[float, float]],
    tokenizer: TargetTokenizer | None,
    roundtrip_sample: int = 500,
) -> DatasetInventory:
    splits: dict[tuple[str, str, str], Split] = {}
    v = Validation(ids_out_of_vocab=0 if tokenizer else None, stop_without_eot=0 if tokenizer else None)
    unreadable: list[str] = []
    prompts: Counter[str] = Counter()
    exact: list[ResponseRecord] = []
    for path in store.record_paths(dataset):
        try:
            rec = _decode(path.read_bytes())
        except msgspec.ValidationError as exc:
            v.schema_errors += 1
            unreadable.append(f"{path}: schema: {exc}")
            continue
        except (OSError, msgspec.DecodeError) as exc:
            v.schema_errors += 1
            unreadable.append(f"{path}: {exc}")
            continue
        s = splits.get((rec.backend, rec.backend_kind, rec.token_source))
        if s is None:
            s = splits[(rec.backend, rec.backend_kind, rec.token_source)] = Split(
                backend=rec.backend, backend_kind=rec.backend_kind, token_source=rec.token_source)
        s.responses += 1
        s.completion_tokens += record_tokens(rec)
        s.prompt_tokens += rec.prompt_tokens
        s.cost_usd += rec.cost_usd
        prompts[_prompt_hash(rec)] += 1
        v.truncated += rec.truncated
        if tokenizer is not None and rec.output_ids:
            if min(rec.output_ids) < 0 or max(rec.output_ids) >= tokenizer.vocab_size:
                v.ids_out_of_vocab += 1
            if rec.finish_reason == "stop" and rec.output_ids[-1] != tokenizer.eot_id:
                v.stop_without_eot += 1
        if rec.token_source == "exact" and rec.output_ids and len(exact) < roundtrip_sample:
            exact.append(rec)
    v.unreadable_files = unreadable[:50]
    v.duplicate_prompts = sum(n - 1 for n in prompts.values() if n > 1)
    if tokenizer is not None and exact:
        for rec in exact:
            ids = rec.output_ids[:-1] if rec.output_ids[-1] == tokenizer.eot_id else rec.output_ids
            try:
                again = tokenizer.encode_text(tokenizer.decode(ids))
            except Exception:  # a tokenizer that refuses the text counts as a mismatch
                again = None
            v.roundtrip_mismatch += again != ids
        v.roundtrip_checked = len(exact)
        v.roundtrip_share = round(v.roundtrip_mismatch / len(exact), 4)

    by_source = sorted(splits.values(), key=lambda s: (s.backend_kind, s.backend, s.token_source))
    responses = sum(s.responses for s in by_source)
    tokens = sum(s.completion_tokens for s in by_source)
    prompt_tokens = sum(s.prompt_tokens for s in by_source)
    mean = tokens / responses if responses else None
    remaining = max(0, budget - tokens) if budget else None
    cost = {}
    if remaining is not None and mean:
        left = remaining / mean  # responses still to generate
        mean_prompt = prompt_tokens / responses
        for name, (p_in, p_out) in prices.items():
            cost[name] = round(remaining * p_out / 1e6 + left * mean_prompt * p_in / 1e6, 2)
    return DatasetInventory(
        dataset=dataset, responses=responses, completion_tokens=tokens, prompt_tokens=prompt_tokens,
        mean_tokens=round(mean, 1) if mean else None, by_source=by_source, budget_tokens=budget,
        share_done=round(tokens / budget, 4) if budget else None, remaining_tokens=remaining,
        spend_usd=round(sum(s.cost_usd for s in by_source), 4), cost_to_finish_usd=cost, validation=v,
    )


def run_inventory(
    store_root: str | Path,
    cfg: FleetConfig | None = None,
    datasets: list[str] | None = None,
    tokenizer: TargetTokenizer | None = None,
    roundtrip_sample: int = 500,
) -> list[DatasetInventory]:
    """Inventory of each dataset; budgets and prices from the config, else from the manifests."""
    store = Store(store_root)
    names = datasets or (store.datasets() if cfg is None else [d.name for d in cfg.datasets])
    prices = {n: (c.price_input_per_mtok, c.price_output_per_mtok) for n, c in (cfg.clouds.items() if cfg else [])}
    out = []
    for name in names:
        if cfg is not None and any(d.name == name for d in cfg.datasets):
            budget = cfg.dataset(name).budget_tokens
        else:
            manifest = store.manifest(name)
            budget = manifest.budget_tokens if manifest else None
        out.append(inventory_dataset(store, name, budget=budget, prices=prices, tokenizer=tokenizer,
                                     roundtrip_sample=roundtrip_sample))
    return out


def group_by_backend(inv: DatasetInventory) -> dict[str, tuple[int, int]]:
    """Responses and tokens per backend (the split without token_source), for pivot reports."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in inv.by_source:
        out[s.backend][0] += s.responses
        out[s.backend][1] += s.completion_tokens
    return {k: (a, b) for k, (a, b) in out.items()}
