"""``draftfleet report``: the run as pictures, one self-contained HTML file."""

from __future__ import annotations

from rich.markup import escape

from draftfleet.cli.common import add_common, add_version, config_or_store, dataset_names, err


def cmd_report(args) -> int:
    from draftfleet.assign import live_budgets
    from draftfleet.cli.plan import fleet_redis
    from draftfleet.ledger import Ledger
    from draftfleet.queues import next_answers
    from draftfleet.store import open_store
    from draftfleet.versions import VersionError, select
    from draftfleet.views.inventory import dataset_keys
    from draftfleet.views.plan import plan_from_store
    from draftfleet.views.report import build_report, write_report

    cfg, root = config_or_store(args)
    store = open_store(cfg or root)
    names = dataset_names(args, cfg, root)
    r = fleet_redis(args, cfg)
    budgets = live_budgets(cfg, r) if cfg is not None and r is not None else {}
    caps = {n: c.max_spend_usd for n, c in cfg.clouds.items()} if cfg else {}
    configured = {d.name: d for d in cfg.datasets} if cfg else {}
    sections = []
    for name in names:
        try:
            selection = select(store, name, args.version, args.all_versions)
        except VersionError as exc:
            err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
        manifest = store.manifest(name)
        ds = configured.get(name)
        settings = manifest.settings if manifest else (ds.settings(cfg.fleet.model) if ds else None)
        # another version than the current one is drawn without budget or plan: they are the current one's
        current = manifest is None or selection.version == manifest.version
        budget = budgets.get(name, ds.budget_tokens if ds else manifest.budget_tokens if manifest else None)
        drawn = selection.settings or settings  # the drawn version's own max_tokens (every version's: the current one's)
        sections.append({
            "dataset": name, "max_tokens": drawn.max_tokens if drawn else None,
            "budget": budget if current else None, "caps": caps,
            "plan": (lambda figures: plan_from_store(cfg, figures, r)) if current else None,
            "events_counts": Ledger(r).events(name) if r is not None else {},
            "prompt_keys": dataset_keys(ds, settings) if ds and settings else None, "selection": selection,
            "answers": next_answers(r, name) if r is not None else 1,
        })
    path = write_report(args.out, build_report(store, sections))
    err.print(f"report: {path} ({len(sections)} dataset(s))", highlight=False)
    return 0


def register(sub) -> None:
    sp = sub.add_parser("report", help="the run as pictures: one self-contained HTML file (charts inlined as SVG)")
    add_common(sp)
    add_version(sp)
    sp.add_argument("--out", "-o", required=True, help="the HTML file to write")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.set_defaults(func=cmd_report)
