"""Readers: one ShareGPT dataset as JSON Lines, as a JSON array (ijson's event parser, item by item),
and as the same array gzip- and zstd-compressed, through ``read_prompts`` (what ``enqueue`` reads).

The reference is the JSONL reader on the same rows (msgspec per line): how much the array's
bounded, streamed parse and the decompression cost beside it.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import zstandard

from draftfleet.producer.readers import PromptRow, read_prompts
from draftfleet.schemas.config import DatasetConfig

from .env import Figure, Section, ratio


def rows(n: int) -> list[dict]:
    """ShareGPT as it ships: an id and from/value turns (two user turns, two answers)."""
    return [{"id": f"sg_{i}", "conversations": [
        {"from": "human", "value": f"question {i}: " + "explain this code " * 12},
        {"from": "gpt", "value": "an answer the dataset had " * 30},
        {"from": "human", "value": "and the follow-up?"},
        {"from": "gpt", "value": "another answer " * 20}]} for i in range(n)]


def _read(path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    n = sum(isinstance(item, PromptRow) for item in read_prompts(DatasetConfig(name="r", path=str(path))))
    return time.perf_counter() - start, n


def run(work: Path, *, n: int, repeats: int = 3) -> Section:
    data = rows(n)
    array = json.dumps(data, indent=2).encode()
    files = {"JSON Lines": work / "sg.jsonl", "JSON array": work / "sg.json",
             "JSON array, gzip": work / "sg.json.gz", "JSON array, zstd": work / "sg.json.zst"}
    files["JSON Lines"].write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in data))
    files["JSON array"].write_bytes(array)
    files["JSON array, gzip"].write_bytes(gzip.compress(array, 6))
    files["JSON array, zstd"].write_bytes(zstandard.ZstdCompressor(level=3).compress(array))
    best: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, so that load from elsewhere hits every file alike
        for name, path in files.items():
            seconds, got = _read(path)
            assert got == n, f"{name}: {got} rows of {n}"
            best[name] = min(best.get(name, seconds), seconds)
    rate = {name: n / s for name, s in best.items()}
    base = rate["JSON Lines"]
    figures = [Figure(bench="readers", name=f"{name}, {n:,} ShareGPT rows", value=rate[name], unit="rows/s",
                      reference="the JSONL reader, same rows", reference_value=base, ratio=ratio(rate[name], base),
                      headline=name == "JSON array")
               for name in files if name != "JSON Lines"]
    details = ["| file | bytes | best s | rows/s |", "| --- | ---: | ---: | ---: |"]
    details += [f"| {name} | {files[name].stat().st_size:,} | {best[name]:.2f} | {rate[name]:,.0f} |" for name in files]
    details += ["", f"{n:,} rows, each two user turns and two answers; read with `turns = \"first\"` (one prompt "
                "a row). The array is pretty-printed (indent 2) as the public dumps are; best of "
                f"{repeats} interleaved runs."]
    return Section(bench="readers", title="Dataset readers: JSONL, JSON array, gzip, zstd", command="",
                   figures=figures, details=details)
