"""``draftfleet report``: a run that lasts days, as pictures, in one self-contained HTML file.

Per dataset (its current version, or ``--version N`` / ``--all-versions``, as inventory takes them), from the store (the truth): the completion-length histogram of each backend with the
``max_tokens`` line and the share cut there; tokens over time per backend with the pivots, the
budget's changes (the store's log, ``Store.events``) and the budget line; cloud spend over time
against each cap; failures and quarantined lines by reason (with the ledger's retry and failure
counters when Redis is at hand); hidden-state capture progress and bytes; and the plan. Charts are
drawn by matplotlib as SVG and inlined: the file needs no network and no script.

Records are read with a decoder of only the fields drawn (msgspec skips the ids), by a process per
core for large datasets, and series are binned before drawing: a 100k-record dataset reports in
seconds (``python -m bench report``).
"""

from __future__ import annotations

import html
import io
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgspec

from draftfleet.ledger import BudgetUse
from draftfleet.schemas.records import IMPORTED_BY
from draftfleet.store import Store
from draftfleet.versions import Selection, select
from draftfleet.views.plan import (Activity, DatasetPlan, StoreFigures, activities, budget_from_store, duration,
                                   headline, merge_activity, note_activity, tokens, usd)

PARALLEL_FROM = 5000  # record files; below this a process pool costs more than it saves
MAX_POINTS = 400  # points per time series drawn (binned): the SVG stays small whatever the store holds


class _Row(msgspec.Struct):
    """The part of a record the report draws (decoding only this skips the ids)."""

    backend: str
    backend_kind: str
    completion_tokens: int
    prompt_tokens: int
    truncated: bool
    cost_usd: float
    cost_source: str
    created_at: float
    latency_s: float
    worker: str
    settings_id: str
    batch_id: str | None = None  # made by a provider batch (its price and hours are the batch side's)
    turns: list[msgspec.Raw] = []  # a conversation's turns, left undecoded: only their number is drawn


_row = msgspec.json.Decoder(_Row)


class Columns(msgspec.Struct):
    """A dataset's records as columns (one entry per record), in no set order."""

    backend: list[str]
    kind: list[str]
    tokens: list[int]
    truncated: list[bool]
    cost: list[float]
    at: list[float]
    imported: list[bool]
    keys: list[str]
    unreadable: int = 0
    other_responses: int = 0  # records of the dataset's other versions (the budget counts them too)
    other_tokens: int = 0
    units: int = 0  # record turns (a conversation has one per regenerated turn): what capture captures
    prompt_tokens: int = 0
    activity: dict[str, Activity] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}  # backend -> its requests' (start, end), not imported


def _read(store: Store, paths: list[str], settings_id: str | None) -> Columns:
    c = Columns([], [], [], [], [], [], [], [])
    for path, data in store.read_many(paths):
        try:
            if isinstance(data, OSError):
                raise data
            r = _row.decode(data)
        except (OSError, msgspec.DecodeError):
            c.unreadable += 1
            continue
        if settings_id is not None and r.settings_id != settings_id:
            c.other_responses += 1  # another version's record: only the budget counts it
            c.other_tokens += r.completion_tokens
            continue
        c.backend.append(r.backend)
        c.kind.append(r.backend_kind)
        c.tokens.append(r.completion_tokens)
        c.truncated.append(r.truncated)
        c.cost.append(r.cost_usd)
        c.at.append(r.created_at)
        c.imported.append(r.worker == IMPORTED_BY)
        c.keys.append(path.rsplit("/", 1)[-1][:-5])
        c.prompt_tokens += r.prompt_tokens
        c.units += len(r.turns) or 1
        note_activity(c.activity, c.intervals, r, r.completion_tokens)
    return c


def read_columns(store: Store, dataset: str, processes: int | None = None, selection: Selection | None = None) -> Columns:
    """The records of ``selection`` (default the dataset's current version, ``versions.select``), as
    inventory takes them."""
    paths = store.record_files(dataset)
    settings_id = (selection or select(store, dataset)).settings_id
    n = processes or (min(os.cpu_count() or 1, 8) if len(paths) >= PARALLEL_FROM else 1)
    if n == 1:
        return _read(store, paths, settings_id)
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = list(pool.map(_read, [store] * n, [paths[i::n] for i in range(n)], [settings_id] * n))
    out = Columns([], [], [], [], [], [], [], [])
    for p in parts:
        for f in ("backend", "kind", "tokens", "truncated", "cost", "at", "imported", "keys"):
            getattr(out, f).extend(getattr(p, f))
        out.unreadable += p.unreadable
        out.other_responses += p.other_responses
        out.other_tokens += p.other_tokens
        out.prompt_tokens += p.prompt_tokens
        out.units += p.units
        merge_activity(out.activity, out.intervals, p.activity, p.intervals)
    return out


