"""Hidden states in a bucket against a real SeaweedFS: a file uploaded once from its descriptor (one
PUT or parts, both under ``If-None-Match: *``), read back as the folder store reads its files."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import numpy as np
import pytest

from draftfleet.hidden import CONVERSATION, HiddenStore, encode_safetensors, f32_to_bf16, open_hidden, read_safetensors
from draftfleet.hidden.bucket import BucketHidden
from draftfleet.store.s3 import Bucket
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
    stored = sum(size for _k, size, _t in hidden.bucket.list_sized(store.object_name("_hidden", "")))
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
    assert (good, unsealed) == (2, 0) and len(bad) == 1
    assert f"s3://{store.bucket_name}/{key}: changed after it was stored" in bad[0]


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
    assert not first.stat().st_mode & 0o222  # read-only, as the store's files
    first.chmod(0o644)
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


def _rewrite_header(data: bytes) -> bytes:
    assert b'"prompt_len":"1"' in data
    return data.replace(b'"prompt_len":"1"', b'"prompt_len":"2"', 1)  # same length, data unchanged


def _write_into_data(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


@pytest.mark.parametrize("change", [_write_into_data, _rewrite_header])
@pytest.mark.parametrize("t", [3, 12 * MIB // (4 * 64 * 2)])  # one PUT; parts
def test_a_file_changed_after_its_check_is_not_stored(s3_env, tmp_path, t, change):
    """The worker passes the digest of the data it checked and the header it wrote: a file whose
    data no longer hashes to the digest, or whose header is not the one written (an engine writing
    into the file after the check), is refused before the object can appear. The data case goes
    through the header as the file has it (``head`` not given)."""
    import hashlib

    from draftfleet.hidden import checked_header as _header

    hidden = open_hidden(_store(s3_env))
    data = _unit(t)
    path = tmp_path / "unit.safetensors"
    path.write_bytes(data)
    _h, offset = _header(path)
    checked = hashlib.sha256(data[offset:]).hexdigest()
    head = data[:offset] if change is _rewrite_header else None
    fd = _fd(tmp_path, "changed", change(data))
    try:
        with pytest.raises(OSError, match="changed after it was checked"):
            hidden.upload("ds", 1, "dd" * 32, 0, fd, digest=checked, head=head, part_size=5 * MIB)
    finally:
        os.close(fd)
    assert not hidden.has("ds", 1, "dd" * 32, 0)
    assert not hidden.bucket.client().list_multipart_uploads(Bucket=hidden.bucket.bucket).get("Uploads")
    fd = _fd(tmp_path, "same", data)
    try:
        assert hidden.upload("ds", 1, "dd" * 32, 0, fd, digest=checked, head=head, part_size=5 * MIB)
    finally:
        os.close(fd)
    assert hidden.verify("ds", 1) == (1, 0, [])
    assert hidden.bucket.get(hidden.object_key("ds", 1, "dd" * 32, 0))[0] == data


# -- the capture worker on a store in a bucket ---------------------------------------------------
def test_capture_worker_uploads_each_checked_file_once_and_leaves_nothing_on_local_disk(
        tmp_path, tokenizer_dir, s3_env, redis_server, workers):
    """``draftfleet capture`` and a real capture worker on the fake engine: every unit one object
    holding exactly the ids and states the worker checked; a unit a twin stored meanwhile (412) is
    not stored again nor counted; the engine's folder ends empty."""
    import json

    from draftfleet import redis_keys as rk
    from draftfleet.hidden import HEADER_ROOM, TargetModel
    from draftfleet.schemas.config import load_config

    from tests.capture_engine import CaptureEngine, contract, engine_file
    from tests.conftest import run_cli, wait_until, write_config
    from tests.test_hidden import _model, _put_record

    storage = tmp_path / "incoming"
    model = _model(tmp_path / "model")
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], TargetModel.load(model).config_sha256))
    location = f"s3://{s3_env.bucket()}/fleet"
    config = write_config(tmp_path, tokenizer=tokenizer_dir, max_attempts=2, store=location,
                          datasets=[{"name": "ds", "path": str(tmp_path / "d.jsonl")}])
    with open(config, "a") as fh:
        fh.write(f'\n[capture]\nmodel_path = "{model}"\nstorage_path = "{storage}"\ninflight = 2\n'
                 f'\n[backends.vllm]\nurls = ["{engine.url}"]\nrequest_timeout_s = 30.0\n')
    store = open_store(load_config(config))
    store.prepare()
    outputs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7]]
    for i, out in enumerate(outputs):
        _put_record(store, i, out)
    hidden, twin, twins_file = open_hidden(store), "01" * 32, _unit(3)
    sent: dict[int, list[int]] = {}

    def answer(ids):  # the connector's file with its header room; while unit 01 runs, a twin stores it
        if ids[-1] == 5:
            assert hidden.put("ds", 1, twin, 0, twins_file)
        if len(ids) > 1:  # not the worker's start-up probe
            sent[ids[-1]] = ids
        return engine.fresh_path(), engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM)

    engine.answer = answer
    env = {"REDIS_URL": redis_server.url}
    res = run_cli("capture", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    (summary,) = json.loads(res.stdout)
    assert (summary["queued"], summary["free_bytes"]) == (4, None)
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    r = redis_server.client()
    wait_until(lambda: len(sent) == 4 and not r.hlen(rk.UNACKED) and not r.llen(rk.capture_queue("ds")), 90, 0.2,
               lambda: f"every unit settled\n{workers.logs()}")
    wait_until(lambda: int(r.hget(rk.capture_progress("ds"), "captured") or 0) >= 3, 10, 0.1, "three counted")
    time.sleep(0.5)
    assert int(r.hget(rk.capture_progress("ds"), "captured")) == 3  # its own, not the twin's
    assert hidden.bucket.get(hidden.object_key("ds", 1, twin, 0))[0] == twins_file
    objects = sorted(hidden.files("ds", 1))
    assert [(k, t) for k, t, _ in objects] == [(f"{i:02x}" * 32, 0) for i in range(4)]
    for key, _turn, _where in objects:
        if key == twin:
            continue
        data = hidden.bucket.get(hidden.object_key("ds", 1, key, 0))[0]
        path = tmp_path / f"{key}.safetensors"
        path.write_bytes(data)
        tensors, meta = read_safetensors(path)
        ids = sent[4 + int(key[:2], 16)]  # record i answered [1, 2, 3, 4 + i]
        assert tensors["token_ids"][1].tolist() == ids and meta["key"] == key
        ref = tmp_path / "ref.safetensors"
        ref.write_bytes(engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
        assert np.array_equal(tensors["hidden_states"][1], read_safetensors(ref)[0]["hidden_states"][1])
    good, unsealed, bad = hidden.verify("ds", 1)
    assert (good, unsealed, bad) == (4, 0, [])
    assert not list(storage.iterdir()), "the engine's files are left on local disk"
    res = run_cli("inventory", "--config", str(config), "--verify", "--json", env=env)  # reads the bucket's
    assert res.returncode == 0, res.stderr
    held = json.loads(res.stdout)[0]["hidden_states"]
    assert (held["files"], held["verified"], held["bad_files"]) == (4, 4, [])
    assert "written again into the store" not in workers.logs(None)  # uploaded from the engine's file


def test_an_export_from_the_bucket_equals_one_from_a_folder_and_a_rerun_downloads_nothing(s3_env, tmp_path,
                                                                                           monkeypatch):
    """-f speculators from a bucket: the files downloaded to <out>/.cache, the rows, the hidden-state
    files and the vocabulary counts the same as from a folder store holding the same; run again,
    nothing is fetched."""
    import pyarrow as pa

    from draftfleet.export import features
    from tests.test_core import _record

    bucket_store, folder = _store(s3_env), open_store(tmp_path / "store")
    folder.prepare()
    plans: dict[str, list] = {"bucket": [], "folder": []}
    for i in range(5):
        rec, data = _record(f"{i:02x}" * 32, output_ids=[7, 8, 9 + i]), _unit(4 + i)
        for s in (bucket_store, folder):
            s.put(rec)
            if i != 3:  # one turn not captured: missing in both
                h = open_hidden(s)
                h.write_manifest(_manifest())
                assert h.put("ds", 1, rec.key, 0, data)
    got, fetched = {}, []
    for name, s in (("bucket", bucket_store), ("folder", folder)):
        monkeypatch.setattr(features, "_run_torch", lambda plan, python, n=name: plans[n].append(plan))
        got[name] = features.export_features(s, "ds", tmp_path / name, ["speculators"], model_path=None,
                                             fetching=lambda n, total: fetched.append((n, total)))
    assert (got["bucket"].rows, got["bucket"].missing, got["bucket"].bad_files) == (4, 1, [])
    assert msgspec.structs.replace(got["bucket"], folders={}) == msgspec.structs.replace(got["folder"], folders={})
    assert fetched[-1][0] == fetched[-1][1] == sum(len(_unit(4 + i)) for i in (0, 1, 2, 4))  # the folder fetches none
    tables = {}
    for name in plans:
        out = tmp_path / name / "ds.speculators"
        with pa.ipc.open_stream(str(out / "data-00000-of-00001.arrow")) as reader:
            tables[name] = reader.read_all().to_pylist()
        assert plans[name][0]["token_freq"]["counts"] == plans["folder"][0]["token_freq"]["counts"]
        for i in range(4):
            assert (out / "hidden_states" / f"hs_{i}.safetensors").read_bytes() == (
                tmp_path / "folder" / "ds.speculators" / "hidden_states" / f"hs_{i}.safetensors").read_bytes()
    assert tables["bucket"] == tables["folder"] and len(tables["bucket"]) == 4
    assert len(list((tmp_path / "bucket" / ".cache" / "_hidden" / "ds" / "v1").rglob("*.safetensors"))) == 4
    fetched.clear()
    again = features.export_features(bucket_store, "ds", tmp_path / "bucket", ["speculators"], model_path=None,
                                      fetching=lambda n, total: fetched.append((n, total)))
    assert fetched == [(0, 0)] and again.rows == 4


def test_a_unit_whose_engine_keeps_rewriting_its_file_fails_once_with_the_reason(
        tmp_path, tokenizer_dir, s3_env, redis_server, monkeypatch, caplog):
    """Issue 29 (8): the engine writes into its file after each check, so the upload refuses it
    (``OSError``). That went back to the queue every 5 s for ever; it is the unit's failure: asked
    again up to ``max_attempts``, then failed once, counted, with the reason, as other capture
    failures are; nothing stored."""
    import logging

    from draftfleet import redis_keys as rk
    from draftfleet.hidden import HEADER_ROOM
    from draftfleet.workers import capture

    from tests.capture_engine import CaptureEngine, contract, engine_file
    from tests.test_hidden import _model_sha
    from tests.test_security import _unit_runtime

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    engine.answer = lambda ids: (engine.fresh_path(), engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage, max_attempts=3,
                                            store=f"s3://{s3_env.bucket()}/fleet")
    checked = capture.check_states

    def check_then_rewrite(ids, got, m):  # the engine writes into its file after each check
        checked(ids, got, m)
        at = os.fstat(got.file.fd).st_size - 1
        os.pwrite(got.file.fd, bytes([os.pread(got.file.fd, 1, at)[0] ^ 1]), at)

    monkeypatch.setattr(capture, "check_states", check_then_rewrite)
    monkeypatch.setattr(capture, "backoff_s", lambda attempt, retry_after=None: 0.0)
    with caplog.at_level(logging.WARNING, logger="draftfleet.capture"):
        assert capture._capture(rt, task, m, ids, spans, "t") == "failed"
    assert len(engine.requests) == 3  # each attempt a new capture, then the unit's failure
    assert int(rt.r.hget(rk.capture_progress("ds"), "failed")) == 1
    [failed] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "failed" in failed and "changed after it was checked" in failed, failed
    assert not rt.hidden.has("ds", 1, task.key, 0)
    assert not list(storage.iterdir()), "the engine's files are left on local disk"


@pytest.mark.parametrize("size, lost, part", [(3, "PUT", ".safetensors"),
                                              (12 * MIB // (4 * 64 * 2) + 5, "POST", ".safetensors?uploadId=")],
                         ids=["put", "multipart"])
def test_a_unit_stored_whose_answer_was_lost_is_this_workers(s3_env, tmp_path, size, lost, part):
    """The unit's conditional PUT (or the ``CompleteMultipartUpload`` of its parts) is stored, its
    answer lost; botocore's retry gets 412. The upload is still this worker's (True: captured, not
    "duplicate"), and another worker's upload of the unit afterwards is refused."""
    from .test_s3_store import _Proxy, lose_first_answer

    bucket, data, key = s3_env.bucket(), _unit(size), "dd" * 32
    lose = lose_first_answer(lost, f"/v1/{key[:2]}/{key}.0{part}")
    with _Proxy(s3_env, lose) as proxy:
        store = open_store(f"s3://{bucket}/run1")
        store.bucket.options = msgspec.structs.replace(store.bucket.options, endpoint=proxy.endpoint)
        store.prepare()
        hidden = open_hidden(store)
        fd, twin = _fd(tmp_path, "mine", data), _fd(tmp_path, "twin", data)
        try:
            assert hidden.upload("ds", 1, key, 0, fd, part_size=5 * MIB)
            assert lose.lost and lose.lost[0].startswith(f"/{bucket}/run1/_hidden/ds/v1/dd/{key}")
            assert not hidden.upload("ds", 1, key, 0, twin, part_size=5 * MIB)
        finally:
            os.close(fd)
            os.close(twin)
    assert hidden.bucket.get(hidden.object_key("ds", 1, key, 0))[0] == data
    assert s3_env.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


_KILLED_MID_UPLOAD = """
import os, sys, threading
from draftfleet.store import open_store
from draftfleet.hidden import open_hidden

hidden = open_hidden(open_store(sys.argv[1]))
client = hidden.bucket.client()
def part_sent(**_):  # the first part is in the bucket: say so, and wait for the kill
    print("part", flush=True)
    threading.Event().wait()
client.meta.events.register("after-call.s3.UploadPart", part_sent)
fd = os.open(sys.argv[2], os.O_RDONLY)
hidden.upload("ds", 1, "ee" * 32, 0, fd, part_size=5 << 20)
"""


def test_an_upload_killed_mid_way_is_aborted_once_stale_and_a_live_one_is_kept(s3_env, tmp_path, monkeypatch,
                                                                               redis_server):
    """A capture worker killed -9 between two parts leaves a multipart upload: ``prepare`` (and
    ``reconcile``) abort the fleet's uploads older than ``STALE_UPLOAD_S``, and leave a younger one
    (a live worker's), and anything outside the fleet's prefix, alone."""
    import subprocess
    import sys

    from draftfleet.store import bucket as objectstore

    store = _store(s3_env)
    bucket, client = store.bucket.bucket, s3_env.client()
    path = tmp_path / "unit"
    path.write_bytes(_unit(12 * MIB // (4 * 64 * 2) + 5))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MID_UPLOAD, store.location, str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "part\n"
    finally:
        proc.kill()
        proc.wait()
    (left,) = client.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert left["Key"] == f"run1/_hidden/ds/v1/ee/{'ee' * 32}.0.safetensors"
    other = client.create_multipart_upload(Bucket=bucket, Key="elsewhere/big.bin")["UploadId"]
    monkeypatch.setattr(objectstore, "STALE_UPLOAD_S", 2.5)
    time.sleep(3.5)  # the killed one is stale; the next is live
    live = client.create_multipart_upload(Bucket=bucket, Key=store.object_name("_hidden", "ds", "v1", "ff", "x"))["UploadId"]
    store.prepare()

    def uploads():
        return sorted(u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ()))

    assert uploads() == sorted([other, live])
    time.sleep(3.5)  # the live one's worker is gone too: the reconciler's pass aborts it
    from draftfleet.reconcile import Reconciler

    Reconciler(store, redis_server.client()).reconcile_all()
    assert uploads() == [other]
