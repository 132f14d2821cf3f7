"""`jaxllm generate`: complete prompts as plain text (no chat template), batched in flight."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxllm.cli.args import (
    DEFAULT_MODEL,
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    sampling_params,
)
from jaxllm.cli.distributed_args import add_distributed_args
from jaxllm.cli.startup import resolve_model_arg, start_executor


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="complete prompts (no chat template)",
        formatter_class=HelpFormatter,
        description="Complete each prompt as plain text with in-flight batching.",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three examples)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated, one prompt at a time")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen, DEFAULT_MODEL)
    add_distributed_args(gen)
    gen.set_defaults(max_batch_size=16, max_num_tokens=512, max_seq_len=2048)
    add_sampling_args(gen, max_tokens=32, temperature=None)


def print_stream(result, out=None) -> Any:
    """Print a streaming result's text as it arrives; returns the final output."""
    out = sys.stdout if out is None else out
    final = None
    for final in result:
        text = final.outputs[0].text_diff
        if text:
            out.write(text)
            out.flush()
    return final


def run_generate(args: argparse.Namespace, started: float) -> int:
    prompts = args.prompt or ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    executor = start_executor(
        args, resolve_model_arg(args), all_variants=False, background_warmup=True, started=started
    )
    try:
        params = sampling_params(args)
        if args.stream:
            for prompt in prompts:
                print(f"{prompt!r} -> ", end="", flush=True)
                final = print_stream(executor.generate_async(prompt, params, streaming=True))
                done = final.outputs[0] if final is not None else None
                print(f"  ({len(done.token_ids) if done else 0} tokens, {done.finish_reason if done else None})")
            return 0
        for out in executor.generate(prompts, params):
            completion = out.outputs[0]
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": out.prompt,
                            "text": completion.text,
                            "token_ids": completion.token_ids,
                            "finish_reason": completion.finish_reason,
                        }
                    )
                )
            else:
                print(
                    f"{out.prompt!r} -> {completion.text!r} "
                    f"({len(completion.token_ids)} tokens, {completion.finish_reason})"
                )
        return 0
    finally:
        executor.shutdown()
