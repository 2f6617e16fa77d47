"""Fast unit tests: config, keys, store, tokenizer, broker URL handling."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from draftfleet.broker import EmbeddedRedis, redact
from draftfleet.identity import prompt_key, settings_id
from draftfleet.schemas.config import ConfigError, load_config, parse_config
from draftfleet.schemas.records import GenerationSettings, Message, ResponseRecord, Usage
from draftfleet.store import StoreError, open_store
from draftfleet.tokenizer import TargetTokenizer

BASE = {"fleet": {"store": "s", "model": "m"}, "datasets": [{"name": "a", "path": "a.jsonl"}]}


def _cfg(**over):
    data = msgspec.json.decode(msgspec.json.encode(BASE))
    for k, v in over.items():
        data[k] = v
    return data


class TestConfig:
    def test_example_config_loads_and_resolves_paths(self):
        cfg = load_config("examples/fleet.toml")
        assert [d.name for d in cfg.datasets] == ["chat", "instruct"]
        assert cfg.datasets[0].path.endswith("examples/data/chat.jsonl")
        assert cfg.fleet.store.endswith("examples/store")
        assert cfg.cloud("openrouter").api_key_env == "OPENROUTER_API_KEY"
        assert cfg.sglang is not None and cfg.sglang.inflight == 32

    @pytest.mark.parametrize(
        "data, where",
        [
            (_cfg(datasets=[{"name": "a", "path": "x", "max_tokens": "many"}]), "datasets[0].max_tokens"),
            (_cfg(datasets=[{"name": "../evil", "path": "x"}]), "datasets[0].name"),
            (_cfg(datasets=[{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]), "datasets[1].name"),
            (_cfg(datasets=[{"name": "a", "path": "x", "budget": 5}]), "datasets[0]"),
            (_cfg(backends={"or": {"base_url": "u", "model": "m", "api_key_env": "sk-or-v1-abcdef"}}), "backends.or.api_key_env"),
            (_cfg(backends={"or": {"base_url": "u", "model": "m"}}), "backends.or"),
            (_cfg(fleet={"store": "s"}), "fleet"),
            (_cfg(datasets=[{"name": "a", "path": "x", "top_p": 0}]), "datasets[0].top_p"),
        ],
    )
    def test_errors_name_the_key(self, data, where):
        with pytest.raises(ConfigError) as exc:
            parse_config(data, "fleet.toml")
        assert where in str(exc.value)
        assert str(exc.value).startswith("fleet.toml: ")

    def test_api_key_value_is_never_echoed(self):
        with pytest.raises(ConfigError) as exc:
            parse_config(_cfg(backends={"or": {"base_url": "u", "model": "m", "api_key_env": "sk-or-v1-secret"}}))
        assert "sk-or-v1-secret" not in str(exc.value)

    def test_visibility_timeout_must_exceed_longest_task(self):
        data = _cfg(fleet={"store": "s", "model": "m", "visibility_timeout_s": 600},
                    backends={"sglang": {"urls": ["http://x"], "request_timeout_s": 900}})
        with pytest.raises(ConfigError, match="visibility_timeout_s"):
            parse_config(data)

    def test_bad_toml_names_file(self, tmp_path):
        p = tmp_path / "fleet.toml"
        p.write_text("[fleet\n")
        with pytest.raises(ConfigError, match="fleet.toml: not valid TOML"):
            load_config(p)


class TestIdentity:
    S = GenerationSettings(model="m", max_tokens=10, temperature=0.5, top_p=1.0)

    def test_key_is_stable_and_sensitive(self):
        msgs = [Message(role="user", content="hi")]
        k = prompt_key("a", msgs, self.S)
        assert k == prompt_key("a", [Message(role="user", content="hi")], self.S)
        assert len(k) == 64
        assert k != prompt_key("b", msgs, self.S)
        assert k != prompt_key("a", [Message(role="user", content="hi ")], self.S)
        assert k != prompt_key("a", msgs, msgspec.structs.replace(self.S, max_tokens=11))
        assert k != prompt_key("a", msgs, msgspec.structs.replace(self.S, system_prompt="x"))
        assert settings_id(self.S) != settings_id(msgspec.structs.replace(self.S, temperature=0.6))


def _record(key: str, dataset: str = "ds", **over) -> ResponseRecord:
    fields = dict(
        key=key, dataset=dataset, source="f.jsonl:1", settings_id="s", messages=[Message(role="user", content="q")],
        system_prompt_used=False, text="t", output_ids=[1, 2], prompt_tokens=3, completion_tokens=2,
        finish_reason="stop", truncated=False, backend="sglang", backend_kind="gpu", model="m", token_source="exact",
        usage=Usage(), cost_usd=0.0, cost_source="none", latency_s=0.1, attempts=1, worker="w", created_at=time.time(),
    )
    fields.update(over)
    return ResponseRecord(**fields)


class TestStore:
    def test_write_once_across_threads(self, tmp_path):
        store = open_store(tmp_path)
        key = "ab" * 32
        results = []
        barrier = threading.Barrier(8)

        def put(i):
            barrier.wait()
            results.append(store.put(_record(key, text=f"writer {i}")))

        threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count(True) == 1
        assert store.keys("ds") == {key}
        assert store.path("ds", key) == tmp_path / "ds" / "ab" / f"{key}.json"
        assert not [p for p in (tmp_path / "ds" / "ab").iterdir() if p.name.startswith(".tmp")]

    @pytest.mark.parametrize("name", ["../x", "/etc", "a/b", "a\x00b", "..", "", ".hidden"])
    def test_dataset_names_cannot_escape(self, tmp_path, name):
        with pytest.raises(StoreError):
            open_store(tmp_path).path(name, "ab" * 32)

    @pytest.mark.parametrize("key", ["../" + "a" * 61, "A" * 64, "a" * 63, "a" * 63 + "\x00"])
    def test_keys_must_be_hex(self, tmp_path, key):
        with pytest.raises(StoreError):
            open_store(tmp_path).path("ds", key)

    def test_unwritable_store_raises_store_error(self, tmp_path):
        (tmp_path / "ds").write_text("a file where a folder should be")
        with pytest.raises(StoreError, match="cannot write"):
            open_store(tmp_path).put(_record("cd" * 32))


class TestTokenizer:
    def test_literal_special_token_in_text_stays_text(self, target_tokenizer):
        ids = target_tokenizer.encode_text("before <|im_end|> after")
        assert target_tokenizer.eot_id not in ids
        assert target_tokenizer.decode(ids) == "before <|im_end|> after"

    def test_completion_ids_end_with_eot_only_when_stopped(self, target_tokenizer):
        msgs = [Message(role="user", content="write code")]
        stopped = target_tokenizer.completion_ids(msgs, "def f(): return 1", None, stopped=True)
        cut = target_tokenizer.completion_ids(msgs, "def f(): return 1", None, stopped=False)
        assert stopped[-1] == target_tokenizer.eot_id and stopped[:-1] == cut
        assert target_tokenizer.decode(cut) == "def f(): return 1"

    def test_reasoning_is_placed_as_the_template_places_it(self, target_tokenizer):
        msgs = [Message(role="user", content="q")]
        ids = target_tokenizer.completion_ids(msgs, "answer", "think hard", stopped=True)
        text = target_tokenizer.decode(ids, skip_special=False)
        assert text == "<think>\nthink hard\n</think>\n\nanswer<|im_end|>"

    def test_prompt_ids_follow_the_chat_template(self, target_tokenizer):
        msgs = [Message(role="system", content="sys"), Message(role="user", content="hello")]
        ids = target_tokenizer.prompt_ids(msgs)
        assert target_tokenizer.decode(ids, skip_special=False) == target_tokenizer.prompt_text(msgs)
        assert target_tokenizer.prompt_text(msgs).endswith("<|im_start|>assistant\n")

    def test_missing_folder_is_a_clear_error(self, tmp_path):
        from draftfleet.tokenizer import TokenizerError

        with pytest.raises(TokenizerError, match="does not exist"):
            TargetTokenizer(str(tmp_path / "nope"))


class TestBroker:
    def test_redact_hides_passwords(self):
        assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
        assert redact("rediss://user:s3cret@host:6380/1") == "rediss://user:***@host:6380/1"
        assert redact("redis://host:6379/0") == "redis://host:6379/0"

    def test_embedded_redis_is_private_and_shared_by_one_store(self, tmp_path):
        emb = EmbeddedRedis(tmp_path / "_redis")
        url = emb.ensure()
        try:
            assert "127.0.0.1" in url and ":" in url.split("@")[0]
            assert EmbeddedRedis(tmp_path / "_redis").ensure() == url  # found, not started twice
            import redis

            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(url.replace(url.split("@")[0], "redis://")).ping()
            assert oct((tmp_path / "_redis" / "redis.url").stat().st_mode & 0o777) == "0o600"
        finally:
            assert emb.stop()
        assert emb.running_url() is None


def test_rediss_urls_check_certificates():
    from draftfleet.broker import verified_tls

    assert verified_tls("rediss://:p@h:6380/0") == "rediss://:p@h:6380/0?ssl_cert_reqs=required"
    assert verified_tls("rediss://h/0?ssl_cert_reqs=none") == "rediss://h/0?ssl_cert_reqs=none"
    assert verified_tls("redis://h/0") == "redis://h/0"


def test_a_second_live_worker_with_the_same_name_is_refused(redis_server):
    import os

    from draftfleet import redis_keys as rk
    from draftfleet.schemas.config import ConfigError
    from draftfleet.workers.worker import refuse_duplicate_name

    r = redis_server.client()
    refuse_duplicate_name(r, "cloud-x@host")  # nobody there
    r.set(rk.worker_report("cloud-x@host"), msgspec.json.encode({"pid": 2**22 + 7}))
    refuse_duplicate_name(r, "cloud-x@host")  # a report left by a dead worker
    r.set(rk.worker_report("cloud-x@host"), msgspec.json.encode({"pid": os.getpid()}))
    with pytest.raises(ConfigError, match="--name"):
        refuse_duplicate_name(r, "cloud-x@host")
