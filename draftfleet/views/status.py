"""What the fleet is doing now, read from Redis alone (quick: a few pipelined round trips).

Workers publish their own reports (kind, host, GPU or URL, in flight, paused) every few seconds;
queue depth comes from Redis itself (Flower lists only queues some worker consumes); tokens,
spend and rates come from the ledger's counters, which the reconciler keeps equal to the store.
The rendering fits 80 columns (a terminal or a pipe) without cutting a number: counts are
shortened (``1.23M``) rather than clipped, and text columns fold.
"""

from __future__ import annotations

import time

import msgspec
import redis
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from draftfleet import redis_keys as rk
from draftfleet.assign import kinds_for, live_budgets, published
from draftfleet.batches import open_batches
from draftfleet.claims import worker_reports
from draftfleet.ledger import BudgetUse, Ledger
from draftfleet.queues import depth, held, next_answers
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import BatchSummary
from draftfleet.views.plan import DatasetPlan, duration, plan_from_redis, render_plans, usd
from draftfleet.views.redis_load import BUSY_SHARE, RedisLoad, redis_load



class WorkerRow(msgspec.Struct, kw_only=True):
    hostname: str
    kind: str
    backend: str
    endpoint: str
    datasets: list[str]
    inflight: int
    slots: int
    paused: str | None
    waiting: str | None = None  # starting up: waiting for its server (what it waits for)
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
    held: int  # delivered to a worker, not acknowledged yet (running, prefetched or deferred)
    inflight: int
    responses: int
    completion_tokens: int
    budget_tokens: int | None
    share_done: float | None  # of the budget, spent as admission counts it (``budget``)
    remaining_tokens: int | None  # of the budget
    closed: bool
    finished: bool  # nothing queued, held or in an open batch: every enqueued prompt has an outcome
    tps_1m: float
    tps_10m: float
    eta_s: float | None  # from the assigned kinds' live workers only (plan.py)
    stalled: str | None = None  # why there is no ETA although work is left ("no live gpu worker")
    backends: list[BackendRow]
    retries: int
    in_batch: int = 0  # prompts in open provider batches (draftfleet worker batch): neither queued nor held
    failures: int
    budget: BudgetUse | None = None  # spent (counted records, paid turns not stored yet), left, full


class SpendRow(msgspec.Struct, kw_only=True):
    backend: str
    spent_usd: float
    cap_usd: float | None
    held_usd: float = 0.0  # held by the requests in flight against the cap (their most)


class CaptureRow(msgspec.Struct, kw_only=True):
    """A dataset's hidden-state capture, from the counters ``draftfleet capture`` and the capture workers keep."""

    dataset: str
    version: int
    units: int  # record turns when the capture was last queued
    captured: int  # of them with a file: those there at queue time plus those stored since
    queued: int  # capture tasks waiting in the queue now
    failed: int
    bytes_per_token: float | None = None  # the version's, in its dtype (as draftfleet capture last measured)
    projected_bytes: int | None = None  # what the turns still to capture and the budget left will take


class Snapshot(msgspec.Struct, kw_only=True):
    at: float
    workers: list[WorkerRow]
    datasets: list[DatasetRow]
    spend: list[SpendRow]
    capture: list[CaptureRow] = []
    plans: list[DatasetPlan] = []
    # False after Redis lost its data, until the counters are rebuilt from the store: the figures
    # are partial meanwhile, and budgets and spend caps admit nothing on them (ops/recover-redis.md)
    counters_built: bool = True
    # the shared Redis's share of a core lately: the fleet stops scaling where it nears 1 (ops/scaling.md §1)
    redis: RedisLoad | None = None
    batches: list[BatchSummary] = []  # open provider batches (draftfleet worker batch)


