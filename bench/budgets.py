"""Budgets exact by construction (issue 41): what a real fleet stores against each budget.

For each max_tokens x budget x fleet size, one dataset of ``prompts`` prompts with that budget is
queued on a private Redis and drained by real ``draftfleet worker gpu`` and ``worker cloud``
processes together (SGLang and an OpenAI-compatible cloud on the emulator, heavy-tailed answers
``lognormal:150:1.0``), until admission closes the dataset. Stored tokens are read from the
records in the store (the cloud's are its retokenized ids, as the budget counts them), so the
figure is the product's, not the counters'. The rule says: never above the budget, and less than
the floor (1% of the budget, never more than max_tokens) below it. The last stretch's cost is the
time from 99% of the budget stored to the dataset's close, beside the whole run's.

It then runs the model test (tests/test_budget_model.py) with many more examples than CI does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger, floor_tokens
from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from .env import REPO, TOKENIZER, EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, write_prompts

DATASET = "bud"
KEY_ENV = "DRAFTFLEET_BENCH_KEY"
LENGTH = "lognormal:150:1.0"


def _config(folder: Path, prompts: Path, emu_url: str, max_tokens: int, budget: int) -> Path:
    lines = ["[fleet]", f'store = "{folder / "store"}"', 'model = "bench/chatml-600"', f'tokenizer = "{TOKENIZER}"', "",
             "[[datasets]]", f'name = "{DATASET}"', f'path = "{prompts}"', f"max_tokens = {max_tokens}",
             f"budget_tokens = {budget}", "",
             "[backends.sglang]", f'urls = ["{emu_url}"]', "inflight = 16", "request_timeout_s = 120.0", "",
             "[backends.cloudy]", f'base_url = "{emu_url}/v1"', 'model = "vendor/model"', f'api_key_env = "{KEY_ENV}"',
             "concurrency = 16", "price_input_per_mtok = 1.0", "price_output_per_mtok = 2.0",
             "request_timeout_s = 120.0", ""]
    path = folder / "fleet.toml"
    path.write_text("\n".join(lines))
    return path


def _one(folder: Path, redis: PrivateRedis, emu: EmulatorProcess, prompts: Path, max_tokens: int, budget: int,
         gpu: int, cloud: int, timeout_s: float) -> dict:
    """One run to the dataset's close: stored tokens (from the store), the time to 99% and to the close."""
    fresh_dir(folder)
    r = redis.client()
    r.flushall()
    config = _config(folder, prompts, emu.url, max_tokens, budget)
    cfg = load_config(config)
    store = open_store(cfg)
    app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
    queued = enqueue_dataset(cfg, cfg.dataset(DATASET), app, r, store).queued
    app.close()
    env = {KEY_ENV: os.environ[KEY_ENV]}
    procs = [WorkerProcess(folder, config, redis.url, "--url", emu.url, env=env) for _ in range(gpu)]
    procs += [WorkerProcess(folder, config, redis.url, "--backend", "cloudy", kind="cloud", env=env) for _ in range(cloud)]
    ledger = Ledger(r)
    start = time.monotonic()
    at99 = None
    for p in procs:
        p.__enter__()
    try:
        while True:
            stored = int(ledger.dataset_totals(DATASET).get("completion_tokens", 0))
            if at99 is None and stored >= 0.99 * budget:
                at99 = time.monotonic()
            closed = ledger.closed_at(DATASET) is not None
            if (closed or not r.llen(rk.queue(DATASET))) and not r.hlen(rk.UNACKED) \
                    and not list(r.scan_iter(rk.claim(DATASET, "*"), count=1000)):
                break  # closed (or every prompt answered) and nothing in flight
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{DATASET} at max_tokens {max_tokens}, budget {budget}: not closed after "
                                   f"{timeout_s:.0f}s (stored {stored})")
            time.sleep(0.1)
        end = time.monotonic()
    finally:
        for p in procs:
            p.__exit__(None, None, None)
    records = list(store.records(DATASET))
    tokens = sum(rec.completion_tokens for rec in records)
    return {"max_tokens": max_tokens, "budget": budget, "workers": f"{gpu} gpu + {cloud} cloud", "queued": queued,
            "records": len(records), "stored": tokens, "ratio": tokens / budget,
            "floor": floor_tokens(budget, max_tokens), "cut": sum(rec.truncated for rec in records),
            "run_s": end - start, "last_stretch_s": (end - at99) if at99 is not None else float("nan"),
            "closed": ledger.closed_at(DATASET) is not None}