def store_figures(c: Columns, dataset: str, budget: BudgetUse | None, prompt_keys: set[str] | None) -> StoreFigures:
    """What the plan needs, from the same read (the report reads the store once)."""
    activity = activities(c.activity, c.intervals)
    return StoreFigures(dataset=dataset, responses=len(c.tokens), completion_tokens=sum(c.tokens),
                        prompt_tokens=c.prompt_tokens, budget=budget,
                        prompts_left=len(prompt_keys - set(c.keys)) if prompt_keys is not None else None,
                        activity=activity)


# -- charts --------------------------------------------------------------------------------------------
def _figure(height: float = 3.2):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, height), layout="constrained")
    return fig, fig.add_subplot()


def _svg(fig) -> str:
    """The figure as inline SVG: text kept as text (searchable, small), ids stable from run to run."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "draftfleet"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: without the XML prolog and doctype


def _amounts(ax, prefix: str = "") -> None:
    """The y-axis in plain amounts with k/M/G suffixes (``250k``, ``1.5M``, ``$20``), never
    matplotlib's ``1e7`` offset above the axis."""
    from matplotlib.ticker import FuncFormatter

    def amount(y: float, _pos=None) -> str:
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(y) >= scale:
                return f"{prefix}{y / scale:.4g}{suffix}"
        return f"{prefix}{y:.4g}"

    ax.yaxis.set_major_formatter(FuncFormatter(amount))


OFF_SCALE = 5.0  # a reference line over this many times the data's top is not drawn: it would flatten the data


def _off_scale(value: float, top: float) -> bool:
    return top > 0 and value > OFF_SCALE * top


def _reference(ax, value: float, top: float, label: str, **style) -> None:
    """A horizontal reference (a budget, a cap) against data that reach ``top``: a line where it is on
    the data's scale; far above it (``OFF_SCALE``), only its legend entry, saying so."""
    if _off_scale(value, top):
        ax.plot([], [], label=label[:-1] + "; off the scale)" if label.endswith(")") else f"{label} (off the scale)",
                **style)
    else:
        ax.axhline(value, label=label, **style)


def _label(backend: str, imported: bool) -> str:
    return f"{backend} (imported)" if imported else backend


# A time axis reads in the largest unit its span holds at least two of (under 2 h: minutes; under 2 min: seconds).
_TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))


class TimeAxis:
    """Every time chart's x-axis: times as offsets from ``t0``, in the unit that suits ``t0``..``end``."""

    def __init__(self, t0: float, end: float):
        self.t0, self.end = t0, end
        self.seconds, self.unit = next(((s, u) for s, u in _TIME_UNITS if end - t0 >= 2 * s), _TIME_UNITS[-1])

    def x(self, at: float) -> float:
        return (at - self.t0) / self.seconds

    def xs(self, values: list[float]) -> list[float]:
        return [self.x(v) for v in values]

    def label(self, ax, since: str) -> None:
        ax.set_xlabel(f"{self.unit} since {since}")


def length_histogram(c: Columns, max_tokens: int | None) -> str:
    import numpy as np

    fig, ax = _figure()
    tokens_ = np.asarray(c.tokens)
    cut = np.asarray(c.truncated)
    groups = sorted({(b, i) for b, i in zip(c.backend, c.imported)})
    top = max(max_tokens or 0, int(tokens_.max()) if len(tokens_) else 1)
    bins = np.linspace(0, top, 61)
    names = np.asarray([f"{b}\x00{i}" for b, i in zip(c.backend, c.imported)])
    for b, imp in groups:
        mask = names == f"{b}\x00{imp}"
        share = cut[mask].mean() if mask.any() else 0.0
        ax.hist(tokens_[mask], bins=bins, histtype="step", linewidth=1.5,
                label=f"{_label(b, imp)}: {int(mask.sum()):,} responses, {100 * share:.1f}% cut at max_tokens")
    if max_tokens:
        ax.axvline(max_tokens, color="red", linestyle="--", label=f"max_tokens = {max_tokens:,}")
    ax.set_xlabel("completion tokens per response")
    ax.set_ylabel("responses")
    ax.legend(fontsize="small")
    return _svg(fig)


