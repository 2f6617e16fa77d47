"""Exactly once, second pass (issue 14): the task's edges, run in-process on a real Redis.

The worker's task body runs here as Celery runs it (the registered task, its request, a real
Runtime with the cloud backend on the emulator over loopback), so each hole can be driven into
its exact moment: a record stored between the reconciler's two reads, a broker gone while a
deferred copy is sent, a record file that cannot be read, a claim lapsing under a running task.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
from celery.exceptions import Reject

from draftfleet import redis_keys as rk
from draftfleet.identity import prompt_key, settings_id
from draftfleet.ledger import Ledger, micro_usd
from draftfleet.reconcile import Reconciler, ensure_counters
from draftfleet.schemas.config import load_config
from draftfleet.schemas.records import FailureRecord, Message, PromptTask
from draftfleet.store import FileStore, open_store

from .conftest import free_port, wait_until, write_config, write_jsonl
from .test_core import _record
from .test_fleet import KEY_ENV


@pytest.fixture
def fleet(tmp_path, redis_server, tokenizer_dir, target_tokenizer, emulator_factory, monkeypatch):
    """A worker's Runtime, in this process: the cloud backend against the emulator, real Redis."""
    from draftfleet.workers import tasks
    from draftfleet.workers.app import make_app
    from draftfleet.workers.cloud import CloudChat

    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:40", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p {i}"} for i in range(3)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    cfg = load_config(config)
    open_store(cfg).prepare()  # as a worker does at start
    monkeypatch.setattr(tasks, "INFRA_RETRY_S", 0.0)
    backend = CloudChat("cloudy", cfg.cloud("cloudy"), target_tokenizer, KEY_ENV["DRAFTFLEET_TEST_KEY"])
    made = []

    def runtime(broker_url: str = redis_server.url, store=None):
        app = make_app(broker_url, 3600)
        tasks.register(app)
        rt = tasks.Runtime(app, cfg, store or open_store(cfg), redis_server.client(), backend, "edge@test", ["ds"],
                           1.0)
        tasks.install(rt)
        made.append(rt)
        return rt

    def prompt(i: int, tag: str = "q") -> PromptTask:
        settings = cfg.dataset("ds").settings(cfg.fleet.model)
        messages = [Message(role="user", content=f"{tag} {i}: write a function")]
        return PromptTask(key=prompt_key("ds", messages, settings), dataset="ds", source=f"d.jsonl:{i}",
                          messages=messages, settings=settings, settings_id=settings_id(settings),
                          enqueued_at=time.time())

    def run(rt, task: PromptTask):
        """Deliver one message of ``task`` to the registered task, as the worker's pool does."""
        gen = rt.app.tasks[rk.TASK_NAME]
        gen.push_request(id=task.key, delivery_info={"routing_key": rk.queue("ds")}, args=[], kwargs={})
        try:
            import msgspec

            return gen.run(msgspec.to_builtins(task))
        finally:
            gen.pop_request()

    yield SimpleNamespace(cfg=cfg, emu=emu, r=redis_server.client(), store=open_store(cfg),
                          runtime=runtime, prompt=prompt, run=run, backend=backend)
    for rt in made:
        rt.stop()
    backend.close()


# -- the reconciler ----------------------------------------------------------------------------


class _StoreWritten(FileStore):
    """The store as the reconciler sees it while workers run: right after it is listed, two
    more records are stored and counted (what a busy fleet does between the two reads)."""

    def __init__(self, root, ledger: Ledger, late: list):
        super().__init__(root)
        self.ledger, self.late = ledger, late

    def keys(self, dataset):
        listed = super().keys(dataset)
        while self.late:
            rec = self.late.pop()
            assert self.put(rec)
            self.ledger.count(rec)
        return listed


def test_reconcile_compares_only_keys_seen_by_both_reads(tmp_path, redis_server):
    """Measured in issue 14: 2,000 of 3,000 tokens were removed as "counted but not stored"."""
    r = redis_server.client()
    ledger = Ledger(r)
    first = _record("a1" * 32, completion_tokens=1000, output_ids=[5] * 1000)
    open_store(tmp_path).put(first)
    ledger.count(first)
    late = [_record(k * 32, completion_tokens=1000, output_ids=[5] * 1000) for k in ("b2", "c3")]
    store = _StoreWritten(tmp_path, ledger, late)
    drift = Reconciler(store, r).reconcile("ds")
    removed = -drift.corrections.get("*", {}).get("completion_tokens", 0)
    print(f"reconcile drift: {removed} of 3000 tokens removed")
    assert drift.corrections == {} and drift.counted_not_stored == 0, drift
    assert ledger.dataset_totals("ds")["completion_tokens"] == 3000
    assert ledger.totals("ds")["sglang"]["completion_tokens"] == 3000
    # a key counted but truly gone from the store is still taken out
    os.unlink(store.path("ds", "c3" * 32))
    drift = Reconciler(open_store(tmp_path), r).reconcile("ds")
    assert drift.counted_not_stored == 1 and drift.corrections["*"]["completion_tokens"] == -1000


