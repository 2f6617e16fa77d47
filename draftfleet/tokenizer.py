"""The target model's tokenizer: prompt ids for SGLang, and cloud text back into token ids.

Loaded with transformers ``AutoTokenizer`` from a local folder only (never the hub). Models like
the Kimi K2 family ship a slow tiktoken tokenizer whose automatic fast conversion shifts special
ids (transformers PR #45359): set ``tokenizer_use_fast = false`` and
``tokenizer_trust_remote_code = true`` for them; :meth:`TargetTokenizer.check_special` verifies
the end-of-turn id. Response text is encoded with special-token parsing off: a literal
``<|im_end|>`` inside a response is text, not the end-of-turn id.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence

from draftfleet.schemas.config import FleetSection
from draftfleet.schemas.records import Message

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class TokenizerError(RuntimeError):
    pass


def _ids(encoded) -> list[int]:
    """transformers 5 returns a BatchEncoding where 4.x returned a list; accept both."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])


def check_code_folder(path: str) -> None:
    """With ``trust_remote_code`` the folder's Python runs in every worker: refuse a folder or file
    in it (a symlink's target included) that a user other than this one or root owns or can write."""
    for root, dirs, files in os.walk(path):
        for p in [root, *(os.path.join(root, n) for n in dirs + files)]:
            st = os.stat(p)
            if st.st_mode & 0o022 or st.st_uid not in (0, os.geteuid()):
                who = f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 \
                    else f"owned by uid {st.st_uid}"
                raise TokenizerError(f"tokenizer_trust_remote_code is on and {p} is {who}: its code would run "
                                     "in every worker; make it yours and not writable by others, or turn the setting off")


class TargetTokenizer:
    """Thread-safe wrapper: fast tokenizers raise "Already borrowed" under concurrent use."""

    def __init__(self, path: str, *, use_fast: bool = True, trust_remote_code: bool = False, end_of_turn: str | None = None):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer folder {path!r} does not exist (a local folder of the target model)")
        if trust_remote_code:
            check_code_folder(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(
                path, use_fast=use_fast, trust_remote_code=trust_remote_code, local_files_only=True
            )
        except Exception as exc:  # transformers raises many kinds; the message is what matters
            raise TokenizerError(f"cannot load tokenizer from {path!r}: {exc}") from exc
        self.path = path
        self._lock = threading.Lock()
        self.eot_token = end_of_turn or self._default_eot()
        eot_id = self._tok.convert_tokens_to_ids(self.eot_token)
        if not isinstance(eot_id, int) or eot_id == self._tok.unk_token_id:
            raise TokenizerError(f"end-of-turn token {self.eot_token!r} is not in the tokenizer at {path!r}")
        self.eot_id: int = eot_id
        self.special_ids = frozenset(self._tok.all_special_ids) | {self.eot_id}
        self.vocab_size = len(self._tok)

    @classmethod
    def from_config(cls, fleet: FleetSection) -> TargetTokenizer:
        if not fleet.tokenizer:
            raise TokenizerError("[fleet].tokenizer is not set: the folder of the target model's tokenizer is needed")
        return cls(
            fleet.tokenizer,
            use_fast=fleet.tokenizer_use_fast,
            trust_remote_code=fleet.tokenizer_trust_remote_code,
            end_of_turn=fleet.end_of_turn,
        )

    def _default_eot(self) -> str:
        vocab = self._tok.get_vocab()
        for cand in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            if cand in vocab:
                return cand
        if self._tok.eos_token:
            return self._tok.eos_token
        raise TokenizerError(f"cannot tell the end-of-turn token of {self.path!r}: set [fleet].end_of_turn")

    @staticmethod
    def _dicts(messages: Sequence[Message]) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in messages]

    def prompt_text(self, messages: Sequence[Message]) -> str:
        with self._lock:
            return self._tok.apply_chat_template(self._dicts(messages), tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The exact ids SGLang receives: the chat template with the generation prompt."""
        with self._lock:
            return _ids(self._tok.apply_chat_template(self._dicts(messages), tokenize=True, add_generation_prompt=True))

    def encode_text(self, text: str) -> list[int]:
        """Encode plain text: special-token strings inside it stay text."""
        with self._lock:
            ids = _ids(self._tok(text, add_special_tokens=False, split_special_tokens=True))
        return self._plain(ids)

    def _plain(self, ids: list[int]) -> list[int]:
        """``ids`` of response text, refused if the tokenizer parsed special tokens inside it."""
        parsed = [i for i in ids if i in self.special_ids]
        if parsed:
            raise TokenizerError(
                f"tokenizer at {self.path!r} parsed special tokens inside response text (ids {parsed[:5]}); "
                "it ignores split_special_tokens: use a tokenizer class that honours it"
            )
        return ids

    def completion_ids(self, messages: Sequence[Message], text: str, reasoning: str | None, stopped: bool) -> list[int]:
        """Re-tokenize a cloud answer as the target's template places it, through end-of-turn.

        The assistant turn is rendered by the chat template (so reasoning lands where the template
        puts it); the body between the generation prompt and the template's closing end-of-turn is
        encoded as text, and the end-of-turn id is appended when the generation stopped.
        """
        ids = self.encode_text(self._completion_body(messages, text, reasoning))
        if stopped:
            ids.append(self.eot_id)
        return ids

    def completion_ids_batch(
        self, answers: Sequence[tuple[Sequence[Message], str, str | None, bool]]
    ) -> list[list[int]]:
        """:meth:`completion_ids` of many ``(messages, text, reasoning, stopped)`` answers at once.

        The same ids, but the bodies are encoded in one batch call, which the fast tokenizer runs on
        every core and which takes the lock once (bench/retokenize.py measures the difference).
        """
        if not answers:
            return []
        bodies = [self._completion_body(messages, text, reasoning) for messages, text, reasoning, _ in answers]
        with self._lock:
            encoded = self._tok(bodies, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        out = []
        for ids, (_, _, _, stopped) in zip(encoded, answers, strict=True):
            ids = self._plain(list(ids))
            if stopped:
                ids.append(self.eot_id)
            out.append(ids)
        return out

    def _completion_body(self, messages: Sequence[Message], text: str, reasoning: str | None) -> str:
        """The assistant turn's text as the chat template renders it, without its end-of-turn."""
        body = text
        prompt = self.prompt_text(messages)
        turn = {"role": "assistant", "content": text}
        if reasoning:
            turn["reasoning_content"] = reasoning
        with self._lock:
            full = self._tok.apply_chat_template(self._dicts(messages) + [turn], tokenize=False)
        end = full.rfind(self.eot_token)
        if full.startswith(prompt) and end >= len(prompt):
            body = full[len(prompt):end]
        elif reasoning:
            raise TokenizerError(
                f"the chat template of {self.path!r} does not extend the generation prompt with the "
                "assistant turn: cannot place the reasoning text"
            )
        return body

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def roundtrip_mismatches(self, batch: Sequence[Sequence[int]]) -> int:
        """How many id lists do not survive decode -> encode unchanged (special tokens as text).

        Batched through the Rust tokenizer when there is one (all cores, one lock), else one by one.
        """
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            bad = 0
            for ids in batch:
                try:
                    bad += self.encode_text(self.decode(ids)) != list(ids)
                except TokenizerError:
                    bad += 1
            return bad
        with self._lock:
            texts = backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=True)
            saved = backend.encode_special_tokens
            backend.encode_special_tokens = True
            try:
                again = backend.encode_batch(texts, add_special_tokens=False)
            finally:
                backend.encode_special_tokens = saved
        return sum(enc.ids != list(ids) for enc, ids in zip(again, batch, strict=True))
