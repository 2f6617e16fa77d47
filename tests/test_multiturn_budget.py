"""Conversations under a budget (issue 21, item 1; issue 26, item 7): every paid turn counts against
its dataset's budget the moment it is paid; a conversation the budget stops keeps its paid turns
(no record: a result is written once, when the conversation ends) and, once the budget is raised
and enqueue runs again, goes on at its next turn. A real cloud worker on the emulator, with a
visibility timeout that hands each conversation back after every turn (so all start before any
ends, as they do in production)."""

from __future__ import annotations

import math

import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger, floor_tokens
from draftfleet.reconcile import Reconciler
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store

from .conftest import wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _enqueue

pytestmark = pytest.mark.slow

BUDGET, CONVERSATIONS, MAX_TOKENS, CONCURRENCY = 150, 12, 32, 4


def test_a_conversation_the_budget_stops_keeps_its_turns_and_goes_on_when_the_budget_is_raised(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    """Budget 150 tokens, 12 three-turn conversations, each handed back after every turn. When the
    budget closes, every paid turn is either in a stored record or kept in ``_progress/`` (the
    emulator's requests = the two together) and spent from the budget (``paid_tokens``); the
    counters equal the store, and they spent the budget exactly: never above it, and less than its
    floor (1% of it, one token here) below. A conversation whose grant ran out mid-way is stored cut
    (its last turn truncated, the turns after it never asked). Then the budget is raised to 5,000 and
    enqueue runs again: the stopped conversations are queued again and finish, each asking only its
    turns not kept (the requests = the stored turns), their kept turns stored as they were, nothing
    counted twice.
    Before (issue 26.7): a stopped conversation was stored with ``finish_reason = "budget"``,
    write-once, and enqueue skipped it for ever."""
    emu = emulator_factory(single_stream_tps=6, ceiling_tps=100000, length="uniform:12:16", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], seed=21)
    rows = [{"id": f"c{i}", "messages": [m for t in range(3) for m in (
        {"role": "user", "content": f"conversation {i} turn {t}"}, {"role": "assistant", "content": "x"})]}
        for i in range(CONVERSATIONS)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = {"name": "ds", "path": str(data), "max_tokens": MAX_TOKENS, "turns": "all", "budget_tokens": BUDGET}
    kwargs = dict(tokenizer=tokenizer_dir, emulator_url=emu.url, concurrency=CONCURRENCY, max_attempts=1)
    longest = load_config(write_config(tmp_path, **kwargs, datasets=[ds])).longest_task_s()
    # room for one turn's worst case and a second more: a turn of 2-2.7 s hands its conversation back
    fleet_extra = f"visibility_timeout_s = {math.ceil(longest) + 1}"
    config = write_config(tmp_path, **kwargs, datasets=[ds], fleet_extra=fleet_extra)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    wait_until(lambda: list(r.scan_iter(rk.worker_report("*"))), 60, 0.1, workers.logs())
    assert _enqueue(config, redis_server.url)[0]["queued"] == CONVERSATIONS
    ledger = Ledger(r)
    store = open_store(load_config(config))

    def settled(what: str) -> None:
        wait_until(lambda: r.llen(rk.queue("ds")) == 0 and not r.hlen(rk.UNACKED)
                   and not list(r.scan_iter(rk.claim("ds", "*"))), 120, 0.2, f"{what}\n{workers.logs()}")

    wait_until(lambda: ledger.closed_at("ds") is not None, 120, 0.2, f"the budget to close\n{workers.logs()}")
    settled("the queue to empty")

    records = list(store.records("ds"))
    kept = {key: store.progress("ds", key).turns for key in store.progress_keys("ds")}
    requests = emu.stats()["by_endpoint"]["/v1/chat/completions"]
    stored_turns = sum(len(rec.turns) for rec in records)
    total = sum(rec.completion_tokens for rec in records)
    paid = sum(t.completion_tokens for turns in kept.values() for t in turns)
    print(f"\nbudget {BUDGET}: {len(records)} conversations stored, {stored_turns} turns, {len(kept)} stopped with "
          f"{sum(map(len, kept.values()))} turns kept, of {requests} paid; {total} + {paid} tokens spent")
    assert kept and not kept.keys() & {rec.key for rec in records}
    assert all(1 <= len(turns) < 3 for turns in kept.values())
    assert requests == stored_turns + sum(map(len, kept.values()))  # every paid turn is stored or kept
    cut = {rec.key for rec in records if len(rec.turns) < 3}
    assert all(rec.finish_reason != "budget" and (len(rec.turns) == 3 or rec.turns[-1].truncated) for rec in records)
    assert ledger.events("ds")["stopped:budget"] == len(kept)
    totals = ledger.dataset_totals("ds")
    assert (totals.get("completion_tokens", 0), totals["paid_tokens"]) == (total, paid)
    # never above: each turn is asked with at most what its conversation was granted; below by less than
    # the floor while conversations remain (1% of 150 rounds to one token: the room is filled)
    assert BUDGET - floor_tokens(BUDGET, 3 * MAX_TOKENS) < total + paid <= BUDGET, total + paid
    drift = Reconciler(store, r).reconcile("ds")
    assert (drift.corrections, drift.paid_turns_marked, drift.paid_tokens_corrected) == ({}, 0, 0)

    # the budget raised (a live setting: the config edited, enqueue run again)
    config = write_config(tmp_path, **kwargs, datasets=[{**ds, "budget_tokens": 5000}], fleet_extra=fleet_extra)
    [again] = _enqueue(config, redis_server.url)
    assert (again["queued"], again["already_done"], again["closed"]) == (CONVERSATIONS - len(records), len(records),
                                                                          False)
    wait_until(lambda: len(store.keys("ds")) == CONVERSATIONS, 120, 0.2, f"every conversation\n{workers.logs()}")
    settled("the queue to empty again")
    records = {rec.key: rec for rec in store.records("ds")}
    requests = emu.stats()["by_endpoint"]["/v1/chat/completions"]
    print(f"raised to 5,000: {len(records)} conversations stored, {requests} requests in all")
    assert all(len(rec.turns) == 3 or key in cut for key, rec in records.items())
    # each turn asked once: no kept turn was asked again, no cut conversation taken up again (stored: write-once)
    assert requests == sum(len(rec.turns) for rec in records.values())
    for key, turns in kept.items():
        assert records[key].turns[:len(turns)] == turns  # the kept turns, stored as they were
    assert not store.progress_keys("ds") and not r.exists(rk.paid_keys("ds"))
    totals = ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == sum(rec.completion_tokens for rec in records.values())
    assert totals.get("paid_tokens", 0) == 0 and totals["responses"] == CONVERSATIONS
    assert ledger.spend_usd("cloudy") == pytest.approx(sum(rec.cost_usd for rec in records.values()), abs=1e-5)
    drift = Reconciler(store, r).reconcile("ds")
    assert (drift.corrections, drift.paid_turns_marked, drift.paid_tokens_corrected) == ({}, 0, 0)
