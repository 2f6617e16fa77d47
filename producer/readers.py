"""Dataset readers: JSONL and parquet rows into prompts, every unusable row into a rejection.

A run over tens of thousands of rows must neither die on one bad line nor quietly alter a
prompt. ``read_prompts`` yields a ``PromptRow`` for each usable row and a ``Rejection`` for each
unusable one, whose message names file, line and field; the rejected line is kept verbatim
(``raw``, or ``raw_b64`` when it is not UTF-8) so that nothing the user gave is lost.
JSONL is read in binary one line at a time, never more than the line limit at once (a longer
line is hashed and counted as it streams past, and only its first bytes are kept); a JSON array
of rows (ShareGPT's usual ``.json``) one item at a time through ijson's event parser, an item over
the limit dropped as it streams past; parquet one record batch at a time. Memory stays bounded by
the limit or one batch, not the file. gzip and zstd files (``.gz``, ``.zst``, found by their magic
bytes, not their names) are read through a decompressor fed a few KiB at a time; a truncated or
corrupt stream is an error, never a quiet early end. Only regular files are read: a FIFO or
``/dev/zero`` would never end.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import ijson
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from draftfleet.conversation import runs
from draftfleet.schemas.config import MAX_LINE_BYTES, DatasetConfig, FieldMap
from draftfleet.schemas.records import Message, QuarantineEntry
from draftfleet.producer.files import STREAM_CHUNK, compression, open_regular, open_text

UTF8_BOM = b"\xef\xbb\xbf"
PARQUET_BATCH_ROWS = 1024
EXCERPT_BYTES = 4096
"""What the quarantine keeps of a line over the limit (with the line's length and sha256)."""

# ShareGPT ``from`` values and the chat roles they stand for.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}


class PromptRow(msgspec.Struct, frozen=True):
    """One usable row: the system and user turns before the first assistant turn, or with
    ``turns = "all"`` every system and user turn, an empty assistant message marking each answer
    the dataset had before a later user turn (``draftfleet.conversation``)."""

    source: str
    messages: list[Message]
    row_id: str | None


class Rejection(msgspec.Struct, frozen=True):
    """One unusable row (or a whole unusable file), ready for the quarantine."""

    entry: QuarantineEntry


class Line(msgspec.Struct, frozen=True):
    """One non-blank JSONL line within the limit, without its terminator. ``ended``: a newline
    followed it (only a file's last line can lack one: its writer may have been killed mid-line)."""

    where: str
    lineno: int
    data: bytes
    ended: bool


class _Reject(Exception):
    """Raised by the shape parsers; the reader turns it into a ``Rejection``."""

    def __init__(self, kind: str, field: str | None, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.field, self.detail = kind, field, detail


def read_prompts(ds: DatasetConfig, *, max_line_bytes: int | None = None) -> Iterator[PromptRow | Rejection]:
    """Yield each row of ``ds.path`` as a ``PromptRow`` or a ``Rejection``, in file order; never raises
    for bad data. A file that cannot be read at all yields one rejection with ``line`` None.
    ``max_line_bytes``: default the dataset's own ``max_line_bytes``."""
    if ds.file_format == "parquet":
        yield from _read_parquet(ds)
    else:
        yield from _read_json(ds, max_line_bytes or ds.max_line_bytes)


def count_rows(ds: DatasetConfig) -> int | None:
    """A cheap total for a progress bar: lines of a plain JSONL file (blank ones included) or a parquet
    file's row count from its footer; None when the file cannot be read, is compressed or is a JSON
    array (counting those means reading them whole)."""
    try:
        with open_regular(ds.path) as f:
            if ds.file_format == "parquet":
                return pq.ParquetFile(f).metadata.num_rows
            if compression(f) or _is_array(f, ds):
                return None
            lines, last = 0, b"\n"
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
        return lines + (last != b"\n")
    except (OSError, pa.ArrowException):
        return None


def jsonl_lines(f: BinaryIO, path: str, max_line_bytes: int = MAX_LINE_BYTES,
                limit_name: str = "the dataset's max_line_bytes") -> Iterator[Line | Rejection]:
    """The non-blank lines of an open JSONL file (``open_regular``), read bounded: a leading BOM
    skipped, a line over ``max_line_bytes`` a ``line_too_long`` rejection keeping its first bytes,
    length and sha256, a failed read an ``unreadable_file`` rejection naming the line (and the end).
    The one line reader of datasets and of ``import``; ``limit_name`` says where the limit is set."""
    name, lineno = Path(path).name, 0
    try:
        if f.peek(len(UTF8_BOM))[:len(UTF8_BOM)] == UTF8_BOM:
            f.read(len(UTF8_BOM))
        for lineno, (line, size, digest, ended) in enumerate(_lines(f, max_line_bytes), 1):
            where = f"{name}:{lineno}"
            if size is not None:
                detail = (f"line is {size} bytes, over the limit of {max_line_bytes} ({limit_name}); "
                          f"kept: its first {len(line)} bytes, its length and sha256")
                yield _rejection(path, where, lineno, "line_too_long", detail, raw=_utf8_prefix(line),
                                 line_bytes=size, line_sha256=digest)
            elif line.strip():
                yield Line(where, lineno, line, ended)
    except OSError as exc:
        where = f"{name}:{lineno + 1}"
        yield _rejection(path, where, lineno + 1, "unreadable_file", f"read failed: {exc.strerror or exc}")


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[bytes, int | None, str | None, bool]]:
    """Each line without its terminator as (bytes, None, None, ended); a line over ``limit`` as (its
    first EXCERPT_BYTES, its length, its sha256, ended), streamed through the hash, never held whole.
    ``ended``: a newline followed the line."""
    while line := f.readline(limit + 2):
        if line.endswith(b"\n") or len(line) < limit + 2:
            ended = line.endswith(b"\n")
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1] if ended else line
            yield (line, None, None, ended) if len(line) <= limit else (line[:EXCERPT_BYTES], len(line),
                                                                        hashlib.sha256(line).hexdigest(), ended)
            continue
        excerpt, digest, size, held = line[:EXCERPT_BYTES], hashlib.sha256(), 0, line
        while not held.endswith(b"\n") and (chunk := f.readline(STREAM_CHUNK)):
            excerpt += chunk[:EXCERPT_BYTES - len(excerpt)]
            digest.update(held[:-2])  # the last two bytes wait: they may be the terminator
            size += len(held) - 2
            held = held[-2:] + chunk
        ended = held.endswith(b"\n")
        held = held[:-2] if held.endswith(b"\r\n") else held[:-1] if ended else held
        digest.update(held)
        size += len(held)
        yield excerpt[:size], size, digest.hexdigest(), ended


