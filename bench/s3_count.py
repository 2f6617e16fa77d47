"""An HTTP proxy in front of the bench's SeaweedFS that counts the S3 requests passing through it.

The workers are given the proxy as their S3 endpoint; the bench's own requests (its polling of the
store) go straight to SeaweedFS, so what is counted is what the workers asked of the bucket. The
request is forwarded as sent, its Host header included, so the client's signature still holds.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections import Counter

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _any(self) -> None:
        server: CountingProxy = self.server  # type: ignore[assignment]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        server.count(self.command)
        conn = http.client.HTTPConnection("127.0.0.1", server.upstream_port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP:
                    conn.putheader(name, value)
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    def log_message(self, *args) -> None:
        pass


class CountingProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def count(self, method: str) -> None:
        with self._lock:
            self.counts[method] += 1

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
