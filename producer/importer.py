"""``draftfleet import``: bring an earlier pipeline's ``raw_responses.jsonl`` into the store.

Each line holds a prompt (in any shape the reader accepts) and its output: text and/or
``output_ids``, and/or ``completion_tokens``. Records are keyed exactly as ``enqueue`` keys the
same prompt under the dataset's settings, so a following ``enqueue`` resumes after them (the
seed's "resume from prompt 1747"). Lines with ids are ``exact``; text-only lines are re-tokenized.
What a line says of its provenance (``token_source`` beside ids, backend, backend_kind, model, cost,
usage, the original ``source``) is kept, so a raw export imports back as the same records.
A cut-off last line (the writer was killed mid-line) is reported and skipped; other bad lines go
to the quarantine. Nothing already in the store is overwritten.

The file is read as a JSONL dataset is (``files.open_text``, ``readers.jsonl_lines``): a regular
file only (a FIFO is a clear error, not a hang), plain or gzip/zstd-compressed, one line at a time,
a line over ``IMPORT_LINE_BYTES`` (64 MiB, not a dataset's 4 MiB: one line holds a whole answer's
ids and text) quarantined with its length and sha256, never held whole.

The target tokenizer re-tokenizes text-only lines. When it cannot for one line (the template
renders that prompt differently once an answer follows it, or refuses its messages with
``raise_exception``; the text holds what it parses as a special token), the line is quarantined as ``retokenize`` with the tokenizer's reason and the import
goes on. When the chat template cannot place any answer as configured (``TemplateError``: a
setting such as ``[fleet].end_of_turn`` or ``[fleet].reasoning_markers`` must change), every
such line would fail alike: the import stops there with a one-line error naming the line; what
was stored before it stays, and the same import run again after the fix skips it.

A line that gives no ``finish_reason`` is classified by a rule the user picks (``FINISH_RULES``),
and the summary says how many lines each rule decided:
- ``max-tokens`` (default): ids ending in end-of-turn stopped; otherwise the response is truncated
  only if it is at least ``max_tokens`` long: a short one stopped (on a stop string, or its writer
  dropped the end-of-turn id; the ids are kept as they are). Text-only lines are measured after
  re-tokenizing.
- ``end-of-turn``: ids that do not end in end-of-turn are truncated, whatever their length.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from draftfleet.identity import prompt_key
from draftfleet.ledger import Ledger
from draftfleet.schemas.config import DatasetConfig
from draftfleet.conversation import conversation_record, runs
from draftfleet.schemas.records import (
    IMPORTED_BY, DatasetManifest, Message, PromptTask, QuarantineEntry, ResponseRecord, Turn, Usage,
)
from draftfleet.store import Store
from draftfleet.tokenizer import TargetTokenizer, TemplateError, TokenizerError
from draftfleet.producer.enqueue import prompt_messages
from draftfleet.producer.files import open_text
from draftfleet.producer.readers import Line, PromptRow, Rejection, jsonl_lines, parse_line, rejection

FINISH_RULES = ("max-tokens", "end-of-turn")
IMPORT_LINE_BYTES = 64 * 1024 * 1024
"""Above the datasets' limit: a raw export's line of a long conversation holds every turn's prompt ids."""
TEXT_FIELDS = ("output", "response", "completion", "generated_text", "answer", "text")
IDS_FIELDS = ("output_ids", "token_ids", "completion_ids")


class ImportSummary(msgspec.Struct, kw_only=True):
    dataset: str
    file: str
    lines: int = 0
    imported: int = 0
    completion_tokens: int = 0
    already_present: int = 0
    rejected: int = 0
    rejected_by_kind: dict[str, int] = {}
    cut_last_line: bool = False
    exact: int = 0
    retokenized: int = 0
    finish_rule: str = FINISH_RULES[0]
    # how each line's finish reason was decided ("file", "end_of_turn", "max_tokens"), then its verdict
    finish_decided: dict[str, dict[str, int]] = {}


class _Bad(Exception):
    def __init__(self, field: str, detail: str):
        super().__init__(detail)
        self.field, self.detail = field, detail


def _output_text(row: dict[str, Any]) -> str | None:
    for f in TEXT_FIELDS:
        if isinstance(row.get(f), str):
            return row[f]
    for col in ("messages", "conversations"):
        turns = row.get(col)
        if isinstance(turns, list):
            for t in turns:
                if isinstance(t, dict) and (t.get("role") or t.get("from")) in ("assistant", "gpt", "chatgpt", "model"):
                    content = t.get("content", t.get("value"))
                    if isinstance(content, str):
                        return content
    return None


def _output_ids(row: dict[str, Any]) -> list[int] | None:
    for f in IDS_FIELDS:
        if f in row and row[f] is not None:
            ids = row[f]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise _Bad(f, "expected a list of integer token ids")
            return ids
    return None


def _int_field(row: dict[str, Any], name: str) -> int | None:
    for src in (row, row.get("usage"), row.get("meta_info")):
        if isinstance(src, dict) and isinstance(src.get(name), int) and not isinstance(src.get(name), bool):
            return src[name]
    return None


