"""``draftfleet report``: one self-contained HTML file of charts, checked in a real (headless) Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from draftfleet.hidden import HiddenStore, encode_safetensors
from draftfleet.schemas.config import load_config
from draftfleet.identity import settings_id
from draftfleet.schemas.records import (CaptureManifest, DatasetEvent, DatasetManifest, FailureRecord, PromptTask,
                                        QuarantineEntry)
from draftfleet.store import open_store
from draftfleet.views.report import TimeAxis

from tests.conftest import run_cli
from tests.test_plan import record, seed_config, seed_records

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path("/tmp/report-screenshot.png")


def pivoted_store(tmp_path, tokenizer_dir):
    """The seed's B3 made on the GPUs, then pivoted to the cloud, which answered 300 prompts, 155 of
    them cut at max_tokens (the trial's spike); a failure and two quarantined lines."""
    config = seed_config(tmp_path, tokenizer_dir)
    cfg = load_config(config)
    store = open_store(cfg)
    pivot_at = time.time() - 2 * 3600
    store.log(DatasetEvent(at=pivot_at - 64_000, dataset="B3_magicoder", kind="budget", budget_tokens=10_000_000,
                           note="enqueue"))
    for rec in seed_records(cfg, ended_at=pivot_at):
        assert store.put(rec)
    store.log(DatasetEvent(at=pivot_at, dataset="B3_magicoder", kind="assign", assigned=["cloud"], note="pivot"))
    for i in range(300):
        n = 8192 if i % 2 == 0 or i >= 290 else 1500 + 7 * i  # 150 + 5 = 155 cut
        rec = record(f"{i:064x}", "B3_magicoder", n, backend="openrouter", kind="cloud",
                     created_at=pivot_at + 60 + 12 * i, latency_s=30.0, cost_usd=n * 2.5e-6, cost_source="provider")
        rec = msgspec.structs.replace(rec, truncated=n == 8192, finish_reason="length" if n == 8192 else "stop")
        assert store.put(rec)
    task = PromptTask(key="f" * 64, dataset="B3_magicoder", source="magicoder.jsonl:9", messages=[],
                      settings=cfg.dataset("B3_magicoder").settings(cfg.fleet.model), settings_id="s", enqueued_at=0.0)
    store.put_failure(FailureRecord(key="f" * 64, dataset="B3_magicoder", source="magicoder.jsonl:9", reason="moderation",
                                    error_kind="moderation", attempts=1, backend="openrouter", worker="cloud-0",
                                    failed_at=time.time(), task=task))
    store.quarantine("B3_magicoder", [QuarantineEntry(file="magicoder.jsonl", line=k, field="prompt", kind="bad_json",
                                                      message="not JSON", raw="{", at=time.time()) for k in (3, 4)])
    hidden = HiddenStore(store)  # 40 of the 2,046 record turns captured
    hidden.write_manifest(CaptureManifest(dataset="B3_magicoder", version=1, model="m", model_config_sha256="0" * 64,
                                          num_layers=8, hidden_size=4, layer_ids=[2, 4, 5, 8], created_at=time.time()))
    for i in range(40):
        ids = np.arange(10, dtype=np.int64)
        states = np.zeros((10, 4, 4), dtype=np.uint16)
        hidden.put("B3_magicoder", 1, f"{i:064x}", 0, encode_safetensors(
            {"token_ids": ("I64", ids), "hidden_states": ("BF16", states)}, {"format": "pt"}))
    return config


def test_report_is_one_self_contained_file(tmp_path, tokenizer_dir):
    config = pivoted_store(tmp_path, tokenizer_dir)
    out = tmp_path / "run.html"
    cp = run_cli("report", "--config", str(config), "--out", str(out))
    assert cp.returncode == 0, cp.stderr
    page = out.read_text()
    assert page.count("<svg") == 5  # lengths, tokens over time, spend, failures, capture
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched: no network
    assert "<script" not in page
    text = re.sub(r"<[^>]+>", " ", page)
    assert "1,746" in text or "2,046" in text
    assert "51.7% cut at max_tokens" in text  # 155 of 300 of the cloud's answers
    assert "max_tokens = 8,192" in text and "pivot: cloud" in text and "budget (as enqueued)" in text
    tokens = _chart_texts(page)[1]  # the 10M budget on the 7.4M tokens' scale: drawn, the axis in M
    assert "10M" in tokens and "budget (as enqueued)" in tokens and not any("1e" in t for t in tokens), tokens
    assert "openrouter cap $20.00" in text and "quarantined: bad_json" in text and "failed: moderation" in text
    assert "tokens left" in text and "13h08m" not in text  # the plan: the GPU's 13 h are for the rest
    assert "40 of 2,046 turns captured, 400 tokens" in text
    # 19 hours of records read in hours, with the total drawn over two backends; 40 captures in under a second
    assert text.count("hours since the first record") == 2 and "all backends (total)" in text
    assert "seconds since the first capture" in text


def test_a_time_axis_reads_in_the_unit_its_span_holds_two_of():
    assert [TimeAxis(100.0, 100.0 + span).unit for span in (0, 119, 120, 7199, 7200, 5 * 86400)] == [
        "seconds", "seconds", "minutes", "minutes", "hours", "hours"]
    assert TimeAxis(100.0, 1900.0).xs([100.0, 1000.0, 1900.0]) == [0.0, 15.0, 30.0]


def test_a_short_run_on_one_backend_reads_in_minutes_as_one_line(tmp_path, tokenizer_dir):
    """Half an hour of one backend: its axis in minutes (not 0 to 0.5 hours), no total over its line."""
    config = seed_config(tmp_path, tokenizer_dir)
    store = open_store(load_config(config))
    now = time.time()
    for i in range(200):
        assert store.put(record(f"{i:064x}", "B3_magicoder", 500 + i, created_at=now - 1800 + 9 * i, latency_s=5.0))
    out = tmp_path / "run.html"
    cp = run_cli("report", "--config", str(config), "--out", str(out))
    assert cp.returncode == 0, cp.stderr
    text = re.sub(r"<[^>]+>", " ", out.read_text())
    assert "minutes since the first record" in text and "hours since" not in text
    assert "all backends (total)" not in text


def _chart_texts(page: str) -> list[list[str]]:
    """The text of each chart (its SVG keeps text as text): tick labels, legend, axis labels."""
    return [re.findall(r"<text[^>]*>([^<]*)</text>", svg) for svg in page.split("<svg")[1:]]


def test_a_budget_far_above_a_short_run_is_named_not_drawn(tmp_path, tokenizer_dir):
    """Half an hour's 150k tokens under a 10M budget, $0.08 under a $20 cap: each chart keeps the
    data's own scale in plain amounts (no ``1e7`` above the axis), and the legend names the budget
    and the cap as off the scale instead of a line that squashes the curve flat. A budget raised
    from one on the scale to 10M: the step is drawn up to the axis's top."""
    config = seed_config(tmp_path, tokenizer_dir)
    store = open_store(load_config(config))
    now = time.time()
    for i in range(200):
        assert store.put(record(f"{i:064x}", "B3_magicoder", 500 + i, created_at=now - 1800 + 9 * i, latency_s=5.0))
    for i in range(40):
        assert store.put(record(f"{1000 + i:064x}", "B3_magicoder", 800, backend="openrouter", kind="cloud",
                                created_at=now - 900 + 20 * i, latency_s=5.0, cost_usd=0.002, cost_source="provider"))
    out = tmp_path / "run.html"

    def charts():
        cp = run_cli("report", "--config", str(config), "--out", str(out))
        assert cp.returncode == 0, cp.stderr
        return _chart_texts(out.read_text())

    _, tokens, spend = charts()[:3]
    assert "budget 10.00M (off the scale)" in tokens, tokens
    assert "140k" in tokens and not {"2M", "10M", "1e7"} & set(tokens), tokens  # the data's scale, in k
    assert "openrouter cap $20.00 (all datasets; off the scale)" in spend, spend
    assert "$0.08" in spend and "$20" not in spend, spend

    store.log(DatasetEvent(at=now - 1900, dataset="B3_magicoder", kind="budget", budget_tokens=200_000, note="enqueue"))
    store.log(DatasetEvent(at=now - 600, dataset="B3_magicoder", kind="budget", budget_tokens=10_000_000,
                           note="enqueue"))
    tokens = charts()[1]
    assert "budget (as enqueued; 10.00M off the scale)" in tokens, tokens
    assert "200k" in tokens and not {"2M", "10M"} & set(tokens), tokens



def test_report_draws_one_version_or_every_version_and_plans_only_the_current(tmp_path, tokenizer_dir):
    """A dataset enqueued again with other settings (``--new-version``): by default the report draws
    the current version's records only, as inventory counts them; ``--version 1`` the first
    version's, without the budget and plan (they belong to the version the fleet works on);
    ``--all-versions`` every record; a version that never was is an error naming the versions."""
    config = seed_config(tmp_path, tokenizer_dir)
    cfg = load_config(config)
    store = open_store(cfg)
    v2 = cfg.dataset("B3_magicoder").settings(cfg.fleet.model)
    v1 = msgspec.structs.replace(v2, max_tokens=v2.max_tokens // 2)
    store.write_manifest(DatasetManifest(name="B3_magicoder", version=2, settings=v2, settings_id=settings_id(v2),
                                         budget_tokens=10_000_000, created_at=time.time(), previous=[v1]))
    now = time.time()
    for i, (sid, n) in enumerate([(settings_id(v1), 300)] * 7 + [(settings_id(v2), 900)] * 5):
        rec = msgspec.structs.replace(record(f"{i:064x}", "B3_magicoder", n, created_at=now - 600 + 30 * i,
                                             latency_s=5.0), settings_id=sid)
        assert store.put(rec)
    out = tmp_path / "run.html"

    def summary(*flags):
        cp = run_cli("report", "--config", str(config), "--out", str(out), "-d", "B3_magicoder", *flags)
        assert cp.returncode == 0, cp.stderr
        page = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text()))
        return page, re.search(r"(\d[\d,]*) responses, ([\d,]+) completion tokens", page).groups()

    page, counts = summary()
    assert counts == ("5", "4,500") and "version 2 of 2" in page and "plan: to finish" in page
    assert "6,600 of a 10,000,000 budget spent (0.1%), 9,993,400 left" in page  # every version's records
    page, counts = summary("--version", "1")
    assert counts == ("7", "2,100") and "version 1 of 2" in page
    assert f"max_tokens = {v1.max_tokens:,}" in page  # that version's own line, not the current one's
    assert "plan: to finish" not in page and "budget spent" not in page
    page, counts = summary("--all-versions")
    assert counts == ("12", "6,600") and "every version" in page
    cp = run_cli("report", "--config", str(config), "--out", str(out), "--version", "3")
    assert cp.returncode == 1 and "versions 1 to 2, not 3" in cp.stderr, cp.stderr