def snapshot(cfg: FleetConfig, r: redis.Redis, datasets: list[str] | None = None) -> Snapshot:
    """The fleet now; ``datasets`` limits the dataset rows (and the workers shown) to those named."""
    now = time.time()
    ledger = Ledger(r)
    reports = worker_reports(r)
    live = live_budgets(cfg, r)  # with datasets enqueued since this config was read (status --watch)
    for n in datasets or ():
        if n not in live:
            cfg.dataset(n)  # the error names the datasets there are
    chosen = [(n, live[n]) for n in (datasets or live)]
    if datasets:
        reports = [w for w in reports if not w.datasets or set(w.datasets) & set(datasets)]
    workers = [
        WorkerRow(hostname=w.hostname, kind=w.kind, backend=w.backend, endpoint=w.endpoint, datasets=w.datasets,
                  inflight=sum(w.inflight.values()), slots=w.slots, paused=w.paused, waiting=w.waiting,
                  age_s=round(now - (w.at or now), 1))
        for w in sorted(reports, key=lambda w: (w.kind, w.hostname))
    ]
    rows, plans = [], []
    all_totals = ledger.all_totals()
    settings = published(r)
    holding = held(r)
    for dataset, budget in chosen:
        inflight = sum(w.inflight.get(dataset, 0) for w in reports)
        totals = all_totals.get(dataset, {})
        names = sorted(totals)
        rates = ledger.rates(dataset, names, [60, 600], now) if names else {}
        backends = [
            BackendRow(backend=b, responses=t.get("responses", 0), completion_tokens=t.get("completion_tokens", 0),
                       cost_usd=t.get("cost_micro_usd", 0) / 1e6, tps_1m=round(rates[b][0], 1),
                       tps_10m=round(rates[b][1], 1))
            for b, t in ((b, totals[b]) for b in names)
        ]
        done = sum(b.completion_tokens for b in backends)
        responses = sum(b.responses for b in backends)
        tps_10m = sum(b.tps_10m for b in backends)
        use = None if budget is None else ledger.budget_use(dataset, budget, _max_tokens(cfg, settings, dataset),
                                                            next_answers(r, dataset), _rule(cfg, settings, dataset))
        queued, holds = depth(r, dataset), holding.get(dataset, 0)
        closed = ledger.closed_at(dataset) is not None
        events = ledger.events(dataset)
        plan = plan_from_redis(cfg, r, dataset, budget=use, prompts_left=queued + holds, reports=reports,
                               totals=totals, closed=closed, now=now)
        plans.append(plan)
        rows.append(DatasetRow(
            dataset=dataset, assigned=sorted(kinds_for(r, dataset)), queue_depth=queued, held=holds,
            inflight=inflight, responses=responses, completion_tokens=done,
            budget_tokens=budget, share_done=round(use.spent_tokens / budget, 4) if use and budget else None,
            remaining_tokens=use.left_tokens if use else None, budget=use, closed=closed,
            finished=not closed and responses > 0 and queued + holds + plan.in_batch == 0, in_batch=plan.in_batch,
            tps_1m=round(sum(b.tps_1m for b in backends), 1), tps_10m=round(tps_10m, 1),
            eta_s=plan.eta_s, stalled=plan.stalled, backends=backends, retries=sum(v for k, v in events.items() if k.startswith("retry:")),
            failures=sum(v for k, v in events.items() if k.startswith("failed:")),
        ))
    spend = [SpendRow(backend=name, spent_usd=ledger.spend_usd(name), cap_usd=cb.max_spend_usd,
                      held_usd=ledger.spend_held_usd(name)) for name, cb in sorted(cfg.clouds.items())]
    return Snapshot(at=now, workers=workers, datasets=rows, spend=spend,
                    capture=capture_rows(r, [n for n, _ in chosen], {d.dataset: d.remaining_tokens for d in rows}),
                    plans=plans, counters_built=ledger.counters_built(), redis=redis_load(r),
                    batches=[b for b in open_batches(r) if b.dataset in {n for n, _ in chosen}])


def _max_tokens(cfg: FleetConfig, live: dict, dataset: str) -> int:
    """The dataset's max_tokens as the fleet runs it (its published settings, else the config's)."""
    if dataset in live:
        return live[dataset].settings.max_tokens
    return next((d.max_tokens for d in cfg.datasets if d.name == dataset), 1)


