"""``draftfleet plan``: the seed's pivot arithmetic computed, and an ETA only from live workers."""

from __future__ import annotations

import json
import re
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from draftfleet import redis_keys as rk
from draftfleet.assign import assign
from draftfleet.conversation import answers
from draftfleet.identity import prompt_key
from draftfleet.ledger import REFUSED, Ledger
from draftfleet.producer.enqueue import prompt_messages
from draftfleet.producer.readers import read_prompts
from draftfleet.queues import next_task
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import BatchSummary, Message, ResponseRecord, Turn, TurnProgress, Usage, WorkerReport
from draftfleet.store import Store, open_store
from draftfleet.views.metrics import FleetCollector
from draftfleet.views.plan import BackendMeasure, BatchMeasure, budget_from_store, headline, plan_dataset
from draftfleet.views.status import render, snapshot

from tests.conftest import run_cli, write_config, write_jsonl

SEED_RESPONSES, SEED_TOKENS, SEED_BUDGET, GPU_TPS = 1746, 5_741_932, 10_000_000, 90.0
SEED_LEFT = SEED_BUDGET - SEED_TOKENS  # 4,258,068: "~4.3M more to hit the 10M budget"


def seed_config(tmp_path, tokenizer_dir, prompts: int = 5000, budget: int = SEED_BUDGET, max_tokens: int = 8192,
                extra: str = ""):
    data = write_jsonl(tmp_path / "magicoder.jsonl", [{"prompt": f"write function number {i}"} for i in range(prompts)])
    path = tmp_path / "fleet.toml"
    path.write_text(f"""
[fleet]
store = "{tmp_path / 'store'}"
model = "moonshotai/Kimi-K2.5"
tokenizer = "{tokenizer_dir}"

[[datasets]]
name = "B3_magicoder"
path = "{data}"
budget_tokens = {budget}
max_tokens = {max_tokens}
{extra}
[backends.sglang]
urls = ["http://127.0.0.1:9"]

[backends.openrouter]
base_url = "http://127.0.0.1:9/v1"
model = "moonshotai/kimi-k2.5"
api_key_env = "OPENROUTER_API_KEY"
price_input_per_mtok = 0.0
price_output_per_mtok = 2.5
max_spend_usd = 20.0
""")
    return path


def record(key: str, dataset: str, n_tokens: int, *, backend="sglang", kind="gpu", created_at: float, latency_s: float,
           cost_usd=0.0, cost_source="none", worker="gpu-0") -> ResponseRecord:
    return ResponseRecord(
        key=key, dataset=dataset, source="magicoder.jsonl:1", settings_id="s", messages=[Message(role="user", content="p")],
        system_prompt_used=False, text="t", output_ids=[5] * n_tokens, prompt_tokens=50, completion_tokens=n_tokens,
        finish_reason="stop", truncated=False, backend=backend, backend_kind=kind,
        model="m", token_source="exact" if kind == "gpu" else "retokenized", usage=Usage(), cost_usd=cost_usd,
        cost_source=cost_source, latency_s=latency_s, attempts=1, worker=worker, created_at=created_at)


def seed_records(cfg, ended_at: float) -> list[ResponseRecord]:
    """The seed's B3: 1,746 responses, 5,741,932 tokens, made one at a time at 90 tok/s (the GPUs'
    single stream), under the keys of the dataset file's first 1,746 prompts."""
    ds = cfg.dataset("B3_magicoder")
    settings = ds.settings(cfg.fleet.model)
    keys = [prompt_key(ds.name, prompt_messages(ds, row), settings) for row in read_prompts(ds)][:SEED_RESPONSES]
    base, extra = divmod(SEED_TOKENS, SEED_RESPONSES)
    lengths = [base + (i < extra) for i in range(SEED_RESPONSES)]
    t = ended_at - SEED_TOKENS / GPU_TPS
    out = []
    for key, n in zip(keys, lengths):
        t += n / GPU_TPS
        out.append(record(key, ds.name, n, created_at=t, latency_s=n / GPU_TPS))
    return out


