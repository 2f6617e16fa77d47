"""Exports of the captured hidden states (``-f speculators``, ``-f specforge``), behind ``draftfleet export``.

Rows are the capture units that have a file in the capture version (the latest by default), in
the order of the other exports (by source file, then line, then key; turns in order), so row i of
each format is the same sample: a record turn, or a conversation captured once (id ``<key>``, what
both trainers take for a multi-turn sample: the whole sequence with the loss mask over every
answer). The ids and loss mask are the file's own token ids and the answers' spans stored with it
(loss 0 on prompts and later user turns, 1 on the answers), never re-rendered. Turns without a file
are counted as missing, not exported. Output folders: ``<out>/<dataset>.speculators/`` and
``<out>/<dataset>.specforge/``.

Each also gets its trainer's draft vocabulary, counted over the loss-masked positions of the
exported rows from the stored ids: speculators' ``token_freq.pt`` (its trainer's default
``<data-path>/token_freq.pt``; ``--draft-vocab-size`` picks the size there) and SpecForge's
``vocab_mapping_{N}.pt`` for ``N`` = ``draft_vocab_size``. Without them a drafter predicts the
whole target vocabulary. The ``torch.save`` files are all written in one ``torch_files.py`` run.

Which layers the states are, is stated twice (``LayerContract``): in the manifest, in both
numberings (vLLM/speculators: id k is the residual stream entering decoder layer k, id N the last
layer's output before the final norm; SpecForge/SGLang: k-1, SGLang adds the 1 back), with each
format's last layer (pre-norm for speculators, post-norm for SpecForge) and the chat template's
hash; and in each folder's ``draft_config.json``, the fields of that trainer's draft-model config
that name the layers, in its own convention (speculators' ``Eagle3SpeculatorConfig.
eagle_aux_hidden_state_layer_ids``; SpecForge's ``eagle_config.eagle_aux_hidden_state_layer_ids``,
which its ``resolve_eagle_capture_layers`` reads), so that the drafter served later asks the target
for the layers it was trained on (sglang #25454: a drafter fed the neighbouring layers loses
acceptance with no error).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from draftfleet.conversation import record_turns
from draftfleet.export import ExportError, export_order, selection
from draftfleet.export import specforge, speculators, torch_files
from draftfleet.hidden import (CONVERSATION, HIDDEN_DIR, HiddenStore, Spans, TargetModel, encode_safetensors, file_spans,
                               loss_mask, open_hidden, read_checked)
from draftfleet.schemas.records import GenerationSettings
from draftfleet.store import Store

FORMATS = ("speculators", "specforge")
CACHE = ".cache"  # under --out: a bucket's files, downloaded for the trainers


class LayerContract(msgspec.Struct, kw_only=True):
    """The target layers an export holds, in both trainers' numberings."""

    num_layers: int  # N, the target's decoder layers
    hidden_size: int
    layer_ids_vllm: list[int]  # the stored slots: the aux ids, then N (the last layer's output)
    aux_layer_ids_vllm: list[int]  # speculators' and vLLM's eagle_aux_hidden_state_layer_ids
    aux_layer_ids_sglang: list[int]  # SpecForge's and SGLang's (each k - 1; SGLang adds the 1 back)
    last_layer: dict[str, str]  # per format: "pre_norm" (before the final norm) or "post_norm"
    chat_template_sha256: str | None  # of the template the records' prompts render with (None: unknown)


LAST_LAYER = {"speculators": "pre_norm", "specforge": "post_norm"}
DRAFT_CONFIG = "draft_config.json"


def layer_contract(m, formats: list[str], chat_template_sha256: str | None) -> LayerContract:
    aux = m.layer_ids[:-1]
    return LayerContract(num_layers=m.num_layers, hidden_size=m.hidden_size, layer_ids_vllm=m.layer_ids,
                         aux_layer_ids_vllm=aux, aux_layer_ids_sglang=[k - 1 for k in aux],
                         last_layer={f: LAST_LAYER[f] for f in formats if f in LAST_LAYER},
                         chat_template_sha256=chat_template_sha256)


def draft_config(fmt: str, c: LayerContract) -> dict:
    """The layer fields of ``fmt``'s draft-model config, in that trainer's own convention."""
    if fmt == "speculators":  # speculators models/eagle3/config.py; vLLM reads the same field when serving
        return {"eagle_aux_hidden_state_layer_ids": c.aux_layer_ids_vllm, "target_hidden_size": c.hidden_size}
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": c.aux_layer_ids_sglang},  # SGLang adds 1 back
            "target_hidden_size": c.hidden_size}


def _write_draft_config(folder: Path, fmt: str, c: LayerContract) -> None:
    (folder / DRAFT_CONFIG).write_bytes(msgspec.json.format(msgspec.json.encode(draft_config(fmt, c))) + b"\n")