def _binned_cumulative(at: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """The running sum of ``values`` in time order, at most ``MAX_POINTS`` points."""
    import numpy as np

    if not at:
        return [], []
    order = np.argsort(at)
    t = np.asarray(at)[order]
    y = np.cumsum(np.asarray(values, dtype=float)[order])
    if len(t) > MAX_POINTS:
        idx = np.unique(np.linspace(0, len(t) - 1, MAX_POINTS).astype(int))
        t, y = t[idx], y[idx]
    return t.tolist(), y.tolist()


def tokens_over_time(c: Columns, events: list, budget: int | None, axis: TimeAxis) -> str:
    fig, ax = _figure(3.6)
    groups = sorted({(b, i) for b, i in zip(c.backend, c.imported)})
    for b, imp in groups:
        sel = [k for k in range(len(c.at)) if c.backend[k] == b and c.imported[k] == imp]
        t, y = _binned_cumulative([c.at[k] for k in sel], [c.tokens[k] for k in sel])
        ax.step(axis.xs(t), y, where="post", label=_label(b, imp))
    t, y = _binned_cumulative(c.at, c.tokens)
    if len(groups) > 1:  # dashed, on top: where one backend ran alone the two lines coincide and both show
        ax.step(axis.xs(t), y, where="post", color="black", linewidth=1, linestyle=(0, (4, 3)),
                label="all backends (total)")
    top = y[-1] if y else 0.0
    steps = [(e.at, e.budget_tokens) for e in events if e.kind == "budget"]
    if steps:
        xs, ys = [], []
        for at, b in steps:
            if b is not None:
                xs.append(axis.x(at))
                ys.append(b)
        far = [b for b in ys if _off_scale(b, top)]
        if xs and len(far) == len(ys):
            _reference(ax, ys[-1], top, f"budget {tokens(ys[-1])}", color="grey", linestyle="--")
        elif xs:
            ax.step([*xs, axis.x(axis.end)], [*ys, ys[-1]], where="post", color="grey", linestyle="--",
                    label=(f"budget (as enqueued; {tokens(max(far))} off the scale)" if far
                           else "budget (as enqueued)"))
            if far:  # the scale of the data and of the budgets near it; the far ones run off the top
                high = max(top, *(b for b in ys if b not in far))
                ax.set_ylim(-0.05 * high, 1.05 * high)
    elif budget:
        _reference(ax, budget, top, f"budget {tokens(budget)}", color="grey", linestyle="--")
    for e in events:
        if e.kind == "assign":
            ax.axvline(axis.x(e.at), color="purple", linestyle=":")
            ax.annotate(f"{e.note}: {'+'.join(e.assigned or []) or 'nobody'}", (axis.x(e.at), 0),
                        xycoords=("data", "axes fraction"), rotation=90, fontsize="small", va="bottom",
                        ha="right", color="purple")
    axis.label(ax, "the first record")
    ax.set_ylabel("completion tokens (cumulative)")
    _amounts(ax)
    ax.legend(fontsize="small", loc="upper left")
    return _svg(fig)


def spend_over_time(c: Columns, caps: dict[str, float | None], axis: TimeAxis) -> str | None:
    clouds = sorted({b for b, k in zip(c.backend, c.kind) if k == "cloud"} | set(caps))
    if not any(k == "cloud" for k in c.kind):
        return None
    fig, ax = _figure()
    spent = {}
    for b in clouds:
        sel = [k for k in range(len(c.at)) if c.backend[k] == b]
        t, y = _binned_cumulative([c.at[k] for k in sel], [c.cost[k] for k in sel])
        if t:
            ax.step(axis.xs(t), y, where="post", label=f"{b}: ${usd(y[-1])}")
            spent[b] = y[-1]
    top = max(spent.values(), default=0.0)
    for b in clouds:
        if caps.get(b) is not None:
            _reference(ax, caps[b], top, f"{b} cap ${usd(caps[b])} (all datasets)", linestyle="--", color="red")
    axis.label(ax, "the first record")
    ax.set_ylabel("USD (cumulative, this dataset)")
    _amounts(ax, "$")
    ax.legend(fontsize="small", loc="upper left")
    return _svg(fig)


def reasons_chart(counts: dict[str, int]) -> str | None:
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: kv[1])
    fig, ax = _figure(max(1.6, 0.35 * len(items) + 0.8))
    bars = ax.barh([k for k, _ in items], [v for _, v in items], color="#c44")
    ax.bar_label(bars, labels=[f"{v:,}" for _, v in items], fontsize="small", padding=2)
    ax.set_xlabel("count")
    return _svg(fig)


