"""A vLLM capture server whose answers and files the test decides (right, wrong, hostile, malformed).

It speaks what ``CaptureClient`` reads of vLLM (``/health``, ``/v1/models``, ``/v1/completions``
answering ``kv_transfer_params.hidden_states_path``) and writes each request's file into the
storage folder as the fleet's connector does, with a contract in its metadata. What it answers is
the engine's word, which the worker must check: ``answer`` (ids in, (path, bytes or None) out) may
name any path and write any bytes. ``dead`` answers as vLLM does once its engine core died: HTTP 500
``EngineDeadError`` to requests, 503 to ``/health``; ``dies_on_request``: it turns dead at the next
request, as vLLM's CPU engine did on its first capture step (issue 42). The real engine, connector and states: tests/engines.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from draftfleet.hidden import encode_safetensors, f32_to_bf16

SERVED = "tiny-capture"
# vLLM's answer to a request once its engine core died (vllm.v1.engine.exceptions.EngineDeadError).
ENGINE_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "type": "InternalServerError", "param": None, "code": 500}}


def contract(layer_ids: list[int], model_sha: str, hidden: int = 128, num_layers: int = 8) -> dict:
    return {"layer_ids": layer_ids, "hidden_size": hidden, "num_layers": num_layers, "dtype": "bfloat16",
            "model": "/models/tiny", "model_config_sha256": model_sha}


def engine_file(ids: list[int], layers: int, hidden: int = 128, contract: dict | None = None, room: int = 0,
                states: np.ndarray | None = None) -> bytes:
    """The bytes the connector writes for ``ids``: token_ids, finite bf16 states [T, L, H] (or ``states``),
    the contract, and ``room`` bytes of header room (the fleet's connector leaves HEADER_ROOM)."""
    if states is None:
        states = f32_to_bf16(np.random.default_rng(len(ids)).standard_normal((len(ids), layers, hidden))
                             .astype(np.float32))
    meta = {"draftfleet_contract": json.dumps(contract)} if contract is not None else {}
    if room:
        meta["header_room"] = " " * room
    return encode_safetensors({"hidden_states": ("BF16", states), "token_ids": ("I64", np.array(ids, np.int64))}, meta)


class CaptureEngine:
    """``answer(ids) -> (path to name, bytes to write there or None)``; the default writes the
    connector's file for ``contract`` (None: no contract) at ``<storage>/<n>.safetensors``."""

    def __init__(self, storage: Path, contract: dict | None, layers: int = 4, hidden: int = 128):
        self.storage, self.contract, self.layers, self.hidden = storage, contract, layers, hidden
        self.answer: Callable[[list[int]], tuple[str, bytes | None]] = self.right
        self.requests: list[list[int]] = []
        self.dead = False
        self.dies_on_request = False
        self._n = itertools.count()
        storage.mkdir(parents=True, exist_ok=True)
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if engine.dead and self.path == "/health":
                    return self._send({}, 503)
                self._send({"data": [{"id": SERVED}]} if self.path == "/v1/models" else {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.dead = engine.dead or engine.dies_on_request
                if engine.dead:
                    return self._send(ENGINE_DEAD, 500)
                ids = [int(i) for i in body["prompt"]]
                engine.requests.append(ids)
                path, data = engine.answer(ids)
                if data is not None:
                    Path(path).write_bytes(data)
                self._send({"choices": [{"text": "", "token_ids": [0]}], "kv_transfer_params": {"hidden_states_path": path}})

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def right(self, ids: list[int]) -> tuple[str, bytes]:
        """The connector's own answer: a fresh file in the storage folder with this engine's contract."""
        return str(self.storage / f"req-{next(self._n)}.safetensors"), engine_file(ids, self.layers, self.hidden, self.contract)

    def fresh_path(self) -> str:
        return str(self.storage / f"req-{next(self._n)}.safetensors")

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
