"""``draftfleet plan``: what is left of a dataset, and the time and money to finish it on each side.

The seed's pivot, computed instead of done by hand: keep the local GPUs (slow, no money per
token), pay a cloud (fast, per token), or run both at once. For each backend configured or
running:

- its rate: the last ten minutes while it is producing (the ledger's rate buckets); once it has
  stopped, its run's mean (tokens over its busy time, the union of its requests' intervals);
  else "not measured";
- a cloud's price per million completion tokens: measured from the provider's own reported
  cost (prompt tokens included), else the configured prices ("configured");
- a cloud with a batch API (``batch`` set; ``draftfleet worker batch``): a third side, kind
  ``batch``: the tokens left at the batch price (``batch_prices()``, prompt tokens counted as on the
  cloud side), in its completion window, or sooner at the provider's progress on the dataset's open
  batches (requests back per second since submitted, applied to the prompts left; never past the
  window). It is in no "all at once"; the headline names it where it is the cheapest way that costs money;
- the tokens left: the rest of the budget, or the prompts left at the mean length, whichever
  runs out first. The budget's rest is admission's (``ledger.budget_use``): the stored records of
  every version and the paid turns of conversations not stored yet are spent; with less left than
  admission reserves for one more prompt the dataset is ``full`` (admission refuses: no ETA).

The ETA counts only the kinds assigned to the dataset that have a live worker on it (reporting,
neither paused nor waiting for its server); with none the dataset is ``stalled`` and has no ETA.
Records brought in by ``import`` (and counted late by the reconciler) are no backend's rate.

API: :func:`plan_dataset` (pure, from figures) makes a :class:`DatasetPlan`; :func:`plan_from_redis`
(status, metrics), :func:`draftfleet.views.inventory.plan_from_inventory` (plan, inventory, pivot) and :func:`plan_from_store`
(report) gather the figures; :func:`render_plans` is the rich table every command prints.
"""

from __future__ import annotations

import re
import time

import msgspec
import redis
from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from draftfleet.assign import kinds_for
from draftfleet.batches import open_batches
from draftfleet.claims import worker_reports
from draftfleet.ledger import BudgetUse, Ledger, budget_use
from draftfleet.schemas.config import BudgetRule
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import IMPORTED_BY, BatchSummary, WorkerReport

WINDOW_S = 600
ENGINES = ("sglang", "vllm")  # the GPU backends' names (a GPU worker's backend is its engine)
ALL_AT_ONCE = "all at once"


class Activity(msgspec.Struct, kw_only=True):
    """How a backend worked on a dataset, read from the store: its busy time (the union of its
    requests' intervals, ``created_at - latency_s`` to ``created_at``) and the tokens made in it,
    and the provider's own reported cost. Imported records are in no backend's busy time."""

    backend: str
    kind: str
    busy_s: float = 0.0
    busy_tokens: int = 0
    provider_tokens: int = 0
    provider_cost_usd: float = 0.0


BATCH_ENTRY = " (batch)"  # the key of a backend's batch answers among a dataset's activity entries


def note_activity(activity: dict[str, Activity], intervals: dict[str, list[tuple[float, float]]], rec,
                  tokens: int) -> None:
    """One stored record (``tokens``: what the budget counts of it) into its backend's activity. A
    provider batch's answer (``batch_id`` set) goes to an entry of its own, kind ``batch``, in no busy
    time: its cost is the batch price and its latency the batch's hours, which in the backend's own
    entry would make the sync side look cheaper and slower than it is."""
    batch = bool(getattr(rec, "batch_id", None))
    name = rec.backend + BATCH_ENTRY if batch else rec.backend
    act = activity.get(name)
    if act is None:
        act = activity[name] = Activity(backend=rec.backend, kind="batch" if batch else rec.backend_kind)
    if rec.worker != IMPORTED_BY and not batch:
        intervals.setdefault(name, []).append((rec.created_at - rec.latency_s, rec.created_at))
        act.busy_tokens += tokens
    if rec.cost_source == "provider":
        act.provider_tokens += tokens
        act.provider_cost_usd += rec.cost_usd


