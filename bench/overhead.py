"""Per-task overhead: what Redis, Celery and the bookkeeping cost when inference costs nothing.

The emulator answers at once (``time_scale = 0``), so one GPU worker's rate is the fleet's own
limit: fetch, claim, generate over HTTP, write the record once (fsync), count it once, release,
acknowledge. The reference is the broker's own limit for the same messages: a plain redis-py
loop that LPUSHes each message body the producer queued and BRPOPs it back.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftfleet import redis_keys as rk
from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from .env import EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, cpu_seconds, fresh_dir, ratio, wait_for, write_config, write_prompts

DATASET = "ovh"


def plain_loop(redis: PrivateRedis, payloads: list[bytes]) -> float:
    """Seconds for one LPUSH and one BRPOP of every payload, one round trip each (redis-py)."""
    r = redis.client()
    q = "bench:plain"
    r.delete(q)
    start = time.perf_counter()
    for p in payloads:
        r.lpush(q, p)
        r.brpop([q], timeout=5)
    return time.perf_counter() - start


def fleet(folder: Path, redis: PrivateRedis, emu: EmulatorProcess, prompts: Path, inflight: int) -> dict[str, float]:
    """Queue every prompt, then let one worker drain the queue; rate between first and last result."""
    fresh_dir(folder)
    redis.client().flushall()
    config = write_config(folder, [{"name": DATASET, "path": str(prompts), "max_tokens": 64}],
                          emulator_url=emu.url, inflight=inflight)
    cfg = load_config(config)
    store = open_store(cfg)
    app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
    n = enqueue_dataset(cfg, cfg.dataset(DATASET), app, redis.client(), store).queued
    app.close()
    payloads = redis.client().lrange(rk.queue(DATASET), 0, -1)
    assert redis.proc is not None
    with WorkerProcess(folder, config, redis.url, "--url", emu.url, "--inflight", str(inflight)) as worker:
        worker.wait_ready()
        cpu = (worker.cpu_seconds(), emu.cpu_seconds(), cpu_seconds(redis.proc.pid))
        wait_for(lambda: len(store.keys(DATASET)) >= n, 600, f"{n} results (worker log: {worker.log_path})", 0.1)
        worker_cpu = worker.cpu_seconds() - cpu[0]
        emu_cpu = emu.cpu_seconds() - cpu[1]
        redis_cpu = cpu_seconds(redis.proc.pid) - cpu[2]
    times = sorted(rec.created_at for rec in store.records(DATASET))
    return {
        "n": n, "tasks_s": (n - 1) / (times[-1] - times[0]), "worker_cpu_ms": 1000 * worker_cpu / n,
        "emulator_cpu_ms": 1000 * emu_cpu / n, "redis_cpu_ms": 1000 * redis_cpu / n, "payloads": payloads,
    }


def run(work: Path, *, tasks: int, inflight: list[int]) -> Section:
    prompts = write_prompts(work / "prompts.jsonl", tasks, tag="ovh")
    results: dict[int, dict] = {}
    with PrivateRedis(work / "redis") as redis, EmulatorProcess(work, time_scale=0, length="uniform:20:60") as emu:
        for c in inflight:
            results[c] = fleet(work / f"fleet{c}", redis, emu, prompts, c)
        payloads = results[inflight[0]]["payloads"]
        plain_s = min(plain_loop(redis, payloads) for _ in range(3))
    plain_rate = len(payloads) / plain_s
    figures, rows = [], [
        "| run | tasks/s | wall ms per task | worker CPU ms per task | redis-server CPU ms | emulator CPU ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c, res in results.items():
        rate = res["tasks_s"]
        figures.append(Figure(bench="overhead", name=f"fleet tasks/s, time_scale=0, --inflight {c}", value=rate,
                              unit="tasks/s", reference="plain redis-py LPUSH+BRPOP loop, same payloads",
                              reference_value=plain_rate, ratio=ratio(rate, plain_rate), headline=c == max(inflight)))
        rows.append(f"| fleet, --inflight {c} | {rate:,.0f} | {1000 / rate:.2f} | {res['worker_cpu_ms']:.2f} | "
                    f"{res['redis_cpu_ms']:.2f} | {res['emulator_cpu_ms']:.2f} |")
    rows.append(f"| plain LPUSH+BRPOP loop | {plain_rate:,.0f} | {1000 / plain_rate:.3f} | – | – | – |")
    avg = sum(len(p) for p in payloads) / len(payloads)
    top = results[max(inflight)]
    details = [*rows, "",
               f"{tasks} prompts, queued first, then drained by one `draftfleet worker gpu` process; rate between the "
               f"first and the last stored result. Message bodies as queued: {avg:,.0f} bytes on average. "
               "The emulator answers at once with 20–60 tokens. CPU columns are per task, from /proc; on this "
               "2-core machine the worker, redis-server and the emulator share the cores. For scale: an SGLang "
               f"server at 5,000 tok/s with 200-token answers completes 25 tasks/s, which costs the worker "
               f"25 × {top['worker_cpu_ms']:.1f} ms = {2.5 * top['worker_cpu_ms']:.0f}% of one core."]
    return Section(bench="overhead", title="Per-task overhead through Redis and Celery", command="",
                   figures=figures, details=details)
