"""The ledger's Lua scripts against a real Redis: idempotent counting and budget admission."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import ADMITTED, CLOSED, LOST, REFUSED, WAIT, Ledger, floor_tokens
from draftfleet.schemas.records import Message, ResponseRecord, Usage


def _rec(key: str, tokens: int) -> ResponseRecord:
    return ResponseRecord(
        key=key, dataset="ds", source="f:1", settings_id="s", messages=[Message(role="user", content="q")],
        system_prompt_used=False, text="t", output_ids=[1] * tokens, prompt_tokens=5, completion_tokens=tokens,
        finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu", model="m", token_source="exact",
        usage=Usage(), cost_usd=0.001, cost_source="none", latency_s=10.0, attempts=1, worker="w", created_at=time.time(),
    )


@pytest.fixture(autouse=True)
def _counters_built(redis_server):
    """These tests drive the ledger alone, on a new Redis and no store: its counters are those of an
    empty store, as the rebuild from the store (reconcile.ensure_counters) would mark them."""
    redis_server.client().set(rk.COUNTERS_BUILT, "empty store")


def test_counting_is_idempotent(redis_server):
    ledger = Ledger(redis_server.client())
    assert ledger.count(_rec("a", 10)) and not ledger.count(_rec("a", 10))
    assert ledger.dataset_totals("ds")["completion_tokens"] == 10
    assert ledger.totals("ds")["sglang"]["responses"] == 1 and ledger.spend_usd("sglang") == 0.001


def _admit(r, ledger: Ledger, key: str, budget: int, want: int, token: str = "w", ds: str = "ds"):
    r.set(rk.claim(ds, key), token, ex=120)
    return ledger.admit(ds, key, token, budget, want)


def _reserved(r, ds: str = "ds") -> int:
    return int(r.hget(rk.reserved_sum(ds), "r") or 0)


def test_a_task_reserves_its_max_tokens_then_what_is_left_then_the_dataset_is_full(redis_server):
    """Budget 1,000, max_tokens 300: three tasks reserve 300 each, the fourth exactly the 100 left
    (its max_tokens now), a fifth waits while they run; answers that come back short free room for
    more, until less than the floor (1% of the budget) is left with nothing in flight: full."""
    r = redis_server.client()
    ledger = Ledger(r)
    got = [_admit(r, ledger, f"k{i}", 1000, 300) for i in range(4)]
    assert [(a.verdict, a.granted) for a in got] == [(ADMITTED, 300)] * 3 + [(ADMITTED, 100)]
    assert _reserved(r) == 1000 and _admit(r, ledger, "k4", 1000, 300).verdict == WAIT
    for i, made in enumerate((120, 300, 250, 100)):  # each at most what it was granted
        assert ledger.count(_rec(f"k{i}", made))
    assert _reserved(r) == 0 and ledger.dataset_totals("ds")["completion_tokens"] == 770
    a = _admit(r, ledger, "k5", 1000, 300)
    assert (a.verdict, a.granted) == (ADMITTED, 230)
    assert ledger.count(_rec("k5", 225))
    assert floor_tokens(1000, 300) == 10 and _admit(r, ledger, "k6", 1000, 300).verdict == REFUSED  # 5 < 10 left
    assert ledger.closed_at("ds") == 1000 and _admit(r, ledger, "k7", 1000, 300).verdict == CLOSED
    assert ledger.dataset_totals("ds")["completion_tokens"] == 995


def test_whole_answers_go_over_by_less_than_one_answer_only_where_the_dataset_says_so(redis_server):
    """``budget_rule = "whole"`` (published as ``<tokens> whole``): admitted at its full max_tokens
    while any room is left, so the dataset may end over its budget by less than one answer."""
    r = redis_server.client()
    ledger = Ledger(r)
    r.hset(rk.BUDGETS, "ds", "1000 whole")
    got = [_admit(r, ledger, f"k{i}", 1000, 300) for i in range(4)]
    assert [(a.verdict, a.granted, a.budget) for a in got] == [(ADMITTED, 300, "1000 whole")] * 4
    assert _admit(r, ledger, "k4", 1000, 300).verdict == WAIT
    r.hset(rk.BUDGETS, "ds", "1000")  # back to the exact rule: nothing more fits
    assert _admit(r, ledger, "k5", 1000, 300).verdict == WAIT


def test_the_published_budget_wins_and_lost_counters_admit_nothing(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    r.hset(rk.BUDGETS, "ds", "500")
    a = _admit(r, ledger, "a", 10**6, 300)
    assert (a.verdict, a.granted, a.budget) == (ADMITTED, 300, "500")
    assert _admit(r, ledger, "b", 10**6, 300).granted == 200
    r.hset(rk.BUDGETS, "ds", "none")  # the budget was removed: admitted, nothing reserved
    c = _admit(r, ledger, "c", 10**6, 300)
    assert (c.verdict, c.granted) == (ADMITTED, 300) and not r.hexists(rk.reservations("ds"), "c")
    r.delete(rk.COUNTERS_BUILT)
    assert _admit(r, ledger, "d", 10**6, 300).verdict == LOST and not r.hexists(rk.reservations("ds"), "d")


def test_reservations_of_dead_workers_are_held_until_the_store_is_counted(redis_server, tmp_path):
    """A dead worker's reservation is not freed when its claim lapses: its task may have stored an
    answer and died before counting it. Admission's due pass buries it (still reserved, no claim's);
    the reconciler's pass counts the store, then frees what stored nothing. Freed at the lapse (as
    before), the dead task's stored 300 would have let a later task past the budget."""
    from draftfleet.reconcile import Reconciler
    from draftfleet.store.folder import FileStore

    r = redis_server.client()
    ledger = Ledger(r)
    store = FileStore(tmp_path / "store")
    store.prepare()
    stored, nothing = f"{7:064x}", f"{8:064x}"
    assert _admit(r, ledger, "alive", 1000, 300).verdict == ADMITTED
    for dead in (stored, nothing):
        r.set(rk.claim("ds", dead), "w", px=300)
        assert ledger.admit("ds", dead, "w", 1000, 300).verdict == ADMITTED
    assert store.put(_rec(stored, 300))  # stored, never counted: the worker died
    time.sleep(0.5)  # the dead worker's claims lapse: their reservations are due, and buried
    a = _admit(r, ledger, "next", 1000, 300)
    assert (a.verdict, a.granted, a.buried) == (ADMITTED, 100, 0)
    assert r.zcard(rk.reservations_dead("ds")) == 2 and _reserved(r) == 1000
    assert r.hget(rk.reservations("ds"), stored) == b"300:"  # no claim's: no stale copy releases it
    ledger.release("ds", stored, "w")
    w = _admit(r, ledger, "more", 1000, 300)
    assert (w.verdict, w.buried, _reserved(r)) == (WAIT, 2, 1000)
    drift = Reconciler(store, r).reconcile("ds")
    assert (drift.newly_counted, drift.stale_reservations) == (1, 1)  # counted, then the other freed
    assert ledger.dataset_totals("ds")["completion_tokens"] == 300 and _reserved(r) == 400
    assert not r.exists(rk.reservations_dead("ds"))
    # the reconciler's own full pass buries what admission has not looked at yet
    r.delete(rk.claim("ds", "alive"), rk.claim("ds", "next"))
    assert ledger.bury_dead("ds") == 2 and _reserved(r) == 400
    assert ledger.settle_dead("ds", ledger.now_ms()) == 2 and not r.exists(rk.reservations("ds"), rk.reserved_sum("ds"))


