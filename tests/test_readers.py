"""The dataset readers against real files: every bad line becomes a clear rejection, kept verbatim,
and the good rows around it still come through with their own line numbers."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftfleet.producer.readers import EXCERPT_BYTES, PromptRow, Rejection, count_rows, read_prompts
from draftfleet.schemas.config import DatasetConfig, FieldMap
from draftfleet.schemas.records import Message

GOOD = b'{"prompt": "good"}'


def dataset(path, **kw) -> DatasetConfig:
    return DatasetConfig(name="t", path=str(path), **kw)


def read(path, **kw) -> list[PromptRow | Rejection]:
    max_line_bytes = kw.pop("max_line_bytes", 4 * 1024 * 1024)
    return list(read_prompts(dataset(path, **kw), max_line_bytes=max_line_bytes))


def split(items):
    rows = [i for i in items if isinstance(i, PromptRow)]
    rejections = [i.entry for i in items if isinstance(i, Rejection)]
    assert len(rows) + len(rejections) == len(items)
    return rows, rejections


def raw_bytes(entry) -> bytes:
    assert (entry.raw is None) != (entry.raw_b64 is None), "exactly one of raw / raw_b64"
    return entry.raw.encode("utf-8") if entry.raw is not None else base64.b64decode(entry.raw_b64)


def jl(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def user(text):
    return {"role": "user", "content": text}


# (id, the bad line, kind, field named in the message or None, whether raw must come as base64)
BAD_LINES = [
    ("truncated-json", b'{"prompt": "hi"', "bad_json", None, False),
    ("trailing-garbage", b'{"prompt": "hi"} extra', "bad_json", None, False),
    ("single-quotes", b"{'prompt': 'hi'}", "bad_json", None, False),
    ("lone-surrogate", b'{"prompt": "\\ud800 x"}', "bad_json", None, False),
    ("nul-bytes", b"\x00\x00\x00", "bad_json", None, False),
    ("deep-nesting", b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "bad_json", None, False),
    ("array-line", b"[1, 2]", "not_object", None, False),
    ("number-line", b"42", "not_object", None, False),
    ("string-line", b'"just text"', "not_object", None, False),
    ("latin1-in-string", '{"prompt": "café"}'.encode("latin-1"), "bad_utf8", None, True),
    ("utf16-bytes", '{"prompt": "é"}'.encode("utf-16-le"), "bad_utf8", None, True),
    ("no-shape", jl({"text": "hi", "label": 1}), "missing_field", None, False),
    ("turn-without-role", jl({"messages": [{"content": "x"}]}), "missing_field", "messages[0]", False),
    ("part-without-type", jl({"messages": [{"role": "user", "content": [{"text": "x"}]}]}),
     "missing_field", "messages[0].content[0].type", False),
    ("content-int", jl({"messages": [user(5)]}), "wrong_type", "messages[0].content", False),
    ("content-null", jl({"messages": [user(None)]}), "wrong_type", "messages[0].content", False),
    ("messages-string", jl({"messages": "hello"}), "wrong_type", "messages", False),
    ("turn-not-object", jl({"messages": ["hello"]}), "wrong_type", "messages[0]", False),
    ("role-int", jl({"messages": [{"role": 1, "content": "x"}]}), "wrong_type", "messages[0].role", False),
    ("prompt-list", jl({"prompt": ["a", "b"]}), "wrong_type", "prompt", False),
    ("system-int", jl({"prompt": "hi", "system": 5}), "wrong_type", "system", False),
    ("input-int", jl({"instruction": "do", "input": 3}), "wrong_type", "input", False),
    ("part-text-int", jl({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
     "wrong_type", "messages[0].content[0].text", False),
    ("prompt-whitespace", jl({"prompt": "  \n\t "}), "empty_prompt", "prompt", False),
    ("user-turn-empty", jl({"messages": [user("")]}), "empty_prompt", "messages[0].content", False),
    ("assistant-first", jl({"messages": [{"role": "assistant", "content": "x"}, user("q")]}),
     "empty_prompt", "messages", False),
    ("empty-conversation", jl({"conversations": []}), "empty_prompt", "conversations", False),
    ("tool-before-assistant", jl({"messages": [{"role": "tool", "content": "x"}, user("q")]}),
     "unsupported_role", "messages[0].role", False),
    ("developer-role", jl({"messages": [{"role": "developer", "content": "x"}, user("q")]}),
     "unsupported_role", "messages[0].role", False),
    ("sharegpt-unknown-from", jl({"conversations": [{"from": "bing", "value": "x"}]}),
     "unsupported_role", "conversations[0].from", False),
    ("image-part", jl({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
     "unsupported_content", "messages[0].content[1]", False),
]


@pytest.mark.parametrize("bad, kind, field, as_b64", [c[1:] for c in BAD_LINES], ids=[c[0] for c in BAD_LINES])
def test_bad_line_is_rejected_verbatim_and_neighbours_survive(tmp_path, bad, kind, field, as_b64):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(GOOD + b"\n" + bad + b"\n\n" + GOOD + b"\n")
    rows, rejections = split(read(path))
    assert [r.source for r in rows] == ["chat.jsonl:1", "chat.jsonl:4"]
    [entry] = rejections
    assert entry.kind == kind
    assert entry.line == 2 and entry.file == str(path) and entry.field == field
    assert entry.message.startswith("chat.jsonl:2: ")
    if field:
        assert f"field '{field}'" in entry.message
    assert (entry.raw_b64 is not None) == as_b64
    assert raw_bytes(entry) == bad


def test_bad_json_message_gives_the_decoder_position(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b'{"prompt": "hi"} extra\n{"prompt": "hi"\n')
    _, rejections = split(read(path))
    assert [e.kind for e in rejections] == ["bad_json", "bad_json"]
    assert re.search(r"\(byte \d+\)$", rejections[0].message)
    assert rejections[1].message.endswith("(byte 15)")


def test_missing_field_says_what_was_looked_for(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(jl({"text": "hi"}) + b"\n")
    [entry] = split(read(path))[1]
    for name in ("'messages'", "'conversations'", "'prompt'", "'instruction'", "'text'"):
        assert name in entry.message


def test_wrong_type_message_names_expected_and_actual(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\n" * 16 + jl({"messages": [user(5)]}) + b"\n")
    [entry] = split(read(path))[1]
    assert entry.message == "chat.jsonl:17: field 'messages[0].content': expected a string or a list of content parts, got int"


@pytest.mark.parametrize("encoding_ok", [True, False], ids=["utf8", "not-utf8"])
def test_line_too_long_keeps_an_excerpt_its_length_and_hash(tmp_path, encoding_ok):
    filler = "é".encode("utf-8") * (5 * 1024 * 1024 // 2) if encoding_ok else b"\xff" + b"x" * (5 * 1024 * 1024)
    big = b'{"prompt": "' + filler + b'"}'
    assert len(big) > 5 * 1024 * 1024
    path = tmp_path / "big.jsonl"
    path.write_bytes(GOOD + b"\n" + big + b"\r\n" + GOOD)
    rows, rejections = split(read(path, max_line_bytes=1024 * 1024))
    assert [r.source for r in rows] == ["big.jsonl:1", "big.jsonl:3"]
    [entry] = rejections
    assert entry.kind == "line_too_long" and entry.line == 2
    assert entry.message.startswith("big.jsonl:2: ") and "1048576" in entry.message
    assert (entry.raw is not None) == encoding_ok
    excerpt = raw_bytes(entry)
    assert big.startswith(excerpt) and EXCERPT_BYTES - 4 < len(excerpt) <= EXCERPT_BYTES
    assert (entry.line_bytes, entry.line_sha256) == (len(big), hashlib.sha256(big).hexdigest())


def test_line_at_the_limit_is_read(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(GOOD + b"\n")
    [row] = read(path, max_line_bytes=len(GOOD))
    assert isinstance(row, PromptRow)


def test_crlf_line_endings(tmp_path):
    path = tmp_path / "win.jsonl"
    path.write_bytes(GOOD + b"\r\n\r\n" + b"[1]\r\n" + jl({"prompt": "a\r\nb"}) + b"\r\n")
    rows, rejections = split(read(path))
    assert [r.source for r in rows] == ["win.jsonl:1", "win.jsonl:4"]
    assert rows[1].messages == [Message("user", "a\r\nb")]
    [entry] = rejections
    assert entry.kind == "not_object" and entry.line == 3 and raw_bytes(entry) == b"[1]"


def test_utf8_bom_is_tolerated(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD + b"\n" + GOOD + b"\n")
    rows, rejections = split(read(path))
    assert not rejections and [r.source for r in rows] == ["bom.jsonl:1", "bom.jsonl:2"]


def test_bom_before_a_bad_first_line_is_not_part_of_raw(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf[1]\n")
    [entry] = split(read(path))[1]
    assert entry.kind == "not_object" and entry.line == 1 and entry.raw == "[1]"


def test_final_line_without_newline_and_blank_lines_count(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\n  \n" + GOOD + b"\n\t\n" + jl({"prompt": "last"}))
    rows, rejections = split(read(path))
    assert not rejections
    assert [(r.source, r.messages[0].content) for r in rows] == [("chat.jsonl:3", "good"), ("chat.jsonl:5", "last")]


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n", b"\xef\xbb\xbf"], ids=["zero-bytes", "blank-lines", "bom-only"])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    [entry] = split(read(path))[1]
    assert entry.kind == "empty_file" and entry.line is None and entry.message.startswith("empty.jsonl: ")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_missing_file_and_directory(tmp_path, fmt):
    for path in (tmp_path / f"nope.{fmt}", tmp_path):
        [entry] = split(read(path, format=fmt))[1]
        assert entry.kind == "unreadable_file" and entry.line is None
        assert str(path) in entry.message


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path):
    path = tmp_path / "secret.jsonl"
    path.write_bytes(GOOD + b"\n")
    path.chmod(0)
    [entry] = split(read(path))[1]
    assert entry.kind == "unreadable_file" and "Permission denied" in entry.message


# --- accepted shapes -------------------------------------------------------------------------


SHAPES = [
    ("openai-up-to-first-assistant",
     {"messages": [{"role": "system", "content": "be brief"}, user("q1"), {"role": "assistant", "content": "a1"},
                   user("q2")]},
     {}, [Message("system", "be brief"), Message("user", "q1")]),
    ("openai-several-users-and-systems-in-order",
     {"messages": [user("q1"), {"role": "system", "content": "s"}, user("q2"), {"role": "assistant", "content": "a"},
                   {"role": "tool", "content": "after the assistant: not read"}]},
     {}, [Message("user", "q1"), Message("system", "s"), Message("user", "q2")]),
    ("openai-text-parts",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]},
     {}, [Message("user", "one\ntwo")]),
    ("openai-images-after-assistant-ignored",
     {"messages": [user("q"), {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]}]},
     {}, [Message("user", "q")]),
    ("content-kept-byte-for-byte",
     {"messages": [user("  leading and trailing \n\t"), {"role": "assistant", "content": "a"}]},
     {}, [Message("user", "  leading and trailing \n\t")]),
    ("sharegpt",
     {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi 👋"},
                        {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]},
     {}, [Message("system", "sys"), Message("user", "hi 👋")]),
    ("sharegpt-other-names",
     {"conversations": [{"from": "user", "value": "u1"}, {"from": "chatgpt", "value": "a"}]},
     {}, [Message("user", "u1")]),
    ("sharegpt-model",
     {"conversations": [{"from": "user", "value": "u1"}, {"from": "model", "value": "a"}]},
     {}, [Message("user", "u1")]),
    ("prompt", {"prompt": "write a poem"}, {}, [Message("user", "write a poem")]),
    ("prompt-with-system", {"prompt": "p", "system": "s"}, {}, [Message("system", "s"), Message("user", "p")]),
    ("prompt-with-empty-system", {"prompt": "p", "system": ""}, {}, [Message("user", "p")]),
    ("instruction-input", {"instruction": "translate", "input": "bonjour"}, {},
     [Message("user", "translate\n\nbonjour")]),
    ("instruction-empty-input", {"instruction": "translate", "input": "", "output": "x"}, {},
     [Message("user", "translate")]),
    ("instruction-null-input", {"instruction": "translate", "input": None}, {}, [Message("user", "translate")]),
    ("messages-before-prompt", {"prompt": "ignored", "messages": [user("m")]}, {}, [Message("user", "m")]),
    ("null-messages-falls-back", {"messages": None, "prompt": "p"}, {}, [Message("user", "p")]),
    ("map-messages", {"dialog": [user("d")], "prompt": "not this"}, {"messages": "dialog"}, [Message("user", "d")]),
    ("map-messages-sharegpt", {"turns": [{"from": "human", "value": "d"}]}, {"messages": "turns"},
     [Message("user", "d")]),
    ("map-prompt-system", {"question": "q", "persona": "p", "system": "no"}, {"prompt": "question", "system": "persona"},
     [Message("system", "p"), Message("user", "q")]),
    ("map-instruction-input", {"task": "t", "context": "c", "input": "no"}, {"instruction": "task", "input": "context"},
     [Message("user", "t\n\nc")]),
]


@pytest.mark.parametrize("row, fields, expected", [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_shapes(tmp_path, row, fields, expected):
    path = tmp_path / "shapes.jsonl"
    path.write_bytes(jl(row) + b"\n")
    [result] = read(path, fields=FieldMap(**fields))
    assert isinstance(result, PromptRow), result
    assert result.messages == expected and result.source == "shapes.jsonl:1"


@pytest.mark.parametrize(
    "row, fields, expected",
    [({"id": "a-1", "prompt": "p"}, {}, "a-1"), ({"id": 7, "prompt": "p"}, {}, "7"),
     ({"id": 1.5, "prompt": "p"}, {}, None), ({"prompt": "p"}, {}, None),
     ({"uid": "u", "id": "no", "prompt": "p"}, {"id": "uid"}, "u")],
)
def test_row_id(tmp_path, row, fields, expected):
    path = tmp_path / "ids.jsonl"
    path.write_bytes(jl(row) + b"\n")
    [result] = read(path, fields=FieldMap(**fields))
    assert result.row_id == expected


@pytest.mark.parametrize(
    "row, fields, kind, field",
    [({"prompt": "p"}, {"id": "uid"}, "missing_field", "uid"),
     ({"prompt": "p", "uid": None}, {"id": "uid"}, "wrong_type", "uid"),
     ({"text": "p"}, {"prompt": "question"}, "missing_field", "question"),
     ({"question": "p"}, {"prompt": "question", "system": "persona"}, "missing_field", "persona")],
)
def test_field_map_columns_are_required(tmp_path, row, fields, kind, field):
    path = tmp_path / "mapped.jsonl"
    path.write_bytes(jl(row) + b"\n")
    [entry] = split(read(path, fields=FieldMap(**fields)))[1]
    assert (entry.kind, entry.field) == (kind, field) and f"field '{field}'" in entry.message


# --- parquet ---------------------------------------------------------------------------------


def write_parquet(path, columns: dict, **kw):
    pq.write_table(pa.table(columns), path, **kw)
    return path


def test_parquet_nested_messages_across_batches(tmp_path):
    n = 2500
    msgs = [[{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"},
             {"role": "assistant", "content": "a"}] for i in range(n)]
    msgs[1500] = [{"role": "tool", "content": "t"}, {"role": "user", "content": "q"}]
    path = write_parquet(tmp_path / "data.parquet", {"messages": msgs, "id": list(range(n))}, row_group_size=700)
    rows, rejections = split(read(path))
    assert len(rows) == n - 1
    assert rows[0].source == "data.parquet:row0" and rows[0].row_id == "0"
    assert rows[0].messages == [Message("system", "s"), Message("user", "q0")]
    assert rows[-1].source == f"data.parquet:row{n - 1}" and rows[-1].messages[1].content == f"q{n - 1}"
    [entry] = rejections
    assert entry.kind == "unsupported_role" and entry.line == 1500 and entry.field == "messages[0].role"
    assert entry.message.startswith("data.parquet:row1500: field 'messages[0].role': ")
    assert json.loads(entry.raw) == {"messages": msgs[1500], "id": 1500}
    assert count_rows(dataset(path)) == n


def test_parquet_flat_columns_and_nulls(tmp_path):
    path = write_parquet(tmp_path / "alpaca.pq", {
        "instruction": ["do a", "do b", None, "  "],
        "input": [None, "ctx", None, ""],
        "output": ["x", "y", "z", "w"],
    })
    rows, rejections = split(read(path))
    assert [r.messages for r in rows] == [[Message("user", "do a")], [Message("user", "do b\n\nctx")]]
    assert [(e.kind, e.line) for e in rejections] == [("missing_field", 2), ("empty_prompt", 3)]


def test_parquet_field_map(tmp_path):
    path = write_parquet(tmp_path / "qa.parquet", {"question": ["q"], "persona": ["p"], "uid": ["u1"]})
    [row] = read(path, fields=FieldMap(prompt="question", system="persona", id="uid"))
    assert row.messages == [Message("system", "p"), Message("user", "q")] and row.row_id == "u1"


@pytest.mark.parametrize("fields", [{}, {"prompt": "question"}], ids=["auto", "field-map"])
def test_parquet_without_usable_columns(tmp_path, fields):
    path = write_parquet(tmp_path / "wrong.parquet", {"text": ["a"], "label": [1]})
    [entry] = split(read(path, fields=FieldMap(**fields)))[1]
    assert entry.kind == "parquet_columns" and entry.line is None
    assert entry.message.startswith("wrong.parquet: ") and "'text', 'label'" in entry.message


def test_truncated_parquet(tmp_path):
    path = write_parquet(tmp_path / "cut.parquet", {"prompt": [f"p{i}" for i in range(1000)]})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    [entry] = split(read(path))[1]
    assert entry.kind == "bad_parquet" and entry.line is None and entry.message.startswith("cut.parquet: ")
    assert count_rows(dataset(path)) is None


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_bytes(GOOD + b"\n")
    assert [e.kind for e in split(read(path))[1]] == ["bad_parquet"]


def test_corrupt_parquet_page_ends_with_bad_parquet(tmp_path):
    path = write_parquet(tmp_path / "rot.parquet", {"prompt": [f"prompt number {i} " * 20 for i in range(5000)]},
                         compression="none", row_group_size=500)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle - 2000: middle + 2000] = b"\xff" * 4000
    path.write_bytes(bytes(data))
    items = read(path)
    rows, rejections = split(items)
    assert items[-1] == Rejection(rejections[0]) and len(rejections) == 1
    assert rejections[0].kind == "bad_parquet" and f"rows from {len(rows)} on" in rejections[0].message
    assert 0 < len(rows) < 5000 and [r.source for r in rows] == [f"rot.parquet:row{i}" for i in range(len(rows))]


@pytest.mark.parametrize("empty", ["zero-bytes", "zero-rows"])
def test_empty_parquet(tmp_path, empty):
    path = tmp_path / "none.parquet"
    if empty == "zero-bytes":
        path.write_bytes(b"")
    else:
        write_parquet(path, {"prompt": pa.array([], pa.string())})
    [entry] = split(read(path))[1]
    assert entry.kind == "empty_file" and entry.line is None


# --- count_rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("content, n", [(b"", 0), (b"a\n", 1), (b"a\nb", 2), (b"a\n\nb\n", 3)])
def test_count_rows_jsonl(tmp_path, content, n):
    path = tmp_path / "c.jsonl"
    path.write_bytes(content)
    assert count_rows(dataset(path)) == n


def test_count_rows_unreadable(tmp_path):
    assert count_rows(dataset(tmp_path / "missing.jsonl")) is None
    assert count_rows(dataset(tmp_path)) is None
