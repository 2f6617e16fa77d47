"""Hidden states without an engine: layer ids, bf16 and safetensors, capture versions and space, the
speculators layout. The engine, transformers and both trainers' readers: ``tests/engines/test_capture.py``."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import safetensors
from safetensors import safe_open

from draftfleet import redis_keys as rk
from draftfleet.export import speculators
from draftfleet.hidden import (CaptureError, HiddenStore, TargetModel, bf16_to_f32, encode_safetensors, f32_to_bf16,
                               read_safetensors)
from draftfleet.producer.capture import queue_capture
from draftfleet.schemas.config import load_config
from draftfleet.store import open_store
from draftfleet.workers.app import make_app

from tests.conftest import REPO, run_cli, wait_until, write_config
from tests.test_core import _record


def _model(folder, layers: int = 8, hidden: int = 128, vocab_size: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden,
                                                    **({"vocab_size": vocab_size} if vocab_size else {})}))
    return folder


@pytest.mark.parametrize("layers, ids", [(8, [2, 4, 5, 8]), (61, [2, 30, 58, 61]), (32, [2, 16, 29, 32])])
def test_default_layers_are_the_trainers_and_end_with_the_pre_norm_last(tmp_path, layers, ids):
    # SpecForge [1, N//2-1, N-4] (+1 inside SGLang) = speculators/vLLM [2, N//2, N-3]; N = the last layer's output
    assert TargetModel.load(_model(tmp_path, layers)).layer_ids(None) == ids


def test_configured_layers_are_sorted_and_checked(tmp_path):
    model = TargetModel.load(_model(tmp_path, 8))
    assert model.layer_ids([6, 1, 3]) == [1, 3, 6, 8]
    for bad in ([2, 2, 5], [0, 3, 5], [2, 4, 8]):
        with pytest.raises(CaptureError):
            model.layer_ids(bad)


def test_kimi_like_config_nests_the_language_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 61, "hidden_size": 7168}}))
    m = TargetModel.load(tmp_path)
    assert (m.num_layers, m.hidden_size) == (61, 7168)


def test_bf16_rounds_to_nearest_even_like_torch():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.140625, 1e-3], dtype=np.float32)
    bits = f32_to_bf16(x)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1); 1 + 3*2^-8 halfway again: to even (1 + 2^-6)
    assert bits[:4].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020]
    assert bf16_to_f32(bits)[4] == np.float32(3.140625)
    assert abs(bf16_to_f32(bits)[5] - 1e-3) <= 1e-3 * 2**-8


def test_safetensors_written_here_read_by_the_safetensors_package(tmp_path):
    ids = np.arange(5, dtype=np.int64)
    states = f32_to_bf16(np.random.default_rng(0).standard_normal((5, 4, 3)).astype(np.float32))
    path = tmp_path / "x.safetensors"
    path.write_bytes(encode_safetensors({"token_ids": ("I64", ids), "hidden_states": ("BF16", states)}, {"key": "k"}))
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"key": "k"} and f.get_tensor("token_ids").tolist() == ids.tolist()
    got = dict(safetensors.deserialize(path.read_bytes()))
    assert got["hidden_states"]["dtype"] == "BF16" and list(got["hidden_states"]["shape"]) == [5, 4, 3]
    assert bytes(got["hidden_states"]["data"]) == states.tobytes()
    tensors, meta = read_safetensors(path)
    assert meta == {"key": "k"} and (tensors["hidden_states"][1] == states).all()
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 8 == 0  # data 8-byte aligned, as safetensors writes it


def test_write_once_per_unit(tmp_path):
    hidden = HiddenStore(open_store(tmp_path))
    key = "ab" * 32
    assert hidden.put("ds", 1, key, 0, b"first") and not hidden.put("ds", 1, key, 0, b"second")
    assert hidden.path("ds", 1, key, 0).read_bytes() == b"first" and hidden.put("ds", 1, key, 1, b"turn 1")


def _fleet(tmp_path, tokenizer_dir, hidden: int = 128):
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(tmp_path / "d.jsonl")}])
    with open(config, "a") as fh:
        fh.write(f'\n[capture]\nmodel_path = "{_model(tmp_path / "model", hidden=hidden)}"\n')
    cfg = load_config(config)
    store = open_store(cfg)
    for i in range(3):
        store.put(_record(f"{i:02x}" * 32, output_ids=[1, 2, 3, 4], prompt_tokens=6))
    return cfg, store


def test_a_unit_counted_while_the_rest_are_sent_stays_counted(tmp_path, tokenizer_dir, redis_server, monkeypatch):
    """The first unit reaches a worker before the rest are sent, and may be stored and counted by
    then: the progress starts before the sending (it was reset after it, and status' captured fell
    short by what the workers had done meanwhile)."""
    from draftfleet.producer.sender import TaskSender

    cfg, store = _fleet(tmp_path, tokenizer_dir)
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    send = TaskSender.send

    def send_and_capture(self, *args, **kwargs):  # a worker stores each unit as soon as it is sent
        send(self, *args, **kwargs)
        r.hincrby(rk.capture_progress("ds"), "captured", 1)

    monkeypatch.setattr(TaskSender, "send", send_and_capture)
    assert queue_capture(cfg, store, app, r, "ds").queued == 3
    progress = {k.decode(): int(v) for k, v in r.hgetall(rk.capture_progress("ds")).items()}
    assert (progress["captured"], progress["queued"], progress["units"]) == (3, 3, 3)


def test_capture_versions_refuse_other_settings_and_space(tmp_path, tokenizer_dir, redis_server):
    cfg, store = _fleet(tmp_path, tokenizer_dir)
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    s = queue_capture(cfg, store, app, r, "ds")
    assert (s.version, s.units, s.queued, s.tokens_to_capture) == (1, 3, 3, 30)
    assert s.bytes_estimate == 30 * (4 * 128 * 2 + 8) and r.llen(rk.capture_queue("ds")) == 3
    again = queue_capture(cfg, store, app, r, "ds")  # the tasks still wait: not sent twice
    assert (again.version, again.queued, again.already_queued) == (1, 0, 3) and r.llen(rk.capture_queue("ds")) == 3
    hidden = HiddenStore(store)
    hidden.put("ds", 1, "00" * 32, 0, b"x")
    assert queue_capture(cfg, store, app, r, "ds").done == 1

    other = msgspec.structs.replace(cfg, capture=msgspec.structs.replace(cfg.capture, aux_layers=[1, 3, 5]))
    with pytest.raises(CaptureError, match="--new-version to start version 2"):
        queue_capture(other, store, app, r, "ds")
    v2 = queue_capture(other, store, app, r, "ds", new_version=True)
    assert (v2.version, v2.layer_ids, v2.done) == (2, [1, 3, 5, 8], 0)
    assert hidden.manifest("ds", 1).layer_ids == [2, 4, 5, 8] and hidden.manifest("ds").version == 2

    # fp8 files beside bf16 ones would train on a mix: a dtype change is a new version too
    fp8 = msgspec.structs.replace(other, capture=msgspec.structs.replace(other.capture, dtype="fp8"))
    with pytest.raises(CaptureError, match="holds bfloat16 .* asks for float8_e4m3fn .* --new-version"):
        queue_capture(fp8, store, app, r, "ds")
    v3 = queue_capture(fp8, store, app, r, "ds", new_version=True)
    assert (v3.version, v3.dtype) == (3, "float8_e4m3fn") and hidden.manifest("ds", 3).dtype == "float8_e4m3fn"
    assert v3.bytes_estimate == 30 * (4 * 128 + 4 + 8) and hidden.manifest("ds", 2).dtype == "bfloat16"


def test_bytes_per_token_and_the_projection_of_the_budget_left(tmp_path, tokenizer_dir, redis_server):
    from draftfleet.views.inventory import run_inventory
    from draftfleet.views.status import capture_rows

    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[
        {"name": "ds", "path": str(tmp_path / "d.jsonl"), "budget_tokens": 40}])
    with open(config, "a") as fh:
        fh.write(f'\n[capture]\nmodel_path = "{_model(tmp_path / "model")}"\ndtype = "fp8"\n')
    cfg = load_config(config)
    store = open_store(cfg)
    for i in range(3):  # 3 turns of 6 prompt + 4 answer tokens: 2.5 captured tokens per answer token
        store.put(_record(f"{i:02x}" * 32, output_ids=[1, 2, 3, 4], completion_tokens=4, prompt_tokens=6))
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    s = queue_capture(cfg, store, app, r, "ds")
    fp8 = 4 * 128 + 4 + 8  # a token in fp8: its 4 states, its scale, its id
    assert (s.bytes_per_token, s.budget_tokens_left, s.bytes_estimate) == (fp8, 40 - 12, 30 * fp8)
    assert s.projected_bytes == (30 + 28 * 2.5) * fp8  # the 3 turns, and the budget's 28 answer tokens with prompts
    [row] = capture_rows(r, ["ds"], {"ds": 28})
    assert (row.bytes_per_token, row.projected_bytes) == (fp8, (30 + 70) * fp8)
    r.hincrby(rk.capture_progress("ds"), "captured_tokens", 10)  # a worker stored a turn
    assert capture_rows(r, ["ds"], {"ds": 28})[0].projected_bytes == (20 + 70) * fp8

    # once files are stored, the measured figure (headers included) replaces the dtype's
    m, got = _fp8_unit(t=10)
    data = encode_safetensors({"token_ids": ("I64", got.ids), "hidden_states": ("F8_E4M3", np.zeros((10, 4, 128), np.uint8)),
                               "hidden_states_scales": got.scales}, {"prompt_len": "6"})
    HiddenStore(store).put("ds", 1, "00" * 32, 0, data)
    [inv] = run_inventory(cfg.fleet.store, cfg, processes=1)
    h = inv.hidden_states
    measured = round(len(data) / 10, 1)
    assert (h.dtype, h.files, h.tokens, h.bytes_per_token) == ("float8_e4m3fn", 1, 10, measured) and measured > fp8
    assert h.projected_bytes == round((30 - 10 + 70) * measured)
    again = queue_capture(cfg, store, app, r, "ds")
    assert again.bytes_per_token == measured and again.bytes_estimate == round(20 * measured)


def _fp8_unit(t: int = 3, nan: bool = False):
    from draftfleet.schemas.records import CaptureManifest
    from draftfleet.workers.capture_intake import Captured

    m = CaptureManifest(dataset="ds", version=1, model="m", model_config_sha256="0" * 64, num_layers=8, hidden_size=4,
                        layer_ids=[2, 4, 5, 8], dtype="float8_e4m3fn", created_at=0.0)
    states = np.full((t, 4, 4), 0x38, dtype=np.uint8)  # 1.0 in e4m3
    if nan:
        states[1, 2, 3] = 0xFF
    from draftfleet.workers.capture_intake import wanted_contract

    return m, Captured("/incoming/x.safetensors", np.arange(t, dtype=np.int64), "float8_e4m3fn", states,
                       ("F32", np.full((t, 1, 1), 0.5, np.float32)), wanted_contract(m))


def test_fp8_states_are_checked_like_bf16_ones():
    from draftfleet.workers.backends import Halt, Permanent
    from draftfleet.workers.capture_intake import check_states

    m, got = _fp8_unit()
    check_states([0, 1, 2], got, m)
    with pytest.raises(Permanent, match="NaN"):
        check_states([0, 1, 2], _fp8_unit(nan=True)[1], m)
    with pytest.raises(Halt, match="hidden_states_scales"):
        check_states([0, 1, 2], got._replace(scales=None), m)
    with pytest.raises(Permanent, match="bad scale"):
        check_states([0, 1, 2], got._replace(scales=("F32", np.zeros((3, 1, 1), np.float32))), m)
    with pytest.raises(Halt, match="the engine wrote bfloat16 states, the version holds float8_e4m3fn"):
        check_states([0, 1, 2], got._replace(dtype="bfloat16", states=got.states.astype(np.uint16)), m)


def test_fp8_bits_decode_as_e4m3fn():
    from draftfleet.hidden import fp8_to_f32

    got = fp8_to_f32(np.array([0x38, 0x7E, 0xFE, 0x01, 0x08, 0x3C, 0x00, 0x80, 0x7F], dtype=np.uint8))
    assert got[:8].tolist() == [1.0, 448.0, -448.0, 2.0**-9, 2.0**-6, 1.5, 0.0, -0.0] and np.isnan(got[8])


def test_capture_refuses_more_than_the_free_space(tmp_path, tokenizer_dir, redis_server):
    cfg, store = _fleet(tmp_path, tokenizer_dir, hidden=2**40)  # ~2^43 bytes a token
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    with pytest.raises(CaptureError, match="--ignore-space"):
        queue_capture(cfg, store, app, r, "ds")
    assert not HiddenStore(store).versions("ds") and not r.llen(rk.capture_queue("ds"))  # nothing started
    env = {"REDIS_URL": redis_server.url, "COLUMNS": "1000"}
    res = run_cli("capture", "--config", str(tmp_path / "fleet.toml"), env=env)  # the file _fleet wrote
    assert res.returncode == 1 and res.stdout == "", res
    [message] = res.stderr.strip().splitlines()
    assert message.startswith("error: ") and "--ignore-space" in message, message
    assert queue_capture(cfg, store, app, r, "ds", ignore_space=True).queued == 3
    res = run_cli("capture", "--config", str(tmp_path / "fleet.toml"), "--ignore-space", "--json", env=env)
    assert res.returncode == 0, res.stderr
    [summary] = json.loads(res.stdout)
    assert (summary["dataset"], summary["queued"], summary["already_queued"]) == ("ds", 0, 3)


def test_capture_puts_its_first_unit_on_the_queue_before_sending_the_rest(tmp_path, tokenizer_dir, redis_server,
                                                                         monkeypatch):
    # A capture worker (and its engine) waits for draftfleet capture: the first unit goes out in its own
    # round trip, not in the first batch of 50 (BENCHMARKS.md, capture alone against alone)
    from draftfleet.producer import sender

    cfg, store = _fleet(tmp_path, tokenizer_dir)
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    seen_at_send: list[int] = []
    send = sender.TaskSender.send

    def watching(self, *args, **kwargs):
        seen_at_send.append(r.llen(rk.capture_queue("ds")))
        return send(self, *args, **kwargs)

    monkeypatch.setattr(sender.TaskSender, "send", watching)
    assert queue_capture(cfg, store, app, r, "ds").queued == 3
    assert seen_at_send == [0, 1, 1]  # the first was in Redis when the second was built; the rest batched
    assert r.llen(rk.capture_queue("ds")) == 3


def test_the_capture_command_does_not_load_the_dataset_readers():
    # pyarrow and ijson cost the command's start, which a waiting engine idles through
    code = "import sys, draftfleet.cli.capture, draftfleet.producer.capture; print(sorted({'pyarrow', 'ijson'} & set(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res


def test_speculators_layout_links_the_files_and_aligns_the_rows(tmp_path):
    files = []
    for i in range(3):
        p = tmp_path / f"s{i}.safetensors"
        p.write_bytes(encode_safetensors({"token_ids": ("I64", np.arange(i + 2, dtype=np.int64))}, {}))
        files.append((f"id{i}", list(range(i + 2)), [0] + [1] * (i + 1), str(p)))
    out = tmp_path / "ds.speculators"
    assert speculators.write(out, files) == 3
    for i, (_id, _ids, _mask, src) in enumerate(files):  # row i <-> hs_i, the store's file itself
        assert os.path.samefile(out / "hidden_states" / f"hs_{i}.safetensors", src)
    table = pa.ipc.open_stream(str(out / speculators.SHARD)).read_all()
    assert table.column("id").to_pylist() == ["id0", "id1", "id2"]
    assert table.column("input_ids").to_pylist() == [f[1] for f in files] and table.column("seq_len").to_pylist() == [2, 3, 4]
    assert table.column("loss_mask").to_pylist() == [f[2] for f in files]
    assert json.loads((out / "state.json").read_text())["_format_type"] == "torch"


def _engine_file(path, t: int = 3, room: int = 1024) -> bytes:
    """A file as the fleet's connector writes it: the states, the ids, and a header with room."""
    states = f32_to_bf16(np.random.default_rng(1).standard_normal((t, 4, 8)).astype(np.float32))
    path.write_bytes(encode_safetensors({"hidden_states": ("BF16", states), "token_ids": ("I64", np.arange(t))},
                                        {"header_room": " " * room} if room else {}))
    return path.read_bytes()


