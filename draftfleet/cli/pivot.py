"""``draftfleet drain`` and ``draftfleet pivot``: move datasets between worker kinds, losing nothing."""

from __future__ import annotations

from rich.markup import escape
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from draftfleet.cli.common import add_common, config_or_store, dataset_names, err, out, redis_client
from draftfleet.cli.inventory import print_inventory, with_plans


def pivot_report(args, cfg, root, result, title: str, warnings: dict[str, str] | None = None) -> int:
    import msgspec

    from draftfleet.views.inventory import run_inventory

    inv = with_plans(args, cfg, lambda r: run_inventory(root, cfg, result.datasets, r=r))
    warnings = warnings or {}
    if args.json:
        print(msgspec.json.encode({"drain": result, "inventory": inv, "warnings": warnings}).decode())
        return 0 if result.drained else 1
    state = "done" if result.drained else f"[red]timed out with {result.still_running} still running[/]"
    out.print(f"{title}: {state} after {result.waited_s:.0f}s; assignment now "
              + ", ".join(f"{d}: {'+'.join(k) or 'nobody'}" for d, k in result.assignment.items()))
    print_inventory(inv)
    for text in warnings.values():
        err.print(f"[yellow]warning[/]: {escape(text)}", highlight=False)
    return 0 if result.drained else 1


def dry_run(args) -> int:
    """``pivot --dry-run``: the plan of each dataset and what the pivot would do; nothing changes."""
    import msgspec

    from draftfleet.assign import kinds_for
    from draftfleet.views.inventory import run_inventory
    from draftfleet.views.pivot import claims_by_kind, idle_target
    from draftfleet.views.plan import render_plans

    cfg, root = config_or_store(args)
    r = redis_client(args, cfg)
    names = dataset_names(args, cfg, root)
    other = "gpu" if args.to == "cloud" else "cloud"
    inv = with_plans(args, cfg, lambda rd: run_inventory(root, cfg, names, None, 0, r=rd))
    warnings = idle_target(r, args.to, names)
    now = {d: sorted(kinds_for(r, d)) for d in names}
    running = claims_by_kind(r, names).get(other, 0)
    if args.json:
        print(msgspec.json.encode({"dry_run": True, "to": args.to, "assignment": now, "would_drain": other,
                                   "running_on_drained_side": running, "plans": [i.plan for i in inv],
                                   "warnings": warnings}).decode())
        return 0
    out.print(f"dry run: pivot {', '.join(names)} to {args.to} would drain {other} ({running} running there now); "
              "assignment now " + ", ".join(f"{d}: {'+'.join(k) or 'nobody'}" for d, k in now.items()), highlight=False)
    out.print(render_plans([i.plan for i in inv]))
    for text in warnings.values():
        err.print(f"[yellow]warning[/]: {escape(text)}", highlight=False)
    return 0


def log_assignment(root, result, what: str) -> None:
    """Keep the new assignment in the store's log: the report marks pivots on its timelines."""
    import time

    from draftfleet.schemas.records import DatasetEvent
    from draftfleet.store import open_store

    store = open_store(root)
    for ds, kinds in result.assignment.items():
        store.log(DatasetEvent(at=time.time(), dataset=ds, kind="assign", assigned=kinds, note=what))


def _move(args, label: str, run, title: str, warnings: dict[str, str] | None = None) -> int:
    """Run a drain or pivot with a live "waiting for N in flight" line, then report."""
    from draftfleet.batches import open_batches

    cfg, root = config_or_store(args)
    r = redis_client(args, cfg)
    names = dataset_names(args, cfg, root)
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=err, disable=args.json) as progress:
        t = progress.add_task(label, total=None)
        tick = lambda running: progress.update(t, description=f"waiting for {running} in flight")  # noqa: E731
        batches = open_batches(r)  # before: the batch workers act on the drain while it runs
        result = run(r, names, tick)
    log_assignment(cfg or root, result, args.command)
    warnings = {**(warnings or {}), **batch_warnings(batches, result)}
    return pivot_report(args, cfg, root, result, title.format(datasets=", ".join(names)), warnings)


def batch_warnings(batches, result) -> dict[str, str]:
    """What becomes of the provider batches open when the drain began, of datasets the cloud no longer
    has: the batch worker cancels those it can (what completed is stored, the rest comes back to the
    queue) and waits for the others; either way their prompts are held by them meanwhile, never
    queued twice."""
    out = {}
    for b in batches:
        if b.dataset not in result.assignment or "cloud" in result.assignment[b.dataset]:
            continue
        left = b.prompts - b.completed - b.failed
        if b.cancellable:
            out[f"batch:{b.id}"] = (f"{b.dataset}: batch {b.provider_id or b.id} on {b.backend} ({left:,} of {b.prompts:,} "
                                    "prompts not answered yet) is cancelled by its batch worker: what completed is "
                                    "stored, the rest comes back to the queue for the new assignment")
        else:
            out[f"batch:{b.id}"] = (f"{b.dataset}: batch {b.provider_id or b.id} on {b.backend} cannot be cancelled "
                                    f"(its API has no cancel): its {left:,} prompts not answered yet stay with it, up to "
                                    f"its {b.window} window; `draftfleet status` shows it, and its answers are stored")
    return out


def cmd_drain(args) -> int:
    from draftfleet.views.pivot import drain

    return _move(args, "draining", lambda r, names, tick: drain(r, args.kind, names, args.timeout, tick),
                 f"drained {args.kind} from {{datasets}}")


def cmd_pivot(args) -> int:
    from draftfleet.views.pivot import idle_target, pivot

    if args.dry_run:
        return dry_run(args)

    def run(r, names, tick):
        result = pivot(r, args.to, names, args.timeout, tick)
        warnings.update(idle_target(r, args.to, names))  # after the wait: reports show the new assignment
        return result

    warnings: dict[str, str] = {}
    return _move(args, "pivoting", run, f"pivoted {{datasets}} to {args.to}", warnings)


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
    sp.add_argument("--dry-run", action="store_true",
                    help="change nothing: print each dataset's plan (time and money to finish on each side) and warnings")
    sp.set_defaults(func=cmd_pivot)
