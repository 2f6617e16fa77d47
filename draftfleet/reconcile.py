"""The reconciler: rebuild the totals from the store (the truth) and correct Redis's counters.

A pass, per dataset: (1) every stored key missing from the counted set is counted through the
ledger's idempotent script (a worker died between storing and counting, or Redis lost its data);
(2) the counted set and the counters are read in one transaction and compared with the sums of
those same keys' records; any difference is drift, reported and corrected with increments (safe
while workers keep counting); (3) the paid turns of conversations not stored yet: every turn kept
in ``_progress/`` is marked as paid (a mark Redis lost is made again, its cost and tokens counted),
and ``paid_tokens`` is set to the sum of the marks of keys not counted; (4) reservations left by
dead workers (no claim, or another copy's) are dropped. Failure records of keys stored since are
deleted (a bucket's ``put`` leaves them). Each pass also aborts the store's stale uploads, and
counts into the spend, once each, the kept charges (paid generations no record carries).

After Redis lost its data the counters are not trusted until :func:`ensure_counters` has rebuilt
them: budget admission and the spend caps wait for it (``rk.COUNTERS_BUILT``), and so does enqueue.
Records are write-once, so each is read once and its figures cached for later passes. A record
file that cannot be read (empty, corrupt, a dangling link) is no result: it is set aside, so the
next ``enqueue`` sends its prompt again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger, SpendHold, micro_usd
from draftfleet.queues import lost_claims_settle_s
from draftfleet.schemas.records import ChargeRecord
from draftfleet.store import Store

FIELDS = ("responses", "prompt_tokens", "completion_tokens", "cost_micro_usd")
SET_ASIDE_CLAIM_S = 10
REBUILD_LOCK_S = 30
REBUILD_POLL_S = 0.2
log = logging.getLogger("draftfleet.reconcile")
# The marker vouches for the rebuild only if Redis kept its data while it ran (the same STATE stamp).
_MARK_BUILT = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""
_RELEASE_LOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_REFRESH_LOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end return 0"


class _TurnFigures(msgspec.Struct, frozen=True):
    """What a conversation's turn adds to the spend of the backend that paid it (``Ledger.count``)."""

    backend: str
    cost_usd: float


class _Figures(msgspec.Struct, frozen=True):
    """The part of a record the counters need (decoding only this is fast)."""

    key: str
    dataset: str
    backend: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    cost_source: str = "none"
    turns: list[_TurnFigures] = []


_figures = msgspec.json.Decoder(_Figures)


class Drift(msgspec.Struct, kw_only=True):
    dataset: str
    stored: int
    counted: int
    newly_counted: int
    corrections: dict[str, dict[str, int]]
    counted_not_stored: int
    stale_reservations: int
    unreadable: list[str]
    set_aside: list[str] = []
    paid_turns_marked: int = 0  # kept turns of conversations not stored whose paid mark was made again
    paid_tokens_corrected: int = 0
    newly_in_flight: int = 0  # of newly_counted: still claimed (stored, about to be counted by its worker)