def test_the_unit_metadata_goes_into_the_header_room_in_place(tmp_path):
    from draftfleet.hidden import SEAL_KEY, read_checked, rewrite_metadata

    path = tmp_path / "req.safetensors"
    before = _engine_file(path)
    meta = {"dataset": "ds", "key": "ab" * 32, "turn": "0", "prompt_len": "2", "version": "1", "layer_ids": "2,4,5,8",
            "model": "m"}
    assert rewrite_metadata(path, meta)
    after = path.read_bytes()
    (n,) = struct.unpack("<Q", before[:8])
    assert len(after) == len(before) and after[8 + n:] == before[8 + n:]  # the tensors' bytes untouched
    with safe_open(str(path), framework="numpy") as f:  # safetensors' own reader takes the padded header
        assert f.metadata() == {**meta, SEAL_KEY: f.metadata()[SEAL_KEY]}
        assert f.get_tensor("token_ids").tolist() == [0, 1, 2]
    assert read_checked(path, True)[2]  # sealed: the header written and the data
    no_room = tmp_path / "plain.safetensors"
    plain = _engine_file(no_room, room=0)
    assert not rewrite_metadata(no_room, meta) and no_room.read_bytes() == plain
    small = tmp_path / "small.safetensors"
    tight = _engine_file(small, room=16)
    assert not rewrite_metadata(small, meta) and small.read_bytes() == tight  # does not fit: nothing written


