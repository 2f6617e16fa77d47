"""``draftfleet report``: the run as pictures, one self-contained HTML file."""

from __future__ import annotations

from draftfleet.cli.common import add_common, config_or_store, dataset_names, err


def cmd_report(args) -> int:
    from draftfleet.assign import live_budgets
    from draftfleet.cli.plan import fleet_redis
    from draftfleet.ledger import Ledger
    from draftfleet.store import Store
    from draftfleet.views.inventory import run_inventory
    from draftfleet.views.plan import plan_from_inventory
    from draftfleet.views.report import build_report, write_report

    cfg, root = config_or_store(args)
    store = Store(root)
    names = dataset_names(args, cfg, root)
    r = fleet_redis(args, cfg)
    budgets = live_budgets(cfg, r) if cfg is not None and r is not None else {}
    caps = {n: c.max_spend_usd for n, c in cfg.clouds.items()} if cfg else {}
    sections = []
    for inv in run_inventory(root, cfg, names, None, 0):
        manifest = store.manifest(inv.dataset)
        max_tokens = manifest.settings.max_tokens if manifest else None
        if cfg is not None and any(d.name == inv.dataset for d in cfg.datasets):
            max_tokens = cfg.dataset(inv.dataset).max_tokens
        sections.append({
            "dataset": inv.dataset, "max_tokens": max_tokens, "budget": budgets.get(inv.dataset, inv.budget_tokens),
            "caps": caps, "plan": plan_from_inventory(cfg, inv, r), "units": inv.turns,
            "events_counts": Ledger(r).events(inv.dataset) if r is not None else {},
        })
    path = write_report(args.out, build_report(store, sections))
    err.print(f"report: {path} ({len(sections)} dataset(s))", highlight=False)
    return 0


def register(sub) -> None:
    sp = sub.add_parser("report", help="the run as pictures: one self-contained HTML file (charts inlined as SVG)")
    add_common(sp)
    sp.add_argument("--out", "-o", required=True, help="the HTML file to write")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.set_defaults(func=cmd_report)
