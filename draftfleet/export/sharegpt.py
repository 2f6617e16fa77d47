"""SpecForge's conversations format: ``{"id", "conversations": [...], "metadata"}`` JSONL.

Top-level keys stay ``id``, ``conversations`` and ``metadata``: SpecForge passes every other column
into ``apply_chat_template``. A conversation carries exactly the turns the generation used: its
system turn when it had one (and none when it had none: the manifest says which SpecForge
template then adds nothing), every regenerated answer with its reasoning in ``reasoning_content``
(read only by SpecForge's thinking templates). A turn cut at ``max_tokens`` is left out unless
asked for: the trainer closes every assistant turn with the end-of-turn token, a stop the model
never made; the turns before it stay.
"""

from __future__ import annotations

from draftfleet.conversation import record_turns, runs
from draftfleet.schemas.records import ResponseRecord


def row(rec: ResponseRecord, metadata: dict, include_truncated: bool) -> tuple[dict | None, int]:
    """The record's row (None when no turn is left) and how many cut turns were left out."""
    turns = record_turns(rec)
    cut = 0
    if turns and turns[-1].truncated and not include_truncated:
        turns, cut = turns[:-1], 1
    if not turns:
        return None, cut
    conversation: list[dict] = []
    for run, turn in zip(runs(rec.messages), turns):
        conversation.extend({"role": m.role, "content": m.content} for m in run)
        answer = {"role": "assistant", "content": turn.text}
        if turn.reasoning is not None:
            answer["reasoning_content"] = turn.reasoning
        conversation.append(answer)
    return {"id": rec.key, "conversations": conversation, "metadata": {**metadata, "turns": len(turns)}}, cut
