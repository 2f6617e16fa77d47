"""``draftfleet enqueue``: queue every prompt of a dataset that has no result yet (the resume)."""

from __future__ import annotations

from rich import box
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
    table = summary_table(summaries)
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


# Two-line headers of at most 6 characters: with counts of up to 6 digits the table fits 80 columns.
_COLUMNS = (("read", "read"), ("queued\nnow", "queued"), ("stored\nbefore", "already_done"),
            ("queued\nbefore", "already_queued"), ("in\nflight", "in_flight"), ("failed\nbefore", "failed_before"),
            ("dupli-\ncates", "duplicate_in_input"), ("re-\njected", "rejected"))


def summary_table(summaries) -> Table:
    """The summary, one row per dataset, that fits 80 columns (and any wider) without cutting a header."""
    table = Table(title="enqueue", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
                  collapse_padding=True)
    table.add_column("dataset\n(version)", overflow="fold", min_width=8)
    for header, _ in _COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for s in summaries:
        table.add_row(f"{escape(s.dataset)} v{s.version}", *(_count(getattr(s, field)) for _, field in _COLUMNS))
    return table


def _count(n: int) -> str:
    """Exact up to six digits, then three significant ones (``--json`` has them exact)."""
    return str(n) if n < 1_000_000 else f"{n / 1e6:.3g}M"


def register(sub) -> None:
    sp = sub.add_parser("enqueue", help="queue every prompt that has no result yet (resume is the default)")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable)")
    sp.add_argument("--new-version", action="store_true", help="start a new version of a dataset whose settings changed")
    sp.add_argument("--retry-failed", action="store_true", help="re-send prompts that failed before")
    sp.add_argument("--show-rejects", type=int, default=20, help="print at most this many rejected lines")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_enqueue)
