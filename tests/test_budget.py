"""Budgets, counters, the reconciler, inventory, import and export (issue 3), on real workers."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from draftfleet import redis_keys as rk
from draftfleet.views.inventory import run_inventory
from draftfleet.ledger import Ledger
from draftfleet.queues import queued_keys
from draftfleet.reconcile import Reconciler
from draftfleet.schemas.config import load_config
from draftfleet.store import Store, open_store

from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_fleet import KEY_ENV, _chat_rows, _enqueue

pytestmark = pytest.mark.slow


def _store_totals(store: Store, dataset: str) -> dict[str, list[int]]:
    """Responses and completion tokens per backend, summed straight from the files."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _name, data in store.read_many(store.record_files(dataset)):
        rec = json.loads(data)
        out[rec["backend"]][0] += 1
        out[rec["backend"]][1] += rec["completion_tokens"]
    return dict(out)


def test_budget_lands_within_one_percent(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    budget = 100_000
    emu = emulator_factory(single_stream_tps=2000, ceiling_tps=200000, length="lognormal:150:0.9", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], seed=5)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(2000))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=32, concurrency=16,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 1000, "budget_tokens": budget}])
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2, 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    ledger = Ledger(r)
    wait_until(lambda: ledger.closed_at("ds") is not None, 90, 0.2, f"the budget to close\n{workers.logs()}")
    wait_until(lambda: not r.hlen(rk.reservations("ds")) and not list(r.scan_iter(rk.claim("ds", "*"))), 60, 0.2,
               "in-flight work to finish")
    store = open_store(load_config(config))
    totals = _store_totals(store, "ds")
    total = sum(t for _, t in totals.values())
    assert abs(total - budget) <= 0.01 * budget, (total, totals)
    assert set(totals) == {"sglang", "cloudy"}
    assert len(store.keys("ds")) < 2000 and r.llen(rk.queue("ds")) == 0
    assert ledger.events("ds")["skipped:budget"] > 0 and not store.failures("ds")
    # a closed dataset takes no more work from enqueue
    again = _enqueue(config, redis_server.url)[0]
    assert again["closed"] and again["queued"] == 0


