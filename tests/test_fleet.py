"""The fleet end to end: real Redis, real Celery worker processes, the emulator on loopback.

These run the production code path: ``draftfleet enqueue`` and ``draftfleet worker`` as
subprocesses, SGLang's ``/generate`` and OpenAI chat completions over real HTTP.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from draftfleet.ledger import Ledger
from draftfleet.queues import depth
from draftfleet.schemas.config import load_config
from draftfleet.store import Store, open_store

from .conftest import run_cli, wait_until, write_config, write_jsonl

pytestmark = pytest.mark.slow

KEY_ENV = {"DRAFTFLEET_TEST_KEY": "test-key-123"}


def _chat_rows(n: int, tag: str = "chat") -> list:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"{tag} question {i}: write a function"}]
        if i % 4 == 0:
            msgs.append({"role": "assistant", "content": "an old answer that must not be sent"})
            msgs.append({"role": "user", "content": "a later turn that must not be sent"})
        rows.append({"id": i, "messages": msgs})
    return rows


def _enqueue(config, redis_url, *extra) -> list[dict]:
    res = run_cli("enqueue", "--config", str(config), "--json", *extra, env={"REDIS_URL": redis_url})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _store_count(store: Store, names) -> int:
    return sum(len(store.keys(n)) for n in names)


def test_two_datasets_through_gpu_and_cloud_workers(tmp_path, redis_server, tokenizer_dir, target_tokenizer,
                                                    emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=60000, length="uniform:5:60",
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], reasoning_rate=0.3,
                           reasoning_length="uniform:5:30", ttft_s=0.01)
    chat = write_jsonl(tmp_path / "data" / "chat.jsonl", [*_chat_rows(30), "{not json", '{"messages": 5}'])
    inst = write_jsonl(tmp_path / "data" / "inst.jsonl",
                       [{"instruction": f"explain item {i}", "input": "x" * (i % 3)} for i in range(30)])
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[
        {"name": "chat", "path": str(chat), "max_tokens": 200},
        {"name": "inst", "path": str(inst), "max_tokens": 200, "system_prompt": "Be brief."},
    ])
    # both workers up before anything is queued, so both get a share
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2, 60, 0.1, f"2 workers\n{workers.logs()}")
    summary = {s["dataset"]: s for s in _enqueue(config, redis_server.url)}
    assert summary["chat"]["queued"] == 30 and summary["chat"]["rejected"] == 2
    assert summary["chat"]["rejected_by_kind"] == {"bad_json": 1, "wrong_type": 1}
    assert summary["inst"]["queued"] == 30
    cfg = load_config(config)
    store = open_store(cfg)
    wait_until(lambda: _store_count(store, ["chat", "inst"]) == 60, 90, 0.2, f"60 results\n{workers.logs()}")

    by_backend = Counter()
    for name, n in (("chat", 30), ("inst", 30)):
        records = list(store.records(name))
        sources = Counter(r.source for r in records)
        assert len(records) == n and all(c == 1 for c in sources.values())
        for rec in records:
            by_backend[rec.backend] += 1
            assert rec.completion_tokens == len(rec.output_ids) > 0
            assert [m.role for m in rec.messages] == (["system", "user"] if name == "inst" else ["user"])
            assert "must not be sent" not in json.dumps([m.content for m in rec.messages])
            if name == "inst":
                assert rec.messages[0].content == "Be brief." and rec.system_prompt_used
            assert rec.finish_reason == "stop" and not rec.truncated
            assert rec.output_ids[-1] == target_tokenizer.eot_id
            if rec.backend == "sglang":
                assert (rec.backend_kind, rec.token_source, rec.model) == ("gpu", "exact", "test/chatml")
                assert target_tokenizer.decode(rec.output_ids) == rec.text
                assert rec.prompt_tokens == len(target_tokenizer.prompt_ids(rec.messages))
                assert rec.cost_usd == 0.0
            else:
                assert (rec.backend, rec.backend_kind, rec.token_source) == ("cloudy", "cloud", "retokenized")
                assert rec.cost_source == "provider" and rec.cost_usd > 0 and rec.usage.completion_tokens > 0
                full = target_tokenizer.decode(rec.output_ids, skip_special=False)
                assert full.endswith(rec.text + "<|im_end|>")
                if rec.reasoning:
                    assert full.startswith(f"<think>\n{rec.reasoning}\n</think>\n\n")
                # re-tokenizing is consistent: the ids decode back to exactly what the API returned
                assert target_tokenizer.encode_text(rec.text) == rec.output_ids[-1 - len(target_tokenizer.encode_text(rec.text)):-1]
    assert by_backend["sglang"] > 0 and by_backend["cloudy"] > 0

    # the fast counters equal the store, once the workers' tally has written its last batch (it lingers 0.5 s)
    ledger = Ledger(redis_server.client())
    for name in ("chat", "inst"):
        expect = defaultdict(lambda: [0, 0])
        for rec in store.records(name):
            expect[rec.backend][0] += 1
            expect[rec.backend][1] += rec.completion_tokens

        def counted(name=name):
            return {b: [t["responses"], t["completion_tokens"]] for b, t in ledger.totals(name).items()}
        wait_until(lambda: sum(v[0] for v in counted().values()) >= 30, 10, 0.1, f"{name} counted")
        assert counted() == dict(expect)

    # quarantine keeps the raw bad lines, with file and line in the message
    quarantined = [json.loads(x) for x in store.quarantine_path("chat").read_text().splitlines()]
    assert [q["raw"] for q in quarantined] == ["{not json", '{"messages": 5}']
    assert [q["line"] for q in quarantined] == [31, 32]
    assert "chat.jsonl:31" in quarantined[0]["message"] and "chat.jsonl:32" in quarantined[1]["message"]

    # a second enqueue queues nothing
    again = {s["dataset"]: s for s in _enqueue(config, redis_server.url)}
    assert again["chat"]["queued"] == 0 and again["chat"]["already_done"] == 30
    assert again["inst"]["queued"] == 0 and again["inst"]["already_done"] == 30


def test_resume_after_redis_lost_everything(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=40, ceiling_tps=5000, length="fixed:20", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(40))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}], inflight=4)
    assert _enqueue(config, redis_server.url)[0]["queued"] == 40
    second = _enqueue(config, redis_server.url)[0]
    assert (second["queued"], second["already_queued"]) == (0, 40)

    store = open_store(load_config(config))
    gpu = workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) >= 8, 60, 0.1, f"8 results\n{workers.logs()}")
    workers.stop(gpu)  # warm shutdown: what started finishes and is stored
    stored = len(store.keys("ds"))
    assert 8 <= stored < 40

    redis_server.client().flushall()
    third = _enqueue(config, redis_server.url)[0]
    assert (third["queued"], third["already_done"], third["already_queued"]) == (40 - stored, stored, 0)

    emu.update(single_stream_tps=2000)
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    wait_until(lambda: len(store.keys("ds")) == 40, 60, 0.2, f"40 results\n{workers.logs()}")
    sources = Counter(r.source for r in store.records("ds"))
    assert len(sources) == 40 and set(sources.values()) == {1}
    wait_until(lambda: depth(redis_server.client(), "ds") == 0, 10)


def test_gpu_worker_keeps_inflight_requests_open(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=40, ceiling_tps=100000, length="fixed:40", ttft_s=0.0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(48))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    _enqueue(config, redis_server.url)
    workers.start(config, "gpu", "--url", emu.url, "--inflight", "16", redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) == 48, 60, 0.2, f"48 results\n{workers.logs()}")
    stats = emu.stats()
    assert stats["max_concurrent_open"] == 16, stats
    assert stats["by_endpoint"].get("/generate") == 48


def test_length_is_kept_and_flagged_abort_is_retried(tmp_path, redis_server, tokenizer_dir, target_tokenizer,
                                                     emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=5000, ceiling_tps=100000, length="uniform:5:40", rate_abort=0.3,
                           ttft_s=0.0, seed=3)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(30))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, max_attempts=10,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 20}])
    _enqueue(config, redis_server.url)
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) == 30, 60, 0.2, f"30 results\n{workers.logs()}")
    records = list(store.records("ds"))
    truncated = [r for r in records if r.truncated]
    assert truncated and all(r.finish_reason == "length" and len(r.output_ids) == 20 for r in truncated)
    assert all(r.output_ids[-1] != target_tokenizer.eot_id for r in truncated)
    assert all(r.finish_reason == "stop" and r.output_ids[-1] == target_tokenizer.eot_id
               for r in records if not r.truncated)
    aborts = emu.stats()["faults"].get("abort", 0)
    assert aborts > 0
    assert sum(r.attempts - 1 for r in records) == aborts
    assert all(r.retry_reasons == ["abort"] * (r.attempts - 1) for r in records)
    def events():
        return {k.decode(): int(v) for k, v in redis_server.client().hgetall("draftfleet:events:ds").items()}
    # the truncated events are written with the tally's batch, up to 0.5 s after the last record is stored
    wait_until(lambda: events().get("truncated", 0) >= len(truncated), 10, 0.1, "the last batch counted")
    assert events()["retry:abort"] == aborts and events()["truncated"] == len(truncated)
    assert not store.failures("ds")


def test_cloud_worker_stops_on_bad_key_and_resumes(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=5000, ceiling_tps=100000, length="uniform:5:30", ttft_s=0.0,
                           api_key="the-right-key")
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(20))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    _enqueue(config, redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    wait_until(lambda: emu.stats()["unauthorized"] > 0, 30, 0.1, f"a 401\n{workers.logs()}")
    store = open_store(load_config(config))
    r = redis_server.client()
    wait_until(lambda: depth(r, "ds") == 20, 15, 0.1, "every task back in the queue")
    assert not store.keys("ds") and not store.failures("ds")
    logs = workers.logs(tail=None)
    assert "STOPPED CONSUMING draftfleet.ds: unauthorized" in logs and "test-key-123" not in logs
    emu.update(api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])  # the operator fixes the key
    wait_until(lambda: len(store.keys("ds")) == 20, 60, 0.2, f"20 results after resume\n{workers.logs()}")
    assert not store.failures("ds")


def test_manifest_refuses_changed_settings_without_new_version(tmp_path, redis_server, tokenizer_dir):
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(3))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    assert _enqueue(config, redis_server.url)[0]["version"] == 1
    config.write_text(config.read_text().replace("max_tokens = 64", "max_tokens = 128"))
    res = run_cli("enqueue", "--config", str(config), env={"REDIS_URL": redis_server.url})
    assert res.returncode == 1 and "--new-version" in res.stderr and "max_tokens" in res.stderr
    again = _enqueue(config, redis_server.url, "--new-version")[0]
    assert (again["version"], again["queued"]) == (2, 3)


def test_message_of_an_unknown_shape_is_dead_lettered(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    from draftfleet import redis_keys as rk
    from draftfleet.workers.app import make_app

    emu = emulator_factory(time_scale=0)
    data = write_jsonl(tmp_path / "d.jsonl", _chat_rows(2))
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
    app = make_app(redis_server.url, 7200)
    app.send_task(rk.TASK_NAME, args=[{"key": "../../etc/passwd", "dataset": "ds"}], queue=rk.queue("ds"))
    _enqueue(config, redis_server.url)
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) == 2, 30, 0.1, workers.logs())
    r = redis_server.client()
    wait_until(lambda: r.llen(rk.DEAD_LETTER) == 1, 10)
    entry = json.loads(r.lindex(rk.DEAD_LETTER, 0))
    assert "not a valid task" in entry["reason"] and entry["queue"] == "draftfleet.ds"
