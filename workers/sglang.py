"""The GPU backend: SGLang's native ``/generate`` with exact token ids.

The prompt goes in as ``input_ids`` built with the target tokenizer's chat template, so the ids
the model saw are the ids we record. SGLang's own ``output_ids`` are stored (``exact``); when the
server omits the matched end-of-turn id from them, it is appended so every stopped record ends
with it. A thinking model's text is split into reasoning and answer at its template's markers, as
the cloud APIs split it (``TargetTokenizer.split_reasoning``), so both kinds of record read alike.
Many requests are kept open at once by the worker's threads: SGLang batches them.
"""

from __future__ import annotations

import re

import httpx

from draftfleet.schemas.records import PromptTask
from draftfleet.workers.backends import Generation, Halt, Permanent, Transient
from draftfleet.workers.engine import EngineClient, error_message

# TokenizerManager._validate_one_request's words (sglang 0.5.23) when input + max_new_tokens is too long.
_OVER_CONTEXT = re.compile(r"maximum context length of (\d+) tokens.*?(\d+) tokens for the completion", re.S)


class SGLangClient(EngineClient):
    engine = "sglang"
    # SGLang's /health runs a one-token generation: 1-20 s under load.
    health_timeout_s = 30.0

    auth_probe_path = "/model_info"

    def model_name(self) -> str:
        # /model_info since sglang 0.5 (/get_model_info is deprecated); older servers have only the old path.
        info = self.get_json("/model_info")
        if info is None:
            info = self.get_json("/get_model_info")
        return str(info.get("model_path") or "") if isinstance(info, dict) else ""

    def rejected(self, resp: httpx.Response) -> Exception:
        """A 400 for the context length: max_tokens that no prompt can fit is a setting (halt, or
        every prompt of the dataset fails); otherwise this prompt is too long (it fails)."""
        message = error_message(resp)
        over = _OVER_CONTEXT.search(message) if resp.status_code == 400 else None
        if over and int(over.group(2)) >= int(over.group(1)):
            return Halt("max_tokens_exceeded", f"{self.endpoint}: max_tokens {over.group(2)} does not fit the model's "
                        f"context length of {over.group(1)} tokens: lower the dataset's max_tokens ({message})")
        if resp.status_code == 400 and "context length" in message:
            return Permanent("context_length", message)
        return super().rejected(resp)

    def generate(self, task: PromptTask) -> Generation:
        s = task.settings
        input_ids = self.prompt_ids(task)
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stop_token_ids": [self.tokenizer.eot_id],
            },
        }
        out = self.post("/generate", body)
        if isinstance(out, list):  # a batch answer to a single prompt: take its only element
            out = out[0] if out else {}
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        ftype = finish.get("type") if isinstance(finish, dict) else str(finish)
        if ftype == "abort":
            raise Transient("abort", str(finish.get("message", ""))[:200])
        ids = out.get("output_ids") or out.get("token_ids") or meta.get("output_ids")
        if not isinstance(ids, list):
            raise Transient("bad_body", "no output_ids in the response (is this SGLang's /generate?)")
        ids = [int(i) for i in ids]
        if ftype == "stop":
            matched = finish.get("matched")
            if isinstance(matched, int) and (not ids or ids[-1] != matched):
                ids.append(matched)
        elif ftype != "length":
            raise Transient("finish_" + str(ftype), "unexpected finish_reason")
        return self.exact(task, input_ids, ids, ftype, prompt_tokens=int(meta.get("prompt_tokens") or len(input_ids)),
                          completion_tokens=int(meta.get("completion_tokens") or len(ids)),
                          cached_tokens=int(meta.get("cached_tokens") or 0))
