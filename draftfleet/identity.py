"""The identity of a prompt: one key function for the whole fleet.

A key is the sha256 of the dataset name, the canonical prompt content and the settings that
define the response (model, max_tokens, temperature, top_p, system prompt, and ``turns`` when it
is ``"all"``: left out at its default so that keys made before it existed stay valid). A
multi-turn prompt's content is its system and user turns with a mark where each answer goes
(an empty assistant message), so the key covers every user turn and where the answers fall.
Same prompt under the same settings → same key, on any machine, in any run: that is what makes
resume and de-duplication work without any state but the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

import msgspec

from draftfleet.schemas.records import GenerationSettings, Message, PromptTask

_encoder = msgspec.json.Encoder(order="sorted")


def _canonical(settings: GenerationSettings) -> dict:
    fields = msgspec.structs.asdict(settings)
    if settings.turns == "first":
        del fields["turns"]
    return fields


def settings_id(settings: GenerationSettings) -> str:
    """Short stable id of a settings block (recorded in manifests and records)."""
    return hashlib.sha256(_encoder.encode(_canonical(settings))).hexdigest()[:16]


def prompt_key(dataset: str, messages: list[Message], settings: GenerationSettings) -> str:
    """The idempotency key of a prompt (64 hex chars)."""
    canonical = _encoder.encode(
        {
            "dataset": dataset,
            "messages": [[m.role, m.content] for m in messages],
            "settings": _canonical(settings),
        }
    )
    return hashlib.sha256(canonical).hexdigest()


def task_problem(task: PromptTask, allowed: Collection[GenerationSettings]) -> str | None:
    """Why a task is not what its own content says (None when it is).

    A task is trusted only as far as it can be recomputed: its settings must be ones its dataset
    was enqueued with, and its key must be the key of its dataset, messages and settings. A forged
    task (any prompt, any ``max_tokens``, a genuine key) would otherwise be generated, stored under
    that key and exported, and the genuine prompt never generated (the store is write-once).
    """
    if task.settings not in allowed:
        return (f"settings {_encoder.encode(task.settings).decode()} are not the dataset's "
                f"({', '.join(_encoder.encode(s).decode() for s in allowed) or 'none known'})")
    marks = [m for m in task.messages if m.role == "assistant"]
    if marks and (task.settings.turns != "all" or any(m.content or m.reasoning for m in marks)):
        return "assistant turns in a task must be empty marks of a multi-turn dataset (turns = \"all\")"
    if task.settings_id != settings_id(task.settings):
        return f"settings_id {task.settings_id!r} does not match the settings"
    if task.key != prompt_key(task.dataset, task.messages, task.settings):
        return f"key {task.key} is not the key of the task's dataset, messages and settings"
    return None
