"""``draftfleet``: the one console script; each subcommand is a thin layer over a module."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from draftfleet.schemas.config import ConfigError, FleetConfig, load_config

err = Console(stderr=True, soft_wrap=True)  # an error stays one line, also in a pipe
out = Console()


def _config(args) -> FleetConfig:
    path = args.config or os.environ.get("DRAFTFLEET_CONFIG") or "fleet.toml"
    cfg = load_config(path)
    if getattr(args, "store", None):
        import msgspec

        cfg = msgspec.structs.replace(cfg, fleet=msgspec.structs.replace(cfg.fleet, store=str(Path(args.store).resolve())))
    return cfg


def _worker_flags(args) -> list[str]:
    """The flags of this worker command that each per-GPU child repeats (all but --gpu/--config)."""
    flags = []
    for name in ("engine", "redis_url", "store", "inflight", "loglevel"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    for ds in args.dataset or []:
        flags += ["--dataset", ds]
    return flags


def _sender(args, cfg):
    """What queues tasks: the Celery app and the Redis client of the fleet's broker, and its store."""
    from draftfleet.broker import connect, resolve_redis_url
    from draftfleet.store import Store
    from draftfleet.workers.app import make_app

    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    return make_app(url, cfg.fleet.visibility_timeout_s), connect(url), Store(cfg.fleet.store)


def _each_dataset(names: list[str], errors: type[Exception], run) -> tuple[list, int]:
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


# -- enqueue -----------------------------------------------------------------------------------
def cmd_enqueue(args) -> int:
    from draftfleet.producer.enqueue import EnqueueError, enqueue_dataset
    from draftfleet.producer.readers import count_rows

    cfg = _config(args)
    app, r, store = _sender(args, cfg)
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
        summaries, status = _each_dataset(args.dataset or [d.name for d in cfg.datasets], EnqueueError, enqueue)
    import msgspec

    if args.json:
        print(msgspec.json.encode(summaries).decode())
        return status
    table = Table(title="enqueue")
    for col in ("dataset", "version", "read", "queued", "already done", "already queued", "in flight",
                "failed before", "duplicates", "rejected"):
        table.add_column(col, justify="right" if col not in ("dataset",) else "left")
    for s in summaries:
        table.add_row(s.dataset, str(s.version), str(s.read), str(s.queued), str(s.already_done),
                      str(s.already_queued), str(s.in_flight), str(s.failed_before), str(s.duplicate_in_input),
                      str(s.rejected))
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


# -- capture -----------------------------------------------------------------------------------
def cmd_capture(args) -> int:
    import msgspec

    from draftfleet.hidden import CaptureError
    from draftfleet.producer.capture import queue_capture

    cfg = _config(args)
    app, r, store = _sender(args, cfg)
    summaries, status = _each_dataset(
        args.dataset or [d.name for d in cfg.datasets], CaptureError,
        lambda name: queue_capture(cfg, store, app, r, name, new_version=args.new_version, ignore_space=args.ignore_space))
    if args.json:
        print(msgspec.json.encode(summaries).decode())
        return status
    for c in summaries:
        out.print(f"{c.dataset} capture v{c.version} (layers {c.layer_ids}): {c.units:,} record turns, {c.done:,} "
                  f"captured, {c.queued:,} queued ({c.already_queued:,} already queued); {c.tokens_to_capture:,} "
                  f"tokens, about {c.bytes_estimate / 1e9:,.2f} GB of {c.free_bytes / 1e9:,.1f} GB free", highlight=False)
    return status