def test_a_linked_engine_file_is_stored_once_and_read_only(tmp_path):
    import stat

    from draftfleet.store import link_once

    old = os.umask(0o002)
    try:
        src = tmp_path / "incoming" / "req.safetensors"
        src.parent.mkdir()
        _engine_file(src)
        final = tmp_path / "store" / "_hidden" / "ds" / "v1" / "ab" / ("ab" * 32 + ".0.safetensors")
        assert link_once(src, final) and os.path.samefile(src, final)
        other = tmp_path / "incoming" / "twin.safetensors"
        _engine_file(other, t=5)
        assert not link_once(other, final) and not os.path.samefile(other, final)  # write-once: the first stays
    finally:
        os.umask(old)
    assert stat.S_IMODE(final.stat().st_mode) == 0o444 and stat.S_IMODE(final.parent.stat().st_mode) == 0o755


def test_storage_on_another_file_system_is_refused_unless_copy(tmp_path, tokenizer_dir, redis_server):
    from draftfleet.hidden import check_storage

    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same file system as the test's folder here")
    cfg, store = _fleet(tmp_path, tokenizer_dir)
    check_storage(cfg, tmp_path / "store" / "_hidden" / "_incoming")  # the default: beside the store
    other = tmp_path.name + "-incoming"
    elsewhere = msgspec.structs.replace(cfg, capture=msgspec.structs.replace(cfg.capture, storage_path=f"/dev/shm/{other}"))
    try:
        with pytest.raises(CaptureError, match="another file system than the store.*copy = true"):
            queue_capture(elsewhere, store, make_app(redis_server.url, 3600), redis_server.client(), "ds")
        assert not HiddenStore(store).versions("ds")
        copying = msgspec.structs.replace(elsewhere, capture=msgspec.structs.replace(elsewhere.capture, copy=True))
        check_storage(copying, f"/dev/shm/{other}")
    finally:
        os.rmdir(f"/dev/shm/{other}")


