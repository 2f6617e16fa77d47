"""Open provider batches as the fleet's views read them: a summary per batch in Redis (``rk.BATCHES``),
written by the batch workers whenever they record a batch (workers/batch.py), dropped once it is
closed. The store's ``_batches/`` is the truth; this is what ``status`` and ``plan`` read every few
seconds without listing the store. After Redis lost it, the next poll of each batch writes it again."""

from __future__ import annotations

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.schemas.records import BatchRecord, BatchSummary

_decoder = msgspec.json.Decoder(BatchSummary)


def summary(batch: BatchRecord) -> BatchSummary:
    held = batch.open_requests()
    return BatchSummary(id=batch.id, backend=batch.backend, dataset=batch.dataset, provider_id=batch.provider_id,
                        status=batch.status, prompts=len(batch.requests), granted_tokens=sum(q.granted for q in held),
                        completed=batch.completed, failed=batch.failed, submitted_at=batch.submitted_at,
                        updated_at=batch.updated_at, window=batch.window, cancellable=batch.cancellable,
                        cancel_requested=batch.cancel_requested, held_prompts=len(held))


def publish(r: redis.Redis, batch: BatchRecord) -> None:
    if batch.closed:
        r.hdel(rk.BATCHES, batch.id)
    else:
        r.hset(rk.BATCHES, batch.id, msgspec.json.encode(summary(batch)))


def open_batches(r: redis.Redis, dataset: str | None = None) -> list[BatchSummary]:
    """The open batches (of ``dataset``), oldest first; an unreadable entry is left out."""
    out = []
    for raw in r.hvals(rk.BATCHES):
        try:
            b = _decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        if dataset is None or b.dataset == dataset:
            out.append(b)
    return sorted(out, key=lambda b: b.id)
