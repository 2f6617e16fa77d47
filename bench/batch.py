"""The same prompts finished twice: by ``draftfleet worker cloud`` (synchronous chat completions) and by
``draftfleet worker batch`` (the provider's batch API, issue 43), side by side.

Each run gets a fresh store, a fresh private Redis and a fresh emulator with the same prices and the
same answers (the emulator's completions are a function of the messages, so both paths get the same
ids and token counts). The prompts are queued first, the dataset assigned to no kind until the worker
is up; then ``CONFIG RESETSTAT`` and the cloud kind's assignment start the counting, which ends once
every result is stored, every claim released and (batch) every batch closed in the store. One pass
gives everything: ``INFO commandstats`` (every command Redis ran, a Lua script's own included) and a
``MONITOR`` of the same span (which of them a client sent, which a script ran), as bench/redis_cost.py
separates them. MONITOR costs Redis CPU, so no CPU figure is given here (bench/redis_cost.py has them).

The dataset runs as in production: a budget far above what it spends (admission for every prompt) and a
spend cap far above the spend (every request holds its worst cost first). Spend is the ledger's for the
backend (``Ledger.spend_usd``), counted from the provider's reported cost of each stored answer.
The emulator's batch timing is its model time (validating, one request after another, finalizing),
seconds where a real provider takes minutes to hours: wall time here says little about a real one.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import redis as redis_lib

from draftfleet.assign import assign
from draftfleet.ledger import Ledger
from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from .env import (TOKENIZER, EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, ratio, wait_for,
                  write_prompts)
from .redis_cost import CALLS_GOAL, END, OWN, START, Monitor, commandstats

DATASET = "bt"
BACKEND = "cloudy"
MODEL = "bench/chatml-600"
KEY_ENV = "DRAFTFLEET_BENCH_KEY"
KEY = "bench-key-43"
PRICE_IN, PRICE_OUT = 1.0, 2.0  # $/Mtok, the emulator's and the config's alike
MAX_TOKENS = 64
LENGTH = "uniform:20:60"  # answer tokens (end-of-turn included), below max_tokens: nothing truncated
CONCURRENCY = 32  # the cloud worker's requests in flight
POLL_S, COLLECT_S = 0.5, 0.3  # the batch worker's (production: 30 s and 5 s)
# The emulator's model: fast decoding for the synchronous path, a short batch for the batch path (model
# seconds: validating, each request one after another, finalizing).
EMULATOR = dict(single_stream_tps=5000, ceiling_tps=100_000, ttft_s=0, time_scale=1, length=LENGTH,
                price_input_per_mtok=PRICE_IN, price_output_per_mtok=PRICE_OUT, model=MODEL, api_key_env=KEY_ENV)
BATCH_TIMING = dict(batch_validating_s=1.0, batch_request_s=0.01, batch_finalizing_s=1.0, batch_price_factor=0.5)


def script_names() -> dict[str, str]:
    """SHA1 -> name of every Lua script the fleet's modules define (module-level strings that call Redis)."""
    for mod in ("draftfleet.ledger_scripts", "draftfleet.claims", "draftfleet.workers.batch", "draftfleet.workers.leases",
                "draftfleet.workers.runtime", "draftfleet.batches", "draftfleet.queues", "draftfleet.recovery"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    found: dict[str, set[str]] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("draftfleet") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, str) and "redis.call" in value:
                found.setdefault(hashlib.sha1(value.encode()).hexdigest(), set()).add(f"{name.rsplit('.', 1)[-1]}.{attr}")
    return {sha: " = ".join(sorted(names)) for sha, names in found.items()}  # one text, several names


