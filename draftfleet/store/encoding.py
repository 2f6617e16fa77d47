"""How the store's documents are encoded, one place for both kinds (folder and bucket)."""

from __future__ import annotations

import msgspec

from draftfleet.schemas.records import (
    BatchRecord,
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

batch_decoder = msgspec.json.Decoder(BatchRecord)

BATCH_ID_RE_TEXT = r"^b[0-9]{20}-[0-9a-f]{8}$"


def quarantine_id(e: QuarantineEntry) -> tuple:
    """A rejection's identity: which line of which file, why, and its bytes (not when)."""
    return e.file, e.line, e.kind, e.field, e.raw, e.raw_b64
