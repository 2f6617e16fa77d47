"""Read the fleet's hidden-state exports with the trainers' own loaders; run it with the ENGINE's python.

``<engine venv>/bin/python tests/engines/trainer_readers.py SPECULATORS_DIR SPECFORGE_DIR MAX_LEN``

speculators: ``ArrowDataset`` over the folder (``on_missing="raise"``: a row whose file is absent
or whose ``token_ids`` differ from the row's ``input_ids`` is an error, not a skip), every row
through ``__getitem__`` and speculators' own ``check_hidden_states``. SpecForge: every ``*.ckpt``
under the folder through ``load_feature_file`` and the EAGLE-3 ``normalize_offline_sample``.
Prints, per format, each sample's ids, mask, shapes and dtypes as JSON for the test to compare.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys


def speculators_rows(folder: str, max_len: int) -> list[dict]:
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len=max_len, datapath=folder, on_missing="raise")
    rows = []
    for i in range(len(ds)):
        item = ds[i]
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


if __name__ == "__main__":
    n = int(sys.argv[3])
    print(json.dumps({"speculators": speculators_rows(sys.argv[1], n), "specforge": specforge_rows(sys.argv[2], n)}))
