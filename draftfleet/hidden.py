"""Hidden states: the EAGLE-3 features of stored records, one write-once file per record turn.

Layout under the store root (beside the records, never inside a dataset's shards)::

    _hidden/<dataset>/v<N>/capture.json                      CaptureManifest: model, layers
    _hidden/<dataset>/v<N>/<key[:2]>/<key>.<turn>.safetensors

The unit is (record key, turn index): a single-turn record has turn 0; a conversation one file
per regenerated turn, or, where each turn's prompt and answer ids are the start of the next turn's
prompt (a template that keeps the history as generated) and the version captures conversations
(``units = "conversation"``), ONE file over its last turn's whole sequence:
``<key>.conversation.safetensors``. Causal attention makes a position's states depend only on the
ids up to it, so that file holds every turn's states once, where per-turn files would compute and
store the shared history again for every turn. A template that rewrites the history (Kimi-K2.5
blanks earlier reasoning) or an answer whose ids are not the tokenizer's own encoding of its text
breaks the prefix: that conversation is captured per turn (:func:`conversation_spans` says why).

A file holds ``token_ids`` int64 [T] (the unit's prompt ids then its output ids, as stored) and ``hidden_states`` [T, L, H] in the version's dtype: bf16, or float8
e4m3 with ``hidden_states_scales`` float32 [T, 1, 1] (one scale per token, amax / 448, the layout
speculators' hs-connectors reads and dequantizes as ``fp8.to(bf16) * scale``). The auxiliary layers in ascending
order, then the last layer's output BEFORE the final norm (vLLM/speculators layer ids, where id k
is the residual stream entering decoder layer k and id N the last layer's output; README,
"Hidden states (EAGLE-3 features)"). That is speculators' own per-row layout, so its export is a copy; SpecForge's
post-norm last layer is derived from it at export (the norm cannot be undone, so the pre-norm
state is the one kept). The header metadata names the key, the turn (``conversation``), the
answers' ``spans`` (``[[start, end], ..]`` in the ids: one per turn, the trainers' loss mask) and
``prompt_len`` (the first span's start).

Files are written once, by the engine's connector, on the store's file system: the worker writes
the unit's metadata into the room the connector leaves in the header (in place, same length), with
the seal over that header and the data it checked (:func:`file_seal`: a file of a version made with
seals that lacks a good one is changed, and bad to every reader), fsyncs, and ``link``s the file
to its name (fails if the target exists), so of two workers capturing the same unit exactly one
file is stored, and the states cross the disk once. A version holds one capture setting (model
identity, layer ids, dtype); other settings need a new version (``--new-version``).

safetensors is written and read here with numpy: numpy has no bfloat16, so bf16 tensors travel
as their uint16 bit patterns (the file format is the same: 8-byte header length, JSON header,
little-endian data).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec
import numpy as np

from draftfleet.conversation import record_turns
from draftfleet.export import tokens
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import CONVERSATION, CaptureManifest, ResponseRecord, turn_name
from draftfleet.store import Store, StoreError, check_key, check_name, write_once
from draftfleet.tokenizer import TargetTokenizer, TokenizerError

HIDDEN_DIR = "_hidden"
MANIFEST = "capture.json"
_FILE_RE = re.compile(r"^([0-9a-f]{64})\.(\d+|conversation)\.safetensors$")
_DTYPES = {"BF16": np.uint16, "F8_E4M3": np.uint8, "I64": np.int64, "F32": np.float32, "I32": np.int32,
           "F16": np.float16}
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # [capture] dtype -> the manifest's (torch's name)
SCALES = "hidden_states_scales"  # hs-connectors' name of the fp8 files' per-token scales
ROOM_KEY = "header_room"  # the connector's metadata entry of spaces the worker writes the unit's metadata over
HEADER_ROOM = 4096  # bytes of it: the unit's metadata takes ~300, plus ~14 a turn of a conversation's spans
_manifest_decoder = msgspec.json.Decoder(CaptureManifest)
# Where transformers checkpoints keep the final norm (text models; multimodal ones such as Kimi-K2.5)
FINAL_NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


class CaptureError(ValueError):
    """A capture that cannot run as asked (other settings in the store, a model folder unread)."""


# -- layers and the target model ---------------------------------------------------------------
def default_aux_layers(num_layers: int) -> list[int]:
    """The aux layer ids SpecForge and speculators both use: r_2, r_{N/2}, r_{N-3} (vLLM ids)."""
    return [2, num_layers // 2, num_layers - 3]


class TargetModel(msgspec.Struct, frozen=True, kw_only=True):
    """What capture needs to know of the target, read from its folder's ``config.json``."""

    path: str
    num_layers: int
    hidden_size: int
    rms_norm_eps: float
    config_sha256: str
    vocab_size: int = 0  # 0: config.json names none

    @classmethod
    def load(cls, path: str | Path) -> TargetModel:
        p = Path(path) / "config.json"
        try:
            raw = p.read_bytes()
            cfg = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise CaptureError(f"{p}: cannot read the target model's config ({exc})") from None
        text = cfg.get("text_config") or cfg  # multimodal targets (Kimi-K2.5) nest the language model
        try:
            return cls(path=str(path), num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                       rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), config_sha256=hashlib.sha256(raw).hexdigest(),
                       vocab_size=int(text.get("vocab_size") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CaptureError(f"{p}: no num_hidden_layers/hidden_size ({exc})") from None

    def layer_ids(self, aux: list[int] | None) -> list[int]:
        """The ids vLLM is asked for: the aux layers ascending, then N (the pre-norm last layer)."""
        ids = sorted(aux if aux else default_aux_layers(self.num_layers))
        if len(set(ids)) != len(ids) or ids[0] < 1 or ids[-1] >= self.num_layers:
            raise CaptureError(f"aux layer ids {ids}: need distinct ids within 1..{self.num_layers - 1} "
                               f"for a {self.num_layers}-layer target")
        return [*ids, self.num_layers]

    def final_norm_weight(self) -> np.ndarray:
        """The final norm's weight as float32, from the model folder's safetensors files."""
        folder = Path(self.path)
        index = folder / "model.safetensors.index.json"
        try:
            where = json.loads(index.read_text())["weight_map"] if index.exists() else None
            for name in FINAL_NORM_NAMES:
                file = folder / (where[name] if where else "model.safetensors") if not where or name in where else None
                if file is None:
                    continue
                header, offset = _header(file)
                if name in header:
                    with open(file, "rb") as fh:
                        w = _read_tensor(fh, header[name], offset)
                    return bf16_to_f32(w) if header[name]["dtype"] == "BF16" else w.astype(np.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise CaptureError(f"{folder}: cannot read the final norm weight ({exc})") from None
        raise CaptureError(f"{folder}: none of {', '.join(FINAL_NORM_NAMES)} in its weights")


def capture_settings(cfg: FleetConfig) -> tuple[TargetModel, list[int]]:
    """The target model and the layer ids this fleet captures with (``[capture]``)."""
    path = cfg.capture.model_path or (cfg.vllm.launch.model_path if cfg.vllm and cfg.vllm.launch else None)
    if not path:
        raise CaptureError(f"{cfg.path}: capture needs the target model's folder: [capture] model_path "
                           "(or [backends.vllm.launch] model_path)")
    model = TargetModel.load(path)
    return model, model.layer_ids(cfg.capture.aux_layers)


def storage_path(cfg: FleetConfig) -> str:
    """Where the engine's connector writes each request's file (the worker moves it into the store,
    or uploads it to a bucket store and removes it): ``[capture] storage_path``, else the store's
    ``_hidden/_incoming``, or for a store in a bucket ``<cache>/draftfleet/capture-incoming``
    (``$XDG_CACHE_HOME`` or ``~/.cache``) on local disk."""
    if cfg.capture.storage_path:
        return cfg.capture.storage_path
    if cfg.fleet.store.startswith("s3://"):
        return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftfleet" / "capture-incoming")
    return str(Path(cfg.fleet.store) / HIDDEN_DIR / "_incoming")


def check_storage(cfg: FleetConfig, storage: str | Path) -> None:
    """Refuse an engine storage folder on another file system than the store (its files are linked
    into the store, never copied) unless ``[capture] copy``. For a store in a bucket any local
    folder the worker can write does: each file is uploaded from it once, then removed."""
    folder = Path(storage)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if cfg.fleet.store.startswith("s3://"):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
            return
        same = os.stat(folder).st_dev == os.stat(cfg.fleet.store).st_dev
    except OSError as exc:
        raise CaptureError(f"{folder}: cannot use it as the engine's storage_path ({exc.strerror or exc})") from None
    if not same and not cfg.capture.copy:
        raise CaptureError(f"{cfg.path}: [capture] storage_path {folder} is on another file system than the store "
                           f"{cfg.fleet.store}: each file would be written twice. Put it on the store's file system "
                           "(the default is <store>/_hidden/_incoming), or set [capture] copy = true")


def record_units(rec: ResponseRecord, tok: TargetTokenizer) -> list[tuple[list[int], int]]:
    """Per turn of a record: (its prompt ids then its output ids, the prompt's length).

    The ids are the token export's (``export/tokens.py``): a conversation's turns keep the prompt
    ids the engine received; a single-turn record's prompt is the template's render of its
    messages, as the GPU worker sent it. An exact record whose render differs in length from the
    prompt the engine counted was made with another tokenizer or template: refused.
    """
    try:
        rows = tokens.rows(rec, {}, tok)
    except TokenizerError as exc:  # the chat template refuses the record's messages
        raise CaptureError(f"record {rec.key}: {exc}") from None
    units = []
    for row, turn in zip(rows, record_turns(rec)):
        ids = row["input_ids"]
        prompt_len = len(ids) - len(turn.output_ids)
        if turn.token_source == "exact" and not turn.prompt_ids and prompt_len != turn.prompt_tokens:
            raise CaptureError(f"record {rec.key}: the prompt renders to {prompt_len} ids, the engine ran "
                               f"{turn.prompt_tokens}: another tokenizer or chat template than at generation")
        units.append((ids, prompt_len))
    return units


Spans = list[tuple[int, int]]


def conversation_spans(rec: ResponseRecord) -> tuple[list[int], Spans] | str:
    """A conversation captured once: its last turn's whole sequence and each turn's answer span in
    it, when every turn's prompt ids then answer ids begin the next turn's prompt ids; otherwise why
    not (a string: one turn, ids not stored, or where the history differs from what was generated).

    Only the stored ids decide: the exact prompt each turn was run with, never a re-render."""
    turns = record_turns(rec)
    if len(turns) < 2:
        return "a single turn"
    if not all(t.prompt_ids and t.output_ids for t in turns):
        return "a turn without stored prompt or answer ids"
    spans: Spans = []
    for k, t in enumerate(turns):
        spans.append((len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids)))
        if k + 1 == len(turns):
            break
        seq, nxt = t.prompt_ids + t.output_ids, turns[k + 1].prompt_ids
        if len(seq) > len(nxt) or nxt[: len(seq)] != seq:
            at = next((i for i, (a, b) in enumerate(zip(seq, nxt)) if a != b), min(len(seq), len(nxt)))
            why = ("the history is rendered otherwise than it was asked" if at < len(t.prompt_ids) else
                   "the template rewrites the earlier answer (its reasoning or think block blanked or dropped)"
                   if t.reasoning or at == len(t.prompt_ids) else
                   "the answer re-renders to other ids than were generated")
            return f"turn {k + 1}'s prompt differs from turn {k}'s prompt and answer at id {at}: {why}"
    last = turns[-1]
    return last.prompt_ids + last.output_ids, spans


def loss_mask(n: int, spans: Spans) -> list[int]:
    """1 on every answer position of ``spans``, 0 elsewhere (prompts, later user turns)."""
    mask = [0] * n
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return mask


def file_spans(meta: dict[str, str], n: int, path: str | Path) -> Spans:
    """The answer spans a stored file's metadata gives (a per-turn file: ``prompt_len`` to the end),
    checked to lie in its ``n`` ids in order: a wrong mask trains on the prompt, silently."""
    try:
        spans = [(int(a), int(b)) for a, b in json.loads(meta["spans"])] if "spans" in meta else [
            (int(meta["prompt_len"]), n)]
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: no readable answer spans in its metadata ({exc})") from None
    ends = [0] + [x for s in spans for x in s] + [n]
    if not spans or any(a > b for a, b in zip(ends, ends[1:])) or any(a == b for a, b in spans):
        raise ValueError(f"{path}: answer spans {spans} do not lie in order within its {n} ids")
    return spans


def projected_bytes(bytes_per_token: float, pending_tokens: int, remaining_budget: int | None,
                    unit_tokens: int, completion_tokens: int) -> int:
    """What the rest of a dataset will take in the store: the stored turns not captured yet
    (``pending_tokens``), plus the answers the budget has left to generate, each with its prompt
    as the stored turns have so far (``unit_tokens`` captured tokens per ``completion_tokens``)."""
    per_answer_token = unit_tokens / completion_tokens if completion_tokens else 1.0
    return round((max(0, pending_tokens) + (remaining_budget or 0) * per_answer_token) * bytes_per_token)


def bytes_per_token(manifest: CaptureManifest) -> int:
    """What a token costs on disk in the version's dtype: its states, fp8's scale, its int64 id."""
    states = len(manifest.layer_ids) * manifest.hidden_size
    return (states + 4 if manifest.dtype == "float8_e4m3fn" else states * 2) + 8


def measured_bytes_per_token(manifest: CaptureManifest, tokens: int, size: int) -> float:
    """The version's bytes per token: what its files hold (headers included) once it has some, else
    the dtype's figure (:func:`bytes_per_token`)."""
    return round(size / tokens, 1) if tokens else float(bytes_per_token(manifest))


# -- bfloat16 and safetensors with numpy -------------------------------------------------------
def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch's ``.to(torch.bfloat16)`` does (finite values)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _fp8_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag).astype(np.float32)  # e4m3fn: no inf, NaN = S.1111.111


_FP8 = _fp8_table()


def fp8_to_f32(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns (uint8) to float32."""
    return _FP8[bits]


_ITEMSIZE = {name: np.dtype(t).itemsize for name, t in _DTYPES.items()}
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def _header(path: str | Path, fh: BinaryIO | None = None, size: int | None = None) -> tuple[dict, int]:
    """The checked header of a safetensors file (tensor entries and ``__metadata__``) and where
    its data starts. Anything malformed (short, a header that is not JSON or not objects, an
    unknown dtype, a shape or offsets that do not fit the file) raises ``ValueError`` naming the
    file and the part: an engine or a disk can hand over any bytes. ``fh``: read from it (a stream,
    such as an object's body, with its ``size``), at its start."""
    if fh is None:
        with open(path, "rb") as own:
            return _header(path, own)
    if size is None:
        size = os.fstat(fh.fileno()).st_size
    n = header_length(path, fh.read(8), size)
    raw = fh.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: {len(raw)} header bytes read of {n} (the file shrank)")
    return parse_header(path, raw, size), 8 + n


def header_length(path: str | Path, head: bytes, size: int) -> int:
    """The JSON header's length from a file's first 8 bytes, checked to fit its ``size``."""
    if len(head) < 8:
        raise ValueError(f"{path}: {size} bytes, not a safetensors file (no 8-byte header length)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or 8 + n > size:
        raise ValueError(f"{path}: header length {n} does not fit the file's {size} bytes")
    return n


def _unique(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose every name is given once: of two entries of one name, readers differ on
    which one counts (another reader's tensor would not be the one sealed and checked here)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"{sorted(k for k in out if sum(p[0] == k for p in pairs) > 1)} given twice")
    return out


def parse_header(path: str | Path, raw: bytes, size: int) -> dict:
    """The JSON header ``raw`` of a file of ``size`` bytes, every entry checked (see ``_header``)."""
    n = len(raw)
    try:
        header = json.loads(raw, object_pairs_hook=_unique)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise ValueError(f"{path}: __metadata__ is not an object of strings")
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{path}: header entry {name!r} is a JSON {type(info).__name__}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one of {', '.join(_DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r} outside its {data_len} data bytes")
        if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(f"{path}: tensor {name!r} of shape {shape} {dtype} holds {offsets[1] - offsets[0]} bytes")
    return header


def _read_tensor(fh: BinaryIO, info: dict, offset: int) -> np.ndarray:
    start, end = info["data_offsets"]
    fh.seek(offset + start)
    data = fh.read(end - start)
    return np.frombuffer(data, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_safetensors(path: str | Path, names: tuple[str, ...] | None = None, *, fh: BinaryIO | None = None
                     ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """``{name: (dtype, array)}`` (only ``names`` when given) and the metadata; BF16 and F8_E4M3
    arrays come as their bit patterns (uint16, uint8). ``fh``: read from this open file (``path``
    then only names it in errors). A malformed file raises ``ValueError`` (``_header``). Nothing is
    checked against a seal: a stored file's readers take :func:`read_checked`."""
    if fh is None:
        with open(path, "rb") as own:
            return read_safetensors(path, names, fh=own)
    header, offset = _header(path, fh)
    meta = header.pop("__metadata__", None) or {}
    return {name: (info["dtype"], _read_tensor(fh, info, offset)) for name, info in header.items()
            if names is None or name in names}, meta


class Read(NamedTuple):
    """One pass over a safetensors file: its checked header (``__metadata__`` included), where its
    data starts, the tensors asked for (taken from the very bytes hashed), and the sha256 of its
    data section with that section's length."""

    header: dict
    offset: int
    tensors: dict[str, tuple[str, np.ndarray]]
    data: hashlib._Hash
    data_len: int

    @property
    def meta(self) -> dict[str, str]:
        return self.header.get("__metadata__") or {}


_CHUNK = 8 << 20  # what a streamed read holds at once


def read_through(path: str | Path, fh: BinaryIO, size: int | None = None, names: tuple[str, ...] | None = None) -> Read:
    """Read a file once from its start (or a stream of ``size`` bytes, such as an object's body):
    every tensor (``names`` None: the whole data section is held, the arrays are views of it), or
    only those of ``names``, copied out of the pieces as they are hashed. A malformed file, or one
    that shrank while read, raises ``ValueError`` naming it."""
    if size is None:
        size = os.fstat(fh.fileno()).st_size
    header, offset = _header(path, fh, size)
    data_len = size - offset
    entries = {n: i for n, i in header.items() if n != "__metadata__" and (names is None or n in names)}
    h = hashlib.sha256()
    if names is None:
        data = fh.read(data_len)
        if len(data) != data_len:
            raise ValueError(f"{path}: {len(data)} data bytes read of {data_len} (the file shrank)")
        h.update(data)
        return Read(header, offset, {n: (i["dtype"], np.frombuffer(data, dtype=_DTYPES[i["dtype"]],
                                                                   count=math.prod(i["shape"]),
                                                                   offset=i["data_offsets"][0]).reshape(i["shape"]))
                                     for n, i in entries.items()}, h, data_len)
    parts = {n: bytearray(i["data_offsets"][1] - i["data_offsets"][0]) for n, i in entries.items()}
    pos = 0
    while pos < data_len:
        chunk = fh.read(min(_CHUNK, data_len - pos))
        if not chunk:
            raise ValueError(f"{path}: {pos} data bytes read of {data_len} (the file shrank)")
        h.update(chunk)
        for n, i in entries.items():
            a, b = i["data_offsets"]
            lo, hi = max(a, pos), min(b, pos + len(chunk))
            if lo < hi:
                parts[n][lo - a:hi - a] = chunk[lo - pos:hi - pos]
        pos += len(chunk)
    return Read(header, offset, {n: (i["dtype"], np.frombuffer(parts[n], dtype=_DTYPES[i["dtype"]]).reshape(i["shape"]))
                                 for n, i in entries.items()}, h, data_len)


# The stored file's seal (README, "Hidden states"), written into its metadata by the capture worker
# over the bytes it checked and the header it wrote: see ``file_seal``.
SEAL_KEY = "seal_sha256"
SEAL = 1  # the seal format of the versions made now (``CaptureManifest.seal``): their files must carry it
# Versions made before the seal (``CaptureManifest.seal`` 0): the sha256 of the data section alone.
DIGEST_KEY = "tensors_sha256"


def file_seal(header: dict, data: hashlib._Hash, data_len: int) -> str:
    """The seal of a file: sha256 over its data section, then its header less the seal itself (as
    canonical JSON: every tensor's dtype, shape and offsets, and the metadata, spans and all), then
    the data's length. Whatever gives the bytes their meaning is in it, so an engine that rewrites a
    loss mask or points ``token_ids`` elsewhere breaks it as surely as one that writes into the
    states. ``data``: the data section's sha256 (copied, not changed), so the worker seals with the
    hash it checked the file through, never reading the states a second time."""
    meta = {k: v for k, v in (header.get("__metadata__") or {}).items() if k != SEAL_KEY}
    h = data.copy()
    h.update(json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode())
    h.update(struct.pack("<Q", data_len))
    return h.hexdigest()


def check_seal(path: str | Path, r: Read, required: bool) -> bool:
    """Whether a stored file read through (``r``) is still the one sealed: True when its seal holds,
    False when it carries none and none is ``required`` (a version made before seals: not checked);
    ``ValueError`` naming the file when its seal is wrong, or missing where ``required`` (the
    version's files all carry one when stored, so it was removed). A version made before seals
    may hold files with the older digest of the data alone (:data:`DIGEST_KEY`), checked as such."""
    meta = r.meta
    again = "it is not the captured file; capture the unit again (remove the file, then draftfleet capture)"
    want = meta.get(SEAL_KEY)
    if want is not None:
        got = file_seal(r.header, r.data, r.data_len)
        if got != want:
            raise ValueError(f"{path}: changed after it was stored ({SEAL_KEY} {want[:16]}.. sealed, {got[:16]}.. "
                             f"now: its header or tensors are not the ones sealed): {again}")
        return True
    if required:
        raise ValueError(f"{path}: changed after it was stored (no {SEAL_KEY}, and every file of its capture "
                         f"version is sealed when stored: its seal was removed): {again}")
    old = meta.get(DIGEST_KEY)
    if old is None:
        return False
    if r.data.hexdigest() != old:
        raise ValueError(f"{path}: changed after it was stored (its tensors: {DIGEST_KEY} {old[:16]}.. sealed, "
                         f"{r.data.hexdigest()[:16]}.. now): {again}")
    return True


def read_checked(path: str | Path, required: bool, names: tuple[str, ...] = (), *, fh: BinaryIO | None = None,
                 size: int | None = None) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str], bool]:
    """A stored file's tensors of ``names``, its metadata, and whether it was sealed (``check_seal``),
    all from one open and one read: the ids and spans given out are the bytes checked, never read
    again where a write in between would go unseen. ``required``: the capture version's files must be
    sealed (``CaptureManifest.seal``). ``fh`` (and ``size``): read this stream instead, such as an
    object's body. ``ValueError`` naming the file when it is malformed or changed."""
    if fh is None:
        with open(path, "rb") as own:
            return read_checked(path, required, names, fh=own)
    r = read_through(path, fh, size, names)
    return r.tensors, r.meta, check_seal(path, r, required)


def rewrite_metadata(file: int | str | Path, metadata: dict[str, str], path: str | Path | None = None,
                     checked: Read | None = None) -> bytes | None:
    """Write the file's header again, in place, with ``metadata`` in the room the connector left
    there (its ``header_room`` entry) and the seal (:func:`file_seal`) over that header and the data,
    and fsync the file: the file's first bytes as written (length and header: what an upload must
    send), None when it has no room or the metadata does not fit (nothing written). The header keeps
    its length, so every tensor stays where it is. ``checked``: the file as the worker read and
    checked it (``read_through``): that header and data digest are the ones sealed, never read again,
    so a change an engine made since is written over (the header) or breaks the seal (the data);
    without it the file is read through now. ``file``: an open read-write descriptor (``path`` then
    only names it in errors), or a path, opened without following a link."""
    if not isinstance(file, int):
        fd = os.open(file, os.O_RDWR | os.O_NOFOLLOW)  # a link put in its place is refused
        try:
            return rewrite_metadata(fd, metadata, file, checked)
        finally:
            os.close(fd)
    if checked is None:
        with os.fdopen(os.dup(file), "rb") as fh:
            fh.seek(0)
            checked = read_through(path or "the file", fh, names=())
    old = checked.meta
    if ROOM_KEY not in old:
        return None
    kept = {k: v for k, v in old.items() if k not in (ROOM_KEY, SEAL_KEY, DIGEST_KEY)}
    header = {**checked.header, "__metadata__": {**kept, **metadata}}
    header["__metadata__"][SEAL_KEY] = file_seal(header, checked.data, checked.data_len)
    new = json.dumps(header, separators=(",", ":")).encode()
    n = checked.offset - 8
    if len(new) > n:
        return None
    head = struct.pack("<Q", n) + new + b" " * (n - len(new))
    if os.pwrite(file, head, 0) != len(head):
        raise OSError(f"{path}: short write of its header")
    os.fsync(file)
    return head


def encode_safetensors(tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str], *,
                       seal: bool = False) -> bytes:
    """The bytes of a safetensors file; each tensor given as (dtype name, contiguous array).
    ``seal``: with its seal in the metadata (:data:`SEAL_KEY`, :func:`file_seal`), as a stored file has it."""
    header: dict = {"__metadata__": dict(metadata)}
    chunks, pos = [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        chunks.append(data)
        pos += len(data)
    body = b"".join(chunks)
    if seal:
        header["__metadata__"][SEAL_KEY] = file_seal(header, hashlib.sha256(body), len(body))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + body


# -- the store ------------------------------------------------------------------------------
class StoredFile(NamedTuple):
    """One stored file of a version: its unit, the record turns it holds, tokens, bytes, mtime."""

    key: str
    turn: int
    path: str
    turns: int
    tokens: int
    bytes: int
    mtime: float


class Hidden:
    """What every kind of hidden store shares: totals from ``entries``. ``open_hidden`` gives the
    store's kind: files under the store's folder (:class:`HiddenStore`) or objects in its bucket
    (``hidden_bucket.BucketHidden``), with the same methods and the same layout."""

    local = True

    def entries(self, dataset: str, version: int) -> Iterator[StoredFile]:
        raise NotImplementedError

    def versions(self, dataset: str) -> list[int]:
        raise NotImplementedError

    def _manifest_bytes(self, dataset: str, version: int) -> bytes | None:
        raise NotImplementedError

    def manifest(self, dataset: str, version: int | None = None) -> CaptureManifest | None:
        """The manifest of ``version`` (default: the latest), None when nothing was captured."""
        if version is None:
            versions = self.versions(dataset)
            if not versions:
                return None
            version = versions[-1]
        data = self._manifest_bytes(dataset, version)
        return _manifest_decoder.decode(data) if data is not None else None

    def sealed(self, dataset: str, version: int) -> bool:
        """Whether every file of the version must carry a seal: it was made since files were sealed
        (its manifest's ``seal``); a missing or wrong seal is then a changed file, never "unsealed"."""
        m = self.manifest(dataset, version)
        return m is not None and m.seal > 0

    def usage(self, dataset: str, version: int) -> tuple[int, int, int]:
        """(files, tokens, bytes) of a version: sizes from the listing, tokens from each header."""
        u = self.turn_usage(dataset, version)
        return u[0], u[2], u[3]

    def turn_usage(self, dataset: str, version: int) -> tuple[int, int, int, int]:
        """(files, record turns they hold, tokens, bytes): a conversation's file holds all its turns."""
        files = turns = tokens = size = 0
        for e in self.entries(dataset, version):
            files, turns, tokens, size = files + 1, turns + e.turns, tokens + e.tokens, size + e.bytes
        return files, turns, tokens, size


def open_hidden(store: Store) -> Hidden:
    """The hidden states of ``store``, in its folder or in its bucket."""
    if store.local:
        return HiddenStore(store)
    from draftfleet.hidden_bucket import BucketHidden

    return BucketHidden(store)


def held_turns(header: dict, turn: int) -> int:
    """The record turns a stored file holds: a conversation's file all of its answers' spans."""
    return len(json.loads((header.get("__metadata__") or {})["spans"])) if turn == CONVERSATION else 1


class HiddenStore(Hidden):
    """The hidden-state files of a store in a folder, per dataset and capture version."""

    def __init__(self, store: Store):
        if not store.local:
            raise StoreError(f"{store.location} is a bucket: its hidden states are open_hidden's (hidden_bucket.py)")
        self.store = store
        self.root = store.root / HIDDEN_DIR

    @classmethod
    def at(cls, root: str | Path) -> HiddenStore:
        """The same layout under another folder (an export's local copy of a bucket's files)."""
        self = cls.__new__(cls)
        self.store, self.root = None, Path(root)
        return self

    def version_dir(self, dataset: str, version: int) -> Path:
        return self.root / check_name(dataset) / f"v{int(version)}"

    def path(self, dataset: str, version: int, key: str, turn: int) -> Path:
        check_key(key)
        return self.version_dir(dataset, version) / key[:2] / f"{key}.{turn_name(turn)}.safetensors"

    def has(self, dataset: str, version: int, key: str, turn: int) -> bool:
        return os.path.lexists(self.path(dataset, version, key, turn))

    def versions(self, dataset: str) -> list[int]:
        base = self.root / check_name(dataset)
        if not base.is_dir():
            return []
        return sorted(int(e.name[1:]) for e in os.scandir(base) if re.fullmatch(r"v\d+", e.name)
                      and os.path.isfile(os.path.join(e.path, MANIFEST)))

    def _manifest_bytes(self, dataset: str, version: int) -> bytes | None:
        p = self.version_dir(dataset, version) / MANIFEST
        return p.read_bytes() if p.exists() else None

    def write_manifest(self, m: CaptureManifest) -> None:
        # The first manifest of a version stays: settings never change under its files.
        write_once(self.version_dir(m.dataset, m.version) / MANIFEST, msgspec.json.format(msgspec.json.encode(m)))

    def put(self, dataset: str, version: int, key: str, turn: int, data: bytes) -> bool:
        """Write the unit's file once. True if this call stored it, False if it was there already."""
        return write_once(self.path(dataset, version, key, turn), data)

    def files(self, dataset: str, version: int) -> Iterator[tuple[str, int, str]]:
        """(key, turn, path) of every stored file of a version, unsorted (a conversation's turn: ``CONVERSATION``)."""
        base = self.version_dir(dataset, version)
        if not base.is_dir():
            return
        for shard in os.scandir(base):
            if shard.is_dir() and len(shard.name) == 2:
                for e in os.scandir(shard.path):
                    m = _FILE_RE.match(e.name)
                    if m:
                        turn = m.group(2)
                        yield m.group(1), CONVERSATION if turn == "conversation" else int(turn), e.path

    def verify(self, dataset: str, version: int) -> tuple[int, int, list[str]]:
        """Every stored file of a version read through its seal (``check_seal``): (files that are the
        ones sealed, files of a version made before seals that carry none, why each other one is bad)."""
        required = self.sealed(dataset, version)
        good = unsealed = 0
        bad: list[str] = []
        for _key, _turn, path in sorted(self.files(dataset, version), key=lambda f: f[2]):
            try:
                if read_checked(path, required)[2]:
                    good += 1
                else:
                    unsealed += 1
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as exc:
                bad.append(f"{path}: {exc.strerror or exc}")
            except ValueError as exc:  # it names the file
                bad.append(str(exc))
        return good, unsealed, bad

    def entries(self, dataset: str, version: int) -> Iterator[StoredFile]:
        """What each stored file of a version holds, from its header; vanished or unreadable ones skipped."""
        for key, turn, path in self.files(dataset, version):
            try:
                header, _offset = _header(Path(path))
                n = int(header["token_ids"]["shape"][0])
                held = held_turns(header, turn)
                st = os.stat(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            yield StoredFile(key=key, turn=turn, path=path, turns=held, tokens=n, bytes=st.st_size, mtime=st.st_mtime)
