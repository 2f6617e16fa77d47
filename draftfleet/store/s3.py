"""The fleet's one S3 client: every call to object storage goes through here.

boto3, not obstore (README, "A store in a bucket"): its ``PutObject`` and
``CompleteMultipartUpload`` take ``IfNoneMatch``/``IfMatch`` (botocore >= 1.36), a low-level
client is documented thread-safe (one is shared by a Celery threads-pool worker), and it survives
``fork`` when a child makes its own client (inventory and report read with a process per core);
obstore's tokio runtime does not (obstore #441: "obstore is not fork safe").

Every failure leaves as one ``S3Error`` line naming the bucket, the object (its key holds a dataset
name and a content hash, nothing secret) and what to do, never a credential: ``PreconditionFailed``
(412, another writer won) and ``Conflict`` (409, a concurrent write: try again) are told apart by
``status``.

A conditional write may be stored while its answer is lost (a connection closed, a read timeout):
botocore's standard retry mode sends it again (``retries/standard.py``: ``ConnectionError`` and
``HTTPClientError`` are transient), and the server answers that retry 412, as to another writer.
So each conditional write carries a token of its own as the object's metadata (``WRITER``), and a
412 is this write's own when one HEAD finds its token on the object.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from draftfleet.schemas.config import StoreS3Section
from draftfleet.store.base import StoreError


_HEX = "0123456789abcdef"
_SHARDS = frozenset(a + b for a in _HEX for b in _HEX)  # a record's folder: the first two hex digits of its key


class S3Error(StoreError):
    """An S3 request failed; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, code: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code


def _boto():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
        import botocore.session
        import botocore.utils
    except ImportError as exc:  # an extra: a file store needs none of it
        raise S3Error("an s3:// store needs boto3: pip install 'draftfleet[s3]'") from exc
    return boto3, botocore


WRITER = "draftfleet-write"  # x-amz-meta-draftfleet-write: the token of the conditional write that stored the object
EXPECT_MIN = 1 << 20  # a request body this large waits for the server's 100 Continue first


def _expect_large_bodies(params, **_):
    """botocore has every PUT or POST body wait for ``100 Continue`` ("Any file like object will use
    an expect 100-continue header regardless of size", ``handlers.add_expect_header``): one server
    turn more per record, a quarter of its client CPU (bench store). Kept from ``EXPECT_MIN`` bytes
    up, where a 412 then spares the upload."""
    headers = params["headers"]
    if "Expect" in headers:
        size = _boto()[1].utils.determine_content_length(params["body"])
        if size is not None and size < EXPECT_MIN:
            del headers["Expect"]


def _timestamp(value):
    """An ISO 8601 time (a listing's LastModified, one per key) by the standard library; others by
    botocore's own parser, whose dateutil took three quarters of a listing's client CPU."""
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if when.tzinfo is not None:
                return when
    return _boto()[1].utils.parse_timestamp(value)


