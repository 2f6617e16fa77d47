"""The engine and cloud clients against the emulator, as strict as the real servers: each test
is a behaviour of real SGLang or OpenRouter that the client once got wrong (FORMATS.md)."""

from __future__ import annotations

import pytest

from draftfleet.schemas.config import CloudBackend
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.workers.backends import Halt, Permanent, Transient
from draftfleet.workers.cloud import CloudChat

KEY = "sk-or-v1-client-test-secret"
USER = [Message(role="user", content="explain how a queue works")]


def task(max_tokens: int = 64, text: str = "explain how a queue works") -> PromptTask:
    settings = GenerationSettings(model="test/chatml", max_tokens=max_tokens, temperature=0.7, top_p=1.0)
    return PromptTask(key="c" * 64, dataset="ds", source="f:1", messages=[Message(role="user", content=text)],
                      settings=settings, settings_id="s", enqueued_at=0.0)


@pytest.fixture
def cloud(emulator_factory, target_tokenizer):
    emu = emulator_factory(time_scale=0, api_key=KEY, length="fixed:20", retry_after_s=7)
    chat = CloudChat("cloudy", CloudBackend(base_url=emu.url + "/v1", model="vendor/model", api_key_env="K"),
                     target_tokenizer, KEY)
    yield emu, chat
    chat.close()


def test_cloud_null_error_in_a_success_is_not_an_error(cloud) -> None:
    emu, chat = cloud
    gen = chat.generate(task())
    assert gen.finish_reason == "stop" and len(gen.output_ids) == 20


def test_cloud_403_is_moderation_only_with_its_metadata(cloud) -> None:
    emu, chat = cloud
    emu.update(rate_moderation=1.0)
    with pytest.raises(Permanent) as moderated:
        chat.generate(task())
    assert moderated.value.reason == "moderation"
    emu.update(rate_moderation=0.0, rate_403=1.0)  # a guardrail or a key without permission: not the prompt's fault
    with pytest.raises(Halt) as blocked:
        chat.generate(task())
    assert blocked.value.reason == "forbidden" and "403" in str(blocked.value) and KEY not in str(blocked.value)


def test_cloud_max_tokens_exceeded_halts_naming_max_tokens(cloud) -> None:
    emu, chat = cloud
    emu.update(max_output_tokens=32)
    with pytest.raises(Halt) as exc:
        chat.generate(task(max_tokens=64))
    assert exc.value.reason == "max_tokens_exceeded" and "datasets" in str(exc.value) and "max_tokens" in str(exc.value)
    assert chat.generate(task(max_tokens=32)).output_ids


def test_cloud_in_body_error_honours_retry_after_seconds(cloud) -> None:
    emu, chat = cloud
    emu.update(rate_200_error=1.0)
    with pytest.raises(Transient) as exc:
        chat.generate(task())
    assert exc.value.reason == "http_502" and exc.value.retry_after == 7


def test_cloud_in_flight_402_is_transient_with_retry_after(cloud) -> None:
    emu, chat = cloud
    emu.update(rate_402_inflight=1.0)
    with pytest.raises(Transient) as exc:
        chat.generate(task())
    assert exc.value.reason == "in_flight_budget" and exc.value.retry_after == 7
    emu.update(rate_402_inflight=0.0, rate_402=1.0)
    with pytest.raises(Halt) as halted:
        chat.generate(task())
    assert halted.value.reason == "payment_required"


def test_cloud_byok_spend_adds_the_providers_charge(cloud) -> None:
    emu, chat = cloud
    emu.update(price_input_per_mtok=1000.0, price_output_per_mtok=2000.0)
    full = chat.generate(task()).cost_usd
    emu.update(byok=True)
    gen = chat.generate(task())
    assert gen.usage.is_byok and gen.usage.upstream_cost_usd == pytest.approx(full)
    assert gen.cost_usd == pytest.approx(full * 1.05)  # OpenRouter's 5% fee plus the provider's own bill