def test_plan_reproduces_the_seeds_arithmetic(tmp_path, redis_server, tokenizer_dir):
    """The seed's hand arithmetic, from a store shaped like its B3 (1,746 responses, 5.74M tokens,
    budget 10M), its GPUs at 90 tok/s and a cloud at $2.5/Mtok: ~4.26M tokens left, ~13 h on the
    GPUs, ~$10.6 on the cloud (configured price: nothing measured there yet)."""
    config = seed_config(tmp_path, tokenizer_dir)
    cfg = load_config(config)
    store = open_store(cfg)
    for rec in seed_records(cfg, ended_at=time.time() - 3600):  # stopped an hour ago: the window is empty
        assert store.put(rec)
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, "--json")
    assert cp.returncode == 0, cp.stderr
    (plan,) = json.loads(cp.stdout)
    assert plan["remaining_tokens"] == SEED_LEFT and plan["prompts_left"] == 5000 - SEED_RESPONSES
    gpu, cloud = plan["sides"]
    assert (gpu["backend"], gpu["rate_source"], gpu["price_source"]) == ("sglang", "run's mean", "local")
    assert abs(gpu["tokens_per_s"] - GPU_TPS) < 0.5
    assert abs(gpu["time_s"] / 3600 - 13.1) < 0.1 and gpu["cost_usd"] == 0  # 4,258,068 / 90 s = 13.14 h
    assert (cloud["backend"], cloud["price_source"], cloud["usd_per_mtok"]) == ("openrouter", "configured", 2.5)
    assert cloud["cost_usd"] == 10.6452 and cloud["time_s"] is None and cloud["rate_source"] == "not measured"
    assert plan["eta_s"] is None and plan["stalled"] == "no live cloud or gpu worker"

    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url)
    assert cp.returncode == 0, cp.stderr
    text = " ".join(cp.stdout.split())
    assert "4.26M tokens left of a 10.00M budget" in text and "stalled: no live cloud or gpu worker" in text
    assert "13h08m" in text and "10.65" in text and "$2.50/Mtok configured" in text, cp.stdout

    # status computes the same plan from Redis alone (the ledger's counters and busy time)
    r = redis_server.client()
    ledger = Ledger(r)
    for rec in sorted(store.records("B3_magicoder"), key=lambda rec: rec.created_at):  # counted as they end
        assert ledger.count(rec, now=rec.created_at)
    r.rpush(rk.queue("B3_magicoder"), *([b"{}"] * (5000 - SEED_RESPONSES)))
    snap = snapshot(cfg, r, ["B3_magicoder"])
    (p,) = snap.plans
    assert p.remaining_tokens == SEED_LEFT and abs(p.sides[0].tokens_per_s - GPU_TPS) < 0.5
    assert p.sides[0].rate_source == "run's mean" and p.sides[1].cost_usd == 10.6452
    assert snap.datasets[0].eta_s is None and snap.datasets[0].stalled == "no live cloud or gpu worker"


def test_measured_cloud_price_and_both_sides_at_once():
    """A cloud's price is measured from the provider's own reported cost once it has some (prompt
    tokens included), and both sides together finish sooner, paying only for the cloud's share."""
    measures = [BackendMeasure(backend="sglang", kind="gpu", window_tps=90.0, producing=True),
                BackendMeasure(backend="openrouter", kind="cloud", window_tps=2000.0, producing=True,
                               provider_tokens=1_000_000, provider_cost_usd=2.5, configured_usd_per_mtok=9.0)]
    p = plan_dataset("B3", responses=SEED_RESPONSES, completion_tokens=SEED_TOKENS,
                     budget=budget_from_store(SEED_BUDGET, SEED_TOKENS, 0, SEED_RESPONSES, 8192), prompts_left=None, measures=measures, assigned={"gpu", "cloud"}, workers_known=False)
    gpu, cloud = p.sides
    assert (cloud.usd_per_mtok, cloud.price_source, cloud.cost_usd) == (2.5, "measured", 10.6452)
    assert cloud.time_s == round(SEED_LEFT / 2000) and gpu.time_s == round(SEED_LEFT / 90)
    both = p.at_once
    assert both.tokens_per_s == 2090.0 and both.time_s == round(SEED_LEFT / 2090)
    assert both.cost_usd == round(SEED_LEFT * 2000 / 2090 * 2.5 / 1e6, 4)
    assert p.eta_s is None and p.stalled is None  # no worker reports read: neither an ETA nor a stall


def test_a_small_runs_cost_is_not_rounded_to_zero():
    """2,000 tokens left at $2.5/Mtok cost half a cent: the plan keeps it and shows four decimals
    under a dollar (as inventory shows spend), not ``0.00``; so for a price under a dollar per Mtok."""
    from rich.console import Console

    from draftfleet.views.plan import render_plans

    measures = [BackendMeasure(backend="openrouter", kind="cloud", window_tps=100.0, producing=True,
                               provider_tokens=8000, provider_cost_usd=0.02),
                BackendMeasure(backend="cheap", kind="cloud", configured_usd_per_mtok=0.5)]
    p = plan_dataset("tiny", responses=10, completion_tokens=8000, budget=budget_from_store(10_000, 8000, 0, 10, 1000),
                     prompts_left=None,
                     measures=measures, assigned={"cloud"}, workers_known=False)
    sides = {s.backend: s for s in p.sides}
    assert sides["openrouter"].cost_usd == 0.005 and sides["cheap"].cost_usd == 0.001
    console = Console(width=120, record=True, file=open("/dev/null", "w"))
    console.print(render_plans([p]))
    text = console.export_text()
    assert "0.0050" in text and "0.0010" in text and "$0.5000/Mtok configured" in text, text
    assert "0.00 " not in text, text


def test_a_cloud_without_a_price_is_shown_not_priced(tmp_path):
    """A cloud's records without the provider's cost and no config to price it (``inventory --store``
    alone): the plan says "no price" (the table raised a TypeError formatting the missing price)."""
    from tests.test_inventory import _rec

    store = open_store(tmp_path)
    for i in range(3):
        assert store.put(_rec(i, [5] * 100, source="retokenized", backend="cloudy"))
    cp = run_cli("inventory", "--store", str(tmp_path), env={"COLUMNS": "200"})
    assert cp.returncode == 0, cp.stderr
    assert "cloudy (cloud)" in cp.stdout and "no price" in cp.stdout, cp.stdout


def _report(r, hostname: str, kind: str, backend: str, datasets: list[str], paused: str | None = None) -> None:
    w = WorkerReport(hostname=hostname, kind=kind, backend=backend, datasets=datasets, follows=datasets,
                     paused=paused, at=time.time())
    r.set(rk.worker_report(hostname), msgspec.json.encode(w), ex=60)


