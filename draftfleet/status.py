"""What the fleet is doing now, read from Redis alone (quick: a few pipelined round trips).

Workers publish their own reports (kind, host, GPU or URL, in flight, paused) every few seconds;
queue depth comes from Redis itself (Flower lists only queues some worker consumes); tokens,
spend and rates come from the ledger's counters, which the reconciler keeps equal to the store.
"""

from __future__ import annotations

import time

import msgspec
import redis
from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table

from draftfleet import redis_keys as rk
from draftfleet.assign import kinds_for
from draftfleet.ledger import Ledger
from draftfleet.queues import depth
from draftfleet.schemas.config import FleetConfig


class WorkerRow(msgspec.Struct, kw_only=True):
    hostname: str
    kind: str
    backend: str
    endpoint: str
    datasets: list[str]
    inflight: int
    slots: int
    paused: str | None
    age_s: float


class BackendRow(msgspec.Struct, kw_only=True):
    backend: str
    responses: int
    completion_tokens: int
    cost_usd: float
    tps_1m: float
    tps_10m: float


class DatasetRow(msgspec.Struct, kw_only=True):
    dataset: str
    assigned: list[str]
    queue_depth: int
    inflight: int
    responses: int
    completion_tokens: int
    budget_tokens: int | None
    share_done: float | None
    remaining_tokens: int | None
    closed: bool
    tps_1m: float
    tps_10m: float
    eta_s: float | None
    backends: list[BackendRow]
    retries: int
    failures: int


class SpendRow(msgspec.Struct, kw_only=True):
    backend: str
    spent_usd: float
    cap_usd: float | None


class Snapshot(msgspec.Struct, kw_only=True):
    at: float
    workers: list[WorkerRow]
    datasets: list[DatasetRow]
    spend: list[SpendRow]


def worker_reports(r: redis.Redis) -> list[dict]:
    keys = list(r.scan_iter(match=rk.worker_report("*"), count=500))
    values = r.mget(keys) if keys else []
    return [msgspec.json.decode(v) for v in values if v]


def snapshot(cfg: FleetConfig, r: redis.Redis) -> Snapshot:
    now = time.time()
    ledger = Ledger(r)
    reports = worker_reports(r)
    workers = [
        WorkerRow(hostname=w["hostname"], kind=w["kind"], backend=w["backend"], endpoint=w.get("endpoint", ""),
                  datasets=w.get("datasets", []),
                  inflight=sum(w.get("inflight", {}).values()), slots=w.get("slots", 0), paused=w.get("paused"),
                  age_s=round(now - w.get("at", now), 1))
        for w in sorted(reports, key=lambda w: (w["kind"], w["hostname"]))
    ]
    datasets = []
    all_totals = ledger.all_totals()
    for ds in cfg.datasets:
        inflight = sum(w.get("inflight", {}).get(ds.name, 0) for w in reports)
        totals = all_totals.get(ds.name, {})
        backends = [
            BackendRow(backend=b, responses=t.get("responses", 0), completion_tokens=t.get("completion_tokens", 0),
                       cost_usd=t.get("cost_micro_usd", 0) / 1e6, tps_1m=round(ledger.rate(ds.name, b, 60, now), 1),
                       tps_10m=round(ledger.rate(ds.name, b, 600, now), 1))
            for b, t in sorted(totals.items())
        ]
        done = sum(b.completion_tokens for b in backends)
        tps_10m = sum(b.tps_10m for b in backends)
        budget = ds.budget_tokens
        remaining = max(0, budget - done) if budget else None
        events = ledger.events(ds.name)
        datasets.append(DatasetRow(
            dataset=ds.name, assigned=sorted(kinds_for(r, ds.name)), queue_depth=depth(r, ds.name),
            inflight=inflight, responses=sum(b.responses for b in backends), completion_tokens=done,
            budget_tokens=budget, share_done=round(done / budget, 4) if budget else None, remaining_tokens=remaining,
            closed=ledger.closed_at(ds.name) is not None, tps_1m=round(sum(b.tps_1m for b in backends), 1),
            tps_10m=round(tps_10m, 1), eta_s=round(remaining / tps_10m) if remaining and tps_10m > 0 else None,
            backends=backends, retries=sum(v for k, v in events.items() if k.startswith("retry:")),
            failures=sum(v for k, v in events.items() if k.startswith("failed:")),
        ))
    spend = [SpendRow(backend=name, spent_usd=ledger.spend_usd(name), cap_usd=cb.max_spend_usd)
             for name, cb in sorted(cfg.clouds.items())]
    return Snapshot(at=now, workers=workers, datasets=datasets, spend=spend)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def render(snap: Snapshot) -> Group:
    wt = Table(title="workers", title_justify="left")
    for col in ("worker", "kind", "backend", "server", "datasets", "in flight", "state"):
        wt.add_column(col, justify="right" if col == "in flight" else "left")
    for w in snap.workers:
        state = f"[red]paused: {w.paused}[/]" if w.paused else ("[yellow]stale[/]" if w.age_s > 60 else "ok")
        wt.add_row(w.hostname, w.kind, w.backend, w.endpoint, ",".join(w.datasets) or "-", f"{w.inflight}/{w.slots}",
                   state)
    dt = Table(title="datasets", title_justify="left")
    for col in ("dataset", "kinds", "queued", "in flight", "responses", "tokens", "budget", "", "tok/s 1m", "tok/s 10m", "ETA"):
        dt.add_column(col, justify="left" if col in ("dataset", "kinds", "") else "right")
    for d in snap.datasets:
        bar = ProgressBar(total=1.0, completed=min(1.0, d.share_done or 0.0), width=20) if d.budget_tokens else "-"
        budget = f"{d.budget_tokens:,}" + (" (closed)" if d.closed else "") if d.budget_tokens else "-"
        dt.add_row(d.dataset, ",".join(d.assigned), f"{d.queue_depth:,}", str(d.inflight), f"{d.responses:,}",
                   f"{d.completion_tokens:,}", budget, bar, f"{d.tps_1m:,.0f}", f"{d.tps_10m:,.0f}", _eta(d.eta_s))
        for b in d.backends:
            dt.add_row(f"  {b.backend}", "", "", "", f"{b.responses:,}", f"{b.completion_tokens:,}", "", "",
                       f"{b.tps_1m:,.0f}", f"{b.tps_10m:,.0f}", "")
    st = Table(title="cloud spend", title_justify="left")
    for col in ("backend", "spent (USD)", "cap (USD)"):
        st.add_column(col, justify="left" if col == "backend" else "right")
    for s in snap.spend:
        st.add_row(s.backend, f"{s.spent_usd:,.2f}", f"{s.cap_usd:,.2f}" if s.cap_usd is not None else "-")
    return Group(wt, dt, st)