# -- _defer through a broker that is gone ----------------------------------------------------


def test_a_deferred_copy_that_cannot_be_sent_requeues_the_original(fleet):
    """A twin holds the claim: the copy is re-sent with a countdown. If the broker refuses the send
    (kombu OperationalError), the original must go back to its queue, never be acknowledged."""
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    rt = fleet.runtime(dead_broker)
    task = fleet.prompt(1)
    fleet.r.set(rk.claim("ds", task.key), "twin@elsewhere:1:abc", ex=60)
    with pytest.raises(Reject) as exc:
        fleet.run(rt, task)
    assert exc.value.requeue
    assert not fleet.store.has("ds", task.key) and not fleet.store.failures("ds")


# -- unreadable record files -----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["empty", "corrupt", "dangling_symlink"])
def test_an_unreadable_record_is_set_aside_and_generated(fleet, damage, tmp_path):
    rt = fleet.runtime()
    task = fleet.prompt(2, tag=damage)
    path = fleet.store.path("ds", task.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "corrupt":
        path.write_bytes(b'{"key": "' + task.key.encode() + b'", "dataset": "ds", "te')
    else:
        path.symlink_to(tmp_path / "restored-from-a-backup-that-is-gone.json")
    assert fleet.store.has("ds", task.key)  # a dangling link is something at the path

    assert fleet.run(rt, task) == "stored"
    rec = fleet.store.get("ds", task.key)
    assert rec.key == task.key and rec.completion_tokens == len(rec.output_ids) > 0
    aside = list((fleet.store.root / "_unreadable" / "ds").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(task.key)
    assert os.path.islink(aside[0]) == (damage == "dangling_symlink")
    assert Ledger(fleet.r).dataset_totals("ds")["responses"] == 1
    assert Ledger(fleet.r).events("ds")["set_aside:unreadable"] == 1
    assert fleet.run(rt, task) == "duplicate"  # and once stored, a redelivery only counts it


def test_the_reconciler_sets_unreadable_records_aside_for_enqueue_to_send_again(fleet):
    """A record broken at rest (no task of its key queued) would count as done for ever: enqueue
    lists file names only. The reconciler, which reads every record, sets it aside."""
    from draftfleet.identity import prompt_key, settings_id
    from draftfleet.producer.enqueue import enqueue_dataset, prompt_messages
    from draftfleet.producer.readers import PromptRow, read_prompts
    from draftfleet.workers.app import make_app

    cfg, store, r = fleet.cfg, fleet.store, fleet.r
    ds = cfg.dataset("ds")
    settings = ds.settings(cfg.fleet.model)
    rows = [x for x in read_prompts(ds) if isinstance(x, PromptRow)]
    tasks = [PromptTask(key=prompt_key("ds", m, settings), dataset="ds", source=row.source, messages=m,
                        settings=settings, settings_id=settings_id(settings), enqueued_at=time.time())
             for row in rows[:2] for m in [prompt_messages(ds, row)]]
    rt = fleet.runtime()
    assert [fleet.run(rt, t) for t in tasks] == ["stored", "stored"]
    app = make_app(_url(r), 3600)
    assert enqueue_dataset(cfg, ds, app, r, store).queued == 1

    broken, held = (store.path("ds", t.key) for t in tasks)
    broken.write_bytes(b"")
    held.write_bytes(b"{")
    r.set(rk.claim("ds", tasks[1].key), "gpu@host:1:abc", ex=60)  # a worker is on this one
    drift = Reconciler(store, r).reconcile("ds")
    assert [os.path.basename(p).split(".")[0] for p in drift.set_aside] == [tasks[0].key]
    assert not os.path.lexists(broken) and os.path.exists(held) and len(drift.unreadable) == 1
    again = enqueue_dataset(cfg, ds, app, r, store)
    assert (again.queued, again.already_done, again.already_queued) == (1, 1, 1)


# -- one claim token per task ----------------------------------------------------------------


def test_two_copies_of_a_key_in_one_worker_hold_distinct_claims(fleet):
    """Copy A's claim lapses (Redis lost it); copy B, in the same process, claims the key. A
    ending must neither delete B's claim nor keep it from B's heartbeat."""
    rt = fleet.runtime()
    task = fleet.prompt(3)
    claim = rk.claim("ds", task.key)
    a = rt.acquire(task)
    assert a
    fleet.r.delete(claim)
    b = rt.acquire(task)
    assert b and b != a
    assert rt.acquire(task) is None  # B holds it now
    rt.release(task, a)
    assert fleet.r.get(claim).decode() == b
    assert rk.claim_holder(b) == "edge@test"
    fleet.r.delete(claim)  # lost again: the heartbeat re-creates B's, not A's
    rt.heartbeat()
    assert fleet.r.get(claim).decode() == b
    rt.release(task, b)
    assert not fleet.r.exists(claim) and rt.claims.inflight["ds"] == 0


# -- the losing twin's cost ------------------------------------------------------------------


def test_the_losing_twins_generation_is_counted_in_spend(fleet):
    """Two copies run (a lapsed claim): one stores, the other's generation was paid for too."""
    rt = fleet.runtime()
    task = fleet.prompt(4)
    ledger = Ledger(fleet.r)
    fleet.emu.update(rate_hang=1.0, hang_s=2.0)  # the loser is still generating when the winner stores
    started = threading.Event()
    result = {}

    def loser():
        started.set()
        result["loser"] = fleet.run(rt, task)

    t = threading.Thread(target=loser)
    t.start()
    started.wait()
    wait_until(lambda: fleet.r.exists(rk.claim("ds", task.key)), 10, 0.01, "the loser's claim")
    fleet.r.delete(rk.claim("ds", task.key))  # its claim lapses while it generates
    wait_until(lambda: fleet.emu.stats()["open"] == 1, 10, 0.01, "the loser's request")
    fleet.emu.update(rate_hang=0.0)
    assert fleet.run(rt, task) == "stored"
    winner = fleet.store.get("ds", task.key)
    t.join(30)
    assert result["loser"] == "duplicate"
    # the emulator answers a prompt the same way every time: the loser paid what the winner did
    assert winner.cost_usd > 0
    assert micro_usd(ledger.spend_usd("cloudy")) == 2 * micro_usd(winner.cost_usd)
    assert ledger.dataset_totals("ds")["cost_micro_usd"] == micro_usd(winner.cost_usd)  # the store's figure
    assert fleet.emu.stats()["by_endpoint"]["/v1/chat/completions"] == 2
    # the loser's payment is kept in the store (no record carries it), so a spend rebuilt after
    # Redis lost everything still holds it; a second pass counts it once
    (charge,) = fleet.store.charges()
    assert (charge.backend, charge.reason, charge.key) == ("cloudy", "twin_stored", task.key)
    fleet.r.flushall()
    assert ensure_counters(fleet.store, fleet.r, wait=False) and ensure_counters(fleet.store, fleet.r, wait=False)
    Reconciler(fleet.store, fleet.r).reconcile_all()
    assert micro_usd(ledger.spend_usd("cloudy")) == 2 * micro_usd(winner.cost_usd)


@pytest.mark.parametrize("writer", ["this_task", "a_twin"])
def test_a_record_whose_answer_was_lost_is_stored_by_its_task_not_a_twin(fleet, s3_env, writer):
    """In a bucket (SeaweedFS behind a proxy), the record's PUT is stored and its answer lost, and
    botocore's retries never reach the server: ``put`` fails, and the worker's own retry calls it
    again. The object carries this task's token, so it is the task's: stored, counted once, no
    ``twin_stored`` charge. A twin's record stored first is still a twin's: charged, counted once."""
    from draftfleet.store.bucket import ObjectStore
    from draftfleet.schemas.config import StoreS3Section

    from .test_s3_store import _Proxy, _drop, botocore_attempts, lose_then_refuse

    task = fleet.prompt(7, tag=writer)
    bucket = s3_env.bucket()
    with _Proxy(s3_env, _drop("nothing")) as proxy:
        store = ObjectStore(f"s3://{bucket}/x", StoreS3Section(endpoint=proxy.endpoint))
        store.prepare()
        rt = fleet.runtime(store=store)
        refused = botocore_attempts(store) - 1
        fault = lose_then_refuse(f"/ds/{task.key[:2]}/{task.key}.json", refused)
        if writer == "a_twin":  # another task of the key stores its record just before ours is sent
            real = fault

            def fault(m, path, headers, body, send):
                if m == "PUT" and not real.seen and f"/{task.key}.json" in path:
                    assert ObjectStore(f"s3://{bucket}/x").put(_record(task.key, text="twin's"))
                return real(m, path, headers, body, send)

            fault.seen = real.seen
        proxy.change = fault
        outcome = fleet.run(rt, task)
        seen = list(fault.seen)
    ledger = Ledger(fleet.r)
    wait_until(lambda: ledger.dataset_totals("ds")["responses"] == 1, 10, 0.05, "the record counted")
    assert ledger.events("ds")["retry:store_error"] == 1  # the worker's own retry of put, after botocore's
    charges = store.charges()
    if writer == "this_task":
        assert seen == ["lost"] + ["refused"] * refused + ["sent"]
        assert outcome == "stored" and store.get("ds", task.key).worker == "edge@test"
        assert charges == [] and list(store.bucket.list(store.object_name("_charges", ""))) == []
    else:
        assert outcome == "duplicate" and store.get("ds", task.key).text == "twin's"
        (charge,) = charges
        assert (charge.reason, charge.key) == ("twin_stored", task.key)
    assert ledger.dataset_totals("ds")["responses"] == 1


# -- failure records of finished prompts -----------------------------------------------------


def test_storing_a_result_clears_the_prompts_failure_record(fleet):
    rt = fleet.runtime()
    task = fleet.prompt(5)
    fleet.store.put_failure(FailureRecord(
        key=task.key, dataset="ds", source=task.source, reason="HTTP 503 four times", error_kind="http_503",
        attempts=4, backend="cloudy", worker="other@host", failed_at=time.time(), task=task))
    assert [f.key for f in fleet.store.failures("ds")] == [task.key]
    assert fleet.run(rt, task) == "stored"
    assert fleet.store.failures("ds") == []


def test_a_failure_recorded_after_a_twin_stored_the_prompt_is_cleared(fleet):
    from draftfleet.workers import tasks

    rt = fleet.runtime()
    task = fleet.prompt(6)
    assert fleet.run(rt, task) == "stored"  # the twin that won
    tasks._fail(rt, task, "http_400", "a late copy failed on a 400", 1)  # the copy that lost, late
    assert fleet.store.failures("ds") == [] and not fleet.store.failure_path("ds", task.key).exists()
    # a store written before failures were cleared: a finished prompt is not listed as failed
    fleet.store.put_failure(FailureRecord(
        key=task.key, dataset="ds", source=task.source, reason="old", error_kind="http_503", attempts=4,
        backend="cloudy", worker="old@host", failed_at=time.time(), task=task))
    assert fleet.store.failure_path("ds", task.key).exists() and fleet.store.failures("ds") == []


# -- the quarantine --------------------------------------------------------------------------


def test_quarantine_keeps_every_rejection_and_names_the_imported_file(fleet, tmp_path, target_tokenizer):
    from draftfleet.producer.enqueue import check_manifest, enqueue_dataset
    from draftfleet.producer.importer import import_file
    from draftfleet.workers.app import make_app

    cfg, store = fleet.cfg, fleet.store
    ds = cfg.dataset("ds")
    app = make_app(_url(fleet.r), 3600)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ok 1"}\n{not json\n')
    enqueue_dataset(cfg, ds, app, fleet.r, store)
    with open(data, "a") as fh:  # the operator finds more bad lines later; the first stays bad
        fh.write('{"prompt": 5}\n')
    enqueue_dataset(cfg, ds, app, fleet.r, store)
    enqueue_dataset(cfg, ds, app, fleet.r, store)  # a re-run adds nothing twice
    raw = tmp_path / "raw_responses.jsonl"
    raw.write_text('{"prompt": "imported 1", "output": "fine"}\n[1, 2]\n')
    manifest = check_manifest(store, cfg, ds, new_version=False)
    summary = import_file(raw, ds, manifest, store, target_tokenizer, Ledger(fleet.r))
    assert (summary.imported, summary.rejected) == (1, 1)

    entries = [json.loads(x) for x in store.quarantine_path("ds").read_text().splitlines()]
    assert [(e["file"], e["line"], e["kind"]) for e in entries] == [
        (str(data), 2, "bad_json"), (str(data), 3, "wrong_type"), (str(raw), 2, "not_object")]
    assert entries[2]["message"].startswith("raw_responses.jsonl:2: ")


def _url(r) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


# -- the published dataset settings ---------------------------------------------------------


def test_published_settings_leave_out_unsafe_or_unreadable_entries(fleet):
    import msgspec

    from draftfleet.assign import publish, published
    from draftfleet.schemas.records import DatasetManifest

    settings = fleet.cfg.dataset("ds").settings(fleet.cfg.fleet.model)
    good = DatasetManifest(name="ds", version=1, settings=settings, settings_id=settings_id(settings),
                           budget_tokens=500, created_at=time.time())
    publish(fleet.r, good)
    fleet.r.hset(rk.DATASETS, "../etc", msgspec.json.encode(msgspec.structs.replace(good, name="../etc")))
    fleet.r.hset(rk.DATASETS, "other", msgspec.json.encode(good))  # a field that is not its own name
    fleet.r.hset(rk.DATASETS, "junk", b"{not json")
    assert published(fleet.r) == {"ds": good}
