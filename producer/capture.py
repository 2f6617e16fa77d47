"""``draftfleet capture``: queue a capture task for every stored record turn without hidden states.

The store is the truth, as for ``enqueue``: a unit (record key, turn) with a file in the dataset's
capture version is done; every other one is queued, unless its task already waits in the queue.
Re-running it is the resume, also after a worker died holding tasks or Redis lost its queues
(a unit queued twice is harmless: the store keeps one file).

A capture version records the target model (its ``config.json`` hash), the layer ids, the
hidden size and the dtype. Asking for other settings than the latest version's is refused unless
``new_version``: files made with two settings (bf16 and fp8 among them) would train a drafter on a mix.

A version also records its units: ``conversation`` (``[capture] conversations``, the default) queues
a conversation whose turns' ids prefix each other as one unit over its last turn, the others (and
every conversation of a ``turn`` version) one unit per turn; the summary says how many went which
way, and the first reason a conversation could not be shared.
"""

from __future__ import annotations

import shutil
import time

import msgspec
import redis
from celery import Celery

from draftfleet import redis_keys as rk
from draftfleet.conversation import record_turns
from draftfleet.hidden import (CONVERSATION, DTYPES, SEAL, CaptureError, Hidden, bytes_per_token, capture_settings,
                               check_storage, conversation_spans, measured_bytes_per_token, open_hidden,
                               projected_bytes, storage_path)
from draftfleet.producer.sender import PUBLISH_BATCH, TaskSender
from draftfleet.queues import claimed_units, lost_claims_settle_s, waiting_ids
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import CaptureManifest, CaptureTask, turn_name
from draftfleet.store import Store
from draftfleet.versions import Selection, select


class CaptureSummary(msgspec.Struct, kw_only=True):
    dataset: str
    dataset_version: int | None  # the version whose records are captured (None: every version)
    version: int
    layer_ids: list[int]
    dtype: str  # the version's: bfloat16 or float8_e4m3fn
    units: int  # capture units (a file each): a turn, or a conversation captured once
    done: int  # of them with a file already
    queued: int
    already_queued: int
    running: int = 0  # held by a running capture worker now (its claim): not sent again
    tokens_to_capture: int
    bytes_estimate: int
    free_bytes: int | None  # the store's file system's; None: a store in a bucket
    bytes_per_token: float  # the version's (its files' once it has some), in its dtype
    budget_tokens_left: int | None  # answer tokens the dataset's budget has left to generate
    projected_bytes: int  # bytes_estimate plus the states of what the budget has left (with its prompts)
    turns: int = 0  # record turns with output ids, the units hold
    unit_kind: str = "turn"  # the version's units: "conversation" or "turn"
    conversations_once: int = 0  # conversations of 2+ turns captured as one unit
    conversations_per_turn: int = 0  # conversations of 2+ turns captured per turn (a conversation version)
    per_turn_reason: str | None = None  # why, for the first of them
    notes: list[str] = []


def existing_version(hidden: Hidden, wanted: CaptureManifest, new_version: bool) -> CaptureManifest | None:
    """The latest version if its settings are ``wanted``'s; None when a new one is to start."""
    current = hidden.manifest(wanted.dataset)
    if current is None or new_version:
        return None
    if (current.model_config_sha256, current.layer_ids, current.hidden_size, current.dtype) == (
            wanted.model_config_sha256, wanted.layer_ids, wanted.hidden_size, wanted.dtype):
        return current
    raise CaptureError(
        f"{wanted.dataset}: capture version {current.version} holds {current.dtype} layers {current.layer_ids} of a "
        f"model with config sha256 {current.model_config_sha256[:12]} (hidden {current.hidden_size}); this config "
        f"asks for {wanted.dtype} layers {wanted.layer_ids} of {wanted.model_config_sha256[:12]} (hidden "
        f"{wanted.hidden_size}): pass --new-version to start version {current.version + 1}")


def start_version(hidden: Hidden, wanted: CaptureManifest) -> CaptureManifest:
    """Write the manifest of the next version (the first one written wins a race) and return it."""
    current = hidden.manifest(wanted.dataset)
    version = current.version + 1 if current is not None else 1
    hidden.write_manifest(msgspec.structs.replace(wanted, version=version))
    return hidden.manifest(wanted.dataset, version)


