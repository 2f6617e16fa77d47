"""Hidden states without an engine: layer ids, bf16 and safetensors, capture versions and space, the
speculators layout. The engine, transformers and both trainers' readers: ``tests/engines/test_capture.py``."""

from __future__ import annotations

import json
import os
import struct

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
from draftfleet.store import Store
from draftfleet.workers.app import make_app

from tests.conftest import run_cli, write_config
from tests.test_core import _record


def _model(folder, layers: int = 8, hidden: int = 128):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden}))
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
    hidden = HiddenStore(Store(tmp_path))
    key = "ab" * 32
    assert hidden.put("ds", 1, key, 0, b"first") and not hidden.put("ds", 1, key, 0, b"second")
    assert hidden.path("ds", 1, key, 0).read_bytes() == b"first" and hidden.put("ds", 1, key, 1, b"turn 1")


def _fleet(tmp_path, tokenizer_dir, hidden: int = 128):
    config = write_config(tmp_path, tokenizer=tokenizer_dir, datasets=[{"name": "ds", "path": str(tmp_path / "d.jsonl")}])
    with open(config, "a") as fh:
        fh.write(f'\n[capture]\nmodel_path = "{_model(tmp_path / "model", hidden=hidden)}"\n')
    cfg = load_config(config)
    store = Store(cfg.fleet.store)
    for i in range(3):
        store.put(_record(f"{i:02x}" * 32, output_ids=[1, 2, 3, 4], prompt_tokens=6))
    return cfg, store


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
    store = Store(cfg.fleet.store)
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
    from draftfleet.workers.capture import Captured

    m = CaptureManifest(dataset="ds", version=1, model="m", model_config_sha256="0" * 64, num_layers=8, hidden_size=4,
                        layer_ids=[2, 4, 5, 8], dtype="float8_e4m3fn", created_at=0.0)
    states = np.full((t, 4, 4), 0x38, dtype=np.uint8)  # 1.0 in e4m3
    if nan:
        states[1, 2, 3] = 0xFF
    return m, Captured(np.arange(t, dtype=np.int64), "float8_e4m3fn", states, ("F32", np.full((t, 1, 1), 0.5, np.float32)))


def test_fp8_states_are_checked_like_bf16_ones():
    from draftfleet.workers.backends import Halt, Permanent
    from draftfleet.workers.capture import check_states

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
