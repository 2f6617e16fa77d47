"""``draftfleet flower`` as a subprocess on a private Redis, with a real GPU worker on the emulator.

Flower facts these pin down (Flower 2.x): basic auth guards the pages and ``/api/*``;
``/metrics`` and ``/healthcheck`` answer without it; with no auth at all ``/api/*`` still answers
401 unless ``FLOWER_UNAUTHENTICATED_API`` is set.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import REPO, RedisServer, free_port, wait_until, write_config, write_jsonl

pytestmark = pytest.mark.slow

USER, PASSWORD = "ops", "flower-pw-7f3c9a"
REDIS_PASSWORD = "redis-pw-51d2e8"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_") and k != "REDIS_URL"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class FlowerProc:
    """``python -m draftfleet flower`` in the background, its output in a file."""

    def __init__(self, folder: Path, config: Path, redis_url: str, *args: str, env: dict):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"flower-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "draftfleet", "flower", "--config", str(config), "--redis-url", redis_url,
                 "--port", str(self.port), *args],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def get(self, path: str, auth: tuple[str, str] | None = None) -> httpx.Response:
        return httpx.get(self.base + path, auth=auth, timeout=10)

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.log()
            try:
                return self.get("/healthcheck").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 30, 0.1, "flower to answer")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def secured_redis(tmp_path):
    server = RedisServer(tmp_path / "redis", password=REDIS_PASSWORD)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def flowers():
    started: list[FlowerProc] = []

    def start(*args, **kwargs) -> FlowerProc:
        f = FlowerProc(*args, **kwargs)
        started.append(f)
        return f

    yield start
    for f in started:
        f.stop()


@pytest.fixture
def config(tmp_path, tokenizer_dir, emulator_factory):
    emu = emulator_factory(single_stream_tps=5000, ceiling_tps=100000, length="fixed:10", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"question {i}"} for i in range(4)])
    return write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                        datasets=[{"name": "ds", "path": str(data), "max_tokens": 32}])


def test_flower_needs_auth_lists_the_worker_and_serves_metrics(tmp_path, secured_redis, config, workers, flowers):
    worker = workers.start(config, "gpu", "--name", "flowertest", redis_url=secured_redis.url)
    flower = flowers(tmp_path, config, secured_redis.url, env=_env(FLOWER_BASIC_AUTH=f"{USER}:{PASSWORD}"))
    flower.wait_up()

    for path in ("/", "/workers", "/tasks", "/broker", "/api/workers", "/api/tasks", "/api/queues/length"):
        assert flower.get(path).status_code == 401, path
        assert flower.get(path, auth=(USER, "wrong")).status_code == 401, path
        assert flower.get(path, auth=("someone", PASSWORD)).status_code == 401, path
    assert flower.get("/", auth=(USER, PASSWORD)).status_code == 200

    found: dict = {}

    def listed() -> bool:
        assert worker.poll() is None, workers.logs()
        res = flower.get("/api/workers?refresh=1", auth=(USER, PASSWORD))
        assert res.status_code == 200, res.text
        found.update(res.json())
        return any(name.startswith("flowertest@") for name in found)

    wait_until(listed, 60, 0.5, f"the worker in /api/workers\n{flower.log()}\n{workers.logs()}")
    name = next(n for n in found if n.startswith("flowertest@"))
    assert [q["name"] for q in found[name]["active_queues"]] == ["draftfleet.ds"]

    # /metrics is open (Flower never authenticates it) and speaks Prometheus text
    def metrics_name_the_worker() -> bool:
        res = flower.get("/metrics")
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
        return f'flower_worker_online{{worker="{name}"}} 1.0' in res.text

    wait_until(metrics_name_the_worker, 30, 0.5, "the worker online in /metrics")
    assert "# TYPE flower_events_total counter" in flower.get("/metrics").text

    # the Redis password shows nowhere: not in the workers' conf that Flower relays, nor its pages
    for path in ("/api/workers", f"/worker/{name}", "/workers", "/broker", "/tasks"):
        res = flower.get(path, auth=(USER, PASSWORD))
        assert res.status_code == 200 and REDIS_PASSWORD not in res.text, path

    # control is off unless --allow-control: authenticated callers are refused too
    res = httpx.post(f"{flower.base}/api/worker/shutdown/{name}", auth=(USER, PASSWORD), timeout=10)
    assert res.status_code == 403 and "Read only" in res.text
    assert worker.poll() is None

    assert flower.stop() == 0
    text = flower.log()
    assert "Flower at http://127.0.0.1" in text and "basic auth" in text
    assert "redis://:***@127.0.0.1" in text
    for secret in (PASSWORD, REDIS_PASSWORD):
        assert secret not in text
        assert secret not in workers.logs(tail=None)


def test_flower_refuses_to_start_without_auth(tmp_path, config):
    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "draftfleet", "flower", "--config", str(config),
                               "--redis-url", "redis://127.0.0.1:1/0", *args],
                              capture_output=True, text=True, env=_env(COLUMNS="200", **env), timeout=60, cwd=REPO)

    res = run()
    assert res.returncode == 2
    assert "Flower needs authentication: set FLOWER_BASIC_AUTH=user:password" in res.stderr
    assert "--no-auth" in res.stderr

    res = run(FLOWER_BASIC_AUTH="   ")
    assert res.returncode == 2 and "Flower needs authentication" in res.stderr

    res = run("--basic-auth-env", "FLEET_UI_AUTH", FLOWER_BASIC_AUTH=f"{USER}:{PASSWORD}")
    assert res.returncode == 2 and "set FLEET_UI_AUTH=user:password" in res.stderr

    res = run(FLOWER_BASIC_AUTH=f"{USER}:{PASSWORD},just-a-password-{PASSWORD}")
    assert res.returncode == 2 and "FLOWER_BASIC_AUTH: entry 2 is not of the form user:password" in res.stderr
    assert PASSWORD not in res.stdout + res.stderr


def test_flower_named_variable_and_several_users(tmp_path, redis_server, config, flowers):
    flower = flowers(tmp_path, config, redis_server.url, "--basic-auth-env", "FLEET_UI_AUTH",
                     env=_env(FLEET_UI_AUTH=f"{USER}:{PASSWORD}, viewer:other-pw"))
    flower.wait_up()
    assert flower.get("/api/workers").status_code == 401
    assert flower.get("/api/workers", auth=(USER, PASSWORD)).status_code == 200
    assert flower.get("/api/workers", auth=("viewer", "other-pw")).status_code == 200
    assert flower.stop() == 0
    assert "2 user(s)" in flower.log() and PASSWORD not in flower.log() and "other-pw" not in flower.log()


def test_flower_no_auth_is_explicit_and_loud(tmp_path, redis_server, config, flowers):
    flower = flowers(tmp_path, config, redis_server.url, "--no-auth", env=_env())
    flower.wait_up()
    assert flower.get("/").status_code == 200
    # Flower itself keeps its API closed without auth unless FLOWER_UNAUTHENTICATED_API is set
    assert flower.get("/api/workers").status_code == 401
    assert flower.get("/metrics").status_code == 200
    assert flower.stop() == 0
    assert "WITHOUT authentication" in flower.log()


def test_flower_task_rows_name_the_dataset_and_format_rejected(tmp_path, redis_server, tokenizer_dir):
    """What Flower shows as a task's args is the argsrepr enqueue sends: the dataset and the prompt's
    file:line (the uuid is only the key). A rejected (given back, later succeeded) task's time is a
    date through Flower's own formatter, not the raw epoch its template prints."""
    import json
    import time

    from celery.events.state import Task

    from draftfleet.views.monitor import format_task

    from .conftest import run_cli

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "B3_magicoder", "path": str(data)}])
    cp = run_cli("enqueue", "--config", str(config), "--redis-url", redis_server.url, "--json")
    assert cp.returncode == 0, cp.stderr
    (body,) = redis_server.client().lrange("draftfleet.B3_magicoder", 0, -1)
    assert json.loads(body)["headers"]["argsrepr"] == "['B3_magicoder', 'prompts.jsonl:1']"
    from draftfleet.schemas.config import load_config
    from draftfleet.store import open_store

    (event,) = open_store(load_config(config)).events("B3_magicoder")  # the budget it published, for the report
    assert (event.kind, event.budget_tokens, event.note) == ("budget", None, "enqueue")

    at = time.time()
    task = format_task(Task(uuid="k" * 64, rejected=at, succeeded=at + 5))
    assert isinstance(task.rejected, str) and time.strftime("%Y-%m-%d", time.gmtime(at)) in task.rejected
    assert "given back to its queue" in task.rejected and task.succeeded == at + 5
