"""``draftfleet``: the one console script; each subcommand is a thin layer over a module."""

# Each command's module (draftfleet.cli.<module>) holds its arguments beside its code: register(sub).

from __future__ import annotations

import argparse
import sys

from rich.markup import escape

from draftfleet.cli import (
    capture,
    data,
    devtools,
    enqueue,
    failures,
    inventory,
    pivot,
    plan,
    report,
    services,
    status,
    worker,
)
from draftfleet.cli.common import err
from draftfleet.schemas.config import ConfigError

DESCRIPTION = ("Generate EAGLE-3 draft-model training data (the target model's own answers, with exact token ids) "
               "on local GPUs (SGLang, vLLM) and OpenAI-compatible clouds, under a token budget per dataset. "
               "New here: `draftfleet demo`. Each command: `draftfleet COMMAND --help`.")

# The order `draftfleet --help` lists them in: the work, the services, the operator's views.
COMMANDS = (enqueue, worker, capture, devtools, services, failures, status, pivot, plan, inventory, report, data)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    p = argparse.ArgumentParser(prog="draftfleet", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"%(prog)s {version('draftfleet')}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return p


# Commands that run once and end: a private Redis they had to start is stopped on the way out.
ONE_SHOT = ("inventory", "plan", "report", "export", "import", "reconcile", "status", "failures", "drain", "pivot")



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = 1
    try:
        code = _run(args)
        return code
    finally:
        # A command that fails leaves nothing it started: not even a worker's private Redis.
        if args.command in ONE_SHOT or code != 0:
            from draftfleet.broker import release_embedded

            release_embedded()



def _local_only(args) -> str | None:
    """The flag that was given an ``s3://`` URL although only ``--store`` may name a bucket: any other
    path would otherwise become a local folder named ``s3:``."""
    for dest, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if dest != "store" and isinstance(v, str) and v.startswith("s3://"):
                return f"{'--' + dest.replace('_', '-') if dest != 'path' else 'the input file'} {v}"
    return None


def _run(args) -> int:
    bucket = _local_only(args)
    if bucket:
        err.print(f"[red]error[/]: {escape(bucket)}: a local path is needed here; only --store takes s3://",
                  highlight=False)
        return 2
    try:
        return args.func(args) or 0
    except ConfigError as exc:
        err.print(f"[red]config error[/]: {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error for operator mistakes; the rest keep a trace
        import redis

        from draftfleet.broker import BrokerError, unreachable
        from draftfleet.hidden import CaptureError
        from draftfleet.store import StoreError
        from draftfleet.tokenizer import TokenizerError

        if isinstance(exc, redis.RedisError):
            # redis-py names host and port, never the password
            err.print(f"[red]cannot reach Redis[/]: {escape(unreachable(exc))}", highlight=False)
            return 1
        if isinstance(exc, (BrokerError, CaptureError, StoreError, TokenizerError, OSError)):
            err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
        raise



if __name__ == "__main__":
    sys.exit(main())
