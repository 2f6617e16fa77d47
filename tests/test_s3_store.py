"""The store in a bucket against a real SeaweedFS (``weed server -s3`` on loopback, tests/conftest.py):
write-once under concurrent writers, the file store's semantics object by object, and each error
case as one clear line."""

from __future__ import annotations

import http.client
import http.server
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from draftfleet.store.bucket import ObjectStore
from draftfleet.schemas.config import StoreS3Section
from draftfleet.schemas.records import (
    DatasetEvent,
    DatasetManifest,
    FailureRecord,
    GenerationSettings,
    Message,
    PromptTask,
    QuarantineEntry,
    TurnProgress,
)
from draftfleet.store import StoreError, open_store

from .test_core import _record


SETTINGS = GenerationSettings(model="m", max_tokens=8, temperature=0.0, top_p=1.0)


def _failure(key: str) -> FailureRecord:
    task = PromptTask(key=key, dataset="ds", source="f:1", messages=[Message(role="user", content="q")],
                      settings=SETTINGS, settings_id="s", enqueued_at=0.0)
    return FailureRecord(key=key, dataset="ds", source="f:1", reason="r", error_kind="http_400", attempts=3,
                         backend="b", worker="w", failed_at=1.0, task=task)


def _manifest(version: int, sid: str) -> DatasetManifest:
    return DatasetManifest(name="ds", version=version, settings=SETTINGS, settings_id=sid, budget_tokens=None,
                           created_at=float(version))


def _store(s3_env, prefix: str = "run1") -> ObjectStore:
    store = open_store(f"s3://{s3_env.bucket()}/{prefix}")
    assert isinstance(store, ObjectStore)
    store.prepare()
    return store


def test_sixteen_writers_of_one_key_leave_one_winner(s3_env):
    """Each writer with its own client, as on separate machines; 20 keys, 16 writers each."""
    location = _store(s3_env).location
    stores = [open_store(location) for _ in range(16)]
    for n in range(20):
        key = f"{n:02x}" * 32
        barrier, won = threading.Barrier(16), []

        def put(i):
            barrier.wait()
            if stores[i].put(_record(key, text=f"writer {i}")):
                won.append(i)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, (key, won)
        assert stores[0].get("ds", key).text == f"writer {won[0]}"  # the winner's bytes, not a later writer's
    assert len(stores[0].keys("ds")) == 20


def test_same_semantics_as_the_file_store(s3_env):
    store = _store(s3_env)
    key, other = "ab" * 32, "cd" * 32
    assert not store.has("ds", key) and store.records("ds") is not None and store.datasets() == []
    store.put_failure(_failure(key))
    store.put_failure(_failure(other))
    assert [f.key for f in store.failures("ds")] == [key, other]
    assert store.put(_record(key)) and not store.put(_record(key, text="again"))
    assert [f.key for f in store.failures("ds")] == [other]  # storing a result cleared its failure
    assert store.get("ds", key).text == "t" and store.keys("ds") == {key} and store.datasets() == ["ds"]

    store.put_progress(TurnProgress(dataset="ds", key=other, turns=[]))
    assert store.progress("ds", other).key == other and store.progress_keys("ds") == {other}
    store.clear_progress("ds", other)
    assert store.progress("ds", other) is None and store.progress_keys("ds") == set()

    bad = QuarantineEntry(file="f.jsonl", line=3, field=None, kind="bad_json", message="f.jsonl:3: bad", raw="{x", at=2.0)
    store.quarantine("ds", [bad])
    store.quarantine("ds", [QuarantineEntry(**{**{f: getattr(bad, f) for f in bad.__struct_fields__}, "at": 9.0})])
    assert [q.raw for q in store.quarantined("ds")] == ["{x"]  # a re-run's rejection is kept once
    for at in (3.0, 1.0, 2.0):
        store.log(DatasetEvent(at=at, dataset="ds", kind="assign", assigned=["gpu"], note="pivot"))
    assert [e.at for e in store.events("ds")] == [1.0, 2.0, 3.0]

    assert store.set_aside("ds", key).startswith(f"s3://{store.bucket_name}/run1/_unreadable/ds/{key}.")
    assert not store.has("ds", key) and store.set_aside("ds", key) is None