def merge_activity(activity: dict[str, Activity], intervals: dict[str, list[tuple[float, float]]],
                   part: dict[str, Activity], part_intervals: dict[str, list[tuple[float, float]]]) -> None:
    """A worker process's share of a read (:func:`note_activity`'s) into the whole."""
    for name, act in part.items():
        acc = activity.setdefault(name, Activity(backend=act.backend, kind=act.kind))
        acc.busy_tokens += act.busy_tokens
        acc.provider_tokens += act.provider_tokens
        acc.provider_cost_usd += act.provider_cost_usd
    for name, spans in part_intervals.items():
        intervals.setdefault(name, []).extend(spans)


def activities(activity: dict[str, Activity], intervals: dict[str, list[tuple[float, float]]]) -> list[Activity]:
    """The entries with their busy time, a backend's sync entry before its batch one."""
    return [msgspec.structs.replace(a, busy_s=round(busy_seconds(intervals.get(name, [])), 3))
            for name, a in sorted(activity.items(), key=lambda kv: (kv[1].backend, kv[1].kind == "batch"))]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > until:
            total += end - max(start, until)
            until = end
    return total


class StoreFigures(msgspec.Struct, kw_only=True):
    """What the plan needs from the store (an inventory's figures, or the report's own read)."""

    dataset: str
    responses: int
    completion_tokens: int
    prompt_tokens: int
    budget: BudgetUse | None  # None: no budget
    prompts_left: int | None
    activity: list[Activity]


class BackendMeasure(msgspec.Struct, kw_only=True):
    """What is known of one backend on one dataset: how fast, at what price, with how many live workers."""

    backend: str
    kind: str  # gpu or cloud
    window_tps: float = 0.0  # completion tokens/s over the last 10 minutes (or the run's age if shorter)
    producing: bool = False  # it counted a response in the last minute
    run_tps: float | None = None  # its run's mean: tokens over busy time (None: no busy time known)
    provider_tokens: int = 0  # completion tokens of its records that carry the provider's own cost
    provider_cost_usd: float = 0.0  # that cost
    configured_usd_per_mtok: float | None = None  # a cloud's configured prices, per completion Mtok
    live_workers: int = 0  # live workers of this backend on this dataset


class BatchMeasure(msgspec.Struct, kw_only=True):
    """A cloud backend's batch API as a way to finish (``draftfleet worker batch``): the batch price per
    completion Mtok (prompts included), the window, and the provider's progress on the open batches."""

    backend: str
    usd_per_mtok: float | None
    price_source: str  # "measured (batch answers)", "batch price", "measured x batch_price_factor", "not priced"
    window: str  # as configured ("24h")
    window_s: float
    progress_rps: float | None = None  # requests/s the open batches have come back at since submitted (None: none yet)
    open_prompts: int = 0  # the prompts of its open batches on this dataset
    live_workers: int = 0  # live batch workers of this backend on this dataset


class Side(msgspec.Struct, kw_only=True):
    """One way to finish a dataset: one backend, or every measured one at once (``ALL_AT_ONCE``)."""

    backend: str
    kind: str  # gpu, cloud, batch (a cloud's batch API), or both
    tokens_per_s: float | None
    rate_source: str  # "last 10 min", "run's mean", "not measured"; a batch: "provider's progress", "the window"
    usd_per_mtok: float | None  # per million completion tokens, prompt tokens included
    price_source: str  # "measured" (the provider's reported cost), "configured", "local" (GPU), "not priced"
    time_s: float | None  # to finish there
    cost_usd: float | None  # to finish there (0 on GPUs: no money per token)
    assigned: bool  # its kind may consume the dataset now
    live_workers: int