def _commands(r) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def test_admission_work_does_not_grow_with_in_flight(redis_server):
    """Redis commands per admit + settle are the same at 20 and at 4,000 reservations in flight."""
    r = redis_server.client()
    ledger = Ledger(r)
    pipe = r.pipeline(transaction=False)
    for i in range(4000):
        pipe.set(rk.claim("ds", f"k{i}"), "w", ex=120)
    pipe.execute()
    ledger.release("ds", "none", "w")  # loads the scripts: their first call costs a NOSCRIPT round
    work = {}
    for n in (20, 4000):
        for i in range(n - r.hlen(rk.reservations("ds"))):
            assert ledger.admit("ds", f"k{r.hlen(rk.reservations('ds'))}", "w", 10**9, 100).verdict == ADMITTED
        before = _commands(r)
        for i in range(10):
            r.set(rk.claim("ds", f"t{i}"), "w", ex=120)
            assert ledger.admit("ds", f"t{i}", "w", 10**9, 100).verdict == ADMITTED
            ledger.release("ds", f"t{i}", "w")
        work[n] = (_commands(r) - before) / 10
    assert work[4000] == work[20] and work[20] < 30, work


def test_the_reserved_total_always_matches_the_reservations(redis_server):
    """Random admissions, counts, releases and lapsed claims: the total kept beside the entries is
    their sum after every step, and never lets committed + reserved pass the budget."""
    r = redis_server.client()
    ledger = Ledger(r)
    rng = random.Random(7)
    budget, live = 20_000, {}
    for i in range(400):
        op = rng.random()
        if op < 0.5 or not live:
            key = f"k{i}"
            a = _admit(r, ledger, key, budget, rng.choice((50, 300, 2000)))
            if a.verdict == ADMITTED:
                live[key] = a.granted
        else:
            key = rng.choice(sorted(live))
            granted = live.pop(key)
            if op < 0.8:
                ledger.count(_rec(key, rng.randint(0, granted)))
            elif op < 0.9:
                ledger.release("ds", key, "w")
            else:
                r.delete(rk.claim("ds", key))
                r.zadd(rk.reservations_due("ds"), {key: 0})
        entries = {k.decode(): int(v.decode().split(":", 1)[0]) for k, v in r.hgetall(rk.reservations("ds")).items()}
        assert _reserved(r) == sum(entries.values()), i
        committed = ledger.dataset_totals("ds").get("completion_tokens", 0)
        assert committed + _reserved(r) <= budget, i
        buried = {k.decode() for k, v in r.hgetall(rk.reservations("ds")).items() if v.endswith(b":")}
        assert {m.decode() for m in r.zrange(rk.reservations_due("ds"), 0, -1)} == set(entries) - buried, i
        assert {m.decode() for m in r.zrange(rk.reservations_dead("ds"), 0, -1)} == buried, i


