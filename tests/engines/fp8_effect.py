"""What fp8 capture costs, against a bf16 capture of the same units; run it with the ENGINE's python.

``<engine venv>/bin/python tests/engines/fp8_effect.py MODEL_DIR SPECULATORS_BF16 SPECULATORS_FP8 MAX_LEN``

Both folders are the fleet's speculators exports of the same rows (row i = the same unit), read by
speculators' own ``ArrowDataset``: the bf16 one through its default file transfer, the fp8 one
through hs-connectors' ``FP8Transfer`` (what ``--hidden-states-backend fp8`` builds), which
dequantizes. Per token it measures the largest error relative to that token's largest state (fp8
is scaled per token), the aux states' relative L2 error, and the teacher distribution the drafter
learns from: softmax(lm_head(final_norm(last state))) of the target, fp8 against bf16 (top-1
agreement, largest probability difference). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys


def main(model_dir: str, bf16_dir: str, fp8_dir: str, max_len: int) -> dict:
    import torch
    from hs_connectors import FP8Transfer
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = ArrowDataset(max_len=max_len, datapath=bf16_dir, on_missing="raise")
    fp8 = ArrowDataset(max_len=max_len, datapath=fp8_dir, on_missing="raise",
                       transfer=FP8Transfer(__import__("pathlib").Path(fp8_dir) / "hidden_states"))
    out = {"rows": len(ref), "tokens": 0, "max_err_of_token_amax": 0.0, "aux_rel_l2": 0.0, "top1_agree": 0.0,
           "max_prob_diff": 0.0, "fp8_dtype_on_disk": None, "dequantized_dtype": None}
    sq_err = sq_ref = 0.0
    agree = 0
    for i in range(len(ref)):
        a, b = ref[i], fp8[i]
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        raw = load_file(os.path.join(fp8_dir, "hidden_states", f"hs_{i}.safetensors"))
        out["fp8_dtype_on_disk"] = str(raw["hidden_states"].dtype)
        out["dequantized_dtype"] = str(b["hidden_states"].dtype)
        # [T, 3H] aux and [T, H] last (speculators splits them); per token, as fp8 is scaled
        full_a = torch.cat([a["hidden_states"], a["verifier_last_hidden_states"]], -1).float()
        full_b = torch.cat([b["hidden_states"], b["verifier_last_hidden_states"]], -1).float()
        amax = full_a.abs().amax(-1)
        out["max_err_of_token_amax"] = max(out["max_err_of_token_amax"],
                                           ((full_b - full_a).abs().amax(-1) / amax).max().item())
        sq_err += (b["hidden_states"].float() - a["hidden_states"].float()).pow(2).sum().item()
        sq_ref += a["hidden_states"].float().pow(2).sum().item()
        with torch.no_grad():
            pa = torch.softmax(model.lm_head(model.model.norm(a["verifier_last_hidden_states"].float())), -1)
            pb = torch.softmax(model.lm_head(model.model.norm(b["verifier_last_hidden_states"].float())), -1)
        agree += int((pa.argmax(-1) == pb.argmax(-1)).sum().item())
        out["max_prob_diff"] = max(out["max_prob_diff"], (pa - pb).abs().max().item())
        out["tokens"] += int(a["input_ids"].shape[0])
    out["aux_rel_l2"] = (sq_err / sq_ref) ** 0.5
    out["top1_agree"] = agree / out["tokens"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
