"""``draftfleet export``: training files from both sources, deterministic, with a manifest.

One module per format (``sharegpt``: SpecForge's conversations; ``raw``: raw_responses with ids
and provenance; ``tokens``: speculators' input_ids + loss_mask rows, one per turn), behind this
one entry, which reads the store, orders and filters the records and writes the manifest.
Order: by source file, then line or row number, then key, so two exports of one store are equal.
Every file is named after its dataset (``<dataset>.<format>.jsonl``, ``<dataset>.manifest.json``),
so several datasets exported into one folder overwrite nothing of each other. An export takes
one version of the dataset (``versions.py``: the current by default), and its manifest names it
with its settings, so a file never mixes the records of two settings.

The manifest tells a trainer what the files hold and how to read them: how many conversations
were generated without a system turn (SpecForge inserts its template's default unless the
template has none), which answers' reasoning the target's chat template renders in a whole
conversation (a template that drops it trains on answers without the reasoning the model wrote),
and how many cut turns the conversations file leaves out.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import msgspec

from draftfleet.conversation import record_turns
from draftfleet.export import raw, sharegpt, tokens
from draftfleet.schemas.records import GenerationSettings, ResponseRecord
from draftfleet.store import Store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.versions import Selection, VersionError, select

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
    version: int | None  # the dataset version exported; None: every version (--all-versions)
    settings: GenerationSettings | None  # that version's generation settings
    formats: list[str]
    records: int
    excluded_truncated: int  # records left out of every file (--exclude-truncated)
    excluded_invalid: int
    unreadable: int
    other_versions: int  # records of the dataset's other versions, left out
    tokens_by_source: dict[str, int]
    responses_by_source: dict[str, int]
    files: dict[str, str]  # name -> sha256
    turns: int = 0  # regenerated answers in the records exported (one per single-turn record)
    truncated_left_out: int = 0  # cut turns the conversations file leaves out (--include-truncated keeps them)
    without_system_turn: int = 0  # records generated without a system turn
    reasoning_in_template: str | None = None  # "all" | "last" | "none": answers whose reasoning the template renders
    notes: list[str] = []


def export_order(rec: ResponseRecord) -> tuple[str, int, str]:
    m = _SOURCE.match(rec.source)
    return (m.group(1), int(m.group(2)), rec.key) if m else (rec.source, 0, rec.key)


def _metadata(rec: ResponseRecord) -> dict:
    system = next((m.content for m in rec.messages if m.role == "system"), None)
    return {
        "key": rec.key, "prompt_id": rec.row_id, "source": rec.source, "backend": rec.backend,
        "token_source": rec.token_source, "model": rec.model, "finish_reason": rec.finish_reason,
        "completion_tokens": rec.completion_tokens,
        # what the generation used: SpecForge inserts its template's default system prompt when there is none
        "system_prompt": system,
    }


def _invalid(rec: ResponseRecord, tok: TargetTokenizer | None) -> bool:
    for turn in record_turns(rec):
        ids = turn.output_ids
        if not ids:
            return True
        if tok is None:
            continue
        if min(ids) < 0 or max(ids) >= tok.vocab_size:
            return True
        if turn.finish_reason == "stop" and ids[-1] != tok.eot_id:
            return True
    return False


def _notes(kept: list[ResponseRecord], without_system: int, reasoning: str | None) -> list[str]:
    notes = []
    if without_system:
        notes.append(f"{without_system} record(s) were generated without a system turn: train them with a SpecForge "
                     "chat template whose system_prompt is empty (README, 'Training with SpecForge'), or SpecForge "
                     "inserts its template's default system prompt the model never saw")
    with_reasoning = any(t.reasoning for rec in kept for t in record_turns(rec))
    if with_reasoning:
        notes.append("answers carry reasoning (reasoning_content): SpecForge keeps it only with a thinking template "
                     "(parser_type thinking); its general parser drops it")
        if reasoning == "none":
            notes.append("the target's chat template renders no answer's reasoning in a whole conversation (history "
                         "turns are blanked): a trainer rendering the conversations file trains on answers without "
                         "their reasoning; the tokens file holds what the model wrote")
        elif reasoning == "last":
            notes.append("the target's chat template renders the reasoning of the last answer only: in multi-turn "
                         "conversations the earlier turns' reasoning is dropped when rendered; the tokens file holds "
                         "every turn as the model wrote it")
    return notes


def selection(store: Store, dataset: str, version: int | None, all_versions: bool) -> Selection:
    try:
        return select(store, dataset, version, all_versions)
    except VersionError as exc:
        raise ExportError(str(exc)) from None


def export_dataset(store: Store, dataset: str, out_dir: str | Path, formats: list[str], *,
                   exclude_truncated: bool = False, exclude_invalid: bool = False, include_truncated: bool = False,
                   tokenizer: TargetTokenizer | None = None, version: int | None = None,
                   all_versions: bool = False) -> ExportManifest:
    """Write the files and manifest of the dataset's current version (``version``: another one;
    ``all_versions``: every record). Cut turns stay in ``raw`` and ``tokens`` (without an
    end-of-turn id) and are left out of ``sharegpt`` unless ``include_truncated``."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ExportError(f"unknown format(s) {sorted(unknown)}: choose from {', '.join(FORMATS)}")
    if "tokens" in formats and tokenizer is None:
        raise ExportError("the tokens format needs the target tokenizer ([fleet].tokenizer or --tokenizer)")
    chosen = selection(store, dataset, version, all_versions)
    records, unreadable, others = [], 0, 0
    for _name, data in store.read_many(store.record_files(dataset)):
        try:
            if isinstance(data, OSError):
                raise data
            rec = _decode(data)
        except (OSError, msgspec.DecodeError):
            unreadable += 1
            continue
        if chosen.takes(rec):
            records.append(rec)
        else:
            others += 1
    records.sort(key=export_order)
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
    files, left_out = {}, 0
    for fmt in formats:
        digest = hashlib.sha256()
        target = out / names[fmt]
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as fh:
            for rec in kept:
                if fmt == "sharegpt":
                    row, cut = sharegpt.row(rec, _metadata(rec), include_truncated)
                    left_out += cut
                    rows = [row] if row is not None else []
                elif fmt == "raw":
                    rows = [raw.row(rec)]
                else:
                    rows = tokens.rows(rec, _metadata(rec), tokenizer)
                for row in rows:
                    line = _encoder.encode(row) + b"\n"
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
    without_system = sum(not any(m.role == "system" for m in rec.messages) for rec in kept)
    reasoning = tokenizer.reasoning_in_conversations() if tokenizer is not None else None
    manifest = ExportManifest(
        dataset=dataset, version=chosen.version, settings=chosen.settings, formats=list(formats), records=len(kept),
        excluded_truncated=trunc, excluded_invalid=invalid, unreadable=unreadable, other_versions=others,
        tokens_by_source=by_tokens,
        responses_by_source=by_count, files=files, turns=sum(len(record_turns(r)) for r in kept),
        truncated_left_out=left_out, without_system_turn=without_system, reasoning_in_template=reasoning,
        notes=_notes(kept, without_system, reasoning),
    )
    (out / manifest_name(dataset)).write_bytes(msgspec.json.format(_encoder.encode(manifest)) + b"\n")
    return manifest
