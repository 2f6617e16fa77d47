"""Engine files in: found, read and checked by descriptor, then sealed and stored once.

What this module guarantees. The engine's answer is its word, not the truth: a file is read and
deleted only inside the capture storage folder (every link resolved, the folder then opened from
the storage folder one name at a time without following one); every step after the check (the
metadata rewrite with the seal over header and data, fsync, ``fchmod``, the link into the store or
the upload to a bucket, removing the engine's name) acts on the descriptors that were checked
(:class:`EngineFile`), never on the path again. Nothing is stored unless it holds exactly the ids
sent, from an engine whose contract (the connector's configuration, written into each file) is the
version's, at its layers, hidden size and dtype, with only finite values. A stored file crosses
the disk once: linked into a folder store, or uploaded once from its descriptor with
``If-None-Match: *`` to a bucket (``hidden/bucket.py``: 412, another worker stored the unit, is a lost
link). What killed workers leave in the engine's folder is swept (:func:`sweep_orphans`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from draftfleet.hidden import SCALES, Read, Spans, TargetModel, encode_safetensors, read_through, rewrite_metadata
from draftfleet.schemas.records import CaptureManifest, CaptureTask, EngineContract, turn_name
from draftfleet.store import StoreError, link_once
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.backends import Halt, Permanent, Transient
from draftfleet.workers.vllm import VLLMClient

log = logging.getLogger("draftfleet.capture")


CONNECTOR_CLASS = "DraftfleetHiddenStatesConnector"

CONNECTOR_MODULE = "draftfleet.workers.vllm_connector"

CONTRACT_KEY = "draftfleet_contract"  # the connector's metadata entry (vllm_connector.py)

_contract_decoder = msgspec.json.Decoder(EngineContract)

# An engine file this old whose lock nobody holds was left by a killed worker (a live one takes its
# file within moments of the answer): removed by the beat.
ORPHAN_S = float(os.environ.get("DRAFTFLEET_CAPTURE_ORPHAN_S", "600"))


class EngineFile:
    """One engine file as it was checked, and every step after the check acts on it: the storage
    folder's descriptor (opened from the capture storage folder one name at a time, no link
    followed), the file's own read-write descriptor, its name in that folder, and its identity
    (``st_dev``, ``st_ino``). The metadata rewrite, fsync, ``fchmod``, the link into the store and the
    removal of the engine's name never look the path up again: an engine that swaps the file, or a
    folder above it, after the check changes nothing of what is stored or deleted (issue 26)."""

    __slots__ = ("dir_fd", "fd", "name", "path", "identity")

    def __init__(self, dir_fd: int, fd: int, name: str, path: str):
        st = os.fstat(fd)
        self.dir_fd, self.fd, self.name, self.path, self.identity = dir_fd, fd, name, path, (st.st_dev, st.st_ino)

    def rewrite_metadata(self, meta: dict[str, str], checked: Read) -> bytes | None:
        return rewrite_metadata(self.fd, meta, self.path, checked)

    def link(self, final: Path) -> bool:
        """The checked file, read-only, at ``final`` in the store (write-once: False if taken)."""
        return link_once(self.fd, final)

    def named(self) -> bool:
        """Whether the engine's name still names the checked file."""
        try:
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def discard(self) -> None:
        """Remove the engine's name and its lock, within the checked folder and only while the name
        is still the checked file's (another file renamed onto it is left to the orphan sweep), then
        let go of both descriptors. Idempotent."""
        if self.fd < 0:
            return
        try:
            if self.named():
                _unlink(self.dir_fd, self.name)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            os.close(self.dir_fd)
            self.fd = self.dir_fd = -1


class Captured(NamedTuple):
    """One engine file: its ids, the states' dtype (the manifest's name) and bits, fp8's scales, the
    connector's contract, the file as read (its header and the digest of its data: what is sealed)
    and the file held."""

    path: str  # as the engine named it (messages only: every step acts on ``file``)
    ids: np.ndarray  # int64 [T]
    dtype: str
    states: np.ndarray  # bf16 bits uint16 or float8_e4m3fn bits uint8, [T, L, H]
    scales: tuple[str, np.ndarray] | None  # (safetensors dtype, array) of hidden_states_scales
    contract: EngineContract | None  # None: not written by the fleet's connector
    checked: Read | None = None  # the header and data digest the arrays were read with (hidden.read_through)
    file: EngineFile | None = None

    def discard(self) -> None:
        if self.file is not None:
            self.file.discard()

