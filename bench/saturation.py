"""GPU-worker saturation: does one worker keep an SGLang server as full as a bare client can?

Against one emulator (continuous batching: a request alone decodes at ``single_stream_tps``, the
batch shares ``ceiling_tps``), in one run: (a) a direct asyncio httpx client holding C requests
open, the ceiling; (b) the fleet: prompts enqueued through Redis, one ``draftfleet worker gpu
--inflight C`` process, results stored; (c) the same worker with ``--inflight 1``, the seed's trap.
Both sides send the same prompts as the same ``input_ids``, so the emulator draws the same lengths.

Throughput is measured in a steady window: after ``warmup`` seconds, the tokens of responses
received (direct) or stored (fleet) between the first and the last completion inside the next
``window`` seconds, divided by the time between them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from draftfleet.producer.enqueue import enqueue_dataset
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import Message
from draftfleet.store import Store, open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.app import make_app

from .env import TOKENIZER, EmulatorProcess, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, ratio, write_config, write_prompts

MAX_TOKENS = 2048
DATASET = "sat"


class Run(msgspec.Struct, kw_only=True):
    """What one side did: completions as (seconds since its start, tokens), and its costs."""

    label: str
    completions: list[tuple[float, int]]
    first_s: float  # from the start (first send, or the enqueue call) to the first result
    cpu_s: float = 0.0  # CPU of the client, or of the worker process, over the whole run
    extra: dict[str, float] = {}

    def steady_tps(self, warmup: float, window: float) -> tuple[float, int]:
        """Tokens per second between the first and last completion in [warmup, warmup + window]."""
        inside = sorted(c for c in self.completions if warmup <= c[0] <= warmup + window)
        if len(inside) < 2:
            return 0.0, len(inside)
        span = inside[-1][0] - inside[0][0]
        return sum(n for _, n in inside[1:]) / span, len(inside) - 1

    def cpu_ms_per_result(self) -> float:
        return 1000 * self.cpu_s / max(1, len(self.completions))


def _bodies(tok: TargetTokenizer, prompts: Path) -> list[bytes]:
    """The exact ``/generate`` bodies the GPU worker sends for these prompts."""
    out = []
    for line in prompts.read_text().splitlines():
        messages = [Message(m["role"], m["content"]) for m in json.loads(line)["messages"]]
        out.append(msgspec.json.encode({
            "input_ids": tok.prompt_ids(messages),
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 1.0,
                                "stop_token_ids": [tok.eot_id]},
        }))
    return out


def sglang_ids(body: dict) -> list[int]:
    return body["output_ids"]


async def _direct(url: str, bodies: list[bytes], concurrency: int, seconds: float, path: str,
                  ids: Callable[[dict], list[int]]) -> Run:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    completions: list[tuple[float, int]] = []
    feed = iter(bodies)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:
        start = time.monotonic()

        async def one() -> None:
            for body in feed:
                resp = await client.post(path, content=body, headers={"content-type": "application/json"})
                resp.raise_for_status()
                completions.append((time.monotonic() - start, len(ids(msgspec.json.decode(resp.content)))))

        cpu0 = time.process_time()
        tasks = [asyncio.create_task(one()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        while not completions and pending and time.monotonic() - start < seconds + 60:
            # an engine slower than the window (a loaded CPU box) has not answered once: wait for its
            # first answer, as the fleet side waits for its first stored result
            await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu0
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            t.result()  # surface errors
    if not completions:
        raise TimeoutError(f"no answer from {url}{path} within {seconds + 60:.0f} s")
    return Run(label=f"direct C={concurrency}", completions=completions, first_s=min(c[0] for c in completions), cpu_s=cpu)


def direct(url: str, bodies: list[bytes], concurrency: int, seconds: float, path: str = "/generate",
           ids: Callable[[dict], list[int]] = sglang_ids) -> Run:
    """(a) A bare asyncio httpx client holding ``concurrency`` requests open for ``seconds``: it
    posts ``bodies`` to ``path`` and counts the generated ids that ``ids`` finds in each answer."""
    return asyncio.run(_direct(url, bodies, concurrency, seconds, path, ids))


def _watch_first(store: Store, first: list[float], timeout: float = 60.0) -> None:
    """Note when the store's first result appears (polled every 2 ms, beside the enqueue call)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.keys(DATASET):
            first.append(time.monotonic())
            return
        time.sleep(0.002)


