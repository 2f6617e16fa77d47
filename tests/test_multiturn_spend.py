"""Conversations and the money and time they take (issue 13's follow-ups): every paid turn is in
the spend once, stored or not; no delivery holds a conversation's message past the visibility
timeout. Run in-process on a real Redis, the cloud backend on the emulator (``conversation_worker``)."""

from __future__ import annotations

import math
import time

import msgspec
import pytest
from celery.exceptions import Reject

from draftfleet import redis_keys as rk
from draftfleet.identity import prompt_key
from draftfleet.ledger import micro_usd
from draftfleet.reconcile import Reconciler

from .test_multiturn import conversation_worker, turn_two_refused  # noqa: F401 - the fixture


def _spend(rt) -> int:
    return int(rt.r.hget(rk.spend("cloudy"), "cost_micro_usd") or 0)


def test_turns_paid_before_a_failed_turn_are_in_the_spend_once(conversation_worker, monkeypatch):  # noqa: F811
    """Turn 2 is refused: turn 1 was paid, so the spend (what the cap sees) holds it although no
    record is stored. The retry stores the conversation: its count adds turns 2 and 3 only, and
    the reconciler finds nothing to correct."""
    tasks, rt, task, run, emu = conversation_worker
    with turn_two_refused(rt, emu, monkeypatch):
        assert run(task) == "failed"
    [turn1] = rt.store.progress("ds", task.key).turns
    assert turn1.cost_usd > 0 and _spend(rt) == micro_usd(turn1.cost_usd)

    [failure] = rt.store.failures("ds")
    assert run(failure.task) == "stored"
    rec = rt.store.get("ds", task.key)
    assert rec.turns[0] == turn1 and len(rec.turns) == 3
    assert _spend(rt) == sum(micro_usd(t.cost_usd) for t in rec.turns)
    assert rt.ledger.totals("ds")["cloudy"]["cost_micro_usd"] == micro_usd(rec.cost_usd)  # the record, once
    assert not rt.r.exists(rk.prepaid("ds", task.key))
    drift = Reconciler(rt.store, rt.r).reconcile("ds")
    assert (drift.newly_counted, drift.corrections) == (0, {})
    assert _spend(rt) == sum(micro_usd(t.cost_usd) for t in rec.turns)


def test_a_conversation_stored_but_not_counted_is_counted_by_the_reconciler_without_paying_twice(
        conversation_worker, monkeypatch):  # noqa: F811
    """The worker stored the conversation and died before counting it: the reconciler counts the
    record, and the turns already in the spend (added when paid) are not added again."""
    tasks, rt, task, run, emu = conversation_worker
    monkeypatch.setattr(rt.ledger, "count", lambda record, now=None: True)
    assert run(task) == "stored"
    rec = rt.store.get("ds", task.key)
    paid = sum(micro_usd(t.cost_usd) for t in rec.turns)
    assert paid > 0 and _spend(rt) == paid
    drift = Reconciler(rt.store, rt.r).reconcile("ds")
    assert drift.newly_counted == 1 and drift.corrections == {}
    assert _spend(rt) == paid
    assert rt.ledger.totals("ds")["cloudy"]["responses"] == 1


def test_a_conversation_goes_back_to_its_queue_before_its_message_could_outlive_the_visibility_timeout(
        conversation_worker, monkeypatch):  # noqa: F811
    """Turns of a little over a second, and a visibility timeout with room for one turn's worst case
    and one second more: each delivery asks one turn, keeps it and hands the conversation back, the
    next resumes at the next turn; no turn is asked twice. With a minute more, one delivery asks all."""
    tasks, rt, task, run, emu = conversation_worker
    longest = rt.cfg.longest_task_s()
    visibility = math.ceil(longest) + 1
    real, asked = rt.backend.generate, []

    def slow(t):  # a turn that takes just over the room left in the visibility window
        time.sleep(visibility - longest + 0.1)
        asked.append(len(t.messages))
        return real(t)

    monkeypatch.setattr(rt.backend, "generate", slow)
    rt.cfg = msgspec.structs.replace(rt.cfg, fleet=msgspec.structs.replace(rt.cfg.fleet, visibility_timeout_s=visibility))
    for kept in (1, 2):
        with pytest.raises(Reject) as info:
            run(task)
        assert info.value.requeue
        assert len(rt.store.progress("ds", task.key).turns) == kept
        assert not rt.r.hexists(rk.reservations("ds"), task.key)  # given back with the message
    assert run(task) == "stored"
    assert len(rt.store.get("ds", task.key).turns) == 3
    assert asked == [1, 3, 5]  # each turn once, with its history
    assert rt.ledger.events("ds")["handed_back:visibility_timeout"] == 2

    rt.cfg = msgspec.structs.replace(rt.cfg, fleet=msgspec.structs.replace(rt.cfg.fleet, visibility_timeout_s=visibility
                                                                           + 60))
    messages = [msgspec.structs.replace(m, content=m.content + " again") if m.role == "user" else m
                for m in task.messages]
    other = msgspec.structs.replace(task, messages=messages, key=prompt_key("ds", messages, task.settings))
    assert run(other) == "stored"
    assert len(rt.store.get("ds", other.key).turns) == 3
    assert rt.ledger.events("ds")["handed_back:visibility_timeout"] == 2


