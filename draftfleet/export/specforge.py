"""SpecForge's offline files: one ``torch.save`` dict per sample, ``rows_{g}-{g+2000}/data_{i}.ckpt``.

What SpecForge's offline loader reads (``specforge.runtime.data_plane.feature_store.
load_feature_file`` + ``algorithms.eagle3.data.normalize_offline_sample``; any ``*.ckpt`` under the
folder): ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``aux_hidden_state`` bf16 [1, T, 3H]
(the aux layers in ascending order, concatenated) and ``hidden_state`` bf16 [1, T, H] AFTER the
final norm. Beside them, ``vocab_mapping_{draft}.pt``: the draft vocabulary its trainer loads with
``model.vocab_mapping_path`` (not a ``.ckpt``: the loader does not take it for a sample). Both
are ``torch.save`` files, written by ``torch_files.py``.
"""

from __future__ import annotations

import os

ROWS_PER_FOLDER = 2000  # SpecForge's prepare_hidden_states.py groups files this way


def sample_path(folder: str, i: int) -> str:
    g = i // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return os.path.join(folder, f"rows_{g}-{g + ROWS_PER_FOLDER}", f"data_{i}.ckpt")


def vocab_mapping_path(folder: str, draft: int) -> str:
    return os.path.join(folder, f"vocab_mapping_{draft}.pt")
