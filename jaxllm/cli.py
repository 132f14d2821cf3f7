"""Command line: `jaxllm generate | serve | bench`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Optional

# `jaxllm bench NAME ...` runs jaxllm.bench.<module>.main(argv)
BENCHMARKS = {
    "scheduler": "jaxllm.bench.scheduler_overhead",
    "kernels": "jaxllm.bench.kernels",
    "engine": "jaxllm.bench.engine_vs_hf",
    "throughput": "jaxllm.bench.throughput",
    "latency": "jaxllm.bench.latency",
    "serve": "jaxllm.bench.serve_client",
}


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-moe", help="HF model directory or a built-in preset (tiny-moe)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--kv-cache-max-tokens", type=int, default=None)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--attention-backend", choices=["xla", "pallas"], default=None)
    parser.add_argument("--moe-backend", choices=["xla", "pallas"], default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    from jaxllm.config import KvCacheConfig

    return dict(
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len, attention_backend=args.attention_backend, moe_backend=args.moe_backend,
        kv_cache_config=KvCacheConfig(tokens_per_block=args.tokens_per_block, max_tokens=args.kv_cache_max_tokens),
    )


def _generate(args: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    prompts = args.prompt or ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: jaxllm bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        return int(importlib.import_module(BENCHMARKS[argv[1]]).main(argv[2:]) or 0)
    if argv and argv[0] == "serve":
        from jaxllm.server.cli import main as serve_main

        return int(serve_main(argv[1:]) or 0)

    parser = argparse.ArgumentParser(prog="jaxllm", description="LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    sub.add_parser("serve", help="OpenAI-compatible server (see `jaxllm serve --help`)")
    sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