class FeaturesManifest(msgspec.Struct, kw_only=True):
    dataset: str
    dataset_version: int | None  # the records' version (None: every version)
    settings: GenerationSettings | None  # that version's generation settings
    capture_version: int
    layer_ids: list[int]
    model: str
    dtype: str  # the states' in the store and the speculators folder (the SpecForge files are bf16)
    rows: int
    tokens: int
    missing: int  # record turns with output ids but no captured file (run draftfleet capture)
    bad_files: list[str] = []  # stored files not exported, each with why: changed since stored (seal), unreadable
    units: str = "turn"  # the capture version's: "conversation" (a conversation whose turns prefix each other is one row)
    conversation_rows: int = 0  # rows that are a whole conversation (id <key>, the loss mask over every answer)
    per_turn_conversations: int = 0  # conversations of 2+ turns exported a row per turn (id <key>_gen<turn>)
    folders: dict[str, str]
    draft_vocab_size: int  # SpecForge's vocab mapping (speculators' trainer picks its own from token_freq.pt)
    trained_tokens: int  # loss-masked positions, the ones the vocabulary files count
    layers: LayerContract
    notes: list[str] = []


DRAFT_VOCAB_SIZE = 32000  # the trainers' usual reduced draft vocabulary


def _rows(hidden: HiddenStore, records: list, dataset: str, version: int
          ) -> tuple[list[tuple[str, list[int], list[int], str, Spans]], int, list[str], list[str]]:
    """(id, ids, loss mask, file, answer spans) per captured unit of the chosen records, in export
    order: a conversation captured once is one row (id ``<key>``, the mask over every answer), else
    a row per turn; how many turns lack a file; the conversations of 2+ turns captured per turn;
    why each file left out is bad (changed since it was stored: its seal wrong, or missing in a
    version made with seals; or it cannot be read). Each file's ids and spans are taken from the
    bytes its seal is checked on, in one open."""
    required = hidden.sealed(dataset, version)
    rows, missing, per_turn, bad = [], 0, [], []
    for rec in records:
        whole = hidden.path(dataset, version, rec.key, CONVERSATION)
        if rec.turns and whole.exists():
            units = [(rec.key, whole)]
        else:
            if rec.turns and len(rec.turns) > 1:
                per_turn.append(rec.key)
            units = []
            for turn, t in enumerate(record_turns(rec)):
                path = hidden.path(dataset, version, rec.key, turn)
                if not t.output_ids:
                    continue
                if not path.exists():
                    missing += 1
                    continue
                units.append((f"{rec.key}_gen{turn}" if rec.turns else rec.key, path))
        for rid, path in units:
            try:
                # a file changed since it was stored is no sample; the states are hashed, not kept
                tensors, meta, _sealed = read_checked(path, required, ("token_ids",))
                ids = tensors["token_ids"][1].tolist()
                spans = file_spans(meta, len(ids), path)
            except OSError as exc:
                bad.append(f"{path}: {exc.strerror or exc}")
                continue
            except (ValueError, KeyError) as exc:  # it names the file
                bad.append(str(exc) if isinstance(exc, ValueError) else f"{path}: no {exc} tensor")
                continue
            rows.append((rid, ids, loss_mask(len(ids), spans), str(path), spans))
    return rows, missing, per_turn, bad


def token_counts(rows: list) -> Counter:
    """Each id's count over the loss-masked positions of ``rows`` (what both trainers count)."""
    counts: Counter = Counter()
    for r in rows:
        counts.update(i for i, m in zip(r[1], r[2]) if m)
    return counts


def _torch_here() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("safetensors.torch") is not None


