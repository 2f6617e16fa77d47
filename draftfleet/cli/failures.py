"""``draftfleet failures``: the prompts whose retries ran out, whether a retry can help, and the
input lines the readers quarantined."""

from __future__ import annotations

from collections import Counter

from rich import box
from rich.markup import escape
from rich.table import Table

from draftfleet.cli.common import add_common, config_or_store, out

_VERDICT = {"yes": "may succeed if re-sent", "maybe": "may succeed if re-sent", "no": "will fail again"}


def cmd_failures(args) -> int:
    import msgspec

    from draftfleet.store import open_store
    from draftfleet.views.failures import failure_rows, quarantine_rows

    cfg, root = config_or_store(args)
    store = open_store(cfg or root)
    names = args.dataset or ([d.name for d in cfg.datasets] if cfg else store.datasets())
    rows = failure_rows(store, names)
    if args.json:
        print(msgspec.json.encode(rows).decode())
        return 0
    table = _table(f"failures ({len(rows)})", ["prompt", "kind", "tries", "retry?", "reason"])
    for row in rows:
        table.add_row(escape(f"{row.dataset} {row.source}"), row.kind, str(row.attempts), row.retry, escape(row.reason))
    out.print(table if rows else "failures: none")
    verdicts = Counter((r.retry, r.advice) for r in rows)
    for (retry, advice), n in sorted(verdicts.items()):
        out.print(f"{n} {_VERDICT[retry]}: {escape(advice)}", highlight=False)
    if rows:
        hopeless = sum(n for (retry, _), n in verdicts.items() if retry == "no")
        if hopeless:
            out.print(f"draftfleet enqueue --retry-failed re-sends all {len(rows)}, also the {hopeless} that will "
                      "fail again: fix those first", highlight=False)
        else:
            out.print("re-send with: draftfleet enqueue --retry-failed", highlight=False)
    quarantined = quarantine_rows(store, names)
    if not quarantined:
        out.print("quarantined lines: none")
        return 0
    qt = _table(f"quarantined lines ({sum(q.lines for q in quarantined)})", ["dataset", "kind", "lines", "first"])
    for q in quarantined:
        qt.add_row(q.dataset, q.kind, str(q.lines), escape(q.first))
    out.print(qt)
    for path in dict.fromkeys(q.file for q in quarantined):
        out.print(f"kept verbatim in {escape(path)}; fix the file and run enqueue again to read them again",
                  highlight=False)
    return 0


def _table(title: str, columns: list[str]) -> Table:
    """Borderless, every text column folding: nothing cut at 80 columns, a reason shown whole."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for col in columns:
        t.add_column(col, overflow="fold", justify="right" if col in ("tries", "lines") else "left")
    return t


def register(sub) -> None:
    sp = sub.add_parser("failures", help="prompts whose retries ran out (and whether a retry helps), quarantined lines")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the failures as JSON (with retry and advice)")
    sp.set_defaults(func=cmd_failures)
