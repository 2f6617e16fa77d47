"""The ledger's Lua scripts against a real Redis: idempotent counting and budget admission."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import ADMITTED, CLOSED, REFUSED, WAIT, Ledger
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


def test_admission_phases_close_the_budget_exactly(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    budget, e = 2000, 100

    def admit(key):
        r.set(rk.claim("ds", key), "w")
        return ledger.admit("ds", key, "w", budget, e, 1000)

    def finish(key, tokens):
        ledger.count(_rec(key, tokens))
        r.delete(rk.claim("ds", key))

    def admit_until_refused(prefix: str, then=None, limit: int = 100) -> tuple[list[str], str]:
        """Admit keys (each followed by ``then(key)``) until admission says no: the keys and the
        verdict. Admission that never stops is a failure here, not a hang to the suite's timeout."""
        keys = []
        for i in range(limit):
            if (v := admit(f"{prefix}{i}")) != ADMITTED:
                return keys, v
            keys.append(f"{prefix}{i}")
            if then:
                then(keys[-1])
        pytest.fail(f"{limit} admissions in a row under a budget of {budget} tokens: admission never closes")

    # phase 1: free admission while the margin (3 sd x sqrt(in flight)) fits
    admitted, v = admit_until_refused("k")
    assert v == WAIT and 2 <= len(admitted) < 20
    # closing: nothing more while anything is in flight
    assert admit("late") == WAIT
    for k in admitted:
        finish(k, e)
    committed = len(admitted) * e
    # a round admits up to half the room left, then waits for the round to finish
    round1, v = admit_until_refused("r")
    assert v == WAIT and len(round1) == max(1, (budget - committed) // 2 // e)
    for k in round1:
        finish(k, e)
    # rounds shrink until less than one response fits; then the dataset closes
    _, v = admit_until_refused("z", then=lambda k: finish(k, e))
    assert v == REFUSED and ledger.closed_at("ds") == budget
    assert budget - e < ledger.dataset_totals("ds")["completion_tokens"] <= budget
    assert admit("after") == CLOSED
    ledger.reopen("ds")
    assert ledger.closed_at("ds") is None


def test_reservations_of_dead_workers_are_dropped(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    r.set(rk.claim("ds", "alive"), "w", ex=120)
    assert ledger.admit("ds", "alive", "w", 10**6, 100, 1000) == ADMITTED
    r.set(rk.claim("ds", "dead"), "w", px=300)
    assert ledger.admit("ds", "dead", "w", 10**6, 100, 1000) == ADMITTED
    time.sleep(0.5)  # the dead worker's claim lapses: its reservation is due and dropped
    r.set(rk.claim("ds", "next"), "w", ex=120)
    ledger.admit("ds", "next", "w", 10**6, 100, 1000)
    assert set(r.hkeys(rk.reservations("ds"))) == {b"alive", b"next"}
    assert _reserved(r) == {"n": 2, "ey": 200}
    # the reconciler's full pass drops the rest once their claims are gone
    r.delete(rk.claim("ds", "alive"), rk.claim("ds", "next"))
    assert ledger.drop_dead("ds") == 2 and not r.exists(rk.reservations("ds"), rk.reserved_sum("ds"))


def _reserved(r) -> dict[str, int]:
    got = {k.decode(): int(v) for k, v in r.hgetall(rk.reserved_sum("ds")).items()}
    got.pop("t0", None)
    return {k: v for k, v in got.items() if v}


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
            assert ledger.admit("ds", f"k{r.hlen(rk.reservations('ds'))}", "w", 10**9, 100, 1000) == ADMITTED
        before = _commands(r)
        for i in range(10):
            r.set(rk.claim("ds", f"t{i}"), "w", ex=120)
            assert ledger.admit("ds", f"t{i}", "w", 10**9, 100, 1000) == ADMITTED
            ledger.release("ds", f"t{i}", "w")
        work[n] = (_commands(r) - before) / 10
    assert work[4000] == work[20] and work[20] < 40, work


def test_long_running_reservations_grow_then_settle(redis_server):
    """A response running past its expected length reserves twice what one stream made, up to max_tokens."""
    r = redis_server.client()
    ledger = Ledger(r)
    # 10 responses of 100 tokens at 1 token/ms of one stream, all alike (no spread: no margin)
    r.hset(rk.dataset_totals("ds"), mapping={"responses": 10, "completion_tokens": 1000, "latency_ms": 1000,
                                             "completion_tokens_sq": 10 * 100 * 100})
    budget = 1000 + 100 + 50 + 200  # committed + one young reservation + half a response + 200 to spare
    r.set(rk.claim("ds", "long"), "w", ex=120)
    assert ledger.admit("ds", "long", "w", budget, 100, 400) == ADMITTED
    time.sleep(0.3)  # by now it has made ~300 tokens: it reserves 2 x 300, capped at max_tokens 400
    r.set(rk.claim("ds", "next"), "w", ex=120)
    assert ledger.admit("ds", "next", "w", budget, 100, 400) == WAIT
    assert _reserved(r) == {"n": 1, "cc": 400}
    ledger.count(_rec("long", 100))
    assert not r.exists(rk.reservations("ds"), rk.reservations_due("ds"), rk.reserved_sum("ds"))


def test_aggregates_always_match_the_reservations(redis_server):
    """Random admissions, counts, releases and dead claims: the kept aggregates equal a recount."""
    r = redis_server.client()
    ledger = Ledger(r)
    rng = random.Random(7)
    # a stream makes 10 tokens/ms: reservations of 100 grow after 5 ms and are capped (200) after 10 ms
    r.hset(rk.dataset_totals("ds"), mapping={"responses": 10, "completion_tokens": 1000, "latency_ms": 100,
                                             "completion_tokens_sq": 10**5})
    held: list[str] = []
    seen: set[str] = set()
    for i in range(400):
        op = rng.random()
        if op < 0.5 or not held:
            key = f"k{i}"
            r.set(rk.claim("ds", key), "w", px=rng.choice([50, 120_000]))  # some workers die soon
            assert ledger.admit("ds", key, "w", 10**12, 100, rng.choice([150, 200, 400])) == ADMITTED  # own caps
            held.append(key)
        elif op < 0.75:
            rec = _rec(held.pop(rng.randrange(len(held))), 100)
            ledger.count(msgspec.structs.replace(rec, latency_s=0.01))  # 10 tokens/ms, as above
        else:
            ledger.release("ds", held.pop(rng.randrange(len(held))), "w")
        if i % 50 == 0:
            time.sleep(0.06)
        entries = {k.decode(): v.decode().split(":", 4)[:4] for k, v in r.hgetall(rk.reservations("ds")).items()}
        agg = {k.decode(): int(v) for k, v in r.hgetall(rk.reserved_sum("ds")).items()}
        t0 = agg.get("t0", 0)
        want = {"n": len(entries), "ey": sum(int(e) for e, _, st, _ in entries.values() if st == "y"),
                "no": sum(st == "o" for _, _, st, _ in entries.values()),
                "so": sum(int(s) - t0 for _, s, st, _ in entries.values() if st == "o"),
                "co": sum(int(c) for _, _, st, c in entries.values() if st == "o"),
                "cc": sum(int(c) for _, _, st, c in entries.values() if st == "c")}
        assert {k: agg.get(k, 0) for k in want} == want, i
        assert {m.decode() for m in r.zrange(rk.reservations_due("ds"), 0, -1)} == set(entries), i
        seen |= {st for _, _, st, _ in entries.values()}
    # the dead workers' reservations were dropped by time, long runners changed state
    assert len(entries) < len(held) and seen == {"y", "o", "c"}


def _one_capped_reservation(r, ledger: Ledger, dataset: str) -> None:
    """A dataset's state: 10 responses of 100 tokens at 1 token/ms of one stream (no spread), and
    one reservation (cap 400) admitted 0.3 s ago: ~300 tokens made, so it holds its cap, 400."""
    r.hset(rk.dataset_totals(dataset), mapping={"responses": 10, "completion_tokens": 1000, "latency_ms": 1000,
                                                "completion_tokens_sq": 10 * 100 * 100})
    r.set(rk.claim(dataset, "long"), "w", ex=120)
    assert ledger.admit(dataset, "long", "w", 10**6, 100, 400) == ADMITTED


def test_a_reservation_is_valued_with_its_own_cap_not_the_askers(redis_server):
    """The same Redis state (committed 1000, one reservation capped at its own 400) gives the same
    verdict whatever the cap of the task asking: 1000 + 400 + half a response is over 1300. Valued
    with the asker's cap, it was admitted at 64 (1000 + 64 + 50) and waited at 640."""
    r = redis_server.client()
    ledger = Ledger(r)
    for dataset in ("a", "b"):
        _one_capped_reservation(r, ledger, dataset)
    time.sleep(0.3)
    verdicts = {}
    for dataset, cap in (("a", 64), ("b", 640)):
        r.set(rk.claim(dataset, "next"), "w", ex=120)
        verdicts[cap] = ledger.admit(dataset, "next", "w", 1300, 100, cap)
    assert verdicts == {64: WAIT, 640: WAIT}
    for dataset in ("a", "b"):
        assert _reserved_of(r, dataset) == {"n": 1, "cc": 400}


def _reserved_of(r, dataset: str) -> dict[str, int]:
    got = {k.decode(): int(v) for k, v in r.hgetall(rk.reserved_sum(dataset)).items()}
    got.pop("t0", None)
    return {k: v for k, v in got.items() if v}


def test_a_budget_lowered_during_a_closing_round_applies_to_that_round(redis_server):
    """A closing round began under a budget of 1,000 (committed 100: its cap is 450) and admitted
    4 x 100. The budget is then published at 150: committed 100 + reserved 400 leave no room, so
    an ask of 40 waits (it was admitted: 440 is within the round's cap of 450)."""
    r = redis_server.client()
    ledger = Ledger(r)
    r.hset(rk.dataset_totals("ds"), mapping={"responses": 5, "completion_tokens": 100, "completion_tokens_sq": 5 * 400})
    r.hset(rk.closing("ds"), mapping={"cap": 0, "admitted": 0})  # in closing rounds: no free admission
    for i in range(4):
        r.set(rk.claim("ds", f"k{i}"), "w", ex=120)
        assert ledger.admit("ds", f"k{i}", "w", 1000, 100, 400) == ADMITTED
    assert r.hget(rk.closing("ds"), "cap") == b"450"
    r.hset(rk.BUDGETS, "ds", "150")  # as assign.publish writes it beside the manifest
    r.set(rk.claim("ds", "ask"), "w", ex=120)
    assert ledger.admit("ds", "ask", "w", 1000, 40, 400) == WAIT
    for i in range(4):  # the round ends short: 10 tokens each; the next round has 10 tokens of room
        ledger.count(msgspec.structs.replace(_rec(f"k{i}", 10), completion_tokens=10))
    assert ledger.admit("ds", "ask", "w", 1000, 40, 400) == REFUSED and ledger.closed_at("ds") == 150


def test_a_stale_copy_never_releases_the_reservation_of_the_copy_that_runs_now(redis_server):
    """Copy A's claim lapsed (its worker was cut off) and copy B claimed the key and was admitted.
    A, ending, releases with its own token: B's reservation stays. Released by key, it went."""
    r = redis_server.client()
    ledger = Ledger(r)
    r.set(rk.claim("ds", "k"), "host:1:a", px=200)
    assert ledger.admit("ds", "k", "host:1:a", 10**6, 100, 1000) == ADMITTED
    time.sleep(0.3)  # A's claim lapses; B takes the key
    r.set(rk.claim("ds", "k"), "host:2:b", ex=120)
    assert ledger.admit("ds", "k", "host:2:b", 10**6, 100, 1000) == ADMITTED
    ledger.release("ds", "k", "host:1:a")
    assert r.hget(rk.reservations("ds"), "k").decode().endswith(":host:2:b") and _reserved(r) == {"n": 1, "ey": 100}
    assert ledger.drop_dead("ds") == 0  # B's claim holds it
    ledger.release("ds", "k", "host:2:b")
    assert not r.exists(rk.reservations("ds"), rk.reserved_sum("ds"))
    # a reservation whose claim another copy holds is dead to the reconciler's pass
    assert ledger.admit("ds", "k", "host:2:b", 10**6, 100, 1000) == ADMITTED
    r.set(rk.claim("ds", "k"), "host:3:c", ex=120)
    assert ledger.drop_dead("ds") == 1 and not r.exists(rk.reservations("ds"))


def test_admission_refuses_because_of_paid_turns(redis_server):
    """Conversations not stored yet have paid 900 tokens of a 1,000 budget (``prepay``): an ask of
    128 tokens is refused and the dataset closes, where the same ask on a dataset with no paid
    turns is admitted. The views' figure (``budget_use``) says the same: 100 left, full."""
    r = redis_server.client()
    ledger = Ledger(r)
    for turn in range(3):
        assert ledger.prepay("ds", "conv", turn, "cloudy", 0.001, 300)
    for name in ("ds", "fresh"):
        r.set(rk.claim(name, "ask"), "w", ex=120)
    assert ledger.admit("fresh", "ask", "w", 1000, 128, 256) == ADMITTED
    use = ledger.budget_use("ds", 1000, 256)
    assert (use.spent_tokens, use.paid_tokens, use.left_tokens, use.expected_tokens, use.full) == (900, 900, 100, 128, True)
    assert ledger.admit("ds", "ask", "w", 1000, 128, 256) == REFUSED and ledger.closed_at("ds") == 1000
    assert not ledger.budget_use("fresh", 1000, 256).full


def test_views_reserve_what_admission_reserves_for_a_conversation(redis_server):
    """One reservation for the worker's admission and the views (``reservation``): a new 3-turn
    conversation of max_tokens 256 reserves 384 before five records (half of max_tokens a turn),
    a conversation with one turn left 128; after them, the mean record (a whole conversation: 300
    here), its turns left's share when resumed. With 250 left of the budget, the views say full
    and admission refuses that conversation."""
    r = redis_server.client()
    ledger = Ledger(r)
    assert (ledger.reservation("ds", 256, 3), ledger.reservation("ds", 256, 3, 1), ledger.reservation("ds", 256)) == (384, 128, 128)
    assert ledger.budget_use("ds", 300, 256, 3).full and not ledger.budget_use("ds", 300, 256).full
    for i, n in enumerate((100, 500) * 3):
        assert ledger.count(_rec(f"k{i}", n))
    assert (ledger.reservation("ds", 256, 3), ledger.reservation("ds", 256, 3, 1)) == (300, 100)
    use = ledger.budget_use("ds", 2050, 256, 3)
    assert (use.left_tokens, use.expected_tokens, use.full) == (250, 300, True)
    r.set(rk.claim("ds", "conv"), "w", ex=120)
    assert ledger.admit("ds", "conv", "w", 2050, ledger.reservation("ds", 256, 3), 256 * 3) == REFUSED
