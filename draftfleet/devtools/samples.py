"""Small real data for the demo and the tests: a BPE tokenizer with a ChatML template, and prompts.

Nothing here is downloaded: the tokenizer is trained with ``tokenizers`` on a built-in corpus,
and saved as a Hugging Face tokenizer folder that ``AutoTokenizer`` loads like a real model's.
``python -m draftfleet.devtools.samples DIR`` regenerates ``examples/``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
END_OF_TURN = "<|im_end|>"

# ChatML, placing reasoning the way Qwen3-style templates do: inside <think> before the answer.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = (
    "the a of to and in is it that for on with as was by this be are or from at an not have but "
    "code function return value list dict string number python rust class object method test data "
    "write explain sort file read parse error handle loop index array map filter reduce query "
    "model token train draft speculative decoding batch queue worker redis celery budget cloud gpu "
    "please show how why when where which example simple fast small large first last next "
    "def import print self yield async await lambda None True False int str float bool tuple set "
    "() [] {} : ; , . = == != < > + - * / % # ' \" \\n"
).split()


def _corpus(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 40))))
    return out


def build_tokenizer(folder: str | Path, vocab_size: int = 600) -> Path:
    """Train a byte-level BPE tokenizer and save it as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(3000), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END_OF_TURN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": END_OF_TURN, "pad_token": "<|endoftext|>"}, indent=2) + "\n"
    )
    return folder


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS[:120]) for _ in range(rng.randint(4, 30)))


def build_datasets(folder: str | Path, n_chat: int = 40, n_instruct: int = 40, seed: int = 11) -> dict[str, Path]:
    """Two small prompt files in the shapes people have: OpenAI messages and instruction/input."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    chat = folder / "chat.jsonl"
    with open(chat, "w") as fh:
        for i in range(n_chat):
            msgs = [{"role": "user", "content": _prompt(rng)}]
            if i % 5 == 0:
                msgs.append({"role": "assistant", "content": "an earlier answer the prompt drops"})
            fh.write(json.dumps({"id": f"chat-{i}", "messages": msgs}) + "\n")
    instruct = folder / "instruct.jsonl"
    with open(instruct, "w") as fh:
        for i in range(n_instruct):
            row = {"instruction": _prompt(rng), "input": _prompt(rng) if i % 2 else ""}
            fh.write(json.dumps(row) + "\n")
    return {"chat": chat, "instruct": instruct}


EXAMPLE_CONFIG = """\
# The demo's fleet: two datasets, a local SGLang server and a cloud backend (both emulated by
# `draftfleet demo`, which rewrites the URLs). Copy this file as the start of your own.
[fleet]
store = "store"
model = "demo/chatml-600"
tokenizer = "tokenizer"

[[datasets]]
name = "chat"
path = "data/chat.jsonl"
budget_tokens = 200000
max_tokens = 256
temperature = 0.7

[[datasets]]
name = "instruct"
path = "data/instruct.jsonl"
budget_tokens = 200000
max_tokens = 256
temperature = 0.7
system_prompt = "You are a helpful coding assistant."

[backends.sglang]
urls = ["http://127.0.0.1:30000"]
inflight = 32

[backends.openrouter]
base_url = "https://openrouter.ai/api/v1"
model = "moonshotai/kimi-k2.5"
api_key_env = "OPENROUTER_API_KEY"
concurrency = 16
price_input_per_mtok = 0.6
price_output_per_mtok = 2.5
max_spend_usd = 5.0
"""


def build_examples(folder: str | Path) -> Path:
    folder = Path(folder)
    build_tokenizer(folder / "tokenizer")
    build_datasets(folder / "data")
    (folder / "fleet.toml").write_text(EXAMPLE_CONFIG)
    return folder


if __name__ == "__main__":
    print(build_examples(sys.argv[1] if len(sys.argv) > 1 else "examples"))