def test_a_killed_workers_engine_files_are_swept(tmp_path):
    import fcntl
    import time

    from draftfleet.workers.capture_intake import sweep_orphans

    folder = tmp_path / "incoming"
    folder.mkdir()
    linked, fresh, old, held = (folder / f"{n}.safetensors" for n in ("linked", "fresh", "old", "held"))
    for f in (linked, fresh, old, held):
        _engine_file(f)
    os.link(linked, tmp_path / "stored.safetensors")  # in the store already: its engine name is a leftover
    (folder / "old.safetensors.lock").write_text("")
    (folder / "held.safetensors.lock").write_text("")
    (folder / "gone.safetensors.lock").write_text("")  # the engine died before writing
    (folder / "x.safetensors.123.partial").write_text("")
    hour_ago = time.time() - 3600
    for name in ("old.safetensors", "old.safetensors.lock", "held.safetensors", "held.safetensors.lock",
                 "gone.safetensors.lock", "x.safetensors.123.partial"):
        os.utime(folder / name, (hour_ago, hour_ago))
    # issue 26 (3b): what the connector writes while it holds <x>.safetensors.lock is <x>.safetensors.<pid>.partial
    (folder / "writing.safetensors.77.partial").write_text("")
    (folder / "writing.safetensors.lock").write_text("")
    for name in ("writing.safetensors.77.partial", "writing.safetensors.lock"):
        os.utime(folder / name, (hour_ago, hour_ago))
    with open(folder / "held.safetensors.lock") as writer, open(folder / "writing.safetensors.lock") as writing:
        fcntl.flock(writer, fcntl.LOCK_EX)  # a live writer holds it
        fcntl.flock(writing, fcntl.LOCK_EX)  # a slow write of a large file, under its lock
        assert sweep_orphans(folder, 600) == 5
        assert sorted(p.name for p in folder.iterdir()) == [
            "fresh.safetensors", "held.safetensors", "held.safetensors.lock", "writing.safetensors.77.partial",
            "writing.safetensors.lock"]
    assert (tmp_path / "stored.safetensors").stat().st_nlink == 1  # the store's name stays
    assert sweep_orphans(folder, 600) == 4  # its writers gone: all of it
    assert sorted(p.name for p in folder.iterdir()) == ["fresh.safetensors"]


def test_a_launched_engines_folder_is_its_hosts_and_the_start_up_sweep_leaves_held_files(
        tmp_path, tokenizer_dir, redis_server):
    """Issue 26 (3a): two hosts' ``worker capture --gpu 0`` on one store each give their engine a folder
    of their own (``capture-gpu0@<host>``), and the start-up sweep of a host's folder removes what a
    killed predecessor left, never a file whose lock a live writer holds. Before, every host's worker
    emptied ``<storage>/capture-gpu0``, other hosts' in-flight files included."""
    import fcntl
    import socket

    storage = tmp_path / "incoming"
    config, cfg, _store = _capture_fleet(tmp_path, tokenizer_dir, "http://127.0.0.1:9", storage, [[1, 2, 3, 4]])
    with open(config, "a") as fh:  # an engine that cannot start: the worker stops right after its sweep
        fh.write(f'\n[backends.vllm.launch]\nmodel_path = "{tmp_path / "model"}"\n'
                 f'python = "{tmp_path / "no-engine" / "python"}"\n')
    mine, theirs = storage / f"capture-gpu0@{socket.gethostname()}", storage / "capture-gpu0@other-host"
    shared_before = storage / "capture-gpu0"  # the one folder every host used before
    files = {}
    for folder, name in ((shared_before, "inflight"), (theirs, "inflight"), (mine, "held"), (mine, "left")):
        folder.mkdir(parents=True, exist_ok=True)
        for suffix in (".safetensors", ".safetensors.lock"):
            (folder / (name + suffix)).write_text(name)
        files[folder, name] = folder / (name + ".safetensors")
    locks = []
    for folder, name in ((shared_before, "inflight"), (theirs, "inflight"), (mine, "held")):
        lock = open(folder / (name + ".safetensors.lock"))
        fcntl.flock(lock, fcntl.LOCK_EX)  # a live engine's writer
        locks.append(lock)
    try:
        res = run_cli("worker", "capture", "--config", str(config), "--gpu", "0",
                      env={"REDIS_URL": redis_server.url, "COLUMNS": "1000"}, timeout=120)
        assert res.returncode != 0, res
        assert files[shared_before, "inflight"].exists() and files[theirs, "inflight"].exists()
        assert files[mine, "held"].exists() and (mine / "held.safetensors.lock").exists()
        assert not files[mine, "left"].exists() and not (mine / "left.safetensors.lock").exists()
    finally:
        for lock in locks:
            lock.close()


def test_printing_the_engine_command_leaves_no_new_folder_behind(tmp_path, tokenizer_dir):
    """Issue 26 (3d): every ``worker capture --print-engine-command`` made a new connector folder that
    nobody removed; now every print names the same folder of this user's cache."""
    from draftfleet.tokenizer import check_code_folder

    cfg, _store = _fleet(tmp_path, tokenizer_dir)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    folders = []
    for _ in range(3):
        res = run_cli("worker", "capture", "--config", cfg.path, "--print-engine-command", env=env)
        assert res.returncode == 0, res.stderr
        folders.append(res.stdout.strip().split(" ", 1)[0].removeprefix("PYTHONPATH="))
    assert len(set(folders)) == 1 and folders[0].startswith(str(tmp_path / "cache" / "draftfleet" / "connector-"))
    assert not list((tmp_path / "tmp").iterdir()) and len(list((tmp_path / "cache" / "draftfleet").iterdir())) == 1
    check_code_folder(folders[0], "test")
    assert sorted(str(p.relative_to(folders[0])) for p in Path(folders[0]).rglob("*") if p.is_file()) == [
        "draftfleet/__init__.py", "draftfleet/workers/__init__.py", "draftfleet/workers/vllm_connector.py"]
    assert (Path(folders[0]) / "draftfleet/workers/vllm_connector.py").read_bytes() == (
        REPO / "workers" / "vllm_connector.py").read_bytes()


def test_vocabulary_counts_only_the_loss_masked_positions():
    from draftfleet.export.features import token_counts

    rows = [("a", [5, 6, 7, 7], [0, 0, 1, 1], "f", 2), ("b", [7, 5, 9], [0, 1, 1], "g", 1)]
    assert token_counts(rows) == {7: 2, 5: 1, 9: 1}  # the prompts' 5, 6 and 7 are not counted


