"""The capture task: a stored record turn's exact ids through vLLM's hidden-state extraction, stored once.

``draftfleet capture`` queues one :class:`CaptureTask` per (record key, turn) that has no file in
the dataset's capture version (or per conversation, captured once over its last turn, where its
turns' ids prefix each other: ``hidden.conversation_spans``, checked again here from the record); ``draftfleet worker capture`` runs them against a vLLM server
started with ``extract_hidden_states`` and the fleet's connector (``vllm_connector.py``). The
prompt sent is the turn's stored prompt ids followed by its output ids, never text, with
``max_tokens`` 1: vLLM's prefill computes the state of every one of those tokens, and the
connector writes them (the one generated token is thrown away), in the version's dtype (bf16,
or fp8 with a scale per token, quantized by the connector). The worker checks the file holds
exactly the ids sent, the version's layers, hidden size and dtype, and only finite values, then
stores it without writing it again: the unit's metadata goes into the room the connector left in
the file's header (in place, fsync'd), and the file is linked to its name in the store (``link``
fails if the name is taken: write-once), then the engine's name is removed. So the states cross
the disk once; the connector's storage path must be on the store's file system (checked at start)
unless ``[capture] copy = true``, which writes each file a second time. With a store in a bucket
the engine writes on local disk as ever; the checked file, sealed in place the same way, is
uploaded once from its descriptor with ``If-None-Match: *`` (``hidden_bucket.py``: 412, another
worker stored the unit, is a lost link) and its local name removed, whether it won or lost, so
the states cross the network once and nothing stays on local disk.

The engine is never kept waiting for the worker: ``inflight`` requests are open at once (a
semaphore around the request only), and twice as many threads run units, so that reading the
record, rendering its prompt, checking, linking and counting one unit overlaps the engine's work
on the others. The worker waits for each file on the connector's lock (``flock``: the kernel wakes
it when the writer lets go), not by polling.

The engine's answer is its word, not the truth: the worker reads and deletes only a file inside
its storage folder (every link resolved, the folder then opened from the storage folder without
following one), and every step after the check (the metadata rewrite, fsync, ``fchmod``, the link
into the store, removing the engine's name) acts on the descriptors that were checked
(:class:`EngineFile`), never on the path again; it stores nothing whose
contract (the connector's configuration, written into each file) differs from the version's; it
refuses to start on an engine whose first file carries no contract or another one.

Delivery is at-least-once, like generation: a message is acknowledged after the file is stored
(or the unit is recorded as failed); a redelivered copy finds the file and stops. While a unit is
captured its worker holds the unit's claim in Redis (``SET NX`` with a TTL its report loop keeps
refreshing); a copy that finds the claim taken is acknowledged, since the holder's own message
comes back if the holder dies. A worker killed mid-run leaves its unit without a file, never with
a half one, and its claims lapse: any live worker's recovery sweep (``recovery.py``, the same as
generation's) gives its messages back to the queue; the next ``draftfleet capture`` would too.
The engine file of a killed worker's unit is removed by a live worker's beat once it is linked
into the store (a second name of a stored file) or ``ORPHAN_S`` old.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np
import redis
from celery import Celery
from celery.exceptions import Reject

from draftfleet import redis_keys as rk
from draftfleet.claims import Claims
from draftfleet.hidden import (CONVERSATION, DTYPES, HEADER_ROOM, SCALES, CaptureError, Read, Spans, TargetModel,
                               capture_settings, check_storage, conversation_spans, encode_safetensors, open_hidden,
                               read_through, record_units, rewrite_metadata, storage_path)
from draftfleet.schemas.config import FleetConfig, VLLMLaunch
from draftfleet.schemas.records import (CaptureManifest, CaptureTask, EngineContract, ResponseRecord, WorkerReport,
                                       turn_name)
from draftfleet.store import Store, StoreError, check_key, check_name, link_once, make_dirs, open_store
from draftfleet.tokenizer import TargetTokenizer
from draftfleet.workers.backends import Halt, Permanent, Transient, backoff_s
from draftfleet.workers.consumer import dead_letter
from draftfleet.workers.vllm import VLLMClient

log = logging.getLogger("draftfleet.capture")

CONNECTOR_CLASS = "DraftfleetHiddenStatesConnector"
CONNECTOR_MODULE = "draftfleet.workers.vllm_connector"
CONTRACT_KEY = "draftfleet_contract"  # the connector's metadata entry (vllm_connector.py)
_contract_decoder = msgspec.json.Decoder(EngineContract)
INFRA_RETRY_S = 5.0
# An engine file this old whose lock nobody holds was left by a killed worker (a live one takes its
# file within moments of the answer): removed by the beat.
ORPHAN_S = float(os.environ.get("DRAFTFLEET_CAPTURE_ORPHAN_S", "600"))


def engine_args(layer_ids: list[int], storage_path: str, dtype: str = "bf16") -> list[str]:
    """The ``vllm serve`` flags of a capture server: the extraction method asked for the layer
    ids, and the fleet's connector writing under ``storage_path`` in ``dtype`` (``bf16``, ``fp8``)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": storage_path, "dtype": dtype,
                                        "header_room": HEADER_ROOM}}
    # No prefix caching: every state of a request is computed for it, none taken from an earlier one.
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv), "--no-enable-prefix-caching"]


