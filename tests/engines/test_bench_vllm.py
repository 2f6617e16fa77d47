"""``python -m bench vllm`` and ``capture`` still run, at their smallest size, on the real engine (no figure is
checked: speed claims live in BENCHMARKS.md). The other entry points: tests/test_bench_smoke.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO
from .real import find_engine

SMALLEST = ["--vllm-concurrency", "2,4", "--vllm-warmup", "1", "--vllm-window", "2", "--vllm-repeats", "1",
            "--vllm-prompts", "60", "--vllm-max-tokens", "16"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_bench_vllm_runs(tmp_path):
    engine, why = find_engine("vllm")
    if engine is None:
        pytest.skip(why)
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "vllm", *SMALLEST, "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert '<a id="vllm"></a>' in report and "sharing the engine with a direct client" in report


CAPTURE_SMALLEST = ["--capture-concurrency", "4", "--capture-warmup", "2", "--capture-window", "6",
                    "--capture-answer", "32", "--capture-units", "200", "--capture-alone-units", "10",
                    "--capture-repeats", "1", "--capture-conversations", "4",
                    "--capture-solo-units", "6", "--capture-solo-blocks", "1"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_bench_capture_runs(tmp_path):
    engine, why = find_engine("vllm")
    if engine is None:
        pytest.skip(why)
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "capture", *CAPTURE_SMALLEST, "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert '<a id="capture"></a>' in report and "write amplification" in report
    assert "three-turn conversations captured once: engine tokens" in report
    assert "Alone against alone: 1 blocks of three phases" in report
