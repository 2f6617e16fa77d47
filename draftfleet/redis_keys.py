"""Every Redis key and queue name the fleet uses, in one place (arq's ``constants.py`` habit).

Redis holds scheduling state and fast counters only; the store is the truth. Everything here
can be lost (Redis restarted empty) and rebuilt: ``enqueue`` re-queues what the store lacks.
"""

from __future__ import annotations

PREFIX = "draftfleet:"
QUEUE_PREFIX = "draftfleet."
TASK_NAME = "draftfleet.generate"
# kombu's Redis transport keeps delivered-but-unacked messages here (its defaults).
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


def queue(dataset: str) -> str:
    """The Celery queue (a Redis list of the same name) of a dataset."""
    return f"{QUEUE_PREFIX}{dataset}"


def dataset_of_queue(name: str) -> str | None:
    return name[len(QUEUE_PREFIX):] if name.startswith(QUEUE_PREFIX) else None


def claim(dataset: str, key: str) -> str:
    """Held (SET NX EX) by the worker generating ``key`` now; stops a redelivered twin running too.

    Its value is the holding task's token, ``<worker hostname>:<pid>:<nonce>``: one per task, so
    two copies of a key in one process never release or refresh each other's claim."""
    return f"{PREFIX}claim:{dataset}:{key}"


# A lease's name (workers/leases.py): its reservation's field and its claim's key, never a prompt's key
# (those are sha256 hex).
LEASE_PREFIX = "lease-"


def is_lease(key: str) -> bool:
    """Whether a claimed or reserved name is a worker's lease of a budget, not a prompt's key."""
    return key.startswith(LEASE_PREFIX)


def claim_holder(token: str | bytes) -> str:
    """The hostname of the worker whose task holds a claim (its token's first part)."""
    text = token.decode() if isinstance(token, bytes) else token
    return text.rsplit(":", 2)[0]


def counted_set(dataset: str) -> str:
    """Keys already added to the counters: each stored key is counted exactly once."""
    return f"{PREFIX}counted:{dataset}"


def totals(dataset: str, backend: str) -> str:
    """Hash of fast counters (responses, prompt_tokens, completion_tokens, cost_micro_usd)."""
    return f"{PREFIX}totals:{dataset}:{backend}"


def totals_pattern(dataset: str = "*") -> str:
    return f"{PREFIX}totals:{dataset}:*"


def dataset_totals(dataset: str) -> str:
    """Hash of a dataset's counters over all backends: what budget admission reads (its
    ``paid_tokens``: turns of conversations paid and not yet counted as a record)."""
    return f"{PREFIX}dataset:{dataset}"


def reservations(dataset: str) -> str:
    """Hash key -> ``tokens:claim token`` of every admitted task (and lease) still in flight: the
    most it can make (ledger.py)."""
    return f"{PREFIX}reserved:{dataset}"


def reservations_due(dataset: str) -> str:
    """Sorted set of the reservations by when their claim is looked at next (dropped once it is gone)."""
    return f"{PREFIX}reserved_due:{dataset}"


def reserved_sum(dataset: str) -> str:
    """Hash (field ``r``) of the tokens reserved in flight, kept as they change, so admission never scans them."""
    return f"{PREFIX}reserved_sum:{dataset}"


def reservations_dead(dataset: str) -> str:
    """Sorted set of the reservations whose claim lapsed, by when admission found it gone: still
    reserved (their task may have stored an answer not counted yet) until a pass over the store has
    counted what it holds (``Ledger.settle_dead``)."""
    return f"{PREFIX}reserved_dead:{dataset}"


def settling(dataset: str) -> str:
    """Held (``SET NX EX``) by the worker counting the store for a dataset's buried reservations."""
    return f"{PREFIX}settling:{dataset}"


def closed(dataset: str) -> str:
    """Set (to the budget it closed at) once a dataset's budget is reached."""
    return f"{PREFIX}closed:{dataset}"


def lease_taken_prefix(dataset: str) -> str:
    """The prefix of a lease's set of keys whose slots its counts took out (ledger_scripts.COUNT_BATCH):
    a count run twice takes nothing twice."""
    return f"{PREFIX}lease_taken:{dataset}:"


def rate(dataset: str, backend: str, bucket: int) -> str:
    """Completion tokens stored in one 10-second bucket (expires): tokens per second for status."""
    return f"{PREFIX}rate:{dataset}:{backend}:{bucket}"


def assignment(dataset: str) -> str:
    """Set of worker kinds (gpu, cloud) that may consume a dataset; absent = both.

    Kept in Redis because Celery forgets consumer changes when a worker restarts.
    """
    return f"{PREFIX}assign:{dataset}"


# Hash dataset -> its manifest (JSON), published by ``enqueue``: the live settings (assign.py).
DATASETS = f"{PREFIX}datasets"
# Hash dataset -> its budget as published with its manifest (``<tokens>``, ``<tokens> whole`` for the
# whole-answers rule, or ``none``): what admission reads on every task, and what a lease is checked
# against before each task it admits (a change retires it), rather than the whole manifest.
BUDGETS = f"{PREFIX}budgets"


def spend(backend: str) -> str:
    """Spend of a backend across datasets (hash: cost_micro_usd), checked against its cap."""
    return f"{PREFIX}spend:{backend}"


