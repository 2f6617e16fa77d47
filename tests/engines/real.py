"""Real inference engines for the real-engine tier and ``python -m bench vllm``: find, build, serve.

Each engine runs from its own interpreter, never the project's (vLLM pins its own torch and
transformers). vLLM: ``DRAFTFLEET_VLLM_ENV`` names the virtual environment that
``bash ops/vllm-cpu-env.sh`` builds (and prints); unset, the vLLM tests are skipped with that
hint, and ``.ci/run`` sets it, so CI runs them and fails when the engine cannot start. SGLang
needs a CUDA GPU: ``DRAFTFLEET_SGLANG_ENV`` names a venv with sglang, else the project's own
interpreter is tried (``pip install .[gpu]``).

The model is the tiny random Llama of ``tiny_model.py``, built by the engine's interpreter from the
sample tokenizer and cached under ``~/.cache/draftfleet/models`` by a hash of its inputs. The
server is started by the fleet's own launcher (``EngineServer``: own process group, health wait,
log quoted on failure), which the tier thereby runs against a real engine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from draftfleet.schemas.config import EngineLaunch, SGLangLaunch, VLLMLaunch
from draftfleet.workers.launcher import EngineServer

HERE = Path(__file__).resolve().parent
TINY_MODEL = HERE / "tiny_model.py"
MODEL_CACHE = Path.home() / ".cache" / "draftfleet" / "models"
SERVED_NAME = "tiny-llama"
ENV_VARS = {"vllm": "DRAFTFLEET_VLLM_ENV", "sglang": "DRAFTFLEET_SGLANG_ENV"}
# vLLM's CPU build (ops/ENGINES.md): 1 GiB of KV cache; no thread pinning on cores others share.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_TARGET_DEVICE": "cpu",
                "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


class Engine(NamedTuple):
    """One engine as the tier drives it: its interpreter, launch flags, and its gauge of the
    requests it is running at once (Prometheus ``/metrics``)."""

    name: str
    python: str
    running_gauge: str
    extra_args: tuple[str, ...]
    env: dict[str, str]

    def launch(self, model: Path, startup_timeout_s: float) -> EngineLaunch:
        kind = VLLMLaunch if self.name == "vllm" else SGLangLaunch
        return kind(model_path=str(model), python=self.python, extra_args=list(self.extra_args),
                    startup_timeout_s=startup_timeout_s)


def find_engine(name: str) -> tuple[Engine | None, str]:
    """The engine, or None and why it is skipped. A setting that points nowhere is an error, not a skip."""
    var = ENV_VARS[name]
    folder = os.environ.get(var)
    if name == "vllm":
        if not folder:
            return None, f"set {var} to the folder that `bash ops/vllm-cpu-env.sh` prints (vLLM's CPU build)"
        python = Path(folder) / "bin" / "python"
        if not (Path(folder) / "bin" / "vllm").exists():
            raise RuntimeError(f"{var}={folder} holds no bin/vllm: build it with `bash ops/vllm-cpu-env.sh`")
        args = ("--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "2048",
                "--max-num-seqs", "64", "--enforce-eager")
        return Engine("vllm", str(python), "vllm:num_requests_running", args, dict(VLLM_CPU_ENV)), ""
    python = str(Path(folder) / "bin" / "python") if folder else sys.executable
    if shutil.which("nvidia-smi") is None:
        return None, "SGLang needs a CUDA GPU (no nvidia-smi here)"
    probe = subprocess.run([python, "-c", "import sglang, torch; assert torch.cuda.is_available()"],
                           capture_output=True, text=True)
    if probe.returncode:
        return None, f"{python} cannot run SGLang on a GPU (set {var}): {probe.stderr.strip()[-200:]}"
    args = ("--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--context-length", "2048",
            "--enable-metrics", "--mem-fraction-static", "0.3")
    return Engine("sglang", python, "sglang:num_running_reqs", args, {"HF_HUB_OFFLINE": "1"}), ""


def tiny_model(python: str, tokenizer_dir: Path, cache: Path = MODEL_CACHE) -> Path:
    """The tiny model for this tokenizer, built once per (script, tokenizer) and reused after.

    Built in a temporary sibling folder and renamed into place, so a run killed mid-build
    leaves nothing that looks complete, and two builders racing both end with the same model.
    """
    digest = hashlib.sha256(TINY_MODEL.read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        digest.update(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes())
    dest = cache / f"tiny-llama-{digest.hexdigest()[:12]}"
    if (dest / "config.json").exists():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=cache))
    try:
        subprocess.run([python, str(TINY_MODEL), str(tokenizer_dir), str(work / "model")], check=True,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"building the tiny model failed:\n{exc.stderr[-3000:]}") from None
    try:
        (work / "model").rename(dest)
    except OSError:  # another run renamed its copy first: the same inputs, the same model
        if not (dest / "config.json").exists():
            raise
    shutil.rmtree(work, ignore_errors=True)
    return dest


def server(engine: Engine, model: Path, port: int, log_path: Path, startup_timeout_s: float = 900.0) -> EngineServer:
    """The fleet's launcher for this engine on ``port`` (not started). GPU 0 on a GPU machine;
    vLLM's CPU build ignores the ``CUDA_VISIBLE_DEVICES`` it sets."""
    return EngineServer(engine.launch(model, startup_timeout_s), [0], port=port, log_path=log_path, env=engine.env)


def metrics(url: str, *names: str, client: httpx.Client | None = None) -> dict[str, float]:
    """Prometheus series of the engine's ``/metrics`` (gauges, counters), each summed over its labels.
    Pass a ``client`` when polling: a new one per call costs ~20 ms of CPU (its TLS context)."""
    text = (client or httpx).get(url + "/metrics", timeout=5.0).text
    out = {}
    for name in names:
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
        if not values:
            raise AssertionError(f"{url}/metrics has no {name}")
        out[name] = sum(float(v) for v in values)
    return out


def gauge(url: str, name: str) -> float:
    return metrics(url, name)[name]


class MetricsSampler(threading.Thread):
    """Samples some of the engine's metrics every ``interval`` seconds while a run goes on (``with``)."""

    def __init__(self, url: str, *names: str, interval: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.names, self.interval = url, names, interval
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.monotonic(), values)
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client() as client:
            while not self._done.wait(self.interval):
                self.samples.append((time.monotonic(), metrics(self.url, *self.names, client=client)))

    def series(self, name: str, start: float = 0.0, end: float = float("inf")) -> list[tuple[float, float]]:
        return [(t, v[name]) for t, v in self.samples if start <= t <= end]

    def mean(self, name: str, start: float, end: float) -> float:
        inside = [v for _, v in self.series(name, start, end)]
        return sum(inside) / len(inside) if inside else 0.0

    def rate(self, name: str, start: float, end: float) -> float:
        """A counter's increase per second between the first and last samples in [start, end]."""
        inside = self.series(name, start, end)
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def __enter__(self) -> MetricsSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()
