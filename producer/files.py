"""Dataset files opened as the readers need them: regular files only, gzip and zstd found by their
magic bytes and decompressed a few KiB at a time, a format not read here refused in one line.

A FIFO would block the open and ``/dev/zero`` would never end, so only regular files are read; a
truncated or corrupt compressed stream is an error, never a quiet early end, and what one read can
expand is bounded (zstd's worst case is ~32,000:1), so a small compressed file cannot blow memory up.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import zlib
from pathlib import Path
from typing import BinaryIO

STREAM_CHUNK = 1 << 20


_FILE_TYPES = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def open_regular(path: str | Path) -> io.BufferedReader:
    """Open a dataset file for reading, refusing anything but a regular file: a FIFO would block
    the open itself (hence O_NONBLOCK) and ``/dev/zero`` would never end."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = _FILE_TYPES.get(stat.S_IFMT(mode), "not a regular file")
            code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
            raise OSError(code, f"{what}, not a regular file" if what != "a directory" else "Is a directory", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# Magic bytes of the compressions read (gzip, zstd) and of those named in a refusal.
_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}


_UNREAD_MAGIC = {b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"PK\x03\x04": "a zip archive",
                 b"PAR1": "parquet (set format = \"parquet\")"}


def compression(f: io.BufferedReader) -> str | None:
    """``gzip`` or ``zstd`` when the open file starts with that format's magic bytes (names lie)."""
    head = f.peek(4)[:4]
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), None)


def open_text(path: str | Path) -> io.BufferedReader:
    """``open_regular``, decompressed when the file is gzip or zstd: the bytes a reader parses. A file
    in a compression (or format) not read here is an ``OSError`` that names it."""
    f = open_regular(path)
    try:
        kind = compression(f)
        if kind:
            return io.BufferedReader(_Inflating(f, kind), STREAM_CHUNK)
        head = f.peek(6)[:6]
        other = next((k for magic, k in _UNREAD_MAGIC.items() if head.startswith(magic)), None)
        if other:
            raise OSError(errno.EINVAL, f"the file is {other}: datasets are read as JSON Lines, a JSON array "
                          "or parquet, plain or gzip/zstd-compressed", str(path))
        return f
    except BaseException:
        f.close()
        raise


_INFLATE_INPUT = 4096
"""Compressed bytes fed to the decompressor at a time: what one call can expand is bounded by it
(zstd's worst case is ~32,000:1), so a small compressed file cannot blow memory up."""


class _Inflating(io.RawIOBase):
    """A gzip or zstd file as its decompressed bytes, member after member (``cat a.gz b.gz`` and
    multi-frame zstd are one stream). A stream that stops mid-member or holds corrupt data raises
    ``OSError`` naming the compression, so the reader reports it instead of ending early."""

    def __init__(self, f: BinaryIO, kind: str) -> None:
        self._f, self._kind = f, kind
        self._d = self._decompressor()
        self._out = b""
        self._pending = b""
        self._mid = False  # inside a member: its end has not been seen
        self._cut = False  # the file ended mid-member: an end reported once, then the error

    def _decompressor(self):
        if self._kind == "gzip":
            return zlib.decompressobj(wbits=31)
        try:
            from compression import zstd  # Python 3.14+
            return zstd.ZstdDecompressor()
        except ImportError:
            import zstandard
            return zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()
        super().close()

    def readinto(self, b) -> int:
        while not self._out:
            if not self._pending:
                self._pending = self._f.read(_INFLATE_INPUT)
                if not self._pending:
                    if self._cut:
                        raise OSError(errno.EIO, f"the {self._kind} stream ends early: the file is truncated")
                    self._cut = self._mid  # first an end, so the lines before the cut are read
                    return 0
            if not self._mid and not self._pending.strip(b"\0"):
                self._pending = b""  # zero padding after the last member (tape-style writers)
                continue
            if self._d.eof:
                self._d = self._decompressor()
            data, self._pending = self._pending[:_INFLATE_INPUT], self._pending[_INFLATE_INPUT:]
            try:
                self._out = self._d.decompress(data)
            except Exception as exc:  # zlib.error, ZstdError: the data is not what its magic promised
                raise OSError(errno.EIO, f"corrupt {self._kind} data: {exc}") from None
            self._mid = not self._d.eof
            if self._d.eof:
                self._pending = self._d.unused_data + self._pending
        n = min(len(b), len(self._out))
        b[:n], self._out = self._out[:n], self._out[n:]
        return n