class Reconciler:
    def __init__(self, store: Store, r: redis.Redis):
        self.store = store
        self.r = r
        self.ledger = Ledger(r)
        self._cache: dict[tuple[str, str], _Figures] = {}
        self._mark_built = r.register_script(_MARK_BUILT)
        self.rebuilt_records = 0  # stored records the last rebuild counted (none on a new fleet's store)

    def _read(self, dataset: str, keys: set[str], unreadable: list[str],
              broken: set[str] | None = None) -> dict[str, _Figures]:
        """Figures of these keys' records; ``broken`` collects keys whose file holds no record."""
        out = {}
        for key in keys:
            fig = self._cache.get((dataset, key))
            if fig is None:
                path = self.store.record_location(dataset, key)
                try:
                    fig = _figures.decode(self.store.record_bytes(dataset, key))
                except (FileNotFoundError, msgspec.DecodeError) as exc:
                    if broken is None:
                        unreadable.append(f"{path}: {exc}")
                    else:
                        broken.add(key)
                    continue
                except OSError as exc:
                    unreadable.append(f"{path}: {exc}")
                    continue
                self._cache[(dataset, key)] = fig
            out[key] = fig
        return out

    def _set_aside(self, dataset: str, key: str, unreadable: list[str]) -> str | Path | None:
        """Move a broken record file aside, holding the key's claim so that no worker is writing
        the key meanwhile. A file that reads well by now is left alone."""
        claim = rk.claim(dataset, key)
        token = f"reconciler@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
        path = self.store.record_location(dataset, key)
        if not self.r.set(claim, token, nx=True, ex=SET_ASIDE_CLAIM_S):
            unreadable.append(f"{path}: unreadable; a worker holds the key, left to it")
            return None
        try:
            self._cache[(dataset, key)] = _figures.decode(self.store.record_bytes(dataset, key))
            return None
        except (FileNotFoundError, msgspec.DecodeError):
            return self.store.set_aside(dataset, key)
        finally:
            with self.r.pipeline() as pipe:  # release the claim if it is still ours
                try:
                    pipe.watch(claim)
                    if pipe.get(claim) == token.encode():
                        pipe.multi()
                        pipe.delete(claim)
                        pipe.execute()
                except redis.WatchError:
                    pass  # it changed hands: not ours to delete

    def reconcile(self, dataset: str) -> Drift:
        """Count what the store holds and Redis does not, correct the counters to the records, and
        free the reservations of dead tasks: buried first (their claim gone), freed only after the
        store was listed and counted, so that the answer a task stored before it died is counted
        before its room goes back (``Ledger.settle_dead``)."""
        unreadable: list[str] = []
        broken: set[str] = set()
        self.ledger.bury_dead(dataset)
        buried_before = self.ledger.now_ms()
        keys = self.store.keys(dataset)
        for failure in self.store.all_failures(dataset):  # finished since (a bucket's put leaves it)
            if failure.key in keys:
                self.store.clear_failure(dataset, failure.key)
        records = self._read(dataset, keys, unreadable, broken)
        aside = []
        for key in sorted(broken):
            moved = self._set_aside(dataset, key, unreadable)
            if moved is not None:
                aside.append(str(moved))
                keys.discard(key)
            elif (dataset, key) in self._cache:  # it reads well by now
                records[key] = self._cache[(dataset, key)]
        counted_now = {m.decode() for m in self.r.smembers(rk.counted_set(dataset))}
        uncounted = sorted(keys - counted_now)
        pipe = self.r.pipeline(transaction=False)
        for key in uncounted:
            pipe.exists(rk.claim(dataset, key))
        # a key still claimed is a live worker's, whose tally counts it within moments (tally.py):
        # counted here all the same (it is stored), but no drift
        claimed = {key for key, held in zip(uncounted, pipe.execute() if uncounted else []) if held}
        newly = in_flight = 0
        for key in uncounted:
            if key in records and self.ledger.count(records[key], rate=False):  # made earlier: no rate
                newly += 1
                in_flight += key in claimed

        backends = {f.backend for f in records.values()} | set(self.ledger.totals(dataset))
        pipe = self.r.pipeline(transaction=True)
        pipe.smembers(rk.counted_set(dataset))
        pipe.hgetall(rk.dataset_totals(dataset))
        for b in sorted(backends):
            pipe.hgetall(rk.totals(dataset, b))
        counted_raw, ds_totals, *per_backend = pipe.execute()
        counted = {m.decode() for m in counted_raw}
        # Keys counted after the listing were stored before they were counted: read them now, so
        # the comparison runs over keys seen by both reads (else they look counted but not stored).
        late = {k for k in counted - keys if self.store.has(dataset, k)}
        records.update(self._read(dataset, late, unreadable))
        keys = keys | late  # (a backend first counted after the listing is compared next pass)

        want: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
        for key in counted & records.keys():
            f = records[key]
            w = want[f.backend]
            w["responses"] += 1
            w["prompt_tokens"] += f.prompt_tokens
            w["completion_tokens"] += f.completion_tokens
            w["cost_micro_usd"] += micro_usd(f.cost_usd)
        corrections: dict[str, dict[str, int]] = {}
        if unreadable:  # figures of unreadable records are unknown: report, correct nothing
            backends = set()
            want.clear()
            per_backend = []
        pipe = self.r.pipeline(transaction=True)
        for b, have_raw in zip(sorted(backends), per_backend):
            have = {k.decode(): int(v) for k, v in have_raw.items()}
            delta = {f: want[b][f] - have.get(f, 0) for f in FIELDS if want[b][f] != have.get(f, 0)}
            if delta:
                corrections[b] = delta
                for f, d in delta.items():
                    pipe.hincrby(rk.totals(dataset, b), f, d)
                if "cost_micro_usd" in delta:
                    pipe.hincrby(rk.spend(b), "cost_micro_usd", delta["cost_micro_usd"])
        have_ds = {k.decode(): int(v) for k, v in ds_totals.items()}
        for f in FIELDS if not unreadable else ():
            d = sum(w[f] for w in want.values()) - have_ds.get(f, 0)
            if d:
                corrections.setdefault("*", {})[f] = d
                pipe.hincrby(rk.dataset_totals(dataset), f, d)
        pipe.execute()

        remarked, paid = self._paid_turns(dataset)
        stale = self.ledger.settle_dead(dataset, buried_before) if not unreadable else 0
        return Drift(
            dataset=dataset, stored=len(keys), counted=len(counted), newly_counted=newly, newly_in_flight=in_flight,
            corrections=corrections, counted_not_stored=len(counted - keys), stale_reservations=stale,
            unreadable=unreadable, set_aside=aside, paid_turns_marked=remarked, paid_tokens_corrected=paid,
        )

    def _paid_turns(self, dataset: str) -> tuple[int, int]:
        """Mark every kept turn of a conversation not stored (a worker marks a turn before it keeps
        it, so an unmarked kept turn is one whose mark Redis lost), then rebuild ``paid_tokens``:
        (turns marked again, the correction made)."""
        remarked = 0
        for key in sorted(self.store.progress_keys(dataset)):
            kept = self.store.progress(dataset, key)
            if kept is None or self.store.has(dataset, key):
                continue
            marked = self.ledger.paid_marks(dataset, key)
            for i, turn in enumerate(kept.turns):
                if i not in marked:
                    remarked += self.ledger.prepay(dataset, key, i, turn.backend, turn.cost_usd, turn.completion_tokens,
                                                   paid_now=False)
        return remarked, self.ledger.rebuild_paid(dataset)

    def reconcile_all(self, datasets: list[str] | None = None) -> list[Drift]:
        """A pass over ``datasets`` (default: every dataset in the store), the kept charges, and the
        store's stale uploads aborted."""
        self.store.abort_stale_uploads()
        drifts = [self.reconcile(d) for d in (datasets or self.store.datasets())]
        self.count_charges()
        self.settle_spend_holds()
        return drifts

    def settle_spend_holds(self) -> int:
        """The spend holds of dead tasks (their claim gone; ledger.py, spend caps): where the cost
        is in the spend (the key counted, the turn prepaid) the hold just goes; else the request may
        have been billed, for at most what it held, so that is kept as a charge (``lost_in_flight``)
        and counted, in one step with the hold's removal: spent + held never drops. Run after the
        datasets' pass, which counted what the dead tasks stored. How many holds went."""
        prefix = rk.spend_held("")
        n = 0
        for name in self.r.scan_iter(match=rk.spend_held("*"), count=500):
            backend = name.decode()[len(prefix):]
            for hold_id, (micro, token) in self.ledger.spend_holds(backend).items():
                dataset, key, turn, ns = hold_id.rsplit(":", 3)
                if token.startswith(rk.BATCH_TOKEN_PREFIX):  # a provider batch's: its batch worker lets it go
                    if self.r.sismember(rk.counted_set(dataset), key):  # (its cost is in the spend)
                        n += self.ledger.spend_release(backend, SpendHold(hold_id, token, micro, 0))
                    continue
                if self.r.get(rk.claim(dataset, key)) == token.encode():
                    continue  # its task runs
                paid = self.r.sismember(rk.counted_set(dataset), key) or (
                    turn != "-" and self.r.hexists(rk.prepaid(dataset, key), turn))
                hold = SpendHold(hold_id, token, micro, 0)
                if paid:
                    n += self.ledger.spend_release(backend, hold)
                    continue
                charge = ChargeRecord(
                    id=f"{int(ns):020d}-{hashlib.sha256(f'{hold_id}:{token}'.encode()).hexdigest()[:12]}",
                    backend=backend, cost_usd=micro / 1_000_000, dataset=dataset, key=key, reason="lost_in_flight",
                    worker=rk.claim_holder(token),
                    at=int(ns) / 1e9)
                self.store.put_charge(charge)
                if self.ledger.spend_lose(backend, charge.id, hold_id, token, micro):
                    n += 1
                    log.warning("%s: a request of a dead task (%s %s) may have been billed: counted at the $%.4f "
                                "it held against the spend cap", backend, dataset, key[:12], micro / 1e6)
        return n

    def hold_batches(self) -> int:
        """Make again what the open provider batches hold (their records in the store): each open
        prompt's granted tokens against its budget and its worst cost against the spend cap. Redis
        lost them; the batches still run at the provider. How many prompts."""
        n = 0
        for batch in self.store.batches():
            for q in batch.open_requests():
                self.ledger.batch_hold(batch.dataset, q.task.key, q.granted)
                if q.hold_micro_usd:
                    self.ledger.spend_rehold(batch.backend, rk.batch_hold_id(batch.dataset, q.task.key, batch.id), rk.batch_token(batch.id),
                                             q.hold_micro_usd)
                n += 1
        return n

    def count_charges(self) -> int:
        """Count into the spend every kept charge not counted yet (once, by its id); how many."""
        return sum(self.ledger.charge(c) for c in self.store.charges())

    def rebuild(self) -> bool:
        """Rebuild every counter from the store (every dataset, the paid turns, the charges), then
        mark them built: True, unless Redis lost its data again meanwhile (the marker would then
        vouch for counters made partly before the loss: it is not set, and a rebuild runs again).

        Waits first for running workers to put their claims back (``queues.lost_claims_settle_s``),
        so that the reservations of what they generate now are made again (``Ledger.restore``)
        before anything is admitted: the flush loses the work in flight, never the budget."""
        time.sleep(lost_claims_settle_s(self.r))
        stamp = self.r.get(rk.STATE)
        self.hold_batches()
        drifts = self.reconcile_all()
        self.rebuilt_records = sum(d.newly_counted for d in drifts)
        for dataset in (d.dataset for d in drifts):  # the datasets the pass just listed: not listed again
            manifest = self.store.manifest(dataset)
            if manifest is not None and manifest.budget_tokens is not None:
                self.ledger.restore(dataset, manifest.settings.max_tokens)
        return bool(self._mark_built(keys=[rk.STATE, rk.COUNTERS_BUILT], args=[stamp or b""]))