_FILE_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}


class CaptureClient(VLLMClient):
    """A vLLM capture server: ids in, the path of their hidden states out, then the file read.

    ``storage`` is the folder the engine's connector writes in (its ``shared_storage_path``): the
    path an answer names is the engine's word, so only a file inside it is read or deleted. At most
    ``inflight`` requests are open at once, whatever the number of threads calling."""

    def __init__(self, url: str, settings, tokenizer: TargetTokenizer, *, inflight: int, storage: str | Path):
        super().__init__(url, settings, tokenizer, inflight=inflight)
        self.storage = Path(storage)
        self.slots = threading.BoundedSemaphore(inflight)

    def capture(self, ids: list[int]) -> Captured:
        """The engine's file for exactly ``ids``, read and held open (``Captured.file``); deleted (with
        its ``.lock``) if that fails, else the caller's to store and then :meth:`Captured.discard`."""
        body: dict = {"prompt": ids, "max_tokens": 1, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        with self.slots:
            out = self.post("/v1/completions", body)
        params = out.get("kv_transfer_params") if isinstance(out, dict) else None
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(path, str):
            raise Halt("no_hidden_states", f"{self.endpoint} returned no hidden_states_path: start it with the "
                       "capture flags (draftfleet worker capture --gpu, or README 'Hidden states')")
        root, folder, name = _inside(path, self.storage)
        try:
            dir_fd = _open_inside(root, folder)
        except OSError as exc:
            raise Halt("hidden_states_path", f"{folder} changed while it was opened ({exc.strerror or exc}): "
                       "refused, nothing read or deleted") from None
        return _read_engine_file(dir_fd, name, os.path.join(folder, name))


def _open_inside(root: str, folder: str) -> int:
    """A descriptor of ``folder`` (a real path inside ``root``), opened from ``root`` one name at a
    time without following a link: a folder swapped for a link since it was resolved is refused."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in Path(os.path.relpath(folder, root)).parts if folder != root else ():
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink(dir_fd: int, name: str) -> None:
    for n in (name, name + ".lock"):
        try:
            os.unlink(n, dir_fd=dir_fd)  # never follows a link: removes the entry, in this folder
        except OSError:
            pass


def _inside(path: str, storage: Path) -> tuple[str, str, str]:
    """(real storage folder, real folder, file name) of an engine's file, refused (Halt, nothing
    touched) unless it lies in ``storage`` once every link is resolved: an answer naming
    ``/home/me/.ssh/id_ed25519`` or a link out of the folder would otherwise have the worker read
    and delete it."""
    root = os.path.realpath(storage)
    real = os.path.realpath(path) if os.path.isabs(path) else root
    if real == root or os.path.commonpath([root, real]) != root:
        raise Halt("hidden_states_path", f"the engine named {path!r}, not a file inside the capture storage folder "
                   f"{root} ([capture] storage_path): refused, nothing read or deleted; start the engine with "
                   "that folder as its shared_storage_path")
    return root, os.path.dirname(real), os.path.basename(real)


def _read_engine_file(dir_fd: int, name: str, path: str) -> Captured:
    """Wait for the connector to finish the file, open it in ``dir_fd`` (which the result then
    holds) and read it. Every malformed file is a ``Transient`` naming it (retried, then the unit's
    failure); on any failure the file's name is removed and ``dir_fd`` closed.

    The connector creates ``<name>.lock`` holding ``LOCK_EX`` when the request is scheduled, before
    the answer names the path, and lets go once the file is renamed into place (or when its
    process dies): a blocking ``LOCK_SH`` sleeps exactly until then, no polling."""
    held: EngineFile | None = None
    try:
        try:
            lock = os.open(name + ".lock", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # a connector without the lock: the file is whole (renamed into place) or absent
        except OSError as exc:
            raise Transient("hidden_states_unreadable", f"{path}.lock: {exc.strerror}") from None
        else:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH)
            finally:
                os.close(lock)
        try:  # no link followed; O_NONBLOCK: a FIFO put there does not hang the open
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            raise Transient("hidden_states_missing", f"the engine let go of {path}.lock without writing the file "
                            "(its log says why: a full disk, a write error)") from None
        except PermissionError as exc:
            raise not_ours(path, exc) from None
        except OSError as exc:
            raise Transient("hidden_states_unreadable", f"{path}: {exc.strerror}") from None
        held = EngineFile(dir_fd, fd, name, path)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Transient("hidden_states_unreadable", f"{path}: not a regular file")
        try:
            with os.fdopen(os.dup(fd), "rb") as fh:
                checked = read_through(path, fh)
            tensors, meta = checked.tensors, checked.meta
        except OSError as exc:
            raise Transient("hidden_states_unreadable", f"{path}: {exc.strerror}") from None
        except ValueError as exc:  # it names the file
            raise Transient("hidden_states_unreadable", str(exc)) from None
        ids, states, scales = tensors.get("token_ids"), tensors.get("hidden_states"), tensors.get(SCALES)
        if ids is None or states is None or states[0] not in _FILE_DTYPES or ids[0] not in ("I64", "I32") \
                or states[1].ndim != 3 or ids[1].ndim != 1:
            raise Transient("hidden_states_unreadable", f"{path}: expected token_ids [T] and bf16 or fp8 "
                            "hidden_states [T, L, H]")
        return Captured(path, ids[1].astype(np.int64), _FILE_DTYPES[states[0]], states[1],
                        None if scales is None else (scales[0], scales[1]), _contract(meta, path), checked, held)
    except BaseException:
        if held is not None:
            held.discard()
        else:
            _unlink(dir_fd, name)
            os.close(dir_fd)
        raise


def not_ours(path: str, exc: OSError) -> Permanent:
    """The engine's file cannot be made the store's (written, made read-only): the engine runs as
    another user. Every unit would meet it, so it is a failure, never a retry (issue 26)."""
    return Permanent("hidden_states_not_ours", f"{path}: {exc.strerror or exc}: the engine's files are not this "
                     f"worker's (uid {os.geteuid()}) to seal and make read-only; run the engine as the worker's "
                     "user (or the worker as the engine's)")


def _contract(meta: dict[str, str], path: str) -> EngineContract | None:
    raw = meta.get(CONTRACT_KEY)
    if raw is None:
        return None
    try:
        return _contract_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise Transient("hidden_states_unreadable", f"{path}: its {CONTRACT_KEY} metadata: {exc}") from None


def wanted_contract(m: CaptureManifest | None = None, *, model: TargetModel | None = None,
                    layer_ids: list[int] | None = None, dtype: str = "bfloat16") -> EngineContract:
    """The contract a capture version's files must carry (or this worker's settings, at start)."""
    if m is not None:
        return EngineContract(layer_ids=m.layer_ids, hidden_size=m.hidden_size, num_layers=m.num_layers, dtype=m.dtype,
                              model=m.model, model_config_sha256=m.model_config_sha256)
    assert model is not None and layer_ids is not None
    return EngineContract(layer_ids=layer_ids, hidden_size=model.hidden_size, num_layers=model.num_layers,
                          dtype=dtype, model=model.path, model_config_sha256=model.config_sha256)


def _describe(c: EngineContract) -> str:
    return (f"layers {c.layer_ids} (hidden {c.hidden_size}, {c.num_layers} layers, {c.dtype}, model config "
            f"{c.model_config_sha256[:12] or 'unknown'})")


def check_contract(got: EngineContract | None, want: EngineContract, path: str, wanted_by: str) -> None:
    """Refuse (Halt: the engine's fault, the unit stays queued) a file whose engine was configured
    otherwise than ``want`` (the model's path may differ between hosts; its config's hash may not)."""
    if got is None:
        raise Halt("engine_contract", f"{path} carries no {CONTRACT_KEY}: the engine does not run the fleet's "
                   f"connector ({CONNECTOR_MODULE} from draftfleet worker capture --print-engine-command)")
    if (got.layer_ids, got.hidden_size, got.num_layers, got.dtype, got.model_config_sha256) != \
            (want.layer_ids, want.hidden_size, want.num_layers, want.dtype, want.model_config_sha256):
        raise Halt("engine_contract", f"the engine computed {_describe(got)}, {wanted_by} wants {_describe(want)}: "
                   "nothing stored; start the engine with the version's layers and model")


def check_states(ids: list[int], got: Captured, m: CaptureManifest) -> None:
    """Refuse anything but the states of exactly ``ids`` from an engine configured as the version
    (its contract) at the version's layers and dtype; no inf/NaN."""
    check_contract(got.contract, wanted_contract(m), got.path, f"{m.dataset} v{m.version}")
    got_ids = got.ids.tolist()
    if got_ids != ids:
        first = next((i for i, (a, b) in enumerate(zip(got_ids, ids)) if a != b), min(len(got_ids), len(ids)))
        raise Transient("hidden_states_ids", f"{got.path} holds {len(got_ids)} ids that differ from the {len(ids)} "
                        f"sent (first at position {first})")
    want = (len(ids), len(m.layer_ids), m.hidden_size)
    if got.states.shape != want:
        raise Halt("hidden_states_shape", f"captured states of shape {got.states.shape}, the version wants {want} "
                   f"(layers {m.layer_ids}, hidden {m.hidden_size}): is the server started with these layers?")
    if got.dtype != m.dtype:
        raise Halt("hidden_states_dtype", f"the engine wrote {got.dtype} states, the version holds {m.dtype}: "
                   "start the server with the version's dtype ([capture] dtype)")
    if m.dtype == "float8_e4m3fn":
        if got.scales is None or got.scales[0] != "F32" or got.scales[1].shape != (len(ids), 1, 1):
            raise Halt("hidden_states_scales", f"fp8 states need {SCALES} float32 [{len(ids)}, 1, 1]")
        if ((got.states & 0x7F) == 0x7F).any() or not (np.isfinite(got.scales[1]) & (got.scales[1] > 0)).all():
            raise Permanent("hidden_states_not_finite", "the captured states hold NaN or a bad scale")
    elif ((got.states & 0x7F80) == 0x7F80).any():  # bf16 exponent all ones: inf or NaN
        raise Permanent("hidden_states_not_finite", "the captured states hold inf or NaN")


def sweep_orphans(folder: Path, age_s: float) -> int:
    """Remove what killed workers left in the engine's folder: files already linked into the store
    (a second name), and files, locks and partial writes ``age_s`` old whose lock nobody holds.

    The connector's names (``vllm_connector.py``): ``<x>.safetensors``, its lock ``<x>.safetensors.lock``
    (held ``LOCK_EX`` from the request's scheduling until the file is whole) and, while it writes,
    ``<x>.safetensors.<pid>.partial`` under that same lock. Everything acts in the folder's descriptor."""
    removed = 0
    now = time.time()
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return 0
    try:
        for e in list(os.scandir(dir_fd)):
            lock = _lock_name(e.name)
            if lock is None or not e.is_file(follow_symlinks=False):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if e.name.endswith(".safetensors") and st.st_nlink > 1:
                    os.unlink(e.name, dir_fd=dir_fd)  # stored: the store keeps its own name
                    removed += 1
                    continue
                if now - st.st_mtime < age_s or _held(dir_fd, lock):
                    continue
                os.unlink(e.name, dir_fd=dir_fd)
                removed += 1
            except OSError:  # gone meanwhile
                continue
    finally:
        os.close(dir_fd)
    return removed

_PARTIAL = re.compile(r"^(.+\.safetensors)\.\d+\.partial$")


def _lock_name(name: str) -> str | None:
    """The lock a connector's entry is written under; None for anything else."""
    if name.endswith(".safetensors.lock"):
        return name
    if name.endswith(".safetensors"):
        return name + ".lock"
    m = _PARTIAL.match(name)
    return m.group(1) + ".lock" if m else None


def _held(dir_fd: int, lock: str) -> bool:
    """Whether a live writer holds ``lock`` (a missing lock: nobody)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def unit_metadata(task: CaptureTask, m: CaptureManifest, spans: Spans, contract: EngineContract) -> dict[str, str]:
    """What a stored file's header says of its unit (written into the connector's room): whose it is,
    the answers' spans (the trainers' loss mask) and the engine's contract."""
    return {"dataset": task.dataset, "key": task.key, "turn": turn_name(task.turn), "prompt_len": str(spans[0][0]),
            "spans": json.dumps([list(sp) for sp in spans], separators=(",", ":")), "version": str(task.version),
            "layer_ids": ",".join(map(str, m.layer_ids)), "model": m.model,
            CONTRACT_KEY: msgspec.json.encode(contract).decode()}


