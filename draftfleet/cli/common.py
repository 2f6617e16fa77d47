"""What every command shares: the consoles, the config, the store, Redis and the common flags."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from draftfleet.schemas.config import ConfigError, FleetConfig, load_config

err = Console(stderr=True, soft_wrap=True)  # an error stays one line, also in a pipe
out = Console()


def add_common(sp, store=True) -> None:
    """The flags every command of a fleet takes: its config, its Redis and (mostly) its store."""
    sp.add_argument("--config", "-c", help="fleet.toml (default: $DRAFTFLEET_CONFIG or ./fleet.toml)")
    sp.add_argument("--redis-url", help="Redis URL (default: $REDIS_URL, [fleet].redis_url, else the store's embedded Redis)")
    if store:
        sp.add_argument("--store", help="store folder or s3://bucket/prefix (overrides [fleet].store)")


def config(args) -> FleetConfig:
    path = args.config or os.environ.get("DRAFTFLEET_CONFIG") or "fleet.toml"
    cfg = load_config(path)
    if getattr(args, "store", None):
        import msgspec

        where = args.store if args.store.startswith("s3://") else str(Path(args.store).resolve())
        cfg = msgspec.structs.replace(cfg, fleet=msgspec.structs.replace(cfg.fleet, store=where))
    return cfg

def sender(args, cfg):
    """What queues tasks: the Celery app and the Redis client of the fleet's broker, and its store."""
    from draftfleet.broker import connect, resolve_redis_url
    from draftfleet.store import open_store
    from draftfleet.workers.app import make_app

    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    return make_app(url, cfg.fleet.visibility_timeout_s), connect(url), open_store(cfg)

def add_version(sp) -> None:
    """``--version N`` / ``--all-versions``: which of a dataset's versions (``enqueue --new-version``)
    a reader of its records takes; by default the current one (``draftfleet/versions.py``)."""
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--version", type=int, help="the records of this dataset version (default the current one)")
    group.add_argument("--all-versions", action="store_true",
                       help="the records of every version (files then mix the versions' settings)")


def each_dataset(names: list[str], errors: type[Exception] | tuple[type[Exception], ...], run) -> tuple[list, int]:
    """``run(name)`` of each dataset: the results, and exit status 1 if one of them raised
    ``errors`` (printed in one line; the other datasets go on)."""
    results, status = [], 0
    for name in names:
        try:
            results.append(run(name))
        except errors as exc:
            err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            status = 1
    return results, status

def redis_client(args, cfg):
    """The fleet's Redis; with no config (``--store`` alone), the flag, REDIS_URL or the store's own."""
    from draftfleet.broker import connect, resolve_redis_url

    configured, store = (cfg.fleet.redis_url, cfg.fleet.store) if cfg else (None, args.store)
    return connect(resolve_redis_url(args.redis_url, configured, store))

def config_or_store(args):
    """(config, store root): ``--store DIR`` alone works without any config (manifests fill in)."""
    if args.store and not args.config and not os.environ.get("DRAFTFLEET_CONFIG"):
        return None, args.store
    cfg = config(args)
    return cfg, cfg.fleet.store

def dataset_names(args, cfg, root=None) -> list[str]:
    """The datasets named (each checked), else all: the config's, or the store's with ``--store`` alone."""
    if cfg is None:
        from draftfleet.store import open_store

        known = open_store(root).datasets()
        unknown = [n for n in args.dataset or [] if n not in known]
        if unknown:
            raise ConfigError(f"unknown dataset(s) {', '.join(unknown)}: {root} has {', '.join(known) or 'none'}")
        return args.dataset or known
    names = args.dataset or [d.name for d in cfg.datasets]
    for n in names:
        cfg.dataset(n)
    return names

def optional_tokenizer(args, cfg):
    from draftfleet.tokenizer import TargetTokenizer

    path = getattr(args, "tokenizer", None) or (cfg.fleet.tokenizer if cfg else None)
    if not path:
        return None
    if cfg is not None and path == cfg.fleet.tokenizer:
        return TargetTokenizer.from_config(cfg.fleet)
    return TargetTokenizer(path)

