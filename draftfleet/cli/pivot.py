"""``draftfleet drain`` and ``draftfleet pivot``: move datasets between worker kinds, losing nothing."""

from __future__ import annotations

from rich.progress import Progress, TextColumn, TimeElapsedColumn

from draftfleet.cli.common import add_common, config_or_store, dataset_names, err, out, redis_client
from draftfleet.cli.inventory import print_inventory


def pivot_report(args, cfg, root, result, title: str) -> int:
    import msgspec

    from draftfleet.views.inventory import run_inventory

    inv = run_inventory(root, cfg, result.datasets)
    if args.json:
        print(msgspec.json.encode({"drain": result, "inventory": inv}).decode())
        return 0 if result.drained else 1
    state = "done" if result.drained else f"[red]timed out with {result.still_running} still running[/]"
    out.print(f"{title}: {state} after {result.waited_s:.0f}s; assignment now "
              + ", ".join(f"{d}: {'+'.join(k) or 'nobody'}" for d, k in result.assignment.items()))
    print_inventory(inv)
    return 0 if result.drained else 1


def _move(args, label: str, run, title: str) -> int:
    """Run a drain or pivot with a live "waiting for N in flight" line, then report."""
    cfg, root = config_or_store(args)
    r = redis_client(args, cfg)
    names = dataset_names(args, cfg, root)
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=err, disable=args.json) as progress:
        t = progress.add_task(label, total=None)
        tick = lambda running: progress.update(t, description=f"waiting for {running} in flight")  # noqa: E731
        result = run(r, names, tick)
    return pivot_report(args, cfg, root, result, title.format(datasets=", ".join(names)))


def cmd_drain(args) -> int:
    from draftfleet.views.pivot import drain

    return _move(args, "draining", lambda r, names, tick: drain(r, args.kind, names, args.timeout, tick),
                 f"drained {args.kind} from {{datasets}}")


def cmd_pivot(args) -> int:
    from draftfleet.views.pivot import pivot

    return _move(args, "pivoting", lambda r, names, tick: pivot(r, args.to, names, args.timeout, tick),
                 f"pivoted {{datasets}} to {args.to}")


def register(sub) -> None:
    sp = sub.add_parser("drain", help="stop a worker kind taking new tasks from datasets; wait for what it started")
    add_common(sp)
    sp.add_argument("--kind", choices=["gpu", "cloud"], required=True, help="the worker kind to drain")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for in-flight work")
    sp.add_argument("--json", action="store_true", help="print the result and the inventory as JSON")
    sp.set_defaults(func=cmd_drain)

    sp = sub.add_parser("pivot", help="hand datasets to one worker kind (drains the other)")
    add_common(sp)
    sp.add_argument("--to", choices=["gpu", "cloud"], required=True, help="the worker kind that takes the datasets")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for in-flight work (default 1800)")
    sp.add_argument("--json", action="store_true", help="print the result and the inventory as JSON")
    sp.set_defaults(func=cmd_pivot)
