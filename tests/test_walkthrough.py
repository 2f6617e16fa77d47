"""Two machines, one bucket, as ops/scaling.md's walkthrough (section 7) tells it (issue 29, item 3):
its shell blocks run as written, each in the shell of the machine its first line names, and its
``fleet.toml`` is each machine's config with only the servers' addresses and the tokenizer's folder
put in. A machine is a folder of its own (cwd, HOME, TMPDIR) with its own SGLang server (an
emulator); they share a real Redis with a password and a bucket of a real SeaweedFS; a third
emulator is OpenRouter. Between blocks the test waits as a person watching ``status`` would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path

import pytest

from draftfleet.store import open_store

from .conftest import REPO, RedisServer, wait_until, write_jsonl
from .test_private_bucket import _machine

pytestmark = pytest.mark.slow

SECTION = "## 7. Two machines, one bucket: a walkthrough"
PROMPTS = 120
SECRETS = {"REDIS_URL", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "OPENROUTER_API_KEY"}


def walkthrough() -> tuple[str, list[tuple[str, list[str]]]]:
    """The section's ``fleet.toml`` and its shell blocks as (machine, command lines)."""
    text = (REPO / "ops" / "scaling.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:] if end < 0 else text[start:end]
    (toml,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        first, *lines = block.splitlines()
        blocks.append((first.removeprefix("# ").split(",")[0], [line for line in lines if line.strip()]))
    return toml, blocks


class Shell:
    """A machine's terminal: one bash that keeps its variables and its background jobs between the
    commands typed into it, in a session of its own (so that the test can end all it started)."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder = folder
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=folder, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.typed: list[tuple[str, str]] = []  # (command, its output)

    def type(self, command: str, timeout: float = 180) -> str:
        """Run one command line; its output, or a failure naming it if it exits non-zero."""
        mark = f"__done_{secrets.token_hex(4)}__"
        self.proc.stdin.write(f"{command}\necho {mark} $?\n")
        self.proc.stdin.flush()
        out = []
        while True:
            line = self.lines.get(timeout=timeout)
            if line.startswith(mark):
                status = int(line.split()[1])
                break
            out.append(line)
        self.typed.append((command, "".join(out)))
        assert status == 0, f"{self.folder.name}: `{command}` exited {status}:\n{''.join(out)[-3000:]}\n{self.logs()}"
        return "".join(out)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.folder.glob("*.log"))

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def shells():
    made: list[Shell] = []

    def make(folder: Path, env: dict[str, str]) -> Shell:
        folder.mkdir(parents=True, exist_ok=True)
        made.append(Shell(folder, env))
        return made[-1]

    yield make
    for shell in made:
        shell.close()


def test_the_two_machine_walkthrough_runs_as_written(tmp_path, tokenizer_dir, emulator_factory, shells):
    from draftfleet.devtools.seaweedfs import SeaweedFS

    toml, blocks = walkthrough()
    machines = [m for m, _ in blocks]
    assert machines[0] == "every machine" and set(machines[1:]) == {"host A", "host B", "a trainer's machine"}
    exported = {w.split("=", 1)[0] for line in blocks[0][1] for w in line.split()[1:] if "=" in w}
    assert exported == SECRETS, exported  # the secrets the test gives each machine are the ones the page names

    redis = RedisServer(tmp_path / "redis", appendonly=True, password=secrets.token_hex(16))
    redis.start()
    bucket = SeaweedFS(tmp_path / "seaweedfs")
    bucket.start()
    try:
        location = re.search(r'^store = "(s3://[^"]+)"', toml, re.M).group(1)
        bucket.make_bucket(location[5:].split("/")[0])
        api_key = "or-" + secrets.token_hex(8)
        cloud = emulator_factory(api_key=api_key, ceiling_tps=100000, single_stream_tps=400,
                                 ttft_s=0.0, length="uniform:8:24", price_input_per_mtok=0.6, price_output_per_mtok=2.5)
        given = {"REDIS_URL": redis.url, **bucket.env(), "OPENROUTER_API_KEY": api_key,
                 "DRAFTFLEET_CLAIM_TTL_S": "6"}  # a dead host's claims lapse in 6 s, not two minutes
        sh, gpus = {}, {}
        for name in ("host A", "host B"):
            folder = tmp_path / name.replace(" ", "-")
            # each SGLang server runs 4 requests at once, so that a host holds work while it runs
            gpus[name] = emulator_factory(single_stream_tps=12, max_running=4, length="uniform:8:24", ttft_s=0.0,
                                          model="Qwen/Qwen3-8B", seed=len(gpus))
            folder.mkdir()
            (folder / "fleet.toml").write_text(
                toml.replace("/models/Qwen3-8B", str(tokenizer_dir)).replace("http://127.0.0.1:30000", gpus[name].url)
                .replace("https://openrouter.ai/api/v1", cloud.url + "/v1"))
            sh[name] = shells(folder, {**_machine(folder), **given})
        write_jsonl(tmp_path / "host-A" / "prompts.jsonl", [{"prompt": f"walkthrough prompt {i}"} for i in range(PROMPTS)])
        trainer = tmp_path / "trainer"
        sh["a trainer's machine"] = shells(trainer, {**_machine(trainer), **bucket.env()})
        store = open_store(location)
        env_before = dict(os.environ)
        os.environ.update(bucket.env())  # this process reads the bucket too, to know when to go on

        def typed(machine: str, lines: list[str]) -> str:
            return "".join(sh[machine].type(line) for line in lines)

        def stored() -> int:
            return len(store.keys("prompts"))

        try:
            steps = iter(blocks[1:])
            # A queues and starts its GPU worker; B starts its own
            typed(*next(steps))
            typed(*next(steps))
            # both generate, and B holds requests open on its server
            wait_until(lambda: gpus["host B"].stats()["completed"] >= 5 and gpus["host A"].stats()["completed"] >= 5
                       and gpus["host B"].stats()["open"] >= 4, 120, 0.2,
                       lambda: f"both hosts generating\n{sh['host A'].logs()}\n{sh['host B'].logs()}")
            status = typed(*next(steps))
            assert status.count("gpu") >= 2 and "prompts" in status, status
            machine, kill = next(steps)
            assert machine == "host B"
            held_by_b = gpus["host B"].stats()["open"]
            typed(machine, kill)
            at_kill = stored()
            assert 0 < at_kill < PROMPTS and held_by_b >= 4
            pivot = typed(*next(steps))  # a cloud worker on A, then the pivot
            assert "prompts" in pivot, pivot
            wait_until(lambda: stored() == PROMPTS, 180, 0.5,
                       lambda: f"all {PROMPTS} stored ({stored()})\n{sh['host A'].logs()}")
            machine, last = next(steps)
            out = typed(machine, last)
            assert "done" in out, out
            machine, export = next(steps)
            typed(machine, export)
        finally:
            os.environ.clear()
            os.environ.update(env_before)

        # every prompt once in the bucket: by both GPUs before B died, by the cloud after the pivot
        records = list(store.records("prompts"))
        assert len({rec.source for rec in records}) == len(records) == PROMPTS
        makers = Counter(rec.worker for rec in records)
        by_backend = Counter(rec.backend for rec in records)
        assert by_backend["sglang"] > 0 and by_backend["openrouter"] > 0, by_backend
        assert len({rec.worker for rec in records if rec.backend == "sglang"}) == 2, makers  # one per host
        print(f"walkthrough: {PROMPTS} prompts, {at_kill} stored when B died holding {held_by_b} open, "
              f"by backend {dict(by_backend)}")
        # the report and the training files, on A from the bucket and on the trainer's machine alike
        assert (tmp_path / "host-A" / "run.html").stat().st_size > 10_000
        rows = (tmp_path / "host-A" / "export" / "prompts.sharegpt.jsonl").read_text().splitlines()
        assert len(rows) == PROMPTS - sum(rec.finish_reason == "length" for rec in records)
        raw_a = (tmp_path / "host-A" / "export" / "prompts.raw_responses.jsonl").read_bytes()
        assert raw_a == (trainer / "export" / "prompts.raw_responses.jsonl").read_bytes()
        assert json.loads((trainer / "export" / "prompts.manifest.json").read_text())["records"] == PROMPTS
    finally:
        redis.stop()
        bucket.stop()
