"""``draftfleet plan``: per dataset, what is left and the time and money to finish on each side."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from draftfleet.cli.common import add_common, config_or_store, err, out, redis_client


def fleet_redis(args, cfg, *, start: bool = False):
    """The fleet's Redis for the plan's live figures (rates, workers, assignment), or None: the
    plan then comes from the store alone. Without ``start``, only a Redis that is given or already
    running is used (an inventory never starts the store's own); one that cannot be reached is a
    one-line warning, not an error."""
    import os

    import redis

    from draftfleet.broker import STATE_DIR, BrokerError, EmbeddedRedis, connect, resolve_redis_url
    from draftfleet.store import StoreError

    try:
        if start:
            r = redis_client(args, cfg)
        else:
            configured = cfg.fleet.redis_url if cfg else None
            if getattr(args, "redis_url", None) or os.environ.get("REDIS_URL") or configured:
                url = resolve_redis_url(args.redis_url, configured, None)
            else:
                url = EmbeddedRedis(Path(cfg.fleet.store if cfg else args.store) / STATE_DIR).running_url()
            if url is None:
                return None
            r = connect(url)
        r.ping()
        return r
    except (redis.RedisError, BrokerError, StoreError, OSError) as exc:
        err.print(f"[yellow]no Redis[/] ({escape(str(exc))}): the plan comes from the store alone, without live workers",
                  highlight=False)
        return None


def plans(cfg, invs, r) -> list:
    from draftfleet.views.inventory import plan_from_inventory

    return [plan_from_inventory(cfg, inv, r) for inv in invs]


def cmd_plan(args) -> int:
    import msgspec

    from draftfleet.views.inventory import run_inventory
    from draftfleet.views.plan import render_plans

    cfg, root = config_or_store(args)
    r = fleet_redis(args, cfg, start=True)
    result = plans(cfg, run_inventory(root, cfg, args.dataset, None, 0, r=r), r)
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        out.print(render_plans(result))
    return 0


def register(sub) -> None:
    sp = sub.add_parser("plan", help="what is left of each dataset; the time and money to finish on each side")
    add_common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the plans as JSON")
    sp.set_defaults(func=cmd_plan)
