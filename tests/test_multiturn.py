"""Multi-turn regeneration (``turns = "all"``): every user turn answered by the target, each turn
asked with the fleet's own earlier answers, on GPU and cloud workers, through a pivot and a
worker's death, exported one token row per turn."""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager

import pytest
from transformers import AutoTokenizer

from draftfleet import redis_keys as rk
from draftfleet.conversation import history, runs
from draftfleet.identity import prompt_key, settings_id, task_problem
from draftfleet.producer.readers import read_prompts
from draftfleet.schemas.config import DatasetConfig, load_config
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.store import Store, open_store

from . import specforge_render as sf
from .conftest import run_cli, wait_until, write_config, write_jsonl
from .test_export_training import CHATML_THINKING
from .test_fleet import KEY_ENV, _enqueue

ORIGINAL = "ORIGINALANSWER"


def _conversations(n: int) -> list[dict]:
    """Chat rows of 1 to 4 user turns (OpenAI and ShareGPT shapes), the dataset's own answers marked."""
    rows = []
    for i in range(n):
        turns = 1 + i % 4
        if i % 2:
            msgs = [{"from": "system", "value": "Be brief."}] if i % 3 == 0 else []
            for t in range(turns):
                msgs += [{"from": "human", "value": f"conversation {i} turn {t}: write a function"},
                         {"from": "gpt", "value": f"{ORIGINAL} {i} {t}"}]
            rows.append({"id": f"c{i}", "conversations": msgs})
        else:
            msgs = []
            for t in range(turns):
                msgs += [{"role": "user", "content": f"conversation {i} turn {t}: explain the code"},
                         {"role": "assistant", "content": f"{ORIGINAL} {i} {t}"}]
            rows.append({"id": f"c{i}", "messages": msgs[:-1] if i % 4 == 2 else msgs})
    return rows


def test_reader_keeps_every_user_turn_and_marks_the_answers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                      {"role": "assistant", "content": "y"}, {"role": "user", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "z"}]},
        {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                      {"role": "system", "content": "s"}, {"role": "assistant", "content": "y"}]},
    ])
    rows = list(read_prompts(DatasetConfig(name="d", path=str(path), turns="all")))
    assert rows[0].messages == [Message("user", "a"), Message("assistant", ""), Message("user", "b"),
                                Message("user", "c")]
    assert runs(rows[0].messages) == [[Message("user", "a")], [Message("user", "b"), Message("user", "c")]]
    assert rows[1].messages == [Message("user", "a")]
    assert rows[2].entry.kind == "empty_prompt"  # a run between two answers with no user turn
    first = list(read_prompts(DatasetConfig(name="d", path=str(path))))
    assert first[0].messages == [Message("user", "a")]


def test_key_covers_turns_and_setting_and_forged_marks_are_refused():
    s = GenerationSettings(model="m", max_tokens=8, temperature=0.7, top_p=1.0)
    all_ = GenerationSettings(model="m", max_tokens=8, temperature=0.7, top_p=1.0, turns="all")
    one, two = [Message("user", "a")], [Message("user", "a"), Message("assistant", ""), Message("user", "b")]
    assert len({prompt_key("d", one, s), prompt_key("d", one, all_), prompt_key("d", two, all_)}) == 3
    task = PromptTask(key=prompt_key("d", two, s), dataset="d", source="x", messages=two, settings=s,
                      settings_id="x", enqueued_at=0.0)
    assert "empty marks" in task_problem(task, [s])
    answered = [Message("user", "a"), Message("assistant", "the dataset's answer"), Message("user", "b")]
    task = PromptTask(key=prompt_key("d", answered, all_), dataset="d", source="x", messages=answered, settings=all_,
                      settings_id=settings_id(all_), enqueued_at=0.0)
    assert "empty marks" in task_problem(task, [all_])


