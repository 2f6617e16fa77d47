"""The real-engine tier's fixtures: one engine server for the whole package, a recording proxy.

``live`` is parametrized over the engines (vLLM marked ``vllm``, SGLang marked ``gpu``), so every
test of the tier runs unchanged against each; an engine absent here is skipped with the reason
(``real.find_engine``). The server lives for the package (one startup, 20–60 s), and is stopped
when the package's last test ends, not at the end of the whole session.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ..conftest import free_port
from .real import SERVED_NAME, Engine, find_engine, gauge, server, tiny_model


class Live:
    """A started engine server that a test can query directly, kill and start again (same port)."""

    def __init__(self, engine: Engine, srv, model: Path):
        self.engine = engine
        self.server = srv
        self.url = srv.url
        # the model name workers record: vLLM's /v1/models gives the served name, SGLang's /model_info the path
        self.model_name = SERVED_NAME if engine.name == "vllm" else str(model)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def prompt_field(self) -> str:
        """Where the prompt ids go in the engine's request body."""
        return "prompt" if self.name == "vllm" else "input_ids"

    def answer_ids(self, response: dict) -> list[int]:
        """The generated ids in the engine's response body, as it sent them."""
        return response["choices"][0]["token_ids"] if self.name == "vllm" else response["output_ids"]

    def running(self) -> float:
        """Requests the engine is running at this moment (its own gauge)."""
        return gauge(self.url, self.engine.running_gauge)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (a crash, an OOM kill), then reap it."""
        pid = self.server.pid
        assert pid is not None, "the server is not running"
        os.killpg(pid, signal.SIGKILL)
        self.server.stop(timeout=30)

    def restart(self) -> None:
        self.server.start()


@pytest.fixture(scope="package", params=[pytest.param("vllm", marks=pytest.mark.vllm),
                                         pytest.param("sglang", marks=pytest.mark.gpu)])
def live(request, tmp_path_factory, tokenizer_dir):
    engine, why = find_engine(request.param)
    if engine is None:
        pytest.skip(why)
    model = tiny_model(engine.python, tokenizer_dir)
    folder = tmp_path_factory.mktemp(f"{engine.name}-server")
    srv = server(engine, model, free_port(), folder / "server.log")
    srv.start()  # a LaunchError names the log and quotes its last lines
    try:
        yield Live(engine, srv, model)
    finally:
        srv.stop()


class RecordingProxy:
    """A loopback HTTP proxy in front of the engine that keeps every JSON exchange, so a test
    sees exactly the ids the worker sent and the ids the engine answered."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.exchanges: list[tuple[str, dict, dict]] = []  # (path, request body, response body)
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=upstream, timeout=300, limits=httpx.Limits(max_connections=256))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                resp = proxy._client.request(self.command, self.path, content=body, headers=headers)
                if body and resp.headers.get("content-type", "").startswith("application/json"):
                    with proxy._lock:
                        proxy.exchanges.append((self.path, json.loads(body), resp.json()))
                self.send_response(resp.status_code)
                self.send_header("content-type", resp.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = _forward

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def answers_by_prompt(self, prompt_field: str) -> dict[tuple[int, ...], list[dict]]:
        """Every answer the engine gave, keyed by the prompt ids it was asked about."""
        out: dict[tuple[int, ...], list[dict]] = defaultdict(list)
        with self._lock:
            for _path, request, response in self.exchanges:
                if prompt_field in request:
                    out[tuple(request[prompt_field])].append(response)
        return out

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._client.close()


@pytest.fixture
def proxy(live):
    p = RecordingProxy(live.url)
    yield p
    p.close()
