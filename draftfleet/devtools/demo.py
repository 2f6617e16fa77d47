"""``draftfleet demo``: the whole fleet on a laptop, no GPU and no network, in under two minutes.

It starts the store's embedded private Redis and the emulator (standing in for an SGLang
server and OpenRouter), enqueues the sample datasets from ``examples/``, runs one GPU worker and
one cloud worker as real subprocesses (``draftfleet worker ...``) until every prompt has its
result, then stops everything it started and prints what each side produced.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from draftfleet.devtools import samples
from draftfleet.views import status
from draftfleet.broker import EmbeddedRedis, connect
from draftfleet.schemas.config import load_config
from draftfleet.store import Store

DEMO_KEY_ENV = "DRAFTFLEET_DEMO_API_KEY"


def examples_dir() -> Path:
    """The repo's ``examples/``; regenerated into a temp folder when running from a wheel."""
    here = Path(__file__).resolve().parents[2] / "examples"
    if (here / "tokenizer" / "tokenizer.json").exists():
        return here
    return samples.build_examples(Path(tempfile.mkdtemp(prefix="draftfleet-examples-")))


def write_demo_config(folder: Path, examples: Path, emulator_url: str) -> Path:
    text = samples.EXAMPLE_CONFIG
    text = text.replace('store = "store"', f'store = "{folder / "store"}"')
    text = text.replace('tokenizer = "tokenizer"', f'tokenizer = "{examples / "tokenizer"}"')
    text = text.replace('path = "data/', f'path = "{examples / "data"}/')
    text = text.replace("http://127.0.0.1:30000", emulator_url)
    text = text.replace("https://openrouter.ai/api/v1", emulator_url + "/v1")
    text = text.replace('api_key_env = "OPENROUTER_API_KEY"', f'api_key_env = "{DEMO_KEY_ENV}"')
    path = folder / "fleet.toml"
    path.write_text(text)
    return path


def _stop(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_demo(store: str | None = None, timeout_s: float = 110.0, as_json: bool = False) -> int:
    from draftfleet.devtools.emulator import Emulator, EmulatorConfig
    from draftfleet.producer.enqueue import enqueue_dataset
    from draftfleet.workers.app import make_app

    console = Console(stderr=as_json)
    started = time.monotonic()
    keep = store is not None
    folder = Path(store).resolve() if keep else Path(tempfile.mkdtemp(prefix="draftfleet-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    examples = examples_dir()
    api_key = "demo-" + os.urandom(8).hex()
    emulator = Emulator(EmulatorConfig(
        tokenizer=str(examples / "tokenizer"), model="demo/chatml-600", api_key=api_key,
        single_stream_tps=400.0, ceiling_tps=20000.0, length="lognormal:90:0.6",
        price_input_per_mtok=0.6, price_output_per_mtok=2.5,
    ))
    emulator.start()
    cfg = load_config(write_demo_config(folder, examples, emulator.url))
    redis_server = EmbeddedRedis(Path(cfg.fleet.store) / "_redis")
    procs: list[subprocess.Popen] = []
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    try:
        url = redis_server.ensure()
        app = make_app(url, cfg.fleet.visibility_timeout_s)
        r = connect(url)
        st = Store(cfg.fleet.store)
        env = {**os.environ, DEMO_KEY_ENV: api_key, "REDIS_URL": url}
        base = [sys.executable, "-m", "draftfleet", "worker"]
        for kind, extra in (("gpu", ["--url", emulator.url, "--inflight", "32"]), ("cloud", ["--backend", "openrouter"])):
            log = open(logs / f"{kind}.log", "wb")
            procs.append(subprocess.Popen([*base, kind, "--config", str(folder / "fleet.toml"), *extra],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        console.print(f"demo: store {cfg.fleet.store}, emulator {emulator.url}; starting a GPU and a cloud worker",
                      highlight=False)
        # Both workers up before anything is queued, so each gets its share.
        while len(status.worker_reports(r)) < len(procs):
            if any(p.poll() is not None for p in procs) or time.monotonic() - started > timeout_s:
                console.print(f"[red]demo failed: the workers did not start; logs in {logs}[/]")
                return 1
            time.sleep(0.2)
        summaries = [enqueue_dataset(cfg, ds, app, r, st) for ds in cfg.datasets]
        expected = {s.dataset: s.queued + s.already_done + s.already_queued + s.in_flight for s in summaries}
        console.print(f"demo: {sum(s.queued for s in summaries)} prompts queued", highlight=False)
        total = sum(expected.values())
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            bar = progress.add_task("generating", total=total)
            while True:
                done = sum(len(st.keys(name)) for name in expected)
                progress.update(bar, completed=done)
                if done >= total:
                    break
                dead = [p for p in procs if p.poll() is not None]
                if dead or time.monotonic() - started > timeout_s:
                    why = "a worker exited" if dead else f"timed out after {timeout_s:.0f}s"
                    console.print(f"[red]demo failed: {why}; logs in {logs}[/]")
                    return 1
                time.sleep(0.25)
    finally:
        _stop(procs)
        emulator.stop()
        redis_server.stop()
    report = _report(st, list(expected))
    if as_json:
        print(msgspec.json.encode(report).decode())
    else:
        _print_report(console, report, time.monotonic() - started, folder if keep else None)
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _report(store: Store, datasets: list[str]) -> dict:
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"responses": 0, "completion_tokens": 0, "cost_usd": 0.0})
    for name in datasets:
        for rec in store.records(name):
            row = rows[(name, f"{rec.backend} ({rec.backend_kind}, {rec.token_source})")]
            row["responses"] += 1
            row["completion_tokens"] += rec.completion_tokens
            row["cost_usd"] += rec.cost_usd
    return {"rows": [{"dataset": d, "backend": b, **v} for (d, b), v in sorted(rows.items())]}


def _print_report(console: Console, report: dict, elapsed: float, kept: Path | None) -> None:
    table = Table(title=f"demo: what each side produced ({elapsed:.0f}s)")
    for col in ("dataset", "backend", "responses", "completion tokens", "cost (USD)"):
        table.add_column(col, justify="left" if col in ("dataset", "backend") else "right")
    for row in report["rows"]:
        table.add_row(row["dataset"], row["backend"], str(row["responses"]), str(row["completion_tokens"]),
                      f"{row['cost_usd']:.4f}")
    console.print(table)
    if kept:
        console.print(f"results kept in {kept / 'store'}; config in {kept / 'fleet.toml'}", highlight=False)