class ScriptMonitor(Monitor):
    """:class:`bench.redis_cost.Monitor`, also telling each script's calls and the commands run inside it
    (a script runs alone: the commands MONITOR shows after its EVALSHA, until the next client command, are its)."""

    def __init__(self, client: redis_lib.Redis):
        self.scripts: Counter[str] = Counter()
        self.inner: Counter[str] = Counter()
        self._names = script_names()
        super().__init__(client)

    def _listen(self) -> None:
        current = "?"
        try:
            with self._client.monitor() as m:
                for line in m.listen():
                    cmd = line["command"].split(" ", 2)
                    name = cmd[0].upper()
                    if name == "ECHO" and START in line["command"]:
                        self.calls.clear()
                        self.scripts.clear()
                        self.inner.clear()
                        self._on = True
                    elif name == "ECHO" and END in line["command"]:
                        return
                    elif self._on and name not in OWN:
                        lua = line.get("client_type") == "lua"
                        self.calls["lua" if lua else "client", name] += 1
                        if name in ("EVALSHA", "EVAL") and not lua and len(cmd) > 1:
                            current = self._names.get(cmd[1].lower(), cmd[1][:10]) if name == "EVALSHA" else "EVAL"
                            self.scripts[current] += 1
                        elif lua:
                            self.inner[current] += 1
        except redis_lib.RedisError:
            return


def _config(folder: Path, prompts: Path, emu_url: str, shape: str | None, batch_size: int) -> Path:
    base = f"{emu_url}/api/v1" if shape == "openrouter" else f"{emu_url}/v1"
    lines = ["[fleet]", f'store = "{folder / "store"}"', f'model = "{MODEL}"', f'tokenizer = "{TOKENIZER}"', "",
             "[[datasets]]", f'name = "{DATASET}"', f'path = "{prompts}"', f"max_tokens = {MAX_TOKENS}",
             f"budget_tokens = {10**12}", "",
             f"[backends.{BACKEND}]", f'base_url = "{base}"', f'model = "{MODEL}"', f'api_key_env = "{KEY_ENV}"',
             f"concurrency = {CONCURRENCY}", f"price_input_per_mtok = {PRICE_IN}", f"price_output_per_mtok = {PRICE_OUT}",
             f"max_spend_usd = {10.0**6}", "request_timeout_s = 60.0", "pause_s = 5.0"]
    if shape is not None:
        lines += [f'batch = "{shape}"', f"batch_size = {batch_size}", f"batch_poll_s = {POLL_S}",
                  f"batch_collect_s = {COLLECT_S}"]
    path = folder / "fleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _wait_batch_ready(w: WorkerProcess, timeout: float = 90.0) -> None:
    """A batch worker is no Celery worker: ready once it logs its start line."""

    def ready() -> bool:
        if w.proc is not None and w.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {w.proc.returncode}: {w.log_path.read_text()[-2000:]}")
        return "batch worker " in w.log_path.read_text(errors="replace")

    wait_for(ready, timeout, f"the batch worker (log: {w.log_path})", 0.05)


def finish(folder: Path, prompts: Path, shape: str | None, batch_size: int) -> dict:
    """Every prompt finished by one worker: ``shape`` None is ``worker cloud``, else ``worker batch``
    on that wire shape. A fresh Redis, emulator and store."""
    fresh_dir(folder)
    os.environ[KEY_ENV] = KEY  # the emulator's key (its --api-key-env) and the worker's
    with PrivateRedis(folder / "redis") as redis, EmulatorProcess(folder, **EMULATOR) as emu:
        httpx.post(emu.url + "/emulator/config", json=BATCH_TIMING, timeout=10.0).raise_for_status()
        r = redis.client()
        config = _config(folder, prompts, emu.url, shape, batch_size)
        cfg = load_config(config)
        store = open_store(cfg)
        app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
        n = enqueue_dataset(cfg, cfg.dataset(DATASET), app, r, store).queued
        app.close()
        assign(r, DATASET, set())  # drained until the worker is up: nothing runs before the counting does
        mon = ScriptMonitor(redis.client())
        kind = "cloud" if shape is None else "batch"
        w = WorkerProcess(folder, config, redis.url, "--backend", BACKEND, kind=kind, env={KEY_ENV: KEY})
        with w:
            (w.wait_ready if shape is None else lambda: _wait_batch_ready(w))()
            time.sleep(0.5)  # the monitor is listening (it has been since before the worker started)
            r.echo(START)
            r.config_resetstat()
            assign(r, DATASET, {"cloud"})
            start = time.perf_counter()
            wait_for(lambda: len(store.keys(DATASET)) >= n and not store.batches(), 600,
                     f"{n} results and the batches closed (worker log {w.log_path})", 0.1)
            wall = time.perf_counter() - start
            # what the last tasks still do once their record is stored (count, release, ack), and the
            # budget's lease going back (up to workers/leases.py's LEASE_S): counted, not timed
            wait_for(lambda: not r.keys("draftfleet:claim:*"), 120, "the claims released", 0.1)
            stats = commandstats(r)
            r.echo(END)
            mon.wait()
        for name in OWN:
            stats.pop(name, None)
        records = list(store.records(DATASET))
        ledger = Ledger(r)
        es = emu.stats()
        totals = ledger.dataset_totals(DATASET)
        return {
            "n": n, "wall_s": wall, "stats": stats, "origin": dict(mon.calls),
            "scripts": dict(mon.scripts), "inner": dict(mon.inner),
            "spend": ledger.spend_usd(BACKEND), "cost_sum": sum(rec.cost_usd for rec in records),
            "stored": len(records), "keys": len({rec.key for rec in records}),
            "prompt_tokens": sum(rec.prompt_tokens for rec in records),
            "completion_tokens": sum(rec.completion_tokens for rec in records),
            "ledger_completion": totals.get("completion_tokens", 0), "paid_tokens": totals.get("paid_tokens", 0),
            "submitted": es["batch"]["submitted"], "batches": es["batch"]["batches"],
            "chat_requests": sum(v for k, v in es["by_endpoint"].items() if "chat/completions" in k),
            "log": w.log_path,
        }