def connector_folder(parent: str | None = None) -> str:
    """A folder of this user's alone to put first on the engine's ``PYTHONPATH``: it holds only
    ``draftfleet/workers/vllm_connector.py`` (a copy of this installation's) and two empty
    ``__init__.py``, so the engine imports the connector and nothing else of the fleet (its own
    environment lacks the fleet's dependencies; the fleet's site-packages must not shadow its own).

    Never the data folder: whatever lies in a ``PYTHONPATH`` folder (a ``sitecustomize.py``) runs
    in the engine. It is made fresh (``mkdtemp``: mode 0700, a new name, in ``parent`` or the temp
    folder) for each launch; the worker that made it removes it when it stops (``remove_connector_folder``)."""
    from draftfleet.tokenizer import check_code_folder

    folder = tempfile.mkdtemp(prefix="draftfleet-connector-", dir=parent)
    try:
        package = Path(folder) / "draftfleet" / "workers"
        for d in (package.parent, package):
            d.mkdir(mode=0o700)  # no umask takes anything from 0700
        for init in (package.parent / "__init__.py", package / "__init__.py"):
            _write_private(init, b'"""Only the connector module of the fleet, for the engine."""\n')
        _write_private(package / "vllm_connector.py", Path(__file__).with_name("vllm_connector.py").read_bytes())
        check_code_folder(folder, "the capture engine imports the connector from it")
    except BaseException:
        remove_connector_folder(folder)
        raise
    return folder


