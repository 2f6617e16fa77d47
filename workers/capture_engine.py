"""The capture engine: how a vLLM capture server is started, and the worker's pause while it is wrong.

What this module guarantees. A launched server runs the fleet's connector and nothing else of the
fleet: ``PYTHONPATH`` names a fresh folder of this user's alone holding only the connector module
(:func:`connector_folder`), never the data folder. Its flags ask for exactly the version's layers,
dtype and header room, with no prefix caching (every state is computed for its request). A worker
refuses to start against an engine whose first file carries no contract or another one
(:func:`check_engine`), or one that died on that first capture (said as such, with its exit). While
an engine's files carry other settings than a version's, or the engine is dead or gone, one unit at
a time asks it again after a growing pause (:class:`EngineGate`), so the units stay queued and none
fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from draftfleet.hidden import HEADER_ROOM, CaptureError, capture_settings, storage_path
from draftfleet.schemas.config import FleetConfig, VLLMLaunch
from draftfleet.schemas.records import EngineContract
from draftfleet.store import make_dirs
from draftfleet.workers.backends import Halt, Permanent, Transient
from draftfleet.workers.capture_intake import (CONNECTOR_CLASS, CONNECTOR_MODULE, CaptureClient, check_contract, not_ours,
                                               sweep_orphans)
from draftfleet.workers.engine import ServerDown

log = logging.getLogger("draftfleet.capture")


INFRA_RETRY_S = 5.0


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

# An engine configured otherwise than the version (check_contract, check_states): every unit meets it.
SETTINGS_HALTS = frozenset({"engine_contract", "hidden_states_shape", "hidden_states_dtype", "hidden_states_scales"})

SETTINGS_PAUSE_MAX_S = 60.0


class EngineGate:
    """The worker's pause while its engine's files carry other settings than the version's (an engine
    restarted by hand with other layers), or while the engine is dead or gone (``ServerDown``: a
    launched one is being restarted): the units go back to their queue, and instead of every
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

    def wrong(self, probe: bool, why: Halt | ServerDown) -> None:
        """The engine's file carried other settings, or the engine is dead: pause (a probe's failure
        doubles the pause; a request already under way when the pause began changes nothing)."""
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
                log.warning("the engine answers again, its files with the version's settings: captures resume")
            if probe:
                self._probing = False
            self._cond.notify_all()


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
                raise not_ours(got.path, exc) from None
        finally:
            got.discard()
    except ServerDown as exc:  # died (or went away) on its first capture: not a configuration mistake
        raise CaptureError(f"the engine at {client.endpoint} died on the worker's first capture, before any unit "
                           f"was taken: {exc}") from None
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