def test_units_are_every_turn_with_its_stored_prompt_ids(target_tokenizer):
    from draftfleet.conversation import record_turns
    from draftfleet.hidden import record_units
    from draftfleet.schemas.records import Message, Turn, Usage

    def turn(prompt, output):
        return Turn(prompt_ids=prompt, output_ids=output, text="t", finish_reason="stop", truncated=False,
                    prompt_tokens=len(prompt), completion_tokens=len(output), backend="vllm", backend_kind="gpu",
                    model="m", token_source="exact", usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=0.1,
                    attempts=1, worker="w", created_at=0.0)

    convo = _record("cd" * 32, turns=[turn([5, 6, 7], [8, 9]), turn([5, 6, 7, 8, 9, 10], [11, 12, 13])])
    assert record_units(convo, target_tokenizer) == [([5, 6, 7, 8, 9], 3), ([5, 6, 7, 8, 9, 10, 11, 12, 13], 6)]
    # a single-turn record: the template's render of its messages, as the GPU worker sent it
    messages = [Message(role="user", content="write a function")]
    prompt = target_tokenizer.prompt_ids(messages)
    single = _record("ef" * 32, messages=messages, prompt_tokens=len(prompt), output_ids=[3, 4])
    assert len(record_turns(single)) == 1 and record_units(single, target_tokenizer) == [(prompt + [3, 4], len(prompt))]
    with pytest.raises(CaptureError, match="another tokenizer or chat template"):
        record_units(msgspec.structs.replace(single, prompt_tokens=len(prompt) + 1), target_tokenizer)


# -- the capture worker against an engine whose word is checked (issue 18) -----------------------
PROMPT_LEN = 15  # _record's messages rendered by the sample tokenizer's template (checked below)


def _capture_fleet(tmp_path, tokenizer_dir, engine_url: str, storage, outputs: list[list[int]], max_attempts: int = 2,
                   vocab_size: int = 0, store: str | None = None):
    """A store of records with these output ids (``store``: its location, default a folder), a config
    whose vLLM is ``engine_url``; (config path, cfg, store)."""
    config = write_config(tmp_path, tokenizer=tokenizer_dir, max_attempts=max_attempts, store=store,
                          datasets=[{"name": "ds", "path": str(tmp_path / "d.jsonl")}])
    model = _model(tmp_path / "model", vocab_size=vocab_size)
    with open(config, "a") as fh:
        fh.write(f'\n[capture]\nmodel_path = "{model}"\nstorage_path = "{storage}"\ninflight = 2\n'
                 f'\n[backends.vllm]\nurls = ["{engine_url}"]\nrequest_timeout_s = 30.0\n')
    cfg = load_config(config)
    store = open_store(cfg)
    store.prepare()
    for i, out in enumerate(outputs):
        _put_record(store, i, out)
    return config, cfg, store


def _put_record(store, i: int, output_ids: list[int]) -> None:
    """Record i of ``_record``'s prompt, as the GPU worker stores it (prompt_tokens: its render's length)."""
    store.put(_record(f"{i:02x}" * 32, output_ids=output_ids, prompt_tokens=PROMPT_LEN))


def test_prompt_len_is_the_records_render(target_tokenizer):
    assert len(target_tokenizer.prompt_ids(_record("00" * 32).messages)) == PROMPT_LEN


def _model_sha(tmp_path, vocab_size: int = 0) -> str:
    return TargetModel.load(_model(tmp_path / "model", vocab_size=vocab_size)).config_sha256


def test_capture_stores_nothing_an_engine_of_other_layers_computed(tmp_path, tokenizer_dir, target_tokenizer,
                                                                    redis_server, workers):
    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    sha = _model_sha(tmp_path)
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], sha))
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]] * 3)
    r, app, hidden = redis_server.client(), make_app(redis_server.url, 3600), HiddenStore(store)
    assert queue_capture(cfg, store, app, r, "ds").queued == 3
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    wait_until(lambda: len(list(hidden.files("ds", 1))) == 3, 60, 0.1, f"3 files\n{workers.logs()}")
    for _key, _turn, path in hidden.files("ds", 1):  # the engine's contract kept with the states
        assert json.loads(read_safetensors(path)[1]["draftfleet_contract"])["layer_ids"] == [2, 4, 5, 8]

    # the server at that URL restarted by hand with other layer ids: states of the same shape
    engine.contract = contract([1, 3, 6, 8], sha)
    wrong_at = []

    def answer(ids):  # when each request met the wrong engine
        if engine.contract["layer_ids"] != [2, 4, 5, 8]:
            wrong_at.append(time.monotonic())
        return engine.right(ids)

    engine.answer = answer
    for i in range(3, 9):
        _put_record(store, i, [1, 2, 3, 4 + i])
    assert queue_capture(cfg, store, app, r, "ds").queued == 6
    refusal = "the engine computed layers [1, 3, 6, 8] (hidden 128, 8 layers, bfloat16, model config"
    wait_until(lambda: refusal in workers.logs(None), 60, 0.1, f"the refusal\n{workers.logs()}")
    # issue 26 (3e): the worker backs off, one unit asking again after 5 s, then 10 s, and says so once
    # (before: every thread asked again every 5 s and logged each refusal)
    wait_until(lambda: time.monotonic() > wrong_at[0] + 13, 30, 0.2)
    log = workers.logs(None)
    assert log.count(refusal) == 1 and "pauses its captures" in log, log[-3000:]
    line = next(ln for ln in log.splitlines() if refusal in ln)
    assert "ds v1 wants layers [2, 4, 5, 8]" in line and "nothing stored" in line, line
    burst = [t for t in wrong_at if t < wrong_at[0] + 3]  # the requests under way when the pause began
    later = [t - wrong_at[0] for t in wrong_at if t >= wrong_at[0] + 3]
    assert len(burst) <= 4 and len(later) == 1 and 4.5 <= later[0] < 9, (burst, later)
    assert len(list(hidden.files("ds", 1))) == 3 and int(r.hget(rk.capture_progress("ds"), "failed") or 0) == 0
    engine.contract = contract([2, 4, 5, 8], sha)  # a right engine again: the units were left for it
    wait_until(lambda: len(list(hidden.files("ds", 1))) == 9, 60, 0.1, f"9 files\n{workers.logs()}")
    assert "captures resume" in workers.logs(None)


