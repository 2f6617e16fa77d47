"""What every kind of store is: the interface, its errors, and the names it accepts.

Records are write-once (of two writers of a key exactly one wins, and only it counts the record);
manifests, failures and progress are replaced whole, atomically; the quarantine, the decision log
and the charges only grow. The layout is in the package's docstring (``draftfleet.store``).
"""

from __future__ import annotations

import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path

from draftfleet.schemas.config import NAME_RE
from draftfleet.schemas.records import (
    BatchRecord,
    ChargeRecord,
    DatasetEvent,
    DatasetManifest,
    FailureRecord,
    QuarantineEntry,
    ResponseRecord,
    TurnProgress,
)
from draftfleet.store.encoding import BATCH_ID_RE_TEXT, encoder, record_decoder

KEY_RE = re.compile(r"^[0-9a-f]{64}$")

MARKER = ".draftfleet-store"

# What a store made before the marker existed can hold: it is recognised, and marked.
FLEET_ENTRIES = {"_redis", "_failures", "_charges", "_quarantine", "_state", "_unreadable", "_progress", "_hidden", "_log",
                  "_batches", "lost+found"}


class StoreError(Exception):
    """The store could not be read or written (permissions, disk full, bad name)."""


def check_name(dataset: str) -> str:
    """Refuse any dataset name that could leave the root (``..``, ``/``, NUL, absolute)."""
    if not isinstance(dataset, str) or not NAME_RE.match(dataset) or ".." in dataset:
        raise StoreError(f"unsafe dataset name {dataset!r}")
    return dataset


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise StoreError(f"malformed key {key!r}: expected 64 hex characters")
    return key

CHARGE_ID_RE = re.compile(r"^[0-9]{20}-[0-9a-f]{12}$")


def new_charge_id() -> str:
    """A charge's id: its time (so the store lists charges in order) and a random part."""
    return f"{time.time_ns():020d}-{secrets.token_hex(6)}"


BATCH_ID_RE = re.compile(BATCH_ID_RE_TEXT)


def new_batch_id() -> str:
    """A provider batch's id in the fleet: time-ordered, unique across machines."""
    return f"b{time.time_ns():020d}-{secrets.token_hex(4)}"


def check_batch_id(batch_id: str) -> str:
    if not BATCH_ID_RE.match(batch_id):
        raise StoreError(f"bad batch id {batch_id!r}")
    return batch_id


def check_charge_id(charge_id: str) -> str:
    if not CHARGE_ID_RE.match(charge_id):
        raise StoreError(f"bad charge id {charge_id!r}")
    return charge_id


