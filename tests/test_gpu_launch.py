"""``draftfleet worker gpu --gpu 0,1``: one worker and one launched SGLang server per GPU.

``sglang.launch_server`` is replaced (via PYTHONPATH) by a stand-in that serves the emulator on
the port it is given and records CUDA_VISIBLE_DEVICES, so the whole launch path runs unchanged:
the per-GPU fan-out, the launcher's health wait, the worker's /generate calls, shutdown.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from draftfleet.schemas.config import load_config
from draftfleet.store import Store, open_store

from .conftest import REPO, wait_until, write_jsonl
from .test_fleet import _chat_rows, _enqueue
from .test_launcher import fake_engines

pytestmark = pytest.mark.slow

FAKE_LAUNCH = textwrap.dedent(
    """
    import argparse, json, os
    from draftfleet.devtools.emulator import EmulatorConfig, serve

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


def _config(tmp_path: Path, tokenizer_dir: Path, prompts: int, backends: str) -> Path:
    """A fleet.toml with one dataset of ``prompts`` chat prompts and the given backend tables."""
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(prompts))
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
    """) + textwrap.dedent(backends))
    return config


def _fake_sglang_fleet(tmp_path: Path, tokenizer_dir: Path, prompts: int, sglang: str) -> tuple[Path, dict, Path, int]:
    """A config whose ``[backends.sglang]`` (``sglang``: its settings) launches servers that are the
    emulator (``FAKE_LAUNCH``), each leaving a mark of its GPU and port: the config, the env a
    worker needs to launch them, the marks folder and the first port."""
    site = fake_engines(tmp_path, FAKE_LAUNCH)
    marks = tmp_path / "marks"
    marks.mkdir()
    base = _free_pair()
    config = _config(tmp_path, tokenizer_dir, prompts, f"[backends.sglang]\n{sglang}\n\n[backends.sglang.launch]\n"
                     f'model_path = "fake/model"\ntp = 1\nport_base = {base}\nstartup_timeout_s = 60.0\n')
    env = {"PYTHONPATH": f"{site}:{REPO}", "FAKE_SGLANG_DIR": str(marks), "FAKE_TOKENIZER": str(tokenizer_dir)}
    return config, env, marks, base


def _run_on_two_gpus(tmp_path: Path, redis_server, config: Path, env: dict, flags: list[str], prompts: int,
                     ports: tuple[int, int]) -> Store:  # fmt: skip
    """``worker gpu --config C FLAGS`` (two GPU groups): wait for both workers, enqueue, wait for
    every result, stop the parent with SIGTERM, and check nothing listens on the servers' ports.

    Both workers consume before the enqueue (Celery's "<hostname> ready." line of each), so that
    each gets some of the prompts: a worker's report is there earlier, from the moment it waits
    for its server, and on a loaded machine one server came up so late that the other worker had
    done all the prompts by then."""
    log = open(tmp_path / "workers.log", "wb")
    parent = subprocess.Popen([sys.executable, "-m", "draftfleet", "worker", "gpu", "--config", str(config), *flags],
                              env={"REDIS_URL": redis_server.url, "PATH": "/usr/bin:/bin", **env}, stdout=log,
                              stderr=subprocess.STDOUT, cwd=REPO)
    store = open_store(load_config(config))
    try:
        r = redis_server.client()
        logs = lambda: (tmp_path / "workers.log").read_text(errors="replace")[-5000:]  # noqa: E731
        ready = lambda: set(re.findall(r"/celery\.apps\.worker\] (\S+) ready\.$",  # noqa: E731
                                       (tmp_path / "workers.log").read_text(errors="replace"), re.M))
        wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2 and len(ready()) == 2, 120, 0.2,
                   f"two workers consuming\n{logs()}")
        assert _enqueue(config, redis_server.url)[0]["queued"] == prompts
        wait_until(lambda: len(store.keys("ds")) == prompts, 60, 0.2, f"{prompts} results\n{logs()}")
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)
    # every child and every launched server is gone: nothing listens on their ports any more
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
            s.bind(("127.0.0.1", port))
    return store


def test_one_worker_and_server_per_gpu(tmp_path, redis_server, tokenizer_dir):
    config, env, marks, base = _fake_sglang_fleet(tmp_path, tokenizer_dir, 40, "inflight = 8\nrequest_timeout_s = 30.0")
    store = _run_on_two_gpus(tmp_path, redis_server, config, env, ["--gpu", "0,1"], 40, (base, base + 1))
    servers = {json.loads(p.read_text())["cuda"]: json.loads(p.read_text()) for p in marks.glob("*.json")}
    assert {k: int(v["port"]) for k, v in servers.items()} == {"0": base, "1": base + 1}
    workers = Counter(rec.worker.split("@")[0] for rec in store.records("ds"))
    assert set(workers) == {"gpu0", "gpu1"} and sum(workers.values()) == 40
    assert {rec.model for rec in store.records("ds")} == {"fake/model"}

FAKE_VLLM = textwrap.dedent(
    """
    import argparse, json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["serve"])
    p.add_argument("model")
    for flag in ("--host", "--port", "--tensor-parallel-size"):
        p.add_argument(flag, required=True)
    args, _ = p.parse_known_args()
    marks = os.environ["FAKE_SGLANG_DIR"]
    with open(os.path.join(marks, f"gpu{os.environ['CUDA_VISIBLE_DEVICES']}.json"), "w") as f:
        json.dump({"cuda": os.environ["CUDA_VISIBLE_DEVICES"], "port": args.port, "argv": sys.argv[1:]}, f)
    EOT = int(os.environ["FAKE_EOT"])
    DIES = os.environ.get("FAKE_VLLM_DIES")  # a mark: the first server to be asked dies as vLLM's CPU engine did
    dead, LOCK = [], __import__("threading").Lock()

    def dies(handler):
        # where no server died yet: say in the log what vLLM does when its worker proc hits SIGILL,
        # answer EngineDeadError (HTTP 500) to this request and any other, then die of SIGILL
        import resource, signal, threading
        with LOCK:
            if not dead and (not DIES or os.path.exists(DIES)):
                return False
            first = not dead
            dead.append(1)
        if first:
            open(DIES, "x").close()
            print("(EngineCore pid=%d) ERROR [multiproc_executor.py:154] Worker proc VllmWorker-0 died unexpectedly "
                  "(exit code: -4), shutting down executor." % os.getpid(), flush=True)
            print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGILL)).start()
        raw = json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                               "root cause.", "type": "InternalServerError", "param": None,
                                    "code": 500}}).encode()
        handler.send_response(500)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)
        return True

    class Handler(BaseHTTPRequestHandler):
        def _send(self, payload):
            raw = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send({"data": [{"id": "served/" + args.model}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if dies(self):
                return
            ids = body["prompt"][-6:] + [EOT]  # a reply that says which prompt it answers
            with open(os.path.join(marks, f"requests-{args.port}.jsonl"), "a") as f:
                f.write(json.dumps(body) + "\\n")
            self._send({"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "stop_reason": None,
                                     "token_ids": ids, "prompt_token_ids": body["prompt"]}],
                        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
    """
)


def test_engine_vllm_one_worker_and_vllm_serve_per_gpu(tmp_path, redis_server, tokenizer_dir, target_tokenizer):
    """``--engine vllm --gpu 0,1`` with both engines configured: the engine reaches every child,
    each launches ``vllm serve`` (the script beside the configured python) on its GPU and port.
    The stand-in answers like vLLM with ids derived from the prompt, so the stored ids show which
    prompt ids the worker sent."""
    fake_engines(tmp_path, FAKE_VLLM)
    marks = tmp_path / "marks"
    marks.mkdir()
    base = _free_pair()
    config = _config(tmp_path, tokenizer_dir, 30, f"""
        [backends.sglang]
        urls = ["http://127.0.0.1:1"]

        [backends.vllm]
        inflight = 8
        request_timeout_s = 30.0

        [backends.vllm.launch]
        model_path = "/models/tiny"
        port_base = {base}
        python = "{tmp_path / 'bin' / 'python'}"
        extra_args = ["--max-model-len", "2048"]
        startup_timeout_s = 60.0
    """)
    env = {"PYTHONPATH": str(REPO), "FAKE_SGLANG_DIR": str(marks), "FAKE_EOT": str(target_tokenizer.eot_id)}
    store = _run_on_two_gpus(tmp_path, redis_server, config, env, ["--engine", "vllm", "--gpu", "0,1"], 30,
                             (base, base + 1))
    servers = {json.loads(p.read_text())["cuda"]: json.loads(p.read_text()) for p in marks.glob("gpu*.json")}
    assert {k: int(v["port"]) for k, v in servers.items()} == {"0": base, "1": base + 1}
    assert servers["1"]["argv"] == ["serve", "/models/tiny", "--host", "127.0.0.1", "--port", str(base + 1),
                                    "--tensor-parallel-size", "1", "--max-model-len", "2048"]
    records = list(store.records("ds"))
    assert Counter(rec.worker.split("@")[0] for rec in records).keys() == {"gpu0", "gpu1"}
    for rec in records:
        prompt = target_tokenizer.prompt_ids(rec.messages)
        assert rec.output_ids == prompt[-6:] + [target_tokenizer.eot_id]
        assert (rec.backend, rec.model, rec.token_source, rec.prompt_tokens) == ("vllm", "served//models/tiny",
                                                                                 "exact", len(prompt))
    sent = [json.loads(line) for port in (base, base + 1) for line in (marks / f"requests-{port}.jsonl").open()]
    assert len(sent) == 30 and all(b["return_token_ids"] and b["stop_token_ids"] == [target_tokenizer.eot_id]
                                   for b in sent)


def test_a_launched_vllm_that_dies_is_said_in_one_line_and_its_worker_pauses_until_it_is_back(
        tmp_path, redis_server, tokenizer_dir, target_tokenizer):
    """Issue 42: vLLM's CPU engine hit SIGILL on its first request; its API server answered
    EngineDeadError (HTTP 500) and died. The generation worker says so once, in one line, with the
    exit and the signal named and the engine log's last lines, pauses as for a server gone (nothing
    failed), and once the supervisor's new server answers, every prompt is done."""
    fake_engines(tmp_path, FAKE_VLLM)
    marks = tmp_path / "marks"
    marks.mkdir()
    base = _free_pair()
    config = _config(tmp_path, tokenizer_dir, 12, f"""
        [backends.vllm]
        inflight = 4
        request_timeout_s = 30.0

        [backends.vllm.launch]
        model_path = "/models/tiny"
        port_base = {base}
        python = "{tmp_path / 'bin' / 'python'}"
        startup_timeout_s = 60.0
    """).read_text()
    (tmp_path / "fleet.toml").write_text(config.replace("[fleet]\n", "[fleet]\nmax_attempts = 2\n", 1))
    env = {"PYTHONPATH": str(REPO), "FAKE_SGLANG_DIR": str(marks), "FAKE_EOT": str(target_tokenizer.eot_id),
           "FAKE_VLLM_DIES": str(marks / "died"), "REDIS_URL": redis_server.url, "PATH": "/usr/bin:/bin"}
    out = tmp_path / "workers.log"
    parent = subprocess.Popen([sys.executable, "-m", "draftfleet", "worker", "gpu", "--config",
                               str(tmp_path / "fleet.toml"), "--engine", "vllm", "--gpu", "0"], env=env,
                              stdout=out.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
    store = open_store(load_config(tmp_path / "fleet.toml"))
    logs = lambda: out.read_text(errors="replace")  # noqa: E731
    try:
        wait_until(lambda: re.search(r"/celery\.apps\.worker\] \S+ ready\.$", logs(), re.M), 120, 0.2,
                   f"a worker consuming\n{logs()[-5000:]}")
        assert _enqueue(tmp_path / "fleet.toml", redis_server.url)[0]["queued"] == 12
        wait_until(lambda: len(store.keys("ds")) == 12, 120, 0.2, f"12 results\n{logs()[-5000:]}")
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)
    text = logs()
    assert (marks / "died").exists() and not store.failures("ds")
    [said] = [ln for ln in text.splitlines() if " died: vLLM server on GPU(s) [0] (pid " in ln]
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -4 (SIGILL))" in said, said
    assert "EngineDeadError: EngineCore encountered an issue." in said.partition("; last lines of ")[2], said
    # the pause: a server gone, with what it answered or how it ended
    pause = text[text.index("STOPPED CONSUMING draftfleet.ds: server_down"):].splitlines()[1]
    assert "answered that its engine died" in pause or "exited with code -4 (SIGILL)" in pause, pause
    assert "-4 (SIGILL)" in pause, pause
    assert re.search(r"vLLM server on GPU\(s\) \[0\] \(pid \d+\) exited with code -4 \(SIGILL\); its log says: ", text)
    assert "resuming after a pause" in text and "not a capture engine" not in text