def _check_conversations(store: Store, tok, rows: list[dict]) -> dict:
    """Every conversation: as many regenerated turns as user turns, or ending at a cut turn; each
    turn's ids exactly what its history renders to; the dataset's answers never sent."""
    records = list(store.records("ds"))
    assert len(records) == len(rows)
    seen = {"gpu": 0, "cloud": 0, "cut": 0, "turns": 0, "mixed": 0}
    for rec in records:
        parts = runs(rec.messages)
        turns = rec.turns
        assert turns and (len(turns) == len(parts) or (turns[-1].truncated and len(turns) < len(parts)))
        assert not any(t.truncated for t in turns[:-1])
        assert rec.truncated == turns[-1].truncated and rec.row_id is not None
        assert rec.completion_tokens == sum(len(t.output_ids) for t in turns)
        for k, turn in enumerate(turns):
            asked = history(rec.messages, turns[:k])
            assert turn.prompt_ids == tok.prompt_ids(asked)
            assert ORIGINAL not in tok.decode(turn.prompt_ids)
            if turn.token_source == "retokenized":
                assert turn.output_ids == tok.completion_ids(asked, turn.text, turn.reasoning,
                                                             turn.finish_reason == "stop")
            seen[turn.backend_kind] += 1
        seen["cut"] += rec.truncated
        seen["turns"] += len(turns)
        seen["mixed"] += len({t.backend_kind for t in turns}) > 1
    return seen


