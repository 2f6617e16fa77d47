"""Hidden states in a bucket: the file store's layout (hidden.py) as objects under the store's prefix.

    <prefix>/_hidden/<dataset>/v<N>/capture.json                      written once
    <prefix>/_hidden/<dataset>/v<N>/<key[:2]>/<key>.<turn>.safetensors  written once

A unit's file is uploaded once from the capture worker's checked descriptor with
``If-None-Match: *`` (``Bucket.put_file``: one ``PutObject``, or parts completed under that
condition): 412, another worker stored the unit, is a lost ``link`` (unless the object carries this
upload's token: its answer was lost); 409, a write of the key under way, is tried again. Sizes
come from the listing, token counts from each header alone (one ranged GET), and ``verify``
streams every object through its seal (``hidden.check_seal``). Trainers read local files only, so
an export first copies a version's files into a local cache (``download``) laid out as a folder
store's ``_hidden``, and reads them there.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from draftfleet.hidden.base import FILE_RE, HIDDEN_DIR, MANIFEST, Hidden, StoredFile, held_turns
from draftfleet.hidden.folder import HiddenStore
from draftfleet.hidden.format import header_length, parse_header, read_checked
from draftfleet.store.bucket import READ_THREADS, ObjectStore
from draftfleet.store.s3 import S3Error
from draftfleet.schemas.records import CONVERSATION, CaptureManifest, turn_name
from draftfleet.store import FILE_MODE, StoreError, check_key, check_name, make_dirs

HEAD_READ = 16 << 10  # a header's first ranged GET: the connector's 4 KiB room and the tensor entries fit
_VERSION_RE = re.compile(r"^v(\d+)/$")


class BucketHidden(Hidden):
    """The hidden-state objects of an ``ObjectStore``, per dataset and capture version."""

    local = False

    def __init__(self, store: ObjectStore):
        self.store = store
        self.bucket = store.bucket

    def _dir(self, dataset: str, version: int) -> str:
        return self.store.object_name(HIDDEN_DIR, check_name(dataset), f"v{int(version)}", "")

    def object_key(self, dataset: str, version: int, key: str, turn: int) -> str:
        check_key(key)
        return f"{self._dir(dataset, version)}{key[:2]}/{key}.{turn_name(turn)}.safetensors"

    def location(self, dataset: str, version: int, key: str, turn: int) -> str:
        return f"s3://{self.store.bucket_name}/{self.object_key(dataset, version, key, turn)}"

    def has(self, dataset: str, version: int, key: str, turn: int) -> bool:
        return self.bucket.exists(self.object_key(dataset, version, key, turn))

    def versions(self, dataset: str) -> list[int]:
        base = self.store.object_name(HIDDEN_DIR, check_name(dataset), "")
        found = (_VERSION_RE.match(p[len(base):]) for p in self.bucket.list(base, delimiter="/"))
        return sorted(int(m.group(1)) for m in found if m and self.bucket.exists(
            f"{self._dir(dataset, int(m.group(1)))}{MANIFEST}"))

    def _manifest_bytes(self, dataset: str, version: int) -> bytes | None:
        got = self.bucket.get(f"{self._dir(dataset, version)}{MANIFEST}")
        return got[0] if got else None

    def write_manifest(self, m: CaptureManifest) -> None:
        # The first manifest of a version stays: settings never change under its files.
        self.store.create_object(f"{self._dir(m.dataset, m.version)}{MANIFEST}",
                                  msgspec.json.format(msgspec.json.encode(m)))

    def put(self, dataset: str, version: int, key: str, turn: int, data: bytes) -> bool:
        """Write the unit's file once. True if this call stored it, False if it was there already."""
        return self.store.create_object(self.object_key(dataset, version, key, turn), data)

    def upload(self, dataset: str, version: int, key: str, turn: int, fd: int, *, digest: str | None = None,
               head: bytes | None = None, part_size: int | None = None) -> bool:
        """Upload the file open on ``fd`` as the unit's, once: True if this call stored it, False
        if another writer had (412: a lost ``link``). ``digest``: the sha256 of the data section the
        worker checked; ``head``: the file's first bytes (length and header, its seal over both
        included) as the worker wrote them (default: as they are now). Bytes sent that differ from
        ``head`` or no longer hash to ``digest`` (an engine still writing into the file) are not
        stored (``OSError``): what is stored is the sealed file, byte for byte."""
        name = self.object_key(dataset, version, key, turn)
        sealed = None
        if digest is not None:
            if head is None:
                try:
                    head = os.pread(fd, 8 + header_length(name, os.pread(fd, 8, 0), os.fstat(fd).st_size), 0)
                except ValueError as exc:  # its header changed since the check
                    raise OSError(errno.EIO, str(exc)) from None
            sealed = (head, digest)
        writer = secrets.token_hex(16)  # one for every try of this upload (Bucket.put_file)
        try:
            self.store.retry_conflict(lambda: self.bucket.put_file(name, fd, part_size=part_size, sealed=sealed,
                                                                    writer=writer))
        except S3Error as exc:
            if exc.status == 412:
                return False
            raise
        return True

    def _listing(self, dataset: str, version: int) -> Iterator[tuple[str, int, str, int, float]]:
        """(unit key, turn, object key, size, mtime) of every stored file of a version."""
        for name, size, mtime in self.bucket.list_sharded(self._dir(dataset, version), sized=True):
            m = FILE_RE.match(name.rpartition("/")[2])
            if m:
                turn = CONVERSATION if m.group(2) == "conversation" else int(m.group(2))
                yield m.group(1), turn, name, size, mtime

    def files(self, dataset: str, version: int) -> Iterator[tuple[str, int, str]]:
        """(key, turn, s3:// location) of every stored file of a version, unsorted."""
        for key, turn, name, _size, _mtime in self._listing(dataset, version):
            yield key, turn, f"s3://{self.store.bucket_name}/{name}"

    def _entry(self, item: tuple[str, int, str, int, float]) -> StoredFile | None:
        key, turn, name, size, mtime = item
        where = f"s3://{self.store.bucket_name}/{name}"
        try:
            got = self.bucket.get_range(name, 0, HEAD_READ)
            if got is None:
                return None
            head, size = got
            n = header_length(where, head, size)
            if 8 + n > len(head):
                more = self.bucket.get_range(name, len(head), 8 + n - len(head))
                head += more[0] if more else b""
            header = parse_header(where, head[8:8 + n], size)
            return StoredFile(key=key, turn=turn, path=where, turns=held_turns(header, turn),
                              tokens=int(header["token_ids"]["shape"][0]), bytes=size, mtime=mtime)
        except (S3Error, ValueError, KeyError, TypeError):
            return None

    def entries(self, dataset: str, version: int) -> Iterator[StoredFile]:
        """What each stored file of a version holds, from its header (a ranged GET each, in parallel);
        vanished or unreadable ones skipped."""
        with ThreadPoolExecutor(READ_THREADS) as pool:
            yield from (e for e in pool.map(self._entry, self._listing(dataset, version)) if e is not None)

    def _verify(self, item: tuple[str, int, str, int, float], required: bool) -> bool | str | None:
        where = f"s3://{self.store.bucket_name}/{item[2]}"
        try:
            got = self.bucket.open(item[2])
            if got is None:
                return None  # removed meanwhile
            body, size = got
            try:
                return read_checked(where, required, fh=body, size=size)[2]
            finally:
                body.close()
        except (S3Error, OSError) as exc:
            return f"{where}: {exc}"
        except ValueError as exc:  # it names the object
            return str(exc)

    def verify(self, dataset: str, version: int) -> tuple[int, int, list[str]]:
        """Every stored file of a version downloaded through its seal, as the folder store's
        ``verify``: (files that are the ones sealed, files of a version made before seals that carry
        none, why each other one is bad)."""
        required = self.sealed(dataset, version)
        good = unsealed = 0
        bad: list[str] = []
        items = sorted(self._listing(dataset, version), key=lambda f: f[2])
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for got in pool.map(lambda item: self._verify(item, required), items):
                if got is True:
                    good += 1
                elif got is False:
                    unsealed += 1
                elif isinstance(got, str):
                    bad.append(got)
        return good, unsealed, bad

    # -- a local copy for the trainers -----------------------------------------------------
    def download(self, dataset: str, version: int, cache: str | Path,
                 progress: Callable[[int, int], None] | None = None, keys: set[str] | None = None) -> HiddenStore:
        """Copy a version's manifest and files (only the units of ``keys`` when given) to ``cache``
        (laid out as a store's ``_hidden``) and return the folder store over them. Resumable: a file
        already there with the listed size and its sealed digest is kept; each download goes to
        ``<name>.part`` and is renamed, read-only, once whole. ``progress(bytes, total)`` is called
        as bytes arrive (``total``: of the files to fetch)."""
        local = HiddenStore.at(cache)
        m = self.manifest(dataset, version)
        if m is None:
            raise StoreError(f"{self.store.location}: {dataset} has no capture version {version}")
        man = local.version_dir(dataset, version) / MANIFEST
        make_dirs(man.parent)
        man.write_bytes(msgspec.json.format(msgspec.json.encode(m)))
        todo = [(name, local.path(dataset, version, key, turn), size)
                for key, turn, name, size, _mtime in self._listing(dataset, version) if keys is None or key in keys]
        todo = [t for t in todo if not _complete(t[1], t[2], m.seal > 0)]
        total, done = sum(t[2] for t in todo), 0
        if progress:
            progress(0, total)
        for name, path, size in todo:
            done += self._fetch(name, path, size, lambda n: progress(n, total) if progress else None, done)
        return local

    def _fetch(self, name: str, path: Path, size: int, tick: Callable[[int], None], before: int) -> int:
        make_dirs(path.parent)
        part = path.with_name(path.name + ".part")
        got = self.bucket.open(name)
        if got is None:
            return 0  # removed meanwhile: the export counts the unit as missing
        body, _size = got
        n = 0
        try:
            with open(part, "wb") as fh:
                for chunk in iter(lambda: body.read(8 << 20), b""):
                    fh.write(chunk)
                    n += len(chunk)
                    tick(before + n)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            body.close()
        os.chmod(part, FILE_MODE)
        os.replace(part, path)
        return n


def _complete(path: Path, size: int, required: bool) -> bool:
    """Whether the local copy is whole: the listed size, and the file the one sealed."""
    try:
        if os.path.getsize(path) != size:
            return False
        read_checked(path, required)
        return True
    except (OSError, ValueError):
        return False
