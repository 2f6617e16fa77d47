"""``draftfleet status``: workers, queues, tokens against budget, spend, ETA."""

from __future__ import annotations

from draftfleet.cli.common import add_common, config, out, redis_client


def cmd_status(args) -> int:
    import time

    import msgspec
    from rich.live import Live

    from draftfleet.views.status import render, snapshot

    cfg = config(args)
    names = args.dataset or None  # checked by snapshot: datasets enqueued since the config changed count too
    r = redis_client(args, cfg)
    if args.json:
        print(msgspec.json.encode(snapshot(cfg, r, names)).decode())
        return 0
    if not args.watch:
        out.print(render(snapshot(cfg, r, names)))
        return 0
    with Live(render(snapshot(cfg, r, names)), console=out, refresh_per_second=1) as live:
        while True:
            time.sleep(args.interval)
            live.update(render(snapshot(cfg, r, names)))


def register(sub) -> None:
    sp = sub.add_parser("status", help="workers, queues, tokens against budget, spend, ETA")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--watch", action="store_true", help="refresh until interrupted")
    sp.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    sp.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    sp.set_defaults(func=cmd_status)
