"""Inventory: how fast the pivot question ("what do we have?") is answered from the store.

Synthetic datasets shaped like the seed's B3 (1,746 responses, 5.7M tokens with output ids) and a
large one, written both as a draftfleet store (one record per key) and as the seed's
``raw_responses.jsonl``. Timed, each the best of ``repeats`` with the page cache warm:
``draftfleet inventory`` (``run_inventory``, validating against the tokenizer); the store read
alone (every record decoded and type-checked by msgspec, tokens summed); the seed's own loop
(``json.loads`` per line, ``completion_tokens`` or ``len(output_ids)``); and ``cat`` of the
same bytes, both forms.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import open_store
from draftfleet.tokenizer import TargetTokenizer

from .env import TOKENIZER, Figure, Section, fresh_dir, ratio

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(ResponseRecord).decode


def build(folder: Path, dataset: str, responses: int, mean_tokens: float, tok: TargetTokenizer, seed: int = 3) -> tuple[Path, Path, int]:
    """Write ``responses`` records (lognormal lengths around ``mean_tokens``) as a store and as JSONL.

    Output ids are slices of one long encoded text, so they are real ids of the tokenizer and the
    text is their decoding; stopped responses end with the end-of-turn id. Returns the store root,
    the JSONL path and the total of completion tokens.
    """
    from draftfleet.devtools.samples import _corpus

    rng = random.Random(seed)
    stream = tok.encode_text(" ".join(_corpus(4000, seed=seed)))
    sigma = 0.6
    mu = math.log(mean_tokens) - sigma * sigma / 2
    lengths = [max(4, min(len(stream) - 1, round(rng.lognormvariate(mu, sigma)))) for _ in range(responses)]
    store = open_store(folder / "store")
    jsonl = folder / "raw_responses.jsonl"
    total = 0
    created: set[str] = set()
    with open(jsonl, "wb") as fh:
        for start in range(0, responses, 1000):
            chunk = []
            for i in range(start, min(responses, start + 1000)):
                n = lengths[i]
                off = rng.randrange(0, len(stream) - n)
                chunk.append((i, stream[off:off + n - 1]))
            texts = tok._tok.batch_decode([ids for _, ids in chunk], skip_special_tokens=True)
            for (i, ids), text in zip(chunk, texts, strict=True):
                stopped = i % 20 != 0
                out = [*ids, tok.eot_id] if stopped else ids
                key = f"{i:064x}"
                messages = [Message(role="user", content=f"prompt {i}: write a function that sorts a list of {i % 97} items")]
                rec = ResponseRecord(
                    key=key, dataset=dataset, source=f"prompts.jsonl:{i + 1}", settings_id="0" * 16, messages=messages,
                    system_prompt_used=False, text=text, output_ids=out, prompt_tokens=20 + i % 50,
                    completion_tokens=len(out), finish_reason="stop" if stopped else "length", truncated=not stopped,
                    backend="sglang", backend_kind="gpu", model="bench/chatml-600", token_source="exact",
                    usage=Usage(prompt_tokens=20 + i % 50, completion_tokens=len(out)), cost_usd=0.0,
                    cost_source="none", latency_s=1.0, attempts=1, worker="bench", created_at=1.7e9 + i,
                )
                path = store.path(dataset, key)
                if path.parent.name not in created:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    created.add(path.parent.name)
                path.write_bytes(_encode(rec))
                fh.write(_encode({"id": rec.source, "messages": messages, "text": text, "output_ids": out,
                                  "completion_tokens": len(out), "finish_reason": rec.finish_reason}) + b"\n")
                total += len(out)
    return folder / "store", jsonl, total


def seed_loop(jsonl: Path) -> tuple[int, int]:
    """The seed's inventory script, as it ran on the GPU box."""
    tok = 0
    count = 0
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            ct = r.get("completion_tokens", 0)
            if ct == 0 and "output_ids" in r:
                ct = len(r["output_ids"])
            tok += ct
            count += 1
    return count, tok


def store_read(root: Path, dataset: str) -> tuple[int, int]:
    """Every record of the store decoded into a validated ResponseRecord, on one core; responses, tokens."""
    count = tokens = 0
    for path in open_store(root).record_files(dataset):
        with open(path, "rb") as fh:
            rec = _decode(fh.read())
        tokens += rec.completion_tokens or len(rec.output_ids)
        count += 1
    return count, tokens


