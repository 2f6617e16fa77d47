"""``draftfleet``: the one console script; each subcommand is a thin layer over a module."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .schemas.config import ConfigError, FleetConfig, load_config

err = Console(stderr=True)
out = Console()


def _config(args) -> FleetConfig:
    path = args.config or os.environ.get("DRAFTFLEET_CONFIG") or "fleet.toml"
    cfg = load_config(path)
    if getattr(args, "store", None):
        import msgspec

        cfg = msgspec.structs.replace(cfg, fleet=msgspec.structs.replace(cfg.fleet, store=str(Path(args.store).resolve())))
    return cfg


def _gpu_list(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--gpu {spec!r}: expected GPU indices like 0 or 0,1") from None


# -- enqueue -----------------------------------------------------------------------------------
def cmd_enqueue(args) -> int:
    from .broker import connect, resolve_redis_url
    from .producer.enqueue import EnqueueError, enqueue_dataset
    from .producer.readers import count_rows
    from .store import Store
    from .workers.app import make_app

    cfg = _config(args)
    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    app = make_app(url, cfg.fleet.visibility_timeout_s)
    r = connect(url)
    store = Store(cfg.fleet.store)
    names = args.dataset or [d.name for d in cfg.datasets]
    summaries = []
    shown = 0

    def on_reject(rej) -> None:
        nonlocal shown
        if not args.json and shown < args.show_rejects:
            err.print(f"[yellow]rejected[/] {rej.entry.message}", markup=True, highlight=False)
        shown += 1

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, disable=args.json)
    status = 0
    with progress:
        for name in names:
            ds = cfg.dataset(name)
            bar = progress.add_task(f"enqueue {name}", total=count_rows(ds))
            try:
                summaries.append(enqueue_dataset(cfg, ds, app, r, store, new_version=args.new_version,
                                                 retry_failed=args.retry_failed,
                                                 on_row=lambda b=bar: progress.advance(b), on_reject=on_reject))
            except EnqueueError as exc:
                err.print(f"[red]error[/]: {exc}", highlight=False)
                status = 1
    import msgspec

    if args.json:
        print(msgspec.json.encode(summaries).decode())
        return status
    table = Table(title="enqueue")
    for col in ("dataset", "version", "read", "queued", "already done", "already queued", "failed before",
                "duplicates", "rejected"):
        table.add_column(col, justify="right" if col not in ("dataset",) else "left")
    for s in summaries:
        table.add_row(s.dataset, str(s.version), str(s.read), str(s.queued), str(s.already_done),
                      str(s.already_queued), str(s.failed_before), str(s.duplicate_in_input), str(s.rejected))
    out.print(table)
    for s in summaries:
        if s.rejected:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(s.rejected_by_kind.items()))
            out.print(f"{s.dataset}: {s.rejected} rejected ({kinds}); raw lines kept in {s.quarantine_file}", highlight=False)
        if s.failed_before:
            out.print(f"{s.dataset}: {s.failed_before} prompts failed before and were not re-sent (--retry-failed)")
    return status


# -- worker ------------------------------------------------------------------------------------
def cmd_worker(args) -> int:
    from .workers.worker import run_worker

    cfg = _config(args)
    run_worker(
        cfg, args.kind, backend_name=args.backend, url=args.url, gpus=_gpu_list(args.gpu),
        slots=args.inflight or args.concurrency, datasets=args.dataset, redis_url=args.redis_url,
        name=args.name, loglevel=args.loglevel,
    )
    return 0


# -- emulator ----------------------------------------------------------------------------------
def emulator_config(args):
    from .emulator import EmulatorConfig

    fields = {f: getattr(args, f) for f in EMULATOR_FLAGS if getattr(args, f, None) is not None}
    if args.api_key_env:
        fields["api_key"] = os.environ.get(args.api_key_env) or None
    return EmulatorConfig(tokenizer=args.tokenizer, **fields)


EMULATOR_FLAGS = ("model", "seed", "length", "reasoning_length", "single_stream_tps", "ceiling_tps", "max_running", "time_scale",
                  "rate_429", "rate_500", "rate_503", "rate_hang", "rate_cut", "rate_402", "rate_200_error",
                  "rate_abort", "retry_after_s", "hang_s", "price_input_per_mtok", "price_output_per_mtok",
                  "ttft_s", "reasoning_rate")


def cmd_emulator(args) -> int:
    from .emulator import serve

    serve(emulator_config(args), args.host, args.port)
    return 0


# -- demo --------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(store=args.store, timeout_s=args.timeout, as_json=args.json)


# -- redis -------------------------------------------------------------------------------------
def cmd_redis(args) -> int:
    from .broker import EmbeddedRedis, redact

    cfg = _config(args)
    emb = EmbeddedRedis(Path(cfg.fleet.store) / "_redis")
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


# -- requeue failures --------------------------------------------------------------------------
def cmd_failures(args) -> int:
    from .store import Store

    cfg = _config(args)
    store = Store(cfg.fleet.store)
    rows = []
    for name in args.dataset or [d.name for d in cfg.datasets]:
        for f in store.failures(name):
            rows.append({"dataset": f.dataset, "key": f.key, "source": f.source, "kind": f.error_kind,
                         "attempts": f.attempts, "reason": f.reason})
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=f"failures ({len(rows)}); re-send with: draftfleet enqueue --retry-failed")
    for col in ("dataset", "source", "kind", "attempts", "reason"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["dataset"], row["source"], row["kind"], str(row["attempts"]), row["reason"][:80])
    out.print(table)
    return 0


# -- flower ------------------------------------------------------------------------------------
def cmd_flower(args) -> int:
    from .broker import resolve_redis_url
    from .monitor import basic_auth_from_env, run_flower

    auth = None if args.no_auth else basic_auth_from_env(args.basic_auth_env)
    cfg = _config(args)
    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    run_flower(cfg, url, basic_auth=auth, address=args.address, port=args.port, allow_control=args.allow_control)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, store=True):
        sp.add_argument("--config", "-c", help="fleet.toml (default: $DRAFTFLEET_CONFIG or ./fleet.toml)")
        sp.add_argument("--redis-url", help="Redis URL (default: $REDIS_URL, [fleet].redis_url, else the store's embedded Redis)")
        if store:
            sp.add_argument("--store", help="store folder (overrides [fleet].store)")

    sp = sub.add_parser("enqueue", help="queue every prompt that has no result yet (resume is the default)")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable)")
    sp.add_argument("--new-version", action="store_true", help="start a new version of a dataset whose settings changed")
    sp.add_argument("--retry-failed", action="store_true", help="re-send prompts that failed before")
    sp.add_argument("--show-rejects", type=int, default=20, help="print at most this many rejected lines")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_enqueue)

    sp = sub.add_parser("worker", help="run a worker: gpu (one per SGLang server) or cloud")
    sp.add_argument("kind", choices=["gpu", "cloud"])
    common(sp)
    sp.add_argument("--url", help="gpu: URL of a running SGLang server")
    sp.add_argument("--gpu", help="gpu: launch SGLang on these GPUs (e.g. 0, or 0,1 for a TP group)")
    sp.add_argument("--inflight", type=int, help="gpu: requests kept in flight (default [backends.sglang].inflight)")
    sp.add_argument("--backend", help="cloud: the [backends.NAME] table to use")
    sp.add_argument("--concurrency", type=int, help="cloud: requests in flight (default the backend's concurrency)")
    sp.add_argument("--dataset", "-d", action="append", help="consume only this dataset's queue (repeatable)")
    sp.add_argument("--name", help="worker name (default from kind and GPU/backend)")
    sp.add_argument("--loglevel", default="INFO")
    sp.set_defaults(func=cmd_worker)

    sp = sub.add_parser("emulator", help="serve SGLang /generate and OpenAI chat completions on loopback (tests, demo)")
    sp.add_argument("--tokenizer", required=True, help="tokenizer folder (the emulator's ids come from it)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=30000)
    sp.add_argument("--api-key-env", help="require this environment variable's value as the bearer key")
    sp.add_argument("--model")
    sp.add_argument("--seed", type=int)
    sp.add_argument("--length", help="completion length distribution: lognormal:MEAN:SIGMA, uniform:LO:HI, fixed:N")
    sp.add_argument("--reasoning-length", help="reasoning length distribution (with --reasoning-rate)")
    for flag in EMULATOR_FLAGS[4:]:
        sp.add_argument("--" + flag.replace("_", "-"), type=float if flag != "max_running" else int, dest=flag)
    sp.set_defaults(func=cmd_emulator)

    sp = sub.add_parser("demo", help="run the whole fleet on the emulator and the sample data (no GPU, no network)")
    sp.add_argument("--store", help="keep the demo's store (and config) in this folder")
    sp.add_argument("--timeout", type=float, default=110.0)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("redis", help="the store's embedded private Redis: start, stop, url")
    sp.add_argument("action", choices=["start", "stop", "url"])
    common(sp)
    sp.add_argument("--show-password", action="store_true", help="url: print the password too")
    sp.set_defaults(func=cmd_redis)

    sp = sub.add_parser("failures", help="list prompts whose retries ran out")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_failures)

    sp = sub.add_parser("flower", help="Flower on the fleet's broker: basic auth required, Prometheus /metrics")
    common(sp)
    sp.add_argument("--address", default="127.0.0.1", help="address to bind (default loopback; /metrics is never authenticated)")
    sp.add_argument("--port", type=int, default=5555)
    sp.add_argument("--basic-auth-env", default="FLOWER_BASIC_AUTH", metavar="NAME",
                    help="environment variable holding user:password, several separated by commas (default FLOWER_BASIC_AUTH)")
    sp.add_argument("--no-auth", action="store_true", help="run without authentication: anyone who reaches the port sees the fleet")
    sp.add_argument("--allow-control", action="store_true",
                    help="enable Flower's control API (shutdown, consumers, revoke, send task); off by default")
    sp.set_defaults(func=cmd_flower)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ConfigError as exc:
        err.print(f"[red]config error[/]: {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error for operator mistakes; the rest keep a trace
        from .broker import BrokerError
        from .tokenizer import TokenizerError

        if isinstance(exc, (BrokerError, TokenizerError, OSError)):
            err.print(f"[red]error[/]: {exc}", highlight=False)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