def _rule(cfg: FleetConfig, live: dict, dataset: str) -> str:
    """The rule the dataset's budget follows (its published manifest's, else the config's)."""
    if dataset in live:
        return live[dataset].budget_rule
    return next((d.budget_rule for d in cfg.datasets if d.name == dataset), "exact")


def capture_rows(r: redis.Redis, datasets: list[str], budget_left: dict[str, int | None]) -> list[CaptureRow]:
    """``budget_left``: the answer tokens each dataset's budget has left (the projection adds their states)."""
    from draftfleet.hidden import projected_bytes

    rows = []
    for name in datasets:
        h = {k.decode(): int(v) for k, v in r.hgetall(rk.capture_progress(name)).items()}
        if h:
            bpt = h["bytes_per_token_x10"] / 10 if "bytes_per_token_x10" in h else None
            projected = None if bpt is None else projected_bytes(
                bpt, h.get("tokens", 0) - h.get("captured_tokens", 0), budget_left.get(name), h.get("unit_tokens", 0),
                h.get("completion_tokens", 0))
            rows.append(CaptureRow(dataset=name, version=h.get("version", 0), units=h.get("units", 0),
                                   captured=min(h.get("units", 0), h.get("done", 0) + h.get("captured", 0)),
                                   queued=r.llen(rk.capture_queue(name)), failed=h.get("failed", 0),
                                   bytes_per_token=bpt, projected_bytes=projected))
    return rows


def _eta(d: DatasetRow) -> str:
    if d.closed:
        return "closed"
    if d.budget is not None and d.budget.full and not d.finished:
        return "full"
    if d.finished:
        return "done"
    if d.stalled:
        return "[red]stalled[/]"
    if d.eta_s is None:
        return "-"
    h, rest = divmod(int(d.eta_s), 3600)
    if h >= 100:
        return f"{h // 24}d"
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _n(x: float) -> str:
    """A count in at most 7 characters: exact below 100,000, else 3 significant digits and a unit."""
    if abs(x) < 100_000:
        return f"{x:,.0f}"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            v = x / size
            return f"{v:.3g}{unit}" if v < 1000 else f"{v:,.0f}{unit}"
    return f"{x:,.0f}"


def _usd(x: float) -> str:
    return usd(x) if x < 100_000 else _n(x)  # the fleet's money (views/plan.py), folded where it would not fit


