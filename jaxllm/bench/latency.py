"""`jaxllm bench latency`: one request at a time, streamed through the executor.

Measures what a single user sees on an otherwise idle engine: TTFT, TPOT, ITL and
end-to-end latency (percentiles over the requests), EOS ignored.

    jaxllm bench latency --model tiny-moe --num-requests 16 --input-mean 128 --output-mean 128
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

from jaxllm.bench.dataset import add_dataset_args, dataset_from_args
from jaxllm.bench.request_metrics import format_table, summarize, write_report
from jaxllm.bench.throughput import add_engine_args, build_engine, engine_host_timing, run_executor


def main(argv: Optional[list[str]] = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench latency", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_engine_args(parser)
    add_dataset_args(parser)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(num_requests=None)
    args = parser.parse_args(argv)
    if args.dataset is None and args.num_requests is None:
        args.num_requests = 16

    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor

    engine = build_engine(args)
    requests = dataset_from_args(args, engine.tokenizer, engine.max_seq_len)
    with GenerationExecutor(engine, ExecutorConfig(num_postprocess_workers=args.num_postprocess_workers)) as ex:
        if args.warmup_requests:
            run_executor(ex, requests[: args.warmup_requests], concurrency=1, progress=False)
        if hasattr(engine, "reset_timing"):
            engine.reset_timing()
        started = time.perf_counter()
        records = run_executor(ex, requests, concurrency=1, progress=not args.no_progress)
        wall = time.perf_counter() - started
    summary = summarize(records, wall_time=wall)
    summary["extra"] = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in engine_host_timing(engine).items()}
    print(format_table(summary, "latency (concurrency 1)"))
    if args.report_json:
        write_report(
            args.report_json,
            summary,
            {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in vars(args).items()},
        )
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
