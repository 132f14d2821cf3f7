"""What logits outputs and logits post-processors cost (`jaxllm bench logits`).

One workload (random prompts, greedy, EOS ignored) through `LLM.generate` on one warmed-up
engine (`warmup_logits_outputs=True`), in runs that differ only in what ONE of the requests
asks for; every other request asks for nothing:

* `plain`: nobody asks (the reference);
* `generation logits`: one request returns its generation logits;
* `context logits + prompt_logprobs`: one request returns its prompt's logits and logprobs;
* `host processor`: one request has a Python logits processor (a no-op);
* `batched processor`: one request selects a registered device-side processor (identity).

Each run is timed `--repeat` times (the fastest pass is reported). Compilations after
warm-up are counted (JAX's backend-compile events): they should be 0 in every run.

    jaxllm bench logits --model tiny-dense --requests 16 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxllm.bench.request_metrics import counting_compiles


def _identity(logits, request_ids, mask):
    return logits


def _no_op(request_id, token_ids, logits):
    return logits


RUNS = {
    "plain": ("plain", {}),
    "generation": ("generation logits", {"return_generation_logits": True}),
    "context": ("context logits + prompt_logprobs", {"return_context_logits": True, "prompt_logprobs": 1}),
    "host": ("host processor", {"logits_processor": _no_op}),
    "batched": ("batched processor", {"logits_post_processor_name": "identity"}),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxllm bench logits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-num-tokens", type=int, default=256)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per run; the fastest is reported")
    parser.add_argument("--report-json", default=None)
    args = parser.parse_args(argv)

    from jaxllm import LLM, KvCacheConfig, SamplingParams

    llm = LLM(
        args.model,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.input_len + args.output_len + 8,
        kv_cache_config=KvCacheConfig(tokens_per_block=16),
        logits_post_processors={"identity": _identity},
        warmup_logits_outputs=True,
    )
    results = []
    try:
        llm.executor.call_on_engine(lambda e: e.warmup(all_variants=False), timeout=3600)
        vocab = llm.executor.call_on_engine(lambda e: e.model_config.vocab_size)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, vocab, args.input_len).tolist() for _ in range(args.requests)]
        with counting_compiles() as compiles:
            for key in args.runs:
                name, asks = RUNS[key]
                plain = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
                params = [SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, **asks)]
                params += [plain] * (len(prompts) - 1)
                before = len(compiles)
                seconds = others_seconds = float("inf")
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    pending = [llm.generate_async(p, sp) for p, sp in zip(prompts, params)]
                    outs = [r.result(timeout=3600) for r in pending[1:]]  # the others first
                    others_seconds = min(others_seconds, time.perf_counter() - started)
                    outs.append(pending[0].result(timeout=3600))
                    seconds = min(seconds, time.perf_counter() - started)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                results.append(
                    {
                        "run": name,
                        "output_tokens": tokens,
                        "seconds": seconds,
                        "others_seconds": others_seconds,
                        "tokens_per_second": tokens / seconds,
                        "compiles_after_warmup": len(compiles) - before,
                    }
                )
                print(f"  {name}: {tokens / seconds:.1f} tok/s", flush=True)
    finally:
        llm.shutdown()
    reference = results[0]["tokens_per_second"]
    print(
        f"\nlogits outputs and post-processors: {args.model}, {args.requests} requests x ({args.input_len} in, "
        f"{args.output_len} out), one of them asking, max_batch_size {args.max_batch_size}"
    )
    print("(others s: until every request but the asking one is done - what asking costs the others)")
    print(
        f"{'run (what one request asks for)':<36} {'out tok/s':>10} {'vs first':>9} {'seconds':>8} "
        f"{'others s':>9} {'compiles':>9}"
    )
    for r in results:
        print(
            f"{r['run']:<36} {r['tokens_per_second']:>10.1f} {r['tokens_per_second'] / reference:>8.2f}x "
            f"{r['seconds']:>8.2f} {r['others_seconds']:>9.2f} {r['compiles_after_warmup']:>9}"
        )
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
