"""Exports train on what the model saw: rendered through SpecForge's own preprocessing logic
(tests/specforge_render.py) they give back the ids the fleet generated.

Records come from the real backends (SGLang's ``/generate`` and chat completions on the emulator),
or, for the thinking templates, from each fixture's ground-truth ids of what the model emits.
"""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from draftfleet.export import export_dataset
from draftfleet.schemas.config import CloudBackend, SGLangBackend
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask, ResponseRecord
from draftfleet.store import Store, open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.backends import Generation
from draftfleet.workers.cloud import CloudChat
from draftfleet.workers.sglang import SGLangClient
from tests import specforge_render as sf
from tests.test_reasoning import ANSWERS, kimi_model_ids, qwen3_model_ids, _plain_truth
from tests.tokenizer_fixtures import kimi_encoding

CHATML_THINKING = sf.SpecForgeTemplate("<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant.",
                                       thinking=True)


def _task(i: int, messages: list[Message], max_tokens: int = 300) -> PromptTask:
    settings = GenerationSettings(model="test/chatml", max_tokens=max_tokens, temperature=0.7, top_p=1.0)
    return PromptTask(key=f"{i:064x}", dataset="ds", source=f"d.jsonl:{i}", messages=messages, settings=settings,
                      settings_id="s", enqueued_at=0.0, row_id=f"row-{i}")


def _record(task: PromptTask, gen: Generation, backend: str, kind: str) -> ResponseRecord:
    return ResponseRecord(
        key=task.key, dataset=task.dataset, source=task.source, settings_id=task.settings_id, messages=task.messages,
        system_prompt_used=any(m.role == "system" for m in task.messages), text=gen.text, reasoning=gen.reasoning,
        output_ids=gen.output_ids, prompt_tokens=gen.prompt_tokens, completion_tokens=len(gen.output_ids),
        finish_reason=gen.finish_reason, truncated=gen.truncated, backend=backend, backend_kind=kind, model=gen.model,
        token_source=gen.token_source, usage=gen.usage, cost_usd=gen.cost_usd, cost_source=gen.cost_source,
        latency_s=0.0, attempts=1, worker="w", created_at=time.time(), row_id=task.row_id,
    )


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _export(store: Store, out, tok: TargetTokenizer, **kw):
    manifest = export_dataset(store, "ds", out, ["sharegpt", "tokens"], tokenizer=tok, **kw)
    by_key: dict[str, list[dict]] = {}
    for row in _rows(out / "ds.tokens.jsonl"):
        by_key.setdefault(row.get("primary_id", row["id"]), []).append(row)
    return manifest, _rows(out / "ds.sharegpt.jsonl"), by_key


def _measure(hf, template, conversations, token_rows) -> dict[str, tuple[bool, bool, int]]:
    return {row["id"]: sf.compare(sf.parse(hf, template, row), token_rows[row["id"]]) for row in conversations}


@pytest.fixture
def fleet_records(tmp_path, emulator_factory, target_tokenizer):
    """40 prompts, half with a system turn, answered half by SGLang (exact; 15% of answers hold a
    word split into tokens the tokenizer would not choose, as sampled models write) and half by
    the cloud (re-tokenized, reasoning on half of them): the records a run stores."""
    emu = emulator_factory(reasoning_rate=0.5, split_rate=0.15, time_scale=0.0, length="uniform:20:150")
    gpu = SGLangClient(emu.url, SGLangBackend(urls=[emu.url]), target_tokenizer, inflight=4)
    cloud = CloudChat("cloudy", CloudBackend(base_url=f"{emu.url}/v1", model="vendor/model", api_key_env="X"),
                      target_tokenizer, "k")
    store = open_store(tmp_path / "store")
    kinds = {}
    for i in range(40):
        system = [Message("system", "Be brief.")] if i % 2 else []
        task = _task(i, [*system, Message("user", f"question {i}: write a python function")], max_tokens=1000)
        backend, kind = (gpu, "gpu") if i % 4 < 2 else (cloud, "cloud")
        store.put(_record(task, backend.generate(task), backend.name, kind))
        kinds[task.key] = kind
    gpu.close()
    cloud.close()
    return store, kinds


def test_specforge_renders_the_generated_ids(tmp_path, fleet_records, target_tokenizer, tokenizer_dir):
    store, kinds = fleet_records
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    manifest, conversations, token_rows = _export(store, tmp_path / "out", target_tokenizer)
    assert manifest.records == 40 and manifest.truncated_left_out == 0
    assert manifest.without_system_turn == 20 and manifest.reasoning_in_template == "all"
    assert any("system_prompt is empty" in n for n in manifest.notes)
    assert any(t.get("reasoning_content") for row in conversations for t in row["conversations"])
    records = {r.key: r for r in store.records("ds")}
    documented = _measure(hf, sf.no_default_system(CHATML_THINKING), conversations, token_rows)
    default = _measure(hf, CHATML_THINKING, conversations, token_rows)
    for key, (ids_equal, covers, extra) in documented.items():
        canonical = target_tokenizer.roundtrip_mismatches([records[key].output_ids]) == 0
        # a GPU answer whose ids are not the tokenizer's own encoding of its text cannot come back
        # from text; every other row renders to exactly the generated ids
        assert ids_equal == canonical or (kinds[key] == "cloud" and ids_equal), (key, kinds[key])
        if ids_equal:
            assert covers and extra <= 1  # SpecForge's "<|im_end|>\n" also trains the newline after it
        with_system = records[key].system_prompt_used
        # SpecForge's default system prompt changes every row generated without one
        assert default[key][0] == (ids_equal and with_system)
    share = sum(v[0] for v in documented.values()) / len(documented)
    share_default = sum(v[0] for v in default.values()) / len(default)
    print(f"\nSpecForge-rendered ids equal to the generated ids: {share:.1%} of {len(documented)} rows "
          f"(documented template); {share_default:.1%} with SpecForge's default system prompt")
    assert 0.5 < share and share_default <= share / 2 + 0.05
    assert all(v[0] for k, v in documented.items() if kinds[k] == "cloud")


