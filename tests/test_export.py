"""``draftfleet export``: files per dataset, a manifest per dataset, errors for unknown datasets."""

from __future__ import annotations

import json

from draftfleet.store import Store, open_store

from tests.conftest import run_cli
from tests.test_inventory import _rec


def _store(tmp_path) -> Store:
    store = open_store(tmp_path / "store")
    for i in range(3):
        store.put(_rec(i, [5, 6, 7], dataset="alpha"))
    for i in range(2):
        store.put(_rec(10 + i, [8, 9], dataset="beta"))
    return store


def test_two_datasets_into_one_folder_overwrite_nothing(tmp_path):
    store = _store(tmp_path)
    out = tmp_path / "out"
    for name in ("alpha", "beta"):
        res = run_cli("export", "--store", str(store.root), "--dataset", name, "-f", "sharegpt", "-f", "raw",
                      "--out", str(out))
        assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "alpha.manifest.json", "alpha.raw_responses.jsonl", "alpha.sharegpt.jsonl",
        "beta.manifest.json", "beta.raw_responses.jsonl", "beta.sharegpt.jsonl"]
    alpha = json.loads((out / "alpha.manifest.json").read_text())
    assert alpha["dataset"] == "alpha" and alpha["records"] == 3
    assert set(alpha["files"]) == {"alpha.sharegpt.jsonl", "alpha.raw_responses.jsonl"}
    assert len((out / "alpha.raw_responses.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "beta.manifest.json").read_text())["records"] == 2


def test_all_datasets_when_none_named_and_unknown_is_an_error(tmp_path):
    store = _store(tmp_path)
    out = tmp_path / "all"
    res = run_cli("export", "--store", str(store.root), "-f", "raw", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert [(m["dataset"], m["records"]) for m in json.loads(res.stdout)] == [("alpha", 3), ("beta", 2)]
    assert (out / "alpha.raw_responses.jsonl").exists() and (out / "beta.raw_responses.jsonl").exists()
    res = run_cli("export", "--store", str(store.root), "--dataset", "gamma", "-f", "raw", "--out", str(tmp_path / "x"))
    assert res.returncode != 0
    assert "unknown dataset(s) gamma" in res.stderr and "alpha, beta" in res.stderr
    assert not (tmp_path / "x").exists()