@pytest.mark.parametrize("engine_layers, why", [
    ([1, 3, 6, 8], "the engine computed layers [1, 3, 6, 8] (hidden 128, 8 layers, bfloat16, model config {sha}), "
                   "this worker's [capture] settings wants layers [2, 4, 5, 8] (hidden 128, 8 layers, bfloat16, "
                   "model config {sha})"),
    (None, "carries no draftfleet_contract: the engine does not run the fleet's connector"),
])
def test_capture_worker_refuses_to_start_on_an_engine_of_another_contract(tmp_path, tokenizer_dir, redis_server,
                                                                          engine_layers, why):
    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    sha = _model_sha(tmp_path)
    engine = CaptureEngine(storage, contract(engine_layers, sha) if engine_layers else None)
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]])
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == 1
    res = run_cli("worker", "capture", "--config", str(config), "--url", engine.url,
                  env={"REDIS_URL": redis_server.url, "COLUMNS": "1000"}, timeout=60)
    assert res.returncode == 1, res
    [message] = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert why.format(sha=sha[:12]) in message, message
    assert not list(HiddenStore(store).files("ds", 1)) and r.llen(rk.capture_queue("ds")) == 1  # nothing taken
    assert not list(storage.iterdir()), "the probe's file is left behind"


def test_a_capture_worker_whose_engine_died_on_its_first_capture_says_it_died(tmp_path, tokenizer_dir, redis_server):
    # issue 42: vLLM's CPU engine killed by SIGILL answered EngineDeadError, which the worker called
    # "not a capture engine this worker can use" (a configuration mistake)
    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    engine.dies_on_request = True  # healthy until its first capture
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]])
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == 1
    res = run_cli("worker", "capture", "--config", str(config), "--url", engine.url,
                  env={"REDIS_URL": redis_server.url, "COLUMNS": "1000"}, timeout=60)
    assert res.returncode == 1, res
    [message] = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert "died on the worker's first capture, before any unit was taken" in message, message
    assert "answered that its engine died (EngineCore encountered an issue." in message, message
    assert "not a capture engine" not in res.stderr
    assert r.llen(rk.capture_queue("ds")) == 1  # nothing taken


def test_a_capture_worker_pauses_while_its_engine_is_dead_and_fails_nothing(tmp_path, tokenizer_dir, redis_server,
                                                                             workers):
    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]] * 2)
    r, app, hidden = redis_server.client(), make_app(redis_server.url, 3600), HiddenStore(store)
    assert queue_capture(cfg, store, app, r, "ds").queued == 2
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    wait_until(lambda: len(list(hidden.files("ds", 1))) == 2, 60, 0.1, lambda: f"2 files\n{workers.logs()}")
    engine.dead = True  # its engine core died: 500 EngineDeadError, /health 503
    for i in range(2, 6):
        _put_record(store, i, [1, 2, 3, 4 + i])
    assert queue_capture(cfg, store, app, r, "ds").queued == 4
    dead = "answered that its engine died (EngineCore encountered an issue."
    wait_until(lambda: dead in workers.logs(None), 60, 0.1, lambda: f"the death\n{workers.logs()}")
    time.sleep(6)  # past the first probe
    log = workers.logs(None)
    line = next(ln for ln in log.splitlines() if dead in ln)
    assert "engine_dead: " in line and "pauses its captures" in line and "not a capture engine" not in log, line
    assert int(r.hget(rk.capture_progress("ds"), "failed") or 0) == 0 and len(list(hidden.files("ds", 1))) == 2
    engine.dead = False  # restarted: the units were left for it
    wait_until(lambda: len(list(hidden.files("ds", 1))) == 6, 90, 0.1, lambda: f"6 files\n{workers.logs()}")
    assert "captures resume" in workers.logs(None) and int(r.hget(rk.capture_progress("ds"), "failed") or 0) == 0


