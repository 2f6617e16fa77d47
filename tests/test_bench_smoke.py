"""Every ``python -m bench`` entry point still runs, at its smallest size (no figure is checked:
speed claims live in BENCHMARKS.md). ``vllm`` needs the real engine and runs in its own tier."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

SMALLEST = {
    "enqueue": ["--enqueue-prompts", "40"],
    "inventory": ["--inventory-b3", "20:50", "--inventory-large", "50:20", "--repeats", "1"],
    "report": ["--report-records", "50:20", "--repeats", "1"],
    "retokenize": ["--retok-answers", "20", "--retok-mean", "30", "--retok-batch", "8", "--repeats", "1"],
    "admission": ["--admission-inflight", "10", "--admission-rounds", "20"],
    "budgets": ["--budgets-max-tokens", "64", "--budgets-budgets", "600", "--budgets-fleets", "2", "--budgets-prompts",
                "40", "--budgets-model-examples", "5"],
    "readers": ["--readers-rows", "50", "--repeats", "1"],
    "overhead": ["--overhead-tasks", "40", "--overhead-inflight", "4"],
    "store": ["--store-records", "40", "--store-tokens", "20", "--store-blobs", "1", "--store-listed", "1100",
              "--store-capture-files", "2", "--store-capture-mib", "1", "--repeats", "1"],
    "redis": ["--redis-tasks", "40", "--redis-workers", "1,2", "--redis-inflight", "4"],
    "batch": ["--batch-prompts", "12", "--batch-size", "5", "--batch-shapes", "openai,openrouter"],
    "saturation": ["--concurrency", "8", "--warmup", "1", "--window", "3", "--length", "lognormal:20:0.3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_bench_entry_point_runs(name: str, tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "bench", name, *SMALLEST[name], "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert f'<a id="{name}"></a>' in report and "| ratio |" in report
