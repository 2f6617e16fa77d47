"""transformers' own hidden states for captured files; run it with the ENGINE's python (torch).

``<engine venv>/bin/python tests/engines/hidden_reference.py MODEL_DIR LAYER_IDS FILE...``

For each captured safetensors file (``token_ids`` [T], ``hidden_states`` bf16 [T, L, H]) the
script runs the model in bf16 over exactly those ids and compares every captured layer with
transformers': ``output_hidden_states[k]`` for an aux id k (the residual stream entering decoder
layer k) and, for the last id N, the input of ``model.norm`` caught by a hook (transformers 5
puts the post-norm output in ``hidden_states[-1]``). It also measures each captured layer against
its neighbours k-1 and k+1, so a test can tell an off-by-one from bf16 noise. A ``.ckpt`` file is
SpecForge's export: its concatenated aux layers are split and compared the same way, and its
post-norm ``hidden_state`` against transformers' post-norm output. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys


def main(model_dir: str, layer_ids: list[int], files: list[str]) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    n = model.config.num_hidden_layers
    caught: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: caught.__setitem__("pre_norm", args[0].detach()))
    out = {"max_abs_err": 0.0, "max_ref_abs": 0.0, "neighbour_min_err": float("inf"), "post_norm_max_abs_err": 0.0,
           "post_norm_max_ref_abs": 0.0, "tokens": 0, "files": len(files)}

    def worst(key: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        out[key] = max(out[key], (got.float() - ref.float()).abs().max().item())

    for path in files:
        if path.endswith(".ckpt"):  # SpecForge's export: aux layers concatenated, last layer after the norm
            raw = torch.load(path, weights_only=False)
            ids = raw["input_ids"]
            got = list(raw["aux_hidden_state"][0].chunk(len(layer_ids) - 1, dim=-1))
            post = raw["hidden_state"][0]
        else:  # the store's file (= speculators' hs_i): [T, L, H], the last slot before the norm
            data = load_file(path)
            ids, hs = data["token_ids"], data["hidden_states"]
            got, post = [hs[:, slot] for slot in range(len(layer_ids))], None
        with torch.no_grad():
            res = model(input_ids=ids.unsqueeze(0), output_hidden_states=True)
        states = [h[0] for h in res.hidden_states[:n]] + [caught["pre_norm"][0]]  # index k: r_k; index n: pre-norm
        for g, k in zip(got, layer_ids):
            worst("max_abs_err", g, states[k])
            out["max_ref_abs"] = max(out["max_ref_abs"], states[k].float().abs().max().item())
            for j in (k - 1, k + 1):
                if 0 <= j <= n:
                    out["neighbour_min_err"] = min(out["neighbour_min_err"], (g.float() - states[j].float()).abs().max().item())
        if post is not None:  # transformers 5: hidden_states[n] is the output of the final norm
            worst("post_norm_max_abs_err", post, res.hidden_states[n][0])
            out["post_norm_max_ref_abs"] = max(out["post_norm_max_ref_abs"], res.hidden_states[n][0].float().abs().max().item())
        out["tokens"] += int(ids.shape[0])
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3:])))
