"""``draftfleet status``: workers, queues, tokens against budget, spend, ETA."""

from __future__ import annotations

from draftfleet.cli.common import add_common, config, out, redis_client


def cmd_status(args) -> int:
    import time

    import msgspec
    from rich.live import Live

    from draftfleet.claims import worker_reports
    from draftfleet.views.status import render, snapshot

    cfg = config(args)
    names = args.dataset or None  # checked by snapshot: datasets enqueued since the config changed count too
    r = redis_client(args, cfg)
    if args.json:
        print(msgspec.json.encode(snapshot(cfg, r, names)).decode())
        return 0
    if not args.watch:
        snap = snapshot(cfg, r, names)
        out.print(render(snap))
        line = private_redis_line(cfg.fleet.store, worker_reports(r))
        if line:
            out.print(line, highlight=False)
        return 0
    with Live(render(snapshot(cfg, r, names)), console=out, refresh_per_second=1) as live:
        while True:
            time.sleep(args.interval)
            live.update(render(snapshot(cfg, r, names)))


def private_redis_line(store: str, workers) -> str | None:
    """Who keeps the store's private Redis up (it outlives them until ``draftfleet redis stop``)."""
    from pathlib import Path

    from draftfleet.broker import STATE_DIR, embedded_users, started_here

    users = embedded_users(store)
    if users is None:
        return None
    server, pids = users
    where = f"private Redis (pid {server}, {Path(store) / STATE_DIR})"
    if started_here(store) and not pids:
        return f"{where}: started for this command, stopped again as it exits"
    by_pid = {w.pid: f"worker {w.hostname}" for w in workers if w.pid}
    who = [f"{by_pid.get(p) or _command(p)} (pid {p})" for p in pids]
    if not who:
        return f"{where}: no draftfleet process uses it; it stays up until `draftfleet redis stop`"
    return f"{where}: kept up by {', '.join(who)}; it stays up after they stop, until `draftfleet redis stop`"


def _command(pid: int) -> str:
    """What a local process runs (``draftfleet worker gpu ...``), from /proc where there is one."""
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return "a draftfleet process"
    words = [w.decode(errors="replace") for w in argv if w]
    if "draftfleet" in words:
        words = words[words.index("draftfleet"):]
    elif any(w.endswith("/draftfleet") for w in words):
        words = ["draftfleet", *words[[w.endswith("/draftfleet") for w in words].index(True) + 1:]]
    shown = []
    for w in words[:3]:
        if w.startswith("-"):
            break
        shown.append(w)
    return " ".join(shown) or "a draftfleet process"


def register(sub) -> None:
    sp = sub.add_parser("status", help="workers, queues, tokens against budget, spend, ETA")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--watch", action="store_true", help="refresh until interrupted")
    sp.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    sp.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    sp.set_defaults(func=cmd_status)
