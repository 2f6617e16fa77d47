"""The one place that picks and sizes the HTTP client (keep the choice here, measured in bench/).

A sync ``httpx.Client`` shared by the worker's threads measured cheapest per request when it was
chosen (1.7 ms of CPU vs 5-9 ms for the async clients). The pool is sized to the number of threads
so no request ever waits in httpcore's pool queue: httpcore 1.0.9's assignment pass is O(N^2) in
queued requests (httpcore PR #1035) and can hang a queued request until its read timeout
(httpcore #1110). Every request carries its own timeout: the threads pool has no task time limit.
"""

from __future__ import annotations

import httpx

def make_client(
    concurrency: int,
    *,
    connect_timeout: float,
    read_timeout: float,
    base_url: str = "",
    headers: dict[str, str] | None = None,
    trust_env: bool = False,
) -> httpx.Client:
    """A pooled client for ``concurrency`` threads, with every timeout set.

    ``trust_env`` (proxy variables) is for the cloud only: a proxy must never sit in front of a
    loopback engine server (SGLang, vLLM).
    """
    return httpx.Client(
        base_url=base_url,
        headers=headers,
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
        timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=60.0, pool=connect_timeout),
        follow_redirects=False,
        trust_env=trust_env,
    )
