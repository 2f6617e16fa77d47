"""Token rows, as vLLM speculators' own regeneration writes them: ``{"id", "input_ids", "loss_mask",
"metadata"}``, loss 0 on the prompt and 1 on the completion; SpecForge's trainer reads them too.

One row per turn, as speculators' ``response_regeneration`` script writes a conversation (``id``
``<conversation>_gen<k>``, ``primary_id`` the conversation): the ids the target saw (the chat
template's render of the conversation so far, with the fleet's earlier answers) and the ids it
wrote, exactly; a cut answer stays, without an end-of-turn id it never wrote. speculators'
``prepare_data`` takes such rows unchanged: rows that carry ``input_ids`` and ``loss_mask`` pass
through without rendering (``preprocessing._passthrough_pretokenized``, speculators c05b95b3).
"""

from __future__ import annotations

from draftfleet.conversation import record_turns, turn_prompts
from draftfleet.schemas.records import ResponseRecord
from draftfleet.tokenizer import TargetTokenizer


def rows(rec: ResponseRecord, metadata: dict, tok: TargetTokenizer) -> list[dict]:
    turns = record_turns(rec)
    out = []
    for k, (turn, prompt) in enumerate(zip(turns, turn_prompts(rec, tok))):
        meta = {**metadata, "backend": turn.backend, "token_source": turn.token_source,
                "finish_reason": turn.finish_reason, "completion_tokens": turn.completion_tokens}
        if rec.turns:
            meta["turn"] = k
        row = {"id": f"{rec.key}_gen{k}" if rec.turns else rec.key, "input_ids": prompt + turn.output_ids,
               "loss_mask": [0] * len(prompt) + [1] * len(turn.output_ids), "metadata": meta}
        if rec.turns:
            row["primary_id"] = rec.key
        out.append(row)
    return out