def test_a_stale_copy_never_releases_the_reservation_of_the_copy_that_runs_now(redis_server):
    """Copy A's claim lapsed (its worker was cut off) and copy B claimed the key and was admitted.
    A, ending, releases with its own token: B's reservation stays. Released by key, it went."""
    r = redis_server.client()
    ledger = Ledger(r)
    r.set(rk.claim("ds", "k"), "host:1:a", px=200)
    assert ledger.admit("ds", "k", "host:1:a", 10**6, 100).verdict == ADMITTED
    time.sleep(0.3)  # A's claim lapses; B takes the key
    assert _admit(r, ledger, "k", 10**6, 100, token="host:2:b").verdict == ADMITTED
    ledger.release("ds", "k", "host:1:a")
    assert r.hget(rk.reservations("ds"), "k").decode() == "100:host:2:b" and _reserved(r) == 100
    assert ledger.bury_dead("ds") == 0  # B's claim holds it
    ledger.release("ds", "k", "host:2:b")
    assert not r.exists(rk.reservations("ds"), rk.reserved_sum("ds"))
    # a reservation whose claim another copy holds is dead to the reconciler's pass
    assert ledger.admit("ds", "k", "host:2:b", 10**6, 100).verdict == ADMITTED
    r.set(rk.claim("ds", "k"), "host:3:c", ex=120)
    assert ledger.bury_dead("ds") == 1 and r.hget(rk.reservations("ds"), "k") == b"100:"
    assert ledger.settle_dead("ds", ledger.now_ms()) == 1 and not r.exists(rk.reservations("ds"))


def test_admission_refuses_because_of_paid_turns(redis_server):
    """Conversations not stored yet have paid 995 tokens of a 1,000 budget (``prepay``): an ask is
    refused and the dataset closes (5 left, under the floor of 10), where the same ask on a
    dataset with no paid turns is admitted. The views' figure (``budget_use``) says the same."""
    r = redis_server.client()
    ledger = Ledger(r)
    for turn, tokens in enumerate((300, 300, 395)):
        assert ledger.prepay("ds", "conv", turn, "cloudy", 0.001, tokens)
    assert _admit(r, ledger, "ask", 1000, 256, ds="fresh").verdict == ADMITTED
    use = ledger.budget_use("ds", 1000, 256)
    assert (use.spent_tokens, use.paid_tokens, use.left_tokens, use.floor_tokens, use.full) == (995, 995, 5, 10, True)
    assert _admit(r, ledger, "ask", 1000, 256).verdict == REFUSED and ledger.closed_at("ds") == 1000
    assert not ledger.budget_use("fresh", 1000, 256).full