def _header_only(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def test_malformed_engine_files_and_other_ids_are_recorded_failures_never_silent_acks(
        tmp_path, tokenizer_dir, redis_server, workers):
    from tests.capture_engine import CaptureEngine, contract, engine_file

    storage = tmp_path / "incoming"
    right = contract([2, 4, 5, 8], _model_sha(tmp_path))
    engine = CaptureEngine(storage, right)
    ids16 = np.zeros(2, np.int64).tobytes()  # two int64 ids: 16 bytes
    cases = {  # the last output id of a unit -> (the file its answer names, what the worker's log says of it)
        20: (b"\x01\x02\x03", "3 bytes, not a safetensors file"),
        21: (_header_only({"hidden_states": 5, "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}},
                          ids16), "header entry 'hidden_states' is a JSON int, not an object"),
        22: (struct.pack("<Q", 9) + b"{not json", "the header is not JSON"),
        23: (struct.pack("<Q", 10**6) + b"{}", "header length 1000000 does not fit"),
        24: (_header_only(["a", "list"]), "the header is a JSON list, not an object"),
        25: (_header_only({"token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 64]}}, ids16),
             "data_offsets [0, 64] outside its 16 data bytes"),
        26: (_header_only({"token_ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 16]}}, ids16),
             "of shape [3] I64 holds 16 bytes"),
        27: (_header_only({"token_ids": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 16]}}, ids16),
             "has dtype 'Q99'"),
        28: (_header_only({"__metadata__": {"draftfleet_contract": 7}}), "__metadata__ is not an object of strings"),
        29: (encode_safetensors({"hidden_states": ("BF16", np.zeros((19, 4, 128), np.uint16)),
                                 "token_ids": ("I64", np.zeros(19, np.int64))}, {"draftfleet_contract": "{"}),
             "its draftfleet_contract metadata"),
        30: (_header_only({"token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, ids16),
             "expected token_ids [T] and bf16 or fp8 hidden_states"),
        31: (None, "holds 19 ids that differ from the 19 sent (first at position 18)"),  # a whole file of other ids than those sent (last one changed)
    }
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage,
                                        [[1, 2, 3, last] for last in cases], max_attempts=2)

    def answer(ids):
        if len(ids) == 1:
            return engine.right(ids)
        data, _why = cases[ids[-1]]
        return engine.fresh_path(), data if data is not None else engine_file([*ids[:-1], 99], 4, 128, right)

    engine.answer = answer
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == len(cases)
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    progress = rk.capture_progress("ds")
    wait_until(lambda: int(r.hget(progress, "failed") or 0) == len(cases), 120, 0.2,
               "every unit counted as failed")
    wait_until(lambda: not r.hlen(rk.UNACKED) and not r.llen(rk.capture_queue("ds")), 30, 0.2, "every unit settled")
    log = workers.logs(None)
    for last, (_data, why) in cases.items():
        assert why in log, (last, why)
    assert log.count("failed: hidden_states_") == len(cases) and "unexpected error" not in log
    assert not list(HiddenStore(store).files("ds", 1)) and int(r.hget(progress, "captured") or 0) == 0
    assert not list(storage.iterdir()), "the engine's files are left behind"


def test_a_unit_stored_by_a_twin_meanwhile_is_not_counted_again(tmp_path, tokenizer_dir, redis_server, workers):
    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4], [1, 2, 3, 5]])
    hidden, twin = HiddenStore(store), "01" * 32

    def answer(ids):  # while the engine computes unit 01, a twin worker stores it
        if ids[-1] == 5:
            assert hidden.put("ds", 1, twin, 0, b"the twin's file")
        return engine.right(ids)

    engine.answer = answer
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == 2
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    wait_until(lambda: len([ids for ids in engine.requests if len(ids) > 1]) == 2 and not r.hlen(rk.UNACKED)
               and not r.llen(rk.capture_queue("ds")), 60, 0.2, "both units settled")
    wait_until(lambda: int(r.hget(rk.capture_progress("ds"), "captured") or 0) >= 1, 10, 0.1, "one counted")
    time.sleep(0.5)
    assert int(r.hget(rk.capture_progress("ds"), "captured")) == 1  # its own, not the twin's
    assert hidden.path("ds", 1, twin, 0).read_bytes() == b"the twin's file"


def test_a_capture_worker_puts_its_claims_back_at_once_after_a_redis_reset(tmp_path, tokenizer_dir, redis_server,
                                                                          workers):
    import threading

    from tests.capture_engine import CaptureEngine, contract

    storage = tmp_path / "incoming"
    engine = CaptureEngine(storage, contract([2, 4, 5, 8], _model_sha(tmp_path)))
    config, cfg, store = _capture_fleet(tmp_path, tokenizer_dir, engine.url, storage, [[1, 2, 3, 4]])
    release = threading.Event()

    def answer(ids):  # the unit takes as long as the test wants: its claim is held meanwhile
        if len(ids) > 1:
            release.wait(60)
        return engine.right(ids)

    engine.answer = answer
    r, app = redis_server.client(), make_app(redis_server.url, 3600)
    assert queue_capture(cfg, store, app, r, "ds").queued == 1
    workers.start(config, "capture", "--url", engine.url, "--name", "cap", redis_url=redis_server.url)
    claim = rk.capture_claim("ds", f"{'00' * 32}.0.v1")
    wait_until(lambda: r.exists(claim), 60, 0.1, "the unit's claim")
    r.flushall()  # Redis came back empty; the worker's heartbeat is 20 s away
    t0 = time.monotonic()
    wait_until(lambda: r.exists(claim), 10, 0.05, "the claim back")
    assert time.monotonic() - t0 < 2.5  # within the state poll (0.5 s) and a beat, as generation workers
    s = queue_capture(cfg, store, app, r, "ds")  # what the worker captures now is not sent again
    assert (s.queued, s.already_queued, s.running) == (0, 0, 1)
    release.set()
    wait_until(lambda: len(list(HiddenStore(store).files("ds", 1))) == 1, 60, 0.1, "the unit stored")
    assert not r.llen(rk.capture_queue("ds"))


def test_store_modes_do_not_follow_the_umask_and_stored_files_are_read_only(tmp_path):
    import stat

    from draftfleet.schemas.config import VLLMLaunch
    from draftfleet.schemas.records import FailureRecord, QuarantineEntry, TurnProgress
    from draftfleet.workers.capture_engine import capture_server, connector_folder, remove_connector_folder

    from tests.conftest import free_port
    from tests.test_security import _task

    old = os.umask(0o002)  # a group-shared umask: folders 0775 and files 0664 unless the fleet says otherwise
    try:
        store = open_store(tmp_path / "store")
        store.prepare()
        key = "ab" * 32
        store.put(_record(key))
        store.put_progress(TurnProgress(key="ef" * 32, dataset="ds", turns=[]))
        store.put_failure(FailureRecord(key="cd" * 32, dataset="ds", source="f.jsonl:2", reason="r", error_kind="http_400",
                                        attempts=1, backend="b", worker="w", failed_at=0.0, task=_task("ds", "cd" * 32)))
        store.quarantine("ds", [QuarantineEntry(file="f.jsonl", line=3, field=None, kind="bad_json", message="m", at=0.0)])
        hidden = HiddenStore(store)
        hidden.put("ds", 1, key, 0, encode_safetensors({"token_ids": ("I64", np.arange(3, dtype=np.int64))}, {}))
        connector = connector_folder()
        capture_server(VLLMLaunch(model_path=str(tmp_path / "model")), [0], free_port(), [2, 4, 5, 8],
                       str(store.root / "_hidden" / "_incoming"), connector)
        remove_connector_folder(connector)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(store.root)): stat.S_IMODE(p.stat().st_mode) for p in store.root.rglob("*")}
    assert {p for p in modes if p.startswith(("_progress", "_failures", "_quarantine", "_hidden", "ds"))}, modes
    for p, mode in modes.items():
        if (store.root / p).is_dir():
            assert mode == 0o755, (p, oct(mode))  # no group member can plant or replace a file
        elif p.startswith("_quarantine"):
            assert mode == 0o644, (p, oct(mode))  # appended to by every enqueue
        else:
            assert mode == 0o444, (p, oct(mode))  # read-only: readable by a trainer's account, written once
    # a hard-linked export shares the stored file's inode, hence its read-only mode
    out = tmp_path / "ds.speculators"
    speculators.write(out, [("id0", [0, 1, 2], [0, 1, 1], str(hidden.path("ds", 1, key, 0)))])
    linked = out / "hidden_states" / "hs_0.safetensors"
    assert os.path.samefile(linked, hidden.path("ds", 1, key, 0)) and stat.S_IMODE(linked.stat().st_mode) == 0o444


