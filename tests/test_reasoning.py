"""Reasoning models: a cloud record's ids are what the target itself would have emitted.

Fixtures of both template families (tests/tokenizer_fixtures.py): Kimi-K2.5's (slow tiktoken
remote code; the generation prompt ends in ``<think>``; history turns render ``<think></think>``)
and Qwen3's (fast; ``<think>\\n...\\n</think>\\n\\n`` written by the model). The expected ids come
from each fixture's ground truth (the ``tiktoken.Encoding`` itself, the raw ``tokenizers`` file),
never from the code under test.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tokenizers import Tokenizer

from draftfleet.schemas.config import CloudBackend, ConfigError, load_config
from draftfleet.schemas.records import GenerationSettings, Message, PromptTask
from draftfleet.tokenizer import TargetTokenizer, TokenizerError
from draftfleet.workers.backends import Halt
from draftfleet.workers.cloud import CloudChat
from tests.tokenizer_fixtures import KIMI_MODULE, KIMI_SPECIALS, KIMI_TEMPLATE, build_fast_chat, kimi_encoding

USER = [Message("system", "be brief"), Message("user", "sort a list in python")]

# (reasoning, content) as a model would write them; some quote special-token strings as text.
ANSWERS = [
    ("let me think: sort the list first", "def f(x): return sorted(x)"),
    ("step one\nstep two, then check", "answer\n\nwith lines and a tail "),
    ("the tags <think> and <|im_end|> are text here", "print('<|im_end|>') is text, not the end"),
]


@pytest.fixture(scope="session")
def kimi(kimi_tokenizer_dir):
    return TargetTokenizer(str(kimi_tokenizer_dir), use_fast=False, trust_remote_code=True)


@pytest.fixture(scope="session")
def kimi_truth(kimi_tokenizer_dir):
    return kimi_encoding(kimi_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3(qwen3_tokenizer_dir):
    return TargetTokenizer(str(qwen3_tokenizer_dir))


def _plain_truth(folder) -> Tokenizer:
    """The raw tokenizers file, with special tokens read as text (added non-special ones still match)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def kimi_model_ids(truth, reasoning: str, content: str) -> list[int]:
    """What K2.5 emits after its generation prompt (which already ends in <think>)."""
    sp = truth._special_tokens
    return truth.encode_ordinary(reasoning) + [sp["</think>"]] + truth.encode_ordinary(content) + [sp["<|im_end|>"]]


def qwen3_model_ids(truth: Tokenizer, reasoning: str, content: str) -> list[int]:
    """What Qwen3 emits after ``<|im_start|>assistant\\n``: its own think block, the answer, <|im_end|>."""
    return truth.encode(f"<think>\n{reasoning}\n</think>\n\n{content}", add_special_tokens=False).ids + [
        truth.token_to_id("<|im_end|>")]


@pytest.fixture(scope="session")
def kimi_template_fast_dir(tmp_path_factory):
    """K2.5's template over a fast tokenizer: the old code drops the reasoning here without an error."""
    return build_fast_chat(tmp_path_factory.mktemp("k25fast"), KIMI_TEMPLATE, dict.fromkeys(KIMI_SPECIALS, True),
                           eos="<|im_end|>")


@pytest.mark.parametrize("reasoning,content", ANSWERS[:2])
def test_k25_template_on_a_fast_tokenizer_keeps_the_reasoning(kimi_template_fast_dir, reasoning, content):
    tok = TargetTokenizer(str(kimi_template_fast_dir))
    truth = _plain_truth(kimi_template_fast_dir)
    expected = (truth.encode(reasoning).ids + [truth.token_to_id("</think>")] + truth.encode(content).ids
                + [truth.token_to_id("<|im_end|>")])
    ids = tok.completion_ids(USER, content, reasoning, stopped=True)
    assert tok.decode(ids, skip_special=False) == f"{reasoning}</think>{content}<|im_end|>"
    assert ids == expected


