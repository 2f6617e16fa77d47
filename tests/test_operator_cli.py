"""The operator's view from the command line: clear one-line errors, help on every flag, a private
Redis that one-shot commands do not leave behind, ``--store`` alone, workers that say what they wait for."""

from __future__ import annotations

import argparse
import ast
import json
import socket
import time

import pytest
import redis

from draftfleet import broker
from draftfleet.broker import STATE_DIR, EmbeddedRedis, unreachable
from draftfleet.cli import build_parser
from draftfleet.schemas.records import DatasetManifest, GenerationSettings
from draftfleet.store import open_store

from tests.conftest import REPO, free_port, run_cli, wait_until, write_config, write_jsonl

NO_REDIS_ENV = {"REDIS_URL": "", "DRAFTFLEET_CONFIG": ""}


def test_version_and_help_on_every_flag():
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("draftfleet ")
    missing = []

    def walk(parser, prefix):  # every subcommand, also nested ones (worker gpu, worker cloud...)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sp in action.choices.items():
                    missing.extend(f"{prefix}{name} {a.option_strings or a.dest}" for a in sp._actions
                                   if not isinstance(a, argparse._HelpAction) and not a.help)
                    walk(sp, f"{prefix}{name} ")

    walk(build_parser(), "")
    assert not missing, missing


def test_imports_name_the_installed_package():
    """No relative import in the package's folders: a reader of workers/ sees draftfleet.store."""
    relative = []
    for folder in ("draftfleet", "workers", "producer", "schemas"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    relative.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not relative, relative


def _config(tmp_path, tokenizer_dir, path=None, emulator_url="http://127.0.0.1:9"):
    data = path or write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    return write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emulator_url,
                        datasets=[{"name": "ds", "path": str(data), "max_tokens": 8}])


def test_missing_dataset_path_is_an_error_naming_it(tmp_path, tokenizer_dir, redis_server):
    missing = tmp_path / "typo" / "prompts.jsonl"
    config = _config(tmp_path, tokenizer_dir, path=missing)
    res = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url})
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(missing) in errors[0] and "does not exist" in errors[0], res.stderr
    assert not (tmp_path / "store" / "_quarantine").exists() and not (tmp_path / "store" / "ds").exists()


def test_bad_scheme_and_unreachable_redis_are_one_line(tmp_path, tokenizer_dir):
    config = _config(tmp_path, tokenizer_dir)
    for url, want in (("http://127.0.0.1:6379/0", "REDIS_URL: scheme 'http:', not a Redis URL"),
                      ("//127.0.0.1:6379", "REDIS_URL: no scheme, not a Redis URL"),
                      (f"redis://127.0.0.1:{free_port()}/0", "connection refused")):
        res = run_cli("status", "--config", str(config), env={"REDIS_URL": url})
        assert res.returncode == 1, (url, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0] and "Traceback" not in res.stderr, (url, res.stderr)