def test_thinking_models_reasoning_split_and_rendered(tmp_path, qwen3_tokenizer_dir):
    """Qwen3: a GPU answer's raw ids (its own think block) are split into reasoning and content,
    and SpecForge's thinking template renders them back to the same ids; its general parser
    (or a template with a default system prompt) does not."""
    tok = TargetTokenizer(str(qwen3_tokenizer_dir))
    truth = _plain_truth(qwen3_tokenizer_dir)
    hf = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    store = open_store(tmp_path / "store")
    for i, (reasoning, content) in enumerate(ANSWERS[:2]):
        task = _task(i, [Message("user", f"question {i}")])
        ids = qwen3_model_ids(truth, reasoning, content)
        text, split = tok.split_reasoning(task.messages, ids)
        assert (text, split) == (content, reasoning)
        store.put(_record(task, Generation(text=text, reasoning=split, output_ids=ids, prompt_tokens=5,
                                           finish_reason="stop", truncated=False, token_source="exact",
                                           usage=sf_usage(), cost_usd=0.0, cost_source="none", model="m"),
                          "sglang", "gpu"))
    manifest, conversations, token_rows = _export(store, tmp_path / "out", tok)
    assert manifest.reasoning_in_template == "last"
    assert conversations[0]["conversations"][-1]["reasoning_content"] == ANSWERS[0][0]
    good = _measure(hf, sf.no_default_system(sf.QWEN3_THINKING), conversations, token_rows)
    assert all(v == (True, True, 0) for v in good.values()), good
    assert not any(v[0] for v in _measure(hf, sf.QWEN3_THINKING, conversations, token_rows).values())
    general = sf.no_default_system(sf.QWEN)  # drops reasoning_content: renders an empty think block
    assert not any(v[0] for v in _measure(hf, general, conversations, token_rows).values())


def test_kimi_k25_template_drops_reasoning_and_the_manifest_says_so(tmp_path, kimi_tokenizer_dir):
    tok = TargetTokenizer(str(kimi_tokenizer_dir), use_fast=False, trust_remote_code=True)
    truth = kimi_encoding(kimi_tokenizer_dir)
    store = open_store(tmp_path / "store")
    reasoning, content = ANSWERS[0]
    task = _task(0, [Message("system", "be brief"), Message("user", "sort a list")])
    ids = kimi_model_ids(truth, reasoning, content)
    assert tok.split_reasoning(task.messages, ids) == (content, reasoning)
    store.put(_record(task, Generation(text=content, reasoning=reasoning, output_ids=ids, prompt_tokens=5,
                                       finish_reason="stop", truncated=False, token_source="exact", usage=sf_usage(),
                                       cost_usd=0.0, cost_source="none", model="m"), "sglang", "gpu"))
    manifest, conversations, token_rows = _export(store, tmp_path / "out", tok)
    assert manifest.reasoning_in_template == "none"
    assert any("renders no answer's reasoning" in n for n in manifest.notes)
    [row] = token_rows[task.key]
    assert row["input_ids"][-len(ids):] == ids  # the tokens file holds what the model wrote
    hf = AutoTokenizer.from_pretrained(str(kimi_tokenizer_dir), use_fast=False, trust_remote_code=True)
    ids_equal, _, _ = sf.compare(sf.parse(hf, sf.KIMI_K2_THINKING, conversations[0]), token_rows[task.key])
    assert not ids_equal  # rendered <think></think>answer: the reasoning is gone


def test_cut_answers_left_out_of_conversations_kept_in_token_rows(tmp_path, target_tokenizer):
    tok = target_tokenizer
    store = open_store(tmp_path / "store")
    full = tok.encode_text("def f(x): return x") + [tok.eot_id]
    for i, ids, finish in [(0, full, "stop"), (1, full[:4], "length")]:
        task = _task(i, [Message("user", f"q {i}")])
        store.put(_record(task, Generation(text=tok.decode(ids), output_ids=ids, prompt_tokens=5, finish_reason=finish,
                                           truncated=finish == "length", token_source="exact", usage=sf_usage(),
                                           cost_usd=0.0, cost_source="none", model="m"), "sglang", "gpu"))
    manifest, conversations, token_rows = _export(store, tmp_path / "a", tok)
    assert [r["metadata"]["prompt_id"] for r in conversations] == ["row-0"] and manifest.truncated_left_out == 1
    cut = token_rows[f"{1:064x}"][0]
    assert cut["input_ids"][-4:] == full[:4] and tok.eot_id not in cut["input_ids"][-4:]
    assert cut["metadata"]["prompt_id"] == "row-1"
    manifest, conversations, _ = _export(store, tmp_path / "b", tok, include_truncated=True)
    assert len(conversations) == 2 and manifest.truncated_left_out == 0 and manifest.records == 2


def sf_usage():
    from draftfleet.schemas.records import Usage

    return Usage()
