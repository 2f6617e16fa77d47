"""Fast counters and budget admission in Redis; the store stays the truth.

Counting is idempotent: one Lua script adds the key to the dataset's counted set and bumps the
totals only if it was not there, so a redelivered task, or a worker that stored a record and died
before counting it (the next copy finds the record and counts it), never counts twice. The same
script settles the key's budget reservation, so committed and reserved tokens move together.
A conversation's turns count against the budget the moment each is paid (``prepay``: the
dataset's ``paid_tokens``), before its record exists; counting the record moves them into the
totals. Admission's committed tokens are the counted ones plus those.

The budget's rule, exact by construction (RELIABILITY.md says it in one paragraph). Before it
generates, a task reserves the most it can make: its max_tokens (times the turns it has left). It
is admitted while committed + reserved + that stays within the budget; where less is left, but at
least ``floor`` (1% of the budget, never more than the task's max_tokens), it reserves exactly
what is left and is asked with that as its max_tokens, so its answer stops there and is stored as
cut (``truncated``). Counting a result replaces its reservation by what it made, never more. So
committed + reserved never passes the budget, and neither does what is stored; while prompts
remain, what comes back short frees room for the next, until less than the floor is left and
nothing is in flight: the dataset is then full (closed), within 1% of its budget. Nothing is
estimated: no running mean, no margin, no closing round. A dataset may ask for whole answers
instead (``budget_rule = "whole"``): admitted while any room is left, at its full max_tokens, it
ends over its budget by less than one answer.

Admission runs only on counters the store vouches for: ``rk.COUNTERS_BUILT`` is set by the rebuild
from the store alone (reconcile.py) and goes with everything else when Redis loses its data, so
a flushed Redis answers LOST instead of admitting on counters back at zero (which would spend a
closed budget a second time); the spend caps are checked the same way (:meth:`Ledger.spend_known`).
After the rebuild each running task's reservation is made again at the most it can make
(:meth:`Ledger.restore`), never less than it was granted.

Redis work per admission does not grow with what is in flight: the reserved total is kept beside
the entries, and each reservation sits in a sorted set at the time its claim is looked at next. An
admission handles only the due entries (at most ``EXPIRE_BATCH``): a reservation whose claim is
gone (its worker died) or is another copy's is dropped, a live one is looked at again a claim TTL
later. A reservation belongs to the claim it was taken under: only that claim's task releases it,
so a stale copy (its claim lapsed, the key claimed again) never frees the reservation of the copy
that runs now.

Leases: far from the budget a worker reserves for many tasks in one step (:meth:`Ledger.lease`,
workers/leases.py): one reservation of n slots, each its tasks' max_tokens, granted only while the
n slots fit in half of the room left. Each result counted takes its slot out (``COUNT_BATCH``, once
per key however often the batch runs), slots left unused go back (:meth:`Ledger.lease_return`),
and a lease belongs to its claim like any reservation (its worker dead, it lapses). A slot holds
the most its task can make, so leased work obeys the same rule.
"""

from __future__ import annotations

import time

import msgspec
import redis

from draftfleet import redis_keys as rk
from draftfleet.ledger_scripts import (ADMIT, BATCH_HOLD, BATCH_TAKE, BATCH_UNHOLD, BUDGET_FIELDS, CHARGE, CLAIM_ADMIT, COUNT_BATCH, COUNT_ONCE, BURY_DEAD,
                                       LEASE, LEASE_RETURN, PREPAY, PURGE, REBUILD_PAID, RELEASE, RESTORE, SETTLE_DEAD,
                                       SPEND_HOLD, SPEND_LOSE, SPEND_REHOLD, SPEND_RELEASE)
from draftfleet.schemas.config import BudgetRule
from draftfleet.schemas.records import ChargeRecord, ResponseRecord

RATE_BUCKET_S = 10
RATE_KEEP_S = 900
# Due reservations handled by one admission (the rest by the next ones), so none waits on a backlog.
EXPIRE_BATCH = 64
# When to look again at a reservation whose claim has no TTL (claims always have one in the fleet).
RECHECK_MS = 30_000


