"""``import`` reads its file as a dataset is read (a regular file only, bounded lines), and a
tokenizer problem never crashes it: one line's is quarantined, a setting's stops it with one line."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import msgspec
import pytest

from draftfleet.identity import settings_id
from draftfleet.producer.importer import import_file
from draftfleet.schemas.config import DatasetConfig
from draftfleet.schemas.records import DatasetManifest, QuarantineEntry
from draftfleet.store import Store, open_store
from draftfleet.tokenizer import TargetTokenizer, TemplateError

from .conftest import run_cli, write_config, write_jsonl
from .tokenizer_fixtures import build_fast_chat

# ChatML whose last user turn gets a line of its own while it is last (as templates that add the
# date do): once an answer follows, the prompt renders differently. No reasoning, no <think> tokens.
QUIRK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] -}}"
    "{%- if loop.last and m['role'] == 'user' and '[today]' in m['content'] -%}{{- '\\nToday is Monday.' -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def quirk_dir(tmp_path_factory):
    added = {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True}
    return build_fast_chat(tmp_path_factory.mktemp("quirk"), QUIRK_TEMPLATE, added, eos="<|im_end|>")


def _setup(tmp_path):
    ds = DatasetConfig(name="ds", path=str(tmp_path / "prompts.jsonl"), max_tokens=64)
    settings = ds.settings("test/chatml")
    manifest = DatasetManifest(name="ds", version=1, settings=settings, settings_id=settings_id(settings),
                               budget_tokens=None, created_at=time.time())
    return ds, manifest, open_store(tmp_path / "store")


def _quarantined(store: Store) -> list[QuarantineEntry]:
    return [msgspec.json.decode(line, type=QuarantineEntry)
            for line in store.quarantine_path("ds").read_bytes().splitlines()]


def _msgs(i: int, extra: str = "") -> list[dict]:
    return [{"role": "user", "content": f"prompt {i}{extra}"}]


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_import_of_a_fifo_or_device_is_a_clear_error_not_a_hang(tmp_path, target_tokenizer, special):
    path = tmp_path / "raw.jsonl"
    if special == "fifo":
        os.mkfifo(path)
    else:
        path = special
    ds, manifest, store = _setup(tmp_path)
    box: list = []

    def run():
        try:
            box.append(import_file(path, ds, manifest, store, target_tokenizer))
        except Exception as exc:  # noqa: BLE001 - the test looks at what it is
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive(), f"import of {path} did not end within 15 s"
    [got] = box
    what = "a FIFO" if special == "fifo" else "a character device"
    assert isinstance(got, OSError) and f"{what}, not a regular file" in str(got), got


def test_an_over_long_raw_line_is_quarantined_never_held_whole(tmp_path, target_tokenizer):
    """A 24 MiB line under a 1 MiB limit: quarantined with its length and sha256, peak Python memory
    near the limit; the lines around it import, a bad line is quarantined, a cut last line skipped."""
    import tracemalloc

    tok = target_tokenizer
    ids = tok.encode_text("def f(x): return x") + [tok.eot_id]
    good = lambda i: msgspec.json.encode({"messages": _msgs(i), "output_ids": ids})  # noqa: E731
    big = msgspec.json.encode({"messages": _msgs(1), "output": "y" * (24 * 1024 * 1024)})
    path = tmp_path / "raw.jsonl"
    path.write_bytes(b"\n".join([good(0), big, b"{not json", good(3), good(4)[:20]]))
    digest = hashlib.sha256(big).hexdigest()
    ds, manifest, store = _setup(tmp_path)
    tracemalloc.start()
    try:
        summary = import_file(path, ds, manifest, store, tok, max_line_bytes=1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB while importing a 24 MiB line"
    assert (summary.lines, summary.imported, summary.cut_last_line) == (5, 2, True)
    assert summary.rejected_by_kind == {"line_too_long": 1, "bad_json": 1}
    assert sorted(r.source for r in store.records("ds")) == ["raw.jsonl:1", "raw.jsonl:4"]
    too_long, bad = _quarantined(store)
    assert (too_long.line, too_long.kind, too_long.line_bytes, too_long.line_sha256) == (2, "line_too_long", len(big),
                                                                                          digest)
    assert (bad.line, bad.kind, bad.raw) == (3, "bad_json", "{not json")


def test_a_line_the_tokenizer_cannot_retokenize_is_quarantined(tmp_path, quirk_dir):
    """One line's template problem is that line's: quarantined with the tokenizer's reason, the rest imports."""
    tok = TargetTokenizer(str(quirk_dir))
    ids = tok.encode_text("fine") + [tok.eot_id]
    raw = write_jsonl(tmp_path / "raw.jsonl", [
        {"messages": _msgs(0), "output": "an answer"},
        {"messages": _msgs(1, " [today]"), "output": "an answer"},  # text only: re-tokenized, and cannot be
        {"messages": _msgs(2, " [today]"), "output_ids": ids},      # ids: nothing to re-tokenize
        {"messages": _msgs(3), "output": "another answer"},
    ])
    ds, manifest, store = _setup(tmp_path)
    summary = import_file(raw, ds, manifest, store, tok)
    assert (summary.imported, summary.rejected_by_kind) == (3, {"retokenize": 1})
    assert sorted(r.source for r in store.records("ds")) == ["raw.jsonl:1", "raw.jsonl:3", "raw.jsonl:4"]
    [entry] = _quarantined(store)
    assert (entry.line, entry.kind, entry.field) == (2, "retokenize", "output")
    assert entry.message.startswith("raw.jsonl:2: field 'output': the target tokenizer cannot re-tokenize this answer")
    assert "renders the prompt's messages differently" in entry.message
    assert "[today]" in entry.raw


