"""``raw_responses.jsonl``: one line per record with its text, ids and provenance.

The seed's own scripts read ``completion_tokens`` and ``output_ids``; ``draftfleet import`` of this
file gives back the same records (provenance included). A conversation's line also holds its
``turns``, each with its prompt ids, answer, reasoning and ids.
"""

from __future__ import annotations

import msgspec

from draftfleet.schemas.records import ResponseRecord


def row(rec: ResponseRecord) -> dict:
    line = {
        "id": rec.key, "prompt_id": rec.row_id,
        "messages": [{"role": m.role, "content": m.content} for m in rec.messages],
        "output": rec.text, "reasoning": rec.reasoning, "output_ids": rec.output_ids,
        "completion_tokens": rec.completion_tokens, "prompt_tokens": rec.prompt_tokens,
        "finish_reason": rec.finish_reason, "backend": rec.backend, "token_source": rec.token_source,
        "source": rec.source,
        # provenance, so that ``draftfleet import`` of this file gives back the same records
        "backend_kind": rec.backend_kind, "model": rec.model, "cost": rec.cost_usd, "cost_source": rec.cost_source,
        "usage": msgspec.to_builtins(rec.usage), "latency_s": rec.latency_s, "attempts": rec.attempts,
        "retry_reasons": rec.retry_reasons,
    }
    if rec.turns:
        line["turns"] = msgspec.to_builtins(rec.turns)
    return line