class DatasetPlan(msgspec.Struct, kw_only=True):
    dataset: str
    state: str  # open, full (no room for one more prompt), closed (admission closed it), done (no prompt left)
    responses: int
    completion_tokens: int
    budget_tokens: int | None
    budget: BudgetUse | None  # what admission counts as spent and left (None: no budget)
    mean_tokens: float | None
    prompts_left: int | None  # None: not known here
    in_batch: int = 0  # of prompts_left, those in open provider batches (neither queued nor stored)
    remaining_tokens: int | None  # to generate: the budget's rest or the prompts left, whichever is first
    sides: list[Side]
    at_once: Side | None  # every measured side together (only with both a GPU and a cloud side)
    assigned: list[str]
    workers_known: bool  # False: no worker reports were read (no Redis): no ETA, no stall
    eta_s: float | None  # from the live, assigned sides only
    eta_kinds: list[str] = []  # the kinds of those sides (a live batch worker's is "batch")
    stalled: str | None  # why there is no ETA although work is left ("no live gpu worker")


def _rate(m: BackendMeasure) -> tuple[float | None, str]:
    if m.producing and m.window_tps > 0:
        return m.window_tps, "last 10 min"
    if m.run_tps:
        return m.run_tps, "run's mean"
    if m.window_tps > 0:
        return m.window_tps, "last 10 min"
    return None, "not measured"


def _price(m: BackendMeasure) -> tuple[float | None, str]:
    if m.kind == "gpu":
        return 0.0, "local"
    if m.provider_tokens > 0:
        return m.provider_cost_usd / m.provider_tokens * 1e6, "measured"
    if m.configured_usd_per_mtok is not None:
        return m.configured_usd_per_mtok, "configured"
    return None, "not priced"


def _finish(remaining: int | None, tps: float | None, usd: float | None) -> tuple[float | None, float | None]:
    if remaining is None:
        return None, None
    time_s = round(remaining / tps) if tps else None
    cost = round(remaining * usd / 1e6, 4) if usd is not None else None  # to the 1/100 cent :func:`usd` shows
    return time_s, cost


def _batch_side(b: BatchMeasure, remaining: int | None, prompts_left: int | None, mean: float | None,
                assigned: set[str]) -> Side:
    """Finishing by batch: the money at the batch price; the time the window, or sooner at the rate the
    open batches have come back at, applied to the prompts left (the tokens left at the mean length, else
    the prompts left); never past the window: a batch submitted now is done or expired by then."""
    cost = round(remaining * b.usd_per_mtok / 1e6, 4) if remaining is not None and b.usd_per_mtok is not None else None
    if remaining is None and prompts_left is None:
        time_s = None  # nothing known of what is left
    elif remaining == 0 or (remaining is None and prompts_left == 0):
        time_s = 0
    else:
        todo = remaining / mean if remaining is not None and mean else prompts_left  # prompts
        time_s = round(min(b.window_s, todo / b.progress_rps) if b.progress_rps and todo is not None else b.window_s)
    tps = b.progress_rps * mean if b.progress_rps and mean else None
    return Side(backend=b.backend, kind="batch", tokens_per_s=round(tps, 1) if tps else None,
                rate_source="provider's progress" if b.progress_rps else f"the {b.window} window",
                usd_per_mtok=round(b.usd_per_mtok, 4) if b.usd_per_mtok is not None else None,
                price_source=b.price_source, time_s=time_s, cost_usd=cost, assigned="cloud" in assigned,
                live_workers=b.live_workers)