def _given_finish(row: dict[str, Any]) -> str | None:
    fr = row.get("finish_reason", (row.get("meta_info") or {}).get("finish_reason") if isinstance(row.get("meta_info"), dict) else None)
    if isinstance(fr, dict):
        fr = fr.get("type")
    return fr if isinstance(fr, str) and fr else None


def _finish(row: dict[str, Any], ids: list[int], tok: TargetTokenizer | None, max_tokens: int,
            rule: str) -> tuple[str, str]:
    """(finish reason, what decided it) for a line with ids; see the module's docstring."""
    given = _given_finish(row)
    if given is not None:
        return given, "file"
    if tok is not None and ids and ids[-1] == tok.eot_id:
        return "stop", "end_of_turn"
    if rule == "end-of-turn" and tok is not None and ids:
        return "length", "end_of_turn"
    return ("length" if len(ids) >= max_tokens else "stop"), "max_tokens"


def _record(ds: DatasetConfig, manifest: DatasetManifest, prompt: PromptRow, row: dict[str, Any],
            tok: TargetTokenizer | None, label: str, source: str, rule: str) -> tuple[ResponseRecord, str]:
    """The record of one line, and what decided its finish reason."""
    messages = prompt_messages(ds, prompt)
    key = prompt_key(ds.name, messages, manifest.settings)
    # a raw export's ``id`` is the key; the row's own id is its ``prompt_id``
    row_id = (row["prompt_id"] if isinstance(row["prompt_id"], str) else None) if "prompt_id" in row else prompt.row_id
    if manifest.settings.turns == "all":
        return _conversation(ds, manifest, messages, key, row_id, row, tok, source), "file"
    text = _output_text(row)
    ids = _output_ids(row)
    reasoning = row.get("reasoning") or row.get("reasoning_content")
    reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
    if ids is None:
        if text is None:
            raise _Bad("output", f"no output: looked for {', '.join(TEXT_FIELDS + IDS_FIELDS)}")
        if tok is None:
            raise _Bad("output_ids", "no output_ids and no tokenizer to re-tokenize the text ([fleet].tokenizer)")
        finish, decided = _given_finish(row), "file"
        if finish is None:
            body = tok.completion_ids(messages, text, reasoning, stopped=False)
            finish, decided = ("length" if len(body) >= manifest.settings.max_tokens else "stop"), "max_tokens"
        ids = tok.completion_ids(messages, text, reasoning, stopped=finish == "stop")
        source_kind = "retokenized"
    else:
        if text is None:
            if tok is None:
                raise _Bad("output", "output_ids without text need a tokenizer to decode them")
            text = tok.decode(ids)
        finish, decided = _finish(row, ids, tok, manifest.settings.max_tokens, rule)
        source_kind = "exact"
    if tok is not None and ids and (min(ids) < 0 or max(ids) >= tok.vocab_size):
        raise _Bad("output_ids", f"ids outside the tokenizer's vocabulary of {tok.vocab_size}")
    theirs = _int_field(row, "completion_tokens")
    prompt_tokens = _int_field(row, "prompt_tokens") or (len(tok.prompt_ids(messages)) if tok else 0)
    cost = row.get("cost") if isinstance(row.get("cost"), (int, float)) else None
    record = ResponseRecord(
        key=key, dataset=ds.name, source=source, settings_id=manifest.settings_id, messages=messages,
        system_prompt_used=any(m.role == "system" for m in messages), text=text, reasoning=reasoning,
        output_ids=ids, prompt_tokens=prompt_tokens, completion_tokens=len(ids) or (theirs or 0),
        finish_reason=finish, truncated=finish == "length", backend=label,
        backend_kind="gpu" if source_kind == "exact" else "cloud", model=str(row.get("model") or manifest.settings.model),
        token_source=source_kind, usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=theirs or 0, cost_usd=cost),
        cost_usd=float(cost or 0.0), cost_source="provider" if cost is not None else "none", latency_s=0.0,
        attempts=1, worker=IMPORTED_BY, created_at=time.time(), row_id=row_id,
    )
    return msgspec.structs.replace(record, **_provenance(row, given_ids=source_kind == "exact")), decided


def _conversation(ds: DatasetConfig, manifest: DatasetManifest, messages: list[Message], key: str,
                  row_id: str | None, row: dict[str, Any], tok: TargetTokenizer | None, source: str) -> ResponseRecord:
    """A conversation's record from a raw export's line of a ``turns = "all"`` dataset: its ``turns``
    as they were stored (one per user turn, fewer only after a cut turn)."""
    try:
        turns = msgspec.convert(row.get("turns"), list[Turn])
    except msgspec.ValidationError as exc:
        raise _Bad("turns", f"a line of a multi-turn dataset needs its turns, as a raw export writes them: {exc}") from None
    n = len(runs(messages))
    if not turns or len(turns) > n or (len(turns) < n and not turns[-1].truncated):
        raise _Bad("turns", f"{len(turns)} turns for a conversation of {n} user turns (fewer only after a cut turn)")
    if tok is not None and any(i < 0 or i >= tok.vocab_size for t in turns for i in t.output_ids):
        raise _Bad("turns", f"ids outside the tokenizer's vocabulary of {tok.vocab_size}")
    task = PromptTask(key=key, dataset=ds.name, source=source, messages=messages, settings=manifest.settings,
                      settings_id=manifest.settings_id, enqueued_at=0.0, row_id=row_id)
    record = conversation_record(task, turns, IMPORTED_BY)
    given = row.get("source")
    return msgspec.structs.replace(record, source=given) if isinstance(given, str) and given else record


