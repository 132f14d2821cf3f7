"""`jaxllm bench throughput`: offline throughput of a dataset through the engine.

Backends, all over one engine (compiled once):
  executor  requests streamed through `GenerationExecutor` (async API; records TTFT/ITL)
  llm       `LLM.generate` on the whole dataset (end-to-end timing only)
  engine    the engine stepped directly on the calling thread, no executor (the baseline
            the executor must not be slower than)
EOS is ignored, so each request produces exactly its `output_tokens`. KV prefix reuse is
off unless --enable-block-reuse: the backends (and --repeat rounds) run the same prompts
one after another, and later runs must not find the earlier runs' blocks in the cache.

    jaxllm bench throughput --model tiny-moe --num-requests 256 --input-mean 64 --output-mean 64 \
        --backend all --concurrency 64 --report-json report.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from tqdm.auto import tqdm

from jaxllm.bench.dataset import BenchRequest, add_dataset_args, dataset_from_args
from jaxllm.bench.request_metrics import RequestRecord, format_table, summarize, write_report

BACKENDS = ("executor", "llm", "engine")


def request_params(request: BenchRequest, detokenize: bool = True):
    from jaxllm.sampling import SamplingParams

    return SamplingParams(max_tokens=request.output_tokens, ignore_eos=True, detokenize=detokenize)


# ---------------------------------------------------------------------------- drivers
async def run_executor_async(
    executor,
    requests: Sequence[BenchRequest],
    *,
    concurrency: Optional[int] = None,
    streaming: bool = True,
    detokenize: bool = True,
    progress: bool = True,
) -> list[RequestRecord]:
    """Submit through the async API with at most `concurrency` requests in flight (None: all at once)."""
    records: list[Optional[RequestRecord]] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)

    async def consume(i: int, result) -> None:
        record = records[i]
        record.input_tokens = len(result.prompt_token_ids)
        try:
            out = None
            async for out in result:
                now = time.perf_counter()
                if out.outputs[0].token_ids_diff:
                    record.chunk_times.append(now)
                    if record.first_token is None:
                        record.first_token = now
            record.end = time.perf_counter()
            record.output_tokens = len(out.outputs[0].token_ids)
        except Exception as exc:  # counted as a failed request
            record.error = f"{type(exc).__name__}: {exc}"
        bar.update(1)

    def make(request: BenchRequest):
        return executor.make_request(request.prompt_input, request_params(request, detokenize), streaming)

    try:
        if concurrency is None or concurrency >= len(requests):
            # All at once: one submission, so every request reaches the engine in the same iteration.
            start = time.perf_counter()
            for i in range(len(requests)):
                records[i] = RequestRecord(input_tokens=0, start=start)
            results = executor.submit_many([make(r) for r in requests])
            await asyncio.gather(*(consume(i, r) for i, r in enumerate(results)))
        else:
            limit = asyncio.Semaphore(concurrency)

            async def one(i: int, request: BenchRequest) -> None:
                async with limit:
                    records[i] = RequestRecord(input_tokens=0, start=time.perf_counter())
                    try:
                        result = executor.submit(make(request))
                    except Exception as exc:
                        records[i].error = f"{type(exc).__name__}: {exc}"
                        bar.update(1)
                        return
                    await consume(i, result)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        bar.close()
    return [r for r in records if r is not None]


def run_executor(executor, requests, **kwargs) -> list[RequestRecord]:
    return asyncio.run(run_executor_async(executor, requests, **kwargs))


def run_llm(
    llm, requests: Sequence[BenchRequest], *, detokenize: bool = True, progress: bool = True
) -> list[RequestRecord]:
    """`LLM.generate` on everything at once: one end time for all (no per-token timing)."""
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_input for r in requests], [request_params(r, detokenize) for r in requests], use_tqdm=progress
    )
    end = time.perf_counter()
    return [
        RequestRecord(
            input_tokens=len(o.prompt_token_ids), start=start, end=end, output_tokens=len(o.outputs[0].token_ids)
        )
        for o in outputs
    ]


def run_engine(
    engine,
    requests: Sequence[BenchRequest],
    *,
    concurrency: Optional[int] = None,
    detokenize: bool = True,
    progress: bool = True,
) -> list[RequestRecord]:
    """Step the engine directly on this thread (no executor): the synchronous baseline."""
    tokenizer = engine.tokenizer
    pending = list(enumerate(requests))[::-1]
    records: dict[int, RequestRecord] = {}
    by_rid: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    limit = concurrency or len(requests)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    in_flight = 0
    try:
        while pending or in_flight:
            while pending and in_flight < limit:
                i, request = pending.pop()
                prompt = request.prompt_input
                ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                records[i] = RequestRecord(input_tokens=len(ids), start=time.perf_counter())
                req = engine.add_request(ids, request_params(request, detokenize))
                by_rid[req.request_id] = i
                outputs[i] = []
                in_flight += 1
            updates = engine.step()
            now = time.perf_counter()
            for u in updates:
                i = by_rid.get(u.request.request_id)
                if i is None:
                    continue
                record = records[i]
                if u.new_token_ids:
                    outputs[i].extend(u.new_token_ids)
                    record.chunk_times.append(now)
                    if record.first_token is None:
                        record.first_token = now
                if u.finished:
                    if detokenize:
                        tokenizer.decode(outputs[i], skip_special_tokens=True)
                    record.end = now
                    record.output_tokens = len(outputs[i])
                    in_flight -= 1
                    bar.update(1)
    finally:
        bar.close()
    return [records[i] for i in range(len(requests))]


# ---------------------------------------------------------------------------- engine setup
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.cli.args import add_engine_args as add_shared_engine_args

    add_shared_engine_args(parser)
    parser.add_argument("--num-postprocess-workers", type=int, default=0)
    parser.add_argument("--no-warmup", action="store_true", help="do not compile every token bucket first")
    parser.add_argument(
        "--enable-block-reuse",
        action="store_true",
        help="keep KV prefix reuse on (off by default: runs that repeat one dataset would "
        "otherwise reuse the blocks the previous run left in the cache)",
    )


def build_engine(args: argparse.Namespace):
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    kwargs["kv_cache_config"].enable_block_reuse = bool(getattr(args, "enable_block_reuse", False))
    engine = LLMEngine(EngineConfig(model=args.model, **kwargs))
    if not args.no_warmup and hasattr(engine, "warmup"):
        started = time.perf_counter()
        engine.warmup()
        print(f"warmup (compile every token bucket): {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return engine


def engine_host_timing(engine) -> dict[str, Any]:
    t = getattr(engine, "timing", None)
    if t is None or not getattr(t, "steps", 0):
        return {}
    return {
        "steps": t.steps,
        "host_ms_per_step": t.host_seconds / t.steps * 1e3,
        "device_wait_ms_per_step": t.device_wait_seconds / t.steps * 1e3,
        # Every device wait excluded (blocking reads and waits inside program calls), and CPU time.
        "host_wall_ms_per_step": t.host_wall_seconds / t.steps * 1e3,
        "host_cpu_ms_per_step": t.host_cpu_seconds / t.steps * 1e3,
        "blocking_reads_per_step": t.blocking_reads / t.steps,
    }


def _reset_engine_timing(engine) -> None:
    if hasattr(engine, "reset_timing"):
        engine.reset_timing()


def run_backend(backend: str, engine, requests: Sequence[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """Run one backend over `engine` and return its summary (with host timing under 'extra')."""
    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor
    from jaxllm.llm import LLM

    progress = not args.no_progress
    extra: dict[str, Any] = {}
    if backend == "engine":
        _reset_engine_timing(engine)
        started = time.perf_counter()
        records = run_engine(engine, requests, concurrency=args.concurrency, progress=progress)
        wall = time.perf_counter() - started
        extra.update(engine_host_timing(engine))
    else:
        executor = GenerationExecutor(engine, ExecutorConfig(num_postprocess_workers=args.num_postprocess_workers))
        try:
            # One short warm pass so first-request costs (threads, workers) stay out of the timing.
            run_executor(executor, requests[: min(len(requests), 4)], progress=False)
            _reset_engine_timing(engine)
            t0 = executor.timing()
            started = time.perf_counter()
            if backend == "executor":
                records = run_executor(
                    executor, requests, concurrency=args.concurrency, streaming=not args.no_streaming, progress=progress
                )
            else:
                records = run_llm(LLM.from_executor(executor), requests, progress=progress)
            wall = time.perf_counter() - started
            t1 = executor.timing()
            iters = t1["iterations"] - t0["iterations"]
            extra.update(engine_host_timing(engine))
            if iters:
                extra["executor_loop_ms_outside_step"] = (
                    (t1["mean_iteration_ms"] * t1["iterations"] - t0["mean_iteration_ms"] * t0["iterations"])
                    - (t1["mean_step_ms"] * t1["iterations"] - t0["mean_step_ms"] * t0["iterations"])
                ) / iters
                extra["output_thread_ms_per_batch"] = t1["mean_output_batch_ms"]
        finally:
            executor.shutdown()
    summary = summarize(records, wall_time=wall)
    summary["extra"] = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in extra.items()}
    summary["backend"] = backend
    return summary


def build_parser(prog: str = "jaxllm bench throughput") -> argparse.ArgumentParser:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_engine_args(parser)
    add_dataset_args(parser)
    parser.add_argument("--backend", choices=(*BACKENDS, "all"), default="executor")
    parser.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: all)")
    parser.add_argument("--no-streaming", action="store_true", help="executor backend: wait for whole results")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the backends round-robin N times and report each one's median run "
        "(evens out noise from other load on the machine)",
    )
    parser.add_argument("--report-json", default=None, help="write the report here")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit("--concurrency must be >= 1")
    engine = build_engine(args)
    requests = dataset_from_args(args, engine.tokenizer, engine.max_seq_len)
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    trials: dict[str, list[dict]] = {b: [] for b in backends}
    for _ in range(args.repeat):
        for backend in backends:
            trials[backend].append(run_backend(backend, engine, requests, args))
    runs = {}
    for backend in backends:
        ordered = sorted(trials[backend], key=lambda s: s["output_token_throughput"])
        summary = ordered[len(ordered) // 2]
        if args.repeat > 1:
            summary["trials_output_token_throughput"] = [s["output_token_throughput"] for s in trials[backend]]
            summary["extra"]["trials (tok/s)"] = ", ".join(
                f"{s['output_token_throughput']:.0f}" for s in trials[backend]
            )
        runs[backend] = summary
        print(
            format_table(summary, f"throughput: {backend}" + (f" (median of {args.repeat})" if args.repeat > 1 else ""))
        )
        print()
    if len(runs) > 1:
        base = runs.get("engine")
        for name, s in runs.items():
            ratio = (
                ""
                if not base or not base["output_token_throughput"]
                else (f"  ({s['output_token_throughput'] / base['output_token_throughput']:.3f}x engine)")
            )
            print(f"{name:<9} {s['output_token_throughput']:>12,.1f} output tok/s{ratio}")
    if args.report_json:
        config = {
            k: str(v) if v is not None and not isinstance(v, (int, float, bool, str)) else v
            for k, v in vars(args).items()
        }
        write_report(args.report_json, {"runs": runs} if len(runs) > 1 else runs[backends[0]], config)
    return 0 if all(s["num_failed"] == 0 for s in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