def lasting_connector_folder() -> str:
    """The connector folder for a server started by hand (``--print-engine-command``): one per user
    and connector code, ``<cache>/draftfleet/connector-<sha256 of the module, 16>`` (``$XDG_CACHE_HOME``
    or ``~/.cache``), made once (``connector_folder`` beside it, renamed into place whole) and the
    same for every later print, so printing the command leaves nothing new behind and the command
    printed keeps working while its server runs. A folder there that is not exactly that (changed,
    or another account's) is refused by ``check_code_folder`` or made again."""
    from draftfleet.tokenizer import check_code_folder

    code = Path(__file__).with_name("vllm_connector.py").read_bytes()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftfleet"
    final = base / f"connector-{hashlib.sha256(code).hexdigest()[:16]}"
    module = final / "draftfleet" / "workers" / "vllm_connector.py"
    if final.is_dir() and not final.is_symlink():
        check_code_folder(str(final), "the capture engine imports the connector from it")
        if module.is_file() and module.read_bytes() == code:
            return str(final)
        remove_connector_folder(str(final))  # not what this installation writes: made again
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = connector_folder(str(base))
    try:
        os.rename(made, final)
    except OSError:  # another print made it meanwhile
        remove_connector_folder(made)
        return lasting_connector_folder()
    return str(final)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def remove_connector_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def capture_server(launch: VLLMLaunch, gpus: list[int], port: int, layer_ids: list[int], storage_path: str,
                   connector: str, env: dict[str, str] | None = None, log_path: str | Path | None = None,
                   dtype: str = "bf16"):
    """The fleet's launcher (``EngineServer``) for a vLLM capture server (not started); ``connector``
    is a ``connector_folder()``."""
    from draftfleet.workers.launcher import EngineServer

    make_dirs(Path(storage_path))
    env = dict(env or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (connector, env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")) if p)
    launch = msgspec.structs.replace(launch, extra_args=[*launch.extra_args, *engine_args(layer_ids, storage_path, dtype)])
    return EngineServer(launch, gpus, port=port, log_path=log_path, env=env)


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
            raise _not_ours(path, exc) from None
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


def _not_ours(path: str, exc: OSError) -> Permanent:
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


# An engine configured otherwise than the version (check_contract, check_states): every unit meets it.
_SETTINGS_HALTS = frozenset({"engine_contract", "hidden_states_shape", "hidden_states_dtype", "hidden_states_scales"})
SETTINGS_PAUSE_MAX_S = 60.0


class EngineGate:
    """The worker's pause while its engine's files carry other settings than the version's (an engine
    restarted by hand with other layers): the units go back to their queue, and instead of every
    thread asking the engine again at once, one unit tries it after ``INFRA_RETRY_S``, then after
    twice as long each time it is still wrong, up to ``SETTINGS_PAUSE_MAX_S``; the others wait. The
    log says so once, and once more when the engine is right again."""

    def __init__(self):
        self._cond = threading.Condition()
        self._delay = 0.0  # 0: open
        self._until = 0.0
        self._probing = False

    def enter(self) -> bool:
        """Wait until this thread may ask the engine; True when it asks as the paused worker's probe."""
        with self._cond:
            while self._delay:
                wait = self._until - time.monotonic()
                if wait <= 0 and not self._probing:
                    self._probing = True
                    return True
                self._cond.wait(wait if wait > 0 else None)
            return False

    def wrong(self, probe: bool, why: Halt) -> None:
        """The engine's file carried other settings: pause (a probe's failure doubles the pause; a
        request already under way when the pause began changes nothing)."""
        with self._cond:
            first = not self._delay
            if first or probe:
                self._delay = INFRA_RETRY_S if first else min(SETTINGS_PAUSE_MAX_S, 2 * self._delay)
                self._until = time.monotonic() + self._delay
            if probe:
                self._probing = False
            self._cond.notify_all()
        if first:
            log.error("%s; the unit goes back to its queue and this worker pauses its captures: one unit asks the "
                      "engine again in %.0fs, then after twice as long each time, up to %.0fs (said once; the "
                      "units stay queued, none fails)", why, INFRA_RETRY_S, SETTINGS_PAUSE_MAX_S)

    def done(self, probe: bool, right: bool) -> None:
        """An attempt ended otherwise; ``right``: its file carried the version's settings."""
        with self._cond:
            if right and self._delay:
                self._delay = 0.0
                log.warning("the engine's files carry the version's settings again: captures resume")
            if probe:
                self._probing = False
            self._cond.notify_all()


class CaptureRuntime:
    """Per-process state of a capture worker."""

    def __init__(self, cfg: FleetConfig, store: Store, r: redis.Redis, client: CaptureClient, tokenizer: TargetTokenizer,
                 hostname: str, layer_ids: list[int], model_sha: str, dtype: str = "bfloat16",
                 storage: Path | None = None):
        self.cfg, self.store, self.r, self.client, self.tokenizer = cfg, store, r, client, tokenizer
        self.hidden = open_hidden(store)
        self.hostname = hostname
        self.layer_ids = layer_ids
        self.model_sha = model_sha
        self.dtype = dtype  # the manifest's name of the states' dtype this worker's engine writes
        self.storage = storage  # where the engine writes its files (swept of a killed worker's)
        self.warned_copy = False
        self.gate = EngineGate()
        self._manifests: dict[tuple[str, int], CaptureManifest] = {}
        self.claims = Claims(r, hostname)
        self._stop = threading.Event()

    def acquire(self, task: CaptureTask) -> str | None:
        """Claim the unit; its token, or None when another copy holds it."""
        return self.claims.acquire(rk.capture_claim(task.dataset, task.unit), task.dataset)

    def release(self, task: CaptureTask, token: str) -> None:
        self.claims.release(rk.capture_claim(task.dataset, task.unit), task.dataset, token)

    def start_reports(self, datasets: list[str], slots: int) -> None:
        """Every HEARTBEAT_S until :meth:`stop`, and at once when Redis lost its state, as generation
        workers do (``Claims.beat_until``): refresh the claims held (set ``rk.STATE`` after them),
        publish this worker's report (``draftfleet status`` lists it; it has a TTL, so a killed
        worker drops out) and sweep for a dead worker's messages."""

        def beat() -> None:
            self.claims.beat(WorkerReport(hostname=self.hostname, kind="capture", backend="vllm",
                                          endpoint=self.client.endpoint, datasets=sorted(datasets),
                                          queues=[rk.capture_queue(d) for d in sorted(datasets)], slots=slots),
                             mark_state=True)
            if self.storage is not None:  # and remove what killed workers left in the engine's folder
                sweep_orphans(self.storage, ORPHAN_S)

        def loop() -> None:
            beat()
            self.claims.beat_until(self._stop, beat)

        threading.Thread(target=loop, name="draftfleet-capture-report", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.claims.withdraw()

    def manifest(self, dataset: str, version: int) -> CaptureManifest | None:
        k = (dataset, version)
        if k not in self._manifests:
            m = self.hidden.manifest(dataset, version)
            if m is None:
                return None
            self._manifests[k] = m
        return self._manifests[k]


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


_runtime: CaptureRuntime | None = None


def install(rt: CaptureRuntime) -> None:
    global _runtime
    _runtime = rt


def _queue(task_self) -> str:
    return (task_self.request.delivery_info or {}).get("routing_key", "?")


def _event(rt: CaptureRuntime, dataset: str, field: str, tokens: int = 0) -> None:
    try:
        with rt.r.pipeline(transaction=False) as pipe:
            pipe.hincrby(rk.capture_progress(dataset), field, 1)
            if tokens:
                pipe.hincrby(rk.capture_progress(dataset), "captured_tokens", tokens)
            pipe.execute()
    except redis.RedisError:
        pass  # progress only: the store is the truth


def execute(task_self, payload: object) -> str:
    """Body of the Celery task; returns what happened (``stored``, ``duplicate``, ``failed``...)."""
    rt = _runtime
    assert rt is not None, "capture runtime not installed"
    queue = _queue(task_self)
    try:
        task = msgspec.convert(payload, CaptureTask)
        check_name(task.dataset)
        check_key(task.key)
    except (msgspec.ValidationError, StoreError) as exc:
        dead_letter(rt.r, queue=queue, reason=f"not a valid capture task: {exc}", body=payload, worker=rt.hostname)
        return "dead_letter"
    if queue != rk.capture_queue(task.dataset):
        dead_letter(rt.r, queue=queue, reason=f"a capture of {task.dataset!r} on queue {queue}", body=payload,
                    worker=rt.hostname)
        return "dead_letter"
    m = rt.manifest(task.dataset, task.version)
    if m is None:
        dead_letter(rt.r, queue=queue, reason=f"{task.dataset} has no capture version {task.version}", body=payload,
                    worker=rt.hostname)
        return "dead_letter"
    if m.layer_ids != rt.layer_ids or m.model_config_sha256 != rt.model_sha or m.dtype != rt.dtype:
        # Another worker's settings: leave it queued for a worker that captures with the version's.
        time.sleep(INFRA_RETRY_S)
        raise Reject(f"{task.dataset} v{task.version} is captured in {m.dtype} with layers {m.layer_ids} of another "
                     f"model, layers or dtype than this worker's ({rt.dtype}, {rt.layer_ids})", requeue=True)
    if rt.hidden.has(task.dataset, task.version, task.key, task.turn):
        return "duplicate"
    try:
        record = rt.store.get(task.dataset, task.key)
    except (FileNotFoundError, msgspec.DecodeError) as exc:
        dead_letter(rt.r, queue=queue, reason=f"no readable record {task.key}: {exc}", body=payload, worker=rt.hostname)
        return "dead_letter"
    unit = _unit_ids(rt, task, record)
    if isinstance(unit, str):
        dead_letter(rt.r, queue=queue, reason=unit, body=payload, worker=rt.hostname)
        return "dead_letter"
    ids, spans = unit
    token = rt.acquire(task)
    if token is None:
        return "claimed"  # another copy runs it; if its worker dies, its own message comes back
    try:
        if rt.hidden.has(task.dataset, task.version, task.key, task.turn):  # stored between our check and claim
            return "duplicate"
        return _capture(rt, task, m, ids, spans, record.source)
    finally:
        rt.release(task, token)


def _unit_ids(rt: CaptureRuntime, task: CaptureTask, record: ResponseRecord) -> tuple[list[int], Spans] | str:
    """The ids to send for the task's unit and its answers' spans in them; why not (a string) when the
    record has no such unit: then it is dead-lettered, never captured from a guess."""
    if task.turn == CONVERSATION:
        shared = conversation_spans(record)
        return shared if isinstance(shared, tuple) else (
            f"record {task.key} is no conversation to capture once ({shared}): draftfleet capture queues its turns")
    try:
        units = record_units(record, rt.tokenizer)
    except CaptureError as exc:
        return str(exc)
    if not 0 <= task.turn < len(units):
        return f"record {task.key} has no turn {task.turn}"
    ids, prompt_len = units[task.turn]
    return ids, [(prompt_len, len(ids))]


def _capture(rt: CaptureRuntime, task: CaptureTask, m: CaptureManifest, ids: list[int], spans: Spans,
             source: str) -> str:
    """Capture one unit with retries and store it; what happened (``stored``, ``duplicate``, ``failed``).

    An attempt is the engine's file, checked, then stored: a file the engine changed after the check
    (the upload refuses it) fails that attempt like a file refused by the check, so a unit whose
    engine keeps rewriting its files fails once, after ``max_attempts``, never goes round the queue."""
    got: Captured | None = None
    failure: Exception | None = None
    stored = False
    for attempt in range(1, rt.cfg.fleet.max_attempts + 1):
        probe = rt.gate.enter()
        try:
            got = None
            try:
                try:
                    got = rt.client.capture(ids)
                    check_states(ids, got, m)
                except BaseException:
                    if got is not None:  # refused: the engine's file goes
                        got.discard()
                    raise
            except (Halt, Permanent, Transient):
                raise
            except Exception as exc:  # a bug or an unforeseen file must not ack the unit away uncounted
                log.exception("capture %s/%s turn %s: unexpected error", task.dataset, task.key, turn_name(task.turn))
                raise Transient("internal", f"{type(exc).__name__}: {exc}") from None
            rt.gate.done(probe, right=True)
        except Halt as exc:  # the server, not the unit: back to the queue for when it is fixed
            if exc.reason in _SETTINGS_HALTS:
                rt.gate.wrong(probe, exc)
                raise Reject(exc.reason, requeue=True) from None  # Celery logs each; the reason is said once
            rt.gate.done(probe, right=False)
            log.error("capture %s/%s turn %s: %s; the task goes back to its queue", task.dataset, task.key,
                      turn_name(task.turn), exc)
            time.sleep(INFRA_RETRY_S)
            raise Reject(str(exc), requeue=True) from None
        except Permanent as exc:
            rt.gate.done(probe, right=got is not None)
            failure = exc
            break
        except Transient as exc:
            rt.gate.done(probe, right=got is not None)
            failure = exc
            _before_retry(rt, task, attempt, exc)
            continue
        except BaseException:  # a shutdown: the probe's turn goes to another thread
            rt.gate.done(probe, right=False)
            raise
        assert got is not None and got.contract is not None
        try:
            stored, failure = _store(rt, task, got, unit_metadata(task, m, spans, got.contract)), None
            break
        except Permanent as exc:
            failure = exc
            break
        except Transient as exc:
            failure = exc
            _before_retry(rt, task, attempt, exc)
        finally:
            got.discard()
    if failure is not None:
        _event(rt, task.dataset, "failed")
        log.error("capture %s/%s turn %s failed: %s (a later draftfleet capture queues it again)", task.dataset,
                  task.key, turn_name(task.turn), failure)
        return "failed"
    if not stored:
        return "duplicate"
    _event(rt, task.dataset, "captured", len(ids))
    log.info("captured %s %s turn %s: %d tokens", task.dataset, source, turn_name(task.turn), len(ids))
    return "stored"


def _before_retry(rt: CaptureRuntime, task: CaptureTask, attempt: int, exc: Transient) -> None:
    """Say why an attempt failed and wait out its backoff, unless it was the last."""
    if attempt < rt.cfg.fleet.max_attempts:
        delay = backoff_s(attempt, exc.retry_after)
        log.warning("capture %s/%s turn %s: %s; retry %d in %.1fs", task.dataset, task.key, turn_name(task.turn),
                    exc, attempt, delay)
        time.sleep(delay)


def unit_metadata(task: CaptureTask, m: CaptureManifest, spans: Spans, contract: EngineContract) -> dict[str, str]:
    """What a stored file's header says of its unit (written into the connector's room): whose it is,
    the answers' spans (the trainers' loss mask) and the engine's contract."""
    return {"dataset": task.dataset, "key": task.key, "turn": turn_name(task.turn), "prompt_len": str(spans[0][0]),
            "spans": json.dumps([list(sp) for sp in spans], separators=(",", ":")), "version": str(task.version),
            "layer_ids": ",".join(map(str, m.layer_ids)), "model": m.model,
            CONTRACT_KEY: msgspec.json.encode(contract).decode()}


def _store(rt: CaptureRuntime, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
    """Give the checked engine file its name in the store, with ``meta`` and the seal over the header
    and the bytes checked in its header; False if the unit is there already. Every step acts on the descriptors
    that were checked (``EngineFile``). The bytes are written again only where they cannot be linked:
    a file without header room (a server started without the fleet's ``header_room``), one whose
    names are all gone (a file renamed over it), or, with ``[capture] copy``, on another file
    system; then what was checked (in memory) is what is written."""
    assert got.file is not None
    if not rt.hidden.local:
        return _upload(rt, task, got, meta)
    final = rt.hidden.path(task.dataset, task.version, task.key, task.turn)
    try:
        if got.file.rewrite_metadata(meta, got.checked):
            try:
                return got.file.link(final)
            except PermissionError as exc:  # fchmod: the file is another user's
                raise _not_ours(got.path, exc) from None
            except FileNotFoundError:  # its every name removed or replaced since the check: written from memory
                log.warning("%s lost its name after it was checked: the states checked are written to the store",
                            got.path)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise StoreError(f"cannot link {got.path} to {final}: {exc.strerror or exc}") from exc
                if not rt.cfg.capture.copy:
                    raise Halt("hidden_states_other_fs", f"{got.path} is on another file system than the store "
                               f"{rt.store.root}: set [capture] storage_path on the store's, or [capture] copy = true "
                               "to write every file twice") from None
        else:
            _warn_no_room(rt, got, meta)
    except PermissionError as exc:  # the header rewrite: the file is another user's
        raise _not_ours(got.path, exc) from None
    return _put_checked(rt, task, got, meta)


def _upload(rt: CaptureRuntime, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
    """A store in a bucket: the checked file, its header sealed in place, uploaded once from the
    checked descriptor, its header compared on the way with the one just written and its data hashed
    against the digest checked; False when another worker had stored the unit (412). A file an
    engine wrote into after the check is not stored: ``Transient``, the attempt's failure. The
    caller removes the engine's name either way (``Captured.discard``)."""
    assert got.file is not None
    try:
        head = got.file.rewrite_metadata(meta, got.checked)
    except PermissionError as exc:  # the header rewrite: the file is another user's
        raise _not_ours(got.path, exc) from None
    if head:
        try:
            return rt.hidden.upload(task.dataset, task.version, task.key, task.turn, got.file.fd,
                                    digest=got.checked.data.hexdigest(), head=head)
        except OSError as exc:  # the engine's file, not the bucket: this attempt's failure, counted
            raise Transient("hidden_states_changed", f"{got.path}: {exc.strerror or exc}") from None
    _warn_no_room(rt, got, meta)
    return _put_checked(rt, task, got, meta)


def _warn_no_room(rt: CaptureRuntime, got: Captured, meta: dict[str, str]) -> None:
    if not rt.warned_copy:
        rt.warned_copy = True
        log.warning("%s has no header room, or too little for the unit's metadata (%d bytes): such files are "
                    "written again into the store (start the server with the fleet's connector flags, README "
                    "'Hidden states')", got.path, len(json.dumps(meta)))


def _put_checked(rt: CaptureRuntime, task: CaptureTask, got: Captured, meta: dict[str, str]) -> bool:
    """Store what was checked (in memory), sealed, as the unit's file, once."""
    tensors = {"token_ids": ("I64", got.ids), "hidden_states": ("BF16" if got.dtype == "bfloat16" else "F8_E4M3", got.states)}
    if got.scales is not None:
        tensors[SCALES] = got.scales
    return rt.hidden.put(task.dataset, task.version, task.key, task.turn, encode_safetensors(tensors, meta, seal=True))


def register(app: Celery) -> None:
    """Register the capture task on ``app`` (acks late; a lost worker's message goes back to the queue)."""

    @app.task(name=rk.CAPTURE_TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def capture(self, *args, **kwargs):
        try:
            if len(args) != 1 or kwargs:
                dead_letter(_runtime.r, queue=_queue(self), reason="not a valid capture task: expected one argument",
                            body=[list(args), kwargs], worker=_runtime.hostname)
                return "dead_letter"
            return execute(self, args[0])
        except (redis.RedisError, OSError, StoreError) as exc:
            log.error("%s: %s: %s; the task goes back to its queue in %.0fs", _queue(self), type(exc).__name__, exc,
                      INFRA_RETRY_S)
            time.sleep(INFRA_RETRY_S)
            raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from None


def run_capture_worker(cfg: FleetConfig, *, url: str | None = None, gpus: list[int] | None = None,
                       slots: int | None = None, datasets: list[str] | None = None, redis_url: str | None = None,
                       name: str | None = None, loglevel: str = "INFO", ready_timeout_s: float = 600.0) -> None:
    """Run a capture worker in the foreground until it is stopped (SIGTERM: warm shutdown)."""
    import socket

    from draftfleet.broker import connect, redact, resolve_redis_url
    from draftfleet.schemas.config import ConfigError
    from draftfleet.workers.app import make_app
    from draftfleet.workers.launcher import port_for
    from draftfleet.workers.worker import announce_waiting, refuse_duplicate_name, setup_logging, worker_datasets

    setup_logging(loglevel)
    if cfg.vllm is None:
        raise ConfigError(f"{cfg.path}: a capture worker needs a [backends.vllm] table (hidden states come from vLLM)")
    model, layer_ids = capture_settings(cfg)
    broker_url = resolve_redis_url(redis_url, cfg.fleet.redis_url, cfg.fleet.store)
    names = worker_datasets(cfg, datasets)
    if gpus is None and url is None:
        raise ConfigError("a capture worker needs --url URL (a vLLM server started for capture) or --gpu N")
    if gpus is not None and cfg.vllm.launch is None:
        raise ConfigError(f"{cfg.path}: --gpu needs [backends.vllm.launch] (model_path, port_base)")
    label = f"capture-gpu{'-'.join(map(str, gpus))}" if gpus is not None else f"capture-{url.rsplit(':', 1)[-1].strip('/')}"
    hostname = f"{name or label}@{socket.gethostname()}"
    r = connect(broker_url)
    refuse_duplicate_name(r, hostname)
    tokenizer = TargetTokenizer.from_config(cfg.fleet)
    store = open_store(cfg)
    store.prepare()
    check_storage(cfg, Path(storage_path(cfg)))  # the engine's files are linked into the store (or uploaded)
    server = client = rt = connector = None
    stop_waiting = announce_waiting(r, hostname, "capture", "vllm", redact(url) if url else f"GPU {gpus}", names,
                                    f"vLLM at {redact(url)}" if url else f"vLLM to start on GPU(s) {gpus}")
    try:
        if gpus is not None:
            launch = cfg.vllm.launch
            storage = engine_folder(cfg, label)
            connector = connector_folder()
            server = capture_server(launch, gpus, port_for(launch, gpus), layer_ids, str(storage), connector,
                                    dtype=cfg.capture.dtype)
            server.start(wait=True)
            server.supervise()
            url = server.url
        else:
            storage = Path(storage_path(cfg))
        n = slots or cfg.capture.inflight
        client = CaptureClient(url, cfg.vllm, tokenizer, inflight=n, storage=storage)
        log.info("waiting for vLLM at %s", redact(url))
        client.wait_ready(ready_timeout_s)
        check_engine(client, wanted_contract(model=model, layer_ids=layer_ids, dtype=DTYPES[cfg.capture.dtype]))
        app = make_app(broker_url, cfg.fleet.visibility_timeout_s)
        app.conf.worker_consumer = "draftfleet.workers.consumer:Consumer"
        app.conf.broker_transport = "draftfleet.workers.consumer:Transport"
        register(app)
        rt = CaptureRuntime(cfg, store, r, client, tokenizer, hostname, layer_ids, model.config_sha256,
                            DTYPES[cfg.capture.dtype], storage)
        install(rt)
        stop_waiting()
        rt.start_reports(names, n)
        queues = [rk.capture_queue(d) for d in names]
        log.info("capture worker %s: layers %s in %s, %d in flight, queues %s", hostname, layer_ids, cfg.capture.dtype,
                 n, ",".join(queues))
        # twice as many threads as engine slots: one unit's record, check and link while n are in the engine
        app.worker_main(["worker", "-P", "threads", "-c", str(2 * n), "-Q", ",".join(queues), "-n", hostname,
                         "-l", loglevel.upper(), "-E", "--without-gossip", "--without-mingle"])
    finally:
        stop_waiting()
        if rt is not None:
            rt.stop()
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if connector is not None:
            remove_connector_folder(connector)
        sys.stdout.flush()


def engine_folder(cfg: FleetConfig, label: str) -> Path:
    """The folder a launched server writes in, one per host and GPU set (``<storage>/<label>@<host>``:
    hosts sharing a store never share it), swept of what a killed predecessor's engine wrote there
    and nobody took (the store never holds it; the unit is captured again). A file whose lock a live
    writer holds is left (``sweep_orphans``)."""
    import socket

    storage = Path(storage_path(cfg)) / f"{label}@{socket.gethostname()}"
    make_dirs(storage)
    sweep_orphans(storage, 0)
    return storage


def check_engine(client: CaptureClient, want: EngineContract) -> None:
    """Refuse to start (CaptureError) against an engine whose files carry no contract or another
    one than this worker's settings: one capture of a single token, before any unit is taken."""
    try:
        got = client.capture([client.tokenizer.eot_id])
        try:
            check_contract(got.contract, want, got.path, "this worker's [capture] settings")
            try:  # what storing does to each file, on the probe's (discarded anyway)
                assert got.file is not None
                os.fchmod(got.file.fd, 0o444)
            except PermissionError as exc:
                raise _not_ours(got.path, exc) from None
        finally:
            got.discard()
    except (Halt, Permanent, Transient) as exc:
        raise CaptureError(f"{client.endpoint} is not a capture engine this worker can use: {exc}") from None


def engine_command(cfg: FleetConfig) -> str:
    """The ``vllm serve`` command line of a capture server started by hand for ``cfg`` (``worker
    capture --url``): the extraction and connector flags, with ``PYTHONPATH`` naming this user's
    connector folder (``lasting_connector_folder``: the same one every time)."""
    import shlex

    model, layer_ids = capture_settings(cfg)
    args = ["vllm", "serve", model.path, *engine_args(layer_ids, storage_path(cfg), cfg.capture.dtype)]
    return f"PYTHONPATH={shlex.quote(lasting_connector_folder())} {shlex.join(args)}"
