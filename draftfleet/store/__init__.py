"""The store: one JSON document per prompt key, the fleet's source of truth.

``Store`` (``base.py``) is what tasks, capture, views and exports use; ``open_store`` picks the kind
from the ``[fleet] store`` setting: a folder (``FileStore``, ``folder.py``, the default) or
``s3://bucket/prefix`` (``ObjectStore``, ``bucket.py``, through the one S3 client in ``s3.py``),
which keeps the same layout under its prefix. Both encode their documents through ``encoding.py``.

Layout under the root::

    <dataset>/manifest.json            settings the dataset's keys were made with
    <dataset>/<key[:2]>/<key>.json     one ResponseRecord per key, write-once
    _failures/<dataset>/<key>.json     tasks whose retries ran out (re-queueable)
    _unreadable/<dataset>/<key>.<ns>.json   record files that could not be read, set aside
    _quarantine/<dataset>.jsonl        input lines that were rejected, verbatim
    _log/<dataset>.jsonl               pivots, drains and budget changes, for the report
    _progress/<dataset>/<key>.json     completed turns of a conversation still being generated, or
                                       stopped by the budget (no result yet: it goes on when raised)
    _charges/<id>.json                 generations paid for that no record carries (the spend's rest)
    _hidden/<dataset>/v<N>/...         captured hidden states, one file per record turn (draftfleet.hidden)
    .draftfleet-store                  marker: this folder is a fleet store (see ``Store.prepare``)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from draftfleet.store.base import (KEY_RE, MARKER, Store, StoreError, check_charge_id, check_key, check_name,
                                   new_charge_id)
from draftfleet.store.folder import DIR_MODE, FILE_MODE, FileStore, link_once, make_dirs, write_once

if TYPE_CHECKING:
    from draftfleet.schemas.config import FleetConfig

__all__ = ["DIR_MODE", "FILE_MODE", "KEY_RE", "MARKER", "FileStore", "Store", "StoreError", "check_charge_id",
           "check_key", "check_name", "link_once", "make_dirs", "new_charge_id", "open_store", "write_once"]


def open_store(where: FleetConfig | str | Path) -> Store:
    """The store a config (its ``[fleet] store`` and ``[store.s3]``) or a location names: the one
    way every command, worker, view and test opens it."""
    options = None
    if not isinstance(where, (str, Path)):
        options, where = where.store.s3, where.fleet.store
    if isinstance(where, str) and where.startswith("s3://"):
        from draftfleet.store.bucket import ObjectStore

        return ObjectStore(where, options)
    return FileStore(where)