# -- worker ------------------------------------------------------------------------------------
def cmd_worker(args) -> int:
    from draftfleet.workers.worker import run_worker

    cfg = _config(args)
    if args.kind == "capture":
        from draftfleet.workers.capture import run_capture_worker

        gpus = None
        if args.gpu is not None:
            from draftfleet.workers.launcher import gpu_groups

            tp = cfg.vllm.launch.tp if cfg.vllm and cfg.vllm.launch else 1
            try:
                groups = gpu_groups(args.gpu, tp)
            except ValueError as exc:
                raise ConfigError(f"--gpu: {exc}") from None
            if len(groups) > 1:
                raise ConfigError(f"--gpu {args.gpu}: {len(groups)} groups of {tp} GPU(s); a capture worker runs one "
                                  "vLLM server: start one worker per group")
            gpus = groups[0]
        run_capture_worker(cfg, url=args.url, gpus=gpus, slots=args.inflight, datasets=args.dataset,
                           redis_url=args.redis_url, name=args.name, loglevel=args.loglevel)
        return 0
    if args.kind == "reconciler":
        from draftfleet.workers.reconciler import run_reconciler

        run_reconciler(cfg, redis_url=args.redis_url, interval_s=args.interval, metrics_port=args.metrics_port,
                       metrics_address=args.metrics_address, loglevel=args.loglevel)
        return 0
    gpus = None
    if args.kind == "gpu" and args.gpu is not None:
        from draftfleet.workers.launcher import gpu_groups

        engine, settings = cfg.engine(args.engine)
        if settings.launch is None:
            raise ConfigError(f"{cfg.path}: --gpu needs [backends.{engine}.launch] (model_path, tp, port_base)")
        try:
            groups = gpu_groups(args.gpu, settings.launch.tp)
        except ValueError as exc:
            raise ConfigError(f"--gpu: {exc}") from None
        if len(groups) > 1:
            from draftfleet.workers.worker import run_gpu_workers

            return run_gpu_workers(cfg.path, groups, _worker_flags(args))
        gpus = groups[0]
    run_worker(
        cfg, args.kind, backend_name=args.backend, engine=args.engine, url=args.url, gpus=gpus,
        slots=args.inflight or args.concurrency, datasets=args.dataset, redis_url=args.redis_url,
        name=args.name, loglevel=args.loglevel,
    )
    return 0


# -- emulator ----------------------------------------------------------------------------------
def emulator_config(args):
    from draftfleet.emulator import EmulatorConfig

    fields = {f: getattr(args, f) for f in EMULATOR_FLAGS if getattr(args, f, None) is not None}
    if args.api_key_env:
        fields["api_key"] = os.environ.get(args.api_key_env) or None
    if args.sglang_api_key_env:
        fields["sglang_api_key"] = os.environ.get(args.sglang_api_key_env) or None
    for flag in ("proxy", "loading"):
        if getattr(args, flag):
            fields[flag] = True
    return EmulatorConfig(tokenizer=args.tokenizer, **fields)


EMULATOR_FLAGS = ("model", "seed", "length", "reasoning_length", "single_stream_tps", "ceiling_tps", "max_running", "time_scale",
                  "rate_429", "rate_500", "rate_503", "rate_hang", "rate_cut", "rate_402", "rate_200_error",
                  "rate_abort", "retry_after_s", "hang_s", "price_input_per_mtok", "price_output_per_mtok",
                  "ttft_s", "reasoning_rate", "rate_402_inflight", "rate_403", "rate_moderation", "split_rate", "health_s",
                  "context_length", "max_output_tokens", "eos_token")
_EMULATOR_INTS = ("max_running", "context_length", "max_output_tokens")
_EMULATOR_HELP = {
    "single_stream_tps": "tokens/s of one request alone", "ceiling_tps": "tokens/s of the whole batch at most",
    "max_running": "requests decoded at once (more wait)", "time_scale": "wall seconds per model second (0: instant)",
    "retry_after_s": "Retry-After sent with faults (seconds)", "hang_s": "how long a hung request is held (seconds)",
    "price_input_per_mtok": "cloud price per million input tokens (USD)",
    "price_output_per_mtok": "cloud price per million output tokens (USD)", "ttft_s": "prefill delay, at most (seconds)",
    "reasoning_rate": "share of chat answers with reasoning (0-1)",
    "split_rate": "share of answers with ids that do not survive decode->encode (0-1)",
    "health_s": "how long a /health probe takes (seconds)", "context_length": "input + output tokens allowed",
    "max_output_tokens": "the cloud model's max_tokens limit", "eos_token": "the model's EOS token (default end-of-turn)",
}


def _emulator_help(flag: str) -> str:
    """Help for an emulator flag: a fault rate names its fault, the rest come from ``_EMULATOR_HELP``."""
    if flag.startswith("rate_"):
        return f"share of requests answered with the {flag[5:].replace('_', ' ')} fault (0-1)"
    return _EMULATOR_HELP[flag]


