"""`jaxllm bench settings`: does a running stream stall when requests with new sampling settings arrive?

One long greedy request streams while short requests arrive one after another, each with a
sampling setting no earlier request used (logprobs, temperature, top-k / top-p, min-p, penalties,
banned tokens with min_tokens, a JSON schema; `--prompt-logprobs` adds one asking for its
prompt's logprobs). The table shows the stream's inter-token gaps: median, worst and worst ÷
median, and the compiles made on the engine's thread meanwhile. Engines, side by side in one
run, each built with the compilation cache off (every program compiles in this run):
  * jaxllm: `serve`'s start-up (background warm-up): a step whose sampler variant is not compiled
    runs the general variant while its own compiles in the background;
  * jaxllm, variants on the step: the engine without that fallback (`compile_ahead=False`, every
    token bucket and the greedy sampler compiled first): a new setting compiles its sampler
    variant on the step, and every running stream waits for it;
  * jaxllm, stall-free steps: `max_num_tokens_with_generation=--stall-free-tokens` (8): an
    arriving prompt joins the stream in chunks up to that step size instead of whole in its
    bucket (whose forward, on a CPU, costs about five one-row decode steps at 64 tokens).

    jaxllm bench settings --model smollm2 --output-len 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from jaxllm.bench.throughput import add_engine_args

JAXLLM = "jaxllm"
ON_THE_STEP = "jaxllm, variants on the step"
STALL_FREE = "jaxllm, stall-free steps"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def settings(tokens: int, prompt_logprobs: bool) -> list[tuple[str, dict]]:
    """(name, SamplingParams keywords) of each arriving request, `tokens` output tokens each."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    from jaxllm.sampling import GuidedDecodingParams

    named = [
        ("logprobs", dict(logprobs=5)),
        ("temperature", dict(temperature=0.8, seed=1)),
        ("top-k top-p", dict(temperature=1.0, top_k=20, top_p=0.9, seed=2)),
        ("min-p", dict(temperature=0.7, min_p=0.05, seed=3)),
        ("penalties", dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)),
        ("banned tokens", dict(min_tokens=2, bad_token_ids=[5, 6])),
        ("json schema", dict(guided_decoding=GuidedDecodingParams(json=schema))),
    ]
    if prompt_logprobs:
        named.append(("prompt logprobs", dict(prompt_logprobs=1)))
    return [(name, dict(max_tokens=tokens, ignore_eos="guided_decoding" not in kw, **kw)) for name, kw in named]


def build_engine(args: argparse.Namespace, fallback: bool, name: str = JAXLLM):
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    kwargs["compile_cache"] = False  # each engine compiles its programs in this run
    if not fallback:
        kwargs["compile_ahead"] = False
    if name == STALL_FREE:
        kwargs["max_num_tokens_with_generation"] = args.stall_free_tokens
    engine = LLMEngine(EngineConfig(model=args.model, **kwargs))
    started = time.perf_counter()
    engine.warmup(all_variants=False, background=fallback)
    print(f"{name}: ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return engine


async def _stream_while_settings_arrive(executor, prompt: list[int], args: argparse.Namespace) -> list[float]:
    """The stream's token times while the other requests arrive (one every --interval seconds)."""
    from jaxllm.sampling import SamplingParams

    stream = executor.submit(
        executor.make_request(prompt, SamplingParams(max_tokens=args.output_len, ignore_eos=True), streaming=True)
    )
    times: list[float] = []

    async def consume() -> None:
        async for out in stream:
            if out.outputs[0].token_ids_diff:
                times.append(time.perf_counter())

    async def arrive() -> None:
        while len(times) < 4:  # the stream is decoding
            await asyncio.sleep(0.01)
        for _, kwargs in settings(args.setting_len, args.prompt_logprobs):
            result = executor.submit(executor.make_request(prompt, SamplingParams(**kwargs), streaming=True))
            async for _ in result:
                pass
            await asyncio.sleep(args.interval)

    await asyncio.gather(consume(), arrive())
    return times


def measure(engine, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    import jax

    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor

    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(threading.current_thread().name)

    with GenerationExecutor(engine, ExecutorConfig()) as executor:
        engine_thread = executor.call_on_engine(lambda e: threading.current_thread().name)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            times = asyncio.run(_stream_while_settings_arrive(executor, prompt, args))
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    engine.close()
    gaps = np.diff(times) * 1e3
    median = statistics.median(gaps)
    return {
        "tokens": len(times),
        "gap_p50_ms": float(median),
        "gap_max_ms": float(gaps.max()),
        "max_over_p50": float(gaps.max() / median),
        "engine_thread_compiles": compiles.count(engine_thread),
        "other_compiles": len(compiles) - compiles.count(engine_thread),
    }


def format_table(results: dict[str, dict], model: str, load: str) -> str:
    header = (
        f"{'engine':<30} {'tokens':>6} {'gap p50':>8} {'gap max':>8} {'max ÷ p50':>9} "
        f"{'compiles: step':>14} {'other':>6}"
    )
    lines = [f"settings: {model}, a greedy stream while new sampling settings arrive (ms; {load})", header]
    lines.append("-" * len(header))
    for name, r in results.items():
        lines.append(
            f"{name:<30} {r['tokens']:>6} {r['gap_p50_ms']:>8.1f} {r['gap_max_ms']:>8.1f} {r['max_over_p50']:>9.2f} "
            f"{r['engine_thread_compiles']:>14} {r['other_compiles']:>6}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench settings", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (the stream's and the others')")
    parser.add_argument("--output-len", type=int, default=96, help="output tokens of the stream")
    parser.add_argument("--setting-len", type=int, default=4, help="output tokens of each arriving request")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between two arriving requests")
    parser.add_argument("--prompt-logprobs", action="store_true", help="a request asking for prompt logprobs too")
    parser.add_argument(
        "--peers", nargs="*", choices=("on-the-step", "stall-free"), default=["on-the-step", "stall-free"]
    )
    parser.add_argument("--stall-free-tokens", type=int, default=8, help="the stall-free peer's step size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-json", default=None)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.input_len, args.output_len, args.setting_len) < 1 or args.interval < 0:
        raise SystemExit("jaxllm bench settings: lengths must be >= 1 and --interval >= 0")
    results: dict[str, dict] = {}
    loads = []
    engines = [(JAXLLM, True)] + [(ON_THE_STEP, False)] * ("on-the-step" in args.peers)
    engines += [(STALL_FREE, True)] * ("stall-free" in args.peers)
    for name, fallback in engines:
        engine = build_engine(args, fallback, name)
        rng = np.random.default_rng(args.seed)
        prompt = rng.integers(3, engine.model_config.vocab_size, args.input_len).tolist()
        loads.append(os.getloadavg()[0])
        results[name] = measure(engine, args, prompt)
        loads.append(os.getloadavg()[0])
    load = f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs"
    print(format_table(results, args.model, load))
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "load": load, "results": results, "argv": argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