def _running_seed(tmp_path, redis_server, tokenizer_dir):
    """A fleet whose GPU made 12,000 tokens over the last two minutes; 100 prompts queued."""
    cfg = load_config(seed_config(tmp_path, tokenizer_dir, prompts=10))
    r = redis_server.client()
    ledger = Ledger(r)
    now = time.time()
    for i in range(12):
        rec = record(f"{i:064x}", "B3_magicoder", 1000, created_at=now - 120 + i * 10, latency_s=10.0)
        assert ledger.count(rec, now=rec.created_at)
    r.rpush(rk.queue("B3_magicoder"), *([b"{}"] * 100))
    return cfg, r


def test_no_live_worker_no_eta(tmp_path, redis_server, tokenizer_dir):
    """Every worker stopped: the tokens of the last minutes are no ETA (it said ``ETA 8m20s`` over an
    empty workers table); status says the dataset is stalled, and why."""
    cfg, r = _running_seed(tmp_path, redis_server, tokenizer_dir)
    d = snapshot(cfg, r, ["B3_magicoder"]).datasets[0]
    assert d.tps_10m > 0 and d.eta_s is None and d.stalled == "no live cloud or gpu worker"
    from rich.console import Console

    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(render(snapshot(cfg, r, ["B3_magicoder"])))
    text = console.export_text()
    assert "stalled" in text and "no live cloud or gpu worker" in text

    _report(r, "gpu-0", "gpu", "sglang", ["B3_magicoder"])
    d = snapshot(cfg, r, ["B3_magicoder"]).datasets[0]
    assert d.stalled is None and d.eta_s is not None
    assert abs(d.eta_s - 100_000 / d.tps_10m) <= 1  # 100 prompts of 1,000 tokens at the GPU's rate

    _report(r, "gpu-0", "gpu", "sglang", ["B3_magicoder"], paused="payment_required")
    d = snapshot(cfg, r, ["B3_magicoder"]).datasets[0]
    assert d.eta_s is None and d.stalled  # a paused worker takes nothing


def test_after_a_pivot_the_eta_is_the_clouds(tmp_path, redis_server, tokenizer_dir):
    """Pivoted to the cloud: the GPU's earlier rate is no part of the ETA (its worker still reports,
    drained); with no live cloud worker the dataset is stalled, and pivot warns of it."""
    cfg, r = _running_seed(tmp_path, redis_server, tokenizer_dir)
    _report(r, "gpu-0", "gpu", "sglang", [])  # drained: allowed nothing
    assign(r, "B3_magicoder", {"cloud"})
    d = snapshot(cfg, r, ["B3_magicoder"]).datasets[0]
    assert d.eta_s is None and d.stalled == "no live cloud worker"

    _report(r, "cloud-0", "cloud", "openrouter", ["B3_magicoder"])
    ledger, now = Ledger(r), time.time()
    for i in range(6):  # the cloud: 6,000 tokens over the last minute
        rec = record(f"{100 + i:064x}", "B3_magicoder", 1000, backend="openrouter", kind="cloud",
                     created_at=now - 55 + i * 10, latency_s=5.0, cost_usd=0.0025, cost_source="provider")
        assert ledger.count(rec, now=rec.created_at)
    snap = snapshot(cfg, r, ["B3_magicoder"])
    (p,) = snap.plans
    cloud = next(s for s in p.sides if s.backend == "openrouter")
    assert cloud.live_workers == 1 and cloud.price_source == "measured" and cloud.usd_per_mtok == 2.5
    assert snap.datasets[0].eta_s == round(p.remaining_tokens / cloud.tokens_per_s)  # the cloud's rate alone


def test_pivot_warns_when_no_live_worker_of_the_target_kind(tmp_path, redis_server, tokenizer_dir):
    """``pivot --dry-run`` changes nothing and prints the plan; a pivot to a kind no live worker
    serves says so (a paused one says why)."""
    config = seed_config(tmp_path, tokenizer_dir, prompts=10)
    r = redis_server.client()
    assign(r, "B3_magicoder", {"gpu"})
    cp = run_cli("pivot", "--to", "cloud", "--dry-run", "--config", str(config), "--redis-url", redis_server.url)
    assert cp.returncode == 0, cp.stderr
    assert "dry run" in cp.stdout and "B3_magicoder: gpu" in cp.stdout and "tokens left" in cp.stdout
    assert "no live cloud worker takes B3_magicoder" in " ".join(cp.stderr.split())
    assert {m.decode() for m in r.smembers(rk.assignment("B3_magicoder"))} == {"gpu"}  # unchanged

    _report(r, "cloud-0", "cloud", "openrouter", ["B3_magicoder"], paused="payment_required")
    cp = run_cli("pivot", "--to", "cloud", "--config", str(config), "--redis-url", redis_server.url, "--timeout", "5")
    assert cp.returncode == 0, cp.stderr
    assert "cloud-0 paused: payment_required" in " ".join(cp.stderr.split())
    assert {m.decode() for m in r.smembers(rk.assignment("B3_magicoder"))} == {"cloud"}
    (event,) = open_store(load_config(config)).events("B3_magicoder")  # the report marks it on its timelines
    assert (event.kind, event.assigned, event.note) == ("assign", ["cloud"], "pivot")

    _report(r, "cloud-0", "cloud", "openrouter", ["B3_magicoder"])
    cp = run_cli("pivot", "--to", "cloud", "--config", str(config), "--redis-url", redis_server.url, "--timeout", "5")
    assert cp.returncode == 0 and "warning" not in cp.stderr, cp.stderr