def test_counters_survive_redeliveries_and_reconcile_corrects_drift(tmp_path, redis_server, tokenizer_dir,
                                                                     emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:50", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(30))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    cfg = load_config(config)
    _enqueue(config, redis_server.url)
    r = redis_server.client()
    # duplicate every message in the queue: each key is delivered twice, as after a redelivery
    for raw in r.lrange(rk.queue("ds"), 0, -1):
        r.lpush(rk.queue("ds"), raw)
    assert r.llen(rk.queue("ds")) == 60
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(cfg)
    wait_until(lambda: len(store.keys("ds")) == 30 and r.llen(rk.queue("ds")) == 0, 60, 0.2, workers.logs())
    wait_until(lambda: not list(r.scan_iter(rk.claim("ds", "*"))), 30, 0.2, "claims released")
    ledger = Ledger(r)
    want = _store_totals(store, "ds")
    got = {b: [t["responses"], t["completion_tokens"]] for b, t in ledger.totals("ds").items()}
    assert got == want and ledger.dataset_totals("ds")["responses"] == 30

    # inject drift: wrong counters, a key forgotten by the counted set, the aggregate wiped
    r.hincrby(rk.totals("ds", "sglang"), "completion_tokens", 12345)
    forgotten = sorted(store.keys("ds"))[0]
    r.srem(rk.counted_set("ds"), forgotten)
    r.delete(rk.dataset_totals("ds"))
    drift = Reconciler(store, r).reconcile("ds")
    assert drift.newly_counted == 1  # counted again through the idempotent path...
    assert drift.corrections["sglang"]["completion_tokens"] == -12345 - store.get("ds", forgotten).completion_tokens
    got = {b: [t["responses"], t["completion_tokens"]] for b, t in ledger.totals("ds").items()}
    assert got == want and ledger.dataset_totals("ds")["completion_tokens"] == sum(t for _, t in want.values())
    assert Reconciler(store, r).reconcile("ds").corrections == {}  # ...and a second pass finds nothing

    # Redis lost everything: the CLI's reconcile rebuilds the counters from the store
    r.flushall()
    res = run_cli("reconcile", "--config", str(config), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["newly_counted"] == 30
    got = {b: [t["responses"], t["completion_tokens"]] for b, t in ledger.totals("ds").items()}
    assert got == want


def test_inventory_import_resume_and_export_round_trip(tmp_path, redis_server, tokenizer_dir, target_tokenizer,
                                                       emulator_factory, workers):
    rows = [{"messages": [{"role": "user", "content": f"task {i}: sort a list"}]} for i in range(40)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:60", ttft_s=0.0)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "b3", "path": str(data), "max_tokens": 100, "budget_tokens": 100000}])
    # An earlier pipeline's raw_responses.jsonl: 25 responses with ids, the last line cut mid-write.
    lines = []
    for i in range(25):
        ids = target_tokenizer.encode_text(f"def sort_{i}(x): return sorted(x)") + [target_tokenizer.eot_id]
        row = {"messages": rows[i]["messages"], "output": target_tokenizer.decode(ids), "output_ids": ids,
               "completion_tokens": len(ids)}
        if i % 5 == 0:
            del row["output"]  # some lines carry ids only (the seed's fallback)
        lines.append(json.dumps(row))
    raw = tmp_path / "raw_responses.jsonl"
    raw.write_text("\n".join(lines[:24]) + "\n" + lines[24][: len(lines[24]) // 2])
    env = {"REDIS_URL": redis_server.url}
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "b3", "--label", "local-sglang",
                  "--json", env=env)
    assert res.returncode == 0, res.stderr
    imported = json.loads(res.stdout)
    assert (imported["imported"], imported["cut_last_line"], imported["rejected"]) == (24, True, 0)
    expected_tokens = sum(len(json.loads(x)["output_ids"]) for x in lines[:24])
    assert imported["completion_tokens"] == expected_tokens

    # enqueue resumes after the import: exactly the other 16 prompts
    summary = _enqueue(config, redis_server.url)[0]
    assert (summary["queued"], summary["already_done"]) == (16, 24)
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("b3")) == 40, 60, 0.2, workers.logs())

    # inventory equals totals computed here from the files
    res = run_cli("inventory", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    inv = json.loads(res.stdout)[0]
    files = _store_totals(store, "b3")
    assert inv["responses"] == 40 and inv["completion_tokens"] == sum(t for _, t in files.values())
    split = {s["backend"]: (s["responses"], s["completion_tokens"], s["token_source"]) for s in inv["by_source"]}
    assert split["local-sglang"] == (24, expected_tokens, "exact")
    assert split["sglang"][:2] == tuple(files["sglang"])
    assert inv["remaining_tokens"] == 100000 - inv["completion_tokens"]
    assert inv["prompts_left"] == 0 and inv["cost_to_finish_usd"] == {"cloudy": 0.0}  # nothing left to pay for
    v = inv["validation"]
    assert (v["schema_errors"], v["ids_out_of_vocab"], v["stop_without_eot"], v["duplicate_prompts"]) == (0, 0, 0, 0)
    assert v["roundtrip_checked"] == 40 and 0 <= v["roundtrip_mismatch_share"] <= 1

    # export both formats; importing the raw export into a fresh store reads back the same counts
    out = tmp_path / "export"
    res = run_cli("export", "--config", str(config), "--dataset", "b3", "-f", "sharegpt", "-f", "raw",
                  "--out", str(out), "--json", env=env)
    assert res.returncode == 0, res.stderr
    manifest = json.loads(res.stdout)
    assert manifest[0]["records"] == 40 and set(manifest[0]["files"]) == {"b3.sharegpt.jsonl", "b3.raw_responses.jsonl"}
    first = (out / "b3.sharegpt.jsonl").read_bytes()
    assert run_cli("export", "--config", str(config), "--dataset", "b3", "-f", "sharegpt", "--out",
                   str(tmp_path / "again"), env=env).returncode == 0
    assert (tmp_path / "again" / "b3.sharegpt.jsonl").read_bytes() == first  # deterministic
    row = json.loads(first.splitlines()[0])
    assert set(row) == {"id", "conversations", "metadata"} and row["conversations"][-1]["role"] == "assistant"
    fresh = tmp_path / "fresh"
    config2 = write_config(fresh, tokenizer=tokenizer_dir,
                           datasets=[{"name": "b3", "path": str(data), "max_tokens": 100, "budget_tokens": 100000}])
    res = run_cli("import", str(out / "b3.raw_responses.jsonl"), "--config", str(config2), "--dataset", "b3", "--json",
                  env=env)
    assert json.loads(res.stdout)["imported"] == 40
    inv2 = run_inventory(load_config(config2).fleet.store)[0]
    assert (inv2.responses, inv2.completion_tokens) == (inv["responses"], inv["completion_tokens"])
    assert store.keys("b3") == open_store(load_config(config2)).keys("b3")


def test_spend_cap_stops_cloud_workers(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="fixed:50", ttft_s=0.0,
                           price_output_per_mtok=1000.0, price_input_per_mtok=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(60))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, concurrency=2,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}],
                          cloud_extra="max_spend_usd = 0.5")
    _enqueue(config, redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    ledger = Ledger(r)
    wait_until(lambda: ledger.spend_usd("cloudy") >= 0.5, 60, 0.2, workers.logs())
    wait_until(lambda: not list(r.scan_iter(rk.claim("ds", "*"))), 30, 0.2, "in-flight requests to end")
    store = open_store(load_config(config))
    stored = len(store.keys("ds"))
    # each response costs $0.05: the cap stops it after 10, plus at most the 2 in flight
    assert 10 <= stored <= 12 and ledger.spend_usd("cloudy") <= 0.5 + 2 * 0.05 + 1e-9
    # the rest stays queued (in the list, or held unacked for a moment while the paused worker retries)
    assert len(queued_keys(r, "ds")) == 60 - stored and not store.failures("ds")
    # the worker says why it stopped (it says so once its next claim meets the cap, a moment after the last store)
    wait_until(lambda: "spend_cap" in workers.logs(tail=None), 30, 0.2, lambda: "the worker to log spend_cap: " + workers.logs())