def export_features(store: Store, dataset: str, out_dir: str | Path, formats: list[str], *,
                    model_path: str | None, version: int | None = None, torch_python: str | None = None,
                    draft_vocab_size: int = DRAFT_VOCAB_SIZE, records_version: int | None = None,
                    all_versions: bool = False, chat_template_sha256: str | None = None,
                    fetching: Callable[[int, int], None] | None = None) -> FeaturesManifest:
    """Write the hidden-state exports of the dataset's current version's records (``records_version``:
    another version's; ``all_versions``: every record) from capture version ``version`` (default
    the latest); ``model_path`` (the target's folder) gives SpecForge's norm and the target's
    vocabulary size; ``chat_template_sha256`` is the fleet tokenizer's, stated in the manifest.

    From a store in a bucket the files are first downloaded to ``<out>/.cache/_hidden`` (both
    trainers open local paths only; ops/scaling.md), resumably, ``fetching(bytes, total)`` told as
    they arrive; the export then reads and links those copies as a folder store's."""
    chosen = selection(store, dataset, records_version, all_versions)
    hidden = open_hidden(store)
    m = hidden.manifest(dataset, version)
    if m is None:
        raise ExportError(f"{dataset}: no captured hidden states" + (f" in version {version}" if version else "")
                          + ": run draftfleet capture and a capture worker first")
    records = sorted(filter(chosen.takes, store.records(dataset)), key=export_order)
    if not hidden.local:
        hidden = hidden.download(dataset, m.version, Path(out_dir) / CACHE / HIDDEN_DIR, fetching,
                                 keys={rec.key for rec in records})
    rows, missing, per_turn, bad = _rows(hidden, records, dataset, m.version)
    counts = sorted(token_counts(rows).items())
    layers = layer_contract(m, formats, chat_template_sha256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folders, plan, notes = {}, {}, []
    if "speculators" in formats:
        folder = out / f"{dataset}.speculators"
        speculators.write(folder, [(r[0], r[1], r[2], r[3]) for r in rows])
        _write_draft_config(folder, "speculators", layers)
        folders["speculators"] = str(folder)
        plan["token_freq"] = {"out": str(folder / speculators.TOKEN_FREQ), "counts": counts}
        if m.dtype == "float8_e4m3fn":
            notes.append("the speculators files are fp8 with a scale per token (hs-connectors' layout): train with "
                         "--hidden-states-backend fp8, which dequantizes them as it reads")
    draft = draft_vocab_size
    if "specforge" in formats:
        if not model_path:
            raise ExportError("-f specforge needs the target model's folder for its final norm ([capture] model_path)")
        model = TargetModel.load(model_path)
        if model.config_sha256 != m.model_config_sha256:
            raise ExportError(f"{model_path} is not the model {dataset} v{m.version} was captured with "
                              f"(config sha256 {model.config_sha256[:12]} != {m.model_config_sha256[:12]})")
        if not model.vocab_size:
            raise ExportError(f"{model_path}/config.json has no vocab_size: SpecForge's vocab mapping needs it")
        draft = min(draft_vocab_size, model.vocab_size)
        folder = out / f"{dataset}.specforge"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _write_draft_config(folder, "specforge", layers)
        folders["specforge"] = str(folder)
        plan["vocab_mapping"] = {"out": specforge.vocab_mapping_path(str(folder), draft), "counts": counts,
                                 "draft": draft, "target": model.vocab_size}
        notes.append(f"SpecForge: set model.vocab_mapping_path to {plan['vocab_mapping']['out']} (draft vocabulary "
                     f"{draft}) and a draft config with draft_vocab_size {draft}")
    if m.units == "conversation" and per_turn:
        notes.append(f"{len(per_turn)} conversation(s) are rows per turn (id <key>_gen<turn>), not one row: their "
                     "turns' ids do not prefix each other (the template rewrites the history, e.g. blanks earlier "
                     "reasoning, or an answer re-renders to other ids); draftfleet capture --json names the first "
                     f"reason (first: {per_turn[0]})")
    with tempfile.TemporaryDirectory(prefix="draftfleet-norm-") as tmp:
        if "specforge" in formats:
            norm = Path(tmp) / "norm.safetensors"
            norm.write_bytes(encode_safetensors({"weight": ("F32", model.final_norm_weight())}, {}))
            plan["specforge"] = {"norm": str(norm), "eps": model.rms_norm_eps, "samples": [
                {"hs": r[3], "out": specforge.sample_path(str(folder), i), "spans": r[4]}
                for i, r in enumerate(rows)]}
        if plan:
            _run_torch(plan, torch_python)
    manifest = FeaturesManifest(dataset=dataset, dataset_version=chosen.version, settings=chosen.settings,
                                capture_version=m.version, layer_ids=m.layer_ids, model=m.model,
                                dtype=m.dtype, rows=len(rows), tokens=sum(len(r[1]) for r in rows), missing=missing,
                                folders=folders, draft_vocab_size=draft, trained_tokens=sum(n for _, n in counts),
                                layers=layers, notes=notes, units=m.units, bad_files=bad,
                                conversation_rows=sum(r[3].endswith(".conversation.safetensors") for r in rows),
                                per_turn_conversations=len(per_turn))
    (out / f"{dataset}.features.json").write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    return manifest


def _run_torch(plan: dict, torch_python: str | None) -> None:
    """Write the plan's torch.save files here when torch is importable, else with ``torch_python``."""
    if torch_python is None and _torch_here():
        torch_files.run(plan)
        return
    if torch_python is None:
        raise ExportError("-f speculators and -f specforge write torch.save files (token_freq.pt, the samples, the "
                          "vocab mapping) and this interpreter has no torch: pass --torch-python with an interpreter "
                          "that has torch and safetensors (e.g. the engine's venv), or pip install "
                          "'draftfleet[specforge]'")
    done = subprocess.run([torch_python, torch_files.__file__], input=json.dumps(plan), capture_output=True, text=True)
    if done.returncode:
        raise ExportError(f"{torch_python} could not write the torch.save files: {done.stderr.strip()[-1500:]}")
