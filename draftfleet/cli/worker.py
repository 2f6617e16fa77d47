"""``draftfleet worker KIND``: run a gpu, cloud, batch, capture or reconciler worker; each kind has its own
options (``draftfleet worker gpu --help``)."""

from __future__ import annotations

from draftfleet.cli.common import add_common, config
from draftfleet.schemas.config import ConfigError


def worker_flags(args) -> list[str]:
    """The flags of this worker command that each per-GPU child repeats (all but --gpu/--config)."""
    flags = []
    for name in ("engine", "redis_url", "store", "inflight", "loglevel"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    for ds in args.dataset or []:
        flags += ["--dataset", ds]
    return flags


def cmd_gpu(args) -> int:
    from draftfleet.workers.worker import run_worker

    cfg = config(args)
    gpus = None
    if args.gpu is not None:
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

            return run_gpu_workers(cfg.path, groups, worker_flags(args))
        gpus = groups[0]
    run_worker(cfg, "gpu", engine=args.engine, url=args.url, gpus=gpus, slots=args.inflight, datasets=args.dataset,
               redis_url=args.redis_url, name=args.name, loglevel=args.loglevel)
    return 0


def cmd_cloud(args) -> int:
    from draftfleet.workers.worker import run_worker

    run_worker(config(args), "cloud", backend_name=args.backend, slots=args.concurrency, datasets=args.dataset,
               redis_url=args.redis_url, name=args.name, loglevel=args.loglevel)
    return 0


def cmd_batch(args) -> int:
    from draftfleet.workers.batch import run_batch_worker

    run_batch_worker(config(args), args.backend, datasets=args.dataset, redis_url=args.redis_url, name=args.name,
                     loglevel=args.loglevel)
    return 0


def cmd_capture(args) -> int:
    from draftfleet.workers.capture import run_capture_worker
    from draftfleet.workers.capture_engine import engine_command

    cfg = config(args)
    if args.print_engine_command:
        print(engine_command(cfg))
        return 0
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


def cmd_reconciler(args) -> int:
    from draftfleet.workers.reconciler import run_reconciler

    run_reconciler(config(args), redis_url=args.redis_url, interval_s=args.interval, metrics_port=args.metrics_port,
                   metrics_address=args.metrics_address, loglevel=args.loglevel)
    return 0


def _consumer_flags(sp, what: str) -> None:
    """What every worker that consumes queues takes: which datasets, its name, its log level."""
    sp.add_argument("--dataset", "-d", action="append", help=f"consume only this dataset's {what} (repeatable)")
    sp.add_argument("--name", help="worker name (default from the kind and the GPU, server or backend)")
    _loglevel(sp)


def _loglevel(sp) -> None:
    sp.add_argument("--loglevel", default="INFO", help="DEBUG, INFO (one line per prompt; default), WARNING or ERROR")


def register(sub) -> None:
    sp = sub.add_parser("worker", help="run a worker: gpu (one per SGLang or vLLM server), cloud, batch, capture or reconciler",
                        description="Run one worker in the foreground until Ctrl-C or SIGTERM (a warm shutdown). "
                        "`draftfleet worker KIND --help` lists each kind's options.")
    kinds = sp.add_subparsers(dest="kind", required=True, metavar="KIND", help="the kind of worker")

    gpu = kinds.add_parser("gpu", help="generate on one SGLang or vLLM server (attached by --url, or launched on --gpu)",
                           description="Generate on one SGLang or vLLM server: attach to a running one (--url, default "
                           "the engine's first configured url) or launch one per GPU group (--gpu).")
    add_common(gpu)
    gpu.add_argument("--engine", choices=["sglang", "vllm"],
                     help="the engine (default: the one of [backends.sglang] / [backends.vllm] configured)")
    gpu.add_argument("--url", help="URL of a running SGLang or vLLM server")
    gpu.add_argument("--gpu", help="launch the engine on these GPUs: 0; 0,1 for one TP group of tp=2; "
                     "0-7 or all for one worker and server per group of [backends.ENGINE.launch].tp GPUs")
    gpu.add_argument("--inflight", type=int, help="requests kept in flight (default [backends.ENGINE].inflight)")
    _consumer_flags(gpu, "queue")
    gpu.set_defaults(func=cmd_gpu)

    cloud = kinds.add_parser("cloud", help="generate on an OpenAI-compatible API (OpenRouter)",
                             description="Generate on an OpenAI-compatible chat-completions API; its key comes from "
                             "the variable the backend's api_key_env names.")
    add_common(cloud)
    cloud.add_argument("--backend", help="the [backends.NAME] table to use (default: the only cloud backend)")
    cloud.add_argument("--concurrency", type=int, help="requests in flight (default the backend's concurrency)")
    _consumer_flags(cloud, "queue")
    cloud.set_defaults(func=cmd_cloud)

    batch = kinds.add_parser("batch", help="finish datasets through a provider's batch API (about half price, hours)",
                             description="Collect prompts from the cloud's queues into batches for the backend's "
                             "batch API ([backends.NAME].batch: openrouter or openai), submit them, poll them and "
                             "store what they answer; a restart goes on with the open batches (the store holds them).")
    add_common(batch)
    batch.add_argument("--backend", help="the [backends.NAME] table (default: the only one with a batch API)")
    _consumer_flags(batch, "queue")
    batch.set_defaults(func=cmd_batch)

    capture = kinds.add_parser("capture", help="capture hidden states of stored records on vLLM",
                               description="Capture the target's hidden states for stored records (queued by "
                               "`draftfleet capture`) on vLLM: attach by --url (a server started with the "
                               "extraction flags) or launch one on --gpu.")
    add_common(capture)
    capture.add_argument("--url", help="URL of a vLLM server started for capture (see README, Hidden states)")
    capture.add_argument("--gpu", help="launch vLLM with the extraction on these GPUs (one TP group)")
    capture.add_argument("--inflight", type=int, help="capture requests in flight (default [capture].inflight)")
    capture.add_argument("--print-engine-command", action="store_true",
                         help="print the `vllm serve` command of a capture server to start by hand for --url, and exit")
    _consumer_flags(capture, "capture queue")
    capture.set_defaults(func=cmd_capture)

    rec = kinds.add_parser("reconciler", help="keep the counters equal to the store; Prometheus metrics",
                           description="Rebuild the counters from the store every --interval seconds and correct "
                           "drift; optionally serve the fleet's Prometheus metrics.")
    add_common(rec)
    rec.add_argument("--interval", type=float, default=60.0, help="seconds between passes (default 60)")
    rec.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    rec.add_argument("--metrics-address", default="127.0.0.1", help="metrics bind address (default loopback)")
    _loglevel(rec)
    rec.set_defaults(func=cmd_reconciler)