def plan_dataset(dataset: str, *, responses: int, completion_tokens: int, budget: BudgetUse | None,
                 prompts_left: int | None, measures: list[BackendMeasure], assigned: set[str],
                 closed: bool = False, workers_known: bool = True,
                 batches: list[BatchMeasure] | None = None, in_batch: int = 0) -> DatasetPlan:
    """The plan of one dataset from its figures (no I/O): see the module's docstring. ``in_batch``:
    of ``prompts_left``, those in open provider batches (a dataset with only those left is not done)."""
    mean = completion_tokens / responses if responses else None
    done = prompts_left == 0 and responses > 0
    full = budget is not None and budget.full
    bounds = [b for b in (budget.left_tokens if budget is not None else None,
                          round(prompts_left * mean) if prompts_left is not None and mean else None) if b is not None]
    if prompts_left == 0:
        bounds.append(0)
    remaining = 0 if closed or (full and not done) else (min(bounds) if bounds else None)
    sides = []
    for m in sorted(measures, key=lambda m: (m.kind != "gpu", m.backend)):
        tps, rate_source = _rate(m)
        usd, price_source = _price(m)
        time_s, cost = _finish(remaining, tps, usd)
        sides.append(Side(backend=m.backend, kind=m.kind, tokens_per_s=round(tps, 1) if tps else None,
                          rate_source=rate_source, usd_per_mtok=round(usd, 4) if usd is not None else None,
                          price_source=price_source, time_s=time_s, cost_usd=cost, assigned=m.kind in assigned,
                          live_workers=m.live_workers))
    # A batch is the third way: about half the money, hours. It is never in "all at once": its rate is
    # a provider's progress on work already submitted, not a speed that more work would add to.
    sides += [_batch_side(b, remaining, prompts_left, mean, assigned) for b in sorted(batches or [], key=lambda b: b.backend)]
    measured = [s for s in sides if s.tokens_per_s and s.kind != "batch"]
    at_once = None
    if {s.kind for s in measured} >= {"gpu", "cloud"}:
        total = sum(s.tokens_per_s for s in measured)
        priced = all(s.usd_per_mtok is not None for s in measured)
        usd = sum(s.tokens_per_s / total * s.usd_per_mtok for s in measured) if priced else None
        time_s, cost = _finish(remaining, total, usd)
        at_once = Side(backend=ALL_AT_ONCE, kind="both", tokens_per_s=round(total, 1), rate_source="sum",
                       usd_per_mtok=round(usd, 4) if usd is not None else None,
                       price_source="measured" if all(s.price_source in ("measured", "local") for s in measured)
                       else "configured", time_s=time_s, cost_usd=cost, assigned=True,
                       live_workers=sum(s.live_workers for s in measured))
    state = "closed" if closed else "done" if done else "full" if full else "open"
    eta, stalled, eta_kinds = None, None, []
    if state == "open" and workers_known and remaining:
        live = [s for s in sides if s.assigned and s.live_workers > 0]
        if not live:
            stalled = f"no live {' or '.join(sorted(assigned))} worker" if assigned else "assigned to no worker kind"
        else:
            # The live sides' rates added up (a live batch worker's is its provider's progress), and
            # with a live batch worker never later than its side's time: it alone finishes by then,
            # within its window (so with no progress yet, the ETA is the window).
            tps = sum(s.tokens_per_s or 0 for s in live)
            eta = round(remaining / tps) if tps else None
            by_batch = [s.time_s for s in live if s.kind == "batch" and s.time_s is not None]
            if by_batch:
                eta = min(by_batch) if eta is None else min(eta, *by_batch)
            eta_kinds = sorted({s.kind for s in live})
    return DatasetPlan(dataset=dataset, state=state, responses=responses, completion_tokens=completion_tokens,
                       budget_tokens=budget.budget_tokens if budget else None, budget=budget, mean_tokens=round(mean, 1) if mean else None,
                       prompts_left=prompts_left, in_batch=in_batch, remaining_tokens=remaining, sides=sides,
                       at_once=at_once,
                       assigned=sorted(assigned), workers_known=workers_known, eta_s=eta, stalled=stalled,
                       eta_kinds=eta_kinds)


