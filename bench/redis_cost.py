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

A last scenario measures ``draftfleet worker cloud`` the same way: one worker on a priced backend
with a spend cap far above what it spends (every paid request holds its worst cost first, as in
production), against an emulator that answers at once at the same prices (bench/batch.py's setup).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import Counter
from pathlib import Path

import redis as redis_lib

from draftfleet.assign import assign
from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from .env import (EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, ratio, wait_for, write_config,
                  write_prompts)
from .s3_count import CountingProxy

DATASET = "rc"
# Issue 32's bound: a stored result costs at most this many Redis commands and this much Redis CPU.
CALLS_GOAL, USEC_GOAL = 15, 120
# What the bench itself asks of Redis while it watches (never a worker's): left out of the figures.
OWN = {"CONFIG", "INFO", "KEYS", "ECHO", "MONITOR", "CLIENT"}
START, END = "draftfleet-bench-start", "draftfleet-bench-end"


class Monitor:
    """``MONITOR`` on the private Redis: every command, by origin: sent by a client (a round trip's
    share, what a worker asks) or run by a Lua script. Counted between the ``ECHO`` the bench sends
    with its ``CONFIG RESETSTAT`` and the one that ends the run, so the two passes' spans are the same. (MONITOR
    costs Redis CPU of its own: the CPU figures come from a pass without it.)"""

    def __init__(self, client: redis_lib.Redis):
        self.calls: Counter[tuple[str, str]] = Counter()
        self._client = client
        self._on = False
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        try:
            with self._client.monitor() as m:
                for line in m.listen():
                    cmd = line["command"].split(" ", 2)
                    name = cmd[0].upper()
                    if name == "ECHO" and START in line["command"]:  # MONITOR leaves CONFIG out
                        self.calls.clear()
                        self._on = True
                    elif name == "ECHO" and END in line["command"]:
                        return
                    elif self._on and name not in OWN:
                        self.calls["lua" if line.get("client_type") == "lua" else "client", name] += 1
        except redis_lib.RedisError:
            return

    def wait(self, timeout_s: float = 30.0) -> None:
        self._thread.join(timeout_s)


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


# The cloud scenario: one ``worker cloud`` on a priced backend with a spend cap far above its spend.
CLOUD_BACKEND, CLOUD_KEY_ENV, CLOUD_KEY = "cloudy", "DRAFTFLEET_BENCH_KEY", "bench-key-32"
CLOUD_PRICES = (1.0, 2.0)  # $/Mtok in and out, the emulator's and the config's alike
CLOUD_CAP_USD = 10.0**6


def cloud_emulator(folder: Path) -> EmulatorProcess:
    """An emulator that answers at once and bills at :data:`CLOUD_PRICES` (its key in ``CLOUD_KEY_ENV``)."""
    os.environ[CLOUD_KEY_ENV] = CLOUD_KEY  # the emulator's --api-key-env reads it
    return EmulatorProcess(folder, time_scale=0, length="uniform:20:60", price_input_per_mtok=CLOUD_PRICES[0],
                           price_output_per_mtok=CLOUD_PRICES[1], api_key_env=CLOUD_KEY_ENV)


def _cloud_config(folder: Path, prompts: Path, emu_url: str, inflight: int, budget: bool) -> Path:
    """A fleet.toml with one cloud backend on the emulator: priced, capped far above its spend."""
    from .env import TOKENIZER

    model = "bench/chatml-600"
    lines = ["[fleet]", f'store = "{folder / "store"}"', f'model = "{model}"', f'tokenizer = "{TOKENIZER}"', "",
             "[[datasets]]", f'name = "{DATASET}"', f'path = "{prompts}"', "max_tokens = 64"]
    if budget:
        lines.append(f"budget_tokens = {10**12}")
    lines += ["", f"[backends.{CLOUD_BACKEND}]", f'base_url = "{emu_url}/v1"', f'model = "{model}"',
              f'api_key_env = "{CLOUD_KEY_ENV}"', f"concurrency = {inflight}",
              f"price_input_per_mtok = {CLOUD_PRICES[0]}", f"price_output_per_mtok = {CLOUD_PRICES[1]}",
              f"max_spend_usd = {CLOUD_CAP_USD}", "request_timeout_s = 60.0", "pause_s = 5.0", ""]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fleet.toml"
    path.write_text("\n".join(lines))
    return path


def drain(folder: Path, redis: PrivateRedis, emu: EmulatorProcess, prompts: Path, workers: int,
          inflight: int, monitor: bool = False, budget: bool = True, bucket: tuple[str, CountingProxy] | None = None,
          cloud: bool = False) -> dict:
    """Queue every prompt, reset Redis's statistics, let ``workers`` processes drain the queue
    (``monitor``: with the commands counted by origin, see :class:`Monitor`, and by script; ``budget``:
    the dataset has one, far above what it spends, so admission runs for every task; ``bucket``: the
    store is that ``s3://`` location, which the workers reach through the counting proxy; ``cloud``:
    ``worker cloud`` processes on a priced, capped backend, ``emu`` being :func:`cloud_emulator`)."""
    fresh_dir(folder)
    r = redis.client()
    r.flushall()
    dataset = {"name": DATASET, "path": str(prompts), "max_tokens": 64}
    if budget:
        dataset["budget_tokens"] = 10**12
    if cloud:
        config = _cloud_config(folder, prompts, emu.url, inflight, budget)
    else:
        config = write_config(folder, [dataset], emulator_url=emu.url, inflight=inflight)
    env = {}
    if bucket is not None:
        location, proxy = bucket
        config.write_text(config.read_text().replace(f'store = "{folder / "store"}"', f'store = "{location}"'))
        env = {"AWS_ENDPOINT_URL": proxy.endpoint}
    cfg = load_config(config)
    store = open_store(cfg)
    app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
    n = enqueue_dataset(cfg, cfg.dataset(DATASET), app, r, store).queued
    app.close()
    assign(r, DATASET, set())  # drained until every worker is up: none starts before the counting does
    if monitor:  # on before the reset it counts from
        from .batch import ScriptMonitor  # (bench/batch.py imports this module)

        mon = ScriptMonitor(redis.client())
    else:
        mon = None
    if cloud:
        kind, args, env = "cloud", ("--backend", CLOUD_BACKEND), {CLOUD_KEY_ENV: CLOUD_KEY}
    else:
        kind, args = "gpu", ("--url", emu.url, "--inflight", str(inflight))
    procs = [WorkerProcess(folder, config, redis.url, *args, kind=kind, env=env) for _ in range(workers)]
    for p in procs:
        p.__enter__()
    try:
        for p in procs:
            p.wait_ready()
        r.echo(START)
        r.config_resetstat()
        if bucket is not None:
            bucket[1].reset()
        assign(r, DATASET, {kind})  # every worker takes the queue on its next poll of the assignment
        cpu0 = _cpu(r)
        early = len(store.keys(DATASET))  # (none: the dataset was drained until now)
        start = time.perf_counter()
        wait_for(lambda: len(store.keys(DATASET)) >= n, 900, f"{n} results (worker logs in {folder})", 0.2)
        # what the last tasks still do after their record is stored (count, release, ack)
        # (and a lease's claim, which goes back within workers/leases.py's LEASE_S)
        wait_for(lambda: not r.keys("draftfleet:claim:*"), 60, "the claims released", 0.1)
        wall = time.perf_counter() - start
        cpu = _cpu(r) - cpu0
        stats = commandstats(r)
        requests = dict(bucket[1].counts) if bucket is not None else None
        r.echo(END)
        if mon is not None:
            mon.wait()
    finally:
        for p in procs:
            p.stop()
    for name in OWN:
        stats.pop(name, None)
    out = {"n": max(1, n - early), "wall_s": wall, "stats": stats, "cpu_s": cpu,
           "origin": dict(mon.calls) if mon is not None else None, "bucket": requests,
           "scripts": dict(mon.scripts) if mon is not None else None,
           "inner": dict(mon.inner) if mon is not None else None}
    if cloud:
        from draftfleet.ledger import Ledger

        ledger = Ledger(r)
        out["spend_usd"] = ledger.spend_usd(CLOUD_BACKEND)
        out["held_usd"] = ledger.spend_held_usd(CLOUD_BACKEND)
        out["cost_sum"] = sum(rec.cost_usd for rec in store.records(DATASET))
    return out


def bucket_requests(work: Path, redis: PrivateRedis, emu: EmulatorProcess, prompts: Path, inflight: int) -> dict:
    """The requests one worker sends the bucket per stored result, by method, on a budgeted dataset
    (a private SeaweedFS; the bench's own polling of the store goes around the counting proxy)."""
    from draftfleet.devtools.seaweedfs import SeaweedFS

    server = SeaweedFS(work / "seaweedfs")
    server.start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    proxy = CountingProxy(server.ports["s3"])
    try:
        res = drain(work / "bucket", redis, emu, prompts, 1, inflight,
                    bucket=(f"s3://{server.bucket()}/fleet", proxy))
    finally:
        proxy.close()
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {method: n / res["n"] for method, n in sorted(res["bucket"].items())}


def scripts(redis: PrivateRedis, n: int = 2000) -> list[tuple[str, float]]:
    """Each step a stored result takes in the ledger, alone on the quiet private Redis: its
    redis-server CPU per call (``INFO cpu``), beside a PING (what any round trip costs)."""
    from draftfleet import redis_keys as rk
    from draftfleet.ledger import Ledger
    from draftfleet.schemas.records import Message, ResponseRecord, Usage

    def sample_record(key: str) -> ResponseRecord:
        return ResponseRecord(
            key=key, dataset=DATASET, source="bench:1", settings_id="s", messages=[Message(role="user", content="q")],
            system_prompt_used=False, text="t", output_ids=[1] * 40, prompt_tokens=5, completion_tokens=40,
            finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu", model="m", token_source="exact",
            usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=0.4, attempts=1, worker="w",
            created_at=time.time())

    r = redis.client()
    r.flushall()
    r.set(rk.COUNTERS_BUILT, 1)
    ledger = Ledger(r)
    keys = [secrets.token_hex(32) for _ in range(n)]
    tokens = {k: f"bench:1:{secrets.token_hex(6)}" for k in keys}
    records = {k: sample_record(k) for k in keys}
    steps = [
        ("PING (one round trip, nothing done)", lambda k: r.ping()),
        ("claim and admission (CLAIM_ADMIT)",
         lambda k: ledger.claim_admit(DATASET, k, tokens[k], 120, 10**12, 64)),
        ("a result counted alone (COUNT_BATCH of 1)", lambda k: ledger.count_batch([(records[k], tokens[k])])),
        ("a lease of 64 slots (LEASE), once per 64 tasks",
         lambda k: ledger.lease(DATASET, rk.LEASE_PREFIX + k[:16], tokens[k], 120, 10**12, 64, 64)),
    ]
    out = []
    for name, step in steps:
        c0 = _cpu(r)
        for k in keys:
            step(k)
        out.append((name, 1e6 * (_cpu(r) - c0) / n))
    batch = 32
    for k in keys:  # claimed and admitted again: the batch has claims to release and reservations to settle
        r.set(rk.claim(DATASET, k), tokens[k])
    r.delete(rk.counted_set(DATASET))
    c0 = _cpu(r)
    for i in range(0, n, batch):
        ledger.count_batch([(records[k], tokens[k]) for k in keys[i:i + batch]])
    out.append((f"a result counted in a batch of {batch} (COUNT_BATCH, per result)", 1e6 * (_cpu(r) - c0) / n))
    return out


SCENARIOS = (("no budget", False), ("budget", True))
CLOUD = "cloud, capped"  # one ``worker cloud``, a spend cap and a budget far above the spend


def run(work: Path, *, tasks: int, workers: list[int], inflight: int, cloud: bool = True) -> Section:
    prompts = write_prompts(work / "prompts.jsonl", tasks, tag="rc")
    runs = [(label, budget, w) for label, budget in SCENARIOS for w in workers]
    if cloud:
        runs.append((CLOUD, True, 1))
    results: dict[tuple, dict] = {}
    origins: dict[tuple, dict] = {}
    by_script: dict[tuple, dict] = {}
    with (PrivateRedis(work / "redis") as redis, EmulatorProcess(work, time_scale=0, length="uniform:20:60") as emu,
          cloud_emulator(work / "cloud-emulator") as cloud_emu):
        def one(folder: str, label: str, budget: bool, w: int, monitor: bool) -> dict:
            on_cloud = label == CLOUD
            return drain(work / folder, redis, cloud_emu if on_cloud else emu, prompts, w, inflight,
                         monitor=monitor, budget=budget, cloud=on_cloud)

        for label, budget, w in runs:
            results[label, w] = one(f"w{w}{budget}{label == CLOUD}", label, budget, w, False)
        for label, budget, w in runs:  # again with MONITOR on: the commands by origin (its CPU is not the figures')
            seen = one(f"m{w}{budget}{label == CLOUD}", label, budget, w, True)
            n = max(1, seen["n"])
            origins[label, w] = {o: sum(v for (origin, _), v in seen["origin"].items() if origin == o)
                                 / n for o in ("client", "lua")}
            by_script[label, w] = {k: (c / n, seen["inner"].get(k, 0) / n) for k, c in seen["scripts"].items()}
            if label == CLOUD:
                results[label, w]["spend"] = (seen["spend_usd"], seen["cost_sum"], seen["held_usd"])
        alone = scripts(redis)
        on_bucket = bucket_requests(work, redis, emu, prompts, inflight)
    cols = [(label, w) for label, _, w in runs]
    per = {c: {cmd: (calls / res["n"], usec / res["n"]) for cmd, (calls, usec) in res["stats"].items()}
           for c, res in results.items()}
    # commands: every one Redis ran, a script's own included (as INFO commandstats counts them);
    # µs in commands: commandstats' usec summed, as issue 32 measured it (a script's usec holds
    # those of the commands it ran, so they count twice); CPU: the process's own, round trips and all
    totals = {c: (sum(n for n, _ in per[c].values()), sum(u for _, u in per[c].values()),
                  1e6 * results[c]["cpu_s"] / results[c]["n"]) for c in cols}
    name = {c: f"{c[0]}, {c[1]} worker{'s' if c[1] > 1 else ''}" for c in cols}
    details = ["| per stored result | " + " | ".join(name[c] for c in cols) + " |", "| --- |" + " ---: |" * len(cols)]
    details.append("| Redis commands | " + " | ".join(f"**{totals[c][0]:.1f}**" for c in cols) + " |")
    details.append("| of which sent by a client (MONITOR pass) | "
                   + " | ".join(f"{origins[c]['client']:.1f}" for c in cols) + " |")
    details.append("| of which run inside a Lua script (MONITOR pass) | "
                   + " | ".join(f"{origins[c]['lua']:.1f}" for c in cols) + " |")
    details.append("| µs in commands (commandstats usec, summed) | "
                   + " | ".join(f"**{totals[c][1]:.0f} µs**" for c in cols) + " |")
    details.append("| redis-server CPU (INFO cpu) | " + " | ".join(f"{totals[c][2]:.0f} µs" for c in cols) + " |")
    details.append("| (command: calls and commandstats µs) | " + " | ".join("" for _ in cols) + " |")
    last = cols[-1]
    for cmd in sorted({k for c in cols for k in per[c]}, key=lambda k: -per[last].get(k, (0, 0))[0]):
        details.append(f"| {cmd} | " + " | ".join(
            f"{per[c].get(cmd, (0, 0))[0]:.2f}, {per[c].get(cmd, (0, 0))[1]:.0f} µs" for c in cols) + " |")
    figures = []
    for c in cols:
        calls, usec, cpu = totals[c]
        figures.append(Figure(bench="redis", name=f"Redis commands per stored result, {name[c]}", value=calls,
                              unit="commands", reference=f"issue 32's bound ({CALLS_GOAL})",
                              reference_value=CALLS_GOAL, ratio=ratio(calls, CALLS_GOAL, higher_is_better=False),
                              headline=c in (cols[0], ("budget", cols[0][1]))))
        figures.append(Figure(bench="redis", name=f"µs in Redis commands per stored result, {name[c]}", value=usec,
                              unit="µs", reference=f"issue 32's bound ({USEC_GOAL} µs)", reference_value=USEC_GOAL,
                              ratio=ratio(usec, USEC_GOAL, higher_is_better=False), headline=False))
        figures.append(Figure(bench="redis", name=f"Client calls per stored result, {name[c]}",
                              value=origins[c]["client"], unit="calls", reference=f"issue 32's bound ({CALLS_GOAL})",
                              reference_value=CALLS_GOAL,
                              ratio=ratio(origins[c]["client"], CALLS_GOAL, higher_is_better=False), headline=False))
    total = sum(on_bucket.values())
    details += ["", "The scripts per stored result: calls (client round trips) and, in brackets, the commands run "
                "inside them (MONITOR pass):", "", "| script | " + " | ".join(name[c] for c in cols) + " |",
                "| --- |" + " ---: |" * len(cols)]
    for script in sorted({k for c in cols for k in by_script[c]}, key=lambda k: -by_script[last].get(k, (0, 0))[1]):
        details.append(f"| `{script}` | " + " | ".join(
            (f"{by_script[c][script][0]:.2f} ({by_script[c][script][1]:.1f})" if script in by_script[c] else "–")
            for c in cols) + " |")
    if cloud:
        spent, billed, held = results[CLOUD, 1]["spend"]
        details += ["", f"The cloud scenario: one `draftfleet worker cloud` ({inflight} requests in flight) on a backend "
                    f"priced at ${CLOUD_PRICES[0]:g}/${CLOUD_PRICES[1]:g} per Mtok with max_spend_usd far above its "
                    "spend (every paid request holds its worst cost first, `SPEND_HOLD`), against an emulator that "
                    f"answers at once at the same prices; the budget as above. Its MONITOR pass's spend: "
                    f"${spent:.6f} in the ledger for ${billed:.6f} in the stored records, ${held:.6f} still held."]
    figures.append(Figure(bench="redis", name="Bucket requests per stored result, budget, 1 worker", value=total,
                          unit="requests", reference="issue 32's bound (2)", reference_value=2,
                          ratio=ratio(total, 2, higher_is_better=False), headline=False))
    details += ["", "On a bucket (a private SeaweedFS behind a counting proxy; budget, 1 worker), requests per "
                "stored result: " + ", ".join(f"{m} {v:.2f}" for m, v in on_bucket.items()) + f" ({total:.2f} in all)."]
    details += ["", "Each ledger step alone, on the quiet private Redis (redis-server CPU per call):", "",
                "| step | µs |", "| --- | ---: |"]
    details += [f"| {step} | {usec:.1f} |" for step, usec in alone]
    cpu = totals[cols[0]][2]
    budget_cpu = max(totals[c][2] for c in cols if c[0] == "budget")
    details += ["", f"{tasks} prompts queued first, then drained by {', '.join(map(str, workers))} `draftfleet worker "
                f"gpu` process(es) at --inflight {inflight}, against an emulator that answers at once (20–60 "
                "tokens), on a dataset without a budget (as issue 32 measured) and with one far above what it "
                "spends (admission runs for every task: through the worker's leases, workers/leases.py, as on a "
                "budget that is not near its end). `INFO commandstats` after `CONFIG RESETSTAT` (taken once "
                "the workers were ready), divided by the results stored since: what the workers asked, their idle "
                "loops included. Commands run by a script count apiece. The redis-server CPU moves with the box's "
                "load; the commands are exact.",
                f"The ceiling: at {cpu:.0f} µs of redis-server CPU a result (no budget, round trips and all), one "
                f"Redis core serves about {1e6 / cpu:,.0f} results/s; GPUs making 25 results/s each (5,000 tok/s, "
                f"200-token answers) fill it at about {1e6 / cpu / 25:,.0f} GPUs; on a budgeted dataset "
                f"({budget_cpu:.0f} µs, the larger of its runs) about {1e6 / budget_cpu:,.0f} results/s, "
                f"{1e6 / budget_cpu / 25:,.0f} such GPUs."]
    return Section(bench="redis", title="The shared Redis: commands and CPU per stored result", command="",
                   figures=figures, details=details)