def test_manifest_is_replaced_only_if_unchanged(s3_env):
    """Two enqueues read the manifest; the second to write is refused instead of overwriting."""
    a = _store(s3_env)
    b = open_store(a.location)
    assert a.manifest("ds") is None and b.manifest("ds") is None
    a.write_manifest(_manifest(1, "s1"))
    with pytest.raises(StoreError, match="manifest of ds in s3://.* changed while this command ran"):
        b.write_manifest(_manifest(1, "s2"))
    assert b.manifest("ds").settings_id == "s1"
    b.write_manifest(_manifest(2, "s2"))  # read since: replaced
    with pytest.raises(StoreError, match="changed while this command ran"):
        a.write_manifest(_manifest(1, "s1"))  # a's view is its own write, older than b's
    assert open_store(a.location).manifest("ds").settings_id == "s2"


def test_listing_pages_past_a_thousand(s3_env):
    store = _store(s3_env)
    keys = {f"{i:064x}" for i in range(1005)}  # all in shard 00: pages within one shard

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda k: store.put(_record(k)), keys))
    assert store.keys("ds") == keys
    assert sum(1 for _ in store.records("ds")) == 1005


def test_a_sharded_listing_is_the_serial_one(s3_env):
    """1,500 keys: 1,020 in shard ab (pages within a shard), the rest spread over the others, beside
    objects under the prefix that are in no shard; and a listing small enough for one page."""
    store = _store(s3_env)
    rng = random.Random(25)
    keys = [f"ab{rng.getrandbits(248):062x}" for _ in range(1020)] + [f"{rng.getrandbits(256):064x}" for _ in range(480)]
    base = store.object_name("ds", "")
    names = [f"{base}{k[:2]}/{k}.json" for k in keys] + [f"{base}manifest.json", f"{base}abc/x.json", f"{base}zz/y.json",
                                                          f"{base}ab", f"{base}0/z.json"]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda n: store.bucket.put(n, b"{}"), names))
    serial = sorted(store.bucket.list(base))
    assert len(serial) == len(names)
    sharded = store.bucket.list_sharded(base)
    assert sharded == sorted(f"{base}{k[:2]}/{k}.json" for k in keys)
    assert sharded == [n for n in serial if n[len(base) + 2:len(base) + 3] == "/" and "/" not in n[len(base) + 3:]
                       and n[len(base):len(base) + 2] in {f"{i:02x}" for i in range(256)}]
    assert store.keys("ds") == set(keys)
    assert [(k, size) for k, size, _mtime in store.bucket.list_sharded(base, sized=True)] == [(k, 2) for k in sharded]
    few = store.object_name("few", "")
    for n in ("manifest.json", "00/a.json", "ff/b.json", "zz/c.json"):
        store.bucket.put(few + n, b"{}")
    assert store.bucket.list_sharded(few) == [few + "00/a.json", few + "ff/b.json"]
    assert store.bucket.list_sharded(store.object_name("none", "")) == []


def test_prepare_refuses_a_prefix_of_someone_elses(s3_env):
    bucket = s3_env.bucket()
    s3_env.client().put_object(Bucket=bucket, Key="data/backup.tar", Body=b"x")
    with pytest.raises(StoreError, match=r"refusing store s3://fleet-\w+/data: it holds objects the fleet did "
                                         r"not make \(backup.tar\)"):
        open_store(f"s3://{bucket}/data").prepare()
    open_store(f"s3://{bucket}/fleet").prepare()  # a prefix of its own in the same bucket is fine


def _error(location: str, options: StoreS3Section | None = None) -> str:
    with pytest.raises(StoreError) as exc:
        ObjectStore(location, options).prepare()
    text = str(exc.value)
    assert "\n" not in text and "fleet-test-secret" not in text
    return text


