"""Redis flushed mid-run, then the runbook's ``enqueue`` at once (issue 33): a budget closed before
the flush is not spent a second time, a spend cap reached before it is not passed, and a budget
still open closes once, from counters rebuilt from the store, on a folder store and on a bucket.

Before the fix, admission and the spend check ran on counters back at zero: the closed dataset
was queued again and spent a second budget, and the capped backend spent its cap again.
"""

from __future__ import annotations

import json
import time

import pytest

from draftfleet import redis_keys as rk
from draftfleet.ledger import Ledger
from draftfleet.store import Store, open_store

from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _chat_rows

pytestmark = pytest.mark.slow

BUDGET = 3000
CAP_USD = 0.5
ANSWER = 20  # tokens: the emulator's fixed length
PRICE = CAP_USD / 10 / ANSWER * 1e6  # $/Mtok: each answer costs a tenth of the cap


@pytest.fixture(params=["folder", "bucket"])
def where(request, tmp_path):
    """The store's location and the environment every process gets (the bucket's AWS_* lines, set
    in this process too)."""
    if request.param == "folder":
        return str(tmp_path / "store"), {}
    s3 = request.getfixturevalue("s3_env")
    return f"s3://{s3.bucket()}/flush", s3.env()


def where_name(location: str) -> str:
    return "bucket" if location.startswith("s3://") else "folder"


def _spent(store: Store, dataset: str) -> tuple[int, float]:
    """(completion tokens, cost) of the dataset's stored records, read from the store."""
    recs = list(store.records(dataset))
    return sum(r.completion_tokens for r in recs), sum(r.cost_usd for r in recs)


def _enqueue(config, env) -> dict[str, dict]:
    res = run_cli("enqueue", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    return {s["dataset"]: s for s in json.loads(res.stdout)}


def _settled(r, dataset: str) -> bool:
    return (not r.llen(rk.queue(dataset)) and not r.hlen(rk.reservations(dataset))
            and not list(r.scan_iter(rk.claim(dataset, "*"))))


def _until_closed_and_capped(r, ledger: Ledger, workers) -> None:
    """Wait until ``bud`` has closed at its budget and settled, and the cloud worker has stopped at its cap."""
    wait_until(lambda: ledger.closed_at("bud") is not None and _settled(r, "bud"), 120, 0.2,
               lambda: f"bud to close at its budget\n{workers.logs()}")
    wait_until(lambda: workers.logs(tail=None).count("spend_cap") >= 1 and not list(r.scan_iter(rk.claim("paid", "*"))),
               60, 0.2, lambda: f"the cloud worker to stop at its cap\n{workers.logs()}")


def _config(tmp_path, tokenizer_dir, emu, location, prompts: int):
    bud = write_jsonl(tmp_path / "bud.jsonl", _chat_rows(prompts, "bud"))
    paid = write_jsonl(tmp_path / "paid.jsonl", _chat_rows(60, "paid"))
    return write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, store=location, inflight=8,
                        concurrency=1, cloud_extra=f"max_spend_usd = {CAP_USD}",
                        datasets=[{"name": "bud", "path": str(bud), "max_tokens": 32, "budget_tokens": BUDGET},
                                  {"name": "paid", "path": str(paid), "max_tokens": 32}])


def test_a_flush_after_the_budget_closed_and_the_cap_was_reached_spends_nothing_twice(
        tmp_path, where, redis_server, tokenizer_dir, emulator_factory, workers):
    location, store_env = where
    env = {"REDIS_URL": redis_server.url, **store_env}
    emu = emulator_factory(single_stream_tps=400, ceiling_tps=20000, length=f"fixed:{ANSWER}", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], price_output_per_mtok=PRICE,
                           price_input_per_mtok=0.0)
    config = _config(tmp_path, tokenizer_dir, emu, location, 400)
    workers.start(config, "gpu", "--url", emu.url, "--dataset", "bud", redis_url=redis_server.url, env=store_env)
    cloud = workers.start(config, "cloud", "--backend", "cloudy", "--dataset", "paid", redis_url=redis_server.url,
                          env={**store_env, **KEY_ENV})
    r = redis_server.client()
    ledger = Ledger(r)
    first = _enqueue(config, env)
    assert (first["bud"]["queued"], first["paid"]["queued"]) == (400, 60)
    _until_closed_and_capped(r, ledger, workers)
    store = open_store(location)
    bud_before, paid_before = len(store.keys("bud")), len(store.keys("paid"))
    tokens_before, _ = _spent(store, "bud")
    assert tokens_before <= BUDGET * 1.01 and paid_before == 10

    r.flushall()  # everything Redis held: queues, claims, counters, the closed flag, the spend
    again = _enqueue(config, env)  # the runbook's step 2, at once, with the workers running
    # the store says bud's budget is spent: nothing of it is queued again
    assert again["bud"]["closed"] and again["bud"]["queued"] == 0, again["bud"]
    assert again["paid"]["queued"] == 60 - paid_before, again["paid"]
    # the cloud worker, paused at its cap, comes back after its pause (2 s) and looks again: the
    # counters rebuilt from the store say the cap is reached, so it stops again, having paid nothing
    wait_until(lambda: workers.logs(tail=None).count("STOPPED CONSUMING") >= 2, 60, 0.2,
               lambda: f"the cloud worker to stop again\n{workers.logs()}")
    time.sleep(3)  # a worker spending a second cap would have spent some of it by now
    workers.assert_alive(cloud)
    tokens_after, _ = _spent(store, "bud")
    _, paid_cost = _spent(store, "paid")
    charged = sum(c.cost_usd for c in store.charges() if c.backend == "cloudy")
    print(f"\nflush after close ({where_name(location)}): bud {bud_before} records, {tokens_before} tokens of "
          f"{BUDGET} before; {len(store.keys('bud'))} records, {tokens_after} tokens after; cloudy spent "
          f"${paid_cost + charged:.3f} of ${CAP_USD} ({len(store.keys('paid'))} records)")
    assert tokens_after <= BUDGET * 1.01 and len(store.keys("bud")) == bud_before
    assert paid_cost + charged <= CAP_USD * 1.01 and len(store.keys("paid")) == paid_before
    # the counters are the store's again, and say so
    assert ledger.counters_built()
    assert ledger.dataset_totals("bud")["completion_tokens"] == tokens_after
    assert abs(ledger.spend_usd("cloudy") - (paid_cost + charged)) < 1e-6