def cmd_emulator(args) -> int:
    from draftfleet.emulator import serve

    serve(emulator_config(args), args.host, args.port)
    return 0


# -- demo --------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from draftfleet.demo import run_demo

    return run_demo(store=args.store, timeout_s=args.timeout, as_json=args.json)


# -- redis -------------------------------------------------------------------------------------
def cmd_redis(args) -> int:
    from draftfleet.broker import STATE_DIR, EmbeddedRedis, redact

    _cfg, root = _config_or_store(args)
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


# -- requeue failures --------------------------------------------------------------------------
def cmd_failures(args) -> int:
    from draftfleet.store import Store

    cfg, root = _config_or_store(args)
    store = Store(root)
    rows = []
    for name in args.dataset or ([d.name for d in cfg.datasets] if cfg else store.datasets()):
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
        table.add_row(row["dataset"], escape(row["source"]), row["kind"], str(row["attempts"]), escape(row["reason"][:80]))
    out.print(table)
    return 0


# -- flower ------------------------------------------------------------------------------------
def cmd_flower(args) -> int:
    from draftfleet.broker import resolve_redis_url
    from draftfleet.monitor import basic_auth_from_env, run_flower

    auth = None if args.no_auth else basic_auth_from_env(args.basic_auth_env)
    cfg = _config(args)
    url = resolve_redis_url(args.redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    run_flower(cfg, url, basic_auth=auth, address=args.address, port=args.port, allow_control=args.allow_control)
    return 0


# -- status, drain, pivot ------------------------------------------------------------------
def _redis(args, cfg):
    """The fleet's Redis; with no config (``--store`` alone), the flag, REDIS_URL or the store's own."""
    from draftfleet.broker import connect, resolve_redis_url

    configured, store = (cfg.fleet.redis_url, cfg.fleet.store) if cfg else (None, args.store)
    return connect(resolve_redis_url(args.redis_url, configured, store))


def cmd_status(args) -> int:
    import time

    import msgspec
    from rich.live import Live

    from draftfleet.status import render, snapshot

    cfg = _config(args)
    names = args.dataset or None  # checked by snapshot: datasets enqueued since the config changed count too
    r = _redis(args, cfg)
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


def _pivot_report(args, cfg, root, result, title: str) -> int:
    import msgspec

    from draftfleet.inventory import run_inventory

    inv = run_inventory(root, cfg, result.datasets)
    if args.json:
        print(msgspec.json.encode({"drain": result, "inventory": inv}).decode())
        return 0 if result.drained else 1
    state = "done" if result.drained else f"[red]timed out with {result.still_running} still running[/]"
    out.print(f"{title}: {state} after {result.waited_s:.0f}s; assignment now "
              + ", ".join(f"{d}: {'+'.join(k) or 'nobody'}" for d, k in result.assignment.items()))
    _print_inventory(inv)
    return 0 if result.drained else 1


def _datasets(args, cfg, root=None) -> list[str]:
    """The datasets named (each checked), else all: the config's, or the store's with ``--store`` alone."""
    if cfg is None:
        from draftfleet.store import Store

        known = Store(root).datasets()
        unknown = [n for n in args.dataset or [] if n not in known]
        if unknown:
            raise ConfigError(f"unknown dataset(s) {', '.join(unknown)}: {root} has {', '.join(known) or 'none'}")
        return args.dataset or known
    names = args.dataset or [d.name for d in cfg.datasets]
    for n in names:
        cfg.dataset(n)
    return names


def _move(args, label: str, run, title: str) -> int:
    """Run a drain or pivot with a live "waiting for N in flight" line, then report."""
    cfg, root = _config_or_store(args)
    r = _redis(args, cfg)
    names = _datasets(args, cfg, root)
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=err, disable=args.json) as progress:
        t = progress.add_task(label, total=None)
        tick = lambda running: progress.update(t, description=f"waiting for {running} in flight")  # noqa: E731
        result = run(r, names, tick)
    return _pivot_report(args, cfg, root, result, title.format(datasets=", ".join(names)))


def cmd_drain(args) -> int:
    from draftfleet.pivot import drain

    return _move(args, "draining", lambda r, names, tick: drain(r, args.kind, names, args.timeout, tick),
                 f"drained {args.kind} from {{datasets}}")


