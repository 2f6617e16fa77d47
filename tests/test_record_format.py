"""Stored records keep their JSON: what earlier versions wrote still decodes to the same record,
and a record encodes to the same keys and values (``Turn`` and ``ResponseRecord`` share their
answer fields through ``Answer``; JSON objects are unordered, so only the keys' order moved)."""

from __future__ import annotations

import json

import msgspec

from draftfleet.conversation import record_turns
from draftfleet.schemas.records import Answer, ResponseRecord, Turn, TurnProgress

# Written by the store before ``Answer`` existed (field for field, in that version's key order).
CONVERSATION = (
    '{"schema_version":1,"key":"abababababababababababababababababababababababababababababababab","dataset":"ds",'
    '"source":"d.jsonl:3","settings_id":"s1","messages":[{"role":"user","content":"hello"}],"system_prompt_used":false,'
    '"text":"hi","reasoning":"think","output_ids":[11,12,2],"prompt_tokens":7,"completion_tokens":3,'
    '"finish_reason":"stop","truncated":false,"backend":"cloudy","backend_kind":"cloud","model":"m/x",'
    '"token_source":"retokenized","usage":{"prompt_tokens":7,"completion_tokens":3,"cost_usd":0.00021},'
    '"cost_usd":0.00021,"cost_source":"provider","latency_s":0.5,"attempts":2,"worker":"w@h",'
    '"created_at":1700000000.5,"retry_reasons":["http_503"],"row_id":"r7","turns":[{"prompt_ids":[1,2,3],'
    '"output_ids":[11,12,2],"text":"hi","reasoning":"think","finish_reason":"stop","truncated":false,'
    '"prompt_tokens":7,"completion_tokens":3,"backend":"cloudy","backend_kind":"cloud","model":"m/x",'
    '"token_source":"retokenized","usage":{"prompt_tokens":7,"completion_tokens":3,"cost_usd":0.00021},'
    '"cost_usd":0.00021,"cost_source":"provider","latency_s":0.5,"attempts":2,"worker":"w@h",'
    '"created_at":1700000000.5,"retry_reasons":["http_503"]}]}'
)
# The seed's format (aae17f4): no ``row_id``, no ``turns``, no ``retry_reasons`` yet written by it.
SEED_SINGLE = (
    '{"schema_version":1,"key":"cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd","dataset":"ds",'
    '"source":"d.jsonl:1","settings_id":"s1","messages":[{"role":"user","content":"q"}],"system_prompt_used":false,'
    '"text":"a","reasoning":null,"output_ids":[5,2],"prompt_tokens":4,"completion_tokens":2,"finish_reason":"stop",'
    '"truncated":false,"backend":"sglang","backend_kind":"gpu","model":"m/x","token_source":"exact",'
    '"usage":{"prompt_tokens":4,"completion_tokens":2},"cost_usd":0.0,"cost_source":"none","latency_s":0.1,'
    '"attempts":1,"worker":"g@h","created_at":1600000000.0}'
)


def test_records_written_before_still_decode_and_encode_to_the_same_json():
    rec = msgspec.json.decode(CONVERSATION, type=ResponseRecord)
    assert (rec.key, rec.row_id, rec.text, rec.reasoning, rec.output_ids, rec.usage.cost_usd) == (
        "ab" * 32, "r7", "hi", "think", [11, 12, 2], 0.00021)
    [turn] = rec.turns
    assert isinstance(turn, Turn) and turn.prompt_ids == [1, 2, 3] and turn.retry_reasons == ["http_503"]
    assert json.loads(msgspec.json.encode(rec)) == json.loads(CONVERSATION)
    progress = TurnProgress(key=rec.key, dataset="ds", turns=rec.turns)
    assert msgspec.json.decode(msgspec.json.encode(progress), type=TurnProgress) == progress

    seed = msgspec.json.decode(SEED_SINGLE, type=ResponseRecord)
    assert (seed.output_ids, seed.token_source, seed.turns, seed.row_id, seed.retry_reasons) == (
        [5, 2], "exact", [], None, [])
    assert json.loads(msgspec.json.encode(seed)) == {**json.loads(SEED_SINGLE), "retry_reasons": [], "row_id": None,
                                                     "turns": []}


def test_a_single_answer_record_reads_as_one_turn_with_every_answer_field():
    seed = msgspec.json.decode(SEED_SINGLE, type=ResponseRecord)
    [turn] = record_turns(seed)
    assert turn.prompt_ids == []
    assert all(getattr(turn, f) == getattr(seed, f) for f in Answer.__struct_fields__)
    assert set(Turn.__struct_fields__) == {*Answer.__struct_fields__, "prompt_ids"}


def test_a_batch_answer_names_its_batch_and_every_other_record_leaves_the_field_out():
    """``batch_id`` (issue 43) is written only by a provider batch's answer: every other record keeps
    the bytes it had, and a record that carries the field (or null) reads back as written."""
    seed = msgspec.json.decode(SEED_SINGLE, type=ResponseRecord)
    assert "batch_id" not in json.loads(msgspec.json.encode(seed)) and not seed.batch_id
    batched = msgspec.structs.replace(seed, batch_id="b-1")
    again = msgspec.json.decode(msgspec.json.encode(batched), type=ResponseRecord)
    assert again.batch_id == "b-1" and again == batched
    nulled = msgspec.json.decode(SEED_SINGLE[:-1] + ',"batch_id":null}', type=ResponseRecord)
    assert nulled.batch_id is None and json.loads(msgspec.json.encode(nulled))["batch_id"] is None
