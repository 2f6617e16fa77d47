"""The target model's tokenizer: prompt ids for SGLang, and cloud text back into token ids.

Loaded with transformers ``AutoTokenizer`` from a local folder only (never the hub). Models like
the Kimi K2 family ship a slow tiktoken tokenizer whose automatic fast conversion shifts special
ids (transformers PR #45359): set ``tokenizer_use_fast = false`` and
``tokenizer_trust_remote_code = true`` for them.

A cloud record's ids are what the target itself would have emitted after the generation prompt:
for Kimi-K2.5 ``reasoning</think>answer<|im_end|>`` (its prompt already ends in ``<think>``), for
Qwen3 ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>``. The chat template says where the
reasoning and the answer go (:meth:`TargetTokenizer._skeleton`); the markup it writes keeps its
special ids, while response text is encoded with special-token parsing off, so a literal
``<|im_end|>`` inside a response is text, not the end-of-turn id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import jinja2

from draftfleet.schemas.config import FleetSection
from draftfleet.schemas.records import Message

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Stand-ins rendered through the chat template to see where it puts the answer and the reasoning.
_CONTENT = "DRAFTFLEETCONTENTSLOT"
_REASONING = "DRAFTFLEETREASONINGSLOT"
_SLOTS = re.compile(f"({_CONTENT}|{_REASONING})")
# Padding around the stand-ins: what the template strips of it, it strips of real text too
# (Qwen3 strips the reasoning's newlines and the answer's leading ones).
_PAD = "\n \n"

Strip = str | None  # None: kept; "\n": newlines stripped; "": all whitespace stripped


class TokenizerError(RuntimeError):
    pass


class TemplateError(TokenizerError):
    """The chat template cannot place any answer as configured: a setting must change, not the prompt."""


class MessagesRefused(TokenizerError):
    """The chat template refuses these messages (its ``raise_exception``, e.g. roles that do not
    alternate): this prompt's problem, like any other :class:`TokenizerError`, not a setting's."""


@contextmanager
def _refusals(path: str) -> Iterator[None]:
    """jinja2's errors from a template render as the tokenizer's own, which every caller handles:
    a template that does not parse is a setting's problem, any other error these messages'."""
    try:
        yield
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the chat template of {path!r} does not parse: {exc}") from None
    except jinja2.TemplateError as exc:
        raise MessagesRefused(f"the chat template of {path!r} refuses these messages: {exc}") from None


def _ids(encoded) -> list[int]:
    """transformers 5 returns a BatchEncoding where 4.x returned a list; accept both."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])


def _strips(bare: str, padded: str) -> dict[str, tuple[Strip, Strip]]:
    """What the template strips of each stand-in's text, from one render with padding and one without."""
    b, p = _SLOTS.split(bare), _SLOTS.split(padded)
    if b[1::2] != p[1::2]:
        raise TemplateError("the chat template places the answer differently when it has surrounding whitespace")
    leads = {_PAD: None, _PAD.lstrip("\n"): "\n", "": ""}  # what is left of the padding -> the rule
    trails = {_PAD: None, _PAD.rstrip("\n"): "\n", "": ""}
    rules: dict[str, list[Strip]] = {slot: [None, None] for slot in b[1::2]}
    for k in range(0, len(b), 2):
        before, after = (b[k - 1] if k else None), (b[k + 1] if k + 1 < len(b) else None)
        fits = [(t, lead) for t in (trails if before else [""]) for lead in (leads if after else [""])
                if p[k] == t + b[k] + lead]
        if not fits:
            raise TemplateError("the chat template changes the text around the answer in a way draftfleet cannot follow")
        t, lead = fits[0]
        if before:
            rules[before][1] = trails[t]
        if after:
            rules[after][0] = leads[lead]
    return {slot: (lead, trail) for slot, (lead, trail) in rules.items()}


def _strip(text: str, rule: tuple[Strip, Strip]) -> str:
    lead, trail = rule
    if lead is not None:
        text = text.lstrip(lead or None)
    if trail is not None:
        text = text.rstrip(trail or None)
    return text


def check_code_folder(path: str, why: str) -> None:
    """Refuse a folder of code that another account could change before it runs: the folder, or a
    file or folder in it (a symlink's target included), owned by a user other than this one or
    root, or writable by its group or by others. ``why`` says whose code it is, for the error."""
    for root, dirs, files in os.walk(path):
        for p in [root, *(os.path.join(root, n) for n in dirs + files)]:
            st = os.stat(p)
            if st.st_mode & 0o022 or st.st_uid not in (0, os.geteuid()):
                who = f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 \
                    else f"owned by uid {st.st_uid}"
                raise TokenizerError(f"{why} and {p} is {who}: its code would run as this user; make it yours and "
                                     "not writable by your group or others")


