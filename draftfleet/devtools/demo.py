"""``draftfleet demo``: what the fleet is for, on a laptop, no GPU and no network, in under a minute.

The story a run tells, with real parts: the store's embedded private Redis, real worker processes
(``draftfleet worker gpu`` and ``worker cloud``), the real enqueue, pivot and inventory, and two
emulators standing in for a slow local SGLang server and a fast paid OpenRouter.

1. The GPU worker generates both sample datasets, ``chat`` under a token budget it will reach.
2. The plan (``draftfleet plan``'s): what is left, how long the GPU would take at its measured
   rate (free) and what the cloud would charge for it (its configured price).
3. The pivot: the GPU drains (what it started is stored, what it held goes back to the queue).
4. The cloud finishes: ``chat`` closes at its budget, ``instruct`` runs out of prompts.
5. The inventory check: responses and tokens per dataset and side, the validation, then the next
   command to type. Everything it started is stopped on the way out.

``--store s3://BUCKET/PREFIX`` tells the same story with the store in a bucket: the user's endpoint
when the environment names one (``AWS_ENDPOINT_URL``, or AWS credentials for S3 itself), else the
private SeaweedFS of ``draftfleet s3`` (started for the run if it is not running, and its data kept,
so the records stay in the bucket for ``draftfleet s3 start`` and an export).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console

from draftfleet.assign import assign
from draftfleet.broker import EmbeddedRedis, connect
from draftfleet.devtools import samples
from draftfleet.schemas.config import load_config
from draftfleet.store import Store, open_store
from draftfleet.claims import worker_reports
from draftfleet.views import status
from draftfleet.views.plan import plan_from_redis, render_plans

DEMO_KEY_ENV = "DRAFTFLEET_DEMO_API_KEY"
CHAT_BUDGET = 2400
"""``chat``'s token budget in the demo: about two thirds of what its 40 prompts would take."""
GPU_SHARE = 0.35
"""The share of the prompts the GPU generates before the pivot."""
GPU_INFLIGHT = 8
PHASE_S = 25.0  # the longest the GPU phase may take on a slow machine before the pivot anyway


class InventoryRow(msgspec.Struct, kw_only=True):
    dataset: str
    responses: int
    completion_tokens: int
    budget_tokens: int | None
    closed: bool
    by_side: dict[str, list[int]]  # "backend (token source)" -> [responses, tokens]
    spend_usd: float
    valid: bool


def examples_dir() -> Path:
    """The repo's ``examples/``; regenerated into a temp folder when running from a wheel."""
    here = Path(__file__).resolve().parents[2] / "examples"
    if (here / "tokenizer" / "tokenizer.json").exists():
        return here
    return samples.build_examples(Path(tempfile.mkdtemp(prefix="draftfleet-examples-")))


def write_demo_config(folder: Path, examples: Path, gpu_url: str, cloud_url: str, store: str | None = None) -> Path:
    text = samples.EXAMPLE_CONFIG
    text = text.replace('store = "store"', f'store = "{store or folder / "store"}"')
    text = text.replace('tokenizer = "tokenizer"', f'tokenizer = "{examples / "tokenizer"}"')
    text = text.replace('path = "data/', f'path = "{examples / "data"}/')
    text = text.replace("budget_tokens = 200000", f"budget_tokens = {CHAT_BUDGET}", 1)  # chat's
    text = text.replace("http://127.0.0.1:30000", gpu_url)
    text = text.replace("https://openrouter.ai/api/v1", cloud_url + "/v1")
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


class _Failed(Exception):
    pass


def _bucket(location: str):
    """Where the demo's bucket is, for the story, and the private SeaweedFS it started (to stop at the
    end), if any: the user's endpoint when the environment gives one, else ``draftfleet s3``'s server."""
    from draftfleet.devtools.seaweedfs import SeaweedFS, default_folder
    from draftfleet.store.bucket import parse_location

    bucket, _prefix = parse_location(location)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint or os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"):
        return f"{location} at {endpoint or 'AWS S3'}", None
    server = SeaweedFS.private(default_folder())
    started = not server.running()
    if started:
        server.start()
    server.make_bucket(bucket)
    os.environ.update(server.env())  # the demo's own reads and its workers reach it like any bucket
    return f"{location} on the private SeaweedFS of `draftfleet s3` ({server.folder})", server if started else None


