"""``draftfleet redis``, ``draftfleet s3`` and ``draftfleet flower``: the services beside the fleet (its
private Redis, a private bucket to try, Flower)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from draftfleet.cli.common import add_common, config, config_or_store, err, out


def cmd_redis(args) -> int:
    from draftfleet.broker import STATE_DIR, BrokerError, EmbeddedRedis, no_embedded, redact

    _cfg, root = config_or_store(args)
    if str(root).startswith("s3://"):
        raise BrokerError(no_embedded(root))
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


def cmd_s3(args) -> int:
    """A bucket to try without Docker, on the road of ``draftfleet redis``: one private SeaweedFS per
    folder, found again by its pid; only ``env`` prints the secret key, for ``eval``."""
    from rich.markup import escape

    from draftfleet.devtools.seaweedfs import IDENTITY_FILE, SeaweedFS, default_folder
    from draftfleet.store.bucket import parse_location

    bucket, _prefix = parse_location(args.store)
    folder = Path(args.dir).expanduser() if args.dir else default_folder()
    server = SeaweedFS.private(folder)
    if args.action == "stop":
        print("stopped" if server.stop() else "not running")
        return 0
    running = server.running()
    if args.action == "env":
        if not running:
            err.print(f"[red]not running[/]: draftfleet s3 start{escape(_dir_flag(args))}", highlight=False)
            return 1
        # the one place the secret key is printed: what `eval "$(draftfleet s3 env)"` is for
        env = server.env()
        print(json.dumps(env) if args.json else "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    if not running:
        server.start()
    made = server.make_bucket(bucket)
    if args.json:
        print(json.dumps({"endpoint": server.endpoint, "pid": server.pid, "folder": str(server.folder), "bucket": bucket,
                          "bucket_made": made, "started": not running, "identity": str(server.folder / IDENTITY_FILE)}))
        return 0
    out.print(f"SeaweedFS {'started' if not running else 'running'} at {server.endpoint} (pid {server.pid}), its data in "
              f"{escape(str(server.folder))}; bucket [bold]{bucket}[/] {'made' if made else 'is there'}; its keys in "
              f"{escape(str(server.folder / IDENTITY_FILE))} (0600)\nnext: eval \"$(draftfleet s3 env{escape(_dir_flag(args))})\", then "
              f"--store s3://{bucket}/PREFIX; draftfleet s3 stop{escape(_dir_flag(args))} when done", highlight=False)
    return 0


def _dir_flag(args) -> str:
    return f" --dir {shlex.quote(args.dir)}" if args.dir else ""


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

    sp = sub.add_parser("s3", help="a private SeaweedFS with a bucket, to try a store in a bucket: start, stop, env")
    sp.add_argument("action", choices=["start", "stop", "env"],
                    help="start it and make the bucket (prints where, never the secret), stop it, or print the "
                    "AWS_* lines that reach it (eval \"$(draftfleet s3 env)\")")
    sp.add_argument("--dir", help="its folder: data, identity (0600), pid (default ~/.local/share/draftfleet/s3)")
    sp.add_argument("--store", default="s3://draftfleet", metavar="s3://BUCKET[/PREFIX]",
                    help="start: the bucket to make (default s3://draftfleet)")
    sp.add_argument("--json", action="store_true", help="start, env: print the result as JSON")
    sp.set_defaults(func=cmd_s3)

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
