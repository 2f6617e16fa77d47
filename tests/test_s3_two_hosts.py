"""Two hosts, one bucket (issue 25, item 5): two worker groups that share nothing but the Redis URL
and an ``s3://`` store on a real SeaweedFS, each with its own folder (cwd, HOME, TMPDIR, config
copy), its own SGLang server (an emulator) and capture engine (tests/capture_engine.py, writing in
the host's folder). One group dies by SIGKILL mid-run, or Redis loses everything mid-run; the
bucket still ends with every prompt once, counted once, every capture unit one object, and neither
host keeps a file behind.

Each test prints its counts (prompts, stored, generated, generated twice, spend against budget,
capture units).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter

import pytest

from draftfleet import redis_keys as rk
from draftfleet.hidden import HEADER_ROOM, TargetModel, open_hidden
from draftfleet.ledger import Ledger
from draftfleet.queues import queued_keys
from draftfleet.store import open_store

from .capture_engine import CaptureEngine, contract, engine_file
from .conftest import Host, wait_until, write_jsonl
from .test_hidden import _model

pytestmark = pytest.mark.slow

# A dead host's claims lapse in 6 s and the survivor's recovery sweep gives its messages back
# (draftfleet/recovery.py). The visibility timeout cannot stand in for it in a test: the config
# refuses one shorter than max_attempts x (request timeout + the longest Retry-After, 600 s).
CLAIM_ENV = {"DRAFTFLEET_CLAIM_TTL_S": "6"}
INFLIGHT = 8
RECORD = re.compile(r"^ds/[0-9a-f]{2}/[0-9a-f]{64}\.json$")
# what a store holds besides its records when nothing failed and nothing is half done: no
# _progress/, _failures/, _unreadable/ or _probe/ objects
SETTLED_OBJECTS = {"record", ".draftfleet-store", "ds/manifest.json", "_log", "_hidden"}
UNIT = re.compile(r"^_hidden/ds/v1/[0-9a-f]{2}/([0-9a-f]{64})\.(\d+)\.safetensors$")
CAPTURE_INFLIGHT = 2


class Engine:
    """A host's capture engine (its vLLM in the host's config), writing its files into the host's own
    folder (``engine/``) as a connector does on local disk; while ``hold`` is clear it keeps the
    units it is asked open."""

    def __init__(self, host: Host, hold: threading.Event | None = None):
        model = TargetModel.load(host.folder / "model")
        self.fake = CaptureEngine(host.folder / "engine", contract([2, 4, 5, 8], model.config_sha256))
        self.fake.answer = self._answer
        self.url = self.fake.url
        with open(host.config, "a") as fh:
            fh.write(f'\n[backends.vllm]\nurls = ["{self.url}"]\nrequest_timeout_s = 30.0\n')
        self.hold = hold
        self.units = self.open = 0
        self._lock = threading.Lock()

    def _answer(self, ids: list[int]) -> tuple[str, bytes]:
        if len(ids) > 1:  # a unit, not the worker's one-token start-up probe
            with self._lock:
                self.units += 1
                self.open += 1
            try:
                if self.hold is not None:
                    self.hold.wait(120)
            finally:
                with self._lock:
                    self.open -= 1
        return self.fake.fresh_path(), engine_file(ids, 4, 128, self.fake.contract, room=HEADER_ROOM)


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(host: Host, hold: threading.Event | None = None) -> Engine:
        made.append(Engine(host, hold))
        return made[-1]

    yield make
    for e in made:
        if e.hold is not None:
            e.hold.set()
        e.fake.close()


def _hosts(tmp_path, workers, emulator_factory, tokenizer_dir, s3_server, redis_url: str, n: int,
           dataset: dict, **emulator) -> tuple[list[Host], list, str]:
    """Two hosts, each with its own emulator, config copy and target model folder (for capture,
    its engine's files in ``engine/``), on one new bucket."""
    data = write_jsonl(tmp_path / "data" / "prompts.jsonl", [{"prompt": f"short prompt {i}"} for i in range(n)])
    location = f"s3://{s3_server.bucket()}/fleet"
    hosts, emus = [], []
    for name in ("host-a", "host-b"):
        host = Host(tmp_path / name, workers, env={**s3_server.env(), **CLAIM_ENV, "REDIS_URL": redis_url})
        emu = emulator_factory(ceiling_tps=100000, ttft_s=0.0, **emulator)
        config = host.write_config(tokenizer=tokenizer_dir, emulator_url=emu.url, store=location, inflight=INFLIGHT,
                                   sglang_timeout_s=60.0, datasets=[{"name": "ds", "path": str(data), **dataset}])
        with open(config, "a") as fh:
            fh.write(f'\n[capture]\nmodel_path = "{_model(host.folder / "model")}"\n'
                     f'storage_path = "{host.folder / "engine"}"\ninflight = {CAPTURE_INFLIGHT}\n')
        hosts.append(host)
        emus.append(emu)
    return hosts, emus, location


def _enqueue(host: Host) -> dict:
    res = host.run_cli("enqueue", "--config", str(host.config), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)[0]


def _cli_json(host: Host, *args: str):
    res = host.run_cli(*args, "--config", str(host.config), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _names(s3_server, location: str, under: str = "") -> list[str]:
    """The names of the objects under the store's prefix (and ``under`` in it), relative to the prefix."""
    bucket, prefix = location[len("s3://"):].split("/", 1)
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{under}")
    return [obj["Key"][len(prefix) + 1:] for page in pages for obj in page.get("Contents", [])]


def _objects(s3_server, location: str) -> Counter:
    """The objects under the store's prefix, by kind: "record" for each record (named by its key,
    so one object per key), what is under a folder of its own (``_log/``, ``_hidden/``) by that
    folder, anything else by its own name; and no multipart upload left open."""
    bucket = location[len("s3://"):].split("/", 1)[0]
    assert not s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads"), "multipart uploads left open"
    return Counter("record" if RECORD.match(name) else name.split("/")[0] if name.startswith("_") else name
                   for name in _names(s3_server, location))


def _generated(emus) -> tuple[int, int, int]:
    """Requests the emulators answered in full, tokens they returned in those, requests cut short."""
    stats = [e.stats() for e in emus]
    return (sum(s["completed"] for s in stats), sum(s["tokens_generated"] for s in stats),
            sum(s["disconnected"] for s in stats))


def _settled(r) -> bool:
    """Nothing queued, held, claimed or reserved for the dataset, nor for its capture."""
    return (not queued_keys(r, "ds") and not r.llen(rk.capture_queue("ds")) and not r.hlen(rk.UNACKED)
            and not r.hlen(rk.reservations("ds")) and not list(r.scan_iter(rk.claim("ds", "*")))
            and not list(r.scan_iter(rk.capture_claim("ds", "*"))))


def _units(s3_server, location: str) -> Counter:
    """The capture units in the bucket, (key, turn) -> objects."""
    found = (UNIT.match(name) for name in _names(s3_server, location, "_hidden/"))
    return Counter((m.group(1), int(m.group(2))) for m in found if m)


def test_a_host_killed_mid_run_leaves_every_prompt_and_unit_once_within_budget(
        tmp_path, s3_env, redis_server, tokenizer_dir, emulator_factory, engines, workers):
    n, budget = 400, 4000  # ~16 tokens an answer: the budget stops the run at ~250 of the 400
    s3_server = s3_env
    hosts, emus, location = _hosts(tmp_path, workers, emulator_factory, tokenizer_dir, s3_server, redis_server.url,
                                   n, {"max_tokens": 32, "budget_tokens": budget},
                                   single_stream_tps=12, length="uniform:8:24", seed=7)
    victim, survivor = hosts
    hold = threading.Event()  # the victim's engine keeps its units open until the victim is dead
    caps = [engines(victim, hold), engines(survivor)]
    r = redis_server.client()
    first = _enqueue(survivor)
    assert first["queued"] == n
    for host, emu, cap in zip(hosts, emus, caps):
        host.start("gpu", "--engine", "sglang", "--url", emu.url, redis_url=redis_server.url)
        host.start("capture", "--url", cap.url, redis_url=redis_server.url)
    store = open_store(location)
    everyone = [*victim.procs, *survivor.procs]

    # capture what is stored so far while generation goes on
    wait_until(lambda: workers.assert_alive(*everyone) or len(store.keys("ds")) >= 20, 90, 0.2,
               lambda: f"20 results\n{workers.logs()}")
    (early,) = _cli_json(survivor, "capture")
    assert early["queued"] >= 20, early

    # the victim dies with a full batch and its capture units open, after both hosts did a share
    def mid_run() -> bool:
        workers.assert_alive(*everyone)
        return (emus[0].stats()["open"] >= INFLIGHT and emus[0].stats()["completed"] >= 10
                and emus[1].stats()["completed"] >= 10 and caps[0].open >= CAPTURE_INFLIGHT
                and caps[1].units >= 3 and len(store.keys("ds")) >= 40)

    wait_until(mid_run, 90, 0.1, lambda: f"both hosts mid-run\n{workers.logs()}")
    open_at_kill = emus[0].stats()["open"]
    victim.kill()
    stored_at_kill = len(store.keys("ds"))
    hold.set()  # its engine finishes them into the dead host's folder

    ledger = Ledger(r)
    wait_until(lambda: ledger.closed_at("ds") is not None, 120, 0.2, lambda: f"the budget to close\n{workers.logs()}")
    wait_until(lambda: _settled(r), 60, 0.2, lambda: f"the dataset to settle\n{workers.logs()}")
    workers.assert_alive(*survivor.procs)
    assert "held by no live worker back to their queues" in workers.logs(tail=None)

    # every prompt stored at most once, as one object; the rest refused by the budget
    records = list(store.records("ds"))
    sources = Counter(rec.source for rec in records)
    assert len(sources) == len(records) and set(sources.values()) == {1}, sources.most_common(3)
    assert stored_at_kill < len(records) < n and not store.failures("ds")
    by_host = Counter(rec.worker.split("@")[0] for rec in records)
    assert by_host["host-a-gpu"] > 0 and by_host["host-b-gpu"] > by_host["host-a-gpu"], by_host

    # counted once: the counted set is the stored keys, and the reconciler finds nothing to correct
    (drift,) = _cli_json(survivor, "reconcile")
    # (a record the victim stored but died before counting is counted by its next copy, or here)
    assert drift["corrections"] == {} and drift["counted_not_stored"] == 0, drift
    assert drift["newly_counted"] <= open_at_kill, drift
    assert {k.decode() for k in r.smembers(rk.counted_set("ds"))} == store.keys("ds")

    # the spend as status shows it: the stored answers' tokens, within 1% of the budget
    (row,) = _cli_json(survivor, "status")["datasets"]
    spent = row["budget"]["spent_tokens"]
    assert spent == sum(rec.completion_tokens for rec in records) and abs(spent - budget) <= 0.01 * budget, spent

    # the emulators' own count: what they answered in full is what was stored, plus what the victim
    # never stored: answers it received as it died, or that were finished into its closed connection
    # before the emulator noticed (those prompts were generated again, and stored and counted once)
    completed, tokens, cut = _generated(emus)
    twice = completed - len(records)
    assert twice >= 0 and cut + twice >= 1, (completed, cut)
    assert spent + 8 * twice <= tokens <= spent + 24 * twice, (tokens, spent, twice)  # answers of 8-24 tokens

    # the rest captured: every stored record's unit is one object, checked when read back
    (late,) = _cli_json(survivor, "capture")
    assert late["queued"] >= len(records) - early["queued"], late
    wait_until(lambda: len(_units(s3_server, location)) == len(records) and _settled(r), 90, 0.5,
               lambda: f"every unit captured\n{workers.logs()}")
    units = _units(s3_server, location)
    assert {key for key, _turn in units} == store.keys("ds") and set(units.values()) == {1}, units.most_common(2)
    hidden = open_hidden(store)
    assert hidden.verify("ds", 1) == (len(records), 0, [])
    # counted once: what the last capture found done, and what was stored since (each run counts anew)
    captured = int(r.hget(rk.capture_progress("ds"), "captured") or 0)
    assert late["done"] + captured == len(records), (late, captured)
    objects = _objects(s3_server, location)
    assert objects["record"] == len(records) and set(objects) <= SETTLED_OBJECTS, objects

    # nothing left on the survivor; on the victim, only the files its engine wrote for the dead
    # worker, until a capture worker starts there again and sweeps them
    assert survivor.leftovers() == [], survivor.leftovers()
    orphans = victim.leftovers()
    assert orphans and all(re.fullmatch(r"engine/req-\d+\.safetensors", f) for f in orphans), orphans
    back = victim.start("capture", "--url", caps[0].url, redis_url=redis_server.url,
                        env={"DRAFTFLEET_CAPTURE_ORPHAN_S": "0"})
    wait_until(lambda: workers.assert_alive(back) or not victim.leftovers(), 60, 0.2,
               lambda: f"the victim's folder swept\n{victim.leftovers()}\n{workers.logs()}")
    workers.stop(back)
    for host in hosts:
        assert host.leftovers() == [], (host.name, host.leftovers())
    assert _units(s3_server, location) == units
    print(f"\ntwo hosts, one bucket, a host killed -9: prompts {n}, stored {len(records)} (host-a "
          f"{by_host['host-a-gpu']}, host-b {by_host['host-b-gpu']}; {stored_at_kill} at the kill), generated "
          f"{completed}, generated twice {twice}, requests cut by the kill {cut} ({open_at_kill} open at the kill), "
          f"spend {spent} tokens against a budget of {budget} ({100 * (spent - budget) / budget:+.2f}%), emulators "
          f"returned {tokens} tokens; capture: units {len(units)} (one object each), engine requests "
          f"{caps[0].units + caps[1].units} (host-a {caps[0].units}, host-b {caps[1].units}; captured twice "
          f"{caps[0].units + caps[1].units - len(units)}), {early['queued']} queued "
          f"mid-run and {late['queued']} after, "
          f"files the victim's engine left {len(orphans)}; bucket objects {dict(objects)}")


def test_redis_flushed_mid_run_then_enqueue_resumes_from_the_bucket(tmp_path, s3_env, redis_server, tokenizer_dir,
                                                                     emulator_factory, workers):
    n = 200
    s3_server = s3_env
    hosts, emus, location = _hosts(tmp_path, workers, emulator_factory, tokenizer_dir, s3_server, redis_server.url,
                                   n, {"max_tokens": 32}, single_stream_tps=12, length="uniform:8:24", seed=3)
    r = redis_server.client()
    assert _enqueue(hosts[0])["queued"] == n
    for host, emu in zip(hosts, emus):
        host.start("gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(location)

    def open_requests() -> int:
        return sum(e.stats()["open"] for e in emus)

    def mid_run() -> bool:
        workers.assert_alive(*hosts[0].procs, *hosts[1].procs)
        return open_requests() >= 2 * INFLIGHT and len(store.keys("ds")) >= 40

    wait_until(mid_run, 90, 0.1, lambda: f"both hosts mid-run\n{workers.logs()}")
    # The requests open now stay open until the enqueue below has counted them as in flight (its
    # start alone can outlast an answer on a loaded machine).
    for emu in emus:
        emu.update(single_stream_tps=0.2)
    r.flushall()  # queues, unacknowledged messages, claims, counters: gone; the workers run on
    stored_at_flush = len(store.keys("ds"))
    open_at_flush = open_requests()  # counted after the stored ones: no key is in both
    # the workers' heartbeats put back the claims of what they hold
    wait_until(lambda: len(list(r.scan_iter(rk.claim("ds", "*")))) >= open_requests(), 30, 0.1,
               lambda: f"the claims re-created\n{workers.logs()}")
    again = _enqueue(hosts[1])  # the other host resumes: the bucket says what is done
    for emu in emus:
        emu.update(single_stream_tps=12)
    assert again["queued"] + again["already_done"] + again["already_queued"] + again["in_flight"] == n, again
    # what was open then is in flight now, or finished since and stored
    assert again["already_done"] + again["in_flight"] >= stored_at_flush + open_at_flush, again

    wait_until(lambda: len(store.keys("ds")) == n, 90, 0.2, lambda: f"{n} results\n{workers.logs()}")
    wait_until(lambda: _settled(r), 60, 0.2, lambda: f"the dataset to settle\n{workers.logs()}")
    workers.assert_alive(*hosts[0].procs, *hosts[1].procs)

    records = list(store.records("ds"))
    sources = Counter(rec.source for rec in records)
    assert len(records) == n and len(sources) == n and set(sources.values()) == {1}, sources.most_common(3)
    objects = _objects(s3_server, location)
    assert objects["record"] == n and set(objects) <= SETTLED_OBJECTS, objects
    # nothing generated twice, not even what was in flight when Redis lost everything
    completed, tokens, cut = _generated(emus)
    assert (completed, cut) == (n, 0) and tokens == sum(rec.completion_tokens for rec in records)
    # the counters lost with Redis: what was counted since is counted once, the reconciler adds the rest
    (drift,) = _cli_json(hosts[1], "reconcile")
    assert drift["corrections"] == {} and drift["counted_not_stored"] == 0, drift
    assert {k.decode() for k in r.smembers(rk.counted_set("ds"))} == store.keys("ds")
    (row,) = _cli_json(hosts[1], "status")["datasets"]
    assert (row["responses"], row["completion_tokens"]) == (n, tokens), row
    for host in hosts:
        assert host.leftovers() == [], (host.name, host.leftovers())
    print(f"\ntwo hosts, one bucket, Redis flushed mid-run: prompts {n}, stored {len(records)} ({stored_at_flush} at "
          f"the flush, {open_at_flush} requests open), enqueue again: queued {again['queued']}, already done "
          f"{again['already_done']}, in flight {again['in_flight']}, already queued {again['already_queued']}; "
          f"generated {completed}, generated twice {completed - n}; counted again by reconcile "
          f"{drift['newly_counted']}")
