"""``draftfleet capture``: queue hidden-state capture of every stored record turn without one."""

from __future__ import annotations

from rich.markup import escape

from draftfleet.cli.common import add_common, add_version, config, each_dataset, out, sender


def cmd_capture(args) -> int:
    import msgspec

    from draftfleet.hidden import CaptureError
    from draftfleet.producer.capture import queue_capture
    from draftfleet.versions import VersionError, select

    cfg = config(args)
    app, r, store = sender(args, cfg)
    summaries, status = each_dataset(
        args.dataset or [d.name for d in cfg.datasets], (CaptureError, VersionError),
        lambda name: queue_capture(cfg, store, app, r, name, new_version=args.new_version, ignore_space=args.ignore_space,
                                   records=select(store, name, args.version, args.all_versions)))
    if args.json:
        print(msgspec.json.encode(summaries).decode())
        return status
    for c in summaries:
        of = f"version {c.dataset_version}" if c.dataset_version is not None else "every version"
        held = f"{c.units:,} units ({c.turns:,} record turns)" if c.units != c.turns else f"{c.units:,} record turns"
        out.print(f"{c.dataset} ({of}) capture v{c.version} (layers {c.layer_ids}, {c.dtype}): {held}, {c.done:,} "
                  f"captured, {c.queued:,} queued ({c.already_queued:,} already queued, {c.running:,} being captured); "
                  f"{c.tokens_to_capture:,} "
                  f"tokens, about {c.bytes_estimate / 1e9:,.2f} GB ({c.bytes_per_token:,.0f} B/token)"
                  + (f" of {c.free_bytes / 1e9:,.1f} GB free" if c.free_bytes is not None else " (to a bucket)"),
                  highlight=False)
        if c.budget_tokens_left:
            out.print(f"  with the {c.budget_tokens_left:,} answer tokens its budget has left: about "
                      f"{c.projected_bytes / 1e9:,.2f} GB" + (" [yellow]more than the free space[/]"
                                                              if c.free_bytes is not None
                                                              and c.projected_bytes > c.free_bytes else ""))
        if c.conversations_once or c.conversations_per_turn:
            out.print(f"  conversations: {c.conversations_once:,} captured once (their turns' ids prefix each other), "
                      f"{c.conversations_per_turn:,} per turn" + (f"; first: {escape(c.per_turn_reason)}"
                                                                   if c.per_turn_reason else ""), highlight=False)
        for note in c.notes:
            out.print(f"  [yellow]note[/] {escape(note)}", highlight=False)
    return status


def register(sub) -> None:
    sp = sub.add_parser("capture", help="queue hidden-state capture of every stored record turn without one (resume)")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--new-version", action="store_true",
                    help="start a new capture version when the model, layers or dtype differ from the stored capture's")
    add_version(sp)
    sp.add_argument("--ignore-space", action="store_true",
                    help="queue even when the estimated size exceeds the store's free space")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_capture)
