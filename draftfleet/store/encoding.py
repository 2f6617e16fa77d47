"""How the store's documents are encoded, one place for both kinds (folder and bucket)."""

from __future__ import annotations

import msgspec

from draftfleet.schemas.records import (
    ChargeRecord,
    DatasetEvent,
    DatasetManifest,
    FailureRecord,
    QuarantineEntry,
    ResponseRecord,
)

encoder = msgspec.json.Encoder()

record_decoder = msgspec.json.Decoder(ResponseRecord)

failure_decoder = msgspec.json.Decoder(FailureRecord)

manifest_decoder = msgspec.json.Decoder(DatasetManifest)

quarantine_decoder = msgspec.json.Decoder(QuarantineEntry)

event_decoder = msgspec.json.Decoder(DatasetEvent)

charge_decoder = msgspec.json.Decoder(ChargeRecord)


def quarantine_id(e: QuarantineEntry) -> tuple:
    """A rejection's identity: which line of which file, why, and its bytes (not when)."""
    return e.file, e.line, e.kind, e.field, e.raw, e.raw_b64