def fleet(folder: Path, redis: PrivateRedis, url: str, prompts: Path, inflight: int, seconds: float, *,
          engine: str = "sglang", dataset: dict | None = None, beside: Callable[[], object] | None = None) -> Run:
    """(b)/(c) Enqueue the prompts (worker already waiting), run for ``seconds``, read the store.
    ``dataset`` overrides the dataset's settings (default: ``MAX_TOKENS``, the default temperature);
    ``beside`` runs in a thread from the enqueue call on (a direct client sharing the server)."""
    fresh_dir(folder)
    redis.client().flushall()
    settings = {"name": DATASET, "path": str(prompts), "max_tokens": MAX_TOKENS, **(dataset or {})}
    config = write_config(folder, [settings], emulator_url=url, inflight=inflight, engine=engine)
    cfg = load_config(config)
    store = open_store(cfg)
    app = make_app(redis.url, cfg.fleet.visibility_timeout_s)
    with WorkerProcess(folder, config, redis.url, "--engine", engine, "--url", url, "--inflight", str(inflight)) as worker:
        worker.wait_ready()
        cpu0 = worker.cpu_seconds()
        first: list[float] = []
        watcher = threading.Thread(target=_watch_first, args=(store, first), daemon=True)
        start_wall, start = time.time(), time.monotonic()
        watcher.start()
        side = threading.Thread(target=beside, daemon=True) if beside else None
        if side:
            side.start()
        summary = enqueue_dataset(cfg, cfg.dataset(DATASET), app, redis.client(), store)
        enqueue_s = time.monotonic() - start
        watcher.join(60)
        if not first:
            raise TimeoutError(f"no result stored within 60 s (worker log: {worker.log_path})")
        first_s = first[0] - start
        time.sleep(max(0.0, seconds - (time.monotonic() - start)))
        cpu = worker.cpu_seconds() - cpu0
    if side:
        side.join()
    app.close()
    completions = [(rec.created_at - start_wall, rec.completion_tokens) for rec in store.records(DATASET)]
    return Run(label=f"fleet --inflight {inflight}", completions=completions, first_s=first_s, cpu_s=cpu,
               extra={"enqueue_s": enqueue_s, "queued": summary.queued})


def run(work: Path, *, concurrency: list[int], warmup: float, window: float, single_stream_tps: float,
        ceiling_tps: float, length: str, trap: bool = True) -> Section:
    seconds = warmup + window
    mean = float(length.split(":")[1]) if length.split(":")[0] in ("lognormal", "fixed") else 200.0
    n_prompts = int(1.3 * seconds * ceiling_tps / mean) + 2 * max(concurrency)
    prompts = write_prompts(work / "prompts.jsonl", n_prompts, tag="sat")
    bodies = _bodies(TargetTokenizer(str(TOKENIZER)), prompts)
    runs: dict[str, Run] = {}
    with PrivateRedis(work / "redis") as redis, EmulatorProcess(
        work, single_stream_tps=single_stream_tps, ceiling_tps=ceiling_tps, length=length
    ) as emu:
        for c in concurrency:
            emu.settle()
            runs[f"direct{c}"] = direct(emu.url, bodies, c, seconds)
            emu.settle()
            runs[f"fleet{c}"] = fleet(work / f"fleet{c}", redis, emu.url, prompts, c, seconds)
        if trap:
            emu.settle()
            runs["trap"] = fleet(work / "trap", redis, emu.url, prompts, 1, seconds)

    figures: list[Figure] = []
    rows = ["| run | steady tok/s | results in window | first result (s) | CPU ms per result |",
            "| --- | ---: | ---: | ---: | ---: |"]
    tps: dict[str, float] = {}
    for key, r in runs.items():
        tps[key], n = r.steady_tps(warmup, window)
        rows.append(f"| {r.label} | {tps[key]:,.0f} | {n} | {r.first_s:.2f} | {r.cpu_ms_per_result():.1f} |")
    for c in concurrency:
        d, f = tps[f"direct{c}"], tps[f"fleet{c}"]
        figures.append(Figure(bench="saturation", name=f"GPU worker, --inflight {c}", value=f, unit="tok/s",
                              reference=f"direct asyncio httpx client, {c} open", reference_value=d,
                              ratio=ratio(f, d), target="≥ 0.9", met=ratio(f, d) >= 0.9, headline=True))
    top = max(concurrency)
    if trap:
        t = tps["trap"]
        figures.append(Figure(bench="saturation", name=f"GPU worker --inflight {top} over --inflight 1", value=tps[f"fleet{top}"],
                              unit="tok/s", reference="same worker, --inflight 1 (the seed's trap)", reference_value=t,
                              ratio=ratio(tps[f"fleet{top}"], t), target="≥ 30", met=ratio(tps[f"fleet{top}"], t) >= 30,
                              headline=True))
    for c in concurrency:
        fr, dr = runs[f"fleet{c}"], runs[f"direct{c}"]
        figures.append(Figure(bench="saturation", name=f"enqueue → first stored result, --inflight {c}", value=fr.first_s,
                              unit="s", reference=f"direct client's first response, {c} open", reference_value=dr.first_s,
                              ratio=ratio(fr.first_s, dr.first_s, higher_is_better=False), headline=True))
    enq = [f"{r.label}: {r.extra['queued']:.0f} prompts enqueued in {r.extra['enqueue_s']:.2f} s"
           for r in runs.values() if "queued" in r.extra]
    details = [*rows, "",
               f"Emulator: single stream {single_stream_tps:g} tok/s, ceiling {ceiling_tps:g} tok/s, completion length "
               f"`{length}`, max_new_tokens {MAX_TOKENS}; {n_prompts} prompts. "
               f"Steady window: {warmup:g} s warm-up, then {window:g} s. Fleet: {'; '.join(enq)} "
               "(the worker was already waiting; the first-result time counts from the enqueue call). "
               "CPU per result: the client process for direct runs, the worker process for the fleet."]
    return Section(bench="saturation", title="GPU-worker saturation", command="", figures=figures, details=details)