def test_a_flush_before_the_budget_closes_rebuilds_then_closes_once(
        tmp_path, where, redis_server, tokenizer_dir, emulator_factory, workers):
    location, store_env = where
    env = {"REDIS_URL": redis_server.url, **store_env}
    emu = emulator_factory(single_stream_tps=100, ceiling_tps=5000, length=f"fixed:{ANSWER}", ttft_s=0.0)
    config = _config(tmp_path, tokenizer_dir, emu, location, 400)
    store = open_store(location)
    r = redis_server.client()
    ledger = Ledger(r)
    assert _enqueue(config, env)["bud"]["queued"] == 400
    workers.start(config, "gpu", "--url", emu.url, "--dataset", "bud", redis_url=redis_server.url, env=store_env)
    wait_until(lambda: len(store.keys("bud")) >= 40, 90, 0.1, lambda: f"40 results\n{workers.logs()}")
    r.flushall()  # a third of the budget spent, eight requests open
    at_flush = len(store.keys("bud"))
    again = _enqueue(config, env)["bud"]
    assert not again["closed"] and again["queued"] > 0, again
    wait_until(lambda: ledger.closed_at("bud") is not None and _settled(r, "bud"), 120, 0.2,
               lambda: f"bud to close at its budget\n{workers.logs()}")
    tokens, _ = _spent(store, "bud")
    closes = workers.logs(tail=None).count("reached its budget of")
    print(f"\nflush before close ({where_name(location)}): {at_flush} records at the flush; {len(store.keys('bud'))} "
          f"records, {tokens} tokens of {BUDGET} at the end; closed {closes} time(s)")
    assert BUDGET * 0.95 <= tokens <= BUDGET * 1.01
    assert closes == 1
    assert ledger.dataset_totals("bud")["completion_tokens"] == tokens


def test_tasks_that_reach_the_workers_before_any_rebuild_are_not_admitted_on_lost_counters(
        tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    """No enqueue after the flush: the tasks come back by another road (a Redis restored from an
    old append-only file, ``requeue``, a deferred copy), so the workers meet the lost counters
    first. Admission and the spend check rebuild them from the store before deciding."""
    location = str(tmp_path / "store")
    env = {"REDIS_URL": redis_server.url}
    emu = emulator_factory(single_stream_tps=400, ceiling_tps=20000, length=f"fixed:{ANSWER}", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], price_output_per_mtok=PRICE,
                           price_input_per_mtok=0.0)
    config = _config(tmp_path, tokenizer_dir, emu, location, 400)
    r = redis_server.client()
    ledger = Ledger(r)
    assert {d: s["queued"] for d, s in _enqueue(config, env).items()} == {"bud": 400, "paid": 60}
    messages = {d: r.lrange(rk.queue(d), 0, -1) for d in ("bud", "paid")}
    workers.start(config, "gpu", "--url", emu.url, "--dataset", "bud", redis_url=redis_server.url)
    cloud = workers.start(config, "cloud", "--backend", "cloudy", "--dataset", "paid", redis_url=redis_server.url,
                          env=KEY_ENV)
    _until_closed_and_capped(r, ledger, workers)
    store = open_store(location)
    bud_before, paid_before = len(store.keys("bud")), len(store.keys("paid"))

    r.flushall()
    res = run_cli("status", "--config", str(config), "--json", env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["counters_built"] is False, res.stderr
    for d, raw in messages.items():  # the tasks with no result, as first sent, straight back on their queue
        done = store.keys(d)
        r.rpush(rk.queue(d), *(m for m in raw if json.loads(m)["headers"]["id"] not in done))
    wait_until(lambda: not r.llen(rk.queue("bud")) and _settled(r, "bud"), 120, 0.2,
               lambda: f"bud's tasks to be taken\n{workers.logs()}")
    wait_until(lambda: workers.logs(tail=None).count("STOPPED CONSUMING") >= 2, 60, 0.2,
               lambda: f"the cloud worker to stop again\n{workers.logs()}")
    time.sleep(3)
    workers.assert_alive(cloud)
    tokens, _ = _spent(store, "bud")
    _, paid_cost = _spent(store, "paid")
    print(f"\ntasks back before any rebuild: bud {bud_before} -> {len(store.keys('bud'))} records ({tokens} tokens of "
          f"{BUDGET}); paid {paid_before} -> {len(store.keys('paid'))} records (${paid_cost:.3f} of ${CAP_USD})")
    assert len(store.keys("bud")) == bud_before and tokens <= BUDGET * 1.01
    assert len(store.keys("paid")) == paid_before and paid_cost <= CAP_USD * 1.01
    assert ledger.counters_built() and ledger.closed_at("bud") is not None
