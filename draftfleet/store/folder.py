"""The store in a folder (``FileStore``): records written once by ``link``, on any POSIX file system.

Writes are atomic (temp file in the same folder, fsync, then ``link``): ``link`` fails when the
target exists, so of two workers finishing the same key exactly one wins, on any POSIX file
system including NFS. The winner is the only one that counts the record.

Modes never follow the umask: every folder the fleet makes is ``DIR_MODE`` (0755: no group or
other account can add a file, such as a planted progress file, or replace one) and every file it
stores ``FILE_MODE`` (0444: read-only, so that a hard link to it, as the speculators export makes,
cannot change the truth through an ordinary write; readable by another account, a trainer's, that
can reach the store's folder). Only the quarantine files, appended to, stay writable by the owner.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from draftfleet.schemas.config import NAME_RE
from draftfleet.schemas.records import BatchRecord, ChargeRecord, DatasetEvent, DatasetManifest, FailureRecord, QuarantineEntry, TurnProgress
from draftfleet.store.base import FLEET_ENTRIES, MARKER, Store, StoreError, check_batch_id, check_charge_id, check_key, check_name
from draftfleet.store.encoding import (batch_decoder, charge_decoder, encoder, event_decoder, failure_decoder, manifest_decoder,
                                       quarantine_decoder, quarantine_id)

DIR_MODE = 0o755

FILE_MODE = 0o444

APPEND_MODE = 0o644  # the quarantine files and the decision logs, appended to by every enqueue

_TEMP_RE = re.compile(r"^\.tmp-[A-Za-z0-9_]+\.json$")  # _write_temp's names (tempfile.mkstemp)


def _why(exc: OSError) -> str:
    """The OS error, with the path it is about (a shard folder, a temp file), when it names one."""
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> None:
    """``mkdir -p`` whose every new folder is ``DIR_MODE`` whatever the umask (a folder that exists
    is left as it is: it may be someone's on purpose, such as a shared parent)."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise  # a file where the folder must go: name it, not a temp file inside it
            continue  # made meanwhile by another writer, with the same mode
        os.chmod(d, DIR_MODE)


def _write_temp(folder: Path, data: bytes) -> str:
    make_dirs(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, FILE_MODE)  # the open descriptor still writes
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_once(final: Path, data: bytes) -> bool:
    """Write ``data`` at ``final`` unless something is there: True if this call wrote it.

    Atomic and write-once on any POSIX file system, NFS included: the data goes to a temp file
    in the same folder, then ``link`` (which fails when the target exists) gives it its name."""
    if os.path.lexists(final):
        return False
    try:
        tmp = _write_temp(final.parent, data)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        _fsync_dir(final.parent)
    except OSError as exc:
        raise StoreError(f"cannot write {final}: {_why(exc)}") from exc
    return True


def link_once(src: int | str | Path, final: Path) -> bool:
    """Give the (fsync'd) file ``src`` the name ``final``, read-only (``FILE_MODE``), unless something
    is there: True if this call named it. ``write_once`` without writing the bytes again.

    ``src`` is best an open descriptor: the file linked is then the one it holds, whatever its
    path names by now (``linkat`` of ``/proc/self/fd/N`` with ``AT_SYMLINK_FOLLOW``, the way
    ``open(2)`` documents for naming an ``O_TMPFILE``; ``AT_EMPTY_PATH`` would need
    ``CAP_DAC_READ_SEARCH``). The new name is made in ``final``'s folder through that folder's own
    descriptor, and ``link`` fails when it is taken (another writer won). A path is opened (no link
    followed) and linked the same way. ``src`` keeps its own name; ``OSError`` ``EXDEV`` when the two
    are on different file systems, ``ENOENT`` when the file has no name left to link from, and
    ``PermissionError`` when ``fchmod`` is refused (the file belongs to another user)."""
    if not isinstance(src, int):
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return link_once(fd, final)
        finally:
            os.close(fd)
    make_dirs(final.parent)
    folder = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _lexists_at(folder, final.name):
            return False
        os.fchmod(src, FILE_MODE)  # stored files are read-only, whoever wrote them
        held = f"/proc/self/fd/{src}"
        if not os.path.exists(held):  # (a file with no name left still resolves: linkat then says ENOENT)
            raise OSError(errno.ENOSYS, "/proc is not mounted: an open file cannot be linked by its descriptor", held)
        try:  # a dir fd makes Python call linkat (AT_SYMLINK_FOLLOW resolves the magic link); link(2) says EXDEV
            os.link(held, final.name, dst_dir_fd=folder, follow_symlinks=True)
        except FileExistsError:
            return False
        os.fsync(folder)
    finally:
        os.close(folder)
    return True


def _lexists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


class FileStore(Store):
    """Object-keyed files under ``root``; safe to share between machines over NFS."""

    local = True

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.location = str(self.root)

    def __getstate__(self):
        return {"root": self.root}

    def __setstate__(self, state):
        self.__init__(state["root"])

    def prepare(self) -> None:
        """Make sure the root is the fleet's own before anything is written under it.

        Refused: a file-system root, and a folder holding anything the fleet did not make (a
        dataset named ``etc`` under ``/`` would write ``/etc/manifest.json``). A new or empty
        folder gets the marker; a store made before the marker existed (only dataset folders
        with a manifest and the fleet's ``_`` folders) is recognised and marked.
        """
        root = self.root.resolve()
        if root == Path(root.anchor):
            raise StoreError(f"refusing store {self.root}: a file-system root; use a folder of its own")
        if (root / MARKER).is_file():
            return
        if root.exists():
            if not root.is_dir():
                raise StoreError(f"refusing store {self.root}: not a folder")
            # The marker's own temp file is the fleet's: two workers started together on a new store
            # each write one, and the second used to find the first's and refuse (exit 1, issue 26.8).
            foreign = sorted(e.name for e in os.scandir(root) if not (
                e.name in FLEET_ENTRIES or _TEMP_RE.match(e.name) and e.is_file(follow_symlinks=False)
                or (e.is_dir(follow_symlinks=False) and NAME_RE.match(e.name)
                    and os.path.isfile(os.path.join(e.path, "manifest.json")))))
            if foreign:
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                raise StoreError(f"refusing store {self.root}: it holds files the fleet did not make ({shown}) "
                                 f"and no {MARKER} marker; use an empty folder")
        make_dirs(root)  # not group-writable, whatever the umask
        os.replace(_write_temp(root, b'{"draftfleet_store": 1}\n'), root / MARKER)

    # -- responses -----------------------------------------------------------------------
    def path(self, dataset: str, key: str) -> Path:
        check_name(dataset)
        check_key(key)
        return self.root / dataset / key[:2] / f"{key}.json"

    def has(self, dataset: str, key: str) -> bool:
        """Something is at the key's path (a dangling symlink too: ``link`` could not replace it)."""
        return os.path.lexists(self.path(dataset, key))

    def _create(self, dataset: str, key: str, data: bytes) -> bool:
        return write_once(self.path(dataset, key), data)

    def set_aside(self, dataset: str, key: str) -> Path | None:
        """An empty, corrupt or dangling-link record file moved aside; the file is kept for a
        person to look at."""
        src = self.path(dataset, key)
        dst = self.root / "_unreadable" / dataset / f"{key}.{time.time_ns()}.json"
        try:
            make_dirs(dst.parent)
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot move {src} aside: {_why(exc)}") from exc
        return dst

    def record_bytes(self, dataset: str, key: str) -> bytes:
        return self.path(dataset, key).read_bytes()

    def record_location(self, dataset: str, key: str) -> str:
        return str(self.path(dataset, key))

    def read_many(self, names: Iterable[str]) -> Iterator[tuple[str, bytes | OSError]]:
        for name in names:
            try:
                with open(name, "rb") as fh:
                    yield name, fh.read()
            except OSError as exc:
                yield name, exc

    def record_files(self, dataset: str) -> list[str]:
        """Paths (as strings: cheaper than Path objects by the 100,000) of every record, unsorted."""
        base = self.root / check_name(dataset)
        if not base.is_dir():
            return []
        out = []
        for shard in os.scandir(base):
            if shard.is_dir() and len(shard.name) == 2:
                out.extend(e.path for e in os.scandir(shard.path) if e.name.endswith(".json") and not e.name.startswith("."))
        return out

    def datasets(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and NAME_RE.match(e.name) and ".." not in e.name
        )

    # -- manifests -----------------------------------------------------------------------
    def manifest_path(self, dataset: str) -> Path:
        return self.root / check_name(dataset) / "manifest.json"

    def manifest(self, dataset: str) -> DatasetManifest | None:
        p = self.manifest_path(dataset)
        return manifest_decoder.decode(p.read_bytes()) if p.exists() else None

    def write_manifest(self, manifest: DatasetManifest) -> None:
        final = self.manifest_path(manifest.name)
        tmp = _write_temp(final.parent, msgspec.json.format(encoder.encode(manifest)))
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    # -- failures ------------------------------------------------------------------------
    def failure_path(self, dataset: str, key: str) -> Path:
        return self.root / "_failures" / check_name(dataset) / f"{check_key(key)}.json"

    def put_failure(self, failure: FailureRecord) -> None:
        final = self.failure_path(failure.dataset, failure.key)
        try:
            tmp = _write_temp(final.parent, encoder.encode(failure))
            os.replace(tmp, final)
        except OSError as exc:
            raise StoreError(f"cannot write {final}: {_why(exc)}") from exc

    def all_failures(self, dataset: str) -> list[FailureRecord]:
        base = self.root / "_failures" / check_name(dataset)
        if not base.is_dir():
            return []
        return [failure_decoder.decode(p.read_bytes()) for p in sorted(base.glob("*.json"))]

    def clear_failure(self, dataset: str, key: str) -> None:
        self.failure_path(dataset, key).unlink(missing_ok=True)

    # -- conversations in progress --------------------------------------------------------
    def progress_path(self, dataset: str, key: str) -> Path:
        return self.root / "_progress" / check_name(dataset) / f"{check_key(key)}.json"

    def put_progress(self, progress: TurnProgress) -> None:
        final = self.progress_path(progress.dataset, progress.key)
        try:
            os.replace(_write_temp(final.parent, encoder.encode(progress)), final)
        except OSError as exc:
            raise StoreError(f"cannot write {final}: {_why(exc)}") from exc

    def progress(self, dataset: str, key: str) -> TurnProgress | None:
        try:
            return msgspec.json.decode(self.progress_path(dataset, key).read_bytes(), type=TurnProgress)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def clear_progress(self, dataset: str, key: str) -> None:
        self.progress_path(dataset, key).unlink(missing_ok=True)

    def progress_keys(self, dataset: str) -> set[str]:
        """The keys of the conversations with completed turns kept (file names only)."""
        base = self.root / "_progress" / check_name(dataset)
        return {p.name[:-5] for p in base.glob("[!.]*.json")} if base.is_dir() else set()

    # -- quarantine ----------------------------------------------------------------------
    def quarantine_path(self, dataset: str) -> Path:
        return self.root / "_quarantine" / f"{check_name(dataset)}.jsonl"

    def quarantine_location(self, dataset: str) -> str:
        return str(self.quarantine_path(dataset))

    def quarantined(self, dataset: str) -> Iterator[QuarantineEntry]:
        """The dataset's quarantined lines, one at a time (the file can be large); a damaged line is skipped."""
        try:
            fh = open(self.quarantine_path(dataset), "rb")
        except FileNotFoundError:
            return
        with fh:
            for line in fh:
                try:
                    yield quarantine_decoder.decode(line)
                except msgspec.DecodeError:
                    continue

    def quarantine(self, dataset: str, entries: list[QuarantineEntry]) -> None:
        if not entries:
            return
        p = self.quarantine_path(dataset)
        try:
            old = p.read_bytes()
        except FileNotFoundError:
            old = b""
        seen = set()
        for line in old.splitlines():
            try:
                seen.add(quarantine_id(quarantine_decoder.decode(line)))
            except msgspec.DecodeError:
                continue
        new = []
        for e in entries:
            if quarantine_id(e) not in seen:
                seen.add(quarantine_id(e))
                new.append(encoder.encode(e) + b"\n")
        if new:  # appended, so that two enqueues at once cannot lose each other's lines
            make_dirs(p.parent)
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, APPEND_MODE)
            os.fchmod(fd, APPEND_MODE)  # a new one was made under the umask
            with os.fdopen(fd, "ab") as fh:
                fh.write((b"\n" if old and not old.endswith(b"\n") else b"") + b"".join(new))
                fh.flush()
                os.fsync(fh.fileno())

    def put_batch(self, batch: BatchRecord) -> None:
        name = f"{check_batch_id(batch.id)}.json"
        final = self.root / "_batches" / ("closed" if batch.closed else "open") / name
        try:
            make_dirs(final.parent)
            os.replace(_write_temp(final.parent, encoder.encode(batch)), final)
            if batch.closed:
                (self.root / "_batches" / "open" / name).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot write {final}: {_why(exc)}") from exc

    def open_batch(self, batch_id: str) -> BatchRecord | None:
        try:
            return batch_decoder.decode((self.root / "_batches" / "open" / f"{check_batch_id(batch_id)}.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def batches(self, *, closed: bool = False) -> list[BatchRecord]:
        out = []
        for p in sorted((self.root / "_batches" / ("closed" if closed else "open")).glob("b*.json")):
            try:
                out.append(batch_decoder.decode(p.read_bytes()))
            except (OSError, msgspec.DecodeError):
                continue
        return out

    def put_charge(self, charge: ChargeRecord) -> None:
        write_once(self.root / "_charges" / f"{check_charge_id(charge.id)}.json", encoder.encode(charge))

    def charges(self) -> list[ChargeRecord]:
        out = []
        for p in sorted((self.root / "_charges").glob("*.json")):
            try:
                out.append(charge_decoder.decode(p.read_bytes()))
            except (OSError, msgspec.DecodeError):
                continue
        return out

    def log_path(self, dataset: str) -> Path:
        return self.root / "_log" / f"{check_name(dataset)}.jsonl"

    def log(self, event: DatasetEvent) -> None:
        """One line, appended (``O_APPEND``)."""
        p = self.log_path(event.dataset)
        make_dirs(p.parent)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, APPEND_MODE)
        os.fchmod(fd, APPEND_MODE)  # a new one was made under the umask
        with os.fdopen(fd, "ab") as fh:
            fh.write(encoder.encode(event) + b"\n")

    def events(self, dataset: str) -> list[DatasetEvent]:
        try:
            lines = self.log_path(dataset).read_bytes().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(event_decoder.decode(line))
            except msgspec.DecodeError:
                continue
        return sorted(out, key=lambda e: e.at)