def test_imported_records_are_no_backends_rate(tmp_path, redis_server):
    """Records brought in by import (or counted late by the reconciler) fill no rate bucket and no
    busy time: a seed-shaped import showed ``tps_1m`` 11,737 and ``eta_s`` 48 with 4.2M tokens left."""
    from draftfleet.reconcile import Reconciler

    r = redis_server.client()
    ledger = Ledger(r)
    store = open_store(tmp_path / "store")
    now = time.time()
    recs = [record(f"{i:064x}", "B3", 3288, created_at=now, latency_s=0.0, worker="import") for i in range(20)]
    for rec in recs[:10]:
        assert store.put(rec) and ledger.count(rec, rate=False)
    for rec in recs[10:]:  # stored, never counted: the reconciler counts them
        assert store.put(rec)
    assert Reconciler(store, r).reconcile("B3").newly_counted == 10
    assert ledger.totals("B3")["sglang"]["completion_tokens"] == 20 * 3288
    assert ledger.rates("B3", ["sglang"], [60, 600]) == {"sglang": [0.0, 0.0]}
    assert "busy_ms" not in ledger.totals("B3")["sglang"]


def _kept_turns(store: Store, ledger: Ledger, conversations: int, sizes: tuple[int, ...], now: float) -> None:
    """Conversations of B3_magicoder handed back between turns: turns of ``sizes`` tokens, paid (marked in
    the ledger) and kept in ``_progress/``."""
    for c in range(conversations):
        key = f"{100 + c:064x}"
        turns = [msgspec.convert({**msgspec.to_builtins(record(key, "B3_magicoder", n, backend="openrouter", kind="cloud",
                                                               created_at=now - 30, latency_s=1.0)), "prompt_ids": [1]},
                                 Turn) for n in sizes]
        store.put_progress(TurnProgress(key=key, dataset="B3_magicoder", turns=turns))
        for i, t in enumerate(turns):
            assert ledger.prepay("B3_magicoder", key, i, "openrouter", t.cost_usd, t.completion_tokens)


def test_paid_turns_are_spent_in_every_view_as_admission_counts_them(tmp_path, redis_server, tokenizer_dir):
    """Issue 26, item 5: conversations handed back between turns have paid 900 tokens of a 1,000
    budget (kept in ``_progress/``, marked in the ledger) and one record of 95 tokens is stored, made
    by a live cloud worker a minute ago. Near the end a prompt is granted what is left, but at least
    the floor (1% of the budget: 10): with 5 left admission refuses, so plan, status, metrics and
    report say 5 left, the dataset full, and no ETA (before: 905 left and an ETA). Once admission has
    refused, they say closed, 5 left."""
    config = seed_config(tmp_path, tokenizer_dir, prompts=50, budget=1000, max_tokens=256, extra='turns = "all"')
    cfg = load_config(config)
    store = open_store(cfg)
    r = redis_server.client()
    r.set(rk.COUNTERS_BUILT, "by hand")  # the counters below are made as the store's: admission trusts them
    ledger, now = Ledger(r), time.time()
    rec = record(f"{1:064x}", "B3_magicoder", 95, backend="openrouter", kind="cloud", created_at=now - 60, latency_s=2.0,
                 cost_usd=0.00005, cost_source="provider")
    assert store.put(rec) and ledger.count(rec, now=rec.created_at)
    _kept_turns(store, ledger, 3, (100, 200), now)  # three conversations, each with turns of 100 + 200 tokens
    _report(r, "cloud-0", "cloud", "openrouter", ["B3_magicoder"])
    r.rpush(rk.queue("B3_magicoder"), *([b"{}"] * 10))
    env = {"REDIS_URL": redis_server.url}

    def views() -> list[tuple[str, int, float | None, str]]:
        """(view, budget left, ETA, state) as plan, status, metrics and report say them."""
        cp = run_cli("plan", "--config", str(config), "--json", env=env)
        assert cp.returncode == 0, cp.stderr
        (plan,) = json.loads(cp.stdout)
        got = [("plan", plan["budget"]["left_tokens"], plan["eta_s"], plan["state"])]
        assert plan["budget"]["spent_tokens"] == 995 and plan["budget"]["paid_tokens"] == 900
        cp = run_cli("status", "--config", str(config), "--json", env=env)
        assert cp.returncode == 0, cp.stderr
        snap = json.loads(cp.stdout)
        (row,), (splan,) = snap["datasets"], snap["plans"]
        got.append(("status", row["remaining_tokens"], row["eta_s"], splan["state"]))
        assert row["budget"]["left_tokens"] == row["remaining_tokens"] and row["share_done"] == 0.995
        registry = CollectorRegistry()
        registry.register(FleetCollector(cfg, r))
        samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
                   for s in f.samples if s.labels.get("dataset") == "B3_magicoder"}
        assert samples["draftfleet_budget_spent_tokens"] == 995 and samples["draftfleet_plan_remaining_tokens"] == 0
        got.append(("metrics", samples["draftfleet_budget_left_tokens"], samples.get("draftfleet_eta_seconds"),
                    "-"))
        out = tmp_path / "run.html"
        cp = run_cli("report", "--config", str(config), "--out", str(out), env=env)
        assert cp.returncode == 0, cp.stderr
        page = " ".join(re.sub(r"<[^>]+>", " ", out.read_text()).split())
        assert "995 of a 1,000 budget spent (99.5%, 900 of them in paid turns of conversations not stored yet)" in page
        left = int(re.search(r"budget spent \([^)]*\), ([\d,]+) left", page).group(1).replace(",", ""))
        state = "full" if "B3_magicoder: full:" in page else "closed" if "B3_magicoder: closed at its budget" in page else "open"
        got.append(("report", left, None if "ETA" not in page else page, state))
        return got

    before = views()
    print("\n" + "\n".join(map(str, before)))
    assert before == [("plan", 5, None, "full"), ("status", 5, None, "full"), ("metrics", 5, None, "-"),
                      ("report", 5, None, "full")]
    r.set(rk.claim("B3_magicoder", "ask"), "w", ex=60)
    assert ledger.admit("B3_magicoder", "ask", "w", 1000, 256).verdict == REFUSED
    after = views()
    assert after == [("plan", 5, None, "closed"), ("status", 5, None, "closed"), ("metrics", 5, None, "-"),
                     ("report", 5, None, "closed")]


