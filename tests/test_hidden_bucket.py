"""Hidden states in a bucket against a real SeaweedFS: a file uploaded once from its descriptor (one
PUT or parts, both under ``If-None-Match: *``), read back as the folder store reads its files."""

from __future__ import annotations

import os
import threading

import msgspec
import numpy as np

from draftfleet.hidden import CONVERSATION, HiddenStore, encode_safetensors, f32_to_bf16, open_hidden, read_safetensors
from draftfleet.hidden_bucket import BucketHidden
from draftfleet.s3 import Bucket
from draftfleet.schemas.records import CaptureManifest
from draftfleet.store import open_store

MIB = 1 << 20


def _store(s3_env):
    store = open_store(f"s3://{s3_env.bucket()}/run1")
    store.prepare()
    return store


def _unit(t: int, hidden: int = 64, layers: int = 4, spans: str | None = None) -> bytes:
    states = f32_to_bf16(np.random.default_rng(t).standard_normal((t, layers, hidden)).astype(np.float32))
    meta = {"prompt_len": "1", **({"spans": spans} if spans else {})}
    return encode_safetensors({"token_ids": ("I64", np.arange(t, dtype=np.int64)), "hidden_states": ("BF16", states)},
                              meta, seal=True)


def _fd(tmp_path, name: str, data: bytes) -> int:
    path = tmp_path / name
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def _manifest(version: int = 1) -> CaptureManifest:
    return CaptureManifest(dataset="ds", version=version, model="m", model_config_sha256="0" * 64, num_layers=8,
                           hidden_size=64, layer_ids=[2, 4, 5, 8], dtype="bfloat16", created_at=1.0)