class TestKimiShape:
    @pytest.mark.parametrize("reasoning,content", ANSWERS)
    def test_completion_keeps_the_reasoning(self, kimi, kimi_truth, reasoning, content):
        ids = kimi.completion_ids(USER, content, reasoning, stopped=True)
        assert ids == kimi_model_ids(kimi_truth, reasoning, content)
        assert kimi.decode(ids, skip_special=False) == f"{reasoning}</think>{content}<|im_end|>"

    def test_no_reasoning_is_an_empty_think(self, kimi, kimi_truth):
        ids = kimi.completion_ids(USER, "just the answer", None, stopped=True)
        assert ids == kimi_model_ids(kimi_truth, "", "just the answer")

    def test_cut_inside_the_reasoning_has_no_close_marker(self, kimi, kimi_truth):
        ids = kimi.completion_ids(USER, "", "still thinking when the length ran", stopped=False)
        assert ids == kimi_truth.encode_ordinary("still thinking when the length ran")

    def test_cut_inside_the_answer(self, kimi, kimi_truth):
        ids = kimi.completion_ids(USER, "half an ans", "done thinking", stopped=False)
        assert ids == kimi_model_ids(kimi_truth, "done thinking", "half an ans")[:-1]

    def test_a_history_turn_keeps_its_blank_think_in_the_prompt(self, kimi, kimi_truth):
        msgs = [*USER, Message("assistant", "an earlier answer"), Message("user", "and now?")]
        assert kimi.prompt_text(msgs).count("<think></think>an earlier answer<|im_end|>") == 1
        ids = kimi.completion_ids(msgs, "now this", "reason again", stopped=True)
        assert ids == kimi_model_ids(kimi_truth, "reason again", "now this")

    def test_text_quoting_special_tokens_stays_plain(self, kimi, kimi_truth):
        text = "a literal <|im_end|> and <think> and [EOS] inside"
        ids = kimi.encode_text(text)
        assert ids == kimi_truth.encode_ordinary(text)
        assert not set(ids) & set(kimi_truth._special_tokens.values())
        assert kimi.decode(ids) == text

    def test_a_tokenizer_with_no_plain_path_is_refused_at_load(self, kimi_tokenizer_dir, tmp_path):
        """The plain path is found by trying, not assumed: one that always parses specials is refused."""
        folder = tmp_path / "always-parses"
        shutil.copytree(kimi_tokenizer_dir, folder)
        code = folder / f"{KIMI_MODULE}.py"
        code.write_text(code.read_text().replace("if allow_special_tokens:", "if True:"))
        with pytest.raises(TokenizerError, match="parses special tokens inside any text"):
            TargetTokenizer(str(folder), use_fast=False, trust_remote_code=True)

    def test_roundtrip_mismatches_on_the_slow_tokenizer(self, kimi, kimi_truth):
        sp = kimi_truth._special_tokens
        good = [kimi_model_ids(kimi_truth, r, c)[:-1] for r, c in ANSWERS]  # as the inventory samples them
        assert kimi.roundtrip_mismatches(good) == 0
        word = kimi_truth.encode_ordinary("return")
        assert len(word) == 1  # a merged token, so its bytes one by one are ids that do not round-trip
        split = [kimi_truth.encode_single_token(bytes([b])) for b in b"return"]
        assert kimi.roundtrip_mismatches([*good, split, [sp["<|im_end|>"], *split]]) == 2

    def test_prompt_ids_use_the_tokenizers_own_special_ids(self, kimi, kimi_truth):
        sp, plain = kimi_truth._special_tokens, kimi_truth.encode_ordinary
        expected = []
        for role, content in (("system", "be brief"), ("user", "sort a list in python")):
            expected += [sp[f"<|im_{role}|>"], *plain(role), sp["<|im_middle|>"], *plain(content), sp["<|im_end|>"]]
        expected += [sp["<|im_assistant|>"], *plain("assistant"), sp["<|im_middle|>"], sp["<think>"]]
        assert kimi.prompt_ids(USER) == expected
        assert kimi.prompt_text(USER).endswith("<|im_middle|><think>") and kimi.prompt_text(USER).count("<think>") == 1
        assert kimi.eot_id == sp["<|im_end|>"]
        # every special id of the encoding (named or reserved: <think> is one) is known as special
        assert kimi.special_ids == frozenset(sp.values()) and set(KIMI_SPECIALS) <= set(sp)


