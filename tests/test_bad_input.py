"""The bad-input corpus through ``draftfleet enqueue``: message, quarantine line, summary count.

test_readers.py holds the corpus at the reader (one case per kind of bad line or file); this
runs all of it end to end in one enqueue of ten datasets, as an operator would meet it: every
bad line and file is reported with its file and line, kept verbatim in the dataset's quarantine
file (a line over the limit: its first bytes, length and sha256) and counted by kind in the
summary, and every good line around them is queued.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter

import pyarrow as pa
import pytest

from draftfleet import redis_keys as rk
from draftfleet.producer.readers import EXCERPT_BYTES
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store

from .conftest import run_cli, write_config
from .test_readers import BAD_LINES, write_parquet

pytestmark = pytest.mark.slow


def _good(i: int) -> bytes:
    return json.dumps({"prompt": f"good prompt {i}"}).encode()


def test_bad_input_corpus_through_enqueue(tmp_path, redis_server, tokenizer_dir):
    data = tmp_path / "data"
    data.mkdir()
    # one JSONL file: a good line, then every bad line of the corpus, each followed by a good one
    lines = [_good(0)]
    expect_lines = []
    for i, (case, bad, kind, _field, as_b64) in enumerate(BAD_LINES, start=1):
        expect_lines.append((len(lines) + 1, kind, bad, as_b64, case))
        lines += [bad, _good(i)]
    too_long = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    expect_lines.append((len(lines) + 1, "line_too_long", too_long, False, "line-too-long"))
    lines += [too_long, _good(len(BAD_LINES) + 1)]
    (data / "lines.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    n_good = len(BAD_LINES) + 2

    (data / "folder.jsonl").mkdir()
    (data / "empty.jsonl").write_bytes(b"")
    (data / "blank.jsonl").write_bytes(b"\n  \n\r\n")
    write_parquet(data / "wrongcols.parquet", {"text": ["a", "b"], "label": [1, 2]})
    cut = write_parquet(data / "cut.parquet", {"prompt": [f"p{i}" for i in range(1000)]})
    cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 2])
    (data / "fake.parquet").write_bytes(_good(0) + b"\n")
    write_parquet(data / "rows.parquet", {"messages": [
        [{"role": "user", "content": "fine"}], [{"role": "tool", "content": "t"}, {"role": "user", "content": "q"}],
        [{"role": "user", "content": "fine too"}]]})
    write_parquet(data / "zero.parquet", {"prompt": pa.array([], pa.string())})

    files = {"lines": "lines.jsonl", "folder": "folder.jsonl", "empty": "empty.jsonl",
             "blank": "blank.jsonl", "wrongcols": "wrongcols.parquet", "cut": "cut.parquet", "fake": "fake.parquet",
             "rows": "rows.parquet", "zero": "zero.parquet"}
    config = write_config(tmp_path, tokenizer=tokenizer_dir,
                          datasets=[{"name": n, "path": str(data / f), "max_tokens": 16} for n, f in files.items()])
    res = run_cli("enqueue", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 1, res.stderr  # seven datasets gave no usable row: each an error with its cause
    summary = {s["dataset"]: s for s in json.loads(res.stdout)}
    unusable = {"folder", "empty", "blank", "wrongcols", "cut", "fake", "zero"}
    assert {n for n, s in summary.items() if s["error"]} == unusable
    for name in unusable:
        assert f"error: dataset '{name}': no usable row in {data / files[name]}" in res.stderr
    store = open_store(load_config(config))
    r = redis_server.client()

    # the JSONL file: each bad line rejected by kind, every good line queued
    want_kinds = Counter(kind for _, kind, *_ in expect_lines)
    s = summary["lines"]
    assert (s["read"], s["queued"], s["rejected"]) == (n_good, n_good, len(expect_lines))
    assert s["rejected_by_kind"] == dict(want_kinds)
    assert r.llen(rk.queue("lines")) == n_good
    quarantined = [json.loads(x) for x in store.quarantine_path("lines").read_text().splitlines()]
    assert s["quarantine_file"] == str(store.quarantine_path("lines"))
    assert len(quarantined) == len(expect_lines)
    for q, (line, kind, bad, as_b64, case) in zip(quarantined, expect_lines):
        assert (q["line"], q["kind"], q["file"]) == (line, kind, str(data / "lines.jsonl")), case
        assert q["message"].startswith(f"lines.jsonl:{line}: "), case
        raw = base64.b64decode(q["raw_b64"]) if as_b64 else q["raw"].encode()
        if kind == "line_too_long":  # never held whole: an excerpt, the length and the hash
            assert bad.startswith(raw) and len(raw) <= EXCERPT_BYTES, case
            assert (q["line_bytes"], q["line_sha256"]) == (len(bad), hashlib.sha256(bad).hexdigest()), case
        else:
            assert raw == bad, case

    # whole files: one rejection each, no line, the file named; nothing queued
    for name, kind in [("folder", "unreadable_file"), ("empty", "empty_file"),
                       ("blank", "empty_file"), ("wrongcols", "parquet_columns"), ("cut", "bad_parquet"),
                       ("fake", "bad_parquet"), ("zero", "empty_file")]:
        s = summary[name]
        assert (s["queued"], s["rejected"], s["rejected_by_kind"]) == (0, 1, {kind: 1}), name
        [q] = [json.loads(x) for x in store.quarantine_path(name).read_text().splitlines()]
        assert q["kind"] == kind and q["line"] is None and files[name] in q["message"], name
    # a Parquet file with one bad row: the row is named, the others are queued
    s = summary["rows"]
    assert (s["queued"], s["rejected_by_kind"]) == (2, {"unsupported_role": 1})
    [q] = [json.loads(x) for x in store.quarantine_path("rows").read_text().splitlines()]
    assert q["line"] == 1 and q["message"].startswith("rows.parquet:row1: field 'messages[0].role'")

    kinds = {k for s in summary.values() for k in s["rejected_by_kind"]}
    assert len(kinds) == 13 and sum(s["rejected"] for s in summary.values()) == len(expect_lines) + 8

    # as an operator sees it: each rejection on stderr with file and line; a re-run queues nothing
    # more and keeps each rejection once in the quarantine files (a re-run adds no copies)
    res = run_cli("enqueue", "--config", str(config), "--show-rejects", "1000", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 1, res.stderr
    shown = [x for x in res.stderr.splitlines() if x.startswith("rejected ")]
    assert sum(f" lines.jsonl:{line}: " in f" {x[9:]}" for x in shown for line, *_ in expect_lines) == len(expect_lines)
    assert any("folder.jsonl" in x for x in shown) and any("cut.parquet: " in x for x in shown)
    assert f"lines: {len(expect_lines)} rejected" in res.stdout
    assert len(store.quarantine_path("lines").read_text().splitlines()) == len(expect_lines)
    assert r.llen(rk.queue("lines")) == n_good
