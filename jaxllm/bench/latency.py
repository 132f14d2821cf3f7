"""`jaxllm bench latency`: what users see at a few concurrencies, next to HF transformers.

For each concurrency c (default 1, 4 and 16) max(--num-requests, c) requests of one prompt
length run with at most c in flight, streamed through the executor, greedy, EOS ignored, each
exactly --output-len tokens: TTFT and inter-token latency (p50, p99) and output tokens/s.
Peers on the same weights and prompts, in the same run:
  * HF transformers (torch, CPU, float32): c requests at a time as one batched `generate`
    (`jaxllm.bench.hf_latency`);
  * jaxllm with small decode buckets off (`decode_batch_sizes=[]`): the same engine, decode
    steps in token buckets of max_batch_size rows.
With --repeat N each level runs N passes and a row shows the pass of median tok/s.
Ratio columns are jaxllm / HF (tok/s above 1 and ITL below 1 favour jaxllm). The engines warm
up fully (greedy sampler) before timing, so no compile is timed. The peers take turns level by
level (all of them at c=1, then at c=4, ...), so a load that changes during the run (a shared
machine) weighs on each level's rows alike; the load average is printed with the table.

    jaxllm bench latency --model smollm2 --num-requests 8 --output-len 32
    jaxllm bench latency --model tiny-moe --concurrency 1 4 16 --peers hf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, Optional

import numpy as np

from jaxllm.bench.dataset import BenchRequest
from jaxllm.bench.request_metrics import RequestRecord, summarize
from jaxllm.bench.throughput import add_engine_args, run_executor

PEERS = ("hf", "no-decode-buckets")
JAXLLM = "jaxllm"
NO_DECODE_BUCKETS = "jaxllm, decode buckets off"


def build_engine(args: argparse.Namespace, decode_buckets: bool = True):
    """The engine under test, fully warmed up (greedy sampler); decode buckets on or off."""
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    kwargs["kv_cache_config"].enable_block_reuse = False  # every level reruns the same prompts
    if not decode_buckets:
        kwargs["decode_batch_sizes"] = []
    engine = LLMEngine(EngineConfig(model=args.model, **kwargs))
    if not args.no_warmup:
        started = time.perf_counter()
        engine.warmup(all_variants=False)
        print(
            f"{JAXLLM if decode_buckets else NO_DECODE_BUCKETS}: warm-up of "
            f"{engine.program_warmup.num_forwards()} forwards in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    return engine


def workload(vocab_size: int, num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(i, output_len, input_ids=rng.integers(3, vocab_size, input_len).tolist()) for i in range(num)]


def level_requests(requests: list[BenchRequest], num: int, concurrency: int) -> list[BenchRequest]:
    return requests[: max(num, concurrency)]


def engine_runner(stack: ExitStack, engine, requests: list[BenchRequest], args: argparse.Namespace) -> Callable:
    """concurrency -> records of one engine behind its executor (after `--warmup-requests`
    untimed requests); the executor and the engine close with `stack`."""
    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor

    stack.callback(engine.close)
    ex = stack.enter_context(
        GenerationExecutor(engine, ExecutorConfig(num_postprocess_workers=args.num_postprocess_workers))
    )
    if args.warmup_requests:
        run_executor(ex, requests[: args.warmup_requests], concurrency=1, detokenize=False, progress=False)

    def level(c: int) -> list:
        reqs = level_requests(requests, args.num_requests, c)
        return run_executor(ex, reqs, concurrency=c, detokenize=False, progress=not args.no_progress)

    return level


def hf_runner(model: str, requests: list[BenchRequest], args: argparse.Namespace) -> Callable:
    """concurrency -> records of HF transformers on the same weights and prompts."""
    from jaxllm.bench.hf_checkpoint import float_checkpoint
    from jaxllm.bench.hf_latency import load_hf_model, run_hf

    hf = load_hf_model(float_checkpoint(model)[0])  # an integer checkpoint's float weights
    prompts = [list(r.input_ids or ()) for r in requests]
    if args.warmup_requests:
        run_hf(hf, prompts[:1], 2, 1)
    return lambda c: run_hf(hf, prompts[: max(args.num_requests, c)], args.output_len, c)


def _stats(records: list[RequestRecord]) -> dict[str, Any]:
    s = summarize(records)
    return {
        "ttft_p50": s["ttft_ms"]["p50"],
        "ttft_p99": s["ttft_ms"]["p99"],
        "itl_p50": s["itl_ms"]["p50"],
        "itl_p99": s["itl_ms"]["p99"],
        "tok_per_s": s["output_token_throughput"],
        "num_failed": s["num_failed"],
        "output_tokens": s["total_output_tokens"],
    }


def _f(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(results: dict[str, dict[int, dict]], model: str, concurrency: list[int], hf_mode: str) -> str:
    header = (
        f"{'c':>3}  {'engine':<28} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'tok/s':>7} {'tok/s ÷HF':>9} {'ITL p50 ÷HF':>11}"
    )
    lines = [f"latency: {model} (ms; {hf_mode})", header, "-" * len(header)]
    for c in concurrency:
        hf = results.get("HF transformers", {}).get(c)
        for name, levels in results.items():
            row = levels.get(c)
            if row is None:
                continue
            tok_ratio = row["tok_per_s"] / hf["tok_per_s"] if hf and hf["tok_per_s"] else None
            itl_ratio = row["itl_p50"] / hf["itl_p50"] if hf and hf["itl_p50"] and row["itl_p50"] else None
            lines.append(
                f"{c:>3}  {name:<28} {_f(row['ttft_p50']):>9} {_f(row['ttft_p99']):>9} {_f(row['itl_p50']):>8} "
                f"{_f(row['itl_p99']):>8} {_f(row['tok_per_s']):>7} {_f(tok_ratio, 2):>9} {_f(itl_ratio, 2):>11}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench latency", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=8, help="requests per level (at least its concurrency)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens of every request")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS), help="peers run next to jaxllm")
    parser.add_argument("--warmup-requests", type=int, default=1, help="untimed requests before each engine's levels")
    parser.add_argument("--repeat", type=int, default=1, help="passes per level; a row shows the median pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.concurrency, default=0) < 1 or min(args.num_requests, args.input_len, args.output_len, args.repeat) < 1:
        raise SystemExit("jaxllm bench latency: counts and lengths must be >= 1")
    with ExitStack() as stack:
        engine = build_engine(args)
        num = max(args.num_requests, *args.concurrency)
        requests = workload(engine.model_config.vocab_size, num, args.input_len, args.output_len, args.seed)
        runners = {JAXLLM: engine_runner(stack, engine, requests, args)}
        if "no-decode-buckets" in args.peers:
            runners[NO_DECODE_BUCKETS] = engine_runner(stack, build_engine(args, decode_buckets=False), requests, args)
        if "hf" in args.peers:
            runners["HF transformers"] = hf_runner(args.model, requests, args)
        passes: dict[str, dict[int, list]] = {name: {c: [] for c in args.concurrency} for name in runners}
        loads = []
        for c in args.concurrency:  # the peers take turns at each level, pass after pass
            for _ in range(args.repeat):
                for name, run in runners.items():
                    passes[name][c].append(_stats(run(c)))
                    loads.append(os.getloadavg()[0])
    # Each row: the pass of median output tok/s.
    results = {
        name: {c: sorted(runs, key=lambda r: r["tok_per_s"])[(len(runs) - 1) // 2] for c, runs in levels.items()}
        for name, levels in passes.items()
    }
    hf_mode = (
        "HF: c requests at a time as one batched generate, torch CPU float32; "
        f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs"
    )
    print(format_table(results, args.model, args.concurrency, hf_mode))
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "hf_mode": hf_mode, "results": results, "argv": argv}, f, indent=2)
    failed = sum(row["num_failed"] for levels in results.values() for row in levels.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
