"""What every kind of hidden store is: the interface, its layout's names, what a listing holds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import NamedTuple

import msgspec

from draftfleet.schemas.records import CONVERSATION, CaptureManifest


HIDDEN_DIR = "_hidden"

MANIFEST = "capture.json"

FILE_RE = re.compile(r"^([0-9a-f]{64})\.(\d+|conversation)\.safetensors$")

manifest_decoder = msgspec.json.Decoder(CaptureManifest)


# -- the store ------------------------------------------------------------------------------
class StoredFile(NamedTuple):
    """One stored file of a version: its unit, the record turns it holds, tokens, bytes, mtime."""

    key: str
    turn: int
    path: str
    turns: int
    tokens: int
    bytes: int
    mtime: float


class Hidden:
    """What every kind of hidden store shares: totals from ``entries``. ``open_hidden`` gives the
    store's kind: files under the store's folder (:class:`HiddenStore`) or objects in its bucket
    (``hidden.bucket.BucketHidden``), with the same methods and the same layout."""

    local = True

    def entries(self, dataset: str, version: int) -> Iterator[StoredFile]:
        raise NotImplementedError

    def versions(self, dataset: str) -> list[int]:
        raise NotImplementedError

    def _manifest_bytes(self, dataset: str, version: int) -> bytes | None:
        raise NotImplementedError

    def manifest(self, dataset: str, version: int | None = None) -> CaptureManifest | None:
        """The manifest of ``version`` (default: the latest), None when nothing was captured."""
        if version is None:
            versions = self.versions(dataset)
            if not versions:
                return None
            version = versions[-1]
        data = self._manifest_bytes(dataset, version)
        return manifest_decoder.decode(data) if data is not None else None

    def sealed(self, dataset: str, version: int) -> bool:
        """Whether every file of the version must carry a seal: it was made since files were sealed
        (its manifest's ``seal``); a missing or wrong seal is then a changed file, never "unsealed"."""
        m = self.manifest(dataset, version)
        return m is not None and m.seal > 0

    def usage(self, dataset: str, version: int) -> tuple[int, int, int]:
        """(files, tokens, bytes) of a version: sizes from the listing, tokens from each header."""
        u = self.turn_usage(dataset, version)
        return u[0], u[2], u[3]

    def turn_usage(self, dataset: str, version: int) -> tuple[int, int, int, int]:
        """(files, record turns they hold, tokens, bytes): a conversation's file holds all its turns."""
        files = turns = tokens = size = 0
        for e in self.entries(dataset, version):
            files, turns, tokens, size = files + 1, turns + e.turns, tokens + e.tokens, size + e.bytes
        return files, turns, tokens, size


def held_turns(header: dict, turn: int) -> int:
    """The record turns a stored file holds: a conversation's file all of its answers' spans."""
    return len(json.loads((header.get("__metadata__") or {})["spans"])) if turn == CONVERSATION else 1