def _utf8_prefix(excerpt: bytes) -> bytes:
    """An excerpt without the character its cut split (so UTF-8 text stays text, not base64)."""
    try:
        excerpt.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            return excerpt[:exc.start]
    return excerpt


def _is_array(f: io.BufferedReader, ds: DatasetConfig) -> bool:
    """Whether the file is one JSON array of rows: ``format = "json"``; with no format, a name that is
    not ``.jsonl``/``.ndjson`` (compressed or not) and a first byte, after a BOM and blanks, of ``[``
    (a JSONL row is an object, and many ``.json`` files are JSON Lines)."""
    if ds.format in ("json", "jsonl"):
        return ds.format == "json"
    name = Path(ds.path).name.removesuffix(".gz").removesuffix(".zst")
    if name.endswith((".jsonl", ".ndjson")):
        return False
    head = f.peek(STREAM_CHUNK)[:STREAM_CHUNK]
    return head.removeprefix(UTF8_BOM).lstrip(b" \t\r\n")[:1] == b"["


def _read_json(ds: DatasetConfig, max_line_bytes: int) -> Iterator[PromptRow | Rejection]:
    """JSON Lines or a JSON array of rows, plain or compressed; a dataset with no content is one
    ``empty_file`` rejection."""
    name = Path(ds.path).name
    try:
        f = open_text(ds.path)
        array = _is_array(f, ds)
    except OSError as exc:
        yield _rejection(ds.path, name, None, "unreadable_file", f"cannot read {ds.path}: {exc.strerror or exc}")
        return
    content = 0
    with f:
        items = _array_rows(f, ds, max_line_bytes) if array else (
            _jsonl_row(item.data, ds, item.where, item.lineno) if isinstance(item, Line) else item
            for item in jsonl_lines(f, ds.path, max_line_bytes))
        for item in items:
            yield item
            if isinstance(item, Rejection) and item.entry.kind == "unreadable_file":
                return  # a read failed: what follows is unknown, not empty
            content += 1
    if not content:
        what = "an empty JSON array" if array else "the file is empty or holds only blank lines"
        yield _rejection(ds.path, name, None, "empty_file", f"no rows: {what}")