def test_each_error_is_one_clear_line(s3_env, monkeypatch):
    assert "no bucket 'no-such-bucket' at http://127.0.0.1:" in _error("s3://no-such-bucket/x")
    bucket = s3_env.bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fleet-test-secret-wrong")
    assert f"access denied to s3://{bucket} at http://127.0.0.1:" in _error(f"s3://{bucket}/x")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert "no credentials for s3://" in _error(f"s3://{bucket}/x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.SECRET_KEY)
    from .conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach s3://{bucket} at {dead}: check [store.s3] endpoint" in _error(
        f"s3://{bucket}/x", StoreS3Section(endpoint=dead))
    assert "bad store 's3://B/x'" in _error("s3://B/x")


def test_credentials_that_may_not_write_are_one_line(s3_env, monkeypatch):
    """Valid credentials the bucket lets read and list but not write: the probe's PUT is refused."""
    bucket = s3_env.bucket()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.READ_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.READ_SECRET)
    text = _error(f"s3://{bucket}/x")
    assert text.startswith(f"access denied to s3://{bucket} at http://127.0.0.1:") and s3_env.READ_SECRET not in text
    assert text.endswith("the credentials may not read and write it"), text


class _Unconditional(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that answers every write 200 whatever its If-None-Match (as stores without
    conditional writes do): the probe must catch it."""

    def _answer(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("ETag", '"0123"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):  # noqa: N802
        self._answer(200 if self.path.count("/") == 1 else 404)

    def do_PUT(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(200)

    def do_DELETE(self):  # noqa: N802
        self._answer(204)

    def do_GET(self):  # noqa: N802
        self._answer(200, b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>')

    def log_message(self, *args):
        pass


def test_a_bucket_that_ignores_conditional_writes_is_refused(s3_env):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unconditional)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        text = _error("s3://plain/x", StoreS3Section(endpoint=f"http://127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()
    assert "refusing store s3://plain/x: the bucket ignores If-None-Match" in text


_RESIGNED = {"authorization", "x-amz-date", "x-amz-content-sha256", "host", "connection", "content-length", "expect",
             "accept-encoding", "keep-alive", "transfer-encoding"}
_PRECONDITION_FAILED = (412, [("Content-Type", "application/xml")],
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code>'
                        b"<Message>At least one of the pre-conditions you specified did not hold</Message></Error>")


class _Forward(http.server.BaseHTTPRequestHandler):
    """Each request on to the server's ``send`` through its ``change``."""

    protocol_version = "HTTP/1.1"

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _RESIGNED}
        answer = self.server.change(self.command, self.path, headers, body, self.server.send)
        if answer is None:  # forwarded, and its answer lost: the connection closes unanswered
            self.close_connection = True
            return
        status, out, data = answer
        self.send_response(status)
        for k, v in out:
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                self.send_header(k, v)
        length = dict((k.lower(), v) for k, v in out).get("content-length", "0") if self.command == "HEAD" else len(data)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    def log_message(self, *args):
        pass


class _Proxy(http.server.ThreadingHTTPServer):
    """The real SeaweedFS behind an endpoint that re-signs each request (the client's signature
    covers the headers) after ``change(method, path, headers, body, send)`` has had its say: a
    real server with one conditional write made unreliable."""

    daemon_threads = True

    def __init__(self, s3, change):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.s3, self.change = s3, change
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def send(self, method: str, path: str, headers: dict, body: bytes):
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        req = AWSRequest(method=method, url=self.s3.endpoint + path, data=body, headers=headers)
        S3SigV4Auth(Credentials(self.s3.ACCESS_KEY, self.s3.SECRET_KEY), "s3", "us-east-1").add_auth(req)
        conn = http.client.HTTPConnection("127.0.0.1", self.s3.ports["s3"], timeout=30)
        try:
            conn.request(method, path, body=body or None, headers=dict(req.headers.items()))
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def _drop(name: str):
    def change(method, path, headers, body, send):
        return send(method, path, {k: v for k, v in headers.items() if k.lower() != name}, body)

    return change


