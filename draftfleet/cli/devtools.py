"""``draftfleet emulator`` and ``draftfleet demo``: the development tools the product ships."""

from __future__ import annotations

import os

EMULATOR_FLAGS = ("model", "seed", "length", "reasoning_length", "single_stream_tps", "ceiling_tps", "max_running", "time_scale",
                  "rate_429", "rate_500", "rate_503", "rate_hang", "rate_cut", "rate_402", "rate_200_error",
                  "rate_abort", "retry_after_s", "hang_s", "price_input_per_mtok", "price_output_per_mtok",
                  "ttft_s", "reasoning_rate", "rate_402_inflight", "rate_403", "rate_moderation", "split_rate", "health_s",
                  "context_length", "max_output_tokens", "eos_token")


_EMULATOR_INTS = ("max_running", "context_length", "max_output_tokens")


_EMULATOR_HELP = {
    "single_stream_tps": "tokens/s of one request alone", "ceiling_tps": "tokens/s of the whole batch at most",
    "max_running": "requests decoded at once (more wait)", "time_scale": "wall seconds per model second (0: instant)",
    "retry_after_s": "Retry-After sent with faults (seconds)", "hang_s": "how long a hung request is held (seconds)",
    "price_input_per_mtok": "cloud price per million input tokens (USD)",
    "price_output_per_mtok": "cloud price per million output tokens (USD)", "ttft_s": "prefill delay, at most (seconds)",
    "reasoning_rate": "share of chat answers with reasoning (0-1)",
    "split_rate": "share of answers with ids that do not survive decode->encode (0-1)",
    "health_s": "how long a /health probe takes (seconds)", "context_length": "input + output tokens allowed",
    "max_output_tokens": "the cloud model's max_tokens limit", "eos_token": "the model's EOS token (default end-of-turn)",
}


def _emulator_help(flag: str) -> str:
    """Help for an emulator flag: a fault rate names its fault, the rest come from ``_EMULATOR_HELP``."""
    if flag.startswith("rate_"):
        return f"share of requests answered with the {flag[5:].replace('_', ' ')} fault (0-1)"
    return _EMULATOR_HELP[flag]


def emulator_config(args):
    from draftfleet.devtools.emulator import EmulatorConfig

    fields = {f: getattr(args, f) for f in EMULATOR_FLAGS if getattr(args, f, None) is not None}
    if args.api_key_env:
        fields["api_key"] = os.environ.get(args.api_key_env) or None
    if args.sglang_api_key_env:
        fields["sglang_api_key"] = os.environ.get(args.sglang_api_key_env) or None
    for flag in ("proxy", "loading"):
        if getattr(args, flag):
            fields[flag] = True
    return EmulatorConfig(tokenizer=args.tokenizer, **fields)


def cmd_emulator(args) -> int:
    from draftfleet.devtools.emulator import serve

    serve(emulator_config(args), args.host, args.port)
    return 0


def cmd_demo(args) -> int:
    from draftfleet.devtools.demo import run_demo

    return run_demo(store=args.store, timeout_s=args.timeout, as_json=args.json)


def register(sub) -> None:
    sp = sub.add_parser("emulator", help="serve SGLang /generate and OpenAI chat completions on loopback (tests, demo)")
    sp.add_argument("--tokenizer", required=True, help="tokenizer folder (the emulator's ids come from it)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sp.add_argument("--port", type=int, default=30000, help="port to serve on (default 30000)")
    sp.add_argument("--api-key-env", help="require this environment variable's value as the bearer key")
    sp.add_argument("--model", help="model name the emulator reports")
    sp.add_argument("--seed", type=int, help="random seed of lengths, texts and faults")
    sp.add_argument("--length", help="completion length distribution: lognormal:MEAN:SIGMA, uniform:LO:HI, fixed:N")
    sp.add_argument("--reasoning-length", help="reasoning length distribution (with --reasoning-rate)")
    for flag in EMULATOR_FLAGS[4:]:
        kind = int if flag in _EMULATOR_INTS else str if flag == "eos_token" else float
        sp.add_argument("--" + flag.replace("_", "-"), type=kind, dest=flag, help=_emulator_help(flag))
    sp.add_argument("--sglang-api-key-env", help="SGLang's --api-key: this variable's value guards all but /health*")
    sp.add_argument("--proxy", action="store_true", help="a proxy in front of /generate (429s, Retry-After)")
    sp.add_argument("--loading", action="store_true", help="/health answers 503 (the model is warming up)")
    sp.set_defaults(func=cmd_emulator)

    sp = sub.add_parser("demo", help="run the whole fleet on the emulator and the sample data (no GPU, no network)")
    sp.add_argument("--store", help="keep the demo's store (and config) in this folder, or tell it on s3://BUCKET/PREFIX "
                    "(the endpoint of AWS_ENDPOINT_URL, else the private SeaweedFS of draftfleet s3)")
    sp.add_argument("--timeout", type=float, default=110.0, help="seconds before the demo gives up (default 110)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.set_defaults(func=cmd_demo)
