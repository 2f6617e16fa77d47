"""``draftfleet export``: training files from both sources, deterministic, with a manifest.

Formats:
- ``sharegpt``: SpecForge's ``{"id", "conversations": [...], "metadata"}`` JSONL. Top-level keys
  stay ``id``, ``conversations`` and ``metadata`` because SpecForge passes every other column into
  ``apply_chat_template``. Reasoning goes in ``reasoning_content``. A row generated without a
  system turn says so in its metadata (SpecForge would insert its template's default).
- ``raw``: ``raw_responses.jsonl`` with ``completion_tokens`` and ``output_ids`` per line, so the
  seed's own scripts keep working.
- ``tokens``: ``{"id", "input_ids", "loss_mask", "metadata"}`` (loss 0 on the prompt, 1 on the
  completion), as vLLM speculators writes them; needs the tokenizer for the prompt ids.
Order: by source file, then line or row number, then key, so two exports of one store are equal.
Every file is named after its dataset (``<dataset>.<format>.jsonl``, ``<dataset>.manifest.json``),
so several datasets exported into one folder overwrite nothing of each other.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import msgspec

from draftfleet.schemas.records import ResponseRecord
from draftfleet.store import Store
from draftfleet.tokenizer import TargetTokenizer

FORMATS = ("sharegpt", "raw", "tokens")
FILE_NAMES = {"sharegpt": "{}.sharegpt.jsonl", "raw": "{}.raw_responses.jsonl", "tokens": "{}.tokens.jsonl"}


class ExportError(ValueError):
    """An export that cannot be made as asked (unknown dataset or format, missing tokenizer)."""


def manifest_name(dataset: str) -> str:
    return f"{dataset}.manifest.json"
_encoder = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(ResponseRecord).decode
_SOURCE = re.compile(r"^(.*):(?:row)?(\d+)$")


class ExportManifest(msgspec.Struct, kw_only=True):
    dataset: str
    formats: list[str]
    records: int
    excluded_truncated: int
    excluded_invalid: int
    unreadable: int
    tokens_by_source: dict[str, int]
    responses_by_source: dict[str, int]
    files: dict[str, str]  # name -> sha256


def _order(rec: ResponseRecord) -> tuple[str, int, str]:
    m = _SOURCE.match(rec.source)
    return (m.group(1), int(m.group(2)), rec.key) if m else (rec.source, 0, rec.key)


def _metadata(rec: ResponseRecord) -> dict:
    return {
        "key": rec.key, "source": rec.source, "backend": rec.backend, "token_source": rec.token_source,
        "model": rec.model, "finish_reason": rec.finish_reason, "completion_tokens": rec.completion_tokens,
        "system_prompt": "given" if rec.system_prompt_used else "none (generated without a system turn)",
    }


def _sharegpt(rec: ResponseRecord) -> dict:
    turns = [{"role": m.role, "content": m.content} for m in rec.messages]
    answer = {"role": "assistant", "content": rec.text}
    if rec.reasoning:
        answer["reasoning_content"] = rec.reasoning
    return {"id": rec.key, "conversations": [*turns, answer], "metadata": _metadata(rec)}


def _raw(rec: ResponseRecord) -> dict:
    return {
        "id": rec.key, "messages": [{"role": m.role, "content": m.content} for m in rec.messages],
        "output": rec.text, "reasoning": rec.reasoning, "output_ids": rec.output_ids,
        "completion_tokens": rec.completion_tokens, "prompt_tokens": rec.prompt_tokens,
        "finish_reason": rec.finish_reason, "backend": rec.backend, "token_source": rec.token_source,
        "source": rec.source,
        # provenance, so that ``draftfleet import`` of this file gives back the same records
        "backend_kind": rec.backend_kind, "model": rec.model, "cost": rec.cost_usd, "cost_source": rec.cost_source,
        "usage": msgspec.to_builtins(rec.usage), "latency_s": rec.latency_s, "attempts": rec.attempts,
        "retry_reasons": rec.retry_reasons,
    }


def _tokens(rec: ResponseRecord, tok: TargetTokenizer) -> dict:
    prompt = tok.prompt_ids(rec.messages)
    return {
        "id": rec.key, "input_ids": prompt + rec.output_ids,
        "loss_mask": [0] * len(prompt) + [1] * len(rec.output_ids), "metadata": _metadata(rec),
    }


def _invalid(rec: ResponseRecord, tok: TargetTokenizer | None) -> bool:
    if not rec.output_ids:
        return True
    if tok is None:
        return False
    if min(rec.output_ids) < 0 or max(rec.output_ids) >= tok.vocab_size:
        return True
    return rec.finish_reason == "stop" and rec.output_ids[-1] != tok.eot_id


def export_dataset(store: Store, dataset: str, out_dir: str | Path, formats: list[str], *,
                   exclude_truncated: bool = False, exclude_invalid: bool = False,
                   tokenizer: TargetTokenizer | None = None) -> ExportManifest:
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ExportError(f"unknown format(s) {sorted(unknown)}: choose from {', '.join(FORMATS)}")
    if "tokens" in formats and tokenizer is None:
        raise ExportError("the tokens format needs the target tokenizer ([fleet].tokenizer or --tokenizer)")
    records, unreadable = [], 0
    for path in store.record_paths(dataset):
        try:
            records.append(_decode(path.read_bytes()))
        except (OSError, msgspec.DecodeError):
            unreadable += 1
    records.sort(key=_order)
    kept, trunc, invalid = [], 0, 0
    for rec in records:
        if exclude_truncated and rec.truncated:
            trunc += 1
        elif exclude_invalid and _invalid(rec, tokenizer):
            invalid += 1
        else:
            kept.append(rec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {fmt: pattern.format(dataset) for fmt, pattern in FILE_NAMES.items()}
    files = {}
    for fmt in formats:
        row = {"sharegpt": _sharegpt, "raw": _raw, "tokens": lambda r: _tokens(r, tokenizer)}[fmt]
        digest = hashlib.sha256()
        target = out / names[fmt]
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as fh:
            for rec in kept:
                line = _encoder.encode(row(rec)) + b"\n"
                digest.update(line)
                fh.write(line)
        tmp.replace(target)
        files[names[fmt]] = digest.hexdigest()
    by_tokens: dict[str, int] = {}
    by_count: dict[str, int] = {}
    for rec in kept:
        label = f"{rec.backend}/{rec.token_source}"
        by_tokens[label] = by_tokens.get(label, 0) + rec.completion_tokens
        by_count[label] = by_count.get(label, 0) + 1
    manifest = ExportManifest(
        dataset=dataset, formats=list(formats), records=len(kept), excluded_truncated=trunc,
        excluded_invalid=invalid, unreadable=unreadable, tokens_by_source=by_tokens,
        responses_by_source=by_count, files=files,
    )
    (out / manifest_name(dataset)).write_bytes(msgspec.json.format(_encoder.encode(manifest)) + b"\n")
    return manifest
