"""The reconciler's Prometheus metrics: per-backend tokens/s and the plan; the Grafana dashboard
(``ops/grafana/draftfleet.json``) queries only what a real scrape exports."""

from __future__ import annotations

import json
import re
import time

import httpx
import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import WorkerReport
from draftfleet.views.metrics import FleetCollector

from tests.conftest import REPO, free_port
from tests.test_plan import record, seed_config

DASHBOARD = REPO / "ops" / "grafana" / "draftfleet.json"


def scrape(tmp_path, redis_server, tokenizer_dir) -> dict[str, list]:
    """A fleet with a GPU and a cloud backend at work, a live cloud worker, a retry; its /metrics over HTTP."""
    cfg = load_config(seed_config(tmp_path, tokenizer_dir, prompts=10))
    r = redis_server.client()
    ledger, now = Ledger(r), time.time()
    for i in range(12):
        gpu = record(f"{i:064x}", "B3_magicoder", 900, created_at=now - 120 + i * 10, latency_s=10.0)
        cloud = record(f"{100 + i:064x}", "B3_magicoder", 1000, backend="openrouter", kind="cloud",
                       created_at=now - 60 + i * 5, latency_s=4.0, cost_usd=0.0025, cost_source="provider")
        assert ledger.count(gpu, now=gpu.created_at) and ledger.count(cloud, now=cloud.created_at)
    ledger.event("B3_magicoder", "retry:http_429")
    r.rpush(rk.queue("B3_magicoder"), *([b"{}"] * 50))
    w = WorkerReport(hostname="cloud-0", kind="cloud", backend="openrouter", datasets=["B3_magicoder"], at=now)
    r.set(rk.worker_report("cloud-0"), msgspec.json.encode(w), ex=60)
    registry = CollectorRegistry()
    registry.register(FleetCollector(cfg, r))
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
        thread.join(5)
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s.labels)
    return samples


def test_backend_rates_and_the_plan_are_exported(tmp_path, redis_server, tokenizer_dir):
    samples = scrape(tmp_path, redis_server, tokenizer_dir)
    windows = {(s["backend"], s["window"]) for s in samples["draftfleet_backend_tokens_per_second"]}
    assert windows == {("sglang", "1m"), ("sglang", "10m"), ("openrouter", "1m"), ("openrouter", "10m")}
    sides = {(s["side"], s["kind"]) for s in samples["draftfleet_plan_time_to_finish_seconds"]}
    assert sides == {("sglang", "gpu"), ("openrouter", "cloud"), ("all at once", "both")}
    assert {s["side"] for s in samples["draftfleet_plan_cost_to_finish_usd"]} == {"sglang", "openrouter", "all at once"}
    assert samples["draftfleet_eta_seconds"] and samples["draftfleet_stalled"]
    assert samples["draftfleet_plan_remaining_tokens"]


def test_every_dashboard_panel_queries_an_exported_metric(tmp_path, redis_server, tokenizer_dir):
    """Each expression's metrics, label matchers, ``by`` labels and legend labels exist in a scrape."""
    samples = scrape(tmp_path, redis_server, tokenizer_dir)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    for title, expr, legend in exprs:
        names = re.findall(r"\bdraftfleet_[a-z_]+\b", expr)
        assert names, (title, expr)
        for name in names:
            assert name in samples, f"panel {title!r}: {name} is not exported (have {sorted(samples)})"
            labels = set().union(*(s.keys() for s in samples[name]))
            for label, value in re.findall(name + r'\{(\w+)="([^"]*)"\}', expr):
                assert label in labels and value in {s.get(label) for s in samples[name]}, (title, label, value)
            for group in re.findall(r"by \(([^)]*)\)", expr):
                assert {g.strip() for g in group.split(",")} <= labels, (title, group, labels)
            assert set(re.findall(r"\{\{(\w+)\}\}", legend)) <= labels, (title, legend, labels)
