"""``draftfleet worker gpu --gpu 0,1``: one worker and one launched SGLang server per GPU.

``sglang.launch_server`` is replaced (via PYTHONPATH) by a stand-in that serves the emulator on
the port it is given and records CUDA_VISIBLE_DEVICES, so the whole launch path runs unchanged:
the per-GPU fan-out, the launcher's health wait, the worker's /generate calls, shutdown.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from draftfleet.schemas.config import load_config
from draftfleet.store import Store

from .conftest import REPO, wait_until, write_jsonl
from .test_fleet import _chat_rows, _enqueue

pytestmark = pytest.mark.slow

FAKE_LAUNCH = textwrap.dedent(
    """
    import argparse, json, os
    from draftfleet.emulator import EmulatorConfig, serve

    p = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--port", "--tp-size"):
        p.add_argument(flag, required=True)
    args, _ = p.parse_known_args()
    with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], f"gpu{os.environ['CUDA_VISIBLE_DEVICES']}.json"), "w") as f:
        json.dump({"cuda": os.environ["CUDA_VISIBLE_DEVICES"], "port": args.port, "tp": args.tp_size}, f)
    serve(EmulatorConfig(tokenizer=os.environ["FAKE_TOKENIZER"], model=args.model_path, single_stream_tps=2000,
                         ceiling_tps=100000, length="uniform:5:40", ttft_s=0.0), args.host, int(args.port))
    """
)


def _free_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def test_one_worker_and_server_per_gpu(tmp_path, redis_server, tokenizer_dir):
    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "launch_server.py").write_text(FAKE_LAUNCH)
    marks = tmp_path / "marks"
    marks.mkdir()
    base = _free_pair()
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(40))
    config = tmp_path / "fleet.toml"
    config.write_text(textwrap.dedent(f"""
        [fleet]
        store = "{tmp_path / 'store'}"
        model = "test/chatml"
        tokenizer = "{tokenizer_dir}"

        [[datasets]]
        name = "ds"
        path = "{data}"
        max_tokens = 64

        [backends.sglang]
        inflight = 8
        request_timeout_s = 30.0

        [backends.sglang.launch]
        model_path = "fake/model"
        tp = 1
        port_base = {base}
        startup_timeout_s = 60.0
    """))
    env = {"REDIS_URL": redis_server.url, "PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "FAKE_SGLANG_DIR": str(marks),
           "FAKE_TOKENIZER": str(tokenizer_dir), "PATH": "/usr/bin:/bin"}
    log = open(tmp_path / "workers.log", "wb")
    parent = subprocess.Popen([sys.executable, "-m", "draftfleet", "worker", "gpu", "--config", str(config),
                               "--gpu", "0,1"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        r = redis_server.client()
        logs = lambda: (tmp_path / "workers.log").read_text(errors="replace")[-5000:]  # noqa: E731
        wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2, 90, 0.2, f"two workers\n{logs()}")
        assert _enqueue(config, redis_server.url)[0]["queued"] == 40
        store = Store(load_config(config).fleet.store)
        wait_until(lambda: len(store.keys("ds")) == 40, 60, 0.2, f"40 results\n{logs()}")
        servers = {json.loads(p.read_text())["cuda"]: json.loads(p.read_text()) for p in marks.glob("*.json")}
        assert {k: int(v["port"]) for k, v in servers.items()} == {"0": base, "1": base + 1}
        workers = Counter(rec.worker.split("@")[0] for rec in store.records("ds"))
        assert set(workers) == {"gpu0", "gpu1"} and sum(workers.values()) == 40
        assert {rec.model for rec in store.records("ds")} == {"fake/model"}
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)
    # every child and every launched server is gone: nothing listens on their ports any more
    for port in (base, base + 1):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
            s.bind(("127.0.0.1", port))