def spend_held(backend: str) -> str:
    """Hash hold id (``<dataset>:<key>:<turn>:<ns>``) -> ``micro_usd:claim token``: the most each
    request in flight on a capped backend can cost (ledger.py, spend holds)."""
    return f"{PREFIX}spend_held:{backend}"


def spend_held_sum(backend: str) -> str:
    """Hash (field ``r``) of the micro-USD held by a backend's requests in flight."""
    return f"{PREFIX}spend_held_sum:{backend}"


def prepaid(dataset: str, key: str) -> str:
    """Hash turn index -> completion tokens of a conversation's turns paid before its record is
    counted (ledger.py): each is in ``spend`` and in its dataset's ``paid_tokens`` (``dataset_totals``)
    once; counting the record moves them to the totals and adds to the spend only the turns not here."""
    return f"{PREFIX}prepaid:{dataset}:{key}"


BATCH_TOKEN_PREFIX = "batch:"
BATCHES = f"{PREFIX}batches"  # hash batch id -> BatchSummary of the open provider batches (draftfleet/batches.py)


def batch_token(batch_id: str) -> str:
    """The holder a provider batch's spend holds are taken under (no claim: the batch is in the store)."""
    return BATCH_TOKEN_PREFIX + batch_id


def batch_lock(batch_id: str) -> str:
    """Held while one batch worker polls a provider batch (any worker of its backend may)."""
    return f"{PREFIX}batch_lock:{batch_id}"


def batch_hold_id(dataset: str, key: str, batch_id: str) -> str:
    """A batch request's spend hold id, in ``spend_held``'s form; the same whenever it is made again."""
    return f"{dataset}:{key}:-:{int(batch_id[1:21])}"


def paid_keys(dataset: str) -> str:
    """Set of the keys that have a ``prepaid`` hash: conversations with paid turns and no counted
    record yet. A closed dataset's purge keeps their tasks, so that each is stopped once (its turns
    kept for a raised budget)."""
    return f"{PREFIX}paid_keys:{dataset}"


# The spend's share that no record carries (store ``_charges/``): the ids of the charges counted.
CHARGED = f"{PREFIX}charged"
# Set (to the ``STATE`` stamp it was built under) only by the rebuild of the counters from the store
# (reconcile.py): absent, the counters may have been lost with Redis, so no budget is admitted and no
# spend cap is trusted until one worker has rebuilt them (under REBUILD_LOCK; the others wait).
COUNTERS_BUILT = f"{PREFIX}counters_built"
REBUILD_LOCK = f"{PREFIX}rebuild_lock"
# The shared Redis's CPU as last sampled (hash run_id, at, cpu): whoever reads status, the metrics or
# a reconcile pass next measures the share of a core used since (views/redis_load.py).
REDIS_CPU = f"{PREFIX}redis_cpu"


def events(dataset: str) -> str:
    """Counters of retries and failures by reason (hash)."""
    return f"{PREFIX}events:{dataset}"


DEAD_LETTER = f"{PREFIX}dead_letter"
# Set by every worker heartbeat (after it has put its claims back) and by enqueue. Absent means
# Redis lost its state (or is new): workers, which look every STATE_POLL_S, beat at once to put
# their claims back, and enqueue waits for them before deciding what to send again.
STATE = f"{PREFIX}state"
STATE_POLL_S = 0.5
# Every live worker has put its claims back this long after the marker's stamp (each looks every
# STATE_POLL_S and beats at once when the stamp is not the one it last beat under).
STATE_SETTLE_S = 2 * STATE_POLL_S + 1.0


def state_stamp(r) -> str:
    """The value of a new ``STATE`` marker: Redis's own clock (the same for every host), in seconds."""
    sec, usec = r.time()
    return f"{sec}.{usec:06d}"
# Held (SET NX EX) by the worker sweeping ``unacked`` for a dead worker's messages (recovery.py).
RECOVERY_LOCK = f"{PREFIX}recovery_lock"
WORKERS = f"{PREFIX}workers"


def worker_report(hostname: str) -> str:
    """A worker's own last report (JSON, with a TTL): kind, backend, in flight, paused."""
    return f"{PREFIX}worker:{hostname}"


# Hidden-state capture (workers/capture.py): its own task and one queue per dataset, named apart
# from the generation queues so that nothing reading those (recovery, status) mistakes them.
CAPTURE_TASK_NAME = "draftfleet.capture"
CAPTURE_QUEUE_PREFIX = "draftfleet-capture."


def capture_queue(dataset: str) -> str:
    return f"{CAPTURE_QUEUE_PREFIX}{dataset}"


def capture_claim(dataset: str, unit: str) -> str:
    """Held (SET NX EX, refreshed) by the worker capturing ``unit`` (``<key>.<turn>.v<version>``) now:
    a message whose unit has no claim is held by nobody, and recovery gives it back (as ``claim``)."""
    return f"{PREFIX}capture_claim:{dataset}:{unit}"


def capture_progress(dataset: str) -> str:
    """Hash of a dataset's capture: version, units (to capture when queued), queued, captured, failed."""
    return f"{PREFIX}capture:{dataset}"