# -- gathering the figures ---------------------------------------------------------------------------
def is_live_on(w: WorkerReport, dataset: str) -> bool:
    """A worker that takes this dataset's tasks now: reporting, allowed the dataset, neither paused
    nor waiting for its server (a worker publishes its report as soon as its assignment changes)."""
    return w.kind in ("gpu", "cloud", "batch") and dataset in w.datasets and not w.paused and not w.waiting


def configured_kinds(cfg: FleetConfig | None) -> dict[str, str]:
    """Backend name -> kind, for every backend the config names (an engine's backend is its name)."""
    if cfg is None:
        return {}
    out = {name: "gpu" for name in ENGINES if getattr(cfg, name, None) is not None}
    out.update({name: "cloud" for name in cfg.clouds})
    return out


def _configured_price(cfg: FleetConfig | None, backend: str, prompt_per_completion: float) -> float | None:
    if cfg is None or backend not in cfg.clouds:
        return None
    c = cfg.clouds[backend]
    return c.price_output_per_mtok + c.price_input_per_mtok * prompt_per_completion


def _backends(cfg: FleetConfig | None, reports: list[WorkerReport], produced: dict[str, str]) -> dict[str, str]:
    """The backends to plan for, with their kinds: configured, running, or having produced (kind known)."""
    kinds = {**{b: k for b, k in produced.items() if k in ("gpu", "cloud")}, **configured_kinds(cfg)}
    kinds.update({w.backend: w.kind for w in reports if w.kind in ("gpu", "cloud")})
    return kinds


def plan_from_redis(cfg: FleetConfig, r: redis.Redis, dataset: str, *, budget: BudgetUse | None, prompts_left: int,
                    reports: list[WorkerReport], totals: dict[str, dict[str, int]] | None = None,
                    closed: bool | None = None, now: float | None = None) -> DatasetPlan:
    """The plan from Redis alone (quick): the ledger's counters, rates and busy time, the worker
    reports and the assignment. ``prompts_left``: the queued and held tasks (the open batches' are
    added here); ``budget``: the
    ledger's ``budget_use`` (None: no budget)."""
    now = time.time() if now is None else now
    ledger = Ledger(r)
    totals = ledger.totals(dataset) if totals is None else totals
    kinds = _backends(cfg, reports, {})
    names = sorted(kinds)
    rates = ledger.rates(dataset, names, [60, WINDOW_S], now) if names else {}
    done = sum(t.get("completion_tokens", 0) for t in totals.values())
    prompt = sum(t.get("prompt_tokens", 0) for t in totals.values())
    measures = []
    for name in names:
        t = totals.get(name, {})
        busy_s = t.get("busy_ms", 0) / 1000
        measures.append(BackendMeasure(
            backend=name, kind=kinds[name], window_tps=rates[name][1], producing=rates[name][0] > 0,
            run_tps=t.get("busy_tokens", 0) / busy_s if busy_s >= 1 else None,
            provider_tokens=t.get("provider_tokens", 0), provider_cost_usd=t.get("provider_cost_micro_usd", 0) / 1e6,
            configured_usd_per_mtok=_configured_price(cfg, name, prompt / done if done else 0.0),
            live_workers=sum(1 for w in reports if w.backend == name and w.kind == kinds[name]
                             and is_live_on(w, dataset))))
    # a prompt in an open batch is neither queued nor held: it is left all the same
    open_ = open_batches(r, dataset)
    in_batch = sum(b.held_prompts for b in open_)
    return plan_dataset(dataset, responses=sum(t.get("responses", 0) for t in totals.values()), completion_tokens=done,
                        budget=budget, prompts_left=prompts_left + in_batch, measures=measures,
                        assigned=kinds_for(r, dataset),
                        closed=ledger.closed_at(dataset) is not None if closed is None else closed,
                        batches=batch_measures(cfg, open_, reports, dataset, measures, prompt / done if done else 0.0,
                                               now), in_batch=in_batch)


