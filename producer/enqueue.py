"""``draftfleet enqueue``: put every prompt that has no result yet on its dataset's queue.

Resume is the default and needs no state of its own: a key is skipped when the store holds its
result, when it is already queued or held by a worker (read from Redis itself), or when it failed
before (unless ``retry_failed``). Running enqueue twice, or again after Redis lost everything,
queues exactly what is missing. A dataset's manifest pins the settings its keys were made with.

Sending is the costly part of a large enqueue (bench/enqueue.py): messages are built by Celery
itself, with the key as task id, and go out through one kombu publish batch, a non-transactional
Redis pipeline, so a hundred commands share one round trip. A run that dies mid-batch loses only
messages not yet sent, which a re-run queues.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import redis
from celery import Celery

from draftfleet import redis_keys as rk
from draftfleet.assign import publish, published
from draftfleet.identity import prompt_key, settings_id
from draftfleet.ledger import Ledger
from draftfleet.queues import queued_keys
from draftfleet.schemas.config import DatasetConfig, FleetConfig
from draftfleet.schemas.records import DatasetManifest, Message, PromptTask
from draftfleet.store import Store
from draftfleet.producer.readers import PromptRow, Rejection, read_prompts


PUBLISH_BATCH = 100
"""Redis commands per pipeline round trip (a message and its task-sent event are two): as fast
as 1,000 for a large file, and the first messages reach a waiting worker ~70 ms sooner."""


class TaskSender:
    """Publishes generate tasks to one queue as Celery's ``send_task`` does, at under half its cost.

    The message is Celery's own (``amqp.create_task_message``: protocol 2, the app's serializer,
    delivery mode and compression) and so is the task-sent event Flower reads. What is left out
    is per-call work that gives the same answer every time: routing the queue name, declaring the
    queue (done once here), and the ``saferepr`` of the whole payload for ``argsrepr`` (the
    caller passes a short one that names the prompt). Publishes go through ``producer``, so an
    open ``producer.batch()`` buffers them.
    """

    def __init__(self, app: Celery, producer, queue: str):
        conf = app.conf
        self._amqp = app.amqp
        self._producer = producer
        self._queue = queue
        self._reply_to = app.thread_oid
        self._publish = {"exchange": "", "routing_key": queue, "serializer": conf.task_serializer,
                         "compression": conf.task_compression, "delivery_mode": conf.task_default_delivery_mode}
        self._events = app.events.Dispatcher(producer.connection, enabled=False) if conf.task_send_sent_event else None
        producer.maybe_declare(app.amqp.queues[queue])

    def send(self, task_id: str, payload: object, argsrepr: str) -> None:
        headers, properties, body, sent = self._amqp.create_task_message(
            task_id, rk.TASK_NAME, [payload], None, argsrepr=argsrepr, kwargsrepr="{}", reply_to=self._reply_to,
            ignore_result=None, create_sent_event=self._events is not None,
        )
        self._producer.publish(body, headers=headers, **self._publish, **properties)
        if self._events is not None:
            sent.update(queue=self._queue, exchange="", routing_key=self._queue)
            self._events.publish("task-sent", sent, self._producer)


class EnqueueError(RuntimeError):
    pass


class EnqueueSummary(msgspec.Struct, kw_only=True):
    dataset: str
    version: int
    read: int = 0
    queued: int = 0
    already_done: int = 0
    already_queued: int = 0
    failed_before: int = 0
    duplicate_in_input: int = 0
    closed: bool = False
    rejected: int = 0
    rejected_by_kind: dict[str, int] = {}
    quarantine_file: str | None = None


def check_manifest(store: Store, cfg: FleetConfig, ds: DatasetConfig, new_version: bool) -> DatasetManifest:
    """Pin the dataset's settings; refuse to mix settings in one version of a dataset."""
    store.prepare()
    settings = ds.settings(cfg.fleet.model)
    sid = settings_id(settings)
    current = store.manifest(ds.name)
    if current is not None and current.settings_id == sid:
        if current.budget_tokens != ds.budget_tokens:
            current = msgspec.structs.replace(current, budget_tokens=ds.budget_tokens)
            store.write_manifest(current)
        return current
    if current is not None and not new_version:
        raise EnqueueError(
            f"dataset {ds.name!r} was started (version {current.version}) with settings "
            f"{msgspec.json.encode(current.settings).decode()} but the config now says "
            f"{msgspec.json.encode(settings).decode()}: pass --new-version to start version "
            f"{current.version + 1} (results made with the old settings stay in the store)"
        )
    manifest = DatasetManifest(
        name=ds.name,
        version=current.version + 1 if current else 1,
        settings=settings,
        settings_id=sid,
        budget_tokens=ds.budget_tokens,
        created_at=time.time(),
        previous=[*current.previous, current.settings] if current else [],
    )
    store.write_manifest(manifest)
    return manifest