class _Counted:
    """A file that counts the bytes read from it, and refuses to read on once one JSON value has
    grown past ``limit`` since ``mark`` (ijson holds a whole string before it yields it)."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self._f, self._limit = f, limit
        self.n = self.mark = 0

    def read(self, size: int = -1) -> bytes:
        if self.n - self.mark > self._limit:
            raise _ValueTooLong(self.n - self.mark)
        data = self._f.read(size)
        self.n += len(data)
        return data


class _ValueTooLong(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


_ARRAY_BUFFER = 64 * 1024
"""ijson's read size at most: what a byte count measured at an event can be ahead of the parser."""


def _array_rows(f: BinaryIO, ds: DatasetConfig, limit: int) -> Iterator[PromptRow | Rejection]:
    """Each item of a JSON array of rows, built from ijson's events one item at a time: an item
    over ``limit`` bytes stops being built as it streams past (a ``line_too_long`` rejection with its
    approximate size), and a single value over it ends the read (the parser would hold it whole).
    Items are named ``<file>:item<i>`` from 0, as parquet rows are ``row<i>``."""
    name, path = Path(ds.path).name, ds.path
    if f.peek(len(UTF8_BOM))[:len(UTF8_BOM)] == UTF8_BOM:
        f.read(len(UTF8_BOM))
    buf = min(_ARRAY_BUFFER, max(1024, limit // 16))
    counted = _Counted(f, limit + 2 * buf)
    events = ijson.basic_parse(counted, use_float=True, buf_size=buf)
    index, depth, builder, start = -1, 0, None, 0
    try:
        first = next(events, None)
        if first is None:
            return
        if first[0] != "start_array":
            detail = (f"expected a JSON array of rows (format = \"json\"), the file starts with a JSON "
                      f"{'object' if first[0] == 'start_map' else 'value'}")
            yield _rejection(path, name, None, "not_array", detail)
            return
        for event, value in events:
            counted.mark = counted.n
            if depth == 0:
                if event == "end_array":
                    break
                index += 1
                builder, start = ijson.ObjectBuilder(), counted.n
            if event in ("start_map", "start_array"):
                depth += 1
            elif event in ("end_map", "end_array"):
                depth -= 1
            if builder is not None:
                builder.event(event, value)
                if counted.n - start > limit + buf:
                    builder = None  # over the limit: skip the rest of this item
            if depth == 0:
                where = f"{name}:item{index}"
                if builder is None:
                    detail = (f"item is about {counted.n - start} bytes, over the limit of {limit} "
                              "(the dataset's max_line_bytes); not kept")
                    yield _rejection(path, where, index, "line_too_long", detail, line_bytes=counted.n - start)
                else:
                    yield _array_row(builder.value, ds, where, index)
                builder = None
        for _ in events:  # anything after the array is an error the parser raises
            pass
    except _ValueTooLong as exc:
        detail = (f"item {index} holds one value over the limit of {limit} bytes (the dataset's max_line_bytes), "
                  "which the parser would hold whole; the rest of the file is not read")
        yield _rejection(path, f"{name}:item{index}", index, "line_too_long", detail, line_bytes=exc.size)
    except ijson.JSONError as exc:
        try:
            f.read(1)  # a compressed file cut short says so on the read after its end
        except OSError as cut:
            yield _rejection(path, f"{name}:item{index + 1}", index + 1, "unreadable_file", f"read failed: {cut.strerror}")
            return
        at = index if depth else index + 1  # the item the error is in, or the one that would follow
        after = f"in item {index}" if depth else f"after item {index}" if index >= 0 else "at its start"
        hint = ("; if the file is JSON Lines whose first line is an array, set format = \"jsonl\""
                if not depth and index >= 0 else "")
        why = str(exc).strip().splitlines()[0]  # yajl adds the text around the error on further lines
        detail = f"invalid JSON {after} (near byte {counted.n}): {why}; the items before it are read, the rest is not{hint}"
        yield _rejection(path, f"{name}:item{at}", at, "bad_json", detail)
    except OSError as exc:
        where = f"{name}:item{index + 1}"
        yield _rejection(path, where, index + 1, "unreadable_file", f"read failed: {exc.strerror or exc}")


def _array_row(row: Any, ds: DatasetConfig, where: str, index: int) -> PromptRow | Rejection:
    """One array item's prompt; a rejected item keeps its JSON (re-encoded: the parser keeps no bytes)."""
    if not isinstance(row, dict):
        return _rejection(ds.path, where, index, "not_object", f"expected a JSON object per item, got {_type(row)}",
                          raw=msgspec.json.encode(row))
    try:
        return _prompt_row(row, ds.fields, where, ds.turns == "all")
    except _Reject as r:
        return _rejection(ds.path, where, index, r.kind, r.detail, field=r.field, raw=msgspec.json.encode(row))


def _jsonl_row(line: bytes, ds: DatasetConfig, where: str, lineno: int) -> PromptRow | Rejection:
    return parse_line(line, ds, where, lineno)[1]


def parse_line(line: bytes, ds: DatasetConfig, where: str, lineno: int,
               path: str | None = None) -> tuple[dict[str, Any] | None, PromptRow | Rejection]:
    """Decode one JSONL line into its row and its prompt (``import`` reads output fields from the row).

    ``path``: the file the line came from when it is not the dataset's (``import``)."""
    path = path or ds.path
    try:
        row = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as uexc:
            detail = f"not valid UTF-8 at byte {uexc.start} ({uexc.reason}); the line is kept as base64"
            return None, _rejection(path, where, lineno, "bad_utf8", detail, raw=line)
        # msgspec gives no position when the input ends early: the position is then the end.
        position = "" if "byte" in str(exc) else f" (byte {len(line)})"
        return None, _rejection(path, where, lineno, "bad_json", f"invalid JSON: {exc}{position}", raw=line)
    except RecursionError:
        return None, _rejection(path, where, lineno, "bad_json", "invalid JSON: nested too deeply to decode", raw=line)
    if not isinstance(row, dict):
        detail = f"expected a JSON object per line, got {_type(row)}"
        return None, _rejection(path, where, lineno, "not_object", detail, raw=line)
    try:
        return row, _prompt_row(row, ds.fields, where, ds.turns == "all")
    except _Reject as r:
        return row, _rejection(path, where, lineno, r.kind, r.detail, field=r.field, raw=line)


def rejection(path: str, where: str, line: int | None, kind: str, detail: str, *,
              field: str | None = None, raw: bytes | None = None) -> Rejection:
    """A quarantine entry for a problem found outside the reader (``import``'s output fields)."""
    return _rejection(path, where, line, kind, detail, field=field, raw=raw)


def _read_parquet(ds: DatasetConfig) -> Iterator[PromptRow | Rejection]:
    name = Path(ds.path).name
    try:  # the plain reason (missing, a directory, a FIFO, permission denied)
        with open_regular(ds.path) as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        yield _rejection(ds.path, name, None, "unreadable_file", f"cannot read {ds.path}: {exc.strerror or exc}")
        return
    if size == 0:
        yield _rejection(ds.path, name, None, "empty_file", "no rows: the file is empty (0 bytes)")
        return
    try:
        pf = pq.ParquetFile(ds.path)
    except (OSError, pa.ArrowException) as exc:
        yield _rejection(ds.path, name, None, "bad_parquet", f"not a readable parquet file: {exc}")
        return
    with pf:
        fm, have = ds.fields, pf.schema_arrow.names
        shapes = [col for _, col in _shapes(fm)]
        mapped = [c for c in (fm.messages, fm.prompt, fm.instruction, fm.input, fm.system, fm.id) if c]
        lacking = [c for c in mapped if c not in have]
        if lacking or not any(c in have for c in shapes):
            problem = f"the field map names {_names(lacking)}" if lacking else f"no column {_names(shapes)}"
            detail = f"no usable column: {problem}; the file has {_names(have)}"
            yield _rejection(ds.path, name, None, "parquet_columns", detail)
            return
        if pf.metadata.num_rows == 0:
            yield _rejection(ds.path, name, None, "empty_file", "no rows: the parquet file holds 0 rows")
            return
        extra = [fm.input or "input", fm.system or "system", fm.id or "id"]
        columns = [c for c in have if c in shapes or c in extra]
        index = 0
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                for row in batch.to_pylist():
                    where = f"{name}:row{index}"
                    try:
                        yield _prompt_row(row, fm, where, ds.turns == "all")
                    except _Reject as r:
                        raw = msgspec.json.encode(row, enc_hook=str)
                        yield _rejection(ds.path, where, index, r.kind, r.detail, field=r.field, raw=raw)
                    index += 1
        except (OSError, pa.ArrowException) as exc:
            detail = f"corrupt parquet: rows from {index} on are unreadable: {exc}"
            yield _rejection(ds.path, name, None, "bad_parquet", detail)


def _shapes(fields: FieldMap) -> list[tuple[str, str]]:
    """(shape, column) pairs to try in order: the field map's own, else the auto-detected defaults."""
    named = (("messages", fields.messages), ("prompt", fields.prompt), ("instruction", fields.instruction))
    return [(shape, col) for shape, col in named if col] or [
        ("messages", "messages"),
        ("messages", "conversations"),
        ("prompt", "prompt"),
        ("instruction", "instruction"),
    ]


def _prompt_row(row: dict[str, Any], fields: FieldMap, where: str, all_turns: bool = False) -> PromptRow:
    """Build the prompt from the first shape whose column is present and not null."""
    shapes = _shapes(fields)
    for shape, col in shapes:
        value = row.get(col)
        if value is None:
            continue
        if shape == "messages":
            messages = _turns(value, col, all_turns)
        else:
            text = _instruction(row, col, fields) if shape == "instruction" else _string(value, col)
            if not text.strip():
                raise _Reject("empty_prompt", col, "the prompt is empty or whitespace only")
            system = _optional_string(row, fields.system or "system", mapped=bool(fields.system))
            messages = ([Message("system", system)] if system else []) + [Message("user", text)]
        return PromptRow(source=where, messages=messages, row_id=_row_id(row, fields))
    cols = [col for _, col in shapes]
    detail = f"no prompt found: looked for {_names(cols)}; the row has {_names(list(row))}"
    raise _Reject("missing_field", cols[0] if len(cols) == 1 else None, detail)


def _turns(value: Any, col: str, all_turns: bool = False) -> list[Message]:
    """The system and user turns before the first assistant turn of an OpenAI or ShareGPT list;
    with ``all_turns``, every system and user turn, an empty assistant mark where an answer the
    dataset had is followed by another user turn (answers in a row make one mark; a last answer
    none: nothing follows it)."""
    if not isinstance(value, list):
        raise _Reject("wrong_type", col, f"expected a list of turns, got {_type(value)}")
    messages: list[Message] = []
    for i, turn in enumerate(value):
        at = f"{col}[{i}]"
        if not isinstance(turn, dict):
            raise _Reject("wrong_type", at, f"expected a turn object, got {_type(turn)}")
        if turn.get("role") is not None:
            role_key, text_key = "role", "content"
        elif turn.get("from") is not None:
            role_key, text_key = "from", "value"
        else:
            detail = "expected 'role' and 'content' (OpenAI) or 'from' and 'value' (ShareGPT)"
            raise _Reject("missing_field", at, detail)
        given = turn[role_key]
        if not isinstance(given, str):
            raise _Reject("wrong_type", f"{at}.{role_key}", f"expected a string, got {_type(given)}")
        role = SHAREGPT_ROLES.get(given, given) if role_key == "from" else given
        if role == "assistant":
            if not all_turns:
                break
            if messages and messages[-1].role != "assistant":
                messages.append(Message("assistant", ""))
            continue
        if role not in ("system", "user"):
            where_ = "in a conversation" if all_turns else "before the first assistant turn"
            detail = f"role {given!r} {where_}: a prompt holds only system and user turns"
            raise _Reject("unsupported_role", f"{at}.{role_key}", detail)
        content = _content(turn.get(text_key), f"{at}.{text_key}")
        if role == "user" and not content.strip():
            raise _Reject("empty_prompt", f"{at}.{text_key}", "the user turn is empty or whitespace only")
        messages.append(Message(role, content))
    if messages and messages[-1].role == "assistant":
        messages.pop()  # the conversation's last answer: nothing follows it
    if not any(m.role == "user" for m in messages):
        raise _Reject("empty_prompt", col, "no user turn before the first assistant turn")
    if all_turns and not all(any(m.role == "user" for m in run) for run in runs(messages)):
        raise _Reject("empty_prompt", col, "a run of turns between two answers holds no user turn")
    return messages


def _content(value: Any, field: str) -> str:
    """A turn's text: a string as is, or a list of text parts joined by newlines (as vLLM does)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _Reject("wrong_type", field, f"expected a string or a list of content parts, got {_type(value)}")
    texts = []
    for j, part in enumerate(value):
        at = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise _Reject("wrong_type", at, f"expected a content part object, got {_type(part)}")
        kind = part.get("type")
        if kind is None:
            raise _Reject("missing_field", f"{at}.type", "a content part needs a 'type'")
        if kind != "text":
            raise _Reject("unsupported_content", at, f"content part of type {kind!r}: only text parts are supported")
        texts.append(_string(part.get("text"), f"{at}.text"))
    return "\n".join(texts)


def _instruction(row: dict[str, Any], col: str, fields: FieldMap) -> str:
    """Alpaca style: ``instruction`` then, when non-empty, a blank line and ``input``."""
    instruction = _string(row[col], col)
    extra = _optional_string(row, fields.input or "input", mapped=bool(fields.input))
    return f"{instruction}\n\n{extra}" if extra else instruction


def _row_id(row: dict[str, Any], fields: FieldMap) -> str | None:
    """The row's own id (a string or an integer); a mapped id column must hold one."""
    col = fields.id or "id"
    if col not in row:
        if fields.id:
            raise _Reject("missing_field", col, f"the field map names column {col!r}, which this row lacks")
        return None
    value = row[col]
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if fields.id:
        raise _Reject("wrong_type", col, f"expected a string or integer id, got {_type(value)}")
    return None


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _Reject("wrong_type", field, f"expected a string, got {_type(value)}")
    return value


def _optional_string(row: dict[str, Any], col: str, *, mapped: bool) -> str | None:
    """An optional string column: None when null or absent (absent is an error only when mapped)."""
    if col not in row:
        if mapped:
            raise _Reject("missing_field", col, f"the field map names column {col!r}, which this row lacks")
        return None
    return None if row[col] is None else _string(row[col], col)


def _type(value: Any) -> str:
    return {type(None): "null", str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _names(cols: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(c) for c in cols[:limit])
    return (shown + f", ... ({len(cols)} in all)") if len(cols) > limit else (shown or "none")


def _rejection(
    path: str,
    where: str,
    line: int | None,
    kind: str,
    detail: str,
    *,
    field: str | None = None,
    raw: bytes | None = None,
    line_bytes: int | None = None,
    line_sha256: str | None = None,
) -> Rejection:
    """A quarantine entry; ``raw`` is kept as text when it is UTF-8, else as base64."""
    text = b64 = None
    if raw is not None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            b64 = base64.b64encode(raw).decode("ascii")
    message = f"{where}: field '{field}': {detail}" if field else f"{where}: {detail}"
    entry = QuarantineEntry(
        file=path, line=line, field=field, kind=kind, message=message, raw=text, raw_b64=b64, at=time.time(),
        line_bytes=line_bytes, line_sha256=line_sha256,
    )
    return Rejection(entry)