def cmd_pivot(args) -> int:
    from draftfleet.pivot import pivot

    return _move(args, "pivoting", lambda r, names, tick: pivot(r, args.to, names, args.timeout, tick),
                 f"pivoted {{datasets}} to {args.to}")


# -- reconcile, inventory, import, export --------------------------------------------------
def cmd_reconcile(args) -> int:
    import msgspec

    from draftfleet.reconcile import Reconciler
    from draftfleet.store import Store

    cfg, root = _config_or_store(args)
    store = Store(root)
    names = _datasets(args, cfg, root)
    drifts = Reconciler(store, _redis(args, cfg)).reconcile_all(names)
    if args.json:
        print(msgspec.json.encode(drifts).decode())
        return 0
    table = Table(title="reconcile: counters against the store")
    for col in ("dataset", "stored", "counted", "newly counted", "corrections", "counted, not stored", "unreadable"):
        table.add_column(col, justify="left" if col in ("dataset", "corrections") else "right")
    for d in drifts:
        fixes = "; ".join(f"{b}: " + ", ".join(f"{k} {v:+d}" for k, v in c.items()) for b, c in d.corrections.items())
        table.add_row(d.dataset, str(d.stored), str(d.counted), str(d.newly_counted), fixes or "none",
                      str(d.counted_not_stored), str(len(d.unreadable)))
    out.print(table)
    for d in drifts:
        if d.set_aside:
            out.print(f"{d.dataset}: {len(d.set_aside)} record files could not be read and were set aside "
                      f"(first: {escape(d.set_aside[0])}); `draftfleet enqueue` generates them again", highlight=False)
    return 0


def _config_or_store(args):
    """(config, store root): ``--store DIR`` alone works without any config (manifests fill in)."""
    if args.store and not args.config and not os.environ.get("DRAFTFLEET_CONFIG"):
        return None, args.store
    cfg = _config(args)
    return cfg, cfg.fleet.store


def _optional_tokenizer(args, cfg):
    from draftfleet.tokenizer import TargetTokenizer

    path = getattr(args, "tokenizer", None) or (cfg.fleet.tokenizer if cfg else None)
    if not path:
        return None
    if cfg is not None and path == cfg.fleet.tokenizer:
        return TargetTokenizer.from_config(cfg.fleet)
    return TargetTokenizer(path)


def _print_inventory(invs) -> None:
    from draftfleet.inventory import ROUNDTRIP_MEANING

    for inv in invs:
        table = Table(title=f"inventory: {inv.dataset}", title_justify="left")
        for col in ("backend", "kind", "token source", "responses", "completion tokens", "provider's count",
                    "difference", "cost (USD)"):
            table.add_column(col, justify="left" if col in ("backend", "kind", "token source") else "right")
        for s in inv.by_source:
            theirs = (f"{s.provider_completion_tokens:,}", f"{s.provider_difference:+,}") if s.provider_responses else ("-", "-")
            table.add_row(s.backend, s.backend_kind, s.token_source, f"{s.responses:,}", f"{s.completion_tokens:,}",
                          *theirs, f"{s.cost_usd:,.2f}")
        table.add_row("total", "", "", f"{inv.responses:,}", f"{inv.completion_tokens:,}", "", "", f"{inv.spend_usd:,.2f}")
        out.print(table)
        out.print("completion tokens: the target tokenizer's count (budgets use it); provider's count: the API's own "
                  "usage.completion_tokens (its tokenizer); difference: ours minus theirs", highlight=False)
        line = f"mean {inv.mean_tokens or 0:,.0f} tokens/response"
        if inv.conversations:
            line += f"; {inv.conversations:,} conversations, {inv.turns:,} regenerated turns in all"
        if inv.budget_tokens:
            line += (f"; budget {inv.budget_tokens:,}: {100 * (inv.share_done or 0):.1f}% done, "
                     f"{inv.remaining_tokens:,} remaining")
        if inv.prompts_left is not None:
            line += f"; {inv.prompts_left:,} prompts left"
        for name, usd in inv.cost_to_finish_usd.items():
            line += f"; to finish on {name}: ~${usd:,.2f}"
        out.print(line, highlight=False)
        v = inv.validation
        checks = [f"schema errors {v.schema_errors}", f"truncated {v.truncated}", f"duplicate prompts {v.duplicate_prompts}"]
        if v.ids_out_of_vocab is not None:
            checks += [f"ids out of vocab {v.ids_out_of_vocab}", f"stopped without end-of-turn {v.stop_without_eot}"]
        if v.roundtrip_mismatch_share is not None:
            checks.append(f"round-trip mismatch share {100 * v.roundtrip_mismatch_share:.1f}% "
                          f"({v.roundtrip_mismatched} of {v.roundtrip_checked} exact records)")
        out.print("validation: " + ", ".join(checks), highlight=False)
        if (h := inv.hidden_states) is not None:
            out.print(f"hidden states v{h.version} (layers {h.layer_ids}): {h.files:,} of {h.units:,} turns captured, "
                      f"{h.tokens:,} tokens, {h.bytes / 1e9:,.3f} GB"
                      + (f" ({h.bytes / h.tokens:,.0f} B/token)" if h.tokens else ""), highlight=False)
        if v.roundtrip_mismatch_share is not None:
            out.print(f"  round-trip mismatch share: {ROUNDTRIP_MEANING}", highlight=False)
        for f in v.unreadable_files[:10]:
            out.print(f"  [yellow]unreadable[/] {escape(f)}", highlight=False)