def test_views_call_a_dataset_full_from_what_is_stored_never_from_a_guess(redis_server):
    """5,000 tokens at max_tokens 32,768: not full (the first answer is admitted with the 5,000 as
    its max_tokens), where the old estimate (half of max_tokens) refused everything; what is in
    flight never makes a dataset full (it may come back short); the whole rule is full at 0 left."""
    r = redis_server.client()
    ledger = Ledger(r)
    assert not ledger.budget_use("ds", 5000, 32_768).full
    a = _admit(r, ledger, "first", 5000, 32_768)
    assert (a.verdict, a.granted) == (ADMITTED, 5000)
    assert not ledger.budget_use("ds", 5000, 32_768).full  # reserved, not spent
    assert ledger.count(_rec("first", 4990))
    use = ledger.budget_use("ds", 5000, 32_768)
    assert use.full and use.floor_tokens == 50 and use.left_tokens == 10
    assert not ledger.budget_use("ds", 5000, 32_768, rule="whole").full
    assert ledger.budget_use("ds", 4990, 32_768, rule="whole").full


def test_a_conversation_reserves_max_tokens_for_each_turn_left(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    assert _admit(r, ledger, "conv", 10_000, 256 * 3).granted == 768
    assert ledger.budget_use("ds", 300, 256, 3).floor_tokens == 3 and not ledger.budget_use("ds", 300, 256, 3).full


def test_a_batchs_answers_count_together_and_their_grants_and_spend_holds_go_once(redis_server):
    """``count_batch_answers``: each answer's tokens and cost in the totals and the spend once, the
    grant its batch held (``batch_take``'s "b" mark) out of paid_tokens and batch_held, its spend
    hold let go, in steps of ``most``; sent again, nothing moves; an answer the reconciler counted
    first (``count``) still gives its grant back."""
    from draftfleet.ledger import SpendHold

    r = redis_server.client()
    ledger = Ledger(r)
    recs = [msgspec.structs.replace(_rec(f"k{i}", 10 + i), backend="batchy", batch_id="b-1") for i in range(5)]
    holds = []
    for rec in recs:
        assert ledger.batch_hold("ds", rec.key, 64)
        verdict, hold = ledger.spend_hold("batchy", "ds", rec.key, None, "batch:b-1", 100, 10.0, 64, 1.0,
                                          hold_id=f"ds:{rec.key}:-:1")
        assert verdict == ADMITTED
        holds.append(SpendHold(hold.id, hold.token, 0, 0))
    assert ledger.dataset_totals("ds")["batch_held"] == 5 * 64
    assert ledger.count(recs[0], rate=False)  # the reconciler's pass came first: its grant is still held
    assert ledger.dataset_totals("ds")["batch_held"] == 5 * 64
    assert ledger.count_batch_answers(list(zip(recs, holds)), most=2) == 4
    totals = ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == sum(x.completion_tokens for x in recs) and totals["responses"] == 5
    assert totals.get("paid_tokens", 0) == 0 and totals.get("batch_held", 0) == 0
    assert not r.smembers(rk.paid_keys("ds")) and not r.exists(rk.prepaid("ds", "k1"))
    assert ledger.spend_usd("batchy") == pytest.approx(5 * 0.001) and ledger.spend_holds("batchy") == {}
    assert ledger.spend_held_usd("batchy") == 0
    assert "provider_tokens" not in ledger.totals("ds")["batchy"]  # a batch's price is not the sync side's
    assert ledger.count_batch_answers(list(zip(recs, holds))) == 0  # sent again: nothing twice
    assert ledger.dataset_totals("ds") == totals and ledger.spend_usd("batchy") == pytest.approx(5 * 0.001)
