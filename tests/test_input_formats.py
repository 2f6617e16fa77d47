"""Datasets as people store them: ShareGPT's JSON array, gzip and zstd files, and a dataset that
gives no usable row, which is an error naming its likely cause (not a quiet 0 rows read)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import tracemalloc

import pytest
import zstandard

from draftfleet.identity import prompt_key
from draftfleet.producer.importer import IMPORT_LINE_BYTES
from draftfleet.producer.readers import PromptRow, Rejection, read_prompts
from draftfleet.schemas.config import MAX_LINE_BYTES, DatasetConfig
from draftfleet.schemas.records import GenerationSettings

from .conftest import REPO, run_cli, write_config

SETTINGS = GenerationSettings(model="m", max_tokens=16, temperature=0.7, top_p=1.0, system_prompt=None, turns="first")


def sharegpt_rows(n: int) -> list[dict]:
    """ShareGPT as it ships (the Vicuna / ShareGPT_V3 dumps): an id and a list of from/value turns."""
    return [{"id": f"QWJhYvA_{i}", "conversations": [
        {"from": "human", "value": f"Write a haiku about número {i} ✓\nwith a second line"},
        {"from": "gpt", "value": "An answer the dataset had."},
        {"from": "human", "value": "And another?"},
        {"from": "gpt", "value": "Another."}]} for i in range(n)]


def read(path, **kw) -> list[PromptRow | Rejection]:
    return list(read_prompts(DatasetConfig(name="t", path=str(path), **kw)))


def keys(items) -> list[str]:
    assert all(isinstance(i, PromptRow) for i in items), [i.entry.message for i in items if isinstance(i, Rejection)]
    return [prompt_key("t", i.messages, SETTINGS) for i in items]


def test_a_sharegpt_json_array_reads_as_its_jsonl_twin(tmp_path):
    rows = sharegpt_rows(50)
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps(rows, indent=2, ensure_ascii=False))  # pretty-printed, as the dumps are
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    got = read(array)
    assert keys(got) == keys(read(lines))
    assert [i.source for i in got[:2]] == ["sharegpt.json:item0", "sharegpt.json:item1"]
    assert got[3].row_id == "QWJhYvA_3" and got[3].messages[0].content.startswith("Write a haiku about número 3 ✓")
    all_turns = read(array, turns="all")
    assert [m.role for m in all_turns[0].messages] == ["user", "assistant", "user"]


def test_a_bad_item_is_quarantined_and_its_neighbours_read(tmp_path):
    path = tmp_path / "mixed.json"
    good = sharegpt_rows(1)[0]
    path.write_text(json.dumps([good, 7, {"conversations": [{"from": "bing", "value": "x"}]}, good]))
    items = read(path)
    assert [i.source for i in items if isinstance(i, PromptRow)] == ["mixed.json:item0", "mixed.json:item3"]
    bad = [i.entry for i in items if isinstance(i, Rejection)]
    assert [(e.kind, e.line) for e in bad] == [("not_object", 1), ("unsupported_role", 2)]
    assert bad[1].message.startswith("mixed.json:item2: field 'conversations[0].from'")
    assert json.loads(bad[1].raw) == {"conversations": [{"from": "bing", "value": "x"}]}


def test_a_cut_array_keeps_what_came_before_and_says_where(tmp_path):
    path = tmp_path / "cut.json"
    text = json.dumps(sharegpt_rows(5))
    path.write_text(text[: len(text) - 40])
    items = read(path)
    assert len([i for i in items if isinstance(i, PromptRow)]) == 4
    [entry] = [i.entry for i in items if isinstance(i, Rejection)]
    assert entry.kind == "bad_json" and entry.message.startswith("cut.json:item4: invalid JSON in item 4")


def test_an_array_item_over_the_limit_is_never_held_whole(tmp_path):
    """A 24 MiB item under a 1 MiB limit: dropped as it streams past; peak memory near the limit."""
    path = tmp_path / "big.json"
    turns = [{"from": "human", "value": "y" * 1000}] * (24 * 1024)
    with open(path, "w") as fh:
        fh.write("[" + json.dumps(sharegpt_rows(1)[0]) + ", ")
        fh.write(json.dumps({"conversations": turns}) + ", " + json.dumps(sharegpt_rows(2)[1]) + "]")
    tracemalloc.start()
    try:
        items = read(path, max_line_bytes=1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [i.source for i in items if isinstance(i, PromptRow)] == ["big.json:item0", "big.json:item2"]
    [entry] = [i.entry for i in items if isinstance(i, Rejection)]
    assert entry.kind == "line_too_long" and "1048576" in entry.message and "max_line_bytes" in entry.message
    assert entry.line_bytes > 24 * 1024 * 1000
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB while reading a 24 MiB item"


def compress(kind: str, data: bytes, tmp_path) -> bytes:
    """``gzip -c`` / ``zstd -c`` when the tools are there (the files people have), else the libraries."""
    tool = shutil.which(kind)
    if tool:
        src = tmp_path / f"src.{kind}.in"
        src.write_bytes(data)
        return subprocess.run([tool, "-c", str(src)], check=True, capture_output=True).stdout
    return gzip.compress(data) if kind == "gzip" else zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("kind, suffix", [("gzip", ".gz"), ("zstd", ".zst")])
@pytest.mark.parametrize("shape", ["jsonl", "json"])
def test_compressed_files_read_as_the_plain_ones(tmp_path, kind, suffix, shape):
    rows = sharegpt_rows(300)
    data = (json.dumps(rows) if shape == "json" else "".join(json.dumps(r) + "\n" for r in rows)).encode()
    plain = tmp_path / f"d.{shape}"
    plain.write_bytes(data)
    packed = tmp_path / f"d.{shape}{suffix}"
    packed.write_bytes(compress(kind, data, tmp_path))
    assert keys(read(packed)) == keys(read(plain))
    # named without the suffix: found by its magic bytes, not its name
    renamed = tmp_path / f"e.{shape}"
    renamed.write_bytes(packed.read_bytes())
    assert keys(read(renamed)) == keys(read(plain))


def test_concatenated_gzip_members_and_zstd_frames_are_one_stream(tmp_path):
    one, two = (json.dumps(r) + "\n" for r in sharegpt_rows(2))
    gz = tmp_path / "cat.jsonl.gz"
    gz.write_bytes(gzip.compress(one.encode()) + gzip.compress(two.encode()))
    zst = tmp_path / "cat.jsonl.zst"
    c = zstandard.ZstdCompressor()
    zst.write_bytes(c.compress(one.encode()) + c.compress(two.encode()))
    for path in (gz, zst):
        assert len(keys(read(path))) == 2, path.name


@pytest.mark.parametrize("kind, suffix", [("gzip", ".gz"), ("zstd", ".zst")])
def test_a_truncated_or_corrupt_compressed_file_is_an_error_not_an_early_end(tmp_path, kind, suffix):
    data = "".join(json.dumps({"prompt": f"prompt {i} " + "z" * (i % 97)}) + "\n" for i in range(20_000)).encode()
    packed = compress(kind, data, tmp_path)
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(packed[: len(packed) // 2])
    items = read(cut)
    rows = [i for i in items if isinstance(i, PromptRow)]
    assert 0 < len(rows) < 20_000
    last = items[-1].entry
    assert last.kind == "unreadable_file" and f"the {kind} stream ends early: the file is truncated" in last.message
    corrupt = tmp_path / f"bad.jsonl{suffix}"
    corrupt.write_bytes(packed[:30] + bytes(b ^ 0x5A for b in packed[30:2000]) + packed[2000:])
    last = read(corrupt)[-1].entry
    assert last.kind == "unreadable_file" and re.search(f"corrupt {kind} data|ends early", last.message)


def test_other_compressions_are_named(tmp_path):
    path = tmp_path / "d.jsonl.xz"
    path.write_bytes(b"\xfd7zXZ\x00\x00\x04")
    [item] = read(path)
    assert item.entry.kind == "unreadable_file" and "the file is xz-compressed" in item.entry.message


def test_enqueue_reads_sharegpt_json_and_fails_on_a_dataset_without_a_usable_row(tmp_path, redis_server,
                                                                                  tokenizer_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sharegpt.json").write_text(json.dumps(sharegpt_rows(12), indent=2))
    (data / "pairs.jsonl.gz").write_bytes(gzip.compress(b"".join(
        json.dumps({"text": f"t{i}", "label": i}).encode() + b"\n" for i in range(5))))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[
        {"name": "sg", "path": str(data / "sharegpt.json"), "max_tokens": 16}])
    res = run_cli("enqueue", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    [s] = json.loads(res.stdout)
    assert (s["read"], s["queued"], s["rejected"], s["error"]) == (12, 12, 0, None)

    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[
        {"name": "sg", "path": str(data / "sharegpt.json"), "max_tokens": 16},
        {"name": "pairs", "path": str(data / "pairs.jsonl.gz"), "max_tokens": 16}])
    res = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url, "COLUMNS": "100"})
    assert res.returncode == 1, res.stdout
    [line] = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: dataset 'pairs': no usable row in {data / 'pairs.jsonl.gz'} (missing_field: 5)")
    assert "likely cause: no row has a prompt column the reader knows: name yours in [datasets.fields]" in line
    assert "the row has 'text', 'label'" in line
    assert "sg " in res.stdout  # the other dataset's summary is still shown


def test_the_line_limits_are_the_same_everywhere():
    """README and the readers give the same limits: a dataset's 4 MiB (max_line_bytes), import's 64 MiB."""
    assert (MAX_LINE_BYTES, IMPORT_LINE_BYTES) == (4 * 2**20, 64 * 2**20)
    assert DatasetConfig(name="t", path="x").max_line_bytes == MAX_LINE_BYTES
    readme = (REPO / "README.md").read_text()
    assert re.search(r"`max_line_bytes`[^.]*4 MiB|4 MiB[^.]*`max_line_bytes`", readme)
    assert re.search(r"`import`[^.]*64 MiB|64 MiB[^.]*`import`", readme.replace("\n", " "))



@pytest.mark.parametrize("width", [80, 100])
def test_the_enqueue_summary_fits_without_cutting_a_header(width):
    from rich.console import Console

    from draftfleet.cli.enqueue import summary_table
    from draftfleet.producer.enqueue import EnqueueSummary

    summaries = [EnqueueSummary(dataset="B3_magicoder", version=12, read=999_999, queued=512_000, already_done=487_999,
                                already_queued=100_000, in_flight=128, failed_before=12, duplicate_in_input=3,
                                rejected=123_456),
                 EnqueueSummary(dataset="chat", version=1, read=40, queued=40)]
    console = Console(width=width, force_terminal=False)
    with console.capture() as cap:
        console.print(summary_table(summaries))
    text = cap.get()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    flat = " ".join(text.split())
    for word in ("dataset", "(version)", "read", "queued", "now", "stored", "before", "in", "flight", "failed",
                 "dupli-", "cates", "re-", "jected", "999999", "512000", "487999", "123456", "B3_magicoder", "v12"):
        assert word in flat, word


@pytest.mark.parametrize("width", [80, 100])
def test_the_inventory_table_fits_without_cutting_a_header(tmp_path, width):
    import time

    from rich.console import Console

    from draftfleet.cli import inventory as cli_inventory
    from draftfleet.schemas.records import Message, ResponseRecord, Usage
    from draftfleet.store import open_store
    from draftfleet.views.inventory import run_inventory

    store = open_store(tmp_path)
    for i, (backend, source) in enumerate([("openrouter", "retokenized"), ("sglang", "exact")] * 3):
        store.put(ResponseRecord(
            key=f"{i:064x}", dataset="B3_magicoder", source=f"f.jsonl:{i}", settings_id="s",
            messages=[Message(role="user", content=f"prompt {i}")], system_prompt_used=False, text="t",
            output_ids=[5] * 900_000, prompt_tokens=7, completion_tokens=900_000, finish_reason="stop",
            truncated=False, backend=backend, backend_kind="gpu" if source == "exact" else "cloud", model="m",
            token_source=source, usage=Usage(completion_tokens=899_000), cost_usd=0.0031 if source != "exact" else 0.0,
            cost_source="provider", latency_s=0.1, attempts=1, worker="w", created_at=time.time()))
    console = Console(width=width, force_terminal=False)
    cli_inventory.out, saved = console, cli_inventory.out
    try:
        with console.capture() as cap:
            cli_inventory.print_inventory(run_inventory(tmp_path))
    finally:
        cli_inventory.out = saved
    table = cap.get().split("completion tokens: the target")[0]
    assert "…" not in table
    assert max(len(line) for line in table.splitlines()) <= width
    flat = " ".join(table.split())
    for word in ("backend", "kind", "token", "source", "responses", "completion", "tokens", "provider's", "count",
                 "differ-", "ence", "cost", "(USD)", "2,700,000", "+3,000", "0.0093"):
        assert word in flat, word