def test_a_new_conversation_reserves_its_turns_in_every_view_as_admission_does(tmp_path, redis_server, tokenizer_dir):
    """A new conversation reserves the most its turns can make (256 x 3 = 768 for the 3-turn
    conversations enqueued here), and near the end its floor is that, not one answer's 256 (the floor
    is 1% of the budget, 1,000 here, never more than the task asks). With 99,500 of a 100,000 budget
    spent (99,480 in kept turns, one record of 20 made a minute ago by a live cloud worker), 500 are
    left: less than the conversation's floor, so admission refuses the next one, and plan, status and
    metrics say full and no ETA (a view that took one answer's floor would say open), then closed."""
    config = seed_config(tmp_path, tokenizer_dir, prompts=1, budget=100_000, max_tokens=256, extra='turns = "all"')
    write_jsonl(tmp_path / "magicoder.jsonl", [{"messages": [m for t in range(3) for m in (
        {"role": "user", "content": f"conversation {i} turn {t}"}, {"role": "assistant", "content": "x"})]}
        for i in range(6)])
    cfg = load_config(config)
    store = open_store(cfg)
    r = redis_server.client()
    env = {"REDIS_URL": redis_server.url}
    cp = run_cli("enqueue", "--config", str(config), "--json", env=env)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)[0]["queued"] == 6
    ledger, now = Ledger(r), time.time()
    rec = record(f"{1:064x}", "B3_magicoder", 20, backend="openrouter", kind="cloud", created_at=now - 60, latency_s=2.0)
    assert store.put(rec) and ledger.count(rec, now=rec.created_at)
    _kept_turns(store, ledger, 2, (30_000, 19_740), now)  # two conversations stopped after two long turns
    _report(r, "cloud-0", "cloud", "openrouter", ["B3_magicoder"])

    def views() -> list[tuple[str, int, int, float | None, str]]:
        """(view, budget left, floor, ETA, state) as plan, status and metrics say them."""
        cp = run_cli("plan", "--config", str(config), "--json", env=env)
        assert cp.returncode == 0, cp.stderr
        (plan,) = json.loads(cp.stdout)
        assert plan["budget"]["spent_tokens"] == 99_500 and plan["budget"]["paid_tokens"] == 99_480
        got = [("plan", plan["budget"]["left_tokens"], plan["budget"]["floor_tokens"], plan["eta_s"], plan["state"])]
        cp = run_cli("status", "--config", str(config), "--json", env=env)
        assert cp.returncode == 0, cp.stderr
        snap = json.loads(cp.stdout)
        (row,), (splan,) = snap["datasets"], snap["plans"]
        got.append(("status", row["remaining_tokens"], row["budget"]["floor_tokens"], row["eta_s"], splan["state"]))
        registry = CollectorRegistry()
        registry.register(FleetCollector(cfg, r))
        samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
                   for s in f.samples if s.labels.get("dataset") == "B3_magicoder"}
        got.append(("metrics", samples["draftfleet_budget_left_tokens"], "-", samples.get("draftfleet_eta_seconds"),
                    "-"))
        return got

    before = views()
    print("\n" + "\n".join(map(str, before)))
    assert before == [("plan", 500, 768, None, "full"), ("status", 500, 768, None, "full"), ("metrics", 500, "-", None, "-")]
    # the worker's own admission of the task it takes next: its turns, what it asks, the verdict
    task = next_task(r, "B3_magicoder")
    assert answers(task) == 3
    r.set(rk.claim("B3_magicoder", task.key), "w", ex=60)
    assert ledger.admit("B3_magicoder", task.key, "w", 100_000, 256 * answers(task)).verdict == REFUSED
    assert views() == [("plan", 500, 768, None, "closed"), ("status", 500, 768, None, "closed"),
                       ("metrics", 500, "-", None, "-")]