def test_a_file_goes_up_once_in_one_put_or_in_parts_and_a_second_writer_stores_nothing(s3_env, tmp_path):
    store = _store(s3_env)
    hidden = open_hidden(store)
    assert isinstance(hidden, BucketHidden) and not hidden.local
    small, large = _unit(3), _unit(12 * MIB // (4 * 64 * 2) + 5)  # ~12 MiB: three 5 MiB parts
    a, b = "aa" * 32, "bb" * 32
    sent0 = hidden.bucket.sent_bytes
    for key, data in ((a, small), (b, large)):
        fd = _fd(tmp_path, key, data)
        try:
            assert hidden.upload("ds", 1, key, 0, fd, part_size=5 * MIB)
            other = _fd(tmp_path, key + "-twin", data[:-1] + b"\x00")  # another worker's file of the unit
            assert not hidden.upload("ds", 1, key, 0, other, part_size=5 * MIB)  # 412: a lost link
            os.close(other)
        finally:
            os.close(fd)
    for key, data in ((a, small), (b, large)):
        assert hidden.bucket.get(hidden.object_key("ds", 1, key, 0))[0] == data  # the first writer's bytes
    stored = sum(size for _k, size, _t in hidden.bucket.list_sized(store._key("_hidden", "")))
    assert stored == len(small) + len(large)
    # bytes uploaded / bytes stored, the losers' uploads included: each file crossed twice, never more
    assert (hidden.bucket.sent_bytes - sent0) / stored == 2.0
    uploads = hidden.bucket.client().list_multipart_uploads(Bucket=hidden.bucket.bucket).get("Uploads", [])
    assert uploads == []  # the loser's parts were aborted, not left billed


def test_uploaded_bytes_equal_stored_bytes(s3_env, tmp_path):
    """The capture measure: each file uploaded once, so bytes sent / bytes stored is exactly 1."""
    hidden = open_hidden(_store(s3_env))
    bucket: Bucket = hidden.bucket
    sent0 = bucket.sent_bytes
    sizes = [3, 40, 12 * MIB // (4 * 64 * 2)]
    for i, t in enumerate(sizes):
        fd = _fd(tmp_path, str(i), _unit(t))
        try:
            assert hidden.upload("ds", 1, f"{i:02x}" * 32, 0, fd, part_size=5 * MIB)
        finally:
            os.close(fd)
    stored = sum(e.bytes for e in hidden.entries("ds", 1))
    assert stored > 12 * MIB and (bucket.sent_bytes - sent0) / stored == 1.0


def test_sixteen_workers_uploading_one_unit_store_it_once(s3_env, tmp_path):
    hidden = open_hidden(_store(s3_env))
    data, key = _unit(5), "cc" * 32
    fds = [_fd(tmp_path, f"w{i}", data) for i in range(16)]
    barrier, won = threading.Barrier(16), []

    def up(fd):
        barrier.wait()
        won.append(hidden.upload("ds", 1, key, 0, fd))

    threads = [threading.Thread(target=up, args=(fd,)) for fd in fds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds:
        os.close(fd)
    assert sorted(won) == [False] * 15 + [True]


def test_the_bucket_reads_like_the_folder(s3_env, tmp_path):
    """versions, manifest, files, entries, turn_usage and verify: the same answers as a folder store's."""
    store, folder = _store(s3_env), open_store(tmp_path / "store")
    folder.prepare()
    units = {("aa" * 32, 0): _unit(3), ("ab" * 32, 1): _unit(7), ("bb" * 32, CONVERSATION): _unit(9, spans="[[1,4],[6,9]]")}
    stores = [open_hidden(store), HiddenStore(folder)]
    for h in stores:
        assert h.versions("ds") == [] and h.manifest("ds") is None
        h.write_manifest(_manifest())
        h.write_manifest(msgspec.structs.replace(_manifest(), model="other"))  # the first one stays
        for (key, turn), data in units.items():
            assert h.put("ds", 1, key, turn, data) and not h.put("ds", 1, key, turn, b"again")
            assert h.has("ds", 1, key, turn) and not h.has("ds", 2, key, turn)
    bucket, files = stores
    assert bucket.versions("ds") == files.versions("ds") == [1]
    assert bucket.manifest("ds") == files.manifest("ds") and bucket.manifest("ds").model == "m"
    assert sorted(f[:2] for f in bucket.files("ds", 1)) == sorted(f[:2] for f in files.files("ds", 1))
    assert all(f[2].startswith(f"s3://{store.bucket_name}/run1/_hidden/ds/v1/") for f in bucket.files("ds", 1))
    strip = sorted((e.key, e.turn, e.turns, e.tokens, e.bytes) for e in bucket.entries("ds", 1))
    assert strip == sorted((e.key, e.turn, e.turns, e.tokens, e.bytes) for e in files.entries("ds", 1))
    assert bucket.turn_usage("ds", 1) == files.turn_usage("ds", 1) == (3, 4, 19, sum(map(len, units.values())))
    assert bucket.verify("ds", 1) == (3, 0, [])
    # a file changed after it was stored: the bucket's verify says which, as the folder's does
    key = bucket.object_key("ds", 1, "aa" * 32, 0)
    data = bytearray(units[("aa" * 32, 0)])
    data[-1] ^= 1
    bucket.bucket.put(key, bytes(data))
    good, unsealed, bad = bucket.verify("ds", 1)
    assert (good, unsealed) == (2, 0) and len(bad) == 1 and f"s3://{store.bucket_name}/{key}: its tensors changed" in bad[0]


def test_a_version_is_downloaded_once_and_resumes(s3_env, tmp_path):
    hidden = open_hidden(_store(s3_env))
    hidden.write_manifest(_manifest())
    units = {f"{i:02x}" * 32: _unit(3 + i) for i in range(4)}
    for key, data in units.items():
        hidden.put("ds", 1, key, 0, data)
    cache, seen = tmp_path / "cache", []
    local = hidden.download("ds", 1, cache, lambda n, total: seen.append((n, total)))
    assert isinstance(local, HiddenStore) and local.manifest("ds") == hidden.manifest("ds")
    for key, data in units.items():
        assert local.path("ds", 1, key, 0).read_bytes() == data
    assert seen[-1] == (sum(map(len, units.values())),) * 2
    # one copy damaged, one cut short, one left as a .part: only those two are fetched again
    first, second = (local.path("ds", 1, k, 0) for k in list(units)[:2])
    first.write_bytes(first.read_bytes()[:-1] + b"\x00")
    second.rename(second.with_name(second.name + ".part"))
    seen.clear()
    hidden.download("ds", 1, cache, lambda n, total: seen.append((n, total)))
    assert seen[-1][1] == len(units[list(units)[0]]) + len(units[list(units)[1]])
    assert first.read_bytes() == units[list(units)[0]] and second.read_bytes() == units[list(units)[1]]
    assert not list(cache.rglob("*.part"))
    seen.clear()
    hidden.download("ds", 1, cache, lambda n, total: seen.append((n, total)))
    assert seen == [(0, 0)]  # nothing fetched again
    _tensors, meta = read_safetensors(first)
    assert meta["prompt_len"] == "1"