def cmd_inventory(args) -> int:
    import msgspec

    from draftfleet.inventory import run_inventory

    cfg, root = _config_or_store(args)
    invs = run_inventory(root, cfg, args.dataset, _optional_tokenizer(args, cfg), args.roundtrip_sample)
    if args.json:
        print(msgspec.json.encode(invs).decode())
    else:
        _print_inventory(invs)
    return 0


def cmd_import(args) -> int:
    import msgspec

    from draftfleet.ledger import Ledger
    from draftfleet.producer.enqueue import check_manifest
    from draftfleet.producer.importer import import_file
    from draftfleet.store import Store

    cfg = _config(args)
    ds = cfg.dataset(args.dataset)
    store = Store(cfg.fleet.store)
    manifest = check_manifest(store, cfg, ds, new_version=False)
    try:
        ledger = Ledger(_redis(args, cfg))
        ledger.r.ping()
    except Exception as exc:  # counting can wait: the reconciler counts what the store holds
        err.print(f"[yellow]counters not updated ({type(exc).__name__}); `draftfleet reconcile` will count them[/]")
        ledger = None
    summary = import_file(args.path, ds, manifest, store, _optional_tokenizer(args, cfg), ledger, args.label,
                          finish_rule=args.finish_rule)
    if args.json:
        print(msgspec.json.encode(summary).decode())
        return 0
    out.print(f"imported {summary.imported:,} records ({summary.completion_tokens:,} completion tokens; "
              f"{summary.exact} exact, {summary.retokenized} re-tokenized) into {ds.name}; "
              f"{summary.already_present} already present; {summary.rejected} rejected", highlight=False)
    if summary.rejected_by_kind:
        out.print("rejected: " + ", ".join(f"{k} {v}" for k, v in summary.rejected_by_kind.items())
                  + f"; raw lines in {store.quarantine_path(ds.name)}", highlight=False)
    if summary.cut_last_line:
        out.print("[yellow]the last line was cut off (the writer was killed mid-line): skipped[/]")
    how = {"file": "from the file's finish_reason", "end_of_turn": "by the end-of-turn id",
           "max_tokens": f"by length against max_tokens {ds.max_tokens:,}"}
    parts = [f"{sum(v.values()):,} {how.get(k, k)} (" + ", ".join(f"{r} {n:,}" for r, n in sorted(v.items())) + ")"
             for k, v in summary.finish_decided.items()]
    if parts:
        out.print(f"finish reasons (rule {summary.finish_rule}): " + "; ".join(parts), highlight=False)
    return 0


