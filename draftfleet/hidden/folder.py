"""Hidden states in the folder store: one write-once file per unit, linked into place.

Files are written once, by the engine's connector, on the store's file system: the worker writes
the unit's metadata into the room the connector leaves in the header (in place, same length), with
the seal over that header and the data it checked, fsyncs, and ``link``s the file to its name
(fails if the target exists), so of two workers capturing the same unit exactly one file is
stored, and the states cross the disk once (``workers/capture_intake.py``).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec

from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import CONVERSATION, CaptureManifest, turn_name
from draftfleet.store import Store, StoreError, check_key, check_name, write_once
from draftfleet.hidden.base import FILE_RE, HIDDEN_DIR, Hidden, MANIFEST, StoredFile, held_turns
from draftfleet.hidden.format import checked_header, read_checked
from draftfleet.hidden.target import CaptureError


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


class HiddenStore(Hidden):
    """The hidden-state files of a store in a folder, per dataset and capture version."""

    def __init__(self, store: Store):
        if not store.local:
            raise StoreError(f"{store.location} is a bucket: its hidden states are open_hidden's (hidden/bucket.py)")
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
                    m = FILE_RE.match(e.name)
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
                header, _offset = checked_header(Path(path))
                n = int(header["token_ids"]["shape"][0])
                held = held_turns(header, turn)
                st = os.stat(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            yield StoredFile(key=key, turn=turn, path=path, turns=held, tokens=n, bytes=st.st_size, mtime=st.st_mtime)