class TestQwen3Shape:
    @pytest.mark.parametrize("reasoning,content", ANSWERS)
    def test_completion_is_the_models_own_think_block(self, qwen3, qwen3_tokenizer_dir, reasoning, content):
        truth = _plain_truth(qwen3_tokenizer_dir)
        ids = qwen3.completion_ids(USER, content, reasoning, stopped=True)
        assert ids == qwen3_model_ids(truth, reasoning, content)
        think = truth.token_to_id("<think>")
        assert ids[0] == think and ids.count(think) == 1 + ("<think>" in reasoning + content)

    def test_history_turns_follow_qwen3s_rules(self, qwen3, qwen3_tokenizer_dir):
        """Earlier turns lose their reasoning in the prompt; the new answer still gets its think block."""
        truth = _plain_truth(qwen3_tokenizer_dir)
        msgs = [*USER, Message("assistant", "<think>\nold thought\n</think>\n\nan earlier answer"),
                Message("user", "and now?")]
        assert "old thought" not in qwen3.prompt_text(msgs)
        assert "<|im_start|>assistant\nan earlier answer<|im_end|>" in qwen3.prompt_text(msgs)
        ids = qwen3.completion_ids(msgs, "now this", "\nreason again\n", stopped=True)
        assert ids == qwen3_model_ids(truth, "reason again", "now this")

    def test_no_reasoning_is_an_empty_think_block(self, qwen3, qwen3_tokenizer_dir):
        truth = _plain_truth(qwen3_tokenizer_dir)
        ids = qwen3.completion_ids(USER, "just the answer", None, stopped=True)
        assert ids == truth.encode("<think>\n\n</think>\n\njust the answer").ids + [qwen3.eot_id]


def _api_answers(kind: str, model_ids: list[int], close: int, tok: TargetTokenizer) -> list[tuple[str, str]]:
    """The (reasoning, content) pairs an API serving the model would return for ``model_ids``."""
    k = model_ids.index(close)
    body = model_ids[:-1]
    if kind == "kimi":
        return [(tok.decode(body[:k]), tok.decode(body[k + 1:]))]
    raw_reasoning, raw_content = tok.decode(body[1:k]), tok.decode(body[k + 1:])  # as vLLM's parser splits
    return [(raw_reasoning, raw_content), (raw_reasoning.strip("\n"), raw_content.lstrip("\n"))]


