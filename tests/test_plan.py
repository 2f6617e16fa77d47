"""``draftfleet plan``: the seed's pivot arithmetic computed, and an ETA only from live workers."""

from __future__ import annotations

import json
import re
import time

import msgspec
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
from draftfleet.schemas.records import Message, ResponseRecord, Turn, TurnProgress, Usage, WorkerReport
from draftfleet.store import Store, open_store
from draftfleet.views.metrics import FleetCollector
from draftfleet.views.plan import BackendMeasure, budget_from_store, plan_dataset
from draftfleet.views.status import render, snapshot

from tests.conftest import run_cli, write_jsonl

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