def _model(examples: int) -> tuple[bool, str]:
    """The model test with ``examples`` examples (0: skipped)."""
    env = {**os.environ, "DRAFTFLEET_MODEL_EXAMPLES": str(examples), "DRAFTFLEET_MODEL_STEPS": "80"}
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_budget_model.py",
                          "-k", "any_interleaving"], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    took = time.monotonic() - started
    return res.returncode == 0, f"{examples} examples of up to 80 steps: {'passed' if not res.returncode else 'FAILED'} " \
                                f"in {took:.0f} s" + ("" if not res.returncode else f"\n\n```\n{res.stdout[-3000:]}\n```")


def run(work: Path, *, max_tokens: list[int], budgets: list[int], fleets: list[int], prompts: int,
        model_examples: int, timeout_s: float = 1200.0) -> Section:
    data = write_prompts(work / "prompts.jsonl", prompts, tag="budgets")
    rows = []
    os.environ.setdefault(KEY_ENV, "bench-key")  # the emulator and the cloud workers read it from their environment
    with PrivateRedis(work / "redis") as redis, EmulatorProcess(
            work / "emu", length=LENGTH, single_stream_tps=3000, ceiling_tps=200_000, ttft_s=0.0, seed=41,
            api_key_env=KEY_ENV, context_length=40_000, max_output_tokens=33_000) as emu:
        for m in max_tokens:
            for b in budgets:
                for n in fleets:
                    gpu, cloud = max(1, n // 2), max(1, n - n // 2)
                    row = _one(work / f"run-{m}-{b}-{n}", redis, emu, data, m, b, gpu, cloud, timeout_s)
                    print(f"  max_tokens {m}, budget {b}, {row['workers']}: stored {row['stored']} "
                          f"({row['ratio']:.4f}), last stretch {row['last_stretch_s']:.1f}s of {row['run_s']:.1f}s",
                          file=sys.stderr, flush=True)
                    rows.append(row)
    model_ok, model_text = _model(model_examples) if model_examples else (True, "skipped (--budgets-model-examples 0)")
    low, high = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    within = all(r["budget"] - r["floor"] < r["stored"] <= r["budget"] for r in rows)
    figures = [
        Figure(bench="budgets", name="highest stored / budget", value=high, unit="x", reference="the budget",
               reference_value=1.0, ratio=1.0 / high if high else float("inf"), target="<= 1.00", met=high <= 1.0,
               headline=True),
        Figure(bench="budgets", name="lowest stored / budget", value=low, unit="x", reference="99% of the budget",
               reference_value=0.99, ratio=low / 0.99, target=">= 0.99", met=low >= 0.99, headline=True),
    ]
    details = [
        "Every run on one private Redis and one emulator, answers " + f"`{LENGTH}`, {prompts} prompts a dataset. "
        "Stored: the completion tokens of the dataset's records in the store. Floor: the least admission grants "
        "near the end (1% of the budget, never more than max_tokens): the rule allows stored in (budget - floor, budget].",
        "",
        "| max_tokens | budget | workers | records (cut) | stored | stored / budget | within the rule | "
        "last stretch (from 99%) | run |",
        "| ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        ok = r["budget"] - r["floor"] < r["stored"] <= r["budget"]
        details.append(f"| {r['max_tokens']:,} | {r['budget']:,} | {r['workers']} | {r['records']} ({r['cut']}) | "
                       f"{r['stored']:,} | {r['ratio']:.4f} | {'yes' if ok else '**no**'} | "
                       f"{r['last_stretch_s']:.1f} s | {r['run_s']:.1f} s |")
    details += ["", f"Every run within the rule: {'yes' if within else '**no**'}.", "",
                f"The model test (tests/test_budget_model.py, hypothesis): {model_text}."]
    if not model_ok:
        details.append("**The model test failed.**")
    return Section(bench="budgets", title="Budgets: stored against the budget, at any max_tokens", command="",
                   figures=figures, details=details)
