"""SpecForge's preprocessing of a conversations row, re-implemented for the tests (not copied).

What ``specforge/data/parse.py`` (GeneralParser / ThinkingParser, SpecForge a6b6b023) does to a row:
- turns are normalised (``from``/``value`` -> ``role``/``content``); a leading system turn is
  kept, else the template's ``system_prompt`` is inserted when it is non-empty;
- each turn keeps only ``role``, ``content``, ``tool_calls`` (the thinking parser also
  ``reasoning_content``, ``name``, ``tool_call_id``);
- the model's own chat template renders the list (``add_generation_prompt=False``; the thinking
  parser passes ``enable_thinking=True`` when the template asks for it), and the tokenizer encodes
  the text with ``add_special_tokens=False`` (special-token strings inside text become special ids);
- the loss mask is 1 from the end of each ``assistant_header`` through the next
  ``end_of_turn_token`` (or the end), the span's token positions taken from the lengths of the
  encoded prefixes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecForgeTemplate:
    """The fields of SpecForge's ``ChatTemplate`` that its parser reads."""

    assistant_header: str
    end_of_turn_token: str
    system_prompt: str | None
    thinking: bool = False  # parser_type "thinking"
    enable_thinking: bool = False


# SpecForge's registered templates the tests use (specforge/data/template.py), and the ones the
# README tells users to register for rows generated without a system turn.
QWEN = SpecForgeTemplate("<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant.")
QWEN3_THINKING = SpecForgeTemplate("<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant.",
                                   thinking=True, enable_thinking=True)
KIMI_K2_THINKING = SpecForgeTemplate("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>",
                                     "You are a helpful assistant.", thinking=True, enable_thinking=True)


def no_default_system(t: SpecForgeTemplate) -> SpecForgeTemplate:
    return SpecForgeTemplate(t.assistant_header, t.end_of_turn_token, None, t.thinking, t.enable_thinking)


def parse(hf_tokenizer, template: SpecForgeTemplate, row: dict) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) as SpecForge builds them from ``row["conversations"]``."""
    turns = []
    for m in row["conversations"]:
        role = m.get("role", m.get("from", ""))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        turns.append({**{k: v for k, v in m.items() if k not in ("from", "value")}, "role": role,
                      "content": m.get("content") or m.get("value") or ""})
    messages = []
    if turns and turns[0]["role"] == "system":
        messages.append({"role": "system", "content": turns[0]["content"]})
        turns = turns[1:]
    elif template.system_prompt:
        messages.append({"role": "system", "content": template.system_prompt})
    keys = {"role", "content", "tool_calls"} | ({"reasoning_content", "name", "tool_call_id"} if template.thinking else set())
    messages += [{k: v for k, v in t.items() if k in keys} for t in turns]
    extra = {"enable_thinking": True} if template.thinking and template.enable_thinking else {}
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **extra)
    ids = list(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    mask = [0] * len(ids)
    pattern = re.escape(template.assistant_header) + r"([\s\S]*?(?:" + re.escape(template.end_of_turn_token) + "|$))"
    for m in re.finditer(pattern, text, re.DOTALL):
        start = len(hf_tokenizer.encode(text[:m.start(1)], add_special_tokens=False))
        end = len(hf_tokenizer.encode(text[:m.end(1)], add_special_tokens=False))
        for i in range(min(start, len(ids)), min(end, len(ids))):
            mask[i] = 1
    return ids, mask


def compare(sf: tuple[list[int], list[int]], token_rows: list[dict]) -> tuple[bool, bool, int]:
    """SpecForge's (ids, mask) of a conversation against the fleet's token rows of it (one per turn):
    (SpecForge's ids start with the last turn's prompt + answer ids, every generated token is
    trained, how many tokens SpecForge trains that the model did not write before the conversation's end).
    The last row's prompt renders every earlier turn, so its ids cover the whole conversation."""
    ids, mask = sf
    last = token_rows[-1]
    n = len(last["input_ids"])
    ids_equal = ids[:n] == last["input_ids"] and all(last["input_ids"][:len(r["input_ids"])] == r["input_ids"]
                                                     for r in token_rows)
    want = [0] * n
    for r in token_rows:
        for i, bit in enumerate(r["loss_mask"]):
            want[i] |= bit
    got = mask[:n] + [0] * (n - len(mask[:n]))
    covers = all(g for g, w in zip(got, want) if w)
    extra = sum(1 for g, w in zip(got, want) if g and not w)
    return ids_equal, covers, extra