class Store(ABC):
    """What the fleet keeps, wherever it keeps it: the same semantics in every kind.

    Records are write-once (of two writers of a key exactly one wins, and only it counts the
    record); manifests, failures and progress are replaced whole, atomically; the quarantine and
    the decision log only grow. ``location`` names the store in messages; ``local`` says whether
    its files are on this machine's file system (hidden-state capture needs that for now).
    """

    location: str
    local: bool

    @abstractmethod
    def prepare(self) -> None:
        """Make sure the store is the fleet's own (its marker) before anything is written to it."""

    # -- responses -----------------------------------------------------------------------
    @abstractmethod
    def has(self, dataset: str, key: str) -> bool: ...

    @abstractmethod
    def _create(self, dataset: str, key: str, data: bytes) -> bool:
        """Store a record's bytes unless the key has one: True if this call stored them."""

    def put(self, record: ResponseRecord, *, writer: str | None = None) -> bool:
        """Write ``record`` once. True if this call stored it, False if the key already had one.
        ``writer``: the writing task's token, the same on each of its calls, so that a bucket tells
        a stored write whose answer was lost (retried by any layer) from a twin's (``ObjectStore``);
        a folder's write cannot lose its answer and ignores it.

        Storing a result clears the key's failure record: the prompt is finished."""
        check_name(record.dataset)
        check_key(record.key)
        if not self._create(record.dataset, record.key, encoder.encode(record)):
            return False
        self.clear_failure(record.dataset, record.key)
        return True

    def abort_stale_uploads(self) -> int:
        """Abort uploads left by writers killed mid-way (a bucket's multipart uploads): how many.
        A folder has none: a file is written whole, then linked."""
        return 0

    @abstractmethod
    def set_aside(self, dataset: str, key: str) -> str | Path | None:
        """Move an unreadable record to ``_unreadable/`` so the key can be generated again; where
        it went (None: nothing was there). Call it holding the key's claim."""

    @abstractmethod
    def record_bytes(self, dataset: str, key: str) -> bytes:
        """A record's stored bytes (``FileNotFoundError`` when there are none)."""

    @abstractmethod
    def record_location(self, dataset: str, key: str) -> str:
        """Where a record is, for messages."""

    def get(self, dataset: str, key: str) -> ResponseRecord:
        return record_decoder.decode(self.record_bytes(dataset, key))

    @abstractmethod
    def record_files(self, dataset: str) -> list[str]:
        """The names of every record (what ``read_many`` takes), unsorted."""

    @abstractmethod
    def read_many(self, names: Iterable[str]) -> Iterator[tuple[str, bytes | OSError]]:
        """Each name's bytes, or the ``OSError`` that reading it raised, in order."""

    def keys(self, dataset: str) -> set[str]:
        """Every key with a stored result (names only; nothing is read)."""
        return {n.rsplit("/", 1)[-1][:-5] for n in self.record_files(dataset)}

    def records(self, dataset: str) -> Iterator[ResponseRecord]:
        """Every record, by key; one that cannot be read raises."""
        for name, data in self.read_many(sorted(self.record_files(dataset), key=lambda n: n.rsplit("/", 1)[-1])):
            if isinstance(data, OSError):
                raise data
            yield record_decoder.decode(data)

    @abstractmethod
    def datasets(self) -> list[str]: ...

    # -- manifests, failures, progress ----------------------------------------------------
    @abstractmethod
    def manifest(self, dataset: str) -> DatasetManifest | None: ...

    @abstractmethod
    def write_manifest(self, manifest: DatasetManifest) -> None: ...

    @abstractmethod
    def put_failure(self, failure: FailureRecord) -> None: ...

    @abstractmethod
    def all_failures(self, dataset: str) -> list[FailureRecord]: ...

    def failures(self, dataset: str) -> list[FailureRecord]:
        """Prompts whose retries ran out and that have no result (one stored since, by a twin or
        before ``put`` cleared failures, is finished: not listed)."""
        return [f for f in self.all_failures(dataset) if not self.has(dataset, f.key)]

    @abstractmethod
    def clear_failure(self, dataset: str, key: str) -> None: ...

    @abstractmethod
    def put_progress(self, progress: TurnProgress) -> None:
        """Keep a conversation's completed turns (replaced atomically as each turn completes), so
        that the worker that takes it up after a death or a retry starts at the next turn."""

    @abstractmethod
    def progress(self, dataset: str, key: str) -> TurnProgress | None:
        """The completed turns kept for ``key``; None when there are none (or they cannot be read)."""

    @abstractmethod
    def clear_progress(self, dataset: str, key: str) -> None: ...

    @abstractmethod
    def progress_keys(self, dataset: str) -> set[str]: ...

    def paid_tokens(self, dataset: str) -> int:
        """Completion tokens of the kept turns of conversations with no record yet: paid, so spent
        from the budget (what the reconciler rebuilds the ledger's ``paid_tokens`` from)."""
        return sum(t.completion_tokens for key in self.progress_keys(dataset) if not self.has(dataset, key)
                   for t in getattr(self.progress(dataset, key), "turns", []))

    # -- provider batches (workers/batch.py) ------------------------------------------------
    @abstractmethod
    def put_batch(self, batch: BatchRecord) -> None:
        """Keep ``batch`` (replaced whole, atomically): under ``_batches/open/`` while it holds
        prompts, moved to ``_batches/closed/`` once ``closed``."""

    @abstractmethod
    def open_batch(self, batch_id: str) -> BatchRecord | None:
        """The open batch ``batch_id`` as stored now; None once it is closed (or unreadable)."""

    @abstractmethod
    def batches(self, *, closed: bool = False) -> list[BatchRecord]:
        """The open batches (or the closed ones), oldest first; an unreadable one is skipped."""

    def batched_keys(self, dataset: str) -> set[str]:
        """Keys of ``dataset`` an open batch holds: not to be queued or submitted again."""
        return {q.task.key for b in self.batches() if b.dataset == dataset for q in b.requests if q.state == "open"}

    # -- what only grows -----------------------------------------------------------------
    @abstractmethod
    def put_charge(self, charge: ChargeRecord) -> None:
        """Keep a paid generation no record carries, once (its id), before the spend counts it:
        the spend rebuilt from the store (records, kept turns, charges) is then the whole spend."""

    @abstractmethod
    def charges(self) -> list[ChargeRecord]:
        """Every kept charge, oldest first (an unreadable one is skipped)."""

    @abstractmethod
    def quarantine_location(self, dataset: str) -> str:
        """Where the dataset's quarantined lines are, for messages."""

    @abstractmethod
    def quarantined(self, dataset: str) -> Iterator[QuarantineEntry]: ...

    @abstractmethod
    def quarantine(self, dataset: str, entries: list[QuarantineEntry]) -> None:
        """Add rejects to the dataset's quarantine, every enqueue's and import's; a line rejected
        again for the same reason (a re-run) is kept once; two enqueues at once lose nothing."""

    @abstractmethod
    def log(self, event: DatasetEvent) -> None:
        """Add an operator's decision (a pivot, a drain, a budget) to the dataset's log; two
        commands at once cannot lose each other's."""

    @abstractmethod
    def events(self, dataset: str) -> list[DatasetEvent]:
        """The dataset's logged decisions, oldest first (an unreadable one is skipped)."""