@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs the chromium OS package (.ci/run installs it)")
def test_report_renders_in_chromium(tmp_path, tokenizer_dir):
    """The page in a real browser: the DOM it builds holds every chart, the console logs nothing,
    and the screenshot is not blank."""
    config = pivoted_store(tmp_path, tokenizer_dir)
    out = tmp_path / "run.html"
    assert run_cli("report", "--config", str(config), "--out", str(out)).returncode == 0
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
             "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]
    cp = subprocess.run([*flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-2000:]
    dom = cp.stdout
    assert dom.count("<svg") == 5 and dom.count("<path") > 50, dom[:500]
    for title in ("completion length per backend", "tokens over time per backend", "cloud spend over time",
                  "failures and quarantined lines by reason", "hidden-state capture"):
        assert title in dom
    console = [line for line in cp.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console

    shot = tmp_path / "shot.png"
    cp = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1100,3000", out.as_uri()],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and shot.exists(), cp.stderr[-2000:]
    assert [line for line in cp.stderr.splitlines() if ":CONSOLE" in line] == []
    from matplotlib.image import imread

    pixels = imread(shot)
    dark = (pixels[..., :3].mean(axis=2) < 0.5).mean()
    assert 0.005 < dark < 0.5  # text and lines drawn on white: neither a blank page nor a black one
    shutil.copy(shot, SCREENSHOT)