def _table(title: str, columns: list[tuple[str, bool]]) -> Table:
    """A borderless table; numeric columns (``True``) never wrap, text columns fold when narrow."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for name, numeric in columns:
        if numeric:
            t.add_column(name, justify="right", no_wrap=True)
        else:
            t.add_column(name, overflow="fold")
    return t


def render(snap: Snapshot) -> Group:
    wt = _table("workers", [("worker", False), ("backend", False), ("server", False), ("datasets", False),
                            ("in flight", True), ("state", False)])
    for w in snap.workers:
        if w.waiting:
            state = f"[yellow]waiting for {escape(w.waiting)}[/]"
        elif w.paused:
            state = f"[red]paused: {escape(w.paused)}[/]"
        else:
            state = "[yellow]stale[/]" if w.age_s > 60 else "ok"
        wt.add_row(escape(w.hostname), f"{escape(w.backend)} ({w.kind})", escape(w.endpoint), ",".join(w.datasets) or "-",
                   f"{w.inflight}/{w.slots}", state)
    # prompts out in open provider batches: a column of their own while any are (a short header, for 80 columns)
    batched = any(d.in_batch for d in snap.datasets)
    dt = _table("datasets (kinds assigned)", [("dataset", False), ("queued", True), ("running", True),
                                              *([("batched", True)] if batched else []), ("done", True),
                                              ("tokens", True), ("budget", True), ("tok/s", True), ("ETA", True)])
    for d in snap.datasets:
        budget = f"{100 * (d.share_done or 0):.0f}% of {_n(d.budget_tokens)}" if d.budget_tokens else "-"
        if d.budget is not None and d.budget.rule == "whole":
            budget += " (whole)"
        dt.add_row(f"{d.dataset} ({','.join(d.assigned) or 'none'})", _n(d.queue_depth), _n(d.inflight),
                   *([_n(d.in_batch)] if batched else []), _n(d.responses), _n(d.completion_tokens), budget,
                   _n(d.tps_10m), _eta(d))
    bt = _table("by backend (tok/s over 1 and 10 min, or the run's age if shorter)",
                [("dataset / backend", False), ("done", True), ("tokens", True), ("1m", True), ("10m", True),
                 ("cost $", True), ("retry", True), ("fail", True)])
    for d in snap.datasets:
        bt.add_row(d.dataset, "", "", "", "", "", _n(d.retries), _n(d.failures))
        for b in d.backends:
            bt.add_row(f"  {b.backend}", _n(b.responses), _n(b.completion_tokens), _n(b.tps_1m), _n(b.tps_10m),
                       _usd(b.cost_usd), "", "")
    st = _table("cloud spend", [("backend", False), ("spent $", True), ("held in flight $", True), ("cap $", True)])
    for s in snap.spend:
        st.add_row(s.backend, _usd(s.spent_usd), _usd(s.held_usd) if s.cap_usd is not None else "-",
                   _usd(s.cap_usd) if s.cap_usd is not None else "-")
    plan = Group(Text("plan: to finish each dataset (draftfleet plan)", style="italic"), render_plans(snap.plans))
    if snap.batches:
        st = Group(st, batch_table(snap.batches, snap.at))
    if snap.redis is not None:
        load = snap.redis
        over = "since it started" if load.since_start else f"over the last {load.window_s:.0f} s"
        busy = load.cpu_share >= BUSY_SHARE
        line = Text(f"Redis: {load.cpu_share:.0%} of a core {over}, {load.ops_per_s:,} commands/s"
                    + (" - near saturation: more GPUs will not go faster (ops/scaling.md, section 1)" if busy else ""),
                    style="bold red" if busy else "dim")
        wt = Group(line, wt)
    if not snap.counters_built:
        lost = Text("the counters are not the store's yet (Redis lost its data, or is new): the figures are partial, "
                    "and budgeted datasets and capped backends wait until a worker, enqueue or the reconciler has "
                    "rebuilt them from the store", style="bold red")
        wt = Group(lost, wt)
    if not snap.capture:
        return Group(wt, dt, bt, st, plan)
    ct = _table("hidden-state capture", [("dataset", False), ("version", True), ("captured", True), ("of", True),
                                         ("queued", True), ("failed", True), ("B/token", True), ("to come", True)])
    for c in snap.capture:
        ct.add_row(c.dataset, f"v{c.version}", _n(c.captured), _n(c.units), _n(c.queued), _n(c.failed),
                   _n(round(c.bytes_per_token)) if c.bytes_per_token is not None else "-",
                   f"{c.projected_bytes / 1e9:,.2f} GB" if c.projected_bytes is not None else "-")
    return Group(wt, dt, bt, st, ct, plan)


def batch_table(batches: list[BatchSummary], now: float) -> Table:
    """The open provider batches: which, where, how far, how old, and whether a pivot can cancel them."""
    bt = _table("open provider batches (draftfleet worker batch)",
                [("dataset / backend", False), ("batch", False), ("status", False), ("prompts", True),
                 ("done", True), ("failed", True), ("age", True), ("window", False), ("cancel", False)])
    for b in batches:
        cancel = ("requested" if b.cancel_requested else "can") if b.cancellable else (
            "[yellow]cannot: waited for[/]" if b.cancel_requested else "cannot")
        bt.add_row(f"{escape(b.dataset)} / {escape(b.backend)}", escape(b.provider_id or f"{b.id} (submitting)"),
                   escape(b.status), _n(b.prompts), _n(b.completed), _n(b.failed),
                   duration(max(0.0, now - b.submitted_at)), escape(b.window), cancel)
    return bt
