"""The hidden-state exports' files that only torch writes (``torch.save``), in one plan.

- SpecForge's samples (``specforge.py`` has the layout): ``input_ids``, ``loss_mask``,
  ``aux_hidden_state`` bf16 [1, T, 3H] and ``hidden_state`` bf16 [1, T, H] AFTER the final norm.
  The store keeps the last layer before the norm, so the norm is applied here, in float32, with
  the target's own weight and epsilon (RMSNorm: x / sqrt(mean(x^2) + eps) * w), then rounded to
  bf16 once. An fp8 file is first dequantized as speculators' hs-connectors reads it
  (``fp8.to(bf16) * scale.to(bf16)``), so both trainers see the same states.
- SpecForge's vocabulary mapping (what ``model.vocab_mapping_path`` loads, as its
  ``generate_vocab_mapping_file`` saves it): ``{"d2t": int64 [draft], "t2d": bool [target]}``, the
  ``draft`` most frequent ids (ties: the lower id), ascending, ``d2t[i] = id_i - i``; ids 0, 1, ..
  fill it when fewer were seen.
- speculators' ``token_freq.pt`` (what ``--token-freq-path`` takes, as its ``prepare-data
  --no-skip-token-freq`` writes it): ``dict[int, int]``, each id's count.

The counts come from the fleet (the loss-masked positions of the exported rows). This module
imports nothing of the fleet: the export runs it in-process where torch is importable, else as a
script with another interpreter that has torch and safetensors (``--torch-python``), given the
plan as JSON on stdin: ``{"specforge"?: {"norm": <F32 safetensors file with "weight">, "eps",
"samples": [{"hs", "out", "spans": [[start, end], ..]}]}, "vocab_mapping"?: {"out", "counts": [[id, n], ..],
"draft", "target"}, "token_freq"?: {"out", "counts"}}``.
"""

from __future__ import annotations

import json
import os
import sys

SCALES = "hidden_states_scales"


def _save(obj, out: str) -> None:
    import torch

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".partial"
    torch.save(obj, tmp)
    os.replace(tmp, out)


def write_samples(spec: dict) -> int:
    import torch
    from safetensors.torch import load_file

    weight = load_file(spec["norm"])["weight"].float()
    eps = float(spec["eps"])
    for s in spec["samples"]:
        data = load_file(s["hs"])
        ids, hs = data["token_ids"].to(torch.int64), data["hidden_states"]
        if SCALES in data:
            hs = hs.to(torch.bfloat16) * data[SCALES].to(torch.bfloat16)
        t = ids.shape[0]
        mask = torch.zeros(t, dtype=torch.int64)
        for start, end in s["spans"]:  # each answer's positions (a conversation's: every turn's)
            mask[int(start):int(end)] = 1
        last = hs[:, -1].float()
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * weight
        _save({
            "input_ids": ids,
            "loss_mask": mask,
            "aux_hidden_state": hs[:, :-1].reshape(t, -1).unsqueeze(0).to(torch.bfloat16).contiguous(),
            "hidden_state": normed.to(torch.bfloat16).unsqueeze(0).contiguous(),
        }, s["out"])
    return len(spec["samples"])


def vocab_mapping(counts: dict[int, int], draft: int, target: int):
    """(d2t, t2d) for the ``draft`` most frequent of ``counts``."""
    import torch

    chosen = sorted(counts, key=lambda i: (-counts[i], i))[:draft]
    taken = set(chosen)
    fill = (i for i in range(target) if i not in taken)
    while len(chosen) < draft:
        chosen.append(next(fill))
    chosen.sort()
    d2t = torch.tensor(chosen, dtype=torch.int64) - torch.arange(draft, dtype=torch.int64)
    t2d = torch.zeros(target, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def run(plan: dict) -> dict:
    done = {}
    if "specforge" in plan:
        done["samples"] = write_samples(plan["specforge"])
    if "vocab_mapping" in plan:
        v = plan["vocab_mapping"]
        d2t, t2d = vocab_mapping({int(i): int(n) for i, n in v["counts"]}, int(v["draft"]), int(v["target"]))
        _save({"d2t": d2t, "t2d": t2d}, v["out"])
        done["vocab_mapping"] = v["out"]
    if "token_freq" in plan:
        f = plan["token_freq"]
        _save({int(i): int(n) for i, n in f["counts"]}, f["out"])
        done["token_freq"] = f["out"]
    return done


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))