class TargetTokenizer:
    """Thread-safe wrapper: fast tokenizers raise "Already borrowed" under concurrent use."""

    def __init__(self, path: str, *, use_fast: bool = True, trust_remote_code: bool = False,
                 end_of_turn: str | None = None, reasoning_markers: tuple[str, str] | None = None):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer folder {path!r} does not exist (a local folder of the target model)")
        if trust_remote_code:
            check_code_folder(path, "tokenizer_trust_remote_code is on")
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
        added = self._tok.added_tokens_decoder
        # Kimi lists its reserved specials only here, not among all_special_ids.
        self.special_ids = (frozenset(self._tok.all_special_ids) | {i for i, t in added.items() if t.special}
                            | {self.eot_id})
        self._added = {t.content: i for i, t in added.items()}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if longest_first else None
        self.vocab_size = len(self._tok)
        self.reasoning_markers = reasoning_markers or self._default_markers()
        self._encode_plain = self._plain_encoder()

    @classmethod
    def from_config(cls, fleet: FleetSection) -> TargetTokenizer:
        if not fleet.tokenizer:
            raise TokenizerError("[fleet].tokenizer is not set: the folder of the target model's tokenizer is needed")
        return cls(
            fleet.tokenizer,
            use_fast=fleet.tokenizer_use_fast,
            trust_remote_code=fleet.tokenizer_trust_remote_code,
            end_of_turn=fleet.end_of_turn,
            reasoning_markers=fleet.reasoning_markers,
        )

    @property
    def chat_template_sha256(self) -> str | None:
        """sha256 of the chat template (its JSON when the tokenizer has several); None without one."""
        t = self._tok.chat_template
        if not t:
            return None
        text = t if isinstance(t, str) else json.dumps(t, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _default_eot(self) -> str:
        vocab = self._tok.get_vocab()
        for cand in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            if cand in vocab:
                return cand
        if self._tok.eos_token:
            return self._tok.eos_token
        raise TokenizerError(f"cannot tell the end-of-turn token of {self.path!r}: set [fleet].end_of_turn")

    def _default_markers(self) -> tuple[str, str] | None:
        vocab = self._tok.get_vocab()
        return ("<think>", "</think>") if "<think>" in vocab and "</think>" in vocab else None

    def _plain_encoder(self) -> Callable[[list[str]], list[list[int]]]:
        """The way this tokenizer encodes text with special-token strings as text, found by trying.

        ``split_special_tokens`` is honoured by fast tokenizers and transformers' own slow ones, but
        not by Kimi's remote code, whose ``encode`` parses specials unless ``allow_special_tokens=False``.
        Each way is tried on text quoting every special token; the first that keeps it text wins.
        """
        tok = self._tok
        backend = getattr(tok, "backend_tokenizer", None)

        def fast(texts: list[str]) -> list[list[int]]:
            saved = backend.encode_special_tokens
            backend.encode_special_tokens = True
            try:
                return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
            finally:
                backend.encode_special_tokens = saved

        def split_special(texts: list[str]) -> list[list[int]]:
            return [list(ids) for ids in tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]]

        def allow_special_false(texts: list[str]) -> list[list[int]]:
            return [list(tok.encode(t, allow_special_tokens=False)) for t in texts]

        specials = [t for t, i in self._added.items() if i in self.special_ids] or [self.eot_token]
        probe = "a " + " b".join(specials) + "c"
        for encode in ([fast] if backend is not None else []) + [split_special, allow_special_false]:
            try:
                [ids] = encode([probe])
                decoded = tok.decode(ids, skip_special_tokens=False)  # the strings kept, not dropped or unknown
                ok = not self.special_ids.intersection(ids) and all(t in decoded for t in specials)
            except Exception:  # a keyword the tokenizer does not know, or worse: this way does not work
                ok = False
            if ok:
                return encode
        raise TokenizerError(f"the tokenizer at {self.path!r} parses special tokens inside any text it encodes: "
                             "cloud answers cannot be re-tokenized with it")

    @staticmethod
    def _dicts(messages: Sequence[Message]) -> list[dict]:
        """Messages as the chat template reads them; an answer's reasoning as ``reasoning_content``."""
        out = []
        for m in messages:
            d = {"role": m.role, "content": m.content}
            if m.reasoning is not None:
                d["reasoning_content"] = m.reasoning
            out.append(d)
        return out

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        """The chat template's text; the flag is always passed (Kimi's default adds the prompt)."""
        with self._lock, _refusals(self.path):
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_text(self, messages: Sequence[Message]) -> str:
        return self._render(self._dicts(messages), True)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The exact ids SGLang receives: the chat template with the generation prompt."""
        with self._lock, _refusals(self.path):
            return _ids(self._tok.apply_chat_template(self._dicts(messages), tokenize=True, add_generation_prompt=True))

    def encode_text(self, text: str) -> list[int]:
        """Encode plain text: special-token strings inside it stay text."""
        return self._encode_texts([text])[0]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        with self._lock:
            out = self._encode_plain(texts)
        for ids in out:
            if parsed := self.special_ids.intersection(ids):
                raise TokenizerError(f"tokenizer at {self.path!r} parsed special tokens inside response text "
                                     f"(ids {sorted(parsed)[:5]})")
        return out

    def completion_ids(self, messages: Sequence[Message], text: str, reasoning: str | None, stopped: bool) -> list[int]:
        """The ids the target would have emitted after the generation prompt for this answer.

        The end-of-turn id comes last when the generation stopped; an answer cut off while still
        reasoning (no text) ends with the reasoning.
        """
        return self.completion_ids_batch([(messages, text, reasoning, stopped)])[0]

    def completion_ids_batch(
        self, answers: Sequence[tuple[Sequence[Message], str, str | None, bool]]
    ) -> list[list[int]]:
        """:meth:`completion_ids` of many ``(messages, text, reasoning, stopped)`` answers at once.

        The same ids, but the text runs are encoded in one batch call, which the fast tokenizer runs
        on every core and which takes the lock once (bench/retokenize.py measures the difference).
        """
        parts = [self._completion_parts(*answer) for answer in answers]
        encoded = iter(self._encode_texts([p for ps in parts for p in ps if isinstance(p, str)]))
        out = []
        for ps, (_, _, _, stopped) in zip(parts, answers, strict=True):
            ids: list[int] = []
            for p in ps:
                ids.extend(next(encoded) if isinstance(p, str) else (p,))
            if stopped:
                ids.append(self.eot_id)
            out.append(ids)
        return out

    def _completion_parts(self, messages: Sequence[Message], text: str, reasoning: str | None,
                          stopped: bool) -> list[int | str]:
        """The completion as the template's added-token ids and runs of text to encode as plain text.

        Added tokens split text in every tokenizer, so encoding the runs between them one by one
        gives the ids of the whole completion; the answer's own text never yields a special id.
        """
        skeleton, strips = self._skeleton(messages, bool(reasoning))
        values = {_CONTENT: _strip(text, strips[_CONTENT]),
                  _REASONING: _strip(reasoning or "", strips.get(_REASONING, (None, None)))}
        pieces = _SLOTS.split(skeleton)
        if not stopped and not text and reasoning and _REASONING in pieces:
            pieces = pieces[: pieces.index(_REASONING) + 1]  # cut off while reasoning: nothing followed it
        parts: list[int | str] = []
        for n, piece in enumerate(pieces):
            bits = [values[piece]] if n % 2 else (self._added_re.split(piece) if self._added_re else [piece])
            for k, bit in enumerate(bits):
                if k % 2:
                    parts.append(self._added[bit])
                elif bit and parts and isinstance(parts[-1], str):
                    parts[-1] += bit
                elif bit:
                    parts.append(bit)
        return parts

    def _skeleton(self, messages: Sequence[Message], with_reasoning: bool) -> tuple[str, dict[str, tuple[Strip, Strip]]]:
        """What the target writes after the generation prompt, with stand-ins for answer and reasoning.

        The answer is rendered as the turn after the prompt's messages. Templates that blank the
        reasoning of history turns (Kimi-K2.5: ``<think></think>``, its prompt ending in ``<think>``)
        or drop it get it placed by the reasoning markers: inside an empty marker pair, else where
        the turn leaves the generation prompt. Returns the text after the generation prompt up to
        the end-of-turn token, and what the template strips of each stand-in's text.
        """
        history = self._dicts(messages)
        base, prompt = self._render(history, False), self._render(history, True)
        answers = []
        for pad in ("", _PAD):  # the answer bare, then padded to see what the template strips
            turn = {"role": "assistant", "content": pad + _CONTENT + pad}
            if with_reasoning:
                turn["reasoning_content"] = pad + _REASONING + pad
            full = self._render([*history, turn], False)
            if not (prompt.startswith(base) and full.startswith(base)):
                raise TokenizerError(f"the chat template of {self.path!r} renders the prompt's messages differently "
                                     "once an answer follows them: cannot tell where the answer starts")
            answer = full[len(base):]
            end = answer.rfind(self.eot_token)
            if _CONTENT not in answer[:max(end, 0)]:
                raise TemplateError(f"the chat template of {self.path!r} does not end an assistant turn with "
                                     f"{self.eot_token!r} after its content: set [fleet].end_of_turn")
            answers.append(answer[:end])
        gen, (answer, padded) = prompt[len(base):], answers
        strips = _strips(answer, padded)
        if _REASONING not in answer and (with_reasoning or not answer.startswith(gen)):
            answer = self._place_reasoning(answer, gen)
        if not answer.startswith(gen):
            raise TemplateError(
                f"the chat template of {self.path!r} ends the generation prompt with {gen!r}, but renders an "
                f"answer as {answer!r}: set [fleet].reasoning_markers to what the model writes around its reasoning"
            )
        return answer[len(gen):], strips

    def _place_reasoning(self, answer: str, gen: str) -> str:
        if self.reasoning_markers is None:
            raise TemplateError(f"the chat template of {self.path!r} does not place reasoning and the tokenizer has "
                                 "no <think> tokens: set [fleet].reasoning_markers")
        open_, close = self.reasoning_markers
        i = answer.find(open_ + close)
        if i >= 0:  # an emptied reasoning block: the reasoning goes inside it
            i += len(open_)
            return answer[:i] + _REASONING + answer[i:]
        i = len(os.path.commonprefix([answer, gen]))
        return answer[:i] + open_ + _REASONING + close + answer[i:]

    def split_reasoning(self, messages: Sequence[Message], output_ids: Sequence[int]) -> tuple[str, str | None]:
        """An engine's answer as (content, reasoning), split as the cloud APIs split a thinking model's.

        The ids are decoded with their markup (the end-of-turn id dropped) and read against the
        template's own answer form (:meth:`_skeleton`), so that rendering the parts again through
        the template gives back the generated text; an answer off that form is split at the
        reasoning markers (the prompt may have opened the block already: Kimi-K2.5), each part then
        stripped as the template strips it. No markers: all content, no reasoning.
        """
        ids = list(output_ids)
        if ids and ids[-1] == self.eot_id:
            ids.pop()
        text = self.decode(ids, skip_special=False)
        if self.reasoning_markers is None:
            return text, None
        skeleton, strips = self._skeleton(messages, True)
        pieces = _SLOTS.split(skeleton)
        pattern = "".join({_REASONING: "(?P<r>.*?)", _CONTENT: "(?P<c>.*)"}[p] if n % 2 else re.escape(p)
                          for n, p in enumerate(pieces))
        if (m := re.fullmatch(pattern, text, re.DOTALL)) and m.group("r") is not None and m.group("c") is not None:
            return m.group("c"), m.group("r")
        open_, close = self.reasoning_markers
        if self.prompt_text(messages).endswith(open_):
            body = text
        elif text.lstrip().startswith(open_):
            body = text.lstrip()[len(open_):]
        else:
            return text, None
        reasoning, found, content = body.partition(close)
        if not found:  # cut off while reasoning
            return "", _strip(body, strips.get(_REASONING, (None, None)))
        return _strip(content, strips[_CONTENT]), _strip(reasoning, strips.get(_REASONING, (None, None)))

    def reasoning_in_conversations(self) -> Literal["all", "last", "none"]:
        """Which answers' reasoning the chat template renders in a whole conversation (what a
        trainer renders): every turn's, the last turn's only (Qwen3), or none (Kimi-K2.5 blanks it)."""
        turns: list[dict] = []
        for n in (1, 2):
            turns += [{"role": "user", "content": f"question {n}"},
                      {"role": "assistant", "content": f"{_CONTENT}{n}", "reasoning_content": f"{_REASONING}{n}"}]
        text = self._render(turns, False)
        first, last = f"{_REASONING}1" in text, f"{_REASONING}2" in text
        return "all" if first and last else "last" if last else "none"

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def roundtrip_mismatches(self, batch: Sequence[Sequence[int]]) -> int:
        """How many id lists do not survive decode -> encode unchanged.

        Added tokens (``</think>``, the end-of-turn) stay ids, as a cloud record's markup does; the
        text runs between them are decoded and encoded again as plain text. Batched through the Rust
        tokenizer when there is one (all cores, one lock).
        """
        added = set(self._added.values())
        runs: list[list[int]] = []
        owner: list[int] = []
        for n, ids in enumerate(batch):
            run: list[int] = []
            for i in [*ids, None]:
                if i is None or i in added:
                    if run:
                        runs.append(run)
                        owner.append(n)
                    run = []
                else:
                    run.append(i)
        backend = getattr(self._tok, "backend_tokenizer", None)
        with self._lock:
            if backend is not None:
                texts = backend.decode_batch(runs, skip_special_tokens=False)
            else:
                texts = [self._tok.decode(r, skip_special_tokens=False) for r in runs]
        again = self._encode_texts(texts) if texts else []
        return len({owner[k] for k, (a, r) in enumerate(zip(again, runs, strict=True)) if a != r})
