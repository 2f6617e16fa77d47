"""Hardening (issue 12): a store and an embedded Redis nobody else can take over, bounded input.

Tests run as root here: "another user" is made with ``os.chown`` to another uid, "writable by
others" with ``chmod``.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import redis

from draftfleet.broker import BrokerError, EmbeddedRedis
from draftfleet import store as store_module
from draftfleet.store import StoreError, open_store
from tests.conftest import RedisServer, run_cli, write_config, write_jsonl

OTHER_UID = 4242


@pytest.fixture
def embedded(tmp_path):
    """An EmbeddedRedis in ``tmp_path/store/_redis``, stopped at the end if it started."""
    emb = EmbeddedRedis(tmp_path / "store" / "_redis")
    yield emb
    try:
        emb.stop()
    except BrokerError:
        pass


# -- the embedded Redis ------------------------------------------------------------------------
class TestEmbeddedRedis:
    def test_refuses_a_redis_folder_owned_by_another_user(self, tmp_path, embedded):
        embedded.dir.mkdir(parents=True, mode=0o700)
        os.chown(embedded.dir, OTHER_UID, OTHER_UID)
        with pytest.raises(BrokerError, match=r"_redis: owned by uid 4242, not by this user"):
            embedded.ensure()
        assert not (embedded.dir / "redis.conf").exists()

    def test_refuses_a_store_owned_by_another_user(self, tmp_path, embedded):
        embedded.dir.parent.mkdir()
        os.chown(embedded.dir.parent, OTHER_UID, OTHER_UID)
        with pytest.raises(BrokerError, match=r"store: owned by uid 4242"):
            embedded.ensure()
        assert not embedded.dir.exists()

    @pytest.mark.parametrize("where,mode", [("_redis", 0o770), ("_redis", 0o707), ("_redis", 0o755),
                                            ("store", 0o777), ("store", 0o775)])
    def test_refuses_folders_other_users_can_write(self, tmp_path, embedded, where, mode):
        embedded.dir.mkdir(parents=True, mode=0o700)
        folder = embedded.dir if where == "_redis" else embedded.dir.parent
        folder.chmod(mode)
        with pytest.raises(BrokerError, match=rf"refusing .*{where}: mode {mode:04o}") as info:
            embedded.ensure()
        assert "\n" not in str(info.value)  # one line
        assert not (embedded.dir / "redis.conf").exists()

    def test_a_store_it_creates_passes_its_own_check_under_any_umask(self, embedded):
        old = os.umask(0o002)
        try:
            url = embedded.ensure()
        finally:
            os.umask(old)
        assert stat.S_IMODE(embedded.dir.parent.stat().st_mode) == 0o755 and embedded.running_url() == url

    def test_refuses_a_symlinked_redis_folder(self, tmp_path, embedded):
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        embedded.dir.parent.mkdir()
        embedded.dir.symlink_to(elsewhere)
        with pytest.raises(BrokerError, match="not a plain folder"):
            embedded.ensure()
        assert list(elsewhere.iterdir()) == []

    def test_never_writes_through_a_planted_symlink(self, tmp_path, embedded):
        """redis.conf (the password) and redis.url are created afresh, never through a link."""
        embedded.dir.mkdir(parents=True, mode=0o700)
        bait = tmp_path / "bait"
        bait.write_text("")
        bait.chmod(0o666)
        (embedded.dir / "redis.conf").symlink_to(bait)
        (embedded.dir / "redis.url").symlink_to(bait)
        url = embedded.ensure()
        assert bait.read_text() == ""
        for name in ("redis.conf", "redis.url"):
            st = os.lstat(embedded.dir / name)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name
        assert embedded.running_url() == url

    def test_a_planted_url_is_not_trusted(self, tmp_path, embedded):
        """A redis.url whose server answers pings but is not this store's own is ignored."""
        foreign = RedisServer(tmp_path / "foreign")
        foreign.start()
        try:
            embedded.dir.mkdir(parents=True, mode=0o700)
            fd = os.open(embedded.dir / "redis.url", os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, foreign.url.encode() + b"\n")
            os.close(fd)
            assert embedded.running_url() is None
            url = embedded.ensure()
            assert url != foreign.url and f":{foreign.port}/" not in url
            r = redis.Redis.from_url(url)
            r.set("probe", "ours")
            assert foreign.client().get("probe") is None
        finally:
            foreign.stop()

    def test_admin_commands_are_disabled(self, embedded, tmp_path):
        """With the password, CONFIG SET dir + SAVE would write a file anywhere as the fleet's user."""
        r = redis.Redis.from_url(embedded.ensure())
        r.set("k", "v")
        for cmd in (("CONFIG", "SET", "dir", str(tmp_path)), ("CONFIG", "GET", "dir"), ("SAVE",), ("BGSAVE",),
                    ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST"), ("REPLICAOF", "127.0.0.1", "1"),
                    ("SLAVEOF", "127.0.0.1", "1")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                r.execute_command(*cmd)
        assert r.get("k") == b"v"  # what the fleet uses still works
        assert embedded.stop()

    def test_cli_reports_a_planted_store_in_one_line(self, tmp_path, tokenizer_dir):
        config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(tmp_path / "x")}])
        (tmp_path / "store" / "_redis").mkdir(parents=True, mode=0o700)
        os.chown(tmp_path / "store" / "_redis", OTHER_UID, OTHER_UID)
        env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "COLUMNS": "500"}
        res = subprocess.run([sys.executable, "-m", "draftfleet", "redis", "start", "--config", str(config)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 1
        assert res.stderr.strip().count("\n") == 0 and "owned by uid 4242" in res.stderr, res.stderr


# -- the store's root --------------------------------------------------------------------------
class TestStoreRoot:
    def test_a_file_system_root_is_refused(self):
        with pytest.raises(StoreError, match="a file-system root"):
            open_store("/").prepare()

    def test_a_folder_with_foreign_content_is_refused(self, tmp_path):
        (tmp_path / "passwd").write_text("root:x:0:0\n")
        (tmp_path / "ssh").mkdir()
        with pytest.raises(StoreError, match=r"did not make \(passwd, ssh\)"):
            open_store(tmp_path).prepare()
        assert not (tmp_path / store_module.MARKER).exists()

    def test_a_new_or_empty_folder_gets_the_marker(self, tmp_path):
        open_store(tmp_path / "new" / "store").prepare()
        assert (tmp_path / "new" / "store" / store_module.MARKER).is_file()
        (tmp_path / "empty").mkdir()
        open_store(tmp_path / "empty").prepare()
        assert (tmp_path / "empty" / store_module.MARKER).is_file()

    def test_a_store_made_before_the_marker_is_recognised(self, tmp_path):
        (tmp_path / "ds" / "ab").mkdir(parents=True)
        (tmp_path / "ds" / "manifest.json").write_text("{}")
        for name in ("_redis", "_failures", "_quarantine", "_state"):
            (tmp_path / name).mkdir()
        open_store(tmp_path).prepare()
        assert (tmp_path / store_module.MARKER).is_file()
        (tmp_path / "foreign.txt").write_text("x")
        open_store(tmp_path).prepare()  # marked: whatever is added later is the operator's business

    def test_a_folder_without_manifest_is_not_a_dataset(self, tmp_path):
        (tmp_path / "etc").mkdir()
        with pytest.raises(StoreError, match=r"\(etc\)"):
            open_store(tmp_path).prepare()

    def test_two_workers_preparing_a_new_store_together_both_start(self, tmp_path, monkeypatch):
        # Two workers started at once on a new store (CI's fault tests start a GPU and a cloud worker
        # together): the second looked while the first's marker was still its temp file, refused the
        # store as foreign, and exited 1 (issue 26.8). The second's look is put in exactly that moment.
        root = tmp_path / "store"
        replace, looked = os.replace, []

        def second_worker_looks_first(src, dst):
            if str(dst).endswith(store_module.MARKER) and not looked:
                looked.append(sorted(os.listdir(root)))  # the temp file, no marker yet
                open_store(root).prepare()
            replace(src, dst)

        monkeypatch.setattr(os, "replace", second_worker_looks_first)
        open_store(root).prepare()
        assert looked and looked[0][0].startswith(".tmp-") and (root / store_module.MARKER).is_file()
        assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / ".tmp-notours.txt").write_text("x")  # only the fleet's own temp names pass
        with pytest.raises(StoreError, match="notours"):
            open_store(tmp_path / "other").prepare()

    def test_enqueue_refuses_a_system_folder_as_store(self, tmp_path, tokenizer_dir, redis_server):
        data = write_jsonl(tmp_path / "data" / "p.jsonl", [{"prompt": "hi"}])
        system = tmp_path / "sys"
        (system / "etc").mkdir(parents=True)
        (system / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
        config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "etc", "path": str(data)}])
        res = run_cli("enqueue", "--config", str(config), "--store", str(system), env={"REDIS_URL": redis_server.url})
        assert res.returncode == 1 and "refusing store" in res.stderr and "(etc)" in res.stderr, res.stderr
        assert not (system / "etc" / "manifest.json").exists()
        assert redis_server.client().llen("draftfleet.etc") == 0