def capture_chart(store: Store, dataset: str, units: int) -> tuple[str | None, str, list[str]]:
    """Captured turns over time (the files' times) against the units, the bytes they take, and why
    each file is bad: every file is read through its seal (``inventory --verify``'s check), so a
    file changed after it was stored, which no export takes, is on the page."""
    from draftfleet.hidden import open_hidden

    hidden = open_hidden(store)
    m = hidden.manifest(dataset)
    if m is None:
        return None, "no hidden-state capture for this dataset", []
    held = sorted((e.mtime, e.turns, e.tokens, e.bytes) for e in hidden.entries(dataset, m.version))
    good, unsealed, bad = hidden.verify(dataset, m.version)
    times = [h[0] for h in held]
    turns, ntokens, size = (sum(h[i] for h in held) for i in (1, 2, 3))
    text = (f"v{m.version} (layers {m.layer_ids}): {turns:,} of {units:,} turns captured, {ntokens:,} tokens, "
            f"{size / 1e9:,.3f} GB" + (f" ({size / ntokens:,.0f} B/token)" if ntokens else "")
            + f"; {good:,} files as sealed" + (f", {unsealed:,} of a version made before seals, not checked"
                                               if unsealed else ""))
    if not times:
        return None, text, bad
    fig, ax = _figure(2.8)
    t, y = _binned_cumulative(times, [float(h[1]) for h in held])  # a conversation's file: all its turns
    axis = TimeAxis(times[0], times[-1])
    ax.step(axis.xs(t), y, where="post", label="captured turns")
    _reference(ax, units, y[-1], f"{units:,} record turns", color="grey", linestyle="--")
    axis.label(ax, "the first capture")
    ax.set_ylabel("turns")
    _amounts(ax)
    ax.legend(fontsize="small", loc="upper left")
    return _svg(fig), text, bad


# -- the page ------------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
h3 { font-size: 1.05em; margin-bottom: .3em; }
table { border-collapse: collapse; font-size: .9em; } td, th { padding: .2em .6em; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
.chart svg { width: 100%; height: auto; } .note { color: #666; font-size: .9em; } .stalled { color: #b00; }
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def plan_table(p: DatasetPlan) -> str:
    rows = []
    for s in p.sides + ([p.at_once] if p.at_once else []):
        price = {"local": "local", "not priced": "not priced"}.get(
            s.price_source, f"{usd(s.usd_per_mtok)} ({s.price_source})" if s.usd_per_mtok is not None else "-")
        rows.append("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in (
            f"{s.backend} (batch API)" if s.kind == "batch" else f"{s.backend} ({s.kind})",
            f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "-", s.rate_source, price,
            duration(s.time_s), "-" if s.cost_usd is None else usd(s.cost_usd),
            "" if s.kind == "both" else (f"{s.live_workers} {'batch worker(s)' if s.kind == 'batch' else 'live'}"
                                         if p.workers_known else "not known")
            + ("" if s.assigned else ", not assigned"))) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("to finish on", "tok/s", "rate from", "$/Mtok", "time", "cost $",
                                               "workers"))
    cls = ' class="stalled"' if p.stalled else ""
    return (f"<p{cls}>{_e(headline(p))}</p>"
            + (f"<table><tr>{head}</tr>{''.join(rows)}</table>" if p.state == "open" and rows else ""))


def _chart(title: str, svg: str | None, note: str = "") -> str:
    body = f'<div class="chart">{svg}</div>' if svg else ""
    return f"<h3>{_e(title)}</h3>{body}" + (f'<p class="note">{_e(note)}</p>' if note else "")


