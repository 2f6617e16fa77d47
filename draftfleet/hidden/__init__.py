"""Hidden states: the EAGLE-3 features of stored records, one write-once file per record turn.

Layout under the store root (beside the records, never inside a dataset's shards)::

    _hidden/<dataset>/v<N>/capture.json                      CaptureManifest: model, layers
    _hidden/<dataset>/v<N>/<key[:2]>/<key>.<turn>.safetensors

The unit is (record key, turn index): a single-turn record has turn 0; a conversation one file
per regenerated turn, or, where each turn's prompt and answer ids are the start of the next turn's
prompt (a template that keeps the history as generated) and the version captures conversations
(``units = "conversation"``), ONE file over its last turn's whole sequence:
``<key>.conversation.safetensors``. Causal attention makes a position's states depend only on the
ids up to it, so that file holds every turn's states once, where per-turn files would compute and
store the shared history again for every turn. A template that rewrites the history (Kimi-K2.5
blanks earlier reasoning) or an answer whose ids are not the tokenizer's own encoding of its text
breaks the prefix: that conversation is captured per turn (:func:`conversation_spans` says why).

A file holds ``token_ids`` int64 [T] (the unit's prompt ids then its output ids, as stored) and ``hidden_states`` [T, L, H] in the version's dtype: bf16, or float8
e4m3 with ``hidden_states_scales`` float32 [T, 1, 1] (one scale per token, amax / 448, the layout
speculators' hs-connectors reads and dequantizes as ``fp8.to(bf16) * scale``). The auxiliary layers in ascending
order, then the last layer's output BEFORE the final norm (vLLM/speculators layer ids, where id k
is the residual stream entering decoder layer k and id N the last layer's output; README,
"Hidden states (EAGLE-3 features)"). That is speculators' own per-row layout, so its export is a copy; SpecForge's
post-norm last layer is derived from it at export (the norm cannot be undone, so the pre-norm
state is the one kept). The header metadata names the key, the turn (``conversation``), the
answers' ``spans`` (``[[start, end], ..]`` in the ids: one per turn, the trainers' loss mask) and
``prompt_len`` (the first span's start).

Files are written once, by the engine's connector, on the store's file system: the worker writes
the unit's metadata into the room the connector leaves in the header (in place, same length), with
the seal over that header and the data it checked (:func:`file_seal`: a file of a version made with
seals that lacks a good one is changed, and bad to every reader), fsyncs, and ``link``s the file
to its name (fails if the target exists), so of two workers capturing the same unit exactly one
file is stored, and the states cross the disk once. A version holds one capture setting (model
identity, layer ids, dtype); other settings need a new version (``--new-version``).

The package: the file format and its seal (``format.py``), what a capture computes from a record
(``target.py``), the interface (``base.py``) and its two kinds, the folder's (``folder.py``) and a
bucket's (``bucket.py``); :func:`open_hidden` picks the store's.
"""

from __future__ import annotations

from draftfleet.schemas.records import CONVERSATION
from draftfleet.store import Store
from draftfleet.hidden.format import (DIGEST_KEY, DTYPES, HEADER_ROOM, MAX_HEADER, ROOM_KEY, Read, SCALES, SEAL,
                                      SEAL_KEY, bf16_to_f32, check_seal, checked_header, encode_safetensors,
                                      f32_to_bf16, file_seal, fp8_to_f32, header_length, parse_header, read_checked,
                                      read_safetensors, read_tensor, read_through, rewrite_metadata)
from draftfleet.hidden.target import (CaptureError, FINAL_NORM_NAMES, Spans, TargetModel, bytes_per_token,
                                      capture_settings, conversation_spans, default_aux_layers, file_spans, loss_mask,
                                      measured_bytes_per_token, projected_bytes, record_units)
from draftfleet.hidden.base import (FILE_RE, HIDDEN_DIR, Hidden, MANIFEST, StoredFile, held_turns, manifest_decoder)
from draftfleet.hidden.folder import (HiddenStore, check_storage, storage_path)

__all__ = ["CONVERSATION", "CaptureError", "DIGEST_KEY", "DTYPES", "FILE_RE", "FINAL_NORM_NAMES", "HEADER_ROOM",
           "HIDDEN_DIR", "Hidden", "HiddenStore", "MANIFEST", "MAX_HEADER", "ROOM_KEY", "Read", "SCALES", "SEAL",
           "SEAL_KEY", "Spans", "StoredFile", "TargetModel", "bf16_to_f32", "bytes_per_token", "capture_settings",
           "check_seal", "check_storage", "checked_header", "conversation_spans", "default_aux_layers",
           "encode_safetensors", "f32_to_bf16", "file_seal", "file_spans", "fp8_to_f32", "header_length",
           "held_turns", "loss_mask", "manifest_decoder", "measured_bytes_per_token", "open_hidden", "parse_header",
           "projected_bytes", "read_checked", "read_safetensors", "read_tensor", "read_through", "record_units",
           "rewrite_metadata", "storage_path"]


def open_hidden(store: Store) -> Hidden:
    """The hidden states of ``store``, in its folder or in its bucket."""
    if store.local:
        return HiddenStore(store)
    from draftfleet.hidden.bucket import BucketHidden

    return BucketHidden(store)
