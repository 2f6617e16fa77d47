"""Spend caps by the budget's rule in dollars (issue 41, item 7): a paid request holds the most it
can cost before it is sent, so the requests in flight can never take a backend past its cap."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from draftfleet import redis_keys as rk
from draftfleet.ledger import ADMITTED, LOST, REFUSED, WAIT, Ledger, micro_usd
from draftfleet.reconcile import Reconciler
from draftfleet.schemas.records import ChargeRecord
from draftfleet.store.folder import FileStore

from .conftest import wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _chat_rows, _enqueue

B = "cloudy"


@pytest.fixture
def ledger(redis_server):
    r = redis_server.client()
    r.set(rk.COUNTERS_BUILT, "empty store")
    return Ledger(r)


def test_a_request_holds_its_worst_cost_and_near_the_cap_is_asked_for_less(ledger):
    """Cap $0.01 (10,000 micro-USD); a request's prompt can cost at most 100 micro-USD and each
    output token 2: at max_tokens 2,000 it holds 4,100. Two fit; the third gets the 1,800 left as
    max_tokens 850; a fourth waits while they run, and once their costs are in the spend and the
    holds let go, the room is what they did not spend; under 1% of the cap left: refused."""
    verdict, a = ledger.spend_hold(B, "ds", "k1", None, "t1", 100, 2.0, 2000, 0.01)
    verdict2, b = ledger.spend_hold(B, "ds", "k2", None, "t2", 100, 2.0, 2000, 0.01)
    assert (verdict, a.micro_usd, a.max_tokens) == (ADMITTED, 4100, 2000) and verdict2 == ADMITTED
    verdict, c = ledger.spend_hold(B, "ds", "k3", None, "t3", 100, 2.0, 2000, 0.01)
    assert (verdict, c.max_tokens, c.micro_usd) == (ADMITTED, 850, 1800)
    assert ledger.spend_hold(B, "ds", "k4", None, "t4", 100, 2.0, 2000, 0.01) == (WAIT, None)
    for hold, cost in ((a, 4100), (b, 2100), (c, 1800)):  # each cost at most what it held
        ledger.r.hincrby(rk.spend(B), "cost_micro_usd", cost)
        assert ledger.spend_release(B, hold)
    assert ledger.spend_held_usd(B) == 0 and ledger.spend_usd(B) == pytest.approx(0.008)
    verdict, d = ledger.spend_hold(B, "ds", "k5", None, "t5", 100, 2.0, 2000, 0.01)
    assert (verdict, d.max_tokens) == (ADMITTED, 950)
    ledger.r.hincrby(rk.spend(B), "cost_micro_usd", 1950)
    assert ledger.spend_release(B, d)
    assert ledger.spend_hold(B, "ds", "k6", None, "t6", 100, 2.0, 2000, 0.01) == (REFUSED, None)  # 50 < 100 left
    assert not ledger.spend_release(B, d)  # once
    ledger.r.delete(rk.COUNTERS_BUILT)
    assert ledger.spend_hold(B, "ds", "k7", None, "t7", 0, 2.0, 1, 1.0) == (LOST, None)


def test_a_dead_tasks_hold_is_charged_at_what_it_held_unless_its_cost_is_counted(ledger, tmp_path):
    """The reconciler: a hold whose claim is gone and whose key is not counted may have been billed:
    kept as a ``lost_in_flight`` charge in the store and counted once; one whose record is counted
    just goes; a live task's stays."""
    store = FileStore(tmp_path / "store")
    store.prepare()
    r = ledger.r
    holds = {}
    for key in ("dead", "counted", "alive"):
        r.set(rk.claim("ds", key), f"w:1:{key}")
        holds[key] = ledger.spend_hold(B, "ds", key, None, f"w:1:{key}", 0, 1.0, 300, 1.0)[1]
    r.delete(rk.claim("ds", "dead"), rk.claim("ds", "counted"))
    r.sadd(rk.counted_set("ds"), "counted")
    rec = Reconciler(store, r)
    assert rec.settle_spend_holds() == 2 and rec.settle_spend_holds() == 0
    assert set(ledger.spend_holds(B)) == {holds["alive"].id} and ledger.spend_usd(B) == pytest.approx(300e-6)
    (charge,) = store.charges()
    assert (charge.reason, charge.key, micro_usd(charge.cost_usd)) == ("lost_in_flight", "dead", 300)
    assert not ledger.charge(msgspec_copy(charge))  # the spend rebuilt from the store counts it once


def msgspec_copy(charge: ChargeRecord) -> ChargeRecord:
    import msgspec

    return msgspec.convert(msgspec.to_builtins(charge), ChargeRecord)