def _inventory(root: Path, dataset: str, tok: TargetTokenizer, roundtrip_sample: int = 500) -> tuple[int, int] | None:
    """``draftfleet inventory`` in-process, with validation (None if the module is not there yet)."""
    # --- draftfleet inventory (issue 3) -----------------------------------------------------------
    # Runs the product's own inventory when draftfleet.views.inventory provides run_inventory; otherwise
    # the benchmark reports the store read alone (store_read above), the path inventory is built on.
    try:
        from draftfleet.views.inventory import run_inventory
    except ImportError:
        return None
    [inv] = run_inventory(root, None, [dataset], tok, roundtrip_sample=roundtrip_sample)
    return inv.responses, inv.completion_tokens


def _cat(*cmd: str) -> None:
    subprocess.run(["bash", "-c", *cmd], check=True)


def best(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    fn()  # warm the page cache and any lazy imports
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def run(work: Path, *, sizes: list[tuple[str, int, float]], repeats: int = 3) -> Section:
    tok = TargetTokenizer(str(TOKENIZER))
    figures, rows = [], ["| dataset | responses | tokens | MiB (store / JSONL) | inventory | inventory, no decode→encode "
                         "check | store read | seed loop | cat JSONL | cat store files |",
                         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, n, mean in sizes:
        folder = fresh_dir(work / label)
        root, jsonl, total = build(folder, label, n, mean, tok)
        ds_dir = root / label
        t_read, got_read = best(lambda: store_read(root, label), repeats)
        t_inv, got_inv = best(lambda: _inventory(root, label, tok), repeats)
        t_inv0, _ = best(lambda: _inventory(root, label, tok, roundtrip_sample=0), repeats)
        t_seed, got_seed = best(lambda: seed_loop(jsonl), repeats)
        t_cat_jsonl, _ = best(lambda: _cat(f"cat '{jsonl}' > /dev/null"), repeats)
        t_cat_store, _ = best(lambda: _cat(f"find '{ds_dir}' -name '*.json' -print0 | xargs -0 cat > /dev/null"), repeats)
        assert got_read == got_seed == (n, total), (got_read, got_seed, n, total)
        store_mib = sum(os.path.getsize(p) for p in open_store(root).record_files(label)) / 2**20
        jsonl_mib = jsonl.stat().st_size / 2**20
        if got_inv is not None:
            assert got_inv == (n, total), (got_inv, n, total)
            name, t_main = "`draftfleet inventory` (validating)", t_inv
        else:
            name, t_main = "store read (msgspec, validated records)", t_read
        what = f"{name}, {label} ({n:,} responses, {total / 1e6:.1f}M tokens)"
        figures.append(Figure(bench="inventory", name=what, value=t_main, unit="s",
                              reference="the seed's json.loads loop over raw_responses.jsonl", reference_value=t_seed,
                              ratio=ratio(t_main, t_seed, higher_is_better=False), target="faster (> 1)",
                              met=t_main < t_seed, headline=True))
        figures.append(Figure(bench="inventory", name=what, value=t_main, unit="s",
                              reference="`cat` of the store's files", reference_value=t_cat_store,
                              ratio=ratio(t_main, t_cat_store, higher_is_better=False), target="within 3× (≥ 0.33)",
                              met=t_main <= 3 * t_cat_store, headline=True))
        inv = f"{t_inv:.3f} s | {t_inv0:.3f} s" if got_inv is not None else "n/a | n/a"
        rows.append(f"| {label} | {n:,} | {total:,} | {store_mib:,.0f} / {jsonl_mib:,.0f} | {inv} | {t_read:.3f} s | "
                    f"{t_seed:.3f} s | {t_cat_jsonl:.3f} s | {t_cat_store:.3f} s |")
    details = [*rows, "",
               "Lengths are lognormal (σ 0.6) around the mean; ids are real ids of the sample tokenizer; one "
               "response in 20 is truncated. `inventory` is `run_inventory` in-process with the tokenizer loaded "
               "(vocabulary, end-of-turn, truncation and duplicate-prompt checks, and decode→encode on its sample of "
               "exact records); the command adds its start-up (imports, tokenizer load). `store read` decodes every "
               "record into a type-checked `ResponseRecord` on one core. `cat store files` is `find | xargs cat`: "
               "the same files inventory opens."]
    return Section(bench="inventory", title="Inventory", command="", figures=figures, details=details)