@pytest.mark.slow
def test_multiturn_dataset_end_to_end_on_gpu_and_cloud_with_a_pivot(tmp_path, redis_server, tokenizer_dir,
                                                                    target_tokenizer, emulator_factory, workers):
    emu = emulator_factory(single_stream_tps=400, ceiling_tps=100000, length="uniform:8:60", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"], reasoning_rate=0.4, reasoning_length="uniform:4:20")
    rows = _conversations(40)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=4, concurrency=4,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 50, "turns": "all",
                                     "budget_tokens": 10_000_000}])
    workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url)
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env=KEY_ENV)
    r = redis_server.client()
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 2, 60, 0.1, workers.logs())
    assert _enqueue(config, redis_server.url)[0]["queued"] == 40
    store = open_store(load_config(config))
    wait_until(lambda: len(store.keys("ds")) >= 10, 90, 0.1, workers.logs())
    env = {"REDIS_URL": redis_server.url}
    res = run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "cloud", "--json", env=env)
    assert res.returncode == 0, res.stderr
    gpu_at_drain = emu.stats()["by_endpoint"].get("/generate", 0)
    wait_until(lambda: len(store.keys("ds")) == 40, 120, 0.2, workers.logs())
    assert emu.stats()["by_endpoint"].get("/generate", 0) == gpu_at_drain  # started conversations ended at the drain
    seen = _check_conversations(store, target_tokenizer, rows)
    assert seen["gpu"] and seen["cloud"] and seen["cut"]
    requests = sum(emu.stats()["by_endpoint"].get(p, 0) for p in ("/generate", "/v1/chat/completions"))
    assert requests == seen["turns"]  # no turn paid twice
    assert not list((store.root / "_progress").rglob("*.json"))

    # totals count every turn; inventory counts turns and conversations
    res = run_cli("reconcile", "--config", str(config), "--json", env=env)
    assert res.returncode == 0, res.stderr
    inv = json.loads(run_cli("inventory", "--config", str(config), "--json", env=env).stdout)[0]
    assert inv["conversations"] == 40 and inv["turns"] == seen["turns"]
    assert inv["completion_tokens"] == sum(rec.completion_tokens for rec in store.records("ds"))
    totals = {k.decode(): int(v) for k, v in r.hgetall(rk.dataset_totals("ds")).items()}
    assert totals["completion_tokens"] == inv["completion_tokens"]

    # exports: one token row per turn, conversations with every completed answer
    out = tmp_path / "out"
    res = run_cli("export", "--config", str(config), "-f", "sharegpt", "-f", "tokens", "-f", "raw", "--out", str(out))
    assert res.returncode == 0, res.stderr
    token_rows = [json.loads(line) for line in (out / "ds.tokens.jsonl").read_text().splitlines()]
    assert len(token_rows) == seen["turns"]
    convs = [json.loads(line) for line in (out / "ds.sharegpt.jsonl").read_text().splitlines()]
    records = {rec.key: rec for rec in store.records("ds")}
    for row in convs:
        rec = records[row["id"]]
        answers = [t for t in row["conversations"] if t["role"] == "assistant"]
        assert len(answers) == len(rec.turns) - rec.truncated and ORIGINAL not in json.dumps(row)
        assert row["metadata"]["prompt_id"] == rec.row_id
    # SpecForge's preprocessing renders each conversation to the generated ids of all its turns,
    # except where an exact answer's ids are not its text's own encoding (the history is text)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows_of: dict[str, list[dict]] = {}
    for row in token_rows:
        rows_of.setdefault(row["primary_id"], []).append(row)
    equal = 0
    for row in convs:
        kept = rows_of[row["id"]][:row["metadata"]["turns"]]
        ids_equal, covers, extra = sf.compare(sf.parse(hf, sf.no_default_system(CHATML_THINKING), row), kept)
        canonical = all(target_tokenizer.roundtrip_mismatches([t.output_ids]) == 0
                        for t in records[row["id"]].turns[:row["metadata"]["turns"]])
        assert ids_equal == canonical and (not ids_equal or covers)
        assert extra <= len(kept) - 1  # the newline after each earlier answer's <|im_end|>, trained by SpecForge
        equal += ids_equal
    print(f"\nmulti-turn: SpecForge-rendered ids equal to the generated ids in {equal} of {len(convs)} conversations")
    # a raw export imports back as the same conversations
    again = tmp_path / "again"
    cfg2 = write_config(again, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(data), "max_tokens": 50,
                                                                   "turns": "all"}])
    res = run_cli("import", str(out / "ds.raw_responses.jsonl"), "--config", str(cfg2), "--dataset", "ds", "--json",
                  env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["imported"] == 40
    imported = {rec.key: rec for rec in open_store(again / "store").records("ds")}
    assert {k: (r.turns, r.row_id) for k, r in imported.items()} == {k: (r.turns, r.row_id) for k, r in records.items()}


@pytest.mark.slow
def test_completed_turns_survive_a_killed_worker(tmp_path, redis_server, tokenizer_dir, target_tokenizer,
                                                 emulator_factory, workers):
    """A GPU worker killed mid-conversation: its completed turns are kept, the conversation goes
    back whole and the cloud resumes it at the next turn, paying for no completed turn again."""
    emu = emulator_factory(single_stream_tps=40, ceiling_tps=100000, length="uniform:20:30", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    rows = [{"id": f"c{i}", "messages": [m for t in range(3) for m in (
        {"role": "user", "content": f"conversation {i} turn {t}"}, {"role": "assistant", "content": ORIGINAL})]}
        for i in range(6)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, inflight=6, concurrency=6,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64, "turns": "all"}])
    fast = {"DRAFTFLEET_CLAIM_TTL_S": "6"}
    gpu = workers.start(config, "gpu", "--url", emu.url, redis_url=redis_server.url, env=fast)
    r = redis_server.client()
    wait_until(lambda: len(list(r.scan_iter("draftfleet:worker:*"))) == 1, 60, 0.1, workers.logs())
    _enqueue(config, redis_server.url)
    store = open_store(load_config(config))
    progress = store.root / "_progress" / "ds"
    wait_until(lambda: len(list(progress.glob("[!.]*.json"))) >= 3, 60, 0.05, workers.logs())
    gpu.send_signal(signal.SIGKILL)
    gpu.wait()
    killed_at = time.time()
    kept = {p.stem: store.progress("ds", p.stem) for p in progress.glob("[!.]*.json")}
    kept = {k: v for k, v in kept.items() if v is not None}
    requests_at_kill = emu.stats()["by_endpoint"].get("/generate", 0)
    env = {"REDIS_URL": redis_server.url}
    assert run_cli("pivot", "--config", str(config), "--dataset", "ds", "--to", "cloud", "--json",
                   env=env).returncode == 0
    workers.start(config, "cloud", "--backend", "cloudy", redis_url=redis_server.url, env={**KEY_ENV, **fast})
    wait_until(lambda: len(store.keys("ds")) == 6, 120, 0.2, workers.logs())
    for key, prog in kept.items():
        rec = store.get("ds", key)
        assert rec.turns[:len(prog.turns)] == prog.turns  # kept, not generated again
        assert all(t.backend_kind == "cloud" and t.created_at > killed_at for t in rec.turns[len(prog.turns):])
        assert len(rec.turns) == 3
    seen = _check_conversations(store, target_tokenizer, rows)
    assert seen["mixed"] >= 1
    cloud_requests = emu.stats()["by_endpoint"].get("/v1/chat/completions", 0)
    assert cloud_requests == seen["cloud"]  # the cloud paid for each of its turns once
    assert seen["gpu"] <= requests_at_kill  # GPU turns stored are ones generated before the kill