class UnitStore:
    """Where a checked engine file goes: the capture version's folder (linked) or bucket (uploaded),
    once, sealed, acting only on the descriptors that were checked (``EngineFile``)."""

    def __init__(self, hidden, *, copy: bool, store_location: str):
        self.hidden = hidden
        self.copy = copy  # [capture] copy: write a file on another file system a second time
        self.store_location = store_location
        self.warned_copy = False

    def store(self, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
        """Give the checked engine file its name in the store, with ``meta`` and the seal over the header
        and the bytes checked in its header; False if the unit is there already. The bytes are written
        again only where they cannot be linked: a file without header room (a server started without
        the fleet's ``header_room``), one whose names are all gone (a file renamed over it), or, with
        ``[capture] copy``, on another file system; then what was checked (in memory) is what is written."""
        assert got.file is not None
        if not self.hidden.local:
            return self._upload(task, got, meta)
        final = self.hidden.path(task.dataset, task.version, task.key, task.turn)
        try:
            if got.file.rewrite_metadata(meta, got.checked):
                try:
                    return got.file.link(final)
                except PermissionError as exc:  # fchmod: the file is another user's
                    raise not_ours(got.path, exc) from None
                except FileNotFoundError:  # its every name removed or replaced since the check: written from memory
                    log.warning("%s lost its name after it was checked: the states checked are written to the store",
                                got.path)
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise StoreError(f"cannot link {got.path} to {final}: {exc.strerror or exc}") from exc
                    if not self.copy:
                        raise Halt("hidden_states_other_fs", f"{got.path} is on another file system than the store "
                                   f"{self.store_location}: set [capture] storage_path on the store's, or [capture] "
                                   "copy = true to write every file twice") from None
            else:
                self._warn_no_room(got, meta)
        except PermissionError as exc:  # the header rewrite: the file is another user's
            raise not_ours(got.path, exc) from None
        return self._put_checked(task, got, meta)

    def _upload(self, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
        """A store in a bucket: the checked file, its header sealed in place, uploaded once from the
        checked descriptor, its header compared on the way with the one just written and its data hashed
        against the digest checked; False when another worker had stored the unit (412). A file an
        engine wrote into after the check is not stored: ``Transient``, the attempt's failure. The
        caller removes the engine's name either way (``Captured.discard``)."""
        assert got.file is not None
        try:
            head = got.file.rewrite_metadata(meta, got.checked)
        except PermissionError as exc:  # the header rewrite: the file is another user's
            raise not_ours(got.path, exc) from None
        if head:
            try:
                return self.hidden.upload(task.dataset, task.version, task.key, task.turn, got.file.fd,
                                          digest=got.checked.data.hexdigest(), head=head)
            except OSError as exc:  # the engine's file, not the bucket: this attempt's failure, counted
                raise Transient("hidden_states_changed", f"{got.path}: {exc.strerror or exc}") from None
        self._warn_no_room(got, meta)
        return self._put_checked(task, got, meta)

    def _warn_no_room(self, got: Captured, meta: dict[str, str]) -> None:
        if not self.warned_copy:
            self.warned_copy = True
            log.warning("%s has no header room, or too little for the unit's metadata (%d bytes): such files are "
                        "written again into the store (start the server with the fleet's connector flags, README "
                        "'Hidden states')", got.path, len(json.dumps(meta)))

    def _put_checked(self, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
        """Store what was checked (in memory), sealed, as the unit's file, once."""
        tensors = {"token_ids": ("I64", got.ids),
                   "hidden_states": ("BF16" if got.dtype == "bfloat16" else "F8_E4M3", got.states)}
        if got.scales is not None:
            tensors[SCALES] = got.scales
        return self.hidden.put(task.dataset, task.version, task.key, task.turn,
                               encode_safetensors(tensors, meta, seal=True))