def lose_first_answer(method: str, part: str):
    """Forward every request; the first ``method`` whose path holds ``part`` reaches the server and
    its answer is lost (the connection closes unanswered), so botocore sends it again. ``lost``
    lists the paths whose answer was lost."""
    lost: list[str] = []

    def change(m, path, headers, body, send):
        answer = send(m, path, headers, body)
        if not lost and m == method and part in path:
            lost.append(path)
            return None
        return answer

    change.lost = lost
    return change


def lose_then_refuse(part: str, refused: int):
    """The first PUT whose path holds ``part`` reaches the server and its answer is lost; the next
    ``refused`` ones never reach it (the connection closes before anything is forwarded), so
    botocore's retries give up; later ones are forwarded. ``seen`` lists what each PUT met."""
    seen: list[str] = []

    def change(m, path, headers, body, send):
        if m != "PUT" or part not in path:
            return send(m, path, headers, body)
        seen.append("lost" if not seen else "refused" if len(seen) <= refused else "sent")
        if seen[-1] == "refused":
            return None
        answer = send(m, path, headers, body)
        return None if seen[-1] == "lost" else answer

    change.seen = seen
    return change


def botocore_attempts(store: ObjectStore) -> int:
    """How many tries botocore gives one request (the first and its retries)."""
    return store.bucket.client().meta.config.retries["total_max_attempts"]


def _check_then_write(method, path, headers, body, send):
    """If-None-Match as a server without an atomic create does it: look, then write."""
    if method != "PUT" or not any(k.lower() == "if-none-match" for k in headers):
        return send(method, path, headers, body)
    if send("HEAD", path, {}, b"")[0] == 200:
        return _PRECONDITION_FAILED
    time.sleep(0.5)  # the window between the look and the write, wide enough for every racer
    return send(method, path, {k: v for k, v in headers.items() if k.lower() != "if-none-match"}, body)