# LOST: the counters are not known to be the store's (``rk.COUNTERS_BUILT`` is gone): rebuild them first.
ADMITTED, WAIT, REFUSED, CLOSED, LOST = 1, 2, 0, -1, -2
CLAIMED = -3  # claim_admit: another task holds the key's claim (nothing reserved)
NO_LEASE = -4  # lease: no slots granted (too near the budget): admit task by task
FLOOR_FRACTION = 100  # near the end, less than budget / 100 left is not worth a task: the dataset is full


def floor_tokens(budget: int, want: int) -> int:
    """The least admission grants a task near the end (``want``: its max_tokens x turns left): 1% of
    the budget, never more than the task would ask. A dataset stops within that of its budget."""
    return max(1, min(want, budget // FLOOR_FRACTION))


def publish_value(budget: int | None, rule: BudgetRule = "exact") -> str:
    """The budget as ``rk.BUDGETS`` holds it: what admission parses, and a lease compares (assign.py)."""
    if budget is None:
        return "none"
    return f"{budget} whole" if rule == "whole" else str(budget)


class Admission(msgspec.Struct, frozen=True):
    """A task's admission: the verdict, the tokens it may make (its max_tokens now: less than the
    dataset's near the end), and the budget as admission read it (``rk.BUDGETS``'s value)."""

    verdict: int
    granted: int = 0
    budget: str = ""
    buried: int = 0  # WAIT: reservations whose claim is gone, held until the store is counted (settle_dead)


class SpendHold(msgspec.Struct, frozen=True):
    """The most one paid request can cost, held against its backend's spend cap while it runs
    (:meth:`Ledger.spend_hold`): its id, the claim token it is held under, the micro-USD held, and
    the max_tokens it may be asked with (less than the task's near the cap)."""

    id: str
    token: str
    micro_usd: int
    max_tokens: int


class BudgetUse(msgspec.Struct, frozen=True, kw_only=True):
    """What a dataset's budget has spent and has left, as admission counts it (:func:`budget_use`).

    Admission and every view (status, plan, metrics, report, inventory) take the figure from
    here, so that a view never promises room that admission refuses."""

    budget_tokens: int | None
    stored_tokens: int  # completion tokens of the dataset's stored (counted) records, every version
    paid_tokens: int  # tokens of the paid turns of conversations with no record yet (kept in _progress/)
    spent_tokens: int  # the two together: what admission counts as committed
    left_tokens: int | None  # the budget less what is spent (None: no budget)
    floor_tokens: int  # the least admission grants a prompt near the end (:func:`floor_tokens`)
    rule: BudgetRule = "exact"  # exact: never above (answers cut at the end); whole: over by < one answer
    full: bool  # less than the floor is left: admission refuses the next prompt and the dataset closes


def budget_use(budget: int | None, stored: int, paid: int, max_tokens: int, rule: BudgetRule = "exact") -> BudgetUse:
    """The one definition of a budget's use: spent = stored records + paid turns not stored; full
    once less than the floor is left (whole answers: once nothing is left). Reserved tokens are
    in flight, not spent: they may come back short, so they never make a dataset full."""
    spent = stored + paid
    left = None if budget is None else max(0, budget - spent)
    floor = 0 if budget is None else floor_tokens(budget, max_tokens)
    full = left is not None and (left <= 0 if rule == "whole" else left < floor)
    return BudgetUse(budget_tokens=budget, stored_tokens=stored, paid_tokens=paid, spent_tokens=spent,
                     left_tokens=left, floor_tokens=floor, rule=rule, full=full)


def _text(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def _admission(out: list) -> Admission:
    return Admission(int(out[0]), int(out[1]), _text(out[2]), int(out[3]))


def micro_usd(cost: float) -> int:
    return int(round(cost * 1_000_000))


def _decode_hash(h: dict) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in h.items()}


class Ledger:
    def __init__(self, client: redis.Redis):
        self.r = client
        self._count = client.register_script(COUNT_ONCE)
        self._admit = client.register_script(ADMIT)
        self._purge = client.register_script(PURGE)
        self._release = client.register_script(RELEASE)
        self._bury_dead = client.register_script(BURY_DEAD)
        self._settle_dead = client.register_script(SETTLE_DEAD)
        self._spend_hold = client.register_script(SPEND_HOLD)
        self._spend_release = client.register_script(SPEND_RELEASE)
        self._spend_lose = client.register_script(SPEND_LOSE)
        self._prepay = client.register_script(PREPAY)
        self._rebuild_paid = client.register_script(REBUILD_PAID)
        self._charge = client.register_script(CHARGE)
        self._restore = client.register_script(RESTORE)
        self._claim_admit = client.register_script(CLAIM_ADMIT)
        self._count_batch = client.register_script(COUNT_BATCH)
        self._lease = client.register_script(LEASE)
        self._lease_return = client.register_script(LEASE_RETURN)
        self._batch_hold = client.register_script(BATCH_HOLD)
        self._batch_take = client.register_script(BATCH_TAKE)
        self._batch_unhold = client.register_script(BATCH_UNHOLD)
        self._spend_rehold = client.register_script(SPEND_REHOLD)

    # -- counting --------------------------------------------------------------------------
    def count(self, record: ResponseRecord, now: float | None = None, *, rate: bool = True) -> bool:
        """Add a stored record to the totals (and free its reservation); False if already counted.

        A conversation's turns go to the spend of the backend that paid each, except those
        :meth:`prepay` added when they were paid; the tokens its marks hold leave ``paid_tokens``,
        now in the totals (the marks are consumed, also when the key was counted before): each paid
        turn is in the spend once and in the budget once, whether its conversation is stored or not.

        ``rate``: the record was made just now by the backend it names, so it is a sample of that
        backend's speed (the 10-second rate buckets, and its busy time: the union of its requests'
        intervals, ``busy_ms`` over ``busy_tokens`` in its totals). Records brought in by
        ``import`` or counted late by the reconciler are no backend's rate: ``rate=False``.

        A provider batch's answers are counted by :meth:`count_batch_answers` (their grants held by
        the batch go with the count); counted here (the reconciler's pass), a batch answer's grant
        stays held until its batch worker counts it too.
        """
        bucket = int((now or time.time()) // RATE_BUCKET_S)
        end_ms = int(record.created_at * 1000) if rate else 0
        start_ms = end_ms - int(record.latency_s * 1000) if rate else 0
        turns = getattr(record, "turns", None) or []
        conversation = [rk.prepaid(record.dataset, record.key), rk.paid_keys(record.dataset),
                        *(rk.spend(t.backend) for t in turns)] if turns else []
        costs = [micro_usd(t.cost_usd) for t in turns]
        added = self._count(
            keys=[rk.counted_set(record.dataset), rk.totals(record.dataset, record.backend), rk.spend(record.backend),
                  rk.dataset_totals(record.dataset), rk.reservations(record.dataset),
                  rk.rate(record.dataset, record.backend, bucket), *self._reservation_index(record.dataset),
                  *conversation],
            args=[record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd), RATE_KEEP_S,
                  int(getattr(record, "latency_s", 0.0) * 1000), end_ms, start_ms,
                  # a batch answer's cost is the batch price: not the backend's measured sync price
                  int(getattr(record, "cost_source", "none") == "provider" and not getattr(record, "batch_id", None)),
                  *costs],
        )
        return bool(added)

    def count_batch_answers(self, answers: list[tuple[ResponseRecord, SpendHold | None]], most: int = 256) -> int:
        """A provider batch's stored answers counted, ``most`` a step (``COUNT_BATCH``), each as
        :meth:`count` (``rate=False``) counts one: its tokens and cost to the totals and the spend once, the grant its batch held (:meth:`batch_hold`) gone (also for a key counted
        before), its spend hold, where it has one, let go in the same step as its cost enters the
        spend. Single answers of one backend and dataset. How many were newly counted. What a batch
        answer costs the shared Redis: a few commands, not ``COUNT_ONCE`` and ``SPEND_RELEASE`` each."""
        if not answers:
            return 0
        backend, dataset = answers[0][0].backend, answers[0][0].dataset
        added = 0
        for i in range(0, len(answers), most):
            recs, held = [], False
            for record, hold in answers[i:i + most]:
                if record.backend != backend or record.dataset != dataset or getattr(record, "turns", None):
                    raise ValueError("count_batch_answers takes single answers of one backend and dataset")
                recs.append([record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd),
                             int(record.latency_s * 1000), 0, 0, 0, "", int(record.truncated), "", 0,
                             [] if hold is None else [[hold.id, hold.token]]])
                held = held or hold is not None
            keys = [rk.spend(backend), rk.counted_set(dataset), rk.totals(dataset, backend), rk.dataset_totals(dataset),
                    rk.reservations(dataset), *self._reservation_index(dataset), rk.rate(dataset, backend, 0),
                    rk.events(dataset)]
            if held:
                keys += [rk.spend_held(backend), rk.spend_held_sum(backend)]
            body = msgspec.json.encode([[rk.claim(dataset, ""), recs, rk.lease_taken_prefix(dataset),
                                         rk.prepaid(dataset, ""), rk.paid_keys(dataset)]])
            added += int(self._count_batch(keys=keys, args=[RATE_KEEP_S, body]))
        return added

    def count_batch(self, results: list[tuple[ResponseRecord, str]] | list[tuple[ResponseRecord, str, str, int]]
                    | list[tuple[ResponseRecord, str, str, int, list[SpendHold]]], now: float | None = None) -> int:
        """Count many stored single-answer records in one step (``COUNT_BATCH``), each as
        :meth:`count` with ``rate=True`` does, and release each one's claim under its token:
        ``results`` is (record, claim token[, lease name ('' for none), the lease's cap a slot[, its
        spend holds]]) in the order they were stored, all of one backend; a record admitted under a
        lease takes its slot out of it, and a paid one's spend holds (:meth:`spend_hold`) go in the
        same step as its cost enters the spend (each once, only under its own token: as
        :meth:`spend_release`, never before the cost is in). How many were newly counted. The
        counters are written once per batch and dataset, not once per record: what a stored result
        costs the shared Redis (issue 32)."""
        if not results:
            return 0
        backend = results[0][0].backend
        bucket = int((now or time.time()) // RATE_BUCKET_S)
        groups: dict[str, list] = {}
        held = False
        for record, token, *rest in results:
            if record.backend != backend or getattr(record, "turns", None):
                raise ValueError("count_batch takes single answers of one backend")
            lease_name, slot = (rest[0], rest[1]) if len(rest) >= 2 else ("", 0)
            holds = rest[2] if len(rest) >= 3 else ()
            end_ms = int(record.created_at * 1000)
            rec = [record.key, record.prompt_tokens, record.completion_tokens, micro_usd(record.cost_usd),
                   int(record.latency_s * 1000), end_ms, end_ms - int(record.latency_s * 1000),
                   int(record.cost_source == "provider"), token, int(record.truncated), lease_name or "", slot or 0]
            if holds:
                rec.append([[h.id, h.token] for h in holds])
                held = True
            groups.setdefault(record.dataset, []).append(rec)
        keys = [rk.spend(backend)]
        for dataset in groups:
            keys += [rk.counted_set(dataset), rk.totals(dataset, backend), rk.dataset_totals(dataset),
                     rk.reservations(dataset), *self._reservation_index(dataset), rk.rate(dataset, backend, bucket),
                     rk.events(dataset)]
        if held:
            keys += [rk.spend_held(backend), rk.spend_held_sum(backend)]
        body = msgspec.json.encode([[rk.claim(d, ""), recs, rk.lease_taken_prefix(d)] for d, recs in groups.items()])
        return int(self._count_batch(keys=keys, args=[RATE_KEEP_S, body]))

    def prepay(self, dataset: str, key: str, turn: int, backend: str, cost_usd: float, tokens: int,
               *, paid_now: bool = True) -> bool:
        """Count a conversation's turn as soon as it is paid: its cost in ``backend``'s spend, its
        ``tokens`` against the dataset's budget (``paid_tokens``), and a mark so that counting the
        stored record moves the tokens to the totals and does not add the cost again. Whether the
        turn was newly marked.

        The turns of a conversation handed back between turns, paused, failed at a later turn or
        stopped by the budget were paid all the same: the spend cap and budget admission must see
        them now, not only once (if ever) the record is stored. The tokens count once per (key,
        turn); the cost counts every time it was paid (``paid_now``: a worker that paid it), else
        (the reconciler, from a kept turn whose mark Redis lost) only with a new mark.
        """
        return bool(self._prepay(
            keys=[rk.spend(backend), rk.prepaid(dataset, key), rk.dataset_totals(dataset), rk.paid_keys(dataset),
                  rk.counted_set(dataset)],
            args=[turn, micro_usd(cost_usd), tokens, key, int(paid_now)],
        ))

    def batch_hold(self, dataset: str, key: str, tokens: int) -> bool:
        """Hold ``tokens`` of the budget for a prompt submitted in a provider batch, as a paid turn
        is held (``paid_tokens``, its mark "b"; its share ``batch_held`` is what admission waits on as
        in flight): no claim keeps it, so no worker's death, lapse or lease frees it; counting its answer moves it to the totals (:meth:`count_batch_answers`),
        :meth:`batch_unhold` gives it back. Made again from the store after Redis lost it."""
        return bool(self._batch_hold(
            keys=[rk.counted_set(dataset), rk.prepaid(dataset, key), rk.dataset_totals(dataset), rk.paid_keys(dataset)],
            args=[key, tokens]))

    def batch_take(self, dataset: str, key: str, tokens: int, token: str, reserved: bool) -> bool:
        """:meth:`batch_hold`, then the reservation the claim ``token`` took settled (``reserved``) and
        the claim let go, in one round trip: a batched prompt's grant passes from its claim to its batch."""
        return bool(self._batch_take(
            keys=[rk.counted_set(dataset), rk.prepaid(dataset, key), rk.dataset_totals(dataset), rk.paid_keys(dataset),
                  rk.reservations(dataset), *self._reservation_index(dataset), rk.claim(dataset, key)],
            args=[key, tokens, token, int(reserved)]))

    def batch_unhold(self, dataset: str, key: str) -> bool:
        return bool(self._batch_unhold(keys=[rk.prepaid(dataset, key), rk.dataset_totals(dataset), rk.paid_keys(dataset)],
                                       args=[key]))

    def spend_rehold(self, backend: str, hold_id: str, token: str, micro: int) -> bool:
        """A batch request's hold made again as its record in the store has it (Redis lost it)."""
        return bool(self._spend_rehold(keys=[rk.spend_held(backend), rk.spend_held_sum(backend)],
                                       args=[hold_id, micro, token]))

    def rebuild_paid(self, dataset: str) -> int:
        """Set ``paid_tokens`` to the sum of the marks of conversations not counted (dropping the
        marks of counted ones); the correction made."""
        return int(self._rebuild_paid(keys=[rk.paid_keys(dataset), rk.counted_set(dataset), rk.dataset_totals(dataset)],
                                      args=[rk.prepaid(dataset, "")]))

    def paid_marks(self, dataset: str, key: str) -> set[int]:
        """The turns of a conversation marked as paid."""
        return {int(t) for t in self.r.hkeys(rk.prepaid(dataset, key)) if t.isdigit()}  # "b": a batch's hold

    def charge(self, charge: ChargeRecord) -> bool:
        """Add a generation no stored record carries (a twin stored the key first, or an answer
        billed but unusable: empty, not re-tokenizable) to the backend's spend, once by its id:
        it was paid for, and the spend cap must see it. The caller keeps it in the store first
        (``Store.put_charge``), so that the spend rebuilt after Redis lost it holds it too. (A
        conversation's turns are added as they are paid: :meth:`prepay`.) Whether it was new."""
        return bool(self._charge(keys=[rk.CHARGED, rk.spend(charge.backend)], args=[charge.id, micro_usd(charge.cost_usd)]))

    # -- spend caps ------------------------------------------------------------------------
    def spend_hold(self, backend: str, dataset: str, key: str, turn: int | None, token: str, prompt_micro: float,
                   out_micro_per_token: float, max_tokens: int, cap_usd: float,
                   hold_id: str | None = None) -> tuple[int, SpendHold | None]:
        """Hold the most a paid request can cost against ``backend``'s cap, as admission reserves a
        budget: ``prompt_micro`` (its prompt's worst case) + ``out_micro_per_token`` x ``max_tokens``,
        or, within 1% of the cap, the max_tokens that fit. (ADMITTED, the hold), or (WAIT | REFUSED |
        LOST, None): what is in flight may cost less; the cap is reached; the counters are not the
        store's. The hold is released once the request's cost is in the spend
        (:meth:`spend_release`); a dead task's is charged at what it held (the reconciler)."""
        hold_id = hold_id or f"{dataset}:{key}:{'-' if turn is None else turn}:{time.time_ns()}"
        cap = micro_usd(cap_usd)
        out = self._spend_hold(keys=[rk.spend(backend), rk.spend_held(backend), rk.spend_held_sum(backend),
                                     rk.COUNTERS_BUILT],
                               args=[hold_id, token, repr(float(prompt_micro)), repr(float(out_micro_per_token)),
                                     max_tokens, cap, max(1, cap // FLOOR_FRACTION)])
        verdict = int(out[0])
        return verdict, SpendHold(hold_id, token, int(out[2]), int(out[1])) if verdict == ADMITTED else None

    def spend_release(self, backend: str, hold: SpendHold) -> bool:
        return bool(self._spend_release(keys=[rk.spend_held(backend), rk.spend_held_sum(backend)],
                                        args=[hold.id, hold.token]))

    def spend_holds(self, backend: str) -> dict[str, tuple[int, str]]:
        """Every hold of ``backend``: id -> (micro-USD, claim token)."""
        out = {}
        for k, v in self.r.hgetall(rk.spend_held(backend)).items():
            micro, _, token = v.decode().partition(":")
            out[k.decode()] = (int(micro), token)
        return out

    def spend_held_usd(self, backend: str) -> float:
        return int(self.r.hget(rk.spend_held_sum(backend), "r") or 0) / 1_000_000

    def spend_lose(self, backend: str, charge_id: str, hold_id: str, token: str, micro: int) -> bool:
        """A dead task's hold into the spend as the charge ``charge_id`` (kept in the store first)."""
        return bool(self._spend_lose(keys=[rk.CHARGED, rk.spend(backend), rk.spend_held(backend),
                                           rk.spend_held_sum(backend)], args=[charge_id, micro, hold_id, token]))

    def counters_built(self) -> bool:
        """Whether the counters were rebuilt from the store since Redis last lost its data
        (``rk.COUNTERS_BUILT``): only then do admission and the spend caps trust them."""
        return bool(self.r.exists(rk.COUNTERS_BUILT))

    def event(self, dataset: str, name: str, n: int = 1) -> None:
        """Count a retry, failure or skip by reason (``retry:http_429``, ``failed:timeout``...)."""
        self.r.hincrby(rk.events(dataset), name, n)

    def events(self, dataset: str) -> dict[str, int]:
        return _decode_hash(self.r.hgetall(rk.events(dataset)))

    # -- budgets ---------------------------------------------------------------------------
    def budget_use(self, dataset: str, budget: int | None, max_tokens: int, turns: int = 1,
                   rule: BudgetRule = "exact") -> BudgetUse:
        """The dataset's budget as admission sees it now (``max_tokens``: its tasks'; ``turns``: the
        answers of the next prompt, a new conversation's turns)."""
        t = self.dataset_totals(dataset)
        stored, paid = (t.get(f, 0) for f in BUDGET_FIELDS)
        # what open provider batches hold is in flight, not spent (it may come back short)
        return budget_use(budget, stored, paid - t.get("batch_held", 0), max_tokens * turns, rule)

    def _admission_keys(self, dataset: str) -> list[str]:
        return [rk.dataset_totals(dataset), rk.reservations(dataset), rk.closed(dataset),
                rk.reservations_due(dataset), rk.reserved_sum(dataset), rk.BUDGETS, rk.COUNTERS_BUILT,
                rk.reservations_dead(dataset)]

    def _args(self, dataset: str, key: str, token: str, budget: int, want: int) -> list:
        return [key, budget, want, rk.claim(dataset, ""), RECHECK_MS, EXPIRE_BATCH, dataset, token, FLOOR_FRACTION]

    def admit(self, dataset: str, key: str, token: str, budget: int, want: int) -> Admission:
        """Reserve for the task holding ``key``'s claim under ``token`` the most it can make, ``want``
        (its max_tokens x turns left), or what is left of the budget where that is less (but at
        least the floor): ADMITTED with the tokens granted (the task's max_tokens now), WAIT (what
        is in flight may come back short), REFUSED (this call found the dataset full and closed
        it), CLOSED, or LOST (the counters were not rebuilt from the store since Redis lost its
        data: nothing is admitted on them). The reservation is the claim's (released by it,
        dropped once it is gone). ``budget`` counts only while the dataset has no published
        budget (assign.py)."""
        out = self._admit(keys=self._admission_keys(dataset), args=self._args(dataset, key, token, budget, want))
        return _admission(out)

    def claim_admit(self, dataset: str, key: str, token: str, ttl_s: int, budget: int, want: int) -> Admission:
        """Claim ``key`` under ``token`` (``SET NX EX ttl_s``) and admit it, in one round trip:
        CLAIMED when another task holds the claim (nothing reserved), else :meth:`admit`'s answer
        with the claim held (the caller releases it, as after ``acquire``)."""
        out = self._claim_admit(keys=self._admission_keys(dataset),
                                args=[*self._args(dataset, key, token, budget, want), ttl_s])
        return _admission(out)

    def lease(self, dataset: str, name: str, token: str, ttl_s: int, budget: int, slots: int,
              cap: int) -> tuple[int, int, str]:
        """Claim the lease ``name`` under ``token`` and reserve up to ``slots`` tasks of at most ``cap``
        tokens each, in one step (``LEASE``): (verdict, slots granted, the budget as published).
        ADMITTED with slots: the lease is held (its claim refreshed by the worker's beat); NO_LEASE,
        CLOSED or LOST: nothing held, admit task by task; ADMITTED with none: the dataset has no
        budget any more, or takes whole answers (admitted one by one)."""
        out = self._lease(keys=self._admission_keys(dataset),
                          args=[*self._args(dataset, name, token, budget, cap), ttl_s, slots])
        return int(out[0]), int(out[1]), _text(out[2])

    def lease_return(self, dataset: str, name: str, token: str, tokens: int) -> None:
        """Give back ``tokens`` of the lease ``name`` (slots its worker will not use), only while it
        is the one taken under ``token``; spent, the lease's reservation and claim are dropped (as
        when ``COUNT_BATCH`` counts its last slot)."""
        self._lease_return(keys=[rk.reservations(dataset), *self._reservation_index(dataset)],
                           args=[name, tokens, token, rk.claim(dataset, ""), rk.lease_taken_prefix(dataset)])

    def published_budget(self, dataset: str) -> str:
        """The budget as admission reads it now (``rk.BUDGETS``; '' when none was published)."""
        return _text(self.r.hget(rk.BUDGETS, dataset))

    @staticmethod
    def _reservation_index(dataset: str) -> list[str]:
        return [rk.reservations_due(dataset), rk.reserved_sum(dataset)]

    def release(self, dataset: str, key: str, token: str) -> None:
        """Settle the reservation the task holding the claim ``token`` took (it ends without a
        counted result); one another copy of the key took since is left alone."""
        self._release(keys=[rk.reservations(dataset), *self._reservation_index(dataset)], args=[key, token])

    def restore(self, dataset: str, max_tokens: int) -> int:
        """Reserve again for every key of ``dataset`` a running task holds with no reservation (Redis
        lost them, and the worker's heartbeat put its claims back): ``max_tokens`` (the most a task
        of it can make, x the turns of a conversation), never less than it was granted; how many."""
        prefix = rk.claim(dataset, "")
        held = [k.decode()[len(prefix):] for k in self.r.scan_iter(match=prefix + "*", count=1000)]
        held = [k for k in held if not rk.is_lease(k)]  # a lease's tasks hold claims of their own, restored here
        keys = [rk.reservations(dataset), *self._reservation_index(dataset), rk.counted_set(dataset)]
        return sum(int(self._restore(keys=keys, args=[k, max_tokens, 0, prefix, RECHECK_MS])) for k in held)

    def bury_dead(self, dataset: str) -> int:
        """Bury every reservation whose claim is gone or held by another copy (a full pass, for the
        reconciler, before it counts the store): held, no longer any claim's, until
        :meth:`settle_dead`; how many."""
        entries = {k.decode(): v.decode() for k, v in self.r.hgetall(rk.reservations(dataset)).items()}
        entries = {k: v for k, v in entries.items() if not v.endswith(":")}  # buried already
        pipe = self.r.pipeline(transaction=False)
        for k in entries:
            pipe.get(rk.claim(dataset, k))
        dead = [k for (k, v), holder in zip(entries.items(), pipe.execute())
                if holder is None or v.split(":", 1)[-1] != holder.decode()]
        keys = [*self._dead_keys(dataset)]
        return sum(int(self._bury_dead(keys=keys, args=[k, rk.claim(dataset, "")])) for k in dead)

    def settle_dead(self, dataset: str, before_ms: int) -> int:
        """Free the reservations buried at or before ``before_ms`` (Redis's clock, :meth:`now_ms`) and
        still buried: call it once a pass over the store that began after ``before_ms`` has counted
        every answer stored (the answer of a buried reservation's task, if any, settled it); how
        many. Buried, a reservation never frees room on its own: a worker killed between storing an
        answer and counting it (or a tally that gave up counting) cannot let the budget pass."""
        return int(self._settle_dead(keys=self._dead_keys(dataset), args=[before_ms]))

    def now_ms(self) -> int:
        """Redis's clock (the one the scripts stamp burials with), in milliseconds."""
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    def buried(self, dataset: str) -> int:
        return int(self.r.zcard(rk.reservations_dead(dataset)))

    @staticmethod
    def _dead_keys(dataset: str) -> list[str]:
        return [rk.reservations(dataset), rk.reservations_due(dataset), rk.reserved_sum(dataset),
                rk.reservations_dead(dataset)]

    def closed_at(self, dataset: str) -> int | None:
        """The budget the dataset was closed at, or None when it is open."""
        v = self.r.get(rk.closed(dataset))
        return int(v) if v is not None else None

    def reopen(self, dataset: str) -> None:
        self.r.delete(rk.closed(dataset))

    def purge_closed(self, dataset: str) -> int | None:
        """Drop the queued tasks of a closed dataset, but for conversations with paid turns (each
        comes once more, to be stopped with its turns kept): how many; None if it is open again."""
        n = int(self._purge(keys=[rk.closed(dataset), rk.queue(dataset), rk.paid_keys(dataset)]))
        return None if n < 0 else n

    # -- reading ---------------------------------------------------------------------------
    def spend_usd(self, backend: str) -> float:
        return int(self.r.hget(rk.spend(backend), "cost_micro_usd") or 0) / 1_000_000

    def spend_known(self, backend: str) -> float | None:
        """The backend's spend, in one round trip with whether the counters are the store's; None
        when they are not (Redis lost them): a spend cap must not be checked against them."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(rk.spend(backend), "cost_micro_usd")
        pipe.exists(rk.COUNTERS_BUILT)
        spent, built = pipe.execute()
        return int(spent or 0) / 1_000_000 if built else None

    def dataset_totals(self, dataset: str) -> dict[str, int]:
        return _decode_hash(self.r.hgetall(rk.dataset_totals(dataset)))

    def all_totals(self, dataset: str = "*") -> dict[str, dict[str, dict[str, int]]]:
        """Counters by dataset, then backend, in one scan (dataset names never hold a colon)."""
        keys = list(self.r.scan_iter(match=rk.totals_pattern(dataset), count=500))
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        out: dict[str, dict[str, dict[str, int]]] = {}
        prefix = len(rk.totals("", "")) - 1
        for key, values in zip(keys, pipe.execute()):
            name, backend = key.decode()[prefix:].split(":", 1)
            out.setdefault(name, {})[backend] = _decode_hash(values)
        return out

    def totals(self, dataset: str) -> dict[str, dict[str, int]]:
        """Counters of one dataset, by backend."""
        return self.all_totals(dataset).get(dataset, {})

    def rates(self, dataset: str, backends: list[str], windows: list[int],
              now: float | None = None) -> dict[str, list[float]]:
        """Completion tokens per second of each backend over each window (seconds), in one round trip.

        A window longer than the dataset's run so far (since the first bucket in which any of its
        backends counted a response) is measured over the run's age instead: a run two minutes old
        must not read as a fifth of its speed over a ten-minute window.
        """
        now = time.time() if now is None else now
        last = int(now // RATE_BUCKET_S)
        n = RATE_KEEP_S // RATE_BUCKET_S
        first_bucket = last - n + 1
        pipe = self.r.pipeline(transaction=False)
        for backend in backends:
            for b in range(first_bucket, last + 1):
                pipe.hget(rk.rate(dataset, backend, b), "completion_tokens")
        values = [int(v or 0) for v in pipe.execute()]
        per = {backend: values[k * n:(k + 1) * n] for k, backend in enumerate(backends)}
        started = min((i for tokens in per.values() for i, v in enumerate(tokens) if v), default=0)
        # the oldest kept bucket: the run is at least that old; never less than one bucket
        age = float("inf") if started == 0 else max(RATE_BUCKET_S, now - (first_bucket + started) * RATE_BUCKET_S)
        out = {}
        for backend, tokens in per.items():
            out[backend] = [sum(tokens[n - max(1, w // RATE_BUCKET_S):]) / min(age, max(1, w // RATE_BUCKET_S) * RATE_BUCKET_S)
                            for w in windows]
        return out
