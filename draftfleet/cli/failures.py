"""``draftfleet failures``: the prompts whose retries ran out."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from draftfleet.cli.common import add_common, config_or_store, out


def cmd_failures(args) -> int:
    from draftfleet.store import Store

    cfg, root = config_or_store(args)
    store = Store(root)
    rows = []
    for name in args.dataset or ([d.name for d in cfg.datasets] if cfg else store.datasets()):
        for f in store.failures(name):
            rows.append({"dataset": f.dataset, "key": f.key, "source": f.source, "kind": f.error_kind,
                         "attempts": f.attempts, "reason": f.reason})
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=f"failures ({len(rows)}); re-send with: draftfleet enqueue --retry-failed")
    for col in ("dataset", "source", "kind", "attempts", "reason"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["dataset"], escape(row["source"]), row["kind"], str(row["attempts"]), escape(row["reason"][:80]))
    out.print(table)
    return 0


def register(sub) -> None:
    sp = sub.add_parser("failures", help="list prompts whose retries ran out")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the list as JSON")
    sp.set_defaults(func=cmd_failures)
