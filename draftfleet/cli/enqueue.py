"""``draftfleet enqueue``: queue every prompt of a dataset that has no result yet (the resume)."""

from __future__ import annotations

from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from draftfleet.cli.common import add_common, config, each_dataset, err, out, sender


def cmd_enqueue(args) -> int:
    from draftfleet.producer.enqueue import EnqueueError, enqueue_dataset
    from draftfleet.producer.readers import count_rows

    cfg = config(args)
    app, r, store = sender(args, cfg)
    shown = 0

    def on_reject(rej) -> None:
        nonlocal shown
        if not args.json and shown < args.show_rejects:
            err.print(f"[yellow]rejected[/] {escape(rej.entry.message)}", highlight=False)
        shown += 1

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, disable=args.json)

    def enqueue(name: str):
        ds = cfg.dataset(name)
        bar = progress.add_task(f"enqueue {name}", total=count_rows(ds))
        return enqueue_dataset(cfg, ds, app, r, store, new_version=args.new_version, retry_failed=args.retry_failed,
                               on_row=lambda: progress.advance(bar), on_reject=on_reject)

    with progress:
        summaries, status = each_dataset(args.dataset or [d.name for d in cfg.datasets], EnqueueError, enqueue)
    import msgspec

    for s in summaries:  # a dataset that gave no usable row is an error, its likely cause named
        if s.error:
            err.print(f"[red]error[/]: {escape(s.error)}", highlight=False)
            status = 1
    if args.json:
        print(msgspec.json.encode(summaries).decode())
        return status
    table = Table(title="enqueue")
    for col in ("dataset", "version", "read", "queued", "already done", "already queued", "in flight",
                "failed before", "duplicates", "rejected"):
        table.add_column(col, justify="right" if col not in ("dataset",) else "left")
    for s in summaries:
        table.add_row(s.dataset, str(s.version), str(s.read), str(s.queued), str(s.already_done),
                      str(s.already_queued), str(s.in_flight), str(s.failed_before), str(s.duplicate_in_input),
                      str(s.rejected))
    out.print(table)
    for s in summaries:
        if s.rejected:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(s.rejected_by_kind.items()))
            out.print(f"{s.dataset}: {s.rejected} rejected ({kinds}); raw lines kept in {s.quarantine_file}", highlight=False)
        if s.failed_before:
            out.print(f"{s.dataset}: {s.failed_before} prompts failed before and were not re-sent (--retry-failed)")
        if s.closed:
            out.print(f"{s.dataset}: its token budget is reached (closed); raise budget_tokens to queue more")
    return status


def register(sub) -> None:
    sp = sub.add_parser("enqueue", help="queue every prompt that has no result yet (resume is the default)")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable)")
    sp.add_argument("--new-version", action="store_true", help="start a new version of a dataset whose settings changed")
    sp.add_argument("--retry-failed", action="store_true", help="re-send prompts that failed before")
    sp.add_argument("--show-rejects", type=int, default=20, help="print at most this many rejected lines")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_enqueue)
