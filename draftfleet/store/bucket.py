"""The store in a bucket: ``s3://bucket/prefix``, for machines that share no file system.

The layout under the prefix is the file store's (draftfleet/store/folder.py), and so are the semantics,
each by one S3 request:

- a record is written once by ``PutObject`` with ``If-None-Match: *``: 412 means another writer
  won (a lost ``link``), unless the object carries this writer's own token (``Bucket.put``: its
  answer was lost, and a retry was refused: botocore's, or the worker's own call again, which
  passes the task's token, kept its whole life); 409 means a write of the same key was under way:
  try again. That PUT is all a record costs (a twin's, one HEAD more);
- a manifest is replaced by ``If-Match: <the ETag it was read with>``: an enqueue that read an
  older one is refused instead of overwriting what another enqueue wrote meanwhile;
- failures and progress are replaced whole (a PUT is atomic), and deleted when done;
- what a file store appends to becomes one object per entry: a quarantined line under the hash
  of what identifies it (so a re-run's is the same object, written once), a logged decision
  under its time;
- listings are by prefix, 1,000 keys a request; a dataset's 256 shard folders side by side;
- an unreadable record is set aside by a copy and a delete conditional on the ETag copied
  (a bucket that ignores the condition keeps the record where it is);
- multipart uploads under the prefix begun over ``STALE_UPLOAD_S`` ago (a worker killed mid-upload)
  are aborted by ``prepare`` and each reconciler pass.

``prepare`` refuses a bucket that does not honour ``If-None-Match`` (it writes a probe twice, then
from several threads at once: without it two workers finishing one prompt would both count it)
or ``If-Match`` (a stale ETag must be refused: without it an enqueue's manifest could be lost),
or drops an object's metadata (the write's token). A bucket whose ``DeleteObject`` ignores
``If-Match`` is used, but an unreadable record in it is left in place (``set_aside``).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec

from draftfleet.store.s3 import WRITER, Bucket, S3Error
from draftfleet.schemas.config import NAME_RE, StoreS3Section
from draftfleet.schemas.records import (BatchRecord, ChargeRecord, DatasetEvent, DatasetManifest, FailureRecord, QuarantineEntry,
                                        ResponseRecord, TurnProgress)
from draftfleet.store.base import FLEET_ENTRIES, MARKER, Store, StoreError, check_batch_id, check_charge_id, check_key, check_name
from draftfleet.store.encoding import (batch_decoder, charge_decoder, encoder, event_decoder, failure_decoder, manifest_decoder,
                                       quarantine_decoder, quarantine_id)

READ_THREADS = 16  # GETs in flight while a view reads every record: latency-bound, not CPU-bound
CONFLICT_RETRIES = 5  # 409 ConditionalRequestConflict: another write of the key was under way
# prepare's race: 2 writers of each of 4 new keys at once, each on a connection of its own. Four
# chances to catch a check-then-write server; not 8 writers of one key, because SeaweedFS 4.48
# makes a third concurrent writer of a key wait about a second (measured: 2-3 s for 8, 40 ms for 4x2)
PROBE_KEYS, PROBE_RACERS = 4, 2
RECORD_RE = re.compile(r"/[0-9a-f]{2}/[0-9a-f]{64}\.json$")
# A multipart upload begun longer ago than this is a dead writer's: a unit's file (GiBs at most) goes
# up in minutes, so a live worker's upload is never this old (ops/scaling.md)
STALE_UPLOAD_S = 24 * 3600
log = logging.getLogger(__name__)


def parse_location(location: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix without slashes at either end)."""
    m = re.match(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?$", location)
    if not m:
        raise StoreError(f"bad store {location!r}: expected s3://bucket/prefix (a bucket name of 3-63 lowercase "
                         f"letters, digits, dots and hyphens)")
    prefix = (m.group(2) or "").strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StoreError(f"bad store {location!r}: the prefix has an empty, '.' or '..' part")
    return m.group(1), prefix


class ObjectStore(Store):
    """The fleet's store in an S3-compatible bucket (AWS S3, Cloudflare R2, SeaweedFS, MinIO)."""

    local = False

    def __init__(self, location: str, options: StoreS3Section | None = None):
        self.bucket_name, self.prefix = parse_location(location)
        self.location = f"s3://{self.bucket_name}/{self.prefix}" if self.prefix else f"s3://{self.bucket_name}"
        self.bucket = Bucket(self.bucket_name, options)
        self._etags: dict[str, str | None] = {}  # dataset -> the ETag its manifest was read with
        self._conditional_delete: bool | None = None  # whether DELETE honours If-Match (None: not probed yet)

    def object_name(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def retry_conflict(self, write):
        """Run ``write``; a 409 (a concurrent write of the key) is tried again."""
        for attempt in range(CONFLICT_RETRIES):
            try:
                return write()
            except S3Error as exc:
                if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise
                time.sleep(0.05 * 2**attempt)

    def create_object(self, key: str, data: bytes, writer: str | None = None) -> bool:
        """Store ``data`` at ``key`` unless something is there: True if stored by ``writer`` (a
        caller's token, the same on each of its calls; by default one for every try of this call)."""
        writer = writer or secrets.token_hex(16)
        try:
            self.retry_conflict(lambda: self.bucket.put(key, data, if_none_match=True, writer=writer))
        except S3Error as exc:
            if exc.status == 412:
                return False
            raise
        return True

    # -- the store's own --------------------------------------------------------------------
    def prepare(self) -> None:
        """Refuse a bucket that cannot be reached or written, a prefix holding what the fleet did
        not make, and a bucket that ignores conditional writes; then mark the prefix and abort
        stale uploads."""
        self.bucket.check_bucket()
        marker = self.object_name(MARKER)
        if not self.bucket.exists(marker):
            top = self.object_name("") if self.prefix else ""
            foreign = []
            for name in self.bucket.list(top, delimiter="/"):
                entry = name[len(top):].rstrip("/")
                if entry in FLEET_ENTRIES or entry == "_probe" or (name.endswith("/") and NAME_RE.match(entry)
                                               and self.bucket.exists(self.object_name(entry, "manifest.json"))):
                    continue
                foreign.append(entry)
                if len(foreign) > 5:
                    break
            if foreign:
                raise StoreError(f"refusing store {self.location}: it holds objects the fleet did not make "
                                 f"({', '.join(foreign[:5])}) and no {MARKER} marker; use an empty prefix")
        self._probe_conditional_writes()
        self.create_object(marker, b'{"draftfleet_store": 1}\n')
        self.abort_stale_uploads()

    def abort_stale_uploads(self) -> int:
        """Abort the multipart uploads under the prefix begun over ``STALE_UPLOAD_S`` ago: a worker
        killed -9 mid-upload leaves its parts billed. A failure is logged, not raised: it loses nothing."""
        top = self.object_name("") if self.prefix else ""
        try:
            aborted = self.bucket.abort_uploads(top, time.time() - STALE_UPLOAD_S)
        except S3Error as exc:
            log.warning("cannot abort stale uploads in %s: %s", self.location, exc)
            return 0
        if aborted:
            log.warning("%s: aborted %d multipart uploads begun over %.0f h ago (writers killed mid-upload)",
                        self.location, aborted, STALE_UPLOAD_S / 3600)
        return aborted

    def _probe_conditional_writes(self) -> None:
        """Write a probe the way the fleet writes: ``If-None-Match`` twice in a row (records), its
        token kept as metadata (a lost answer's 412 told apart), ``If-Match`` with a current then a
        stale ETag (manifests), a DELETE with the stale ETag then the current one (``set_aside``),
        and ``PROBE_RACERS`` writers of each of ``PROBE_KEYS`` new keys at once (a server that
        checks, then writes, lets several win)."""
        probe = self.object_name("_probe", secrets.token_hex(8))
        race = [f"{probe}.race{n}" for n in range(PROBE_KEYS)]
        refuse = f"refusing store {self.location}:"
        advice = "use a bucket or server with conditional writes (ops/scaling.md)"
        try:
            if not self.create_object(probe, b"1") or self.create_object(probe, b"2"):
                raise StoreError(f"{refuse} the bucket ignores If-None-Match (a second conditional PUT of one "
                                 f"key succeeded), so two workers could both store one prompt; {advice}")
            stale, meta = self.bucket.head(probe)
            if WRITER not in meta:
                raise StoreError(f"{refuse} the bucket drops an object's metadata (x-amz-meta-*), so a record whose "
                                 f"answer was lost would be taken for another writer's; {advice}")
            try:
                current = self.retry_conflict(lambda: self.bucket.put(probe, b"3", if_match=stale))
            except S3Error as exc:
                if exc.status != 412:
                    raise
                raise StoreError(f"{refuse} the bucket refused If-Match with the object's current ETag, so no "
                                 f"enqueue could replace a manifest; {advice}") from None
            try:
                self.retry_conflict(lambda: self.bucket.put(probe, b"4", if_match=stale))
            except S3Error as exc:
                if exc.status != 412:
                    raise
            else:
                raise StoreError(f"{refuse} the bucket ignores If-Match (a PUT with a stale ETag succeeded), so "
                                 f"an enqueue could overwrite a manifest another enqueue just wrote; {advice}")
            self._probe_delete(probe, stale, current)
            self._probe_race(race, refuse, advice)
        finally:
            with ThreadPoolExecutor(len(race) + 1) as pool:
                list(pool.map(self._try_delete, (probe, *race)))

    def _probe_delete(self, probe: str, stale: str, current: str) -> bool:
        """Whether DELETE honours If-Match, on ``probe`` (now of ETag ``current``, once ``stale``): a
        delete with the stale ETag must answer 412 and leave it, one with the current ETag remove it.
        Amazon S3 documents it ("How to perform conditional deletes"), SeaweedFS 4.48 does it;
        Cloudflare R2's conditional operations name writes only. Without it ``set_aside`` moves nothing."""
        try:
            self.bucket.delete(probe, if_match=stale)
        except S3Error as exc:
            if exc.status != 412:
                raise
            self.bucket.delete(probe, if_match=current)
            self._conditional_delete = True
        else:
            self._conditional_delete = False
            log.warning("%s: the bucket ignores If-Match on DELETE, so an unreadable record is left where it is, "
                        "for a person to look at and remove (it is then generated again)", self.location)
        return self._conditional_delete

    def _deletes_conditionally(self) -> bool:
        """``_probe_delete``'s answer, probed now on an object of its own if ``prepare`` did not."""
        if self._conditional_delete is None:
            probe = self.object_name("_probe", secrets.token_hex(8))
            try:
                stale = self.bucket.put(probe, b"1")
                self._probe_delete(probe, stale, self.bucket.put(probe, b"2"))
            finally:
                self._try_delete(probe)
        return self._conditional_delete

    def _try_delete(self, key: str) -> None:
        """Delete ``key`` if the bucket lets us: what is left is harmless (a probe under ``_probe/``,
        a second copy of a record set aside)."""
        try:
            self.bucket.delete(key)
        except S3Error:
            pass

    def _probe_race(self, keys: list[str], refuse: str, advice: str) -> None:
        n = len(keys) * PROBE_RACERS
        start = threading.Barrier(n, timeout=60)

        def write(i: int) -> bool:
            start.wait()
            return self.create_object(keys[i % len(keys)], b"racer %d" % i)

        with ThreadPoolExecutor(n) as pool:
            won = [i for i, ok in enumerate(pool.map(write, range(n))) if ok]
        for k, key in enumerate(keys):
            winners = [i for i in won if i % len(keys) == k]
            got = self.bucket.get(key)
            if len(winners) != 1:
                what = f"let {len(winners)} of {PROBE_RACERS} concurrent conditional PUTs of one key succeed"
            elif got is None or got[0] != b"racer %d" % winners[0]:
                what = "kept the bytes of a concurrent conditional PUT it had refused"
            else:
                continue
            raise StoreError(f"{refuse} the bucket {what} (it checks, then writes), so two workers could both "
                             f"store one prompt; {advice}")

    # -- responses -----------------------------------------------------------------------
    def _record_key(self, dataset: str, key: str) -> str:
        check_name(dataset)
        check_key(key)
        return self.object_name(dataset, key[:2], f"{key}.json")

    def has(self, dataset: str, key: str) -> bool:
        return self.bucket.exists(self._record_key(dataset, key))

    def _create(self, dataset: str, key: str, data: bytes) -> bool:
        return self.create_object(self._record_key(dataset, key), data)

    def put(self, record: ResponseRecord, *, writer: str | None = None) -> bool:
        """Write ``record`` once: the conditional PUT and nothing more. The key's failure record is
        left (a DELETE for every record was half of its requests and client CPU, bench store):
        ``failures`` never lists a key with a result, and the reconciler removes it. ``writer`` (the
        task's token) goes on the object as a digest: the token itself stays the task's."""
        check_name(record.dataset)
        check_key(record.key)
        token = hashlib.sha256(writer.encode()).hexdigest()[:32] if writer else None
        return self.create_object(self._record_key(record.dataset, record.key), encoder.encode(record), token)

    def set_aside(self, dataset: str, key: str) -> str | None:
        """Copy the record to ``_unreadable/``, then delete it only if it is still the object copied
        (``If-Match`` on its ETag): a caller whose claim was lost mid-way, while another one set the
        record aside and a good one was stored, deletes nothing and removes its copy (None). In a
        bucket whose DELETE ignores If-Match the record is left in place (None)."""
        src = self._record_key(dataset, key)
        got = self.bucket.head(src)
        if got is None or not self._deletes_conditionally():
            return None
        dst = self.object_name("_unreadable", dataset, f"{key}.{time.time_ns()}.json")
        try:
            self.bucket.copy(src, dst, if_match=got[0])
            self.bucket.delete(src, if_match=got[0])
        except S3Error as exc:
            if exc.status not in (404, 412):
                raise
            self._try_delete(dst)  # gone or replaced since the HEAD: another caller moved it
            return None
        return f"s3://{self.bucket_name}/{dst}"

    def record_bytes(self, dataset: str, key: str) -> bytes:
        got = self.bucket.get(self._record_key(dataset, key))
        if got is None:
            raise FileNotFoundError(errno.ENOENT, "no such record", self.record_location(dataset, key))
        return got[0]

    def record_location(self, dataset: str, key: str) -> str:
        return f"s3://{self.bucket_name}/{self._record_key(dataset, key)}"

    def record_files(self, dataset: str) -> list[str]:
        """Listed shard by shard, side by side (``Bucket.list_sharded``): 100k keys in a row is 100 round trips."""
        return [k for k in self.bucket.list_sharded(self.object_name(check_name(dataset), "")) if RECORD_RE.search(k)]

    def _read(self, name: str) -> bytes | OSError:
        try:
            got = self.bucket.get(name)
        except S3Error as exc:
            return OSError(errno.EIO, str(exc))
        return got[0] if got is not None else FileNotFoundError(errno.ENOENT, "no such object", name)

    def read_many(self, names: Iterable[str]) -> Iterator[tuple[str, bytes | OSError]]:
        names = list(names)
        if len(names) < 2:
            yield from ((n, self._read(n)) for n in names)
            return
        with ThreadPoolExecutor(READ_THREADS) as pool:
            yield from zip(names, pool.map(self._read, names))

    def _documents(self, prefix: str, decoder) -> list:
        """Every object under ``prefix`` decoded (an unreadable one is skipped)."""
        out = []
        for _name, data in self.read_many(self.bucket.list(prefix)):
            if isinstance(data, OSError):
                continue
            try:
                out.append(decoder.decode(data))
            except msgspec.DecodeError:
                continue
        return out

    def datasets(self) -> list[str]:
        top = self.object_name("") if self.prefix else ""
        names = (p[len(top):].rstrip("/") for p in self.bucket.list(top, delimiter="/") if p.endswith("/"))
        return sorted(n for n in names if NAME_RE.match(n) and ".." not in n)

    # -- manifests, failures, progress ----------------------------------------------------
    def manifest(self, dataset: str) -> DatasetManifest | None:
        got = self.bucket.get(self.object_name(check_name(dataset), "manifest.json"))
        self._etags[dataset] = got[1] if got else None
        return manifest_decoder.decode(got[0]) if got else None

    def write_manifest(self, manifest: DatasetManifest) -> None:
        """Replace the manifest if it is still the one this store read (read it first if not)."""
        if manifest.name not in self._etags:
            self.manifest(manifest.name)
        seen = self._etags[manifest.name]
        key = self.object_name(check_name(manifest.name), "manifest.json")
        data = msgspec.json.format(encoder.encode(manifest))
        writer = secrets.token_hex(16)
        try:
            etag = self.retry_conflict(lambda: self.bucket.put(key, data, if_none_match=seen is None, if_match=seen,
                                                                writer=writer))
        except S3Error as exc:
            if exc.status == 412:
                self._etags.pop(manifest.name, None)
                raise StoreError(f"the manifest of {manifest.name} in {self.location} changed while this command "
                                 f"ran (another enqueue?): run it again") from None
            raise
        self._etags[manifest.name] = etag

    def put_failure(self, failure: FailureRecord) -> None:
        key = self.object_name("_failures", check_name(failure.dataset), f"{check_key(failure.key)}.json")
        self.retry_conflict(lambda: self.bucket.put(key, encoder.encode(failure)))

    def all_failures(self, dataset: str) -> list[FailureRecord]:
        return sorted(self._documents(self.object_name("_failures", check_name(dataset), ""), failure_decoder),
                      key=lambda f: f.key)

    def clear_failure(self, dataset: str, key: str) -> None:
        self.bucket.delete(self.object_name("_failures", check_name(dataset), f"{check_key(key)}.json"))

    def _progress_key(self, dataset: str, key: str) -> str:
        return self.object_name("_progress", check_name(dataset), f"{check_key(key)}.json")

    def put_progress(self, progress: TurnProgress) -> None:
        key = self._progress_key(progress.dataset, progress.key)
        self.retry_conflict(lambda: self.bucket.put(key, encoder.encode(progress)))

    def progress(self, dataset: str, key: str) -> TurnProgress | None:
        got = self.bucket.get(self._progress_key(dataset, key))
        try:
            return msgspec.json.decode(got[0], type=TurnProgress) if got else None
        except msgspec.DecodeError:
            return None

    def clear_progress(self, dataset: str, key: str) -> None:
        self.bucket.delete(self._progress_key(dataset, key))

    def progress_keys(self, dataset: str) -> set[str]:
        base = self.object_name("_progress", check_name(dataset), "")
        return {k[len(base):-5] for k in self.bucket.list(base) if k.endswith(".json")}

    # -- what only grows: one object per entry ---------------------------------------------
    def quarantine_location(self, dataset: str) -> str:
        return f"s3://{self.bucket_name}/{self.object_name('_quarantine', check_name(dataset), '')}"

    def quarantined(self, dataset: str) -> Iterator[QuarantineEntry]:
        found = self._documents(self.object_name("_quarantine", check_name(dataset), ""), quarantine_decoder)
        yield from sorted(found, key=lambda e: (e.at, e.file, e.line or 0))

    def quarantine(self, dataset: str, entries: list[QuarantineEntry]) -> None:
        base = ("_quarantine", check_name(dataset))
        for e in entries:  # named by what identifies the rejection: a re-run's is the same object
            name = hashlib.sha256(encoder.encode(quarantine_id(e))).hexdigest()
            self.create_object(self.object_name(*base, f"{name}.json"), encoder.encode(e))

    def put_batch(self, batch: BatchRecord) -> None:
        name = f"{check_batch_id(batch.id)}.json"
        key = self.object_name("_batches", "closed" if batch.closed else "open", name)
        data = encoder.encode(batch)
        self.retry_conflict(lambda: self.bucket.put(key, data))
        if batch.closed:
            self.bucket.delete(self.object_name("_batches", "open", name))

    def open_batch(self, batch_id: str) -> BatchRecord | None:
        got = self.bucket.get(self.object_name("_batches", "open", f"{check_batch_id(batch_id)}.json"))
        try:
            return batch_decoder.decode(got[0]) if got else None
        except msgspec.DecodeError:
            return None

    def batches(self, *, closed: bool = False) -> list[BatchRecord]:
        found = self._documents(self.object_name("_batches", "closed" if closed else "open", ""), batch_decoder)
        return sorted(found, key=lambda b: b.id)

    def put_charge(self, charge: ChargeRecord) -> None:
        self.create_object(self.object_name("_charges", f"{check_charge_id(charge.id)}.json"), encoder.encode(charge))

    def charges(self) -> list[ChargeRecord]:
        return sorted(self._documents(self.object_name("_charges", ""), charge_decoder), key=lambda c: c.id)

    def log(self, event: DatasetEvent) -> None:
        name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.json"
        self.create_object(self.object_name("_log", check_name(event.dataset), name), encoder.encode(event))

    def events(self, dataset: str) -> list[DatasetEvent]:
        return sorted(self._documents(self.object_name("_log", check_name(dataset), ""), event_decoder), key=lambda e: e.at)