def test_a_template_that_places_no_reasoning_stops_the_import_with_one_line(tmp_path, quirk_dir, redis_server):
    """A setting every reasoning line needs: the import stops at the first such line, naming it; what
    came before is stored, and the same import after the fix imports the rest and skips it."""
    lines = [{"messages": _msgs(0), "output": "an answer"},
             {"messages": _msgs(1), "output_ids": "not ids"},  # rejected before the stop
             {"messages": _msgs(2), "output": "an answer", "reasoning": "let me think"},
             {"messages": _msgs(3), "output": "never reached"}]
    raw = write_jsonl(tmp_path / "raw.jsonl", lines)
    ds, manifest, store = _setup(tmp_path)
    with pytest.raises(TemplateError) as info:
        import_file(raw, ds, manifest, store, TargetTokenizer(str(quirk_dir)))
    assert str(info.value).startswith("raw.jsonl:3: the chat template of ")
    assert "set [fleet].reasoning_markers" in str(info.value) and "the import stopped at this line" in str(info.value)
    assert [r.source for r in store.records("ds")] == ["raw.jsonl:1"]
    assert [(e.line, e.kind) for e in _quarantined(store)] == [(2, "bad_output")]

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": _msgs(0)}])
    config = write_config(tmp_path / "cli", tokenizer=quirk_dir, datasets=[{"name": "ds", "path": str(data)}])
    env = {"REDIS_URL": redis_server.url, "COLUMNS": "1000"}
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "ds", env=env)
    assert res.returncode == 1 and res.stdout == "", res
    [message] = res.stderr.strip().splitlines()
    assert message.startswith("error: raw.jsonl:3: the chat template of ") and "reasoning_markers" in message, message

    config.write_text(config.read_text().replace("[fleet]\n", '[fleet]\nreasoning_markers = ["<r>", "</r>"]\n'))
    res = run_cli("import", str(raw), "--config", str(config), "--dataset", "ds", "--json", env=env)
    assert res.returncode == 0, res.stderr
    summary = msgspec.json.decode(res.stdout)
    assert (summary["imported"], summary["already_present"], summary["rejected"]) == (2, 1, 1)


# The quirk template, refusing (``raise_exception``, as templates that check role order do) any
# message that says so.
REFUSING_TEMPLATE = ("{%- for m in messages if '[refuse]' in m['content'] -%}"
                     "{{- raise_exception('this template refuses: ' + m['content']) -}}{%- endfor -%}" + QUIRK_TEMPLATE)


def test_messages_the_chat_template_refuses_are_that_line_s_problem_everywhere(tmp_path, tmp_path_factory):
    """jinja2's error from ``raise_exception`` comes out as the tokenizer's own: the import
    quarantines the line and goes on, an engine worker fails the prompt without a request."""
    from draftfleet.hidden import CaptureError, record_units
    from draftfleet.schemas.config import SGLangBackend
    from draftfleet.schemas.records import Message, PromptTask
    from draftfleet.tokenizer import MessagesRefused, TokenizerError
    from draftfleet.workers.backends import Permanent
    from draftfleet.workers.sglang import SGLangClient

    added = {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True}
    tok = TargetTokenizer(str(build_fast_chat(tmp_path_factory.mktemp("refusing"), REFUSING_TEMPLATE, added,
                                              eos="<|im_end|>")))
    refused = [Message(role="user", content="prompt 1 [refuse]")]
    with pytest.raises(MessagesRefused, match="this template refuses: prompt 1 \\[refuse\\]") as info:
        tok.prompt_ids(refused)
    assert isinstance(info.value, TokenizerError) and not isinstance(info.value, TemplateError)

    ids = tok.encode_text("fine") + [tok.eot_id]
    raw = write_jsonl(tmp_path / "raw.jsonl", [
        {"messages": _msgs(0), "output": "an answer"},
        {"messages": _msgs(1, " [refuse]"), "output": "an answer"},  # re-tokenizing renders the template
        {"messages": _msgs(2, " [refuse]"), "output_ids": ids},      # counting its prompt tokens does too
        {"messages": _msgs(3), "output_ids": ids},
    ])
    ds, manifest, store = _setup(tmp_path)
    summary = import_file(raw, ds, manifest, store, tok)
    assert (summary.imported, summary.rejected_by_kind) == (2, {"retokenize": 2})
    assert sorted(r.source for r in store.records("ds")) == ["raw.jsonl:1", "raw.jsonl:4"]
    entries = _quarantined(store)
    assert [(e.line, e.kind) for e in entries] == [(2, "retokenize"), (3, "retokenize")]
    assert all("this template refuses: prompt" in e.message for e in entries)
    [stored] = [rec for rec in store.records("ds") if rec.source == "raw.jsonl:4"]
    with pytest.raises(CaptureError, match="this template refuses"):  # a capture dead-letters it, with the reason
        record_units(msgspec.structs.replace(stored, messages=refused), tok)

    settings = ds.settings("test/chatml")
    client = SGLangClient("http://127.0.0.1:9", SGLangBackend(), tok, inflight=1)  # nothing listens: no request made
    try:
        with pytest.raises(Permanent, match="this template refuses") as failed:
            client.generate(PromptTask(key="c" * 64, dataset="ds", source="f:1", messages=refused, settings=settings,
                                       settings_id=settings_id(settings), enqueued_at=0.0))
        assert failed.value.reason == "chat_template"
    finally:
        client.close()
