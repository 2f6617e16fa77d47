"""What one stored result costs the shared Redis: commands and Redis CPU, by command (issue 32).

One Redis serves the whole fleet, and it is one thread: the fleet stops scaling where the sum of
every worker's Redis work per result, times the results per second, fills that core. The prompts
are queued first (``enqueue``'s own 2 commands a prompt are not the worker's), the counters reset
(``CONFIG RESETSTAT``), then one or more ``draftfleet worker gpu`` processes drain the queue against
an emulator that answers at once; ``INFO commandstats`` then says what the workers asked of Redis,
divided by the results stored. Commands run inside a Lua script count as calls of their own, as
Redis counts them (they are what the script costs); the scripts' own calls are in EVALSHA, whose µs include theirs. The CPU figure is
redis-server's own (``INFO cpu``, user + system) over the same span. The
dataset has a budget far above what it spends, so admission runs for every task as in production.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from .env import (EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, ratio, wait_for, write_config,
                  write_prompts)

DATASET = "rc"
# Issue 32's bound: a stored result costs at most this many Redis commands and this much Redis CPU.
CALLS_GOAL, USEC_GOAL = 15, 120


def commandstats(r) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` as command -> (calls, usec)."""
    out = {}
    for name, v in r.info("commandstats").items():
        out[name.removeprefix("cmdstat_").upper()] = (int(v["calls"]), int(v["usec"]))
    return out


def _cpu(r) -> float:
    """redis-server's own CPU seconds (user + system), from ``INFO cpu``."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def drain(folder: Path, redis: PrivateRedis, emu: EmulatorProcess, prompts: Path, workers: int,
          inflight: int) -> dict:
    """Queue every prompt, reset Redis's statistics, let ``workers`` processes drain the queue."""
    fresh_dir(folder)
    r = redis.client()
    r.flushall()
    config = write_config(folder, [{"name": DATASET, "path": str(prompts), "max_tokens": 64,
                                    "budget_tokens": 10**12}], emulator_url=emu.url, inflight=inflight)
    cfg = load_config(config)
    store = open_store(cfg)
    app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
    n = enqueue_dataset(cfg, cfg.dataset(DATASET), app, r, store).queued
    app.close()
    procs = [WorkerProcess(folder, config, redis.url, "--url", emu.url, "--inflight", str(inflight))
             for _ in range(workers)]
    for p in procs:
        p.__enter__()
    try:
        for p in procs:
            p.wait_ready()
        r.config_resetstat()
        cpu0 = _cpu(r)
        early = len(store.keys(DATASET))  # stored by a worker ready before the others: not in the figures
        start = time.perf_counter()
        wait_for(lambda: len(store.keys(DATASET)) >= n, 900, f"{n} results (worker logs in {folder})", 0.2)
        # what the last tasks still do after their record is stored (count, release, ack)
        wait_for(lambda: not r.keys("draftfleet:claim:*"), 60, "the claims released", 0.1)
        wall = time.perf_counter() - start
        cpu = _cpu(r) - cpu0
        stats = commandstats(r)
    finally:
        for p in procs:
            p.stop()
    stats.pop("CONFIG", None)
    stats.pop("INFO", None)
    return {"n": n - early, "wall_s": wall, "stats": stats, "cpu_s": cpu}


def run(work: Path, *, tasks: int, workers: list[int], inflight: int) -> Section:
    prompts = write_prompts(work / "prompts.jsonl", tasks, tag="rc")
    results: dict[int, dict] = {}
    with PrivateRedis(work / "redis") as redis, EmulatorProcess(work, time_scale=0, length="uniform:20:60") as emu:
        for w in workers:
            results[w] = drain(work / f"w{w}", redis, emu, prompts, w, inflight)
    figures, details = [], []
    head = "| per stored result | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in workers) + " |"
    details += [head, "| --- |" + " ---: |" * len(workers)]
    per = {w: {c: (calls / res["n"], usec / res["n"]) for c, (calls, usec) in res["stats"].items()}
           for w, res in results.items()}
    # the process's CPU, not the sum of commandstats: a script's usec holds those of the commands it ran
    totals = {w: (sum(c for c, _ in per[w].values()), 1e6 * res["cpu_s"] / res["n"]) for w, res in results.items()}
    details.append("| Redis commands | " + " | ".join(f"**{totals[w][0]:.1f}**" for w in workers) + " |")
    details.append("| redis-server CPU (INFO cpu) | " + " | ".join(f"**{totals[w][1]:.0f} µs**" for w in workers) + " |")
    details.append("| (command, then calls and commandstats µs) | " + " | ".join("" for _ in workers) + " |")
    first = workers[0]
    for cmd in sorted(per[first], key=lambda c: -per[first][c][0]):
        details.append(f"| {cmd} | " + " | ".join(
            f"{per[w].get(cmd, (0, 0))[0]:.2f} calls, {per[w].get(cmd, (0, 0))[1]:.0f} µs" for w in workers) + " |")
    for w in workers:
        calls, usec = totals[w]
        figures.append(Figure(bench="redis", name=f"Redis commands per stored result, {w} worker(s)", value=calls,
                              unit="commands", reference=f"issue 32's bound ({CALLS_GOAL})",
                              reference_value=CALLS_GOAL, ratio=ratio(calls, CALLS_GOAL, higher_is_better=False),
                              headline=w == first))
        figures.append(Figure(bench="redis", name=f"Redis CPU per stored result, {w} worker(s)", value=usec,
                              unit="µs", reference=f"issue 32's bound ({USEC_GOAL} µs)", reference_value=USEC_GOAL,
                              ratio=ratio(usec, USEC_GOAL, higher_is_better=False), headline=False))
    calls, usec = totals[first]
    details += ["", f"{tasks} prompts queued first, then drained by {', '.join(map(str, workers))} `draftfleet worker "
                f"gpu` process(es) at --inflight {inflight}, against an emulator that answers at once (20–60 "
                "tokens); the dataset has a budget, so every task is admitted. `INFO commandstats` after `CONFIG "
                "RESETSTAT` (taken once the workers were ready), divided by the results stored since: what the "
                "workers asked, their idle loops included. Commands run by a script count apiece.",
                f"The ceiling: at {usec:.0f} µs of Redis CPU a result, one Redis core serves about "
                f"{1e6 / usec:,.0f} results/s; GPUs making 25 results/s each (5,000 tok/s, 200-token answers) fill "
                f"it at about {1e6 / usec / 25:,.0f} GPUs."]
    return Section(bench="redis", title="The shared Redis: commands and CPU per stored result", command="",
                   figures=figures, details=details)