def run_demo(store: str | None = None, timeout_s: float = 110.0, as_json: bool = False) -> int:
    from draftfleet.devtools.emulator import Emulator, EmulatorConfig
    from draftfleet.producer.enqueue import enqueue_dataset
    from draftfleet.workers.app import make_app

    console = Console(stderr=as_json, highlight=False)
    started = time.monotonic()
    in_bucket = store is not None and store.startswith("s3://")
    keep = store is not None and not in_bucket  # a bucket keeps the records; the local folder goes
    folder = Path(store).resolve() if keep else Path(tempfile.mkdtemp(prefix="draftfleet-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    where, seaweedfs = _bucket(store) if in_bucket else (None, None)
    examples = examples_dir()
    api_key = "demo-" + os.urandom(8).hex()
    common = dict(tokenizer=str(examples / "tokenizer"), model="demo/chatml-600", length="lognormal:90:0.6")
    # A local GPU that is slow for the job (the seed's problem), and a fast cloud that charges.
    gpu = Emulator(EmulatorConfig(**common, single_stream_tps=40.0, ceiling_tps=2000.0))
    cloud = Emulator(EmulatorConfig(**common, api_key=api_key, single_stream_tps=400.0, ceiling_tps=20000.0,
                                    price_input_per_mtok=0.6, price_output_per_mtok=2.5))
    gpu.start()
    cloud.start()
    cfg = load_config(write_demo_config(folder, examples, gpu.url, cloud.url, store if in_bucket else None))
    redis_server = EmbeddedRedis((folder / "redis" if in_bucket else Path(cfg.fleet.store)) / "_redis")
    procs: list[subprocess.Popen] = []
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    names = [d.name for d in cfg.datasets]
    say = console.print
    report: dict = {}
    told = False
    try:
        url = redis_server.ensure()
        r = connect(url)
        st = open_store(cfg)
        for name in names:  # 1. starts on the GPU alone: assigned before any worker reads it
            assign(r, name, {"gpu"})
        env = {**os.environ, DEMO_KEY_ENV: api_key, "REDIS_URL": url}
        base = [sys.executable, "-m", "draftfleet", "worker"]
        for kind, extra in (("gpu", ["--url", gpu.url, "--inflight", str(GPU_INFLIGHT)]),
                            ("cloud", ["--backend", "openrouter"])):
            log = open(logs / f"{kind}.log", "wb")
            procs.append(subprocess.Popen([*base, kind, "--config", str(folder / "fleet.toml"), *extra],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        say(f"[bold]draftfleet demo[/]: a private Redis, a slow local SGLang and a paid OpenRouter (both emulated), "
            f"the sample datasets of {examples}" + (f";\n   the store in the bucket {where}" if where else ""))

        def alive() -> None:
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.monotonic() - started > timeout_s:
                raise _Failed("a worker exited" if dead else f"timed out after {timeout_s:.0f}s")

        while len(worker_reports(r)) < len(procs):
            alive()
            time.sleep(0.2)
        app = make_app(url, cfg.fleet.visibility_timeout_s)
        queued = {s.dataset: s.queued + s.already_queued for s in (enqueue_dataset(cfg, ds, app, r, st)
                                                                    for ds in cfg.datasets)}
        total = sum(queued.values())
        say(f"\n[bold]1. GPU[/] `draftfleet enqueue` queued {total} prompts for one GPU worker ({GPU_INFLIGHT} in "
            f"flight);\n   chat's budget is {CHAT_BUDGET:,} tokens")
        phase = time.monotonic()
        shown = 0.0
        while True:
            snap = status.snapshot(cfg, r)
            done = sum(d.responses for d in snap.datasets)
            if done >= GPU_SHARE * total or time.monotonic() - phase > PHASE_S:
                break
            if time.monotonic() - shown >= 2:
                say("   " + "   ".join(_progress(d) for d in snap.datasets))
                shown = time.monotonic()
            alive()
            time.sleep(0.25)
        say("   " + "   ".join(_progress(d) for d in snap.datasets))
        # 2. the plan
        reports = worker_reports(r)
        plan = [plan_from_redis(cfg, r, d.dataset, budget=d.budget, prompts_left=d.queue_depth + d.held,
                                reports=reports) for d in snap.datasets]
        say("\n[bold]2. The plan[/] `draftfleet plan`: what is left, and the time and money to finish it on each side")
        say(render_plans(plan))
        # 3. the pivot
        from draftfleet.views.pivot import pivot

        say(f"\n[bold]3. Pivot[/] `draftfleet pivot {' '.join(f'--dataset {n}' for n in names)} --to cloud`")
        cloud_started, cost_before = time.monotonic(), _cloud_spend(st, names)  # it starts as the GPU drains
        result = pivot(r, "cloud", names, timeout_s=60)
        say(f"   the GPU drained in {result.waited_s:.1f} s: what it had started is stored, what it held is back "
            "in the queue,\n   and the cloud worker takes it")
        # 4. the cloud finishes
        settled = 0
        while settled < 2:  # twice in a row: a message handed back by the drain is briefly in neither
            snap = status.snapshot(cfg, r)
            settled = settled + 1 if _settled(snap, st, queued) else 0
            alive()
            time.sleep(0.25)
        took = time.monotonic() - cloud_started
        paid = _cloud_spend(st, names) - cost_before
        planned = sum(side.cost_usd or 0 for p in plan for side in p.sides if side.kind == "cloud")
        say(f"\n[bold]4. The cloud finished[/] in {took:.1f} s for ${paid:.4f} (the plan: ${planned:.2f}): "
            + "; ".join(f"{d.dataset} {'closed at its budget' if d.closed else 'done'}" for d in snap.datasets))
        report = {"plan": msgspec.to_builtins(plan), "pivot": msgspec.to_builtins(result),
                  "cloud": {"seconds": round(took, 1), "cost_usd": round(paid, 6)}}
        told = True
    except _Failed as exc:
        console.print(f"[red]demo failed: {exc}; logs in {logs}[/]")
        return 1
    finally:
        _stop(procs)
        gpu.stop()
        cloud.stop()
        redis_server.stop()
        if seaweedfs is not None and not told:
            seaweedfs.stop()
    # 5. the inventory check (a bucket's SeaweedFS that the demo started goes once it is read)
    try:
        inventory = _inventory(cfg, st, {d.dataset: d.closed for d in snap.datasets})
    finally:
        if seaweedfs is not None:
            seaweedfs.stop()
    report["inventory"] = msgspec.to_builtins(inventory)
    report["rows"] = [{"dataset": row.dataset, "backend": side, "responses": n, "completion_tokens": t}
                      for row in inventory for side, (n, t) in sorted(row.by_side.items())]
    if as_json:
        print(msgspec.json.encode(report).decode())
    else:
        say("\n[bold]5. The inventory[/] `draftfleet inventory`, read from the store")
        for row in inventory:
            budget = f" (its budget: {row.budget_tokens:,})" if row.closed and row.budget_tokens else ""
            check = "validation ok" if row.valid else "[red]validation failed[/]"
            say(f"   [bold]{row.dataset}: {row.responses} responses, {row.completion_tokens:,} tokens[/]{budget}; "
                f"${row.spend_usd:.4f} spent; {check}")
            for side, (n, t) in sorted(row.by_side.items()):
                say(f"      {side}: {n} responses, {t:,} tokens")
        say(f"\nall of it in {time.monotonic() - started:.0f} s; nothing is left running.")
        if in_bucket:
            again = 'draftfleet s3 start; eval "$(draftfleet s3 env)"; ' if seaweedfs else ""  # its server was stopped
            say(f"next: {again}draftfleet export --store {store} --dataset chat -f sharegpt --out demo-export")
        elif keep:
            say(f"next: draftfleet export --config {folder / 'fleet.toml'} --dataset chat -f sharegpt "
                f"--out {folder / 'export'}")
        else:
            say("next: draftfleet demo --store demo   (keeps the store and config, then "
                "draftfleet export --config demo/fleet.toml --dataset chat -f sharegpt --out demo/export);\n"
                "      your own run: copy examples/fleet.toml, point it at your data and servers, "
                "then draftfleet enqueue")
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _settled(snap: status.Snapshot, store: Store, queued: dict[str, int]) -> bool:
    """Every prompt has its outcome: nothing queued, held or running, and each prompt of an open
    dataset stored or failed (a closed dataset's rest was skipped at its budget)."""
    for d in snap.datasets:
        if d.queue_depth or d.held or d.inflight:
            return False
        if not d.closed and len(store.keys(d.dataset)) + len(store.failures(d.dataset)) < queued[d.dataset]:
            return False
    return True


def _progress(d: status.DatasetRow) -> str:
    budget = f"/{d.budget_tokens:,}" if d.budget_tokens and d.budget_tokens < 100_000 else ""
    return f"{d.dataset}: {d.responses} done, {d.completion_tokens:,}{budget} tokens"


def _cloud_spend(store: Store, names: list[str]) -> float:
    return sum(rec.cost_usd for name in names for rec in store.records(name) if rec.backend_kind == "cloud")


def _inventory(cfg, store: Store, closed: dict[str, bool]) -> list[InventoryRow]:
    from draftfleet.tokenizer import TargetTokenizer
    from draftfleet.views.inventory import run_inventory

    rows = []
    for inv in run_inventory(cfg.fleet.store, cfg, tokenizer=TargetTokenizer.from_config(cfg.fleet), processes=1):
        v = inv.validation
        rows.append(InventoryRow(
            dataset=inv.dataset, responses=inv.responses, completion_tokens=inv.completion_tokens,
            budget_tokens=inv.budget_tokens, closed=closed.get(inv.dataset, False),
            by_side={f"{s.backend} ({s.token_source})": [s.responses, s.completion_tokens] for s in inv.by_source},
            spend_usd=inv.spend_usd, valid=_valid(v)))
    return rows


def _valid(v) -> bool:
    """The inventory's checks: records that decode, ids in the vocabulary, stops that end in end-of-turn."""
    return not (v.schema_errors or v.unreadable_files or v.ids_out_of_vocab or v.stop_without_eot
                or v.duplicate_prompts)
