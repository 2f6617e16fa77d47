"""Conversations: where a multi-turn prompt's answers go, and the history each turn is asked with.

A task of a ``turns = "all"`` dataset holds the conversation's system and user turns, with an
empty assistant message marking each place the dataset had an answer; the target answers after
every run of user turns. The history of turn k is the runs up to k with the fleet's own answers
(content and reasoning) between them: the same list renders the GPU prompt ids, is sent to the
cloud, and is what the exports write, so all three agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftfleet.schemas.records import Message, ResponseRecord, Turn


def runs(messages: Sequence[Message]) -> list[list[Message]]:
    """The runs of system/user turns that each get an answer (a single-turn prompt is one run)."""
    out: list[list[Message]] = [[]]
    for m in messages:
        if m.role == "assistant":
            out.append([])
        else:
            out[-1].append(m)
    return out


def answer(turn: Turn) -> Message:
    """A regenerated turn as the history of the next one."""
    return Message("assistant", turn.text, turn.reasoning)


def history(messages: Sequence[Message], done: Sequence[Turn]) -> list[Message]:
    """The messages turn ``len(done)`` is asked with: every run so far, answered by ``done``."""
    parts = runs(messages)
    out: list[Message] = []
    for k, run in enumerate(parts[: len(done) + 1]):
        out.extend(run)
        if k < len(done):
            out.append(answer(done[k]))
    return out


def record_turns(rec: ResponseRecord) -> list[Turn]:
    """A record's turns; a single-turn record's answer as one turn (its prompt ids not kept: [])."""
    if rec.turns:
        return list(rec.turns)
    return [Turn(
        prompt_ids=[], output_ids=rec.output_ids, text=rec.text, reasoning=rec.reasoning,
        finish_reason=rec.finish_reason, truncated=rec.truncated, prompt_tokens=rec.prompt_tokens,
        completion_tokens=rec.completion_tokens, backend=rec.backend, backend_kind=rec.backend_kind, model=rec.model,
        token_source=rec.token_source, usage=rec.usage, cost_usd=rec.cost_usd, cost_source=rec.cost_source,
        latency_s=rec.latency_s, attempts=rec.attempts, worker=rec.worker, created_at=rec.created_at,
        retry_reasons=rec.retry_reasons,
    )]
