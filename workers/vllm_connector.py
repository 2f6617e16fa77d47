"""The KV connector vLLM loads to write a request's hidden states (runs INSIDE the vLLM server).

vLLM's ``extract_hidden_states`` speculative method caches, per token, the target's states at the
configured layer ids; a KV connector copies them out when the request finishes.
vLLM's own ``ExampleHiddenStatesConnector`` copies with CUDA events, a CUDA stream and pinned
memory: on a CPU engine the first finished request kills the engine. This subclass copies
synchronously (the slot gather already makes a copy; on a GPU it is followed by a plain
device-to-host copy), then writes the file from the writer threads as the parent does, under the
same ``.lock`` protocol: the client takes ``LOCK_SH`` on ``<path>.lock`` and reads once it has it.
The file appears complete or not at all (written beside, then renamed): an engine killed
mid-write leaves no half file for a reader to take.

Every file carries the contract the connector was configured with (safetensors metadata
``draftfleet_contract``, JSON): the layer ids vLLM was asked for, the target's hidden size and
layer count, the stored dtype and the model (its ``config.json``'s sha256). States of other layers
have the same shape as the right ones; the worker compares this contract with the capture
version's and stores nothing that differs (``capture.py``).

``"header_room": N`` leaves N bytes of room in each file's header (a ``header_room`` metadata
entry of N spaces): the capture worker writes the unit's metadata there, in place, and links the
file into the store, so the states are written to disk once (``capture.py``).

``kv_connector_extra_config`` ``"dtype": "fp8"`` stores float8 e4m3 states with one float32 scale
per token, in the writer thread (off the engine's step), exactly as speculators' hs-connectors
0.9.0 writes them (``fp8_utils.quantize_tensor_to_fp8``: scale = amax over the token's layers and
features / 448, at least 1e-12; ``hidden_states`` float8_e4m3fn [T, L, H] and
``hidden_states_scales`` float32 [T, 1, 1]), so its ``FP8Transfer`` reads the files unchanged.

vLLM imports it as ``draftfleet.workers.vllm_connector`` (``kv_connector_module_path``): this
module must import nothing but vLLM, torch, safetensors and the standard library, because it runs
in the engine's own environment, where the fleet's dependencies are absent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed


class _Copied:
    """Stands in for the parent's CUDA event: the copy is already done when this exists."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn states, float32 scales [T, 1, ..]): one scale per token, hs-connectors' formula."""
    x = states.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


STORED_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # extra config -> the capture manifest's name


def contract(vllm_config, dtype: str) -> dict:
    """What this engine computes and stores, from its own configuration (``schemas.records.EngineContract``)."""
    model = vllm_config.model_config
    spec = vllm_config.speculative_config.draft_model_config.hf_config
    return {"layer_ids": [int(i) for i in getattr(spec, "eagle_aux_hidden_state_layer_ids", None) or []],
            "hidden_size": int(model.get_hidden_size()), "num_layers": int(model.get_total_num_hidden_layers()),
            "dtype": STORED_DTYPES[dtype], "model": str(model.model),
            "model_config_sha256": _config_sha256(str(model.model), model.revision)}


def _config_sha256(model: str, revision: str | None) -> str:
    """sha256 of the model's ``config.json`` (a local folder, else the hub cache); "" when unread."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json", revision=revision)
        except Exception:  # any failure leaves the identity unknown, which the worker refuses
            found = None
        if not isinstance(found, str):
            return ""
        path = found
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class DraftfleetHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous copy, atomic files and the contract in each."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dtype = self._kv_transfer_config.get_from_extra_config("dtype", "bf16")
        if dtype not in STORED_DTYPES:
            raise ValueError(f"kv_connector_extra_config dtype {dtype!r}: bf16 or fp8")
        self._fp8 = dtype == "fp8"
        self._metadata = {"draftfleet_contract": json.dumps(contract(self._vllm_config, dtype), separators=(",", ":"))}
        room = int(self._kv_transfer_config.get_from_extra_config("header_room", 0))
        if room:
            self._metadata["header_room"] = " " * room

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], filename: str,
                       lock_fd: int | None, fp8: bool = False) -> None:
        tmp = f"{filename}.{os.getpid()}.partial"
        try:
            if fp8:
                tensors["hidden_states"], tensors["hidden_states_scales"] = quantize_fp8(tensors["hidden_states"])
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, filename)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the reader may go

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        with gpu_sync_allowed():
            states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                           pending.token_ids.shape[0]).to("cpu").contiguous()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, "another hidden-state write with the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, self._metadata, pending.filename, lock_fd,
                                       self._fp8)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
