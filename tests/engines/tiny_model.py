"""Build the tiny random Llama that the real-engine tier serves; run it with the ENGINE's python.

``<engine venv>/bin/python tests/engines/tiny_model.py TOKENIZER_DIR OUT_DIR``

Nothing is downloaded: the weights are drawn from a fixed seed, so the same inputs give the same
model (bf16, ``save_pretrained`` with the tokenizer's files beside it). The shape is the one
ops/ENGINES.md gives (hidden 128, 2 heads of 64, 1 KV head, 8 layers so that the hidden-state layers
r_2, r_{N/2}, r_{N-3} are distinct). Weights are drawn wider than transformers' default (std 0.1,
not 0.02) so that the context, not just the last token, decides the next one: different prompts
get different answers. A random model rarely picks one given id, so greedy decoding would seldom
stop: the end-of-turn row of the output matrix is scaled by ``EOS_GAIN`` (2: about a third of
answers stop at ``<|im_end|>`` within 64 tokens, the rest run to the length limit — the tier needs
both). Imports torch and transformers: never run it in the project's venv.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SEED = 1234
LAYERS = 8
EOS_GAIN = 2.0


def build(tokenizer_dir: Path, out: Path) -> None:
    import torch

    torch.set_num_threads(1)  # a 1.7M-parameter model: more threads only fight over shared cores
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False, initializer_range=0.1,
        dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[eos] *= EOS_GAIN
    model = model.to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None).save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
