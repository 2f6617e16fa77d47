"""The hidden-state file: safetensors written and read with numpy, and the seal over what gives it meaning.

safetensors is written and read here with numpy: numpy has no bfloat16, so bf16 tensors travel
as their uint16 bit patterns (the file format is the same: 8-byte header length, JSON header,
little-endian data). The seal (:func:`file_seal`) covers the data and the header without its own
field: a file of a version made with seals that lacks a good one is changed, and bad to every
reader (:func:`check_seal`); a reader checks the bytes it reads, in one open (:func:`read_checked`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np



_DTYPES = {"BF16": np.uint16, "F8_E4M3": np.uint8, "I64": np.int64, "F32": np.float32, "I32": np.int32,
           "F16": np.float16}

DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # [capture] dtype -> the manifest's (torch's name)

SCALES = "hidden_states_scales"  # hs-connectors' name of the fp8 files' per-token scales

ROOM_KEY = "header_room"  # the connector's metadata entry of spaces the worker writes the unit's metadata over

HEADER_ROOM = 4096  # bytes of it: the unit's metadata takes ~300, plus ~14 a turn of a conversation's spans


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


def checked_header(path: str | Path, fh: BinaryIO | None = None, size: int | None = None) -> tuple[dict, int]:
    """The checked header of a safetensors file (tensor entries and ``__metadata__``) and where
    its data starts. Anything malformed (short, a header that is not JSON or not objects, an
    unknown dtype, a shape or offsets that do not fit the file) raises ``ValueError`` naming the
    file and the part: an engine or a disk can hand over any bytes. ``fh``: read from it (a stream,
    such as an object's body, with its ``size``), at its start."""
    if fh is None:
        with open(path, "rb") as own:
            return checked_header(path, own)
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
    """The JSON header ``raw`` of a file of ``size`` bytes, every entry checked (see ``checked_header``)."""
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


def read_tensor(fh: BinaryIO, info: dict, offset: int) -> np.ndarray:
    start, end = info["data_offsets"]
    fh.seek(offset + start)
    data = fh.read(end - start)
    return np.frombuffer(data, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_safetensors(path: str | Path, names: tuple[str, ...] | None = None, *, fh: BinaryIO | None = None
                     ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """``{name: (dtype, array)}`` (only ``names`` when given) and the metadata; BF16 and F8_E4M3
    arrays come as their bit patterns (uint16, uint8). ``fh``: read from this open file (``path``
    then only names it in errors). A malformed file raises ``ValueError`` (``checked_header``). Nothing is
    checked against a seal: a stored file's readers take :func:`read_checked`."""
    if fh is None:
        with open(path, "rb") as own:
            return read_safetensors(path, names, fh=own)
    header, offset = checked_header(path, fh)
    meta = header.pop("__metadata__", None) or {}
    return {name: (info["dtype"], read_tensor(fh, info, offset)) for name, info in header.items()
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
    header, offset = checked_header(path, fh, size)
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
