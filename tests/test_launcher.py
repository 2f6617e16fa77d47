"""EngineServer against fake engines (stdlib HTTP, no GPU), plus gpu_groups.

One fake plays both ``python -m sglang.launch_server`` and the ``vllm serve`` script. It records
its argv, CUDA_VISIBLE_DEVICES and pids in ``$FAKE_SGLANG_DIR/<pid>.json`` and the paths it was
probed on in ``<pid>.paths``, and starts a helper child in its process group, as the engines start
their scheduler / engine-core processes, so the tests can check that a stop or a restart takes
the whole group down.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from draftfleet.schemas.config import SGLangLaunch, VLLMLaunch
from draftfleet.workers.launcher import EngineServer, LaunchError, gpu_groups, port_for

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    vllm = sys.argv[1:2] == ["serve"]
    if vllm:  # vllm serve MODEL --host H --port P --tensor-parallel-size N
        parser.add_argument("command", choices=["serve"])
        parser.add_argument("model_path")
    for flag in ("--host", "--port", "--tensor-parallel-size") if vllm else ("--model-path", "--host", "--port", "--tp-size"):
        parser.add_argument(flag, required=True)
    args, _ = parser.parse_known_args()
    slow_file = os.environ.get("FAKE_HEALTH_DELAY_FILE")  # holds the seconds each probe takes
    delay = float(os.environ.get("FAKE_SGLANG_STARTUP_DELAY", "0"))
    exit_after = os.environ.get("FAKE_SGLANG_EXIT_AFTER")
    crash_file = os.environ.get("FAKE_SGLANG_CRASH_FILE")
    sigill_file = os.environ.get("FAKE_ENGINE_SIGILL_FILE")  # then die as vLLM's AMX kernels do without the state
    ready_at = time.monotonic() + delay

    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    info = {"argv": sys.argv[1:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "helper": helper.pid}
    with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(info, f)

    def die(after):
        time.sleep(after)
        print("RuntimeError: CUDA out of memory (fake)", file=sys.stderr, flush=True)
        os._exit(3)

    def watch(path):
        while not os.path.exists(path):
            time.sleep(0.05)
        os.remove(path)
        die(0)

    def sigill(path):
        import resource, signal
        while not os.path.exists(path):
            time.sleep(0.05)
        os.remove(path)
        print("(EngineCore pid=%d) ERROR [multiproc_executor.py:154] Worker proc VllmWorker-0 died unexpectedly "
              "(exit code: -4), shutting down executor." % os.getpid(), flush=True)
        print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.kill(os.getpid(), signal.SIGILL)

    if sigill_file:
        threading.Thread(target=sigill, args=(sigill_file,), daemon=True).start()
    if exit_after is not None:
        threading.Thread(target=die, args=(float(exit_after),), daemon=True).start()
    if crash_file:
        threading.Thread(target=watch, args=(crash_file,), daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], f"{os.getpid()}.paths"), "a") as f:
                f.write(self.path + "\\n")
            if slow_file and os.path.exists(slow_file):
                time.sleep(float(open(slow_file).read()))
            no_generate = vllm or os.environ.get("FAKE_SGLANG_NO_HEALTH_GENERATE")
            known = {"/health"} if no_generate else {"/health", "/health_generate"}
            code = 404 if self.path not in known else 200 if time.monotonic() >= ready_at else 503
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    print(f"fake {'vllm' if vllm else 'sglang'} serving {args.model_path} on {args.host}:{args.port}", flush=True)
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
    """
)