def _provenance(row: dict[str, Any], given_ids: bool) -> dict[str, Any]:
    """What a line says about where its response came from, kept as it is (a raw export writes it all).

    ``token_source`` is kept only beside ids: a re-tokenized cloud record stays ``retokenized``,
    while a text-only line is re-tokenized here whatever it claims. Invalid values are ignored.
    """
    out: dict[str, Any] = {}
    for name, ok in (("backend", lambda v: isinstance(v, str) and v), ("source", lambda v: isinstance(v, str) and v),
                     ("backend_kind", lambda v: v in ("gpu", "cloud")),
                     ("cost_source", lambda v: v in ("provider", "price_table", "none")),
                     ("latency_s", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
                     ("attempts", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                     ("retry_reasons", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))):
        if name in row and ok(row[name]):
            out[name] = row[name]
    if given_ids and row.get("token_source") in ("exact", "retokenized"):
        out["token_source"] = row["token_source"]
    if isinstance(row.get("usage"), dict):
        try:
            out["usage"] = msgspec.convert(row["usage"], Usage)
        except msgspec.ValidationError as exc:
            raise _Bad("usage", f"not a usage object: {exc}") from None
    return out


def import_file(path: str | Path, ds: DatasetConfig, manifest: DatasetManifest, store: Store,
                tokenizer: TargetTokenizer | None, ledger: Ledger | None = None, label: str = "import",
                finish_rule: str = FINISH_RULES[0], max_line_bytes: int = IMPORT_LINE_BYTES) -> ImportSummary:
    """Import every line of ``path`` (see the module's docstring). Raises ``OSError`` when the file
    cannot be opened or is not a regular file, ``TemplateError`` when the chat template must change."""
    if finish_rule not in FINISH_RULES:
        raise ValueError(f"unknown finish rule {finish_rule!r}: choose from {', '.join(FINISH_RULES)}")
    path = Path(path)
    summary = ImportSummary(dataset=ds.name, file=str(path), finish_rule=finish_rule)
    kinds: Counter[str] = Counter()
    rejects: list[QuarantineEntry] = []
    try:
        with open_text(path) as fh:
            for line in jsonl_lines(fh, str(path), max_line_bytes, "import's limit"):
                summary.lines += 1
                got = line.entry if isinstance(line, Rejection) else _line_record(
                    line, ds, manifest, tokenizer, label, finish_rule, str(path))
                if got is None:
                    summary.cut_last_line = True
                    continue
                if isinstance(got, QuarantineEntry):
                    kinds[got.kind] += 1
                    rejects.append(got)
                    continue
                rec, decided = got
                verdicts = summary.finish_decided.setdefault(decided, {})
                verdicts[rec.finish_reason] = verdicts.get(rec.finish_reason, 0) + 1
                if not store.put(rec):
                    summary.already_present += 1
                    continue
                if ledger is not None:
                    ledger.count(rec, rate=False)  # made elsewhere, earlier: no backend's rate
                summary.imported += 1
                summary.completion_tokens += rec.completion_tokens
                summary.exact += rec.token_source == "exact"
                summary.retokenized += rec.token_source == "retokenized"
    finally:  # also when a template problem stops the import: what was rejected before it is kept
        store.quarantine(ds.name, rejects)
    summary.rejected = sum(kinds.values())
    summary.rejected_by_kind = dict(kinds)
    return summary


def _line_record(line: Line, ds: DatasetConfig, manifest: DatasetManifest, tokenizer: TargetTokenizer | None,
                 label: str, finish_rule: str, path: str) -> tuple[ResponseRecord, str] | QuarantineEntry | None:
    """The record of one line and what decided its finish reason; the quarantine entry of a rejected
    line; None for a cut-off last line (no newline after it, and not JSON: its writer was killed)."""
    row, prompt = parse_line(line.data, ds, line.where, line.lineno, path)
    if isinstance(prompt, Rejection):
        return None if not line.ended and row is None else prompt.entry
    try:
        return _record(ds, manifest, prompt, row, tokenizer, label, line.where, finish_rule)
    except _Bad as bad:
        kind, field, detail = "bad_output", bad.field, bad.detail
    except TemplateError as exc:
        raise TemplateError(f"{line.where}: {exc}; the import stopped at this line (what it imported before "
                            "stays: run it again once the setting is fixed)") from None
    except TokenizerError as exc:
        kind, field, detail = "retokenize", "output", f"the target tokenizer cannot re-tokenize this answer: {exc}"
    return rejection(path, line.where, line.lineno, kind, detail, field=field, raw=line.data).entry