def dataset_section(store: Store, dataset: str, *, max_tokens: int | None, budget: int | None,
                    caps: dict[str, float | None], plan: Callable[[StoreFigures], DatasetPlan] | None,
                    events_counts: dict[str, int], prompt_keys: set[str] | None = None,
                    selection: Selection | None = None, answers: int = 1) -> str:
    """One dataset's part of the page: the records of ``selection`` (default its current version);
    ``plan`` makes its plan from the figures read here; ``answers``: the next queued task's turns."""
    selection = selection or select(store, dataset)
    c = read_columns(store, dataset, selection=selection)
    total = sum(c.tokens)
    manifest = store.manifest(dataset) if budget is not None else None
    use = budget_from_store(budget, total + c.other_tokens, store.paid_tokens(dataset) if budget is not None else 0,
                            max_tokens, answers, manifest.budget_rule if manifest is not None else "exact")
    p = plan(store_figures(c, dataset, use, prompt_keys)) if plan is not None else None
    events = store.events(dataset)
    t0 = min([*c.at, *(e.at for e in events)], default=time.time())
    axis = TimeAxis(t0, max([*c.at, *(e.at for e in events)], default=t0))  # tokens' and spend's, alike
    cut = sum(c.truncated)
    summary = (f"{len(c.tokens):,} responses, {total:,} completion tokens"
               + (f"; {use.spent_tokens:,} of a {budget:,} budget spent ({100 * use.spent_tokens / budget:.1f}%"
                  + (f", {use.paid_tokens:,} of them in paid turns of conversations not stored yet" if use.paid_tokens
                     else "") + f"), {use.left_tokens:,} left" if use and budget else "")
               + f"; {cut:,} cut at max_tokens ({100 * cut / len(c.tokens) if c.tokens else 0:.1f}%)"
               + (f"; {c.unreadable:,} record files unreadable" if c.unreadable else ""))
    manifest = store.manifest(dataset)
    which = ("" if manifest is None else "every version" if selection.version is None
             else f"version {selection.version} of {manifest.version}")
    parts = [f"<h2>{_e(dataset)}" + (f" <small>({_e(which)})</small>" if which else "") + "</h2>",
             f"<p>{_e(summary)}</p>"]
    if p is not None:
        parts.append("<h3>plan: to finish</h3>" + plan_table(p))
    parts.append(batch_rows(store, dataset))
    if not c.tokens:
        parts.append('<p class="note">no records yet</p>')
        return "".join(parts)
    parts.append(_chart("completion length per backend", length_histogram(c, max_tokens),
                        "a spike at the red line is answers cut at max_tokens"))
    parts.append(_chart("tokens over time per backend", tokens_over_time(c, events, budget, axis),
                        "dotted lines: pivots and drains (the assignment after); grey dashes: the budget; "
                        "black dashes: all backends"))
    spend = spend_over_time(c, caps, axis)
    parts.append(_chart("cloud spend over time", spend, "" if spend else "no cloud records"))
    failures: dict[str, int] = {}
    for f in store.failures(dataset):
        failures[f"failed: {f.error_kind}"] = failures.get(f"failed: {f.error_kind}", 0) + 1
    for kind, n in _quarantined(store, dataset).items():
        failures[f"quarantined: {kind}"] = n
    for name, n in events_counts.items():
        if name.startswith(("retry:", "failed:")) and n:
            failures[f"counted {name}"] = n
    parts.append(_chart("failures and quarantined lines by reason", reasons_chart(failures),
                        "" if failures else "none"))
    svg, note, bad = capture_chart(store, dataset, c.units)
    parts.append(_chart("hidden-state capture", svg, note))
    if bad:
        parts.append(f'<p class="stalled">{len(bad):,} file{"s" if len(bad) > 1 else ""} changed or unreadable since '
                     "stored, not exported (capture each unit again):</p><ul>"
                     + "".join(f'<li class="stalled">{_e(why)}</li>' for why in bad) + "</ul>")
    return "".join(parts)


def batch_rows(store: Store, dataset: str) -> str:
    """The dataset's provider batches (open ones first), from the store: what each held and became."""
    batches = [b for b in store.batches() + store.batches(closed=True) if b.dataset == dataset]
    if not batches:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("batch", "backend", "provider id", "status", "prompts", "stored",
                                               "back to queue", "failed", "submitted", "note"))
    rows = []
    for b in batches:
        states = [q.state for q in b.requests]
        note = "open" if not b.closed else ""
        if b.cancel_requested:
            note = ("cancel requested" if b.cancellable else "could not be cancelled: waited for") + (
                "" if b.closed else ", open")
        rows.append("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in (
            b.id, b.backend, b.provider_id or "-", b.status, len(states), states.count("stored"),
            states.count("returned"), states.count("failed"),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(b.submitted_at)), (b.error or note)[:200])) + "</tr>")
    return f"<h3>provider batches</h3><table><tr>{head}</tr>{''.join(rows)}</table>"


def _quarantined(store: Store, dataset: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in store.quarantined(dataset):
        out[e.kind] = out.get(e.kind, 0) + 1
    return out


def build_report(store: Store, datasets: list[dict], title: str = "draftfleet report") -> str:
    """The whole page; ``datasets``: keyword arguments of :func:`dataset_section` with ``dataset``."""
    sections = [dataset_section(store, **d) for d in datasets]
    made = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
            f'<p class="note">store {_e(store.location)}, made {_e(made)}: the store is the truth; pivots and budget '
            "changes from its log; retries from the fleet's counters when Redis was at hand</p>"
            + "".join(sections) + "</body></html>\n")


def write_report(path: str | Path, text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