def test_a_bucket_that_ignores_if_match_is_refused(s3_env):
    """Everything real but If-Match: write-once passes, the stale ETag's overwrite does not."""
    bucket = s3_env.bucket()
    with _Proxy(s3_env, _drop("if-match")) as proxy:
        text = _error(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
        with _Proxy(s3_env, _drop("nothing")) as honest:  # the proxy itself changes nothing else
            ObjectStore(f"s3://{bucket}/y", StoreS3Section(endpoint=honest.endpoint)).prepare()
    assert text == (f"refusing store s3://{bucket}/x: the bucket ignores If-Match (a PUT with a stale ETag "
                    f"succeeded), so an enqueue could overwrite a manifest another enqueue just wrote; use a bucket "
                    f"or server with conditional writes (ops/scaling.md)")
    assert [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", ())] == ["y/.draftfleet-store"]


def _strip(method: str, prefix: str):
    """Headers starting with ``prefix`` removed from each ``method`` request: a server that ignores them."""
    def change(m, path, headers, body, send):
        if m == method:
            headers = {k: v for k, v in headers.items() if not k.lower().startswith(prefix)}
        return send(m, path, headers, body)

    return change


def test_a_bucket_that_drops_metadata_is_refused(s3_env):
    """Without the write's token on the object a lost answer's 412 cannot be told from a twin's."""
    bucket = s3_env.bucket()
    with _Proxy(s3_env, _strip("PUT", "x-amz-meta-")) as proxy:
        text = _error(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
    assert text == (f"refusing store s3://{bucket}/x: the bucket drops an object's metadata (x-amz-meta-*), so a "
                    f"record whose answer was lost would be taken for another writer's; use a bucket or server with "
                    f"conditional writes (ops/scaling.md)")
    assert s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", []) == []  # probes cleaned up


@pytest.mark.parametrize("prepared", [True, False], ids=["probed-by-prepare", "probed-by-set-aside"])
def test_a_bucket_whose_delete_ignores_if_match_keeps_an_unreadable_record_in_place(s3_env, prepared):
    """Setting aside needs a conditional DELETE; where the bucket ignores it (probed by ``prepare``, or
    by the first ``set_aside`` of a process that did not prepare) the record stays, nothing is copied."""
    bucket = s3_env.bucket()
    with _Proxy(s3_env, _strip("DELETE", "if-match")) as proxy:
        options = StoreS3Section(endpoint=proxy.endpoint)
        ObjectStore(f"s3://{bucket}/x", options).prepare()
        store = ObjectStore(f"s3://{bucket}/x", options)
        if prepared:
            store.prepare()
        key = "cd" * 32
        store.bucket.put(store._record_key("ds", key), b"")
        assert store.set_aside("ds", key) is None
        assert store.record_bytes("ds", key) == b""
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["x/.draftfleet-store", f"x/ds/cd/{key}.json"]  # no probe, no copy aside


def test_a_bucket_that_checks_then_writes_is_refused(s3_env):
    """If-None-Match answered right one writer at a time, wrong for writers at once."""
    bucket = s3_env.bucket()
    with _Proxy(s3_env, _check_then_write) as proxy:
        text = _error(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
    assert text == (f"refusing store s3://{bucket}/x: the bucket let 2 of 2 concurrent conditional PUTs of one key "
                    f"succeed (it checks, then writes), so two workers could both store one prompt; use a bucket or "
                    f"server with conditional writes (ops/scaling.md)")
    assert s3_env.client().list_objects_v2(Bucket=bucket).get("Contents", []) == []  # probes cleaned up


def test_a_record_stored_whose_answer_was_lost_is_this_writers(s3_env):
    """The record's conditional PUT is stored, its answer lost; botocore's retry gets 412. The record
    is still this call's (True: the worker counts it once and charges no twin's cost), and a twin's
    PUT of the key afterwards is still refused (False)."""
    bucket = s3_env.bucket()
    key = "ab" * 32
    lose = lose_first_answer("PUT", f"/ds/{key[:2]}/")
    with _Proxy(s3_env, lose) as proxy:
        store = ObjectStore(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
        store.prepare()
        assert store.put(_record(key, text="mine"))
        assert lose.lost == [f"/{bucket}/x/ds/ab/{key}.json"]
        assert not store.put(_record(key, text="twin"))
    assert store.get("ds", key).text == "mine"


def test_a_writer_whose_retries_were_refused_finds_its_own_write_on_its_next_call(s3_env):
    """The record's PUT is stored, its answer lost, and botocore's retries never reach the server:
    the call fails. The caller's next call with the same ``writer`` gets 412 and finds its own token
    on the object (True, stored once); another writer's call is a twin's (False), as is one with none."""
    bucket = s3_env.bucket()
    key = "ef" * 32
    with _Proxy(s3_env, _drop("nothing")) as proxy:
        store = ObjectStore(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
        store.prepare()
        fault = lose_then_refuse(f"/ds/{key[:2]}/{key}.json", botocore_attempts(store) - 1)
        proxy.change = fault
        with pytest.raises(StoreError):
            store.put(_record(key, text="mine"), writer="task-a")
        assert fault.seen == ["lost"] + ["refused"] * (botocore_attempts(store) - 1)
        assert store.put(_record(key, text="mine"), writer="task-a")
        assert not store.put(_record(key, text="twin"), writer="task-b")
        assert not store.put(_record(key, text="twin"))
    assert store.get("ds", key).text == "mine"


def test_a_record_costs_one_request(s3_env, redis_server):
    """``Store.put`` in a bucket is the conditional PUT alone (bench store: client CPU is per request);
    a twin's costs one HEAD more, to tell its 412 from a lost answer's. The failure record it leaves
    is never listed, and the reconciler deletes it."""
    from draftfleet.reconcile import Reconciler

    store = _store(s3_env)
    sent = []
    store.bucket.client().meta.events.register("before-send.s3", lambda **kw: sent.append(kw["request"].method))
    store.put_failure(_failure("ab" * 32))
    sent.clear()
    assert store.put(_record("ab" * 32))
    assert sent == ["PUT"]
    sent.clear()
    assert not store.put(_record("ab" * 32, text="twin"))
    assert sent == ["PUT", "HEAD"]
    assert store.failures("ds") == []  # its failure is finished: a stored key's is never listed
    Reconciler(store, redis_server.client()).reconcile_all()
    assert list(store.bucket.list(store.object_name("_failures", ""))) == []


def test_set_aside_never_deletes_a_record_written_after_its_copy(s3_env):
    """Two callers set one unreadable record aside (a claim lost mid-way): the second moves it and a
    good record is stored before the first deletes what it copied. The first's delete is conditional
    on the ETag it copied: the good record stays, and the first says it moved nothing."""
    a = _store(s3_env)
    b = open_store(a.location)
    key = "cd" * 32
    a.bucket.put(a._record_key("ds", key), b"")  # an empty record file: unreadable
    copy = a.bucket.copy

    def copy_then_b_moves_and_stores(*args, **kw):
        copy(*args, **kw)
        assert b.set_aside("ds", key) is not None
        assert b.put(_record(key, text="good"))

    a.bucket.copy = copy_then_b_moves_and_stores
    assert a.set_aside("ds", key) is None
    assert a.get("ds", key).text == "good"
    aside = list(a.bucket.list(a.object_name("_unreadable", "ds", "")))
    assert len(aside) == 1 and a.bucket.get(aside[0])[0] == b""  # b's copy; a's removed again


def test_store_location_errors_before_any_request():
    with pytest.raises(StoreError, match="bad store 's3://x'"):
        open_store("s3://x")
    assert open_store("s3://bucket/a/b/").location == "s3://bucket/a/b"
    t0 = time.monotonic()
    assert open_store("s3://bucket").location == "s3://bucket" and time.monotonic() - t0 < 5


@pytest.mark.slow
def test_fleet_on_a_bucket_resumes_after_redis_lost_everything(tmp_path, s3_server, redis_server, tokenizer_dir,
                                                               emulator_factory, workers):
    """enqueue, a real GPU worker on the emulator, records in the bucket; Redis flushed mid-run and
    ``enqueue`` again queues only what the bucket lacks; inventory and status read the bucket."""
    import json
    from collections import Counter

    from draftfleet.schemas.config import load_config

    from .conftest import run_cli, wait_until, write_config, write_jsonl
    from .test_fleet import _chat_rows

    emu = emulator_factory(single_stream_tps=40, ceiling_tps=5000, length="fixed:20", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", [*_chat_rows(40), "{not json"])
    location = f"s3://{s3_server.bucket()}/fleet"
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, store=location,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64, "budget_tokens": 100000}],
                          inflight=4)
    env = {**s3_server.env(), "REDIS_URL": redis_server.url}

    def enqueue() -> dict:
        res = run_cli("enqueue", "--config", str(config), "--json", env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)[0]

    first = enqueue()
    assert (first["queued"], first["rejected"]) == (40, 1) and first["quarantine_file"] == f"{location}/_quarantine/ds/"
    assert not (tmp_path / "store").exists()  # nothing local: the store is the bucket
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        store = open_store(load_config(config))
        gpu = workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url, env=s3_server.env())
        wait_until(lambda: len(store.keys("ds")) >= 8, 90, 0.2, lambda: f"8 results\n{workers.logs()}")
        workers.stop(gpu)  # warm shutdown: what started finishes and is stored
        stored = len(store.keys("ds"))
        assert 8 <= stored < 40

        redis_server.client().flushall()
        again = enqueue()
        assert (again["queued"], again["already_done"], again["already_queued"]) == (40 - stored, stored, 0)

        emu.update(single_stream_tps=2000)
        workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url, env=s3_server.env())
        wait_until(lambda: len(store.keys("ds")) == 40, 90, 0.2, lambda: f"40 results\n{workers.logs()}")
        records = list(store.records("ds"))
        assert Counter(r.source for r in records).most_common(1)[0][1] == 1 and len(records) == 40
        assert [q.raw for q in store.quarantined("ds")] == ["{not json"]

    res = run_cli("inventory", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    inv = json.loads(res.stdout)[0]
    assert inv["responses"] == 40 and inv["completion_tokens"] == sum(r.completion_tokens for r in records)
    res = run_cli("export", "--config", str(config), "-f", "raw", "--out", str(tmp_path / "export"), "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["records"] == 40
    exported = [json.loads(x) for x in (tmp_path / "export" / "ds.raw_responses.jsonl").read_text().splitlines()]
    assert sorted(r["completion_tokens"] for r in exported) == sorted(r.completion_tokens for r in records)
    assert len(exported) == 40
    out = tmp_path / "report.html"
    res = run_cli("report", "--config", str(config), "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert f"store {location}" in out.read_text()
    res = run_cli("status", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    (ds,) = json.loads(res.stdout)["datasets"]
    assert ds["dataset"] == "ds"
    print(f"\n{stored} stored before Redis was flushed; status: {json.dumps(ds)[:300]}")


def test_commands_on_a_bucket_say_what_is_wrong_in_one_line(tmp_path, s3_server, redis_server, tokenizer_dir):
    from .conftest import run_cli, write_config, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    ds = [{"name": "ds", "path": str(data)}]
    env = s3_server.env()
    config = write_config(tmp_path / "a", tokenizer=tokenizer_dir, datasets=ds, store="s3://no-such-bucket/x")
    res = run_cli("enqueue", "--config", str(config), env=env)  # no Redis given: a bucket has none beside it
    assert res.returncode == 1 and "has no embedded Redis" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("enqueue", "--config", str(config), env={**env, "REDIS_URL": redis_server.url})
    assert res.returncode == 1 and "no bucket 'no-such-bucket' at http://127.0.0.1:" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and s3_server.SECRET_KEY not in res.stderr
    assert [x for x in res.stderr.splitlines() if "no bucket" in x] == [res.stderr.splitlines()[-1]]
    res = run_cli("inventory", "--store", "s3://no-such-bucket/x", "--json", env=env)
    assert res.returncode == 1 and "no bucket 'no-such-bucket' at http://127.0.0.1:" in res.stderr, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr


@pytest.mark.parametrize("kind", ["folder", "bucket"])
def test_provider_batches_are_kept_open_then_closed_the_same_in_both_stores(s3_env, tmp_path, kind):
    """A batch (workers/batch.py) is replaced whole while open, moved aside once closed; its open
    prompts are the keys enqueue must not queue again."""
    from draftfleet.schemas.records import BatchRecord, BatchRequest
    from draftfleet.store.base import new_batch_id
    from draftfleet.store.folder import FileStore

    store = _store(s3_env, "batches") if kind == "bucket" else FileStore(tmp_path / "store")
    if kind == "folder":
        store.prepare()
    key, other = "ab" * 32, "cd" * 32
    reqs = [BatchRequest(task=_failure(k).task, granted=64, digest="d") for k in (key, other)]
    b = BatchRecord(id=new_batch_id(), backend="cloudy", shape="openai", dataset="ds", model="m", worker="w",
                    submitted_at=1.0, updated_at=1.0, requests=reqs)
    store.put_batch(b)
    assert [x.id for x in store.batches()] == [b.id] and store.batches(closed=True) == []
    assert store.batched_keys("ds") == {key, other} and store.batched_keys("other") == set()
    done = msgspec.structs.replace(b, provider_id="batch_1", requests=[msgspec.structs.replace(reqs[0], state="stored"),
                                                                       reqs[1]])
    store.put_batch(done)
    assert store.open_batch(b.id).provider_id == "batch_1" and store.batched_keys("ds") == {other}
    store.put_batch(msgspec.structs.replace(done, closed=True))
    assert store.batches() == [] and store.open_batch(b.id) is None and store.batched_keys("ds") == set()
    assert [x.id for x in store.batches(closed=True)] == [b.id]
    with pytest.raises(StoreError):
        store.put_batch(msgspec.structs.replace(b, id="../x"))
