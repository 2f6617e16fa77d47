"""speculators' offline layout: ``hidden_states/hs_{i}.safetensors`` tied to row i of an Arrow dataset.

What speculators' ``ArrowDataset`` reads (speculators 0.9, ``train/data.py``): ``load_from_disk``
of a folder holding ``input_ids``, ``loss_mask`` and ``seq_len`` rows (torch format), and per row
i the file ``hidden_states/hs_{i}.safetensors`` with ``token_ids`` int64 [T] (must equal the row's
``input_ids``) and ``hidden_states`` bf16 [T, 4, H] (3 aux layers, then the last layer before the
final norm). The store's files are exactly that, so each is linked (a copy across file systems):
nothing is rewritten and the export costs no space on the store's file system. The Arrow folder is
what ``Dataset.save_to_disk`` writes (one IPC-stream shard, ``state.json``, ``dataset_info.json``),
written with pyarrow: the fleet does not depend on ``datasets``. Rows keep the export's order (by
source, then line), unshuffled; ``id`` names the record (``<key>_gen<turn>`` for conversations).
Beside them ``token_freq.pt`` (``features.py``), the draft vocabulary's counts. fp8 captures are
linked as they are: speculators reads them with ``--hidden-states-backend fp8`` (hs-connectors'
``FP8Transfer`` dequantizes).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa

_FEATURES = {
    "id": {"dtype": "string", "_type": "Value"},
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}
SHARD = "data-00000-of-00001.arrow"
TOKEN_FREQ = "token_freq.pt"  # the trainer's default --token-freq-path: <data-path>/token_freq.pt


def _link(src: str, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(src, dst)


def write(folder: Path, rows: list[tuple[str, list[int], list[int], str]]) -> int:
    """Write the layout for ``rows`` = (id, input ids, loss mask, store file); returns the rows written."""
    hs = folder / "hidden_states"
    if folder.exists():
        shutil.rmtree(folder)
    hs.mkdir(parents=True)
    for i, (_id, _ids, _mask, path) in enumerate(rows):
        _link(path, hs / f"hs_{i}.safetensors")
    table = pa.table({
        "id": pa.array([r[0] for r in rows], pa.string()),
        "input_ids": pa.array([r[1] for r in rows], pa.list_(pa.int64())),
        "loss_mask": pa.array([r[2] for r in rows], pa.list_(pa.int64())),
        "seq_len": pa.array([len(r[1]) for r in rows], pa.int64()),
    })
    info = {"citation": "", "description": "", "features": _FEATURES, "homepage": "", "license": ""}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": _FEATURES}})})
    with pa.OSFile(str(folder / SHARD), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    digest = hashlib.sha256(b"".join(r[0].encode() for r in rows)).hexdigest()[:16]
    state = {"_data_files": [{"filename": SHARD}], "_fingerprint": digest, "_format_columns": None,
             "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return len(rows)