@pytest.fixture
def conversation_worker(tmp_path, redis_server, tokenizer_dir, target_tokenizer, emulator_factory, monkeypatch):
    """A worker's Runtime in this process (cloud backend on the emulator, real Redis) and a
    three-turn conversation task of a ``turns = "all"`` dataset with a budget."""
    from draftfleet.workers import tasks
    from draftfleet.workers.app import make_app
    from draftfleet.workers.cloud import CloudChat

    emu = emulator_factory(single_stream_tps=3000, ceiling_tps=100000, length="uniform:5:20", ttft_s=0.0,
                           api_key=KEY_ENV["DRAFTFLEET_TEST_KEY"])
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "unused"}])
    cfg = load_config(write_config(tmp_path, tokenizer=tokenizer_dir, emulator_url=emu.url, datasets=[
        {"name": "ds", "path": str(data), "max_tokens": 64, "turns": "all", "budget_tokens": 1_000_000}]))
    open_store(cfg).prepare()
    backend = CloudChat("cloudy", cfg.cloud("cloudy"), target_tokenizer, KEY_ENV["DRAFTFLEET_TEST_KEY"])
    app = make_app(redis_server.url, 3600)
    tasks.register(app)
    rt = tasks.Runtime(app, cfg, open_store(cfg), redis_server.client(), backend, "conv@test", ["ds"], 1.0)
    tasks.install(rt)
    settings = cfg.dataset("ds").settings(cfg.fleet.model)
    messages = [Message("user", "turn a"), Message("assistant", ""), Message("user", "turn b"),
                Message("assistant", ""), Message("user", "turn c")]
    task = PromptTask(key=prompt_key("ds", messages, settings), dataset="ds", source="d.jsonl:1", messages=messages,
                      settings=settings, settings_id=settings_id(settings), enqueued_at=time.time())

    def run(t: PromptTask):
        import msgspec

        gen = app.tasks[rk.TASK_NAME]
        gen.push_request(id=t.key, delivery_info={"routing_key": rk.queue("ds")}, args=[], kwargs={})
        try:
            return gen.run(msgspec.to_builtins(t))
        finally:
            gen.pop_request()

    yield tasks, rt, task, run, emu
    rt.stop()
    backend.close()


@contextmanager
def turn_two_refused(rt, emu, monkeypatch):
    """Inside: the request right after turn 1 is kept is refused (moderation); after: none is."""
    real = rt.store.put_progress

    def then_refuse(progress):  # the fault arrives with the next request, right after turn 1 is kept
        real(progress)
        emu.update(rate_moderation=1.0)

    monkeypatch.setattr(rt.store, "put_progress", then_refuse)
    try:
        yield
    finally:
        monkeypatch.setattr(rt.store, "put_progress", real)
        emu.update(rate_moderation=0.0)


def test_admission_reserves_for_the_turns_still_to_come(conversation_worker, redis_server):
    tasks, rt, task, _, _ = conversation_worker
    r = redis_server.client()
    token = rt.acquire(task)
    assert token is not None
    reserved = []
    granted = []
    for left in (3, 1):
        granted.append(tasks._admit(rt, task, token, left))
        reserved.append(int(r.hget(rk.reservations("ds"), task.key).decode().split(":")[0]))
        rt.ledger.release("ds", task.key, token)
    # the most each turn still to come can make: max_tokens per turn, no estimate
    assert reserved == granted == [3 * 64, 64]
    assert r.hget(rk.reservations("ds"), task.key) is None


def test_a_failed_turn_keeps_the_completed_ones_and_a_retry_resumes(conversation_worker, monkeypatch):
    """Turn 2 is refused (moderation): the failure names the conversation's own task (so requeue
    sends it again), turn 1 stays kept, and the retry pays only for turns 2 and 3."""
    tasks, rt, task, run, emu = conversation_worker
    with turn_two_refused(rt, emu, monkeypatch):
        assert run(task) == "failed"
    [failure] = rt.store.failures("ds")
    assert failure.task == task and failure.error_kind == "moderation"
    [turn1] = rt.store.progress("ds", task.key).turns
    assert emu.stats()["by_endpoint"]["/v1/chat/completions"] == 2

    assert run(failure.task) == "stored"
    rec = rt.store.get("ds", task.key)
    assert rec.turns[0] == turn1 and len(rec.turns) == 3
    assert emu.stats()["by_endpoint"]["/v1/chat/completions"] == 4  # turns 2 and 3 only
    assert rt.store.progress("ds", task.key) is None and not rt.store.failures("ds")