def ensure_counters(store: Store, r: redis.Redis, *, wait: bool) -> bool:
    """Whether the counters are the store's (``rk.COUNTERS_BUILT``), rebuilding them when they are
    not: one process at a time, under ``rk.REBUILD_LOCK`` (refreshed while it runs). Admission and
    the spend caps never run on counters Redis lost (a flush would spend a closed budget twice).
    Without ``wait``, False while another process rebuilds; with it, returns once they are built."""
    ledger = Ledger(r)
    token = f"rebuild@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
    while not ledger.counters_built():
        if r.set(rk.REBUILD_LOCK, token, nx=True, ex=REBUILD_LOCK_S):
            done = threading.Event()
            keeper = threading.Thread(target=_keep_lock, args=(r, token, done), name="draftfleet-rebuild", daemon=True)
            keeper.start()
            try:
                log.info("the counters are not the store's (Redis lost its data, or is new): rebuilding them "
                         "from %s before admitting any budget or spend", store.location)
                rebuilder = Reconciler(store, r)
                if rebuilder.rebuild() and rebuilder.rebuilt_records:  # a new fleet's empty store says nothing
                    log.warning("Redis had lost the counters: rebuilt from %s (%d stored records counted again) "
                                "before admitting any budget or spend", store.location, rebuilder.rebuilt_records)
            finally:
                done.set()
                keeper.join()
                r.eval(_RELEASE_LOCK, 1, rk.REBUILD_LOCK, token)
        elif not wait:
            return False
        else:
            time.sleep(REBUILD_POLL_S)
    return True


def _keep_lock(r: redis.Redis, token: str, done: threading.Event) -> None:
    """Refresh the rebuild lock while its holder runs (a large store takes minutes to read)."""
    while not done.wait(REBUILD_LOCK_S / 3):
        try:
            r.eval(_REFRESH_LOCK, 1, rk.REBUILD_LOCK, token, REBUILD_LOCK_S)
        except redis.RedisError:
            continue