def fake_engines(folder: Path, script: str) -> Path:
    """Install ``script`` as both engines' entry points: ``folder/site/sglang/launch_server.py``
    (for ``python -m`` with ``folder/site`` on PYTHONPATH, which is returned) and ``folder/bin/vllm``
    beside a ``folder/bin/python``, as in a vLLM venv."""
    pkg = folder / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(script)
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "vllm").write_text(f"#!{sys.executable}\n{script}")
    (bin_dir / "vllm").chmod(0o755)
    return folder / "site"


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    """Env overrides that make ``-m sglang.launch_server`` and ``tmp_path/bin/vllm`` run the fake."""
    fake_engines(tmp_path, FAKE_SERVER)
    runs = tmp_path / "runs"
    runs.mkdir()
    return {"PYTHONPATH": str(tmp_path / "site"), "FAKE_SGLANG_DIR": str(runs)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """True for a running process; a zombie left to a non-reaping init counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def run_info(env: dict[str, str], pid: int) -> dict:
    return json.loads(Path(env["FAKE_SGLANG_DIR"], f"{pid}.json").read_text())


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def make(env: dict[str, str], tmp_path: Path, gpus: list[int] = [0], *, startup_timeout_s: float = 10.0,
         extra_args: list[str] = [], engine: str = "sglang", **kw) -> EngineServer:  # fmt: skip
    fields = dict(model_path="/models/tiny", tp=len(gpus), extra_args=extra_args, startup_timeout_s=startup_timeout_s)
    if engine == "vllm":
        launch = VLLMLaunch(python=str(tmp_path / "bin" / "python"), **fields)
    else:
        launch = SGLangLaunch(**fields)
    kw.setdefault("health_interval_s", 0.1)
    kw.setdefault("restart_backoff_s", 0.05)
    return EngineServer(launch, gpus, port=free_port(), log_path=tmp_path / "sglang.log", env=env, **kw)


def test_start_waits_for_health_and_passes_command_and_gpus(fake, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="draftfleet.launcher")
    env = {**fake, "FAKE_SGLANG_STARTUP_DELAY": "0.4"}
    server = make(env, tmp_path, [2, 3], extra_args=["--mem-fraction-static", "0.8", "--api-key", "sk-hush"])
    try:
        t0 = time.monotonic()
        server.start()
        assert time.monotonic() - t0 >= 0.4
        assert server.healthy()
        assert httpx.get(server.url + "/health_generate").status_code == 200
        info = run_info(env, server.pid)
    finally:
        server.stop()
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert info["cuda"] == "2,3"
    assert info["argv"] == [
        "--model-path", "/models/tiny", "--host", "127.0.0.1", "--port", str(server.port), "--tp-size", "2",
        "--mem-fraction-static", "0.8", "--api-key", "sk-hush",
    ]  # fmt: skip
    assert "sk-hush" not in caplog.text and "--api-key ***" in caplog.text
    assert str(tmp_path / "sglang.log") in caplog.text
    assert "fake sglang serving /models/tiny" in (tmp_path / "sglang.log").read_text()


def test_falls_back_to_health_when_health_generate_is_missing(fake, tmp_path):
    with make({**fake, "FAKE_SGLANG_NO_HEALTH_GENERATE": "1"}, tmp_path) as server:
        assert server.healthy()


def test_vllm_serve_runs_the_script_beside_the_configured_python(fake, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="draftfleet.launcher")
    server = make(fake, tmp_path, [4, 5], engine="vllm", extra_args=["--max-model-len", "2048", "--api-key", "sk-hush"])
    assert server.command[0] == str(tmp_path / "bin" / "vllm")
    with server:
        assert server.healthy()
        info = run_info(fake, server.pid)
    assert info["argv"] == [
        "serve", "/models/tiny", "--host", "127.0.0.1", "--port", str(server.port), "--tensor-parallel-size", "2",
        "--max-model-len", "2048", "--api-key", "sk-hush",
    ]  # fmt: skip
    assert info["cuda"] == "4,5"
    # vLLM has no /health_generate: its cheap /health is probed from the start
    assert set(Path(fake["FAKE_SGLANG_DIR"], f"{info['pid']}.paths").read_text().split()) == {"/health"}
    assert "fake vllm serving /models/tiny" in (tmp_path / "sglang.log").read_text()
    assert "started vLLM server on GPU(s) [4, 5]" in caplog.text and "sk-hush" not in caplog.text
    assert not alive(info["pid"]) and not alive(info["helper"])


def test_vllm_not_installed_is_a_clear_error(tmp_path):
    launch = VLLMLaunch(model_path="m", python=str(tmp_path / "no-venv" / "bin" / "python"), startup_timeout_s=5)
    server = EngineServer(launch, [0], port=free_port(), log_path=tmp_path / "vllm.log")
    with pytest.raises(LaunchError, match=r"cannot start the vLLM server \(.*no-venv/bin/vllm serve m .*\): No such file"):
        server.start()
    assert server.pid is None


def test_each_engine_is_probed_on_its_own_terms():
    sglang = EngineServer(SGLangLaunch(model_path="m"), [3])
    vllm = EngineServer(VLLMLaunch(model_path="m"), [3])
    # SGLang's health check generates a token and takes up to 20 s under load, and a
    # restart of a large model costs 10-30 min: a slow answer is not a dead server.
    assert sglang.health_timeout_s >= 25 and sglang.unhealthy_after > vllm.unhealthy_after
    assert sglang.health_timeout_s * sglang.unhealthy_after >= 120
    assert (sglang.port, vllm.port) == (30003, 8003)
    assert sglang.log_path.name.startswith("sglang-gpu3") and vllm.log_path.name.startswith("vllm-gpu3")


def test_slow_probes_within_the_timeout_are_not_failures(fake, tmp_path):
    slow = tmp_path / "slow"
    with make({**fake, "FAKE_HEALTH_DELAY_FILE": str(slow)}, tmp_path, health_timeout_s=2.0, unhealthy_after=2) as server:
        pid = server.pid
        slow.write_text("0.8")
        time.sleep(3.0)
        assert server.restarts == 0 and server.pid == pid


def test_probes_slower_than_the_timeout_restart_after_unhealthy_after(fake, tmp_path, caplog):
    slow = tmp_path / "slow"
    restarted: list[int] = []
    with make({**fake, "FAKE_HEALTH_DELAY_FILE": str(slow)}, tmp_path, health_timeout_s=0.5, unhealthy_after=2) as server:
        server.on_restart = restarted.append
        first = server.pid
        slow.write_text("2")
        wait_until(lambda: not alive(first))
        slow.unlink()
        wait_until(lambda: restarted == [1])
        assert server.pid != first and server.healthy()
    assert f"(pid {first}) failed 2 health checks in a row; restart 1/10" in caplog.text


def test_exit_during_startup_raises_with_log_tail(fake, tmp_path):
    server = make({**fake, "FAKE_SGLANG_STARTUP_DELAY": "60", "FAKE_SGLANG_EXIT_AFTER": "0.2"}, tmp_path)
    with pytest.raises(LaunchError) as err:
        server.start()
    msg = str(err.value)
    assert "exited with code 3 during startup" in msg
    assert str(tmp_path / "sglang.log") in msg
    assert "CUDA out of memory (fake)" in msg
    assert server.pid is None
    server.stop()


def test_never_healthy_times_out_and_is_stopped(fake, tmp_path):
    env = {**fake, "FAKE_SGLANG_STARTUP_DELAY": "600"}
    server = make(env, tmp_path, startup_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"was not healthy within 1s") as err:
        server.start()
    assert 1.0 <= time.monotonic() - t0 < 8.0
    assert "fake sglang serving" in str(err.value)
    (info,) = [json.loads(p.read_text()) for p in Path(fake["FAKE_SGLANG_DIR"]).glob("*.json")]
    assert not alive(info["pid"]) and not alive(info["helper"])


def test_port_in_use_is_a_clear_error(fake, tmp_path):
    server = make(fake, tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", server.port))
        busy.listen()
        with pytest.raises(LaunchError, match=rf"port {server.port} is already in use"):
            server.start()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_supervisor_restarts_a_crashed_server(fake, tmp_path, caplog, engine):
    caplog.set_level(logging.INFO, logger="draftfleet.launcher")
    crash = tmp_path / "crash-now"
    restarted: list[int] = []
    with make({**fake, "FAKE_SGLANG_CRASH_FILE": str(crash)}, tmp_path, engine=engine) as server:
        server.on_restart = restarted.append
        first = run_info(fake, server.pid)
        crash.touch()
        wait_until(lambda: restarted == [1])
        assert server.restarts == 1
        assert server.healthy()
        assert server.pid != first["pid"]
        assert not alive(first["pid"]) and not alive(first["helper"])  # the old group was cleaned up
    assert f"(pid {first['pid']}) exited with code 3; restart 1/10" in caplog.text


def test_an_engine_killed_by_a_signal_is_said_in_one_line_with_the_signal_and_its_log(fake, tmp_path, caplog,
                                                                                       target_tokenizer):
    from draftfleet.schemas.config import VLLMBackend
    from draftfleet.workers.engine import ServerDown
    from draftfleet.workers.vllm import VLLMClient

    caplog.set_level(logging.INFO)
    sigill = tmp_path / "sigill-now"
    reasons: list[str] = []
    server = make({**fake, "FAKE_ENGINE_SIGILL_FILE": str(sigill)}, tmp_path, engine="vllm", max_restarts=0)
    server.on_give_up = reasons.append
    client = VLLMClient(server.url, VLLMBackend(connect_timeout_s=2), target_tokenizer, inflight=1)
    client.process = server
    with server:
        pid = server.pid
        sigill.touch()
        wait_until(lambda: reasons)
        clue = ("Worker proc VllmWorker-0 died unexpectedly (exit code: -4 (SIGILL)), shutting down executor.")
        assert f"(pid {pid}) exited with code -4 (SIGILL); its log says: (EngineCore pid={pid}) ERROR" in reasons[0]
        assert clue in reasons[0]
        [line] = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
        assert "\n" not in line
        death = server.death()
        assert (death.pid, death.code) == (pid, -4) and clue in death.clue
        assert death.tail[-1] == "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
        # what a worker says when its requests meet the dead server: the exit, the signal named, in
        # its error (the pause's reason) and once in full in its log
        for _ in range(2):
            with pytest.raises(ServerDown) as err:
                client.post("/v1/completions", {"prompt": [1]})
            assert f"(pid {pid}) exited with code -4 (SIGILL); its log says: " in str(err.value)
        [said] = [r.getMessage() for r in caplog.records if r.name == "draftfleet.engine"]
        assert said.startswith(f"{client.endpoint} died: vLLM server on GPU(s) [0] (pid {pid}) exited with code -4 "
                               "(SIGILL)") and "last lines of " in said and "EngineDeadError" in said and "\n" not in said
    client.close()


def test_vllms_cpu_build_says_what_the_cpu_gives_its_attention(fake, tmp_path, caplog):
    from draftfleet import amx

    caplog.set_level(logging.INFO, logger="draftfleet.launcher")
    with make({**fake, "VLLM_TARGET_DEVICE": "cpu"}, tmp_path, engine="vllm", extra_args=["--dtype", "bfloat16"]):
        pass
    note = amx.summary(amx.cpu_flags(), "bfloat16", asks=False)  # the fake's venv has no hook
    assert f"==== draftfleet: vLLM's CPU build: {note}\n" in (tmp_path / "sglang.log").read_text()
    assert note in caplog.text and "vLLM CPU attention will use " in note
    with make(fake, tmp_path, engine="sglang"):
        pass
    assert (tmp_path / "sglang.log").read_text().count("vLLM's CPU build") == 1


def test_supervisor_gives_up_after_max_restarts(fake, tmp_path):
    reasons: list[str] = []
    # Healthy at once, dies 0.5 s later, every time.
    server = make({**fake, "FAKE_SGLANG_EXIT_AFTER": "0.5"}, tmp_path, max_restarts=1)
    server.on_give_up = reasons.append
    with server:
        wait_until(lambda: reasons)
        assert server.restarts == 1
        assert "giving up after 1 restart(s)" in reasons[0]
        assert server.pid is None


def test_stop_kills_the_process_group_and_is_idempotent(fake, tmp_path):
    server = make(fake, tmp_path)
    server.start()
    server.supervise()
    info = run_info(fake, server.pid)
    assert alive(info["pid"]) and alive(info["helper"])
    server.stop(timeout=5)
    assert not alive(info["pid"]) and not alive(info["helper"])
    assert server.pid is None and not server.healthy()
    server.stop()
    assert server.restarts == 0


def test_constructor_rejects_mismatched_group(tmp_path):
    launch = SGLangLaunch(model_path="m", tp=2)
    with pytest.raises(ValueError, match="tp=2"):
        EngineServer(launch, [0])
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        EngineServer(launch, [0, 1], env={"CUDA_VISIBLE_DEVICES": "5"})
    server = EngineServer(launch, [4, 5])
    assert server.port == port_for(launch, [4, 5]) == 30004
    assert server.url == "http://127.0.0.1:30004"


@pytest.mark.parametrize(
    ("spec", "tp", "groups"),
    [
        ("0", 1, [[0]]),
        ("0,1,2,3", 2, [[0, 1], [2, 3]]),
        ("0-7", 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("0-3, 6,7", 1, [[0], [1], [2], [3], [6], [7]]),
        ("4-5", 2, [[4, 5]]),
    ],
)
def test_gpu_groups(spec, tp, groups):
    assert gpu_groups(spec, tp) == groups


@pytest.mark.parametrize(
    ("spec", "tp", "error"),
    [
        ("0,1,2", 2, r"3 GPU\(s\) \[0, 1, 2\] cannot be split into groups of tp=2"),
        ("0,x", 1, r"'x' is not an index"),
        ("", 1, r"'' is not an index"),
        ("3-1", 1, r"runs backwards"),
        ("0,0-1", 1, r"more than once"),
        ("0", 0, r"at least 1"),
    ],
)
def test_gpu_groups_errors(spec, tp, error):
    with pytest.raises(ValueError, match=error):
        gpu_groups(spec, tp)


def test_gpu_groups_all_uses_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    assert gpu_groups("all", 2) == [[2, 3], [4, 5]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="no GPU is visible"):
        gpu_groups("all", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f0c1e2a")
    with pytest.raises(ValueError, match="not a list of GPU indices"):
        gpu_groups("all", 1)


def test_gpu_groups_all_counts_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="nvidia-smi not found"):
        gpu_groups("all", 1)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaa)'\n"
        "echo '  MIG 3g.40gb     Device  0: (UUID: MIG-bbb)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-ccc)'\n"
    )
    smi.chmod(0o755)
    assert gpu_groups("all", 2) == [[0, 1]]
    assert gpu_groups("ALL", 1) == [[0], [1]]


def _real_sglang_skip_reason() -> str | None:
    if not os.environ.get("DRAFTFLEET_TEST_MODEL"):
        return "set DRAFTFLEET_TEST_MODEL to a local model path"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import sglang  # noqa: F401
    except ImportError:
        return "sglang is not installed"
    return None


@pytest.mark.gpu
def test_real_sglang_server_on_gpu0(tmp_path):
    reason = _real_sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    launch = SGLangLaunch(model_path=os.environ["DRAFTFLEET_TEST_MODEL"], python=sys.executable, startup_timeout_s=900)
    with EngineServer(launch, [0], port=free_port(), log_path=tmp_path / "sglang.log") as server:
        pid = server.pid
        assert pid is not None and server.healthy()
    assert not alive(pid)
    assert server.pid is None
