"""Two "machines": worker processes with their own working folder, HOME, TMPDIR, config copy and
SGLang server (an emulator each), sharing only the Redis URL and the store folder, as workers on
other hosts do with one Redis and an NFS-mounted store (ops/scaling.md).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftfleet.ledger import Ledger
from draftfleet.queues import depth
from draftfleet.store import open_store

from .conftest import Host, wait_until, write_jsonl

pytestmark = pytest.mark.slow

N = 60


def test_two_machines_share_one_redis_and_one_store(tmp_path, redis_server, tokenizer_dir, emulator_factory, workers):
    shared_store = tmp_path / "nfs" / "store"
    data = write_jsonl(tmp_path / "data" / "prompts.jsonl", [{"prompt": f"prompt number {i}"} for i in range(N)])
    machines = {}
    for name in ("machine-a", "machine-b"):
        host = Host(tmp_path / name, workers)
        emu = emulator_factory(single_stream_tps=80, ceiling_tps=100000, length="fixed:24", ttft_s=0.0)
        host.write_config(tokenizer=tokenizer_dir, emulator_url=emu.url,
                          datasets=[{"name": "ds", "path": str(data), "max_tokens": 64}])
        machines[name] = (host, emu)

    res = machines["machine-a"][0].run_cli("enqueue", "--config", str(machines["machine-a"][0].config), "--store",
                                           str(shared_store), "--json", env={"REDIS_URL": redis_server.url})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["queued"] == N

    for name, (host, emu) in machines.items():
        host.start("gpu", "--url", emu.url, "--inflight", "4", "--name", name, "--store", str(shared_store),
                   redis_url=redis_server.url)

    store = open_store(shared_store)
    wait_until(lambda: len(store.keys("ds")) == N, 90, 0.2, f"{N} results\n{workers.logs()}")
    r = redis_server.client()
    wait_until(lambda: depth(r, "ds") == 0, 15, 0.1, "an empty queue")
    workers.stop_all()

    records = list(store.records("ds"))
    assert len(records) == N
    assert Counter(rec.source for rec in records).most_common(1)[0][1] == 1  # no prompt twice
    by_machine = Counter(rec.worker.split("@")[0] for rec in records)
    assert set(by_machine) == {"machine-a", "machine-b"} and all(n > 0 for n in by_machine.values()), by_machine
    # every prompt was generated once: no machine repeated another's work
    generated = {name: emu.stats()["by_endpoint"].get("/generate", 0) for name, (_, emu) in machines.items()}
    assert generated == dict(by_machine)
    totals = Ledger(r).totals("ds")
    assert sum(t["responses"] for t in totals.values()) == N
    # nothing was written into a machine's own folders: the store is the only shared state
    for host, _ in machines.values():
        assert host.leftovers() == [], host.leftovers()
    assert not list(shared_store.rglob(".tmp-*"))
