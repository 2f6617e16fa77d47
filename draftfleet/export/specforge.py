"""SpecForge's offline files: one ``torch.save`` dict per sample, ``rows_{g}-{g+2000}/data_{i}.ckpt``.

What SpecForge's offline loader reads (``specforge.runtime.data_plane.feature_store.
load_feature_file`` + ``algorithms.eagle3.data.normalize_offline_sample``): ``input_ids`` int64
[T], ``loss_mask`` int64 [T], ``aux_hidden_state`` bf16 [1, T, 3H] (the aux layers in ascending
order, concatenated) and ``hidden_state`` bf16 [1, T, H] AFTER the final norm. The store keeps
the last layer before the norm, so the norm is applied here, in float32, with the target's own
weight and epsilon (RMSNorm: x / sqrt(mean(x^2) + eps) * w), then rounded to bf16 once.

Writing ``torch.save`` files needs torch, which the fleet does not depend on. This module imports
nothing of the fleet: the export runs it in-process where torch is importable, else as a script
with another interpreter that has torch and safetensors (``--torch-python``: the engine's venv, or
any with ``pip install torch safetensors``), given the plan as JSON on stdin:
``{"norm": <F32 safetensors file with "weight">, "eps": float, "samples": [{"hs", "out",
"prompt_len"}]}``.
"""

from __future__ import annotations

import json
import os
import sys

ROWS_PER_FOLDER = 2000  # SpecForge's prepare_hidden_states.py groups files this way


def sample_path(folder: str, i: int) -> str:
    g = i // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return os.path.join(folder, f"rows_{g}-{g + ROWS_PER_FOLDER}", f"data_{i}.ckpt")


def write_samples(plan: dict) -> int:
    import torch
    from safetensors.torch import load_file

    weight = load_file(plan["norm"])["weight"].float()
    eps = float(plan["eps"])
    for s in plan["samples"]:
        data = load_file(s["hs"])
        ids, hs = data["token_ids"].to(torch.int64), data["hidden_states"]
        t = ids.shape[0]
        mask = torch.zeros(t, dtype=torch.int64)
        mask[int(s["prompt_len"]):] = 1
        last = hs[:, -1].float()
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * weight
        sample = {
            "input_ids": ids,
            "loss_mask": mask,
            "aux_hidden_state": hs[:, :-1].reshape(t, -1).unsqueeze(0).to(torch.bfloat16).contiguous(),
            "hidden_state": normed.to(torch.bfloat16).unsqueeze(0).contiguous(),
        }
        os.makedirs(os.path.dirname(s["out"]), exist_ok=True)
        tmp = s["out"] + ".partial"
        torch.save(sample, tmp)
        os.replace(tmp, s["out"])
    return len(plan["samples"])


if __name__ == "__main__":
    print(write_samples(json.load(sys.stdin)))
