"""The ledger's Lua scripts against a real Redis: idempotent counting and budget admission."""

from __future__ import annotations

import time

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
        return ledger.admit("ds", key, budget, e, 1000)

    def finish(key, tokens):
        ledger.count(_rec(key, tokens))
        r.delete(rk.claim("ds", key))

    # phase 1: free admission while the margin (3 sd x sqrt(in flight)) fits
    admitted = []
    while (v := admit(f"k{len(admitted)}")) == ADMITTED:
        admitted.append(f"k{len(admitted)}")
    assert v == WAIT and 2 <= len(admitted) < 20
    # closing: nothing more while anything is in flight
    assert admit("late") == WAIT
    for k in admitted:
        finish(k, e)
    committed = len(admitted) * e
    # a round admits up to half the room left, then waits for the round to finish
    round1 = []
    while (v := admit(f"r{len(round1)}")) == ADMITTED:
        round1.append(f"r{len(round1)}")
    assert v == WAIT and len(round1) == max(1, (budget - committed) // 2 // e)
    for k in round1:
        finish(k, e)
    # rounds shrink until less than one response fits; then the dataset closes
    n = 0
    while True:
        v = admit(f"z{n}")
        if v != ADMITTED:
            break
        finish(f"z{n}", e)
        n += 1
    assert v == REFUSED and ledger.closed_at("ds") == budget
    assert budget - e < ledger.dataset_totals("ds")["completion_tokens"] <= budget
    assert admit("after") == CLOSED
    ledger.reopen("ds")
    assert ledger.closed_at("ds") is None


def test_reservations_of_dead_workers_are_dropped(redis_server):
    r = redis_server.client()
    ledger = Ledger(r)
    r.set(rk.claim("ds", "alive"), "w")
    assert ledger.admit("ds", "alive", 10**6, 100, 1000) == ADMITTED
    r.set(rk.claim("ds", "dead"), "w")
    assert ledger.admit("ds", "dead", 10**6, 100, 1000) == ADMITTED
    r.delete(rk.claim("ds", "dead"))  # its claim expired: the worker is gone
    r.set(rk.claim("ds", "next"), "w")
    ledger.admit("ds", "next", 10**6, 100, 1000)
    assert set(r.hkeys(rk.reservations("ds"))) == {b"alive", b"next"}
