"""Re-tokenization: cloud text back into the target's token ids, per core, batched or not.

A cloud worker turns every answer into ids with the target tokenizer (``completion_ids``: the
chat template places the turn, the answer's text is encoded with special-token parsing off). Measured on
the same synthetic answers: one call per answer, as the worker does now, against
``completion_ids_batch`` over batches of answers; both give the same ids. Per core means tokens
per CPU-second of the process (all threads, the tokenizer's own included).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from draftfleet.devtools.samples import _WORDS
from draftfleet.schemas.records import Message
from draftfleet.tokenizer import TargetTokenizer

from .env import TOKENIZER, Figure, Section, ratio

Answer = tuple[list[Message], str, str | None, bool]


def answers(n: int, mean_tokens: float, reasoning_rate: float = 0.3, seed: int = 5) -> list[Answer]:
    """``n`` answers with lognormal lengths (σ 0.6) of about ``mean_tokens`` tokens of code-ish text."""
    rng = random.Random(seed)
    sigma = 0.6
    mu = math.log(mean_tokens / 1.3) - sigma * sigma / 2  # about 1.3 tokens a word here
    out = []
    for i in range(n):
        words = max(1, round(rng.lognormvariate(mu, sigma)))
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        reasoning = " ".join(rng.choice(_WORDS) for _ in range(words // 3)) if rng.random() < reasoning_rate else None
        messages = [Message(role="user", content=f"question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(20)))]
        out.append((messages, text, reasoning, i % 10 != 0))
    return out


def _timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run(work: Path, *, n: int, mean_tokens: float, batch: int, repeats: int = 3) -> Section:
    tok = TargetTokenizer(str(TOKENIZER))
    data = answers(n, mean_tokens)
    bodies = [(r or "") + t for _, t, r, _ in data]  # the answers' text, without the template's markup

    def single() -> list[list[int]]:
        return [tok.completion_ids(m, t, r, s) for m, t, r, s in data]

    def batched() -> list[list[int]]:
        return [ids for i in range(0, n, batch) for ids in tok.completion_ids_batch(data[i:i + batch])]

    def encode_only() -> list[list[int]]:
        return [tok.encode_text(b) for b in bodies]

    paths = {"one at a time": single, f"batched ({batch} a call)": batched, "encode_text alone": encode_only}
    for fn in paths.values():
        fn()  # warm caches
    results: dict[str, tuple[float, float, object]] = {}
    for _ in range(repeats):  # interleaved, so that load from elsewhere hits every path alike
        for name, fn in paths.items():
            run_ = _timed(fn)
            if name not in results or run_[1] < results[name][1]:
                results[name] = run_
    one, bat = results["one at a time"], results[f"batched ({batch} a call)"]
    assert one[2] == bat[2], "batched ids differ from one-at-a-time ids"
    tokens = sum(map(len, one[2]))
    rows = ["| path | wall s | CPU s | tok/s | tok/s per core (per CPU-second) |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, (wall, cpu, _) in results.items():
        rows.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {tokens / wall:,.0f} | {tokens / cpu:,.0f} |")
    per_core = {k: tokens / v[1] for k, v in results.items()}
    wall_tps = {k: tokens / v[0] for k, v in results.items()}
    figures = [
        Figure(bench="retokenize", name=f"completion_ids_batch, {batch} a call, per core", value=per_core[f"batched ({batch} a call)"],
               unit="tok/s/core", reference="completion_ids one at a time, per core", reference_value=per_core["one at a time"],
               ratio=ratio(per_core[f"batched ({batch} a call)"], per_core["one at a time"]), headline=True),
        Figure(bench="retokenize", name=f"completion_ids_batch, {batch} a call, wall", value=wall_tps[f"batched ({batch} a call)"],
               unit="tok/s", reference="completion_ids one at a time, wall", reference_value=wall_tps["one at a time"],
               ratio=ratio(wall_tps[f"batched ({batch} a call)"], wall_tps["one at a time"])),
    ]
    details = [*rows, "",
               f"{n:,} answers, {tokens:,} tokens (mean {tokens / n:,.0f}; 30% with reasoning text), the sample "
               "byte-level BPE tokenizer (600 ids) through transformers' fast tokenizer. `encode_text alone` is "
               "the encode step without the chat-template rendering, one answer at a time. Both paths give the "
               "same ids (checked)."]
    return Section(bench="retokenize", title="Re-tokenization", command="", figures=figures, details=details)
