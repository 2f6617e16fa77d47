"""Tokenizers shaped like the real targets', built at test time (nothing is downloaded).

- ``build_kimi_like``: Kimi-K2.5's shape. A *slow* tokenizer in remote code (loaded with
  ``trust_remote_code=True, use_fast=False``), a ``PreTrainedTokenizer`` over a ``tiktoken.Encoding``
  whose byte-level ranks and merges are learned here from a small corpus. Its ``encode`` parses
  special-token strings inside text by default (``allowed_special="all"``) whatever
  ``split_special_tokens`` says, and ``encode(text, allow_special_tokens=False)`` does not. Its
  ``apply_chat_template`` defaults ``add_generation_prompt=True``. The chat template renders turns
  ``<|im_{role}|>{name}<|im_middle|>{content}<|im_end|>``, ends the generation prompt with
  ``<think>``, and renders every historical assistant turn ``<think></think>content`` (up to the last
  one without tool calls; later ones keep their reasoning).
- ``build_qwen3_like``: Qwen3's shape. A fast byte-level BPE with ChatML, where ``<think>`` and
  ``</think>`` are added tokens that are not special, and Qwen3's rules for assistant turns:
  reasoning is kept only after the last user query (the last turn always gets a think block),
  stripped of newlines, and the content's leading newlines are dropped.
- ``build_fast_chat``: any template over a fast tokenizer with the given added tokens.

Special ids sit right after the base vocabulary, as Kimi's do; ``KIMI_SPECIALS`` maps them.
"""

from __future__ import annotations

import base64
import inspect
import json
import random
from pathlib import Path

# cl100k-style pre-tokenization (tiktoken's own), so merges never cross words.
PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# Offsets after the base vocabulary, in Kimi's order (with reserved slots between).
KIMI_SPECIALS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "[EOT]": 9, "<|im_system|>": 10, "<|im_middle|>": 17, "<think>": 22, "</think>": 23,
    "[UNK]": 30, "[PAD]": 31,
}
KIMI_RESERVED = 32

KIMI_TEMPLATE = (
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last_plain = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_' + m.role + '|>' + (m.get('name') or m.role) + '<|im_middle|>' -}}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if loop.index0 <= ns.last_plain -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' + (m.get('reasoning_content') or '') + '</think>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{{- m.content + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|><think>' -}}{%- endif -%}"
)

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1, multi_step=true) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- set i = (messages|length - 1) - loop.index0 -%}"
    "{%- if ns.multi_step and m.role == 'user' and not (m.content.startswith('<tool_response>') "
    "and m.content.endswith('</tool_response>')) -%}"
    "{%- set ns.multi_step = false -%}{%- set ns.last_query = i -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_WORDS = (
    "the a of to and in is it that for on with as was by this be are or from at an not have but "
    "let me think first step so answer because then check wait hmm sort list return value def "
    "function python code class test data write explain file read parse error loop index token "
    "model draft budget queue worker cloud gpu print self import None True False int str "
    "() [] {} : ; , . = == != < > + - * / # ' \" | _ \n \n\n"
).split(" ")