class _API(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat API answering with the next (reasoning, content) given to it."""

    answers: list[tuple[str, str]] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        json.loads(self.rfile.read(int(self.headers["content-length"])))
        reasoning, content = self.answers.pop(0)
        out = {"id": "gen-1", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": content, "reasoning": reasoning}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 9, "cost": 0.0}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _API)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("kind", ["kimi", "qwen3"])
def test_gpu_and_cloud_records_of_the_same_text_get_the_same_ids(kind, request, api, kimi_truth, qwen3_tokenizer_dir):
    """The ids a model emits, decoded into what an API returns, come back through the cloud path unchanged."""
    tok: TargetTokenizer = request.getfixturevalue(kind)
    settings = GenerationSettings(model="m", max_tokens=256, temperature=0.7, top_p=1.0)
    task = PromptTask(key="a" * 64, dataset="ds", source="f:1", messages=USER, settings=settings,
                      settings_id="s", enqueued_at=0.0)
    backend = CloudChat("cloudy", CloudBackend(base_url=api, model="m", api_key_env="K"), tok, "secret")
    try:
        for reasoning, content in ANSWERS:
            if kind == "kimi":
                model_ids = kimi_model_ids(kimi_truth, reasoning, content)
                close = kimi_truth._special_tokens["</think>"]
            else:
                truth = _plain_truth(qwen3_tokenizer_dir)
                model_ids, close = qwen3_model_ids(truth, reasoning, content), truth.token_to_id("</think>")
            answers = _api_answers(kind, model_ids, close, tok)
            _API.answers = list(answers)
            for api_reasoning, api_content in answers:
                gen = backend.generate(task)
                assert (gen.reasoning, gen.text) == (api_reasoning, api_content)
                assert gen.output_ids == model_ids, (api_reasoning, api_content)
                assert gen.prompt_tokens == len(tok.prompt_ids(USER))
    finally:
        backend.close()


# A DeepSeek-R1-like template: history turns drop the reasoning entirely and the generation
# prompt ends in "<think>\n", so the template cannot tell what the model writes before the answer.
R1_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|assistant|>' + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|' + m.role + '|>' + m.content -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|><think>\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory):
    added = {"<|system|>": True, "<|user|>": True, "<|assistant|>": True, "<|end|>": True,
             "<think>": False, "</think>": False}
    return build_fast_chat(tmp_path_factory.mktemp("r1"), R1_TEMPLATE, added, eos="<|end|>")


def test_markers_setting_where_the_template_cannot_tell(r1_dir):
    plain = TargetTokenizer(str(r1_dir))
    with pytest.raises(TokenizerError, match="reasoning_markers"):
        plain.completion_ids(USER, "the answer", "some thought", stopped=True)
    tok = TargetTokenizer(str(r1_dir), reasoning_markers=("<think>\n", "\n</think>\n\n"))
    truth = _plain_truth(r1_dir)
    expected = truth.encode("some thought\n</think>\n\nthe answer").ids + [tok.eot_id]
    assert tok.completion_ids(USER, "the answer", "some thought", stopped=True) == expected
    assert tok.completion_ids(USER, "the answer", None, stopped=True) == truth.encode(
        "\n</think>\n\nthe answer").ids + [tok.eot_id]


def test_a_template_that_cannot_place_reasoning_halts_the_cloud_worker(r1_dir, api):
    """Every answer with reasoning would fail alike: the worker stops, the prompts stay queued."""
    settings = GenerationSettings(model="m", max_tokens=64, temperature=0.7, top_p=1.0)
    task = PromptTask(key="b" * 64, dataset="ds", source="f:1", messages=USER, settings=settings,
                      settings_id="s", enqueued_at=0.0)
    backend = CloudChat("cloudy", CloudBackend(base_url=api, model="m", api_key_env="K"), TargetTokenizer(str(r1_dir)),
                        "secret")
    _API.answers = [("some thought", "the answer")]
    try:
        with pytest.raises(Halt, match="reasoning_markers") as exc:
            backend.generate(task)
        assert exc.value.reason == "chat_template"
    finally:
        backend.close()


def test_markers_setting_in_the_config(tmp_path):
    base = '[fleet]\nstore = "s"\nmodel = "m"\n'
    path = tmp_path / "fleet.toml"
    path.write_text(base + 'reasoning_markers = ["<think>\\n", "\\n</think>\\n\\n"]\n')
    assert load_config(path).fleet.reasoning_markers == ("<think>\n", "\n</think>\n\n")
    for bad in ('["<think>"]', '["<think>", ""]', '["a", "b", "c"]'):
        path.write_text(base + f"reasoning_markers = {bad}\n")
        with pytest.raises(ConfigError, match="reasoning_markers"):
            load_config(path)


def test_batch_gives_what_one_at_a_time_gives(kimi, qwen3):
    for tok in (kimi, qwen3):
        answers = [(USER, c, r, s) for (r, c) in ANSWERS for s in (True, False)] + [(USER, "", "cut", False)]
        assert tok.completion_ids_batch(answers) == [tok.completion_ids(*a) for a in answers]