def run(work: Path, *, prompts: int, batch_size: int, shapes: list[str]) -> Section:
    path = write_prompts(work / "prompts.jsonl", prompts, tag="batch")
    paths: list[tuple[str, str | None]] = [("sync (worker cloud)", None)]
    paths += [(f"batch, {s} (worker batch)", s) for s in shapes]
    res = {label: finish(work / (shape or "sync"), path, shape, batch_size) for label, shape in paths}
    sync_label = paths[0][0]
    sync = res[sync_label]
    problems = []
    for label, shape in paths:
        x = res[label]
        if x["stored"] != prompts or x["keys"] != prompts:
            problems.append(f"{label}: {x['stored']} records of {x['keys']} keys for {prompts} prompts")
        if shape is None:
            if x["chat_requests"] != prompts:
                problems.append(f"{label}: {x['chat_requests']} chat requests for {prompts} prompts")
        else:
            sub = x["submitted"]
            if len(sub) != prompts or set(sub.values()) != {1}:
                problems.append(f"{label}: {len(sub)} prompts submitted, times {sorted(set(sub.values()))}")
            if x["chat_requests"]:
                problems.append(f"{label}: {x['chat_requests']} synchronous requests besides the batches")
        if (x["prompt_tokens"], x["completion_tokens"]) != (sync["prompt_tokens"], sync["completion_tokens"]):
            problems.append(f"{label}: tokens {x['prompt_tokens']}/{x['completion_tokens']} against the sync path's "
                            f"{sync['prompt_tokens']}/{sync['completion_tokens']}")
    if problems:
        raise AssertionError("the two paths did not finish the same prompts once each: " + "; ".join(problems))

    per = {}
    for label, _ in paths:
        x = res[label]
        n = max(1, x["stored"])
        by_origin = {o: sum(v for (origin, _), v in x["origin"].items() if origin == o) / n for o in ("client", "lua")}
        per[label] = {"total": sum(c for c, _ in x["stats"].values()) / n, **by_origin,
                      "cmds": {cmd: c / n for cmd, (c, _) in x["stats"].items()},
                      "lua_cmds": {cmd: v / n for (o, cmd), v in x["origin"].items() if o == "lua"},
                      "client_cmds": {cmd: v / n for (o, cmd), v in x["origin"].items() if o == "client"}}
    labels = [label for label, _ in paths]
    rows = ["| | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]

    def row(name: str, cell) -> None:
        rows.append(f"| {name} | " + " | ".join(cell(label) for label in labels) + " |")

    row("results stored (each prompt once)", lambda lb: f"{res[lb]['stored']}")
    row("prompt / completion tokens stored", lambda lb: f"{res[lb]['prompt_tokens']:,} / {res[lb]['completion_tokens']:,}")
    row("requests at the provider", lambda lb: (f"{res[lb]['chat_requests']} chat completions" if lb == sync_label else
                                                f"{res[lb]['batches']} batches, each prompt submitted once"))
    row("spend (ledger)", lambda lb: f"${res[lb]['spend']:.6f}")
    row("spend / sync spend", lambda lb: f"**{res[lb]['spend'] / sync['spend']:.3f}**")
    row("Redis commands per stored result (all, Lua's own included)", lambda lb: f"**{per[lb]['total']:.1f}**")
    row("of which sent by the client (round trips' commands)", lambda lb: f"{per[lb]['client']:.1f}")
    row("of which run inside Lua scripts", lambda lb: f"{per[lb]['lua']:.1f}")
    row("commands / sync's commands", lambda lb: f"{per[lb]['total'] / per[sync_label]['total']:.2f}")
    row("wall time, queue assigned to all stored and batches closed (emulator model time)", lambda lb: f"{res[lb]['wall_s']:.1f} s")
    row("wall time / sync's", lambda lb: f"{res[lb]['wall_s'] / sync['wall_s']:.1f}")

    breakdown = ["", "Redis commands per stored result, by command (commandstats calls; in brackets the MONITOR "
                 "pass's split, client-sent / run by a script):", "",
                 "| command | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    last = labels[-1]
    for cmd in sorted({c for lb in labels for c in per[lb]["cmds"]}, key=lambda c: -per[last]["cmds"].get(c, 0.0)):
        cells = []
        for lb in labels:
            total = per[lb]["cmds"].get(cmd, 0.0)
            cl, lu = per[lb]["client_cmds"].get(cmd, 0.0), per[lb]["lua_cmds"].get(cmd, 0.0)
            cells.append(f"{total:.2f} ({cl:.2f} / {lu:.2f})" if total else "–")
        breakdown.append(f"| {cmd} | " + " | ".join(cells) + " |")

    breakdown += ["", "The scripts per stored result: calls (client round trips) and, in brackets, the commands run "
                  "inside them (MONITOR pass):", "", "| script | " + " | ".join(labels) + " |",
                  "| --- |" + " ---: |" * len(labels)]
    names = {k for lb in labels for k in res[lb]["scripts"]}
    for script in sorted(names, key=lambda k: -res[last]["scripts"].get(k, 0)):
        cells = []
        for lb in labels:
            n = max(1, res[lb]["stored"])
            calls, inner = res[lb]["scripts"].get(script, 0) / n, res[lb]["inner"].get(script, 0) / n
            cells.append(f"{calls:.2f} ({inner:.1f})" if calls else "–")
        breakdown.append(f"| `{script}` | " + " | ".join(cells) + " |")

    figures = []
    for label, shape in paths[1:]:
        x, p = res[label], per[label]
        figures.append(Figure(bench="batch", name=f"Spend for the same {prompts} prompts, {shape} batch API",
                              value=x["spend"], unit="USD", reference="worker cloud (sync), same prompts",
                              reference_value=sync["spend"],
                              ratio=ratio(x["spend"], sync["spend"], higher_is_better=False), target="≈ 2× (half price)",
                              met=abs(x["spend"] / sync["spend"] - 0.5) < 0.02, headline=True))
        figures.append(Figure(bench="batch", name=f"Redis commands per stored result, {shape} batch (Lua's own included)",
                              value=p["total"], unit="commands", reference="worker cloud (sync), same run",
                              reference_value=per[sync_label]["total"],
                              ratio=ratio(p["total"], per[sync_label]["total"], higher_is_better=False),
                              target=f"≤ {CALLS_GOAL} (issue 32)", met=p["total"] <= CALLS_GOAL, headline=True))
        figures.append(Figure(bench="batch", name=f"Client-sent Redis commands per stored result, {shape} batch",
                              value=p["client"], unit="commands", reference="worker cloud (sync), same run",
                              reference_value=per[sync_label]["client"],
                              ratio=ratio(p["client"], per[sync_label]["client"], higher_is_better=False),
                              target=f"≤ {CALLS_GOAL} (issue 32)", met=p["client"] <= CALLS_GOAL, headline=False))
        figures.append(Figure(bench="batch", name=f"Wall time, {shape} batch (emulated model time)", value=x["wall_s"],
                              unit="s", reference="worker cloud (sync), same run", reference_value=sync["wall_s"],
                              ratio=ratio(x["wall_s"], sync["wall_s"], higher_is_better=False), headline=False))
    details = rows + breakdown
    over = [(label, per[label]) for label, _ in paths if per[label]["total"] > CALLS_GOAL]
    if over:
        details += ["", "**Over the fleet's budget of about a dozen Redis commands per result (issue 32's bound, "
                    f"{CALLS_GOAL}):** " + "; ".join(f"{label} {p['total']:.1f} ({p['client']:.1f} sent by the client, "
                                                      f"{p['lua']:.1f} inside scripts)" for label, p in over) + ". "
                    "Where the batch path's go, per result: three scripts, each one round trip, run once per "
                    "prompt when it is collected and recorded (`CLAIM_ADMIT`, `SPEND_HOLD`, and `BATCH_TAKE`: the "
                    "grant moved to the batch's hold, the reservation and the claim let go), about 28 commands "
                    "inside them, and kombu's unacked bookkeeping of each message (`basic_get` and its ack: RPOP, "
                    "two MULTI/EXEC with ZADD/HSET and ZREM/HDEL, 9 commands). The answers are counted 256 at a "
                    "time (`COUNT_BATCH`: the totals once a step, each grant's mark and spend hold let go in the "
                    "same call; before, `COUNT_ONCE` and `SPEND_RELEASE` for each answer, 65.5 commands a result in "
                    "all). Admission could be paid per batch too: one admission and spend hold for the batch's "
                    "prompts in one script (or a lease, workers/leases.py, as `worker cloud` admits), the grants "
                    "moved to the batch hold in the same call. The synchronous "
                    "cloud path under a cap counts a paid answer whose hold covers its cost in the tally's batch "
                    "(workers/tally.py), its hold let go in the same `COUNT_BATCH`; what is left over the bound is "
                    "the hold itself (`SPEND_HOLD`, one round trip a request). The GPU workers in "
                    "[the Redis section](#redis) have no spend to hold."]
    details += ["", f"{prompts} prompts (max_tokens {MAX_TOKENS}, answers of {LENGTH.replace('uniform:', '').replace(':', '–')} "
                f"tokens), finished once by one `draftfleet worker cloud` ({CONCURRENCY} in flight) and once by one "
                f"`draftfleet worker batch` per wire shape (batches of {batch_size}, batch_poll_s {POLL_S}, "
                f"batch_collect_s {COLLECT_S}), each on a fresh store, private Redis and emulator priced at "
                f"${PRICE_IN:g}/${PRICE_OUT:g} per Mtok (batch price factor {BATCH_TIMING['batch_price_factor']}). "
                "The dataset has a budget far above what it spends and the backend a spend cap far above its "
                "spend, as in production: every prompt is admitted and holds its worst cost. Checked: every prompt "
                "stored once, the same tokens on each path, each batched prompt submitted once (the emulator's "
                "`stats()['batch']['submitted']`), no synchronous request on the batch path. Commands are counted "
                "from `CONFIG RESETSTAT` (worker up, queue full) to the last result stored, claim released and "
                "batch closed: the worker's idle loops (assignment and heartbeat polls, the batch worker's 1 s "
                "cycle) are in them, as in bench/redis_cost.py.",
                f"Wall time is the emulator's model time: a batch validates {BATCH_TIMING['batch_validating_s']:g} s, "
                f"answers a request every {BATCH_TIMING['batch_request_s']:g} s and finalizes "
                f"{BATCH_TIMING['batch_finalizing_s']:g} s, where a real provider takes minutes to 24 hours; the "
                "ratio says how the worker's own collecting and polling compare with a synchronous drain, not how "
                "long a real batch takes."]
    return Section(bench="batch", title="Batch", command="",
                   figures=figures, details=details)
