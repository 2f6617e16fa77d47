"""Versions of a dataset: which stored records a reader takes.

``enqueue --new-version`` starts a version with new settings (say ``turns`` "first" → "all");
the records made under the older ones stay in the dataset's folder, each naming its settings by
``settings_id``. Readers of the records (export, capture, the hidden-state export, inventory)
take one version, the current by default, so that one file never mixes two settings (4 rows
gave 8 conversations, each first user turn twice); ``version`` picks another, ``all_versions``
takes every record. The manifest lists the older versions' settings in ``previous``, oldest first,
then the current one's in ``settings`` (its ``version`` is the last number).
"""

from __future__ import annotations

import msgspec

from draftfleet.identity import settings_id
from draftfleet.schemas.records import GenerationSettings, ResponseRecord
from draftfleet.store import Store


class VersionError(ValueError):
    """A version the dataset does not have."""


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The records a reader takes: one version's (``version``, its ``settings``), or every record
    (``version`` None: all versions, or a dataset without a manifest)."""

    version: int | None
    settings: GenerationSettings | None = None
    settings_id: str | None = None

    def takes(self, rec: ResponseRecord) -> bool:
        return self.settings_id is None or rec.settings_id == self.settings_id


def select(store: Store, dataset: str, version: int | None = None, all_versions: bool = False) -> Selection:
    """The current version by default, version ``version``, or every record (``all_versions``)."""
    if version is not None and all_versions:
        raise VersionError("choose a version or all versions, not both")
    manifest = store.manifest(dataset)
    if all_versions or manifest is None:
        if version is not None:
            raise VersionError(f"dataset {dataset!r} has no manifest, so no version {version}")
        return Selection(version=None)
    every = [*manifest.previous, manifest.settings]  # oldest first, the current one last
    first = manifest.version - len(manifest.previous)
    chosen = manifest.version if version is None else version
    if not first <= chosen <= manifest.version:
        raise VersionError(f"dataset {dataset!r} has versions {first} to {manifest.version}, not {chosen}")
    settings = every[chosen - first]
    return Selection(version=chosen, settings=settings, settings_id=settings_id(settings))
