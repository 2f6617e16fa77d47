"""What a capture computes: the target model's layers, a record's units and their ids, their size.

The auxiliary layers in ascending order, then the last layer's output BEFORE the final norm
(vLLM/speculators layer ids, where id k is the residual stream entering decoder layer k and id N
the last layer's output; README, "Hidden states (EAGLE-3 features)"). A unit is (record key,
turn): a conversation whose turns' ids prefix each other is captured once over its last turn
(:func:`conversation_spans` says when not), and the answers' ``spans`` are the trainers' loss mask.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import numpy as np

from draftfleet.conversation import record_turns, turn_prompts
from draftfleet.schemas.config import FleetConfig
from draftfleet.schemas.records import CaptureManifest, ResponseRecord
from draftfleet.tokenizer import TargetTokenizer, TokenizerError
from draftfleet.hidden.format import checked_header, read_tensor, bf16_to_f32


# Where transformers checkpoints keep the final norm (text models; multimodal ones such as Kimi-K2.5)
FINAL_NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


class CaptureError(ValueError):
    """A capture that cannot run as asked (other settings in the store, a model folder unread)."""


# -- layers and the target model ---------------------------------------------------------------
def default_aux_layers(num_layers: int) -> list[int]:
    """The aux layer ids SpecForge and speculators both use: r_2, r_{N/2}, r_{N-3} (vLLM ids)."""
    return [2, num_layers // 2, num_layers - 3]


class TargetModel(msgspec.Struct, frozen=True, kw_only=True):
    """What capture needs to know of the target, read from its folder's ``config.json``."""

    path: str
    num_layers: int
    hidden_size: int
    rms_norm_eps: float
    config_sha256: str
    vocab_size: int = 0  # 0: config.json names none

    @classmethod
    def load(cls, path: str | Path) -> TargetModel:
        p = Path(path) / "config.json"
        try:
            raw = p.read_bytes()
            cfg = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise CaptureError(f"{p}: cannot read the target model's config ({exc})") from None
        text = cfg.get("text_config") or cfg  # multimodal targets (Kimi-K2.5) nest the language model
        try:
            return cls(path=str(path), num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                       rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), config_sha256=hashlib.sha256(raw).hexdigest(),
                       vocab_size=int(text.get("vocab_size") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CaptureError(f"{p}: no num_hidden_layers/hidden_size ({exc})") from None

    def layer_ids(self, aux: list[int] | None) -> list[int]:
        """The ids vLLM is asked for: the aux layers ascending, then N (the pre-norm last layer)."""
        ids = sorted(aux if aux else default_aux_layers(self.num_layers))
        if len(set(ids)) != len(ids) or ids[0] < 1 or ids[-1] >= self.num_layers:
            raise CaptureError(f"aux layer ids {ids}: need distinct ids within 1..{self.num_layers - 1} "
                               f"for a {self.num_layers}-layer target")
        return [*ids, self.num_layers]

    def final_norm_weight(self) -> np.ndarray:
        """The final norm's weight as float32, from the model folder's safetensors files."""
        folder = Path(self.path)
        index = folder / "model.safetensors.index.json"
        try:
            where = json.loads(index.read_text())["weight_map"] if index.exists() else None
            for name in FINAL_NORM_NAMES:
                file = folder / (where[name] if where else "model.safetensors") if not where or name in where else None
                if file is None:
                    continue
                header, offset = checked_header(file)
                if name in header:
                    with open(file, "rb") as fh:
                        w = read_tensor(fh, header[name], offset)
                    return bf16_to_f32(w) if header[name]["dtype"] == "BF16" else w.astype(np.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise CaptureError(f"{folder}: cannot read the final norm weight ({exc})") from None
        raise CaptureError(f"{folder}: none of {', '.join(FINAL_NORM_NAMES)} in its weights")


def capture_settings(cfg: FleetConfig) -> tuple[TargetModel, list[int]]:
    """The target model and the layer ids this fleet captures with (``[capture]``)."""
    path = cfg.capture.model_path or (cfg.vllm.launch.model_path if cfg.vllm and cfg.vllm.launch else None)
    if not path:
        raise CaptureError(f"{cfg.path}: capture needs the target model's folder: [capture] model_path "
                           "(or [backends.vllm.launch] model_path)")
    model = TargetModel.load(path)
    return model, model.layer_ids(cfg.capture.aux_layers)


def record_units(rec: ResponseRecord, tok: TargetTokenizer) -> list[tuple[list[int], int]]:
    """Per turn of a record: (its prompt ids then its output ids, the prompt's length).

    The ids are the token export's (``conversation.turn_prompts``, as ``export/tokens.py`` takes them): a conversation's turns keep the prompt
    ids the engine received; a single-turn record's prompt is the template's render of its
    messages, as the GPU worker sent it. An exact record whose render differs in length from the
    prompt the engine counted was made with another tokenizer or template: refused.
    """
    try:
        prompts = turn_prompts(rec, tok)
    except TokenizerError as exc:  # the chat template refuses the record's messages
        raise CaptureError(f"record {rec.key}: {exc}") from None
    units = []
    for prompt, turn in zip(prompts, record_turns(rec)):
        ids = prompt + turn.output_ids
        prompt_len = len(prompt)
        if turn.token_source == "exact" and not turn.prompt_ids and prompt_len != turn.prompt_tokens:
            raise CaptureError(f"record {rec.key}: the prompt renders to {prompt_len} ids, the engine ran "
                               f"{turn.prompt_tokens}: another tokenizer or chat template than at generation")
        units.append((ids, prompt_len))
    return units

Spans = list[tuple[int, int]]


def conversation_spans(rec: ResponseRecord) -> tuple[list[int], Spans] | str:
    """A conversation captured once: its last turn's whole sequence and each turn's answer span in
    it, when every turn's prompt ids then answer ids begin the next turn's prompt ids; otherwise why
    not (a string: one turn, ids not stored, or where the history differs from what was generated).

    Only the stored ids decide: the exact prompt each turn was run with, never a re-render."""
    turns = record_turns(rec)
    if len(turns) < 2:
        return "a single turn"
    if not all(t.prompt_ids and t.output_ids for t in turns):
        return "a turn without stored prompt or answer ids"
    spans: Spans = []
    for k, t in enumerate(turns):
        spans.append((len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids)))
        if k + 1 == len(turns):
            break
        seq, nxt = t.prompt_ids + t.output_ids, turns[k + 1].prompt_ids
        if len(seq) > len(nxt) or nxt[: len(seq)] != seq:
            at = next((i for i, (a, b) in enumerate(zip(seq, nxt)) if a != b), min(len(seq), len(nxt)))
            why = ("the history is rendered otherwise than it was asked" if at < len(t.prompt_ids) else
                   "the template rewrites the earlier answer (its reasoning or think block blanked or dropped)"
                   if t.reasoning or at == len(t.prompt_ids) else
                   "the answer re-renders to other ids than were generated")
            return f"turn {k + 1}'s prompt differs from turn {k}'s prompt and answer at id {at}: {why}"
    last = turns[-1]
    return last.prompt_ids + last.output_ids, spans


def loss_mask(n: int, spans: Spans) -> list[int]:
    """1 on every answer position of ``spans``, 0 elsewhere (prompts, later user turns)."""
    mask = [0] * n
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return mask


def file_spans(meta: dict[str, str], n: int, path: str | Path) -> Spans:
    """The answer spans a stored file's metadata gives (a per-turn file: ``prompt_len`` to the end),
    checked to lie in its ``n`` ids in order: a wrong mask trains on the prompt, silently."""
    try:
        spans = [(int(a), int(b)) for a, b in json.loads(meta["spans"])] if "spans" in meta else [
            (int(meta["prompt_len"]), n)]
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: no readable answer spans in its metadata ({exc})") from None
    ends = [0] + [x for s in spans for x in s] + [n]
    if not spans or any(a > b for a, b in zip(ends, ends[1:])) or any(a == b for a, b in spans):
        raise ValueError(f"{path}: answer spans {spans} do not lie in order within its {n} ids")
    return spans


def projected_bytes(bytes_per_token: float, pending_tokens: int, remaining_budget: int | None,
                    unit_tokens: int, completion_tokens: int) -> int:
    """What the rest of a dataset will take in the store: the stored turns not captured yet
    (``pending_tokens``), plus the answers the budget has left to generate, each with its prompt
    as the stored turns have so far (``unit_tokens`` captured tokens per ``completion_tokens``)."""
    per_answer_token = unit_tokens / completion_tokens if completion_tokens else 1.0
    return round((max(0, pending_tokens) + (remaining_budget or 0) * per_answer_token) * bytes_per_token)


def bytes_per_token(manifest: CaptureManifest) -> int:
    """What a token costs on disk in the version's dtype: its states, fp8's scale, its int64 id."""
    states = len(manifest.layer_ids) * manifest.hidden_size
    return (states + 4 if manifest.dtype == "float8_e4m3fn" else states * 2) + 8


def measured_bytes_per_token(manifest: CaptureManifest, tokens: int, size: int) -> float:
    """The version's bytes per token: what its files hold (headers included) once it has some, else
    the dtype's figure (:func:`bytes_per_token`)."""
    return round(size / tokens, 1) if tokens else float(bytes_per_token(manifest))