# -- input that exhausts or hangs --------------------------------------------------------------
def _read_all(path, limit: int = 4 * 1024 * 1024, fmt: str = "jsonl", timeout: float = 20.0):
    """The reader's output, run in a thread: a hang is a test failure after ``timeout``, not a stuck suite."""
    from draftfleet.producer.readers import read_prompts
    from draftfleet.schemas.config import DatasetConfig

    got: list = []
    t = threading.Thread(target=lambda: got.extend(read_prompts(DatasetConfig(name="t", path=str(path), format=fmt),
                                                                max_line_bytes=limit)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"reading {path} did not end within {timeout}s"
    return got


def test_an_oversized_line_is_never_held_whole(tmp_path):
    """A 64 MiB line under a 1 MiB limit: peak Python memory stays near the limit, not the line."""
    import tracemalloc

    from draftfleet.producer.readers import EXCERPT_BYTES, PromptRow

    big = b'{"prompt": "' + b"y" * (64 * 1024 * 1024) + b'"}'
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as fh:
        fh.write(b'{"prompt": "a"}\n' + big + b'\n{"prompt": "b"}\n')
    digest = hashlib.sha256(big).hexdigest()
    del big
    tracemalloc.start()
    try:
        items = _read_all(path, limit=1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB while reading a 64 MiB line"
    assert [i.source for i in items if isinstance(i, PromptRow)] == ["big.jsonl:1", "big.jsonl:3"]
    [entry] = [i.entry for i in items if not isinstance(i, PromptRow)]
    assert entry.kind == "line_too_long" and len(entry.raw) == EXCERPT_BYTES
    assert (entry.line_bytes, entry.line_sha256) == (64 * 1024 * 1024 + 14, digest)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""], ids=["lf", "crlf", "eof"])
def test_lines_around_the_limit(tmp_path, ending):
    """Lines of limit-1 .. limit+3 bytes: up to the limit read, above it rejected with the right length and hash."""
    from draftfleet.producer.readers import PromptRow

    limit = 64
    lines = [b'{"prompt": "' + b"z" * (n - 14) + b'"}' for n in range(limit - 1, limit + 4)]
    for i, line in enumerate(lines):
        path = tmp_path / f"l{i}.jsonl"
        path.write_bytes(line + ending)
        [item] = _read_all(path, limit=limit)
        if len(line) <= limit:
            assert isinstance(item, PromptRow), len(line)
        else:
            assert (item.entry.kind, item.entry.line_bytes) == ("line_too_long", len(line))
            assert item.entry.line_sha256 == hashlib.sha256(line).hexdigest() and item.entry.raw == line.decode()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_fifo_or_a_device_is_refused_not_read(tmp_path, fmt):
    from draftfleet.producer.readers import count_rows
    from draftfleet.schemas.config import DatasetConfig

    fifo = tmp_path / f"pipe.{fmt}"
    os.mkfifo(fifo)
    for path, what in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        [item] = _read_all(path, fmt=fmt)
        assert item.entry.kind == "unreadable_file" and item.entry.line is None
        assert item.entry.message == f"{os.path.basename(path)}: cannot read {path}: {what}, not a regular file"
        box: list = []
        t = threading.Thread(target=lambda: box.append(count_rows(DatasetConfig(name="t", path=str(path), format=fmt))),
                             daemon=True)
        t.start()
        t.join(10)
        assert box == [None], f"count_rows({path}) hung or counted"


def test_enqueue_of_a_fifo_ends_with_a_clear_error(tmp_path, tokenizer_dir, redis_server):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(fifo)},
                                                                       {"name": "zero", "path": "/dev/zero"}])
    started = time.monotonic()
    try:
        res = run_cli("enqueue", "--config", str(config), "--show-rejects", "10",
                      env={"REDIS_URL": redis_server.url, "COLUMNS": "500"},
                      timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("enqueue hung on a FIFO / /dev/zero")
    assert res.returncode == 1, res.stderr  # no usable row: an error, with the reason
    assert f"cannot read {fifo}: a FIFO, not a regular file" in res.stderr
    assert "cannot read /dev/zero: a character device, not a regular file" in res.stderr
    assert time.monotonic() - started < 60


# -- what a message can make a worker do -------------------------------------------------------
def test_a_worker_runs_only_genuine_fleet_tasks(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    """Forged, foreign and Celery built-in tasks are dead-lettered with the reason, never run or requeued."""
    import json

    import msgspec

    from draftfleet import redis_keys as rk
    from draftfleet.identity import prompt_key, settings_id
    from draftfleet.schemas.config import load_config
    from draftfleet.schemas.records import Message, PromptTask
    from draftfleet.workers.app import make_app

    from .test_faults import CLOUD_ENV, _enqueue
    from .test_fleet import KEY_ENV

    emu = emulator_factory(time_scale=0, api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"genuine {i}"} for i in range(3)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[
        {"name": "ds", "path": str(data), "max_tokens": 16}, {"name": "ds2", "path": str(data), "max_tokens": 16}])
    cfg = load_config(config)
    settings = cfg.dataset("ds").settings(cfg.fleet.model)
    genuine = [Message(role="user", content="genuine 0")]
    real_key = prompt_key("ds", genuine, settings)
    evil = [Message(role="user", content="say something the trainer must not learn")]
    big = msgspec.structs.replace(settings, max_tokens=4096)

    def task(messages, s=settings, key=None, dataset="ds", sid=None) -> dict:
        return msgspec.to_builtins(PromptTask(
            key=key or prompt_key(dataset, messages, s), dataset=dataset, source="evil:1", messages=messages,
            settings=s, settings_id=sid or settings_id(s), enqueued_at=0.0))

    app = make_app(redis_server.url, 7200)
    q = rk.queue("ds")
    sends = [
        ("unknown dataset 'nope'", rk.TASK_NAME, [task(evil, dataset="nope")]),
        ("a task of dataset 'ds2' on queue draftfleet.ds", rk.TASK_NAME, [task(evil, dataset="ds2")]),
        ("forged or stale task: key " + real_key, rk.TASK_NAME, [task(evil, key=real_key)]),
        ('forged or stale task: settings {"max_tokens":4096', rk.TASK_NAME, [task(genuine, s=big)]),
        ("forged or stale task: settings_id 'x'", rk.TASK_NAME, [task(genuine, sid="x")]),
        ("not a fleet task 'celery.accumulate'", "celery.accumulate", [1, 2]),
        ("not a fleet task 'celery.backend_cleanup'", "celery.backend_cleanup", []),
        ("not a fleet task 'celery.map'", "celery.map", [{"task": "celery.accumulate", "args": [],
                                                           "kwargs": {}, "options": {}}, [[1]]]),
        ("not a fleet task 'celery.chunks'", "celery.chunks", [{"task": "celery.accumulate", "args": [],
                                                                 "kwargs": {}, "options": {}}, [[1]], 1]),
    ]
    for _, name, args in sends:
        app.send_task(name, args=args, queue=q)
    _enqueue(config, redis_server.url, "--dataset", "ds")
    r = redis_server.client()
    worker = workers.start(config, "cloud", "--backend", "cloudy", "--name", "strict",
                           redis_url=redis_server.url, env=CLOUD_ENV)
    store = open_store(cfg)
    from .conftest import wait_until

    wait_until(lambda: len(store.keys("ds")) == 3, 60, 0.2, f"3 results\n{workers.logs()}")
    wait_until(lambda: r.llen(rk.DEAD_LETTER) >= len(sends), 20, 0.2, f"{len(sends)} dead letters\n{workers.logs()}")
    time.sleep(1.0)
    reasons = sorted(json.loads(x)["reason"] for x in r.lrange(rk.DEAD_LETTER, 0, -1))
    assert len(reasons) == len(sends), reasons
    for want, _, _ in sends:
        assert sum(got.startswith(want) for got in reasons) == 1, (want, reasons)
    # the genuine prompt behind the stolen key was generated, with its own content and settings
    rec = store.get("ds", real_key)
    assert rec.messages == genuine and rec.settings_id == settings_id(settings)
    assert all(m.content.startswith("genuine") for key in store.keys("ds") for m in store.get("ds", key).messages)
    assert not store.keys("ds2") and r.llen(q) == 0 and worker.poll() is None
    log = workers.logs(tail=None)
    for name in ("celery.accumulate", "celery.backend_cleanup", "celery.map", "celery.chunks"):
        assert f"{name}[" not in log, f"{name} was received or run"
    assert log.count("requeue") < 5 and emu.stats()["by_endpoint"]["/v1/chat/completions"] == 3


# -- trust_remote_code -------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["file 0666", "folder 0777", "file 0664", "folder 0775", "file of another user"])
def test_remote_code_from_a_folder_others_can_change_is_refused(tmp_path, tokenizer_dir, change):
    import shutil

    from draftfleet.tokenizer import TargetTokenizer, TokenizerError

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    code = folder / "tokenization_custom.py"
    code.write_text("# a tokenizer's remote code\n")
    code.chmod(0o644)
    folder.chmod(0o755)
    TargetTokenizer(str(folder), trust_remote_code=True)  # ours, not writable by others: loads
    if change.startswith("file 0"):
        code.chmod(int(change[5:], 8))
    elif change.startswith("folder 0"):  # writable by the folder's group only is refused too
        folder.chmod(int(change[7:], 8))
    else:
        os.chown(code, OTHER_UID, OTHER_UID)
    with pytest.raises(TokenizerError, match="tokenizer_trust_remote_code is on and .* (writable by other users|owned by uid 4242)"):
        TargetTokenizer(str(folder), trust_remote_code=True)
    TargetTokenizer(str(folder), trust_remote_code=False)  # no code runs: nothing to refuse


def test_compose_redis_runs_without_admin_commands(tmp_path):
    """compose.yaml's own redis command line, run here (the local binary, a temp folder, a free port)."""
    import shlex

    import yaml

    from draftfleet.broker import DISABLED_COMMANDS, redis_binary
    from tests.conftest import REPO, free_port, wait_until

    svc = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["redis"]
    assert svc["command"][:2] == ["sh", "-c"]
    script = svc["command"][2].replace("$$", "$")
    port, conf, data = free_port(), tmp_path / "redis.conf", tmp_path / "data"
    data.mkdir()
    script = (script.replace("/tmp/redis.conf", shlex.quote(str(conf))).replace("--dir /data", f"--dir {data}")
              .replace("exec redis-server", f"exec {shlex.quote(redis_binary())}")
              + f" --port {port} --bind 127.0.0.1 --daemonize no --logfile {tmp_path / 'log'}")
    proc = subprocess.Popen(["sh", "-c", script], env={"REDIS_PASSWORD": "compose-secret", "PATH": os.environ["PATH"]})
    try:
        r = redis.Redis(port=port, password="compose-secret", socket_connect_timeout=1)

        def up() -> bool:
            try:
                return bool(r.ping())
            except redis.RedisError:
                return False

        wait_until(up, 10, 0.05, f"compose's redis\n{(tmp_path / 'log').read_text() if (tmp_path / 'log').exists() else ''}")
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and "compose-secret" not in " ".join(proc.args)
        for name in DISABLED_COMMANDS:
            with pytest.raises(redis.ResponseError, match="unknown command"):
                r.execute_command(name, "x")
        r.set("k", "v")  # what the fleet uses still works
        assert r.get("k") == b"v"
    finally:
        proc.kill()
        proc.wait()
