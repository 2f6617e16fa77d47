"""A bucket on the first day (issue 29, item 1): ``draftfleet s3 start|stop|env`` and the README's
"a local bucket to try" block, run as a person types it (bash, ``eval "$(draftfleet s3 env)"``),
on a machine of its own (HOME, cwd and TMPDIR in the test's folder; no AWS variables)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def _machine(tmp_path: Path) -> dict[str, str]:
    """A fresh user's environment: the venv's scripts on PATH, a HOME of its own, no AWS_* or Redis."""
    (tmp_path / "tmp").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "REDIS_", "DRAFTFLEET_"))}
    return {**env, "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"), "XDG_DATA_HOME": str(tmp_path / "share"),
            "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "COLUMNS": "200"}


def _bash(script: str, env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def readme_block(marker: str) -> str:
    """The README's first bash block after ``marker``."""
    text = (REPO / "README.md").read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(marker):], re.S).group(1)


def _weed_pids(folder: Path) -> list[int]:
    """The running ``weed`` processes whose data folder is under ``folder``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"weed") and any(a.startswith(f"-dir={folder}".encode()) for a in argv):
            pids.append(int(cmdline.parent.name))
    return pids


def test_the_readme_local_bucket_block_runs_as_written(tmp_path):
    """Start, eval env, the demo on the bucket, an export from it, stop: records in the bucket, the
    secret key in no output and no log, the identity file 0600, nothing left running."""
    env = _machine(tmp_path)
    block = readme_block("**A local bucket to try, then your real one.**")
    assert "draftfleet s3 start" in block and 'eval "$(draftfleet s3 env)"' in block
    res = _bash(block, env, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    folder = tmp_path / "share" / "draftfleet" / "s3"
    assert folder.stat().st_mode & 0o777 == 0o700
    identity = folder / "s3.json"
    assert identity.stat().st_mode & 0o777 == 0o600
    (cred,) = json.loads(identity.read_text())["identities"][0]["credentials"]
    secret = cred["secretKey"]
    assert len(secret) >= 30 and secret != "fleet-test-secret-not-real"
    assert secret not in res.stdout + res.stderr and secret not in (folder / "weed.log").read_text()
    text = " ".join(res.stdout.split())
    assert "bucket draftfleet made" in text and "the store in the bucket s3://draftfleet/demo at http://127.0.0.1:" in text
    rows = (tmp_path / "demo-export" / "chat.sharegpt.jsonl").read_text().splitlines()
    manifest = json.loads((tmp_path / "demo-export" / "chat.manifest.json").read_text())
    assert rows and manifest["records"] >= len(rows) > 0, manifest
    assert not _weed_pids(folder) and not (folder / "weed.json").exists()  # stopped by its pid
    assert not (tmp_path / "s3:").exists()

    # the data stays: started again (other ports, same keys), the records are in the bucket
    try:
        again = _bash('draftfleet s3 start --json && eval "$(draftfleet s3 env)" && '
                      "draftfleet inventory --store s3://draftfleet/demo --json", env, tmp_path, 120)
    finally:
        stopped = _bash("draftfleet s3 stop", env, tmp_path, 60)
    assert again.returncode == 0, again.stderr[-3000:]
    started, inventory = (json.loads(line) for line in again.stdout.splitlines())
    assert started["started"] and not started["bucket_made"] and started["folder"] == str(folder)
    assert {row["dataset"]: row["responses"] for row in inventory}["instruct"] == 40
    assert stopped.stdout == "stopped\n" and not _weed_pids(folder)


def test_s3_env_start_stop_say_what_is_there(tmp_path):
    """``env`` before ``start`` and a second ``stop`` say "not running" (env exits 1, on stderr: an
    ``eval`` of it runs nothing); ``start`` twice reuses the server; a folder others may enter is refused."""
    env = _machine(tmp_path)
    folder = tmp_path / "bucket"
    res = _bash(f"draftfleet s3 env --dir {folder}", env, tmp_path)
    assert res.returncode == 1 and not res.stdout and res.stderr.strip() == f"not running: draftfleet s3 start --dir {folder}"
    try:
        first = _bash(f"draftfleet s3 start --dir {folder} --store s3://try-it/run1 --json", env, tmp_path, 120)
        assert first.returncode == 0, first.stderr
        second = _bash(f"draftfleet s3 start --dir {folder} --store s3://try-it --json", env, tmp_path, 120)
        one, two = json.loads(first.stdout), json.loads(second.stdout)
        assert (one["started"], one["bucket_made"], two["started"], two["bucket_made"]) == (True, True, False, False)
        assert one["pid"] == two["pid"] and _weed_pids(folder) == [one["pid"]]
        lines = _bash(f"draftfleet s3 env --dir {folder}", env, tmp_path).stdout.splitlines()
        assert [line.split("=", 1)[0] for line in lines] == [
            "export AWS_ENDPOINT_URL", "export AWS_ACCESS_KEY_ID", "export AWS_SECRET_ACCESS_KEY", "export AWS_REGION"]
        assert lines[0] == f"export AWS_ENDPOINT_URL={one['endpoint']}"
    finally:
        stopped = _bash(f"draftfleet s3 stop --dir {folder}; draftfleet s3 stop --dir {folder}", env, tmp_path, 60)
    assert stopped.stdout.split() == ["stopped", "not", "running"] and not _weed_pids(folder)
    open_folder = tmp_path / "shared"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    refused = _bash(f"draftfleet s3 start --dir {open_folder}", env, tmp_path)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"refusing {open_folder}: mode 0755 lets other users in" in refused.stderr
