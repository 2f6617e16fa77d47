"""``draftfleet redis`` and ``draftfleet flower``: the services beside the fleet (its private Redis, Flower)."""

from __future__ import annotations

from pathlib import Path

from draftfleet.cli.common import add_common, config, config_or_store


def cmd_redis(args) -> int:
    from draftfleet.broker import STATE_DIR, EmbeddedRedis, redact

    _cfg, root = config_or_store(args)
    emb = EmbeddedRedis(Path(root) / STATE_DIR)
    if args.action == "start":
        print(redact(emb.ensure()))
    elif args.action == "stop":
        print("stopped" if emb.stop() else "not running")
    else:
        url = emb.running_url()
        if url is None:
            print("not running")
            return 1
        # `url` prints the full URL (with its password) only when asked for it explicitly.
        print(url if args.show_password else redact(url))
    return 0


def cmd_flower(args) -> int:
    from draftfleet.broker import resolve_redis_url
    from draftfleet.views.monitor import basic_auth_from_env, run_flower

    auth = None if args.no_auth else basic_auth_from_env(args.basic_auth_env)
    cfg = config(args)
    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    run_flower(cfg, url, basic_auth=auth, address=args.address, port=args.port, allow_control=args.allow_control)
    return 0


def register(sub) -> None:
    sp = sub.add_parser("redis", help="the store's embedded private Redis: start, stop, url")
    sp.add_argument("action", choices=["start", "stop", "url"],
                    help="start it (prints the URL, password hidden), stop it, or print its URL")
    add_common(sp)
    sp.add_argument("--show-password", action="store_true", help="url: print the password too")
    sp.set_defaults(func=cmd_redis)

    sp = sub.add_parser("flower", help="Flower on the fleet's broker: basic auth required, Prometheus /metrics")
    add_common(sp)
    sp.add_argument("--address", default="127.0.0.1", help="address to bind (default loopback; /metrics is never authenticated)")
    sp.add_argument("--port", type=int, default=5555, help="port to serve on (default 5555)")
    sp.add_argument("--basic-auth-env", default="FLOWER_BASIC_AUTH", metavar="NAME",
                    help="environment variable holding user:password, several separated by commas (default FLOWER_BASIC_AUTH)")
    sp.add_argument("--no-auth", action="store_true", help="run without authentication: anyone who reaches the port sees the fleet")
    sp.add_argument("--allow-control", action="store_true",
                    help="enable Flower's control API (shutdown, consumers, revoke, send task); off by default")
    sp.set_defaults(func=cmd_flower)