def corpus(n: int = 1500, seed: int = 5) -> list[str]:
    """Random lines of code-and-reasoning words: enough text for a few hundred merges."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_WORDS) + rng.choice(["", " ", " ", "\n"]) for _ in range(rng.randint(5, 30)))
            for _ in range(n)]


def byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in which byte-level token strings are written."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def learn_ranks(texts: list[str], vocab_size: int = 650) -> dict[bytes, int]:
    """Byte-level BPE ranks (tiktoken's mergeable_ranks): the 256 bytes, then merges learned from ``texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    to_byte = {c: b for b, c in byte_chars().items()}
    ranks = {bytes([i]): i for i in range(256)}
    for pair in json.loads(tok.to_str())["model"]["merges"]:
        a, b = pair.split(" ") if isinstance(pair, str) else pair
        ranks.setdefault(bytes(to_byte[c] for c in a + b), len(ranks))
    return ranks


# The remote code the Kimi-like folder ships: a slow tokenizer in the shape of Kimi's
# tokenization_kimi.py (written here, not copied).
_REMOTE_CODE = '''\
"""A slow tiktoken tokenizer in the shape of Kimi's (test fixture)."""
import base64
import os

import tiktoken
from transformers import PreTrainedTokenizer

PAT_STR = PAT_STR_VALUE


BYTE_CHARS_SOURCE

class TikTokenChatTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
                 added_tokens_decoder=None, **kwargs):
        ranks = {}
        with open(vocab_file, "rb") as fh:
            for line in fh.read().splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        names = {int(i): (t.content if hasattr(t, "content") else t["content"])
                 for i, t in (added_tokens_decoder or {}).items()}
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + RESERVED)}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        chars = byte_chars()
        self.byte_decoder = {c: b for b, c in chars.items()}
        self.decoder = {i: "".join(chars[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {t: i for i, t in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        """Like Kimi's: special strings in text are special ids unless allow_special_tokens=False;
        any other keyword goes through transformers' own path (which also ends in this encode)."""
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_tokens["[UNK]"])

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (self.vocab_file,)

    def apply_chat_template(self, conversation, tools=None, tokenize=True, add_generation_prompt=True, **kwargs):
        """Kimi's default: the generation prompt is added unless asked not to."""
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
'''

KIMI_CLASS = "TikTokenChatTokenizer"
KIMI_MODULE = "tokenization_tiktoken_chat"


def build_kimi_like(folder: str | Path) -> Path:
    """A Kimi-K2.5-shaped tokenizer folder: tiktoken.model, remote code, config with the template."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = learn_ranks(corpus())
    (folder / "tiktoken.model").write_bytes(
        b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for tok, rank in ranks.items()))
    code = (_REMOTE_CODE.replace("PAT_STR_VALUE", repr(PAT_STR)).replace("RESERVED", str(KIMI_RESERVED))
            .replace("BYTE_CHARS_SOURCE", inspect.getsource(byte_chars)))
    (folder / f"{KIMI_MODULE}.py").write_text(code)
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for tok, i in kimi_specials(len(ranks)).items()}
    config = {
        "tokenizer_class": KIMI_CLASS,
        "auto_map": {"AutoTokenizer": [f"{KIMI_MODULE}.{KIMI_CLASS}", None]},
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "[EOT]",
                                      "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "chat_template": KIMI_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def kimi_encoding(folder: str | Path):
    """The fixture's ground truth: the ``tiktoken.Encoding`` itself, built from the folder's files."""
    import tiktoken

    folder = Path(folder)
    ranks = {base64.b64decode(t): int(r) for t, r in
             (line.split() for line in (folder / "tiktoken.model").read_bytes().splitlines() if line)}
    return tiktoken.Encoding(name="truth", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=kimi_specials(len(ranks)))


def kimi_specials(base: int) -> dict[str, int]:
    """Every special token after ``base`` base tokens: the named ones and the reserved slots, as Kimi lists them."""
    named = {base + off: tok for tok, off in KIMI_SPECIALS.items()}
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + KIMI_RESERVED)}


def build_fast_chat(folder: str | Path, template: str, added: dict[str, bool], eos: str,
                    vocab_size: int = 700) -> Path:
    """A fast byte-level BPE folder with ``template`` and ``added`` tokens (token -> special?)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added.items()])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos, "pad_token": eos, "bos_token": None, "unk_token": None,
        "model_max_length": 40960,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def build_qwen3_like(folder: str | Path) -> Path:
    """A Qwen3-shaped fast tokenizer: ChatML; <think> and </think> are added tokens, not special."""
    added = {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<think>": False, "</think>": False}
    return build_fast_chat(folder, QWEN3_TEMPLATE, added, eos="<|im_end|>")