class Bucket:
    """One bucket through one boto3 client per process (made again after a fork)."""

    def __init__(self, bucket: str, options: StoreS3Section | None = None):
        self.bucket = bucket
        self.options = options or StoreS3Section()
        self._client = None
        self._pid = 0
        self._lock = threading.Lock()

    def __getstate__(self):  # a process pool's child gets the settings, and makes its own client
        return {"bucket": self.bucket, "options": self.options}

    def __setstate__(self, state):
        self.__init__(state["bucket"], state["options"])

    @property
    def endpoint(self) -> str:
        return self.options.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"

    def client(self):
        if self._client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    boto3, botocore = _boto()
                    core = botocore.session.Session()
                    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
                    session = boto3.session.Session(botocore_session=core, profile_name=self.options.profile)
                    cfg = botocore.config.Config(
                        retries={"mode": "standard", "max_attempts": 5},
                        connect_timeout=10, read_timeout=60,
                        max_pool_connections=64,  # a threads-pool worker's concurrency, not boto's 10
                        # only where the operation needs one (botocore 1.36 default "when_supported" sends
                        # CRC32 trailers that several S3-compatible servers reject)
                        request_checksum_calculation="when_required", response_checksum_validation="when_required",
                        # the calls are this module's own; botocore's Config: "You can disable parameter
                        # validation for performance reasons" (a twentieth of a record's client CPU)
                        parameter_validation=False,
                    )
                    client = session.client("s3", endpoint_url=self.options.endpoint,
                                            region_name=self.options.region, config=cfg)
                    client.meta.events.register_last("before-call.s3", _expect_large_bodies)  # after botocore's
                    self._client = client
                    self._pid = os.getpid()
        return self._client

    # -- errors ---------------------------------------------------------------------------
    def _error(self, exc: Exception, what: str) -> S3Error:
        """One line for a failed request; the secret key never appears in botocore's messages."""
        _, botocore = _boto()
        where = f"s3://{self.bucket} at {self.endpoint}"
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return S3Error(f"no credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                           f"(or [store.s3] profile)")
        if isinstance(exc, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError)):
            return S3Error(f"cannot reach {where}: check [store.s3] endpoint or AWS_ENDPOINT_URL")
        if isinstance(exc, botocore.exceptions.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code == "NoSuchBucket":
                return S3Error(f"no bucket {self.bucket!r} at {self.endpoint}: create it first", status, code)
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return S3Error(f"{where} refused the credentials ({code}): check AWS_ACCESS_KEY_ID and "
                               f"AWS_SECRET_ACCESS_KEY", status, code)
            if code == "AccessDenied" or status == 403:
                return S3Error(f"access denied to {where} ({what}): the credentials may not read and write it",
                               status, code)
            return S3Error(f"{what} in {where} failed: {status} {code}", status, code)
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return S3Error(f"{what} in {where} failed: {exc}")
        raise exc

    def _call(self, what: str, fn, **kw):
        _, botocore = _boto()
        try:
            return fn(Bucket=self.bucket, **kw)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._error(exc, what) from None

    # -- objects --------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag; None when there is none."""
        try:
            r = self._call(f"reading {key}", self.client().get_object, Key=key)
        except S3Error as exc:
            if exc.status == 404 and exc.code in ("NoSuchKey", "404"):
                return None
            raise
        return r["Body"].read(), r["ETag"]

    def head(self, key: str) -> tuple[str, dict[str, str]] | None:
        """The object's ETag and metadata (``x-amz-meta-*``, named in lower case); None when there is none."""
        try:
            r = self._call(f"looking up {key}", self.client().head_object, Key=key)
        except S3Error as exc:
            if exc.status == 404:
                return None
            raise
        return r["ETag"], r.get("Metadata", {})

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def _written(self, exc: S3Error, key: str, writer: str | None) -> str:
        """The ETag of ``key`` when the conditional write refused with ``exc`` (412, or a completion's
        404 ``NoSuchUpload``) was stored after all, by an earlier try of its own whose answer was
        lost: the object carries ``writer``. Otherwise ``exc`` is raised (another writer's object)."""
        refused = exc.status == 412 or exc.code == "NoSuchUpload"
        got = self.head(key) if writer and refused else None
        if got is None or got[1].get(WRITER) != writer:
            raise exc
        return got[0]

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None,
            writer: str | None = None) -> str:
        """Store ``data`` at ``key``: its new ETag. ``if_none_match``: only if nothing is there;
        ``if_match``: only if the object still has that ETag (412 ``S3Error`` otherwise). ``writer``:
        a token unique to the writer, the same on each try of its write (botocore's, 409's, the
        caller's own), stored with the object so that a 412 answering a retry of a write that was
        stored is told from another writer's."""
        cond = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match} if if_match else {}
        meta = {"Metadata": {WRITER: writer}} if writer else {}
        try:
            return self._call(f"writing {key}", self.client().put_object, Key=key, Body=data, **cond, **meta)["ETag"]
        except S3Error as exc:
            return self._written(exc, key, writer)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete ``key``; with ``if_match`` only if it still has that ETag (412 otherwise, or 404 when
        nothing is there: SeaweedFS answers 412, S3 404; user guide, "How to perform conditional deletes")."""
        cond = {"IfMatch": if_match} if if_match else {}
        self._call(f"deleting {key}", self.client().delete_object, Key=key, **cond)

    def copy(self, src: str, dst: str, *, if_match: str | None = None) -> None:
        """Copy ``src`` to ``dst``; with ``if_match`` only if ``src`` still has that ETag (412 otherwise)."""
        self._call(f"copying {src}", self.client().copy_object, Key=dst, CopySource={"Bucket": self.bucket, "Key": src},
                   **({"CopySourceIfMatch": if_match} if if_match else {}))

    def _pages(self, prefix: str, delimiter: str | None = None) -> Iterator[dict]:
        """The listing's pages under ``prefix`` (1,000 keys a request), each token naming the next."""
        kw = {"Prefix": prefix, **({"Delimiter": delimiter} if delimiter else {})}
        token = None
        while True:
            page = self._call(f"listing {prefix}", self.client().list_objects_v2, **kw,
                              **({"ContinuationToken": token} if token else {}))
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def list(self, prefix: str, delimiter: str | None = None) -> Iterator[str]:
        """Every key under ``prefix``, or with ``delimiter`` the common prefixes too."""
        for page in self._pages(prefix, delimiter):
            for obj in page.get("Contents", ()):
                yield obj["Key"]
            for p in page.get("CommonPrefixes", ()):
                yield p["Prefix"]

    def list_sharded(self, prefix: str, *, sized: bool = False) -> list:
        """Every key under ``prefix<hh>/`` (the 256 two-hex-digit shard folders of a dataset's
        records or a capture version's hidden states), sorted; with ``sized``, (key, size,
        last-modified time) as ``list_sized`` gives. A listing is a chain of pages, each token naming
        the next: one round trip per 1,000 keys in a row. Up to 1,000 keys are the first page alone;
        beyond, the 16 prefixes ``prefix0`` .. ``prefixf`` are listed side by side (bench/store.py:
        16 chains hide the round trips; 256 one-page shard listings were no faster, with more requests)."""
        first = self._call(f"listing {prefix}", self.client().list_objects_v2, Prefix=prefix)
        if first.get("IsTruncated"):
            listing = self.list_sized if sized else self.list
            with ThreadPoolExecutor(len(_HEX)) as pool:
                found = [e for part in pool.map(lambda d: list(listing(prefix + d)), _HEX) for e in part]
        else:
            found = [_sized(o) if sized else o["Key"] for o in first.get("Contents", ())]
        n = len(prefix)
        keys = (e[0] for e in found) if sized else found
        return [e for e, k in zip(found, keys) if k[n:n + 2] in _SHARDS and k[n + 2:n + 3] == "/"]

    def check_bucket(self) -> None:
        """Refuse a missing bucket, a wrong endpoint and missing or refused credentials, in one line."""
        try:
            self._call("opening the bucket", self.client().head_bucket)
        except S3Error as exc:  # HEAD answers carry no body: the status alone tells
            if exc.status == 404:
                raise S3Error(f"no bucket {self.bucket!r} at {self.endpoint}: create it first", 404) from None
            if exc.status in (400, 401, 403):
                raise S3Error(f"access denied to s3://{self.bucket} at {self.endpoint} ({exc.status}): check "
                              f"AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and the bucket's policy", exc.status) from None
            raise

    # -- files: written once from an open descriptor, read back in ranges or streams -------------
    PART_SIZE = 64 << 20  # a multipart upload's part, what one request holds in memory
    MIN_PART = 5 << 20  # S3's least part size (all parts but the last)

    def put_file(self, key: str, fd: int, *, part_size: int | None = None,
                 sealed: tuple[bytes, str] | None = None, writer: str | None = None) -> str:
        """Store the file open on ``fd`` at ``key`` only if nothing is there: its ETag; a 412
        ``S3Error`` when another writer stored it first, 409 when one was storing it at that moment.

        The bytes are read with ``pread`` on ``fd``, never through a path: the file stored is the
        one held. Up to ``part_size`` (default ``PART_SIZE``) it is one ``PutObject`` with
        ``If-None-Match: *``; a larger one goes up in parts and becomes visible by
        ``CompleteMultipartUpload`` with the same condition; a failed multipart upload is aborted,
        so no parts are left billed. Every body byte handed to a request counts in ``sent_bytes``.
        ``sealed`` (head, sha256 hex): the file must start with ``head`` and the bytes after it must
        hash to the digest, checked on the bytes sent before the object can become visible
        (``OSError`` otherwise, nothing stored). ``writer``: as ``put``'s, for the one PUT or the
        completion (a retried ``CompleteMultipartUpload`` of an upload completed is refused 412, or
        404 ``NoSuchUpload``)."""
        part = max(part_size or self.PART_SIZE, self.MIN_PART)
        meta = {"Metadata": {WRITER: writer}} if writer else {}
        size = os.fstat(fd).st_size
        seal = _Seal(*sealed) if sealed else None
        if size <= part:
            data = _pread_all(fd, size, 0)
            if seal:
                seal.update(0, data)
                seal.check(key)
            try:
                return self._call(f"writing {key}", self.client().put_object, Key=key, Body=data,
                                  IfNoneMatch="*", **meta)["ETag"]
            except S3Error as exc:
                return self._written(exc, key, writer)
            finally:
                self._sent(len(data))
        client = self.client()
        upload = self._call(f"starting an upload of {key}", client.create_multipart_upload, Key=key,
                            **meta)["UploadId"]
        try:
            parts = []
            for number, offset in enumerate(range(0, size, part), 1):
                data = _pread_all(fd, min(part, size - offset), offset)
                if seal:
                    seal.update(offset, data)
                try:
                    r = self._call(f"writing part {number} of {key}", client.upload_part, Key=key, UploadId=upload,
                                   PartNumber=number, Body=data)
                finally:
                    self._sent(len(data))
                parts.append({"PartNumber": number, "ETag": r["ETag"]})
            if seal:
                seal.check(key)
            try:
                return self._call(f"writing {key}", client.complete_multipart_upload, Key=key, UploadId=upload,
                                  MultipartUpload={"Parts": parts}, IfNoneMatch="*")["ETag"]
            except S3Error as exc:
                return self._written(exc, key, writer)
        except BaseException:
            try:
                self._call(f"aborting the upload of {key}", client.abort_multipart_upload, Key=key, UploadId=upload)
            except S3Error:
                pass  # the bucket's lifecycle rule for incomplete uploads is the last resort
            raise

    sent_bytes = 0  # body bytes put_file handed to requests, this process (bytes uploaded / bytes stored)

    def _sent(self, n: int) -> None:
        with self._lock:
            self.sent_bytes += n

    def get_range(self, key: str, start: int, length: int) -> tuple[bytes, int] | None:
        """Up to ``length`` bytes of the object from ``start`` and its whole size; None when there is none."""
        try:
            r = self._call(f"reading {key}", self.client().get_object, Key=key,
                           Range=f"bytes={start}-{start + length - 1}")
        except S3Error as exc:
            if exc.status == 404:
                return None
            if exc.status == 416:  # nothing at start (an empty object)
                return b"", start
            raise
        whole = str(r.get("ContentRange") or "").rpartition("/")[2]
        return r["Body"].read(), int(whole) if whole.isdigit() else int(r["ContentLength"])

    def open(self, key: str):
        """The object's body as a stream (``read(n)``) and its size; None when there is none."""
        try:
            r = self._call(f"reading {key}", self.client().get_object, Key=key)
        except S3Error as exc:
            if exc.status == 404:
                return None
            raise
        return r["Body"], int(r["ContentLength"])

    def abort_uploads(self, prefix: str, begun_before: float) -> int:
        """Abort every multipart upload under ``prefix`` initiated before ``begun_before`` (a Unix
        time; the parts of a writer killed mid-upload, billed until aborted): how many were."""
        client, kw, aborted = self.client(), {"Prefix": prefix}, 0
        while True:
            page = self._call(f"listing the uploads under {prefix}", client.list_multipart_uploads, **kw)
            for up in page.get("Uploads", ()):
                if up["Initiated"].timestamp() >= begun_before:
                    continue
                try:
                    self._call(f"aborting the upload of {up['Key']}", client.abort_multipart_upload, Key=up["Key"],
                               UploadId=up["UploadId"])
                    aborted += 1
                except S3Error as exc:
                    if exc.status != 404:  # NoSuchUpload: aborted meanwhile (another reconciler)
                        raise
            if not page.get("IsTruncated"):
                return aborted
            kw.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def list_sized(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, last-modified time) of every object under ``prefix``."""
        for page in self._pages(prefix):
            yield from map(_sized, page.get("Contents", ()))


class _Seal:
    """A file's bytes as they are sent, fed in order: the first ones must be ``head`` (the header
    as written), the rest must hash to ``want`` (the sha256 of the data section checked)."""

    def __init__(self, head: bytes, want: str):
        self.head, self.want, self.h, self.same = head, want, hashlib.sha256(), True

    def update(self, offset: int, data: bytes) -> None:
        view, n = memoryview(data), len(self.head)
        if offset < n:
            self.same = self.same and view[:n - offset] == self.head[offset:offset + len(data)]
        skip = max(0, n - offset)
        if skip < len(data):
            self.h.update(view[skip:])

    def check(self, key: str) -> None:
        if not self.same or self.h.hexdigest() != self.want:
            raise OSError(errno.EIO, f"the file for {key} changed after it was checked (its header is not the one "
                          "written or its bytes no longer hash to the digest sealed): not stored")


def _sized(obj: dict) -> tuple[str, int, float]:
    return obj["Key"], int(obj["Size"]), obj["LastModified"].timestamp()


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    """Exactly ``n`` bytes at ``offset`` of ``fd`` (a file that shrank meanwhile: ``OSError``)."""
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise OSError(errno.EIO, f"the file shrank while it was uploaded ({offset + got} of {offset + n} bytes)")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
