"""Report: ``draftfleet report`` on a 100k-record dataset, beside the inventory of the same store.

The store is the inventory benchmark's large one (lognormal lengths, one response in 20 cut at
``max_tokens``). Timed, each the best of ``repeats`` with the page cache warm: the report's whole
work in-process (the inventory its plan needs, reading the records' drawn fields, drawing the
charts, the page), the inventory alone (no tokenizer), and ``cat`` of the same files.
"""

from __future__ import annotations

from pathlib import Path

from draftfleet.store import open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.views.inventory import run_inventory
from draftfleet.views.plan import plan_from_store
from draftfleet.views.report import build_report

from .env import TOKENIZER, Figure, Section, fresh_dir, ratio
from .inventory import _cat, best, build


def report(root: Path, dataset: str) -> str:
    """What ``draftfleet report --store ROOT`` does, in-process."""
    section = {"dataset": dataset, "max_tokens": 1200, "budget": 40_000_000, "caps": {},
               "plan": lambda figures: plan_from_store(None, figures, None), "events_counts": {}}
    return build_report(open_store(root), [section])


def run(work: Path, *, responses: int, mean_tokens: float, repeats: int = 3) -> Section:
    tok = TargetTokenizer(str(TOKENIZER))
    folder = fresh_dir(work / "report")
    label = "large"
    root, _jsonl, total = build(folder, label, responses, mean_tokens, tok)
    t_report, page = best(lambda: report(root, label), repeats)
    t_inv, _ = best(lambda: run_inventory(root, None, [label], None, 0), repeats)
    t_cat, _ = best(lambda: _cat(f"find '{root / label}' -name '*.json' -print0 | xargs -0 cat > /dev/null"), repeats)
    what = f"`draftfleet report`, {responses:,} responses ({total / 1e6:.1f}M tokens)"
    figures = [
        Figure(bench="report", name=what, value=t_report, unit="s", reference="`draftfleet inventory` of the same store "
               "(no tokenizer)", reference_value=t_inv, ratio=ratio(t_report, t_inv, higher_is_better=False),
               target="seconds, not minutes (< 30 s)", met=t_report < 30, headline=True),
        Figure(bench="report", name=what, value=t_report, unit="s", reference="`cat` of the store's files",
               reference_value=t_cat, ratio=ratio(t_report, t_cat, higher_is_better=False)),
    ]
    details = [f"The page: {len(page) / 1024:,.0f} KiB, {page.count('<svg')} charts inlined as SVG (series binned to "
               "at most 400 points, so its size does not grow with the store). The report reads the store once, "
               "decoding only the fields it draws (msgspec skips the ids), a process per core; the command adds "
               "its start-up (imports, matplotlib) and, with a config, hashing the dataset file's prompts for the "
               "prompts left."]
    return Section(bench="report", title="Report", command="", figures=figures, details=details)