def test_a_conversation_a_twin_stored_first_is_not_charged_again(conversation_worker, monkeypatch):  # noqa: F811
    """A twin stored the conversation while this copy generated it: this copy's turns are in the
    spend once (added as they were paid), not once more as a loser's charge."""
    tasks, rt, task, run, emu = conversation_worker
    real = rt.store.put

    def twin_first(record, **kw):
        real(msgspec.structs.replace(record, worker="twin@test"))
        return real(record, **kw)

    monkeypatch.setattr(rt.store, "put", twin_first)
    assert run(task) == "duplicate"
    rec = rt.store.get("ds", task.key)
    assert rec.worker == "twin@test"
    assert _spend(rt) == sum(micro_usd(t.cost_usd) for t in rec.turns) > 0
    assert rt.ledger.totals("ds")["cloudy"]["responses"] == 1


def test_a_handed_back_conversations_paid_turn_counts_against_the_budget_and_survives_a_flush(
        conversation_worker, monkeypatch):  # noqa: F811
    """Handed back after turn 1 (the visibility timeout): turn 1's tokens are in the dataset's
    ``paid_tokens``, which admission adds to what is committed. Redis then loses everything: the
    reconciler counts the kept turn again (tokens and cost) from ``_progress/``. The conversation's
    record, once stored and counted, moves them into the totals: nothing counted twice."""
    tasks, rt, task, run, emu = conversation_worker
    longest = rt.cfg.longest_task_s()
    visibility = math.ceil(longest) + 1
    real = rt.backend.generate

    def slow(t):
        time.sleep(visibility - longest + 0.1)
        return real(t)

    monkeypatch.setattr(rt.backend, "generate", slow)
    rt.cfg = msgspec.structs.replace(rt.cfg, fleet=msgspec.structs.replace(rt.cfg.fleet, visibility_timeout_s=visibility))
    with pytest.raises(Reject):
        run(task)
    [turn1] = rt.store.progress("ds", task.key).turns
    assert rt.ledger.dataset_totals("ds")["paid_tokens"] == turn1.completion_tokens > 0
    assert r_members(rt, rk.paid_keys("ds")) == {task.key}

    rt.r.flushall()
    drift = Reconciler(rt.store, rt.r).reconcile("ds")
    assert (drift.paid_turns_marked, drift.paid_tokens_corrected) == (1, 0)  # marked again, so counted
    assert rt.ledger.dataset_totals("ds")["paid_tokens"] == turn1.completion_tokens
    assert _spend(rt) == micro_usd(turn1.cost_usd)
    assert Reconciler(rt.store, rt.r).reconcile("ds").paid_tokens_corrected == 0  # a second pass: nothing
    rt.r.hincrby(rk.dataset_totals("ds"), "paid_tokens", 999)  # drift: corrected from the marks
    assert Reconciler(rt.store, rt.r).reconcile("ds").paid_tokens_corrected == -999
    assert rt.ledger.dataset_totals("ds")["paid_tokens"] == turn1.completion_tokens

    rt.cfg = msgspec.structs.replace(rt.cfg, fleet=msgspec.structs.replace(rt.cfg.fleet, visibility_timeout_s=3600))
    assert run(task) == "stored"
    rec = rt.store.get("ds", task.key)
    totals = rt.ledger.dataset_totals("ds")
    assert totals["completion_tokens"] == rec.completion_tokens and totals["paid_tokens"] == 0
    assert _spend(rt) == sum(micro_usd(t.cost_usd) for t in rec.turns)
    assert not rt.r.exists(rk.paid_keys("ds"), rk.prepaid("ds", task.key))
    drift = Reconciler(rt.store, rt.r).reconcile("ds")
    assert (drift.corrections, drift.paid_turns_marked, drift.paid_tokens_corrected) == ({}, 0, 0)


def r_members(rt, key: str) -> set[str]:
    return {m.decode() for m in rt.r.smembers(key)}