def test_a_batch_api_is_a_third_way_to_finish_at_half_the_money(tmp_path, redis_server, tokenizer_dir):
    """Issue 43: a cloud backend with a batch API plans a third side: the money at the batch price (half
    the configured $2.5/Mtok: ~$5.32 for the seed's 4.26M tokens) and the time of its window; once a
    batch runs, the time from the provider's progress on it."""
    from draftfleet.batches import publish
    from draftfleet.schemas.records import BatchRecord, BatchRequest, GenerationSettings, PromptTask

    config = seed_config(tmp_path, tokenizer_dir)
    config.write_text(config.read_text() + 'batch = "openrouter"\n')  # [backends.openrouter] is the last table
    cfg = load_config(config)
    store = open_store(cfg)
    for rec in seed_records(cfg, ended_at=time.time() - 3600):
        assert store.put(rec)
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, "--json")
    assert cp.returncode == 0, cp.stderr
    (plan,) = json.loads(cp.stdout)
    gpu, cloud, batch = plan["sides"]
    assert (batch["backend"], batch["kind"], batch["price_source"]) == ("openrouter", "batch", "batch price")
    assert batch["usd_per_mtok"] == 1.25 and batch["cost_usd"] == pytest.approx(cloud["cost_usd"] / 2, abs=1e-4)
    assert batch["time_s"] == 86400 and batch["rate_source"] == "the 24h window"
    assert plan["at_once"] is None  # a batch is not a speed to add to the others
    text = " ".join(run_cli("plan", "--config", str(config), "--redis-url", redis_server.url,
                            env={"COLUMNS": "200"}).stdout.split())
    assert "openrouter (batch API) - 1d00h 5.32 time: the 24h window; $1.25/Mtok batch price" in text
    assert "; by batch on openrouter: $5.32, about half the money, within a day" in text  # the headline

    # a batch of 200 prompts, 100 of them back after 1,000 s: ~100 x 3,288 tokens / 1,000 s
    task = PromptTask(key="ab" * 32, dataset="B3_magicoder", source="f:1", messages=[Message(role="user", content="p")],
                      settings=GenerationSettings(model="m", max_tokens=8192, temperature=0.0, top_p=1.0),
                      settings_id="s", enqueued_at=0.0)
    r = redis_server.client()
    for rec in store.records("B3_magicoder"):  # status plans from the ledger's counters
        assert Ledger(r).count(rec, rate=False)
    r.rpush(rk.queue("B3_magicoder"), *([b"{}"] * (5000 - SEED_RESPONSES)))
    publish(r, BatchRecord(id="b00000000000000000001-0000beef", backend="openrouter", shape="openrouter",
                           dataset="B3_magicoder", model="m", provider_id="batch_1", status="in_progress",
                           worker="w", submitted_at=time.time() - 1000, updated_at=time.time(), completed=100,
                           requests=[BatchRequest(task=task, granted=8192, digest="d")] * 200))
    snap = snapshot(cfg, r, ["B3_magicoder"])
    (p,) = snap.plans
    side = next(s for s in p.sides if s.kind == "batch")
    mean = SEED_TOKENS / SEED_RESPONSES
    assert side.rate_source == "provider's progress" and side.tokens_per_s == pytest.approx(100 * mean / 1000, rel=0.01)
    assert side.time_s == pytest.approx(SEED_LEFT / (100 * mean / 1000), rel=0.01)


def test_a_backend_without_a_batch_api_has_no_batch_side(tmp_path, redis_server, tokenizer_dir):
    cfg = load_config(seed_config(tmp_path, tokenizer_dir, prompts=10))
    (p,) = snapshot(cfg, redis_server.client(), ["B3_magicoder"]).plans
    assert [s.kind for s in p.sides] == ["gpu", "cloud"]


def _cloudy_batch(tmp_path, redis_server, tokenizer_dir, cloud_extra='batch = "openai"'):
    """conftest's fleet (SGLang, and ``cloudy`` at $1/$2 per Mtok in/out) with a batch API on cloudy; a
    dataset of 100 prompts, 10 answered by cloudy (1,000 tokens, 50 prompt tokens each), stored and
    counted; the 90 others queued: 90,000 tokens left at $2.05/Mtok on the cloud."""
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(100)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url="http://127.0.0.1:9", cloud_extra=cloud_extra,
                          datasets=[{"name": "ds", "path": str(data), "budget_tokens": 1_000_000, "max_tokens": 1000}])
    cfg = load_config(config)
    ds = cfg.dataset("ds")
    keys = [prompt_key(ds.name, prompt_messages(ds, row), ds.settings(cfg.fleet.model)) for row in read_prompts(ds)]
    store, r, now = open_store(cfg), redis_server.client(), time.time()
    for i, key in enumerate(keys[:10]):
        rec = record(key, "ds", 1000, backend="cloudy", kind="cloud", created_at=now - 7200 + i, latency_s=1.0,
                     worker="cloud-0")
        assert store.put(rec) and Ledger(r).count(rec, rate=False)
    r.rpush(rk.queue("ds"), *([b"{}"] * 90))
    return config, cfg, r


def _open_batch(r, *, completed: int, age_s: float, prompts: int = 40, backend: str = "cloudy") -> None:
    from draftfleet.schemas.records import BatchSummary

    now = time.time()
    r.hset(rk.BATCHES, f"b-{backend}", msgspec.json.encode(BatchSummary(
        id=f"b-{backend}", backend=backend, dataset="ds", provider_id="batch_1", status="in_progress", prompts=prompts,
        granted_tokens=prompts * 1000, completed=completed, failed=0, submitted_at=now - age_s, updated_at=now,
        window="24h", cancellable=True, cancel_requested=False)))