def queue_capture(cfg: FleetConfig, store: Store, app: Celery, r: redis.Redis, dataset: str, *,
                  new_version: bool = False, ignore_space: bool = False,
                  records: Selection | None = None) -> CaptureSummary:
    """Queue the record turns that lack hidden states, of the dataset's current version unless
    ``records`` chooses (``versions.select``); refuse when they will not fit."""
    # Claims before the queue, as enqueue does: after Redis came back empty, running workers put
    # theirs back within a poll, so what they capture now is not sent again. The wait for them runs
    # while the store is scanned.
    settled = time.monotonic() + lost_claims_settle_s(r)
    records = records or select(store, dataset)
    model, layer_ids = capture_settings(cfg)
    check_storage(cfg, storage_path(cfg))  # the engine's files are linked into the store: same file system
    hidden = open_hidden(store)
    wanted = CaptureManifest(dataset=dataset, version=0, model=cfg.fleet.model, model_config_sha256=model.config_sha256,
                             num_layers=model.num_layers, hidden_size=model.hidden_size, layer_ids=layer_ids,
                             dtype=DTYPES[cfg.capture.dtype], created_at=time.time(),
                             units="conversation" if cfg.capture.conversations else "turn", seal=SEAL)
    existing = existing_version(hidden, wanted, new_version)
    kind = (existing or wanted).units
    pending: list[tuple[CaptureTask, int]] = []
    units = turns = done = unit_tokens = completion_tokens = spent = once = per_turn = 0
    reason = None
    version = existing.version if existing is not None else None
    # what is stored, from one listing (a bucket answers a HEAD per unit far slower)
    stored = {(k, t) for k, t, _ in hidden.files(dataset, version)} if version is not None else set()
    for rec in store.records(dataset):
        spent += rec.completion_tokens or len(rec.output_ids)  # the budget counts every version's records
        if not records.takes(rec):
            continue
        completion_tokens += rec.completion_tokens or len(rec.output_ids)
        shared = conversation_spans(rec) if kind == "conversation" and rec.turns and len(rec.turns) > 1 else None
        if isinstance(shared, str):
            per_turn += 1
            reason = reason or f"record {rec.key[:12]} ({rec.source}): {shared}"
        if isinstance(shared, tuple):
            once += 1
            ids, spans = shared
            work = [(CONVERSATION, len(ids), len(spans))]
        else:
            work = [(turn, t.prompt_tokens + len(t.output_ids), 1) for turn, t in enumerate(record_turns(rec))
                    if t.output_ids]
        for turn, n, held in work:
            units += 1
            turns += held
            unit_tokens += n
            if (rec.key, turn) in stored:
                done += 1
                continue
            pending.append((CaptureTask(dataset=dataset, key=rec.key, turn=turn, version=0), n))
    tokens = sum(n for _, n in pending)
    bpt = (measured_bytes_per_token(existing, *hidden.usage(dataset, existing.version)[1:]) if existing is not None
           else float(bytes_per_token(wanted)))
    need = round(tokens * bpt)
    budget = cfg.dataset(dataset).budget_tokens if any(d.name == dataset for d in cfg.datasets) else None
    left = max(0, budget - spent) if budget else None
    projected = projected_bytes(bpt, tokens, left, unit_tokens, completion_tokens)
    # a bucket has no free space to ask: the engine's local folder holds only the files in flight
    free = shutil.disk_usage(store.root).free if store.local else None
    if free is not None and need > free and not ignore_space:
        raise CaptureError(f"{dataset}: capturing {len(pending):,} record turns ({tokens:,} tokens) needs about "
                           f"{need / 1e9:,.1f} GB and {store.root} has {free / 1e9:,.1f} GB free: make room, or pass "
                           "--ignore-space to start anyway")
    m = existing or start_version(hidden, wanted)
    queue = rk.capture_queue(dataset)
    time.sleep(max(0.0, settled - time.monotonic()))
    held = claimed_units(r, dataset)
    waiting = waiting_ids(r, queue)  # a unit a dead worker held is queued again: harmless (write-once)
    queued = already = running = 0
    # The counts start from zero before the first unit is sent: a worker may store it (and count it)
    # while the rest are sent, and a reset after the sending erased those counts.
    r.delete(rk.capture_progress(dataset))
    r.hset(rk.capture_progress(dataset), mapping={
        "version": m.version, "units": units, "done": done, "captured": 0, "failed": 0,
        # for status' projection: bytes per token (x10), tokens to capture and captured since, tokens per answer token
        "bytes_per_token_x10": round(bpt * 10), "tokens": tokens, "captured_tokens": 0, "unit_tokens": unit_tokens,
        "completion_tokens": completion_tokens})
    with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_BATCH) as batch:
        sender = TaskSender(app, producer, queue, rk.CAPTURE_TASK_NAME)
        for task, _n in pending:
            task = msgspec.structs.replace(task, version=m.version)
            if task.unit in waiting:
                already += 1
                continue
            if task.unit in held:
                running += 1
                continue
            sender.send(task.unit, msgspec.to_builtins(task), f"{dataset} {task.key[:12]} turn {turn_name(task.turn)}")
            queued += 1
            if queued == 1:
                batch.flush()  # a waiting worker, and its engine, start on it while the rest is sent
    r.hset(rk.capture_progress(dataset), "queued", queued + already + running)
    notes = []
    if m.units != wanted.units:
        notes.append(f"v{m.version} captures {'each turn apart' if m.units == 'turn' else 'conversations once'} as it "
                     f"began; [capture] conversations = {str(cfg.capture.conversations).lower()} applies to a new "
                     "version (--new-version)")
    return CaptureSummary(dataset=dataset, dataset_version=records.version, version=m.version, layer_ids=m.layer_ids,
                          dtype=m.dtype, units=units, done=done, queued=queued, already_queued=already, running=running,
                          tokens_to_capture=tokens, bytes_estimate=need, free_bytes=free, bytes_per_token=bpt,
                          budget_tokens_left=left, projected_bytes=projected, turns=turns, unit_kind=m.units,
                          conversations_once=once, conversations_per_turn=per_turn, per_turn_reason=reason, notes=notes)
