"""Budget admission against what is in flight: time and Redis commands per task at 100 to 50,000.

Each run fills one dataset with N reservations (N tasks in flight, each with its claim), then
runs tasks through the ledger as a fleet does: admit a new key, settle the oldest by counting its
record (first in, first out, so N stays constant). It measures the admission call's time as the
client sees it, and per task (admit + count) the Redis commands (``INFO commandstats``, those run
inside the Lua scripts included) and redis-server CPU. An estimating ledger (before issue 41) is
given figures that make a reservation grow after 5 ms and reach max_tokens after 10 ms, the worst
case for it; the exact ledger reserves max_tokens from the start and has no state change to pay.

The reference is the same measurement of another checkout of the repository (``--admission-baseline
PATH``, e.g. the commit before the ledger stopped scanning, checked out with ``git worktree add``),
loaded in a child process; without one, the reference is this ledger at the smallest N. Each
ledger runs in a child process that imports ``draftfleet`` from the tree it is given, so that
both run the same harness.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

DATASET = "adm"
# A stream makes 10 tokens/ms; responses of 100 tokens, max 200: a reservation grows after 5 ms
# (2 x what it made passes the expected 100) and is capped after 10 ms. No spread: no margin.
EXPECTED, MAX_TOKENS, BUDGET = 100, 200, 10**15
TOTALS = {"responses": 1000, "completion_tokens": 100_000, "latency_ms": 10_000, "completion_tokens_sq": 10**7}


# -- the child: one ledger, one N -------------------------------------------------------------
def _load_tree(tree: Path) -> None:
    """Import ``draftfleet`` (and its ``schemas`` subpackage) from ``tree``, as pyproject maps them."""
    for name, sub in (("draftfleet", "draftfleet"), ("draftfleet.schemas", "schemas")):
        folder = tree / sub
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _commands(r) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def _redis_cpu(r) -> float:
    info = r.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def _admitter(ledger, admitted: int):
    """``admit(key) -> bool`` for either ledger: the estimating one takes (budget, expected,
    max_tokens) and answers a verdict; the exact one (issue 41) takes (budget, max_tokens) and
    answers an ``Admission``."""
    import inspect

    if len(inspect.signature(ledger.admit).parameters) >= 6:
        return lambda k: ledger.admit(DATASET, k, "bench", BUDGET, EXPECTED, MAX_TOKENS) == admitted
    return lambda k: ledger.admit(DATASET, k, "bench", BUDGET, MAX_TOKENS).verdict == admitted


def _child(tree: Path, url: str, inflight: int, rounds: int, max_s: float) -> dict:
    _load_tree(tree)
    import redis

    from draftfleet import ledger as ledger_module
    from draftfleet import redis_keys as rk
    from draftfleet.schemas.records import Message, ResponseRecord, Usage

    r = redis.Redis.from_url(url, socket_timeout=300)
    r.flushall()
    if hasattr(rk, "COUNTERS_BUILT"):  # the counters an empty store has, as its rebuild marks them
        r.set(rk.COUNTERS_BUILT, "bench")
    ledger = ledger_module.Ledger(r)
    admit = _admitter(ledger, ledger_module.ADMITTED)
    r.hset(rk.dataset_totals(DATASET), mapping=TOTALS)
    keys = [f"{i:064x}" for i in range(inflight + rounds)]
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.set(rk.claim(DATASET, k), "bench", ex=3600)
    pipe.execute()
    scans = not hasattr(rk, "reserved_sum")
    fill_start = time.perf_counter()
    if scans:  # the scanning ledger's whole state is one hash: write it (admitting costs O(N^2))
        now_ms = int(time.time() * 1000)
        for i in range(0, inflight, 10_000):
            chunk = keys[i:min(i + 10_000, inflight)]
            r.hset(rk.reservations(DATASET), mapping={k: f"{EXPECTED}:{now_ms}" for k in chunk})
    else:
        for k in keys[:inflight]:
            assert admit(k)
    fill_s = time.perf_counter() - fill_start

    def record(key: str) -> ResponseRecord:
        return ResponseRecord(
            key=key, dataset=DATASET, source="bench:1", settings_id="s", messages=[Message(role="user", content="q")],
            system_prompt_used=False, text="t", output_ids=[1] * EXPECTED, prompt_tokens=5, completion_tokens=EXPECTED,
            finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu", model="m", token_source="exact",
            usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=EXPECTED / 10 / 1000, attempts=1, worker="w",
            created_at=0.0,
        )

    nxt, oldest = inflight, 0

    def task() -> float:
        nonlocal nxt, oldest
        t0 = time.perf_counter()
        assert admit(keys[nxt])
        took = time.perf_counter() - t0
        ledger.count(record(keys[oldest]))
        nxt, oldest = nxt + 1, oldest + 1
        return took

    task()  # loads both scripts (a first call costs a NOSCRIPT round trip)
    if not scans:  # let the fill's own due state changes drain first: measure the steady state
        time.sleep(0.02)
        while r.zcount(rk.reservations_due(DATASET), "-inf", int(time.time() * 1000)) > 0 and nxt < len(keys) - 1:
            task()
    rounds = min(rounds, len(keys) - nxt)
    before_cmds, before_cpu = _commands(r), _redis_cpu(r)
    start = time.perf_counter()
    times = []
    while len(times) < rounds and (len(times) < 20 or time.perf_counter() - start < max_s):
        times.append(task())
    n = len(times)
    cmds = (_commands(r) - before_cmds) / n
    cpu_ms = (_redis_cpu(r) - before_cpu) / n * 1000
    held = sorted(int(k, 16) for k in r.hkeys(rk.reservations(DATASET)))
    assert len(held) == inflight, (held[:5], held[-5:], len(held), nxt, oldest, n)
    times.sort()
    return {
        "inflight": inflight, "tasks": n, "fill_s": fill_s, "scans": scans,
        "admit_ms_mean": sum(times) / n * 1000, "admit_ms_p50": times[n // 2] * 1000,
        "admit_ms_p99": times[min(n - 1, int(n * 0.99))] * 1000, "commands_per_task": cmds,
        "redis_cpu_ms_per_task": cpu_ms, "ledger": ledger_module.__file__,
    }


# -- the parent: both ledgers, every N --------------------------------------------------------
def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _measure(tree: Path, url: str, inflight: int, rounds: int, max_s: float) -> dict:
    args = json.dumps({"tree": str(tree), "url": url, "inflight": inflight, "rounds": rounds, "max_s": max_s})
    out = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"admission bench child failed for {tree} at {inflight}:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout)
    if not result["ledger"].startswith(str(tree)):
        raise RuntimeError(f"the child imported {result['ledger']}, not the ledger of {tree}")
    return result


def run(work: Path, *, inflight: list[int], rounds: int, baseline: str | None, max_s: float = 20.0):
    from .env import REPO, Figure, PrivateRedis, Section, ratio

    trees = [("now", REPO)] + ([("before", Path(baseline).resolve())] if baseline else [])
    results: dict[str, list[dict]] = {}
    with PrivateRedis(work / "redis") as redis:
        for label, tree in trees:
            results[label] = [_measure(tree, redis.url, n, rounds, max_s) for n in inflight]
    now = results["now"]
    figures = []
    for res, ref in zip(now, results.get("before", [])):
        figures.append(Figure(
            bench="admission", name=f"admission, {res['inflight']:,} in flight, median", value=res["admit_ms_p50"],
            unit="ms", reference=f"scanning ledger ({_commit(trees[1][1])}), {res['inflight']:,} in flight, median",
            reference_value=ref["admit_ms_p50"], ratio=ratio(res["admit_ms_p50"], ref["admit_ms_p50"], False),
            headline=res["inflight"] in (inflight[0], inflight[-1]),
        ))
    flat = ratio(now[-1]["admit_ms_p50"], now[0]["admit_ms_p50"], higher_is_better=False)
    figures.append(Figure(
        bench="admission", name=f"admission, {now[-1]['inflight']:,} in flight, median", value=now[-1]["admit_ms_p50"],
        unit="ms", reference=f"this ledger, {now[0]['inflight']:,} in flight, median",
        reference_value=now[0]["admit_ms_p50"], ratio=flat, target="flat (≥ 0.5)", met=flat >= 0.5, headline=True,
    ))
    details = ["| ledger | in flight | tasks timed | admit mean ms | p50 ms | p99 ms | Redis commands / task "
               "| redis-server CPU ms / task | fill s |",
               "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, tree in trees:
        name = f"{label} ({_commit(tree)}{'+ working tree' if label == 'now' else ''})"
        for res in results[label]:
            details.append(
                f"| {name} | {res['inflight']:,} | {res['tasks']:,} | {res['admit_ms_mean']:.3f} | "
                f"{res['admit_ms_p50']:.3f} | {res['admit_ms_p99']:.3f} | {res['commands_per_task']:.1f} | "
                f"{res['redis_cpu_ms_per_task']:.3f} | {res['fill_s']:.1f} |")
    details += [
        "",
        f"A task is one `Ledger.admit` of a new key plus one `Ledger.count` settling the oldest reservation, on a "
        f"private redis-server, in flight held constant. Up to {rounds:,} tasks per row, fewer where a row would pass "
        f"{max_s:.0f} s (at least 20). Commands per task count those run inside the Lua scripts (`INFO commandstats`). "
        "The current ledger's rows include both state changes of every task (its reservation grows after 5 ms and "
        "is capped after 10 ms), after the fill's own backlog has drained. The scanning ledger's reservations are "
        "written straight into its hash (admitting 50,000 one by one through it takes O(N²)).",
    ]
    return Section(bench="admission", title="Budget admission against what is in flight", command="",
                   figures=figures, details=details)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    print(json.dumps(_child(Path(a["tree"]), a["url"], a["inflight"], a["rounds"], a["max_s"])))