def test_a_batch_side_at_half_the_clouds_money_in_its_window_in_plan_and_status_json(tmp_path, redis_server,
                                                                                     tokenizer_dir):
    config, cfg, r = _cloudy_batch(tmp_path, redis_server, tokenizer_dir)
    for cmd in ("plan", "status"):
        cp = run_cli(cmd, "--config", str(config), "--redis-url", redis_server.url, "--json")
        assert cp.returncode == 0, cp.stderr
        out = json.loads(cp.stdout)
        (plan,) = out if cmd == "plan" else out["plans"]
        assert plan["remaining_tokens"] == 90_000 and plan["prompts_left"] == 90, cmd
        assert [(s["backend"], s["kind"]) for s in plan["sides"]] == [("sglang", "gpu"), ("cloudy", "cloud"),
                                                                       ("cloudy", "batch")], cmd
        gpu, cloud, batch = plan["sides"]
        assert set(batch) == set(cloud) == set(gpu), cmd  # the same fields as every side
        assert cloud["usd_per_mtok"] == 2.05 and cloud["cost_usd"] == pytest.approx(0.1845), cmd
        assert (batch["usd_per_mtok"], batch["price_source"]) == (1.025, "batch price"), cmd
        assert batch["cost_usd"] == pytest.approx(cloud["cost_usd"] / 2, abs=1e-4), cmd
        assert (batch["time_s"], batch["rate_source"], batch["tokens_per_s"]) == (86400, "the 24h window", None), cmd
        assert batch["assigned"] and batch["live_workers"] == 0, cmd
    (p,) = snapshot(cfg, r, ["ds"]).plans
    assert headline(p).endswith("; by batch on cloudy: $0.0922, about half the money, within a day")


def test_the_batch_sides_time_comes_from_the_providers_progress_on_open_batches(tmp_path, redis_server,
                                                                                 tokenizer_dir):
    """20 of an open batch's requests back in 1,000 s: 0.02 requests/s, so the 90 prompts left take
    ~4,500 s (not the window); a live batch worker alone gives the dataset that ETA. A batch that
    crawls is capped at the window; another backend's batch is not this one's progress."""
    config, cfg, r = _cloudy_batch(tmp_path, redis_server, tokenizer_dir)
    _open_batch(r, completed=20, age_s=1000)
    _open_batch(r, completed=40, age_s=10, backend="elsewhere")
    (p,) = snapshot(cfg, r, ["ds"]).plans
    batch = p.sides[-1]
    assert (batch.kind, batch.rate_source) == ("batch", "provider's progress")
    assert batch.tokens_per_s == pytest.approx(20.0, rel=0.01)  # 0.02 requests/s at the mean 1,000 tokens
    assert batch.time_s == pytest.approx(4500, rel=0.01) and batch.cost_usd == pytest.approx(0.0922, abs=1e-4)
    assert p.at_once is None and p.eta_s is None and p.stalled == "no live cloud or gpu worker"
    assert "in about 1h1" in headline(p) and "at the provider's progress" in headline(p)

    _report(r, "batch-0", "batch", "cloudy", ["ds"])
    (p,) = snapshot(cfg, r, ["ds"]).plans
    assert p.sides[-1].live_workers == 1 and p.sides[1].live_workers == 0  # a batch worker is not a cloud worker
    assert p.stalled is None and p.eta_s == pytest.approx(4500, rel=0.01)
    assert p.eta_kinds == ["batch"] and "; ETA 1h1" in headline(p) and "(batch)" in headline(p)  # not "cloud+gpu"
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, env={"COLUMNS": "200"})
    text = " ".join(cp.stdout.split())
    assert "cloudy (batch API) 20 1h1" in text and "time: provider's progress; $1.02/Mtok batch price; 1 batch" in text

    _open_batch(r, completed=1, age_s=1000)  # 0.001 requests/s: 90,000 s, past the window
    (p,) = snapshot(cfg, r, ["ds"]).plans
    assert (p.sides[-1].time_s, p.sides[-1].rate_source) == (86400, "provider's progress") and p.eta_s == 86400

    _open_batch(r, completed=0, age_s=1000)  # nothing back yet: the window; a live batch worker's ETA is it
    (p,) = snapshot(cfg, r, ["ds"]).plans
    assert (p.sides[-1].time_s, p.sides[-1].rate_source, p.eta_s) == (86400, "the 24h window", 86400)


def test_a_cloudy_without_a_batch_api_has_no_batch_side(tmp_path, redis_server, tokenizer_dir):
    config, cfg, r = _cloudy_batch(tmp_path, redis_server, tokenizer_dir, cloud_extra="")
    _open_batch(r, completed=20, age_s=1000)
    (p,) = snapshot(cfg, r, ["ds"]).plans
    assert [s.kind for s in p.sides] == ["gpu", "cloud"] and "batch" not in headline(p)
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, "--json")
    assert [s["kind"] for s in json.loads(cp.stdout)[0]["sides"]] == ["gpu", "cloud"]


def test_a_batch_side_from_figures_alone():
    """No answer yet (no mean length), no budget: the progress applies to the prompts left; no
    price, no money; a batch dearer than the cloud is not in the headline."""
    b = BatchMeasure(backend="c", usd_per_mtok=None, price_source="not priced", window="24h", window_s=86400,
                     progress_rps=0.01)
    p = plan_dataset("d", responses=0, completion_tokens=0, budget=None, prompts_left=100, measures=[],
                     assigned={"cloud"}, batches=[b])
    (side,) = p.sides
    assert (side.time_s, side.tokens_per_s, side.cost_usd, side.rate_source) == (10_000, None, None,
                                                                                 "provider's progress")
    cloud = BackendMeasure(backend="c", kind="cloud", configured_usd_per_mtok=1.0)
    dear = msgspec.structs.replace(b, usd_per_mtok=3.0, price_source="batch price", progress_rps=None)
    p = plan_dataset("d", responses=10, completion_tokens=10_000, budget=None, prompts_left=90, measures=[cloud],
                     assigned={"cloud"}, batches=[dear])
    assert [(s.kind, s.cost_usd, s.time_s) for s in p.sides] == [("cloud", 0.09, None), ("batch", 0.27, 86400)]
    assert "batch" not in headline(p)
    p = plan_dataset("d", responses=10, completion_tokens=10_000, budget=None, prompts_left=0, measures=[cloud],
                     assigned={"cloud"}, batches=[dear])
    assert p.state == "done" and p.sides[-1].time_s == 0 and p.sides[-1].cost_usd == 0