def cmd_export(args) -> int:
    import msgspec

    from draftfleet.export import ExportError, export_dataset
    from draftfleet.store import Store

    cfg, root = _config_or_store(args)
    store = Store(root)
    known = sorted({d.name for d in cfg.datasets} | set(store.datasets())) if cfg else store.datasets()
    names = args.dataset or known
    unknown = [n for n in names if n not in known]
    if unknown:
        err.print(f"[red]error[/]: unknown dataset(s) {', '.join(unknown)}: {root} has "
                  + (", ".join(known) or "no datasets"), highlight=False)
        return 1
    from draftfleet.export import features

    hidden_formats = [f for f in args.format if f in features.FORMATS]
    text_formats = [f for f in args.format if f not in features.FORMATS]
    tok = _optional_tokenizer(args, cfg) if text_formats else None  # also tells which reasoning the template renders
    try:
        manifests = [export_dataset(store, name, args.out, text_formats, exclude_truncated=args.exclude_truncated,
                                    exclude_invalid=args.exclude_invalid, include_truncated=args.include_truncated,
                                    tokenizer=tok) for name in names] if text_formats else []
        if hidden_formats:
            from draftfleet.hidden import CaptureError, HiddenStore, capture_settings

            try:
                model_path = capture_settings(cfg)[0].path if cfg else None
            except CaptureError:
                model_path = None
            captured = names if args.dataset else [n for n in names if HiddenStore(store).versions(n)]
            found = [features.export_features(store, name, args.out, hidden_formats, model_path=model_path,
                                              version=args.capture_version, torch_python=args.torch_python)
                     for name in captured]
            if args.json:
                print(msgspec.json.encode(found).decode())
            else:
                for f in found:
                    out.print(f"exported {f.rows:,} captured turns ({f.tokens:,} tokens) of {f.dataset} capture "
                              f"v{f.capture_version}: " + ", ".join(f.folders.values())
                              + (f"; {f.missing:,} turns not captured yet" if f.missing else ""), highlight=False)
    except ExportError as exc:
        err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    if args.json:
        if text_formats:
            print(msgspec.json.encode(manifests).decode())
        return 0
    for m in manifests:
        out.print(f"exported {m.records:,} records of {m.dataset} to {args.out}: "
                  + ", ".join(m.files) + f" (excluded: {m.excluded_truncated} truncated, "
                  f"{m.excluded_invalid} invalid; {m.truncated_left_out} cut turns left out of sharegpt)", highlight=False)
        for note in m.notes:
            out.print(f"  note: {note}", highlight=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    p = argparse.ArgumentParser(prog="draftfleet", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {version('draftfleet')}")
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

    sp = sub.add_parser("worker", help="run a worker: gpu (one per SGLang or vLLM server) or cloud")
    sp.add_argument("kind", choices=["gpu", "cloud", "reconciler", "capture"],
                    help="gpu: one per SGLang or vLLM server; cloud: an OpenAI-compatible API; "
                    "reconciler: counters vs the store; capture: hidden states of stored records (vLLM)")
    common(sp)
    sp.add_argument("--engine", choices=["sglang", "vllm"],
                    help="gpu: the engine (default: the one of [backends.sglang] / [backends.vllm] configured)")
    sp.add_argument("--url", help="gpu, capture: URL of a running SGLang or vLLM server (capture: started for it)")
    sp.add_argument("--gpu", help="gpu: launch the engine on these GPUs: 0; 0,1 for one TP group of tp=2; "
                    "0-7 or all for one worker and server per group of [backends.ENGINE.launch].tp GPUs")
    sp.add_argument("--inflight", type=int, help="gpu: requests kept in flight (default [backends.ENGINE].inflight)")
    sp.add_argument("--backend", help="cloud: the [backends.NAME] table to use (default: the only cloud backend)")
    sp.add_argument("--concurrency", type=int, help="cloud: requests in flight (default the backend's concurrency)")
    sp.add_argument("--dataset", "-d", action="append", help="consume only this dataset's queue (repeatable)")
    sp.add_argument("--name", help="worker name (default from kind and GPU/backend)")
    sp.add_argument("--interval", type=float, default=60.0, help="reconciler: seconds between passes")
    sp.add_argument("--metrics-port", type=int, help="reconciler: serve Prometheus metrics on this port")
    sp.add_argument("--metrics-address", default="127.0.0.1", help="reconciler: metrics bind address")
    sp.add_argument("--loglevel", default="INFO", help="DEBUG, INFO (one line per prompt; default), WARNING or ERROR")
    sp.set_defaults(func=cmd_worker)

    sp = sub.add_parser("capture", help="queue hidden-state capture of every stored record turn without one (resume)")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--new-version", action="store_true",
                    help="start a new capture version when the model or layers differ from the stored capture's")
    sp.add_argument("--ignore-space", action="store_true",
                    help="queue even when the estimated size exceeds the store's free space")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_capture)

    sp = sub.add_parser("emulator", help="serve SGLang /generate and OpenAI chat completions on loopback (tests, demo)")
    sp.add_argument("--tokenizer", required=True, help="tokenizer folder (the emulator's ids come from it)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sp.add_argument("--port", type=int, default=30000, help="port to serve on (default 30000)")
    sp.add_argument("--api-key-env", help="require this environment variable's value as the bearer key")
    sp.add_argument("--model", help="model name the emulator reports")
    sp.add_argument("--seed", type=int, help="random seed of lengths, texts and faults")
    sp.add_argument("--length", help="completion length distribution: lognormal:MEAN:SIGMA, uniform:LO:HI, fixed:N")
    sp.add_argument("--reasoning-length", help="reasoning length distribution (with --reasoning-rate)")
    for flag in EMULATOR_FLAGS[4:]:
        kind = int if flag in _EMULATOR_INTS else str if flag == "eos_token" else float
        sp.add_argument("--" + flag.replace("_", "-"), type=kind, dest=flag, help=_emulator_help(flag))
    sp.add_argument("--sglang-api-key-env", help="SGLang's --api-key: this variable's value guards all but /health*")
    sp.add_argument("--proxy", action="store_true", help="a proxy in front of /generate (429s, Retry-After)")
    sp.add_argument("--loading", action="store_true", help="/health answers 503 (the model is warming up)")
    sp.set_defaults(func=cmd_emulator)

    sp = sub.add_parser("demo", help="run the whole fleet on the emulator and the sample data (no GPU, no network)")
    sp.add_argument("--store", help="keep the demo's store (and config) in this folder")
    sp.add_argument("--timeout", type=float, default=110.0, help="seconds before the demo gives up (default 110)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("redis", help="the store's embedded private Redis: start, stop, url")
    sp.add_argument("action", choices=["start", "stop", "url"],
                    help="start it (prints the URL, password hidden), stop it, or print its URL")
    common(sp)
    sp.add_argument("--show-password", action="store_true", help="url: print the password too")
    sp.set_defaults(func=cmd_redis)

    sp = sub.add_parser("failures", help="list prompts whose retries ran out")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the list as JSON")
    sp.set_defaults(func=cmd_failures)

    sp = sub.add_parser("flower", help="Flower on the fleet's broker: basic auth required, Prometheus /metrics")
    common(sp)
    sp.add_argument("--address", default="127.0.0.1", help="address to bind (default loopback; /metrics is never authenticated)")
    sp.add_argument("--port", type=int, default=5555, help="port to serve on (default 5555)")
    sp.add_argument("--basic-auth-env", default="FLOWER_BASIC_AUTH", metavar="NAME",
                    help="environment variable holding user:password, several separated by commas (default FLOWER_BASIC_AUTH)")
    sp.add_argument("--no-auth", action="store_true", help="run without authentication: anyone who reaches the port sees the fleet")
    sp.add_argument("--allow-control", action="store_true",
                    help="enable Flower's control API (shutdown, consumers, revoke, send task); off by default")
    sp.set_defaults(func=cmd_flower)
    sp = sub.add_parser("status", help="workers, queues, tokens against budget, spend, ETA")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--watch", action="store_true", help="refresh until interrupted")
    sp.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    sp.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("drain", help="stop a worker kind taking new tasks from datasets; wait for what it started")
    common(sp)
    sp.add_argument("--kind", choices=["gpu", "cloud"], required=True, help="the worker kind to drain")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for in-flight work")
    sp.add_argument("--json", action="store_true", help="print the result and the inventory as JSON")
    sp.set_defaults(func=cmd_drain)

    sp = sub.add_parser("pivot", help="hand datasets to one worker kind (drains the other)")
    common(sp)
    sp.add_argument("--to", choices=["gpu", "cloud"], required=True, help="the worker kind that takes the datasets")
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for in-flight work (default 1800)")
    sp.add_argument("--json", action="store_true", help="print the result and the inventory as JSON")
    sp.set_defaults(func=cmd_pivot)

    sp = sub.add_parser("reconcile", help="rebuild the counters from the store, report and correct drift")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--json", action="store_true", help="print the drift as JSON")
    sp.set_defaults(func=cmd_reconcile)

    sp = sub.add_parser("inventory", help="responses, tokens, budget, cost to finish and validation, from the store")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append", help="only this dataset (repeatable; default all)")
    sp.add_argument("--tokenizer", help="tokenizer folder for the validation (default [fleet].tokenizer)")
    sp.add_argument("--roundtrip-sample", type=int, default=200,
                    help="exact records checked decode->encode (at most 100k tokens of them; 0: skip)")
    sp.add_argument("--json", action="store_true", help="print the inventory as JSON")
    sp.set_defaults(func=cmd_inventory)

    sp = sub.add_parser("import", help="bring an earlier run's raw_responses.jsonl into the store")
    sp.add_argument("path", help="a JSONL file: one prompt and its output (text and/or output_ids) per line")
    common(sp)
    sp.add_argument("--dataset", "-d", required=True, help="the dataset (of the config) the lines belong to")
    sp.add_argument("--label", default="import", help="backend for imported lines that name none (a raw export names its own)")
    sp.add_argument("--finish-rule", choices=("max-tokens", "end-of-turn"), default="max-tokens",  # importer.FINISH_RULES
                    help="for lines without finish_reason whose ids lack the end-of-turn id: max-tokens calls them "
                    "truncated only when at least max_tokens long (default); end-of-turn always calls them truncated")
    sp.add_argument("--tokenizer", help="tokenizer folder (default [fleet].tokenizer): re-tokenizes text-only lines")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_import)

    sp = sub.add_parser("export", help="write training files (SpecForge sharegpt, raw_responses, token rows)")
    common(sp)
    sp.add_argument("--dataset", "-d", action="append",
                    help="export this dataset (repeatable; default every dataset of the config or store)")
    sp.add_argument("--format", "-f", action="append", choices=["sharegpt", "raw", "tokens", "speculators", "specforge"],
                    required=True, help="sharegpt: SpecForge conversations; raw: raw_responses with ids; tokens: "
                    "input_ids + loss_mask rows; speculators / specforge: captured hidden states in each trainer's "
                    "offline layout (repeatable)")
    sp.add_argument("--capture-version", type=int, help="speculators/specforge: the capture version (default the latest)")
    sp.add_argument("--torch-python", help="specforge: an interpreter with torch and safetensors to write its "
                    "torch.save files (default this one, when it has torch)")
    sp.add_argument("--out", required=True,
                    help="folder for <dataset>.<format>.jsonl and <dataset>.manifest.json (other datasets' files stay)")
    sp.add_argument("--exclude-truncated", action="store_true", help="leave out responses cut at max_tokens (every format)")
    sp.add_argument("--include-truncated", action="store_true",
                    help="keep answers cut at max_tokens in the sharegpt conversations (left out by default: a trainer "
                    "would close them with an end-of-turn the model never wrote); raw and tokens always keep them")
    sp.add_argument("--exclude-invalid", action="store_true",
                    help="leave out records with no ids, ids outside the vocabulary, or a stop without end-of-turn")
    sp.add_argument("--tokenizer", help="tokenizer folder (default [fleet].tokenizer); needed by -f tokens")
    sp.add_argument("--json", action="store_true", help="print the manifests as JSON")
    sp.set_defaults(func=cmd_export)
    return p


# Commands that run once and end: a private Redis they had to start is stopped on the way out.
ONE_SHOT = ("inventory", "export", "import", "reconcile", "status", "failures", "drain", "pivot")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        if args.command in ONE_SHOT:
            from draftfleet.broker import release_embedded

            release_embedded()


def _run(args) -> int:
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
        from draftfleet.store import StoreError
        from draftfleet.tokenizer import TokenizerError

        if isinstance(exc, redis.RedisError):
            # redis-py names host and port, never the password
            err.print(f"[red]cannot reach Redis[/]: {escape(unreachable(exc))}", highlight=False)
            return 1
        if isinstance(exc, (BrokerError, StoreError, TokenizerError, OSError)):
            err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
