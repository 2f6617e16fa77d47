"""Conversations: where a multi-turn prompt's answers go, and the history each turn is asked with.

A task of a ``turns = "all"`` dataset holds the conversation's system and user turns, with an
empty assistant message marking each place the dataset had an answer; the target answers after
every run of user turns. The history of turn k is the runs up to k with the fleet's own answers
(content and reasoning) between them: the same list renders the GPU prompt ids, is sent to the
cloud, and is what the exports write, so all three agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import time

from draftfleet.schemas.records import Answer, Message, PromptTask, ResponseRecord, Turn, Usage


def runs(messages: Sequence[Message]) -> list[list[Message]]:
    """The runs of system/user turns that each get an answer (a single-turn prompt is one run)."""
    out: list[list[Message]] = [[]]
    for m in messages:
        if m.role == "assistant":
            out.append([])
        else:
            out[-1].append(m)
    return out


def answers(task: PromptTask) -> int:
    """How many answers a task asks for: its conversation's turns (1 for a single-turn prompt).
    What admission reserves for (``ledger.reservation``), in the worker and in every view."""
    return len(runs(task.messages))


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


def answer_of(a: Answer) -> dict:
    """The :class:`Answer` fields of a turn or a record, to build the other from."""
    return {f: getattr(a, f) for f in Answer.__struct_fields__}


def single_record(task: PromptTask, turn: Turn) -> ResponseRecord:
    """The stored record of a single-turn prompt: the turn's answer (its prompt ids not kept)."""
    return ResponseRecord(
        key=task.key, dataset=task.dataset, source=task.source, settings_id=task.settings_id, messages=task.messages,
        system_prompt_used=any(m.role == "system" for m in task.messages), row_id=task.row_id, **answer_of(turn),
    )


def record_turns(rec: ResponseRecord) -> list[Turn]:
    """A record's turns; a single-turn record's answer as one turn (its prompt ids not kept: [])."""
    if rec.turns:
        return list(rec.turns)
    return [Turn(prompt_ids=[], **answer_of(rec))]


def turn_prompts(rec: ResponseRecord, tok) -> list[list[int]]:
    """Each turn's prompt ids as the engine saw them: the ids a conversation's turn kept, or the
    target template's render (``tok``, a ``TargetTokenizer``) of its history with the fleet's own
    answers. The one place the token export and hidden-state capture take them from."""
    turns = record_turns(rec)
    return [t.prompt_ids or tok.prompt_ids(history(rec.messages, turns[:k])) for k, t in enumerate(turns)]


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def conversation_record(task: PromptTask, turns: list[Turn], worker: str) -> ResponseRecord:
    """The stored record of a conversation: every turn, the last one's answer on top, counts, cost,
    usage and attempts summed over the turns (so totals count them all). Its ``backend`` is the one
    that finished it; each turn keeps its own. Exact only if every turn is."""
    last = turns[-1]
    usages = [t.usage for t in turns]
    usage = Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages), completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages), reasoning_tokens=sum(u.reasoning_tokens for u in usages),
        cost_usd=_total([u.cost_usd for u in usages]), upstream_cost_usd=_total([u.upstream_cost_usd for u in usages]),
        is_byok=last.usage.is_byok,
    )
    sources = {t.cost_source for t in turns}
    return ResponseRecord(
        key=task.key, dataset=task.dataset, source=task.source, settings_id=task.settings_id, messages=task.messages,
        system_prompt_used=any(m.role == "system" for m in task.messages), text=last.text, reasoning=last.reasoning,
        output_ids=last.output_ids, prompt_tokens=sum(t.prompt_tokens for t in turns),
        completion_tokens=sum(t.completion_tokens for t in turns), finish_reason=last.finish_reason,
        truncated=last.truncated, backend=last.backend, backend_kind=last.backend_kind, model=last.model,
        token_source="exact" if all(t.token_source == "exact" for t in turns) else "retokenized", usage=usage,
        cost_usd=sum(t.cost_usd for t in turns),
        cost_source=sources.pop() if len(sources) == 1 else ("provider" if "provider" in sources else "price_table"),
        latency_s=round(sum(t.latency_s for t in turns), 4), attempts=sum(t.attempts for t in turns), worker=worker,
        created_at=time.time(), retry_reasons=[r for t in turns for r in t.retry_reasons], row_id=task.row_id,
        turns=turns,
    )