def test_a_server_that_never_answers_is_a_timeout(monkeypatch):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # the kernel accepts the connection; nothing ever replies
    try:
        monkeypatch.setattr(broker, "REPLY_TIMEOUT_S", 0.5)
        client = broker.connect(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        t0 = time.monotonic()
        with pytest.raises(redis.TimeoutError) as info:
            client.ping()
        assert time.monotonic() - t0 < 5
        assert unreachable(info.value).startswith("timed out")
    finally:
        silent.close()


def test_one_shot_commands_stop_the_private_redis_they_started(tmp_path, tokenizer_dir):
    config = _config(tmp_path, tokenizer_dir)
    store = tmp_path / "store"
    emb = EmbeddedRedis(store / STATE_DIR)
    settings = GenerationSettings(model="m", max_tokens=8, temperature=0.0, top_p=1.0)
    open_store(store).write_manifest(DatasetManifest(name="ds", version=1, settings=settings, settings_id="s",
                                                budget_tokens=None, created_at=time.time()))
    for args in (["status", "--config", str(config)], ["reconcile", "--config", str(config)],
                 ["reconcile", "--store", str(store)], ["failures", "--store", str(store)],
                 ["drain", "--kind", "gpu", "--store", str(store), "--json"]):
        res = run_cli(*args, env=NO_REDIS_ENV)
        assert res.returncode == 0, (args, res.stderr)
        assert emb.running_url() is None, f"{args} left the private Redis running"
    assert json.loads(res.stdout)["drain"]["assignment"] == {"ds": ["cloud"]}  # the store's datasets
    res = run_cli("reconcile", "--store", str(store), "--dataset", "nope", env=NO_REDIS_ENV)
    assert res.returncode == 2 and "unknown dataset(s) nope" in res.stderr
    # started on purpose (--store alone, no fleet.toml): one-shot commands leave it running
    res = run_cli("redis", "start", "--store", str(store), env=NO_REDIS_ENV)
    assert res.returncode == 0, res.stderr
    try:
        assert emb.running_url() is not None
        assert run_cli("status", "--config", str(config), env=NO_REDIS_ENV).returncode == 0
        assert emb.running_url() is not None
    finally:
        assert run_cli("redis", "stop", "--store", str(store), env=NO_REDIS_ENV).stdout.strip() == "stopped"


def test_release_keeps_a_server_someone_else_uses(tmp_path):
    store = tmp_path / "store"
    url = broker.resolve_redis_url(None, None, store)
    other = redis.Redis.from_url(url)
    other.ping()
    try:
        assert broker.release_embedded() == []
        assert EmbeddedRedis(store / STATE_DIR).running_url() == url
    finally:
        other.close()
        EmbeddedRedis(store / STATE_DIR).stop()


def test_cloud_worker_uses_the_only_cloud_backend(tmp_path, tokenizer_dir, redis_server):
    config = _config(tmp_path, tokenizer_dir)
    # no API key in the environment: the error shows which backend it chose without --backend
    res = run_cli("worker", "cloud", "--config", str(config), env={"REDIS_URL": redis_server.url,
                                                                   "DRAFTFLEET_TEST_KEY": ""})
    assert res.returncode == 2
    assert "backend 'cloudy'" in res.stderr and "DRAFTFLEET_TEST_KEY" in res.stderr, res.stderr


def test_a_worker_waiting_for_its_server_shows_in_status(tmp_path, tokenizer_dir, redis_server, workers):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens yet: SGLang still loading
    config = _config(tmp_path, tokenizer_dir, emulator_url=url)
    env = {"REDIS_URL": redis_server.url}
    workers.start(config, "gpu", "--url", url, "--name", "slowstart", redis_url=redis_server.url)

    def waiting():
        res = run_cli("status", "--config", str(config), "--json", env=env)
        return [w for w in json.loads(res.stdout)["workers"] if w["waiting"]]

    wait_until(lambda: bool(waiting()), 60, 0.5, workers.logs())
    [w] = waiting()
    assert w["hostname"].startswith("slowstart@") and url in w["waiting"]
    res = run_cli("status", "--config", str(config), env={**env, "COLUMNS": "200"})
    assert f"waiting for SGLang at {url}" in res.stdout


def test_flower_broker_tab_lists_every_dataset_queue(tmp_path, tokenizer_dir, emulator_factory, workers):
    """Read-only Flower (the default) lists the queue of a dataset no worker consumes, with its depth."""
    from draftfleet import redis_keys as rk
    from tests.conftest import RedisServer
    from tests.test_flower import FlowerProc, _env

    server = RedisServer(tmp_path / "redis")
    server.start()
    flower = None
    try:
        emu = emulator_factory(single_stream_tps=5000, ceiling_tps=100000, length="fixed:10", ttft_s=0.0)
        data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}"} for i in range(3)])
        config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                              datasets=[{"name": "ds", "path": str(data), "max_tokens": 32},
                                        {"name": "other", "path": str(data), "max_tokens": 32}])
        res = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": server.url})
        assert res.returncode == 0, res.stderr
        workers.start(config, "gpu", "--dataset", "ds", "--name", "onlyds", redis_url=server.url)
        flower = FlowerProc(tmp_path, config, server.url, env=_env(FLOWER_BASIC_AUTH="ops:pw-9d1e"))
        flower.wait_up()
        auth = ("ops", "pw-9d1e")

        def lengths() -> dict[str, int]:
            res = flower.get("/api/queues/length", auth=auth)
            assert res.status_code == 200, res.text
            return {q["name"]: q["messages"] for q in res.json()["active_queues"]}

        wait_until(lambda: lengths().get(rk.queue("ds")) == 0, 60, 0.5, "the worker to empty ds")
        assert lengths()[rk.queue("other")] == 3
        page = flower.get("/broker", auth=auth)
        assert page.status_code == 200 and rk.queue("other") in page.text and rk.queue("ds") in page.text
        assert "read only" in flower.log() or "control off" in flower.log()
    finally:
        if flower is not None:
            flower.stop()
        server.stop()


def test_worker_logs_one_line_per_prompt_and_no_traceback_for_pauses(tmp_path, tokenizer_dir, redis_server,
                                                                      emulator_factory, workers):
    from draftfleet.schemas.config import load_config

    emu = emulator_factory(single_stream_tps=5000, ceiling_tps=100000, length="fixed:10", ttft_s=0.0,
                           api_key="the-right-key")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}"} for i in range(5)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 32}])
    assert run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url}).returncode == 0
    # a cloud worker whose key is refused: it pauses and requeues what it took, without tracebacks
    cloud = workers.start(config, "cloud", redis_url=redis_server.url, env={"DRAFTFLEET_TEST_KEY": "a-wrong-key"})
    wait_until(lambda: "STOPPED CONSUMING" in workers.logs(tail=None), 60, 0.3, workers.logs())
    workers.stop(cloud)
    paused_log = workers.logs(tail=None)
    assert "Traceback" not in paused_log and "a-wrong-key" not in paused_log
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) == 5, 60, 0.2, workers.logs())
    time.sleep(0.5)
    log = workers.logs(tail=None)[len(paused_log):]
    stored = [line for line in log.splitlines() if "INFO/" in line and "stored ds " in line]
    assert len(stored) == 5, log
    assert all(" tokens from sglang in " in line and line.rstrip().endswith(", attempt 1)") for line in stored), stored
    assert "] received" not in log and "] succeeded in" not in log, log
    assert "Traceback" not in log
