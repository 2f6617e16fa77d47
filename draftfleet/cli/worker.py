"""``draftfleet worker KIND``: run a gpu, cloud, capture or reconciler worker."""

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


def cmd_worker(args) -> int:
    from draftfleet.workers.worker import run_worker

    cfg = config(args)
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

            return run_gpu_workers(cfg.path, groups, worker_flags(args))
        gpus = groups[0]
    run_worker(
        cfg, args.kind, backend_name=args.backend, engine=args.engine, url=args.url, gpus=gpus,
        slots=args.inflight or args.concurrency, datasets=args.dataset, redis_url=args.redis_url,
        name=args.name, loglevel=args.loglevel,
    )
    return 0


def register(sub) -> None:
    sp = sub.add_parser("worker", help="run a worker: gpu (one per SGLang or vLLM server) or cloud")
    sp.add_argument("kind", choices=["gpu", "cloud", "reconciler", "capture"],
                    help="gpu: one per SGLang or vLLM server; cloud: an OpenAI-compatible API; "
                    "reconciler: counters vs the store; capture: hidden states of stored records (vLLM)")
    add_common(sp)
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