class SpendModel(RuleBasedStateMachine):
    """Requests hold, are billed at most what they held (or nothing), and are counted, charged,
    killed or lost with Redis; the reconciler settles the dead. After every step: spent + held
    covers what was billed, and at each hold what was billed plus every hold fits the cap."""

    def __init__(self, r, root):
        super().__init__()
        self.r = r
        r.flushall()
        r.set(rk.COUNTERS_BUILT, "model")
        self.ledger = Ledger(r)
        self.store = FileStore(root / os.urandom(4).hex())
        self.store.prepare()
        self.live: list[tuple[str, object, int]] = []  # (key, hold, billed so far)
        self.billed = 0  # micro-USD the provider billed
        self.n = 0

    @initialize(cap=st.integers(1000, 200_000), per=st.sampled_from([0.5, 2.0, 15.0]))
    def setup(self, cap: int, per: float) -> None:
        self.cap, self.per = cap, per

    @rule(prompt=st.integers(0, 500), max_tokens=st.sampled_from([1, 64, 512, 4096, 32_768]))
    def hold(self, prompt: int, max_tokens: int) -> None:
        self.n += 1
        key = f"{self.n:064x}"
        token = f"w:1:{self.n}"
        self.r.set(rk.claim("ds", key), token)
        verdict, hold = self.ledger.spend_hold(B, "ds", key, None, token, prompt, self.per, max_tokens, self.cap / 1e6)
        if verdict == ADMITTED:
            assert 1 <= hold.max_tokens <= max_tokens
            held = sum(h.micro_usd for _, h, _ in self.live) + hold.micro_usd
            assert self.billed + held <= self.cap, (self.billed, held, self.cap)
            self.live.append((key, hold, 0))
        else:
            self.r.delete(rk.claim("ds", key))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 10**6), share=st.floats(0, 1), end=st.sampled_from(["counted", "charged", "unbilled",
                                                                                     "killed", "killed_counted"]))
    def finish(self, which: int, share: float, end: str) -> None:
        key, hold, _ = self.live.pop(which % len(self.live))
        cost = 0 if end == "unbilled" else int(share * hold.micro_usd)
        self.billed += cost
        if end in ("counted", "charged", "killed_counted"):  # the cost goes into the spend (a count, a charge)
            self.r.hincrby(rk.spend(B), "cost_micro_usd", cost)
            self.r.sadd(rk.counted_set("ds"), key)
        if end in ("counted", "charged", "unbilled"):
            assert self.ledger.spend_release(B, hold)
        self.r.delete(rk.claim("ds", key))  # a killed worker's claim lapses: the reconciler decides

    @rule()
    def reconcile(self) -> None:
        Reconciler(self.store, self.r).settle_spend_holds()

    @invariant()
    def covered(self) -> None:
        spent = int(self.r.hget(rk.spend(B), "cost_micro_usd") or 0)
        held = int(self.r.hget(rk.spend_held_sum(B), "r") or 0)
        truth_in_flight = sum(h.micro_usd for _, h, _ in self.live)
        assert spent + held >= self.billed + truth_in_flight
        assert held == sum(m for m, _ in self.ledger.spend_holds(B).values())

    def teardown(self) -> None:
        if hasattr(self, "cap"):
            spent = int(self.r.hget(rk.spend(B), "cost_micro_usd") or 0)
            assert self.billed <= self.cap and spent <= self.cap + 0, (self.billed, spent, self.cap)


def test_the_cap_holds_under_any_interleaving_of_requests_and_deaths(redis_server, tmp_path):
    r = redis_server.client()
    run_state_machine_as_test(lambda: SpendModel(r, tmp_path), settings=settings(
        max_examples=int(os.environ.get("DRAFTFLEET_MODEL_EXAMPLES", "60")), stateful_step_count=40, deadline=None,
        derandomize=bool(os.environ.get("CI")), suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.slow
def test_cloud_workers_never_pass_the_cap_with_requests_in_flight(tmp_path, redis_server, tokenizer_dir,
                                                                  emulator_factory, workers):
    """The provider's prices are the config's ($1 in, $2 out per Mtok): 4 requests in flight, answers
    of 50 tokens, a cap of $0.002. Checked before each request (as before), the spend ended above the
    cap by up to the requests in flight; held, it never does, and the rest stays queued."""
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="fixed:50", ttft_s=0.0,
                           price_output_per_mtok=2.0, price_input_per_mtok=1.0, api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(60))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, concurrency=4,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}],
                          cloud_extra="max_spend_usd = 0.002")
    _enqueue(config, redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    ledger = Ledger(r)
    wait_until(lambda: "spend_cap" in workers.logs(tail=None) and not list(r.scan_iter(rk.claim("ds", "*"))),
               90, 0.3, workers.logs())
    spent = ledger.spend_usd("cloudy")
    assert 0.001 < spent <= 0.002 and ledger.spend_held_usd("cloudy") == 0
    assert r.llen(rk.queue("ds")) + r.hlen(rk.UNACKED) > 0