def test_prompts_in_open_batches_are_left_until_their_batch_closes(tmp_path, redis_server, tokenizer_dir):
    """A prompt in an open provider batch is neither queued nor held nor stored: status (Redis) and plan
    (the store) call the dataset done only once its batch is closed, and say how many are out."""
    config, cfg, r = _cloudy_batch(tmp_path, redis_server, tokenizer_dir)
    r.delete(rk.queue("ds"))  # the 90 left all went into a batch
    _open_batch(r, completed=0, age_s=60, prompts=90)
    r.hset(rk.BATCHES, "b-cloudy", msgspec.json.encode(msgspec.structs.replace(
        msgspec.json.decode(r.hget(rk.BATCHES, "b-cloudy"), type=BatchSummary), held_prompts=90)))
    snap = snapshot(cfg, r, ["ds"])
    (p,), (row,) = snap.plans, snap.datasets
    assert (p.state, p.prompts_left, p.in_batch, p.remaining_tokens) == ("open", 90, 90, 90_000)
    assert "90 prompts left (90 of them in open batches)" in headline(p)
    assert not row.finished and row.in_batch == 90 and row.queue_depth == 0
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, "--json")
    (plan,) = json.loads(cp.stdout)
    assert (plan["state"], plan["prompts_left"], plan["in_batch"]) == ("open", 90, 90)  # the store's 90 not stored
    cp = run_cli("status", "--config", str(config), "--redis-url", redis_server.url, env={"COLUMNS": "200"})
    (row,) = [line for line in cp.stdout.splitlines() if line.lstrip().startswith("ds (")]
    assert "batched" in cp.stdout and row.split()[2:5] == ["0", "0", "90"], cp.stdout  # queued, running, batched

    r.hdel(rk.BATCHES, "b-cloudy")  # closed: its prompts are stored, failed or queued again
    snap = snapshot(cfg, r, ["ds"])
    (p,), (row,) = snap.plans, snap.datasets
    assert (p.state, p.in_batch) == ("done", 0) and row.finished


def test_batch_answers_price_the_batch_side_and_leave_the_clouds_measures_alone(tmp_path, redis_server,
                                                                                  tokenizer_dir):
    """Ten sync answers at the provider's $2/Mtok in 1 s each, ten batch answers at $1/Mtok an hour
    after their batch was submitted: the cloud side is measured at $2/Mtok and 1,000 tok/s in every
    view (not $1.50 and a few tok/s); the batch side at the batch answers' own $1/Mtok."""
    config, cfg, r = _cloudy_batch(tmp_path, redis_server, tokenizer_dir)
    ds = cfg.dataset("ds")
    keys = [prompt_key(ds.name, prompt_messages(ds, row), ds.settings(cfg.fleet.model)) for row in read_prompts(ds)]
    store, ledger, now = open_store(cfg), Ledger(r), time.time()
    r.flushall()
    for f in (tmp_path / "store" / "ds").rglob("*.json"):
        f.unlink()
    for i, key in enumerate(keys[:20]):
        batch = i >= 10
        rec = record(key, "ds", 1000, backend="cloudy", kind="cloud", created_at=now - 3600 + 2 * i,
                     latency_s=3600.0 if batch else 1.0, worker="cloud-0", cost_source="provider",
                     cost_usd=0.001 if batch else 0.002)
        rec = msgspec.structs.replace(rec, batch_id="b-1" if batch else msgspec.UNSET)
        assert store.put(rec) and ledger.count(rec, rate=False)
    r.set(rk.COUNTERS_BUILT, 1)
    redis_side = next(s for s in snapshot(cfg, r, ["ds"]).plans[0].sides if s.kind == "cloud")
    assert (redis_side.usd_per_mtok, redis_side.price_source) == (2.0, "measured")
    cp = run_cli("plan", "--config", str(config), "--redis-url", redis_server.url, "--json")
    (plan,) = json.loads(cp.stdout)
    cloud, batch = (next(s for s in plan["sides"] if s["kind"] == k) for k in ("cloud", "batch"))
    assert (cloud["usd_per_mtok"], cloud["price_source"]) == (2.0, "measured")
    assert cloud["tokens_per_s"] == pytest.approx(1000, rel=0.01) and cloud["rate_source"] == "run's mean"
    assert (batch["usd_per_mtok"], batch["price_source"]) == (1.0, "measured (batch answers)")
    cp = run_cli("inventory", "--config", str(config), "--json")
    (inv,) = json.loads(cp.stdout) if cp.stdout.lstrip().startswith("[") else json.loads(cp.stdout)["datasets"]
    acts = {(a["backend"], a["kind"]): a for a in inv["activity"]}
    assert acts[("cloudy", "cloud")]["busy_s"] == pytest.approx(10, abs=0.01)
    assert acts[("cloudy", "batch")]["busy_s"] == 0 and acts[("cloudy", "batch")]["provider_cost_usd"] == 0.01