def test_every_hidden_state_export_states_its_layers_in_each_trainers_numbering(tmp_path, monkeypatch):
    """Issue 18, item 7: the manifest names the layers in both numberings, each format's last layer
    and the chat template's hash; each folder's draft_config.json carries the ids in its trainer's
    convention (speculators/vLLM: r_k is id k; SpecForge/SGLang: id k-1)."""
    from draftfleet.export import features
    from draftfleet.export.features import export_features
    from draftfleet.schemas.records import CaptureManifest

    store = open_store(tmp_path / "store")
    store.prepare()
    key = "ab" * 32
    store.put(_record(key, output_ids=[1, 2]))
    hidden = HiddenStore(store)
    m = CaptureManifest(dataset="ds", version=1, model="m", model_config_sha256="0" * 64, num_layers=61,
                        hidden_size=8, layer_ids=[2, 30, 58, 61], created_at=0.0)  # Kimi-K2.5's defaults
    hidden.write_manifest(m)
    hidden.put("ds", 1, key, 0, encode_safetensors({"token_ids": ("I64", np.arange(5, dtype=np.int64)),
                                                   "hidden_states": ("BF16", np.zeros((5, 4, 8), np.uint16))},
                                                  {"prompt_len": "3"}))
    out = tmp_path / "out"
    plans = []
    monkeypatch.setattr(features, "_run_torch", lambda plan, python: plans.append(plan))  # torch: tests/engines
    got = export_features(store, "ds", out, ["speculators"], model_path=None, chat_template_sha256="c" * 64)
    assert plans and got.layers.layer_ids_vllm == [2, 30, 58, 61]
    assert (got.layers.aux_layer_ids_vllm, got.layers.aux_layer_ids_sglang) == ([2, 30, 58], [1, 29, 57])
    assert got.layers.last_layer == {"speculators": "pre_norm"} and got.layers.chat_template_sha256 == "c" * 64
    written = json.loads((out / "ds.features.json").read_text())
    assert written["layers"]["aux_layer_ids_sglang"] == [1, 29, 57] and written["layers"]["num_layers"] == 61
    spec = json.loads((out / "ds.speculators" / "draft_config.json").read_text())
    assert spec == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "target_hidden_size": 8}
    # SpecForge's default for a 61-layer target is [1, N//2-1, N-4] = [1, 29, 57], the same residual streams
    assert features.draft_config("specforge", got.layers) == {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}, "target_hidden_size": 8}


def test_an_export_takes_each_files_ids_from_the_bytes_it_checked_in_one_open(tmp_path, monkeypatch):
    """Issue 29 (5): the export checked a file in one open and read its ids in another, so a write
    between the two was exported unseen. Here every open after a file's first finds its ids changed:
    the export still gives the ids checked, from one open of each file."""
    from draftfleet.hidden import format as hidden_module  # where read_checked opens the file
    from draftfleet.export import features
    from draftfleet.schemas.records import CaptureManifest

    store = open_store(tmp_path / "store")
    store.prepare()
    hidden = HiddenStore(store)
    hidden.write_manifest(CaptureManifest(dataset="ds", version=1, model="m", model_config_sha256="0" * 64,
                                          num_layers=8, hidden_size=8, layer_ids=[2, 4, 5, 8], created_at=0.0))
    keys = ["ab" * 32, "cd" * 32]
    for key in keys:
        store.put(_record(key, output_ids=[1, 2]))
        hidden.put("ds", 1, key, 0, encode_safetensors({"token_ids": ("I64", np.arange(5, dtype=np.int64)),
                                                        "hidden_states": ("BF16", np.zeros((5, 4, 8), np.uint16))},
                                                       {"prompt_len": "3"}, seal=True))
    opened: dict[str, int] = {}
    real_open = open

    def engine_between_opens(file, *args, **kwargs):  # the engine writes an id between two opens of a file
        name = os.fspath(file)
        if isinstance(name, str) and name.endswith(".safetensors"):
            opened[name] = opened.get(name, 0) + 1
            if opened[name] > 1:
                os.chmod(name, 0o644)
                with real_open(name, "r+b") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    fh.seek(8 + n + json.loads(fh.read(n))["token_ids"]["data_offsets"][0])
                    fh.write(np.int64(7).tobytes())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(hidden_module, "open", engine_between_opens, raising=False)
    monkeypatch.setattr(features, "_run_torch", lambda plan, python: None)  # torch: tests/engines
    got = features.export_features(store, "ds", tmp_path / "out", ["speculators"], model_path=None)
    assert (got.rows, got.bad_files) == (2, [])
    with pa.ipc.open_stream(str(tmp_path / "out" / "ds.speculators" / "data-00000-of-00001.arrow")) as reader:
        rows = reader.read_all().to_pylist()
    assert [r["input_ids"] for r in rows] == [[0, 1, 2, 3, 4]] * 2  # the ids checked, not the 7 written after
    assert sorted(opened.values()) == [1, 1]


def test_a_version_made_before_seals_counts_its_files_as_before_and_one_made_with_them_needs_them(tmp_path):
    """Issue 29 (4): a version whose manifest has no ``seal`` (made before seals) keeps its count:
    a file without a seal is not checked, one with the older digest of the data alone is checked
    against it. In a version made with seals, both are bad. A header naming an entry twice is
    refused (readers differ on which one counts)."""
    import hashlib

    from draftfleet.hidden import DIGEST_KEY, SEAL, checked_header as _header
    from draftfleet.schemas.records import CaptureManifest

    tensors = {"token_ids": ("I64", np.arange(4, dtype=np.int64)),
               "hidden_states": ("BF16", np.ones((4, 4, 8), np.uint16))}
    bare = encode_safetensors(tensors, {"prompt_len": "1"})
    at = 8 + struct.unpack("<Q", bare[:8])[0]
    old = encode_safetensors(tensors, {"prompt_len": "1", DIGEST_KEY: hashlib.sha256(bare[at:]).hexdigest()})
    files = {"aa" * 32: bare, "bb" * 32: old, "cc" * 32: encode_safetensors(tensors, {"prompt_len": "1"}, seal=True)}
    store = open_store(tmp_path / "store")
    store.prepare()
    hidden = HiddenStore(store)
    for version, seal in ((1, 0), (2, SEAL)):
        hidden.write_manifest(CaptureManifest(dataset="ds", version=version, model="m", model_config_sha256="0" * 64,
                                              num_layers=8, hidden_size=8, layer_ids=[2, 4, 5, 8], created_at=0.0,
                                              seal=seal))
        for key, data in files.items():
            hidden.put("ds", version, key, 0, data)
    assert hidden.verify("ds", 1) == (2, 1, [])
    good, unsealed, bad = hidden.verify("ds", 2)
    assert (good, unsealed, len(bad)) == (1, 0, 2) and all("changed after it was stored" in b for b in bad)
    assert "aa" * 32 in bad[0] and "no seal_sha256" in bad[0] and "bb" * 32 in bad[1]
    twice = tmp_path / "twice.safetensors"
    raw = files["cc" * 32]
    n = struct.unpack("<Q", raw[:8])[0]
    head = raw[8:8 + n].rstrip()
    entry = json.dumps({"dtype": "I64", "shape": [4], "data_offsets": [64, 96]}, separators=(",", ":")).encode()
    dup = head[:1] + b'"token_ids":' + entry + b"," + head[1:]
    twice.write_bytes(struct.pack("<Q", len(dup)) + dup + raw[8 + n:])
    with pytest.raises(ValueError, match="given twice"):
        _header(twice)