def window_seconds(window: str) -> float:
    """A batch API's completion window (``"24h"``; also ``m``, ``s``, ``d``) in seconds; 24 h if unreadable
    (the config takes only ``"24h"`` for a batch API)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", window or "")
    if m is None:
        return 86400.0
    return float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 3600}[m[2]]


def batch_measures(cfg: FleetConfig | None, open_: list[BatchSummary], reports: list[WorkerReport], dataset: str,
                   measures: list[BackendMeasure], prompt_per_completion: float, now: float | None = None,
                   answered: dict[str, Activity] | None = None) -> list[BatchMeasure]:
    """Each cloud backend with a batch API: its batch price (the provider's own cost of its batch
    answers, ``answered``, where they carry one; else configured; else the sync side's measured
    price x ``batch_price_factor``), its window, and the progress of the dataset's open batches
    (``open_``, from ``rk.BATCHES``)."""
    if cfg is None:
        return []
    now = time.time() if now is None else now
    answered = answered or {}
    measured = {m.backend: m for m in measures}
    out = []
    for name, c in sorted(cfg.clouds.items()):
        if c.batch is None:
            continue
        pin, pout = c.batch_prices()
        m, a = measured.get(name), answered.get(name)
        if a is not None and a.provider_tokens:
            usd, source = a.provider_cost_usd / a.provider_tokens * 1e6, "measured (batch answers)"
        elif pin or pout:
            usd, source = pout + pin * prompt_per_completion, "batch price"
        elif m is not None and m.provider_tokens:
            usd, source = m.provider_cost_usd / m.provider_tokens * 1e6 * c.batch_price_factor, "measured x batch_price_factor"
        else:
            usd, source = None, "not priced"
        # the provider's progress: the requests come back over the open batches, per second since the
        # first was submitted (none back yet, or no open batch: the window)
        mine = [b for b in open_ if b.backend == name]
        done = sum(b.completed for b in mine)
        since = min((b.submitted_at for b in mine), default=now)
        rps = done / (now - since) if done and now > since else None
        out.append(BatchMeasure(backend=name, usd_per_mtok=usd, price_source=source, window=c.completion_window,
                                window_s=window_seconds(c.completion_window), progress_rps=rps,
                                open_prompts=sum(b.prompts for b in mine),
                                live_workers=sum(1 for w in reports if w.kind == "batch" and w.backend == name
                                                 and is_live_on(w, dataset))))
    return out


def budget_from_store(budget: int | None, stored: int, paid: int, max_tokens: int | None, turns: int = 1,
                      rule: BudgetRule = "exact") -> BudgetUse | None:
    """A budget's use from a store's figures (``stored``: every version's record tokens, ``paid``:
    ``Store.paid_tokens``; ``turns``: the next task's answers, ``queues.next_answers``), as the
    ledger counts it; None without a budget."""
    if budget is None:
        return None
    return budget_use(budget, stored, paid, (max_tokens or 1) * turns, rule)


def plan_from_store(cfg: FleetConfig | None, f: StoreFigures, r: redis.Redis | None) -> DatasetPlan:
    """The plan from the store's figures (counts, busy time, provider costs), with the ledger's
    recent rates, the worker reports and the assignment when Redis is at hand (``r``)."""
    reports = worker_reports(r) if r is not None else []
    # a backend's batch answers are its batch side's figures, not its own (:func:`note_activity`)
    activity = {a.backend: a for a in f.activity if a.kind != "batch"}
    answered = {a.backend: a for a in f.activity if a.kind == "batch"}
    kinds = _backends(cfg, reports, {a.backend: a.kind for a in activity.values()})
    names = sorted(kinds)
    rates = Ledger(r).rates(f.dataset, names, [60, WINDOW_S]) if r is not None and names else {}
    ratio = f.prompt_tokens / f.completion_tokens if f.completion_tokens else 0.0
    measures = []
    for name in names:
        a = activity.get(name)
        window = rates.get(name, [0.0, 0.0])
        measures.append(BackendMeasure(
            backend=name, kind=kinds[name], window_tps=window[1], producing=window[0] > 0,
            run_tps=a.busy_tokens / a.busy_s if a and a.busy_s >= 1 else None,
            provider_tokens=a.provider_tokens if a else 0, provider_cost_usd=a.provider_cost_usd if a else 0.0,
            configured_usd_per_mtok=_configured_price(cfg, name, ratio),
            live_workers=sum(1 for w in reports if w.backend == name and w.kind == kinds[name]
                             and is_live_on(w, f.dataset))))
    closed = Ledger(r).closed_at(f.dataset) is not None if r is not None else False
    open_ = open_batches(r, f.dataset) if r is not None else []
    return plan_dataset(f.dataset, responses=f.responses, completion_tokens=f.completion_tokens,
                        budget=f.budget, prompts_left=f.prompts_left, measures=measures,
                        assigned=kinds_for(r, f.dataset) if r is not None else {"gpu", "cloud"},
                        closed=closed, workers_known=r is not None,
                        batches=batch_measures(cfg, open_, reports, f.dataset, measures, ratio, answered=answered),
                        # the store's prompts left (not stored) hold the open batches' already
                        in_batch=sum(b.held_prompts for b in open_) if f.prompts_left is not None else 0)


# -- rendering ----------------------------------------------------------------------------------------
def duration(seconds: float | None) -> str:
    """``13h08m``, ``4m05s``, ``3d02h``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(seconds)
    d, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    if d:
        return f"{d}d{h:02d}h"
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def tokens(n: float | None) -> str:
    if n is None:
        return "-"
    if abs(n) < 100_000:
        return f"{n:,.0f}"
    return f"{n / 1e6:.2f}M" if abs(n) < 1e9 else f"{n / 1e9:.2f}G"


def usd(x: float) -> str:
    """Money, without the sign: cents from a dollar up; below it four decimals, so a small run's
    spend or cost does not read as 0.00 (every command and the report show money so)."""
    return f"{x:,.2f}" if abs(x) >= 1 or x == 0 else f"{x:.4f}"


def rule_words(b: BudgetUse) -> str:
    """The rule a budget follows, in words (``budget_rule``, draftfleet/ledger.py)."""
    if b.rule == "whole":
        return "whole answers: may end over the budget by less than one answer"
    return "exact: never above the budget; the last answers are cut at what is left"


def spent(b: BudgetUse) -> str:
    """``920 of a 1,000 budget spent (900 in paid turns not stored yet), 80 left``."""
    paid = f" ({tokens(b.paid_tokens)} in paid turns not stored yet)" if b.paid_tokens else ""
    return f"{tokens(b.spent_tokens)} of a {tokens(b.budget_tokens)} budget spent{paid}, {tokens(b.left_tokens)} left"


def headline(p: DatasetPlan) -> str:
    """One line: what is left and why (the ETA, or why there is none)."""
    b = p.budget
    if p.state == "closed":
        return f"{p.dataset}: closed at its budget ({spent(b) if b else tokens(p.completion_tokens) + ' tokens'})"
    if p.state == "full":
        return (f"{p.dataset}: full: {spent(b)}, less than the {tokens(b.floor_tokens)} a prompt is granted at "
                f"least ({rule_words(b)}); admission refuses more (raise budget_tokens and enqueue to go on)")
    if p.state == "done":
        return f"{p.dataset}: done, no prompt left ({tokens(p.completion_tokens)} tokens)"
    left = f"{tokens(p.remaining_tokens)} tokens left" if p.remaining_tokens is not None else "tokens left: not known"
    if b is not None:
        left += f" of a {tokens(b.budget_tokens)} budget ({'whole answers' if b.rule == 'whole' else 'exact'})"
        if b.paid_tokens:
            left += f" ({tokens(b.paid_tokens)} of it spent in paid turns not stored yet)"
    if p.prompts_left is not None:
        left += f", {p.prompts_left:,} prompts left"
        if p.in_batch:
            left += f" ({p.in_batch:,} of them in open batches)"
    if p.stalled:
        now = f"stalled: {p.stalled}"
    elif not p.workers_known:
        now = "workers not known (no Redis)"
    elif p.eta_s is not None:
        now = f"ETA {duration(p.eta_s)} ({'+'.join(p.eta_kinds or p.assigned)})"
    else:
        now = "ETA - (no rate yet)"
    return f"{p.dataset}: {left}; {now}" + batch_note(p)


def batch_note(p: DatasetPlan) -> str:
    """``; by batch on openrouter: $5.32, about half the money, within a day`` where a batch API is the
    cheapest way that costs money (the GPUs cost none, but take their time): priced, and below every
    priced cloud side; empty otherwise."""
    batches = [s for s in p.sides if s.kind == "batch" and s.cost_usd is not None]
    if p.state != "open" or not p.remaining_tokens or not batches:
        return ""
    b = min(batches, key=lambda s: (s.cost_usd, s.time_s if s.time_s is not None else float("inf")))
    clouds = [s.cost_usd for s in p.sides if s.kind == "cloud" and s.cost_usd is not None]
    if clouds and b.cost_usd >= min(clouds):
        return ""
    share = b.cost_usd / min(clouds) if clouds and min(clouds) > 0 else None
    money = ("" if share is None else ", about half the money" if 0.4 <= share <= 0.6
             else f", {share:.0%} of the cloud's money")
    if b.time_s is None:
        when = ""
    elif b.rate_source == "provider's progress":
        when = f", in about {duration(b.time_s)} at the provider's progress"
    else:
        when = ", within a day" if b.time_s == 86400 else f", within {duration(b.time_s)}"
    return f"; by batch on {b.backend}: ${usd(b.cost_usd)}{money}{when}"


def _side_row(s: Side, workers_known: bool) -> list[str]:
    tps = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "-"
    cost = "-" if s.cost_usd is None else usd(s.cost_usd)
    if s.kind == "both":
        how = "every side above at its rate"
    elif s.kind == "batch":
        price = "no price" if s.usd_per_mtok is None else f"${usd(s.usd_per_mtok)}/Mtok {s.price_source}"
        live = ("workers not known" if not workers_known else f"{s.live_workers} batch worker(s)" if s.live_workers
                else "no batch worker")
        how = f"time: {s.rate_source}; {price}; {live}" + ("" if s.assigned else ", not assigned")
    else:
        price = ("no money per token" if s.price_source == "local" else "no price" if s.usd_per_mtok is None
                 else f"${usd(s.usd_per_mtok)}/Mtok {s.price_source}")
        live = ("workers not known" if not workers_known else f"{s.live_workers} live" if s.live_workers
                else "none live")
        how = f"rate: {s.rate_source}; {price}; {live}" + ("" if s.assigned else ", not assigned")
    label = s.backend if s.kind == "both" else f"{s.backend} (batch API)" if s.kind == "batch" else f"{s.backend} ({s.kind})"
    return [escape(label), tps, duration(s.time_s), cost, escape(how)]


def render_plans(plans: list[DatasetPlan]) -> Group:
    """Each dataset's headline, then one row per side: rate, price, time and money to finish there."""
    parts = []
    for p in plans:
        parts.append(Text(headline(p), style="red" if p.stalled else ""))
        if p.state != "open" or not p.sides:
            continue
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), show_edge=False)
        for name, numeric in (("to finish on", False), ("tok/s", True), ("time", True), ("cost $", True),
                              ("measured how", False)):
            if numeric:
                t.add_column(name, justify="right", no_wrap=True)
            else:
                t.add_column(name, overflow="fold")
        for s in p.sides + ([p.at_once] if p.at_once else []):
            t.add_row(*_side_row(s, p.workers_known))
        parts.append(t)
    return Group(*parts)