def _raised(budget: int | None, than: int | None) -> bool:
    return than is not None and (budget is None or budget > than)


def prompt_messages(ds: DatasetConfig, row: PromptRow) -> list[Message]:
    """What is sent: the row's turns, with the dataset's system prompt when the row has none."""
    if ds.system_prompt and not any(m.role == "system" for m in row.messages):
        return [Message(role="system", content=ds.system_prompt), *row.messages]
    return list(row.messages)


def enqueue_dataset(
    cfg: FleetConfig,
    ds: DatasetConfig,
    app: Celery,
    r: redis.Redis,
    store: Store,
    *,
    new_version: bool = False,
    retry_failed: bool = False,
    on_row: Callable[[], None] | None = None,
    on_reject: Callable[[Rejection], None] | None = None,
) -> EnqueueSummary:
    if not os.path.lexists(ds.path):  # a typo in the config, not a bad line: nothing is written
        raise EnqueueError(f"dataset {ds.name!r}: {ds.path} does not exist")
    manifest = check_manifest(store, cfg, ds, new_version)
    summary = EnqueueSummary(dataset=ds.name, version=manifest.version)
    ledger = Ledger(r)
    # Published before the dataset is reopened, reopened before anything is sent: running workers'
    # admission reads the budget published here, so none closes it again at the old budget.
    before = published(r).get(ds.name)
    publish(r, manifest)
    closed_at = ledger.closed_at(ds.name)
    if closed_at is not None and _raised(ds.budget_tokens, closed_at):
        ledger.reopen(ds.name)  # the budget was raised (or removed): the dataset takes work again
        closed_at = None
    elif closed_at is None and before is not None and _raised(ds.budget_tokens, before.budget_tokens):
        ledger.reopen(ds.name)  # raised while closing rounds ran: admission starts afresh
    summary.closed = closed_at is not None
    done = store.keys(ds.name)
    queued = queued_keys(r, ds.name)
    failed = {f.key for f in store.failures(ds.name)}
    seen: set[str] = set()
    kinds: Counter[str] = Counter()
    rejects = []
    queue = rk.queue(ds.name)
    retried: list[str] = []
    with app.producer_or_acquire() as producer, producer.batch(max_size=PUBLISH_BATCH):
        sender = TaskSender(app, producer, queue)
        for item in read_prompts(ds):
            if on_row:
                on_row()
            if isinstance(item, Rejection):
                kinds[item.entry.kind] += 1
                rejects.append(item.entry)
                if on_reject:
                    on_reject(item)
                continue
            summary.read += 1
            messages = prompt_messages(ds, item)
            key = prompt_key(ds.name, messages, manifest.settings)
            if key in seen:
                summary.duplicate_in_input += 1
                continue
            seen.add(key)
            if key in done:
                summary.already_done += 1
                continue
            if key in queued:
                summary.already_queued += 1
                continue
            if key in failed and not retry_failed:
                summary.failed_before += 1
                continue
            if summary.closed:
                continue
            task = PromptTask(
                key=key, dataset=ds.name, source=item.source, messages=messages,
                settings=manifest.settings, settings_id=manifest.settings_id, enqueued_at=time.time(),
                row_id=item.row_id,
            )
            # The task id is the key: queued keys can then be read from message headers alone.
            sender.send(key, msgspec.to_builtins(task), argsrepr=f"[{item.source!r}]")
            if key in failed:
                retried.append(key)
            summary.queued += 1
    for key in retried:  # only once their messages are in Redis
        store.clear_failure(ds.name, key)
    store.quarantine(ds.name, rejects)
    summary.rejected = sum(kinds.values())
    summary.rejected_by_kind = dict(kinds)
    if rejects:
        summary.quarantine_file = str(store.quarantine_path(ds.name))
    return summary
