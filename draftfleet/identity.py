"""The identity of a prompt: one key function for the whole fleet.

A key is the sha256 of the dataset name, the canonical prompt content and the settings that
define the response (model, max_tokens, temperature, top_p, system prompt). Same prompt under
the same settings → same key, on any machine, in any run: that is what makes resume and
de-duplication work without any state but the store.
"""

from __future__ import annotations

import hashlib

import msgspec

from draftfleet.schemas.records import GenerationSettings, Message

_encoder = msgspec.json.Encoder(order="sorted")


def settings_id(settings: GenerationSettings) -> str:
    """Short stable id of a settings block (recorded in manifests and records)."""
    return hashlib.sha256(_encoder.encode(settings)).hexdigest()[:16]


def prompt_key(dataset: str, messages: list[Message], settings: GenerationSettings) -> str:
    """The idempotency key of a prompt (64 hex chars)."""
    canonical = _encoder.encode(
        {
            "dataset": dataset,
            "messages": [[m.role, m.content] for m in messages],
            "settings": settings,
        }
    )
    return hashlib.sha256(canonical).hexdigest()
