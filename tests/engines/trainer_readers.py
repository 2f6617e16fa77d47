"""Read the fleet's hidden-state exports with the trainers' own loaders; run it with the ENGINE's python.

``<engine venv>/bin/python tests/engines/trainer_readers.py SPECULATORS_DIR SPECFORGE_DIR MAX_LEN [fp8]``

speculators: ``ArrowDataset`` over the folder (``on_missing="raise"``: a row whose file is absent
or whose ``token_ids`` differ from the row's ``input_ids`` is an error, not a skip), every row
through ``__getitem__`` and speculators' own ``check_hidden_states``; with ``fp8``, through
hs-connectors' ``FP8Transfer`` (``--hidden-states-backend fp8``). Its ``token_freq.pt`` loaded as
its trainer loads it (``torch.load(weights_only=True)``), turned into d2t/t2d by its own
``build_vocab_mappings_from_distribution``, and compared with what its own
``save_token_frequency_distribution`` (prepare-data) writes for the same rows. SpecForge: every
``*.ckpt`` under the folder through ``load_feature_file`` and the EAGLE-3
``normalize_offline_sample``; its ``vocab_mapping_*.pt`` loaded by its draft model's own
``load_vocab_mapping`` into buffers of the draft and target sizes, checked by its
``validate_vocab_mapping_consistency``, with its own ``count_effective_feature_tokens`` over the
folder. Prints, per format, each sample's ids, mask, shapes and dtypes and the vocabularies as JSON.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path


def speculators_rows(folder: str, max_len: int, fp8: bool) -> list[dict]:
    from hs_connectors import FP8Transfer
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    transfer = FP8Transfer(Path(folder) / "hidden_states") if fp8 else None
    ds = ArrowDataset(max_len=max_len, datapath=folder, on_missing="raise", transfer=transfer)
    rows = []
    for i in range(len(ds)):
        item = ds[i]
        if not fp8:  # speculators' checker takes bf16 files only
            check_hidden_states(load_file(os.path.join(folder, "hidden_states", f"hs_{i}.safetensors")),
                                ds.data[i]["input_ids"].tolist())
        rows.append({
            "id": ds.data.with_format(None)[i]["id"],
            "input_ids": item["input_ids"].tolist(), "loss_mask": item["loss_mask"].tolist(),
            "hidden_states": [list(item["hidden_states"].shape), str(item["hidden_states"].dtype)],
            "verifier_last_hidden_states": [list(item["verifier_last_hidden_states"].shape),
                                            str(item["verifier_last_hidden_states"].dtype)],
            "input_ids_dtype": str(item["input_ids"].dtype), "lengths": item["lengths"].tolist(),
        })
    return rows


def speculators_vocab(folder: str) -> dict:
    import torch
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, save_token_frequency_distribution

    ours = torch.load(os.path.join(folder, "token_freq.pt"), weights_only=True)  # as its trainer loads it
    with tempfile.TemporaryDirectory() as tmp:
        data = load_from_disk(folder).with_format("torch")
        save_token_frequency_distribution(data, Path(tmp) / "token_freq.pt")  # what prepare-data writes
        theirs = torch.load(Path(tmp) / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(ours, draft_vocab_size=8, target_vocab_size=max(ours) + 1)
    return {"counts": sorted(ours.items()), "key_types": sorted({type(k).__name__ for k in ours}),
            "equals_prepare_data": ours == theirs, "d2t_shape": list(d2t.shape), "t2d_sum": int(t2d.sum())}


def specforge_rows(folder: str, max_len: int) -> list[dict]:
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    paths = sorted(glob.glob(os.path.join(folder, "**", "*.ckpt"), recursive=True),
                   key=lambda p: int(re.search(r"data_(\d+)\.ckpt$", p).group(1)))
    rows = []
    for path in paths:
        raw = load_feature_file(path)
        s = normalize_offline_sample(raw, max_len)
        rows.append({
            "path": os.path.relpath(path, folder),
            "input_ids": raw["input_ids"].tolist(), "loss_mask": raw["loss_mask"].tolist(),
            "dtypes": {k: str(v.dtype) for k, v in raw.items()},
            "shapes": {k: list(v.shape) for k, v in s.items()},
            "normalized_loss_mask": s["loss_mask"][0].tolist(),
        })
    return rows


def specforge_vocab(folder: str) -> dict | None:
    import torch
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.modeling.draft.base import Eagle3DraftModel
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    [path] = glob.glob(os.path.join(folder, "vocab_mapping_*.pt")) or [None]
    if path is None:
        return None
    draft = int(re.search(r"vocab_mapping_(\d+)\.pt$", path).group(1))
    raw = torch.load(path)
    target = raw["t2d"].shape[0]

    class Buffers:  # what load_vocab_mapping fills: the draft model's d2t [draft] and t2d [target] buffers
        d2t = torch.zeros(draft, dtype=torch.int64)
        t2d = torch.zeros(target, dtype=torch.bool)

    model = Buffers()
    Eagle3DraftModel.load_vocab_mapping(model, path)
    validate_vocab_mapping_consistency(model.t2d, model.d2t)
    chosen = (model.d2t + torch.arange(draft)).tolist()
    return {"draft": draft, "target": target, "chosen": chosen, "d2t_dtype": str(raw["d2t"].dtype),
            "t2d_dtype": str(raw["t2d"].dtype), "loaded": bool(getattr(model, "vocab_mapping_loaded", False)),
            "specforge_counts": sorted(count_effective_feature_tokens(folder).items())}


if __name__ == "__main__":
    n, fp8 = int(sys.argv[3]), sys.argv[4:] == ["fp8"]
    print(json.dumps({"speculators": speculators_rows(sys.argv[1], n, fp8), "specforge": specforge_rows(sys.argv[2], n),
                      "speculators_vocab": speculators_vocab(sys.argv[1]), "specforge_vocab": specforge_vocab(sys.argv[2])}))
