"""What structured output costs a batch (`jaxllm bench structured`).

One warmed-up `LLMEngine` runs the same batch of `--batch` requests three times, side by side:
  * `none`: no request constrained (the peer);
  * `1 of N`: one request follows a JSON schema, the others are free;
  * `N of N`: every request follows the schema.
Free requests ignore EOS and run `--output-len` tokens; constrained ones end when their JSON
closes (or at `--output-len`). Columns: seconds of the run, seconds until the last free request
finished (under the overlap scheduler a constrained request runs every other step while others
run, so the free ones should finish as in `none`), output tokens per second over the run and its
ratio to `none`, engine steps, host milliseconds per step (planning, packing, mask filling, bookkeeping:
`EngineTiming.host_seconds`) and its ratio, of which filling the grammar masks, and programs
compiled after warm-up (the sampler variant with a bitmask compiles on its first step, before
the timed run). The modes take turns `--repeat` times; each row is its fastest pass. Then the
grammar compile time of the schema: cold (translated and its matcher
built) and cached (a hit in both caches), and one request's matcher (a copy of the cached one).

    jaxllm bench structured --model tiny-moe
    jaxllm bench structured --model smollm2
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}


@dataclass
class StructuredRow:
    mode: str
    constrained: int
    seconds: float
    others_seconds: float  # until the last unconstrained request finished (0: none)
    output_tokens: int
    steps: int
    host_ms_per_step: float
    mask_ms_per_step: float
    valid_json: int  # constrained outputs that parse as JSON
    compiles_after_warmup: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_row(engine, prompts: list[list[int]], free, constrained, num_constrained: int, mode: str) -> StructuredRow:
    """Run the batch once: the first `num_constrained` requests with `constrained` params."""
    # The first step of a new sampler variant compiles it: run one short batch untimed first.
    if num_constrained:
        probe = engine.add_request(prompts[0], constrained)
        while engine.has_unfinished_requests():
            engine.step()
        del probe
    compiled = engine.runner.num_compiled_variants
    fill_before = engine.guided.fill_seconds
    engine.reset_timing()
    requests = [engine.add_request(p, constrained if i < num_constrained else free) for i, p in enumerate(prompts)]
    others = requests[num_constrained:]
    others_seconds = 0.0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if not others_seconds and others and all(r.is_finished for r in others):
            others_seconds = time.perf_counter() - started
    seconds = time.perf_counter() - started
    timing = engine.timing
    valid = 0
    for request in requests[:num_constrained]:
        try:
            json.loads(engine.tokenizer.decode(request.output_token_ids, skip_special_tokens=True))
            valid += 1
        except ValueError:
            pass
    steps = max(1, timing.steps)
    return StructuredRow(
        mode,
        num_constrained,
        seconds,
        others_seconds,
        sum(len(r.output_token_ids) for r in requests),
        timing.steps,
        1e3 * timing.host_seconds / steps,
        1e3 * (engine.guided.fill_seconds - fill_before) / steps,
        valid,
        engine.runner.num_compiled_variants - compiled,
    )


def format_table(rows: list[StructuredRow]) -> str:
    base = rows[0]
    head = (
        f"{'mode':<9} {'guided':>6} {'seconds':>8} {'free s':>7} {'out tok':>8} {'tok/s':>8} {'vs none':>7} "
        f"{'steps':>6} "
        f"{'host ms/step':>12} {'vs none':>7} {'mask ms/step':>12} {'valid json':>10} {'compiles':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        tok_ratio = r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        host_ratio = r.host_ms_per_step / base.host_ms_per_step if base.host_ms_per_step else 0.0
        lines.append(
            f"{r.mode:<9} {r.constrained:>6} {r.seconds:>8.2f} {_secs(r.others_seconds):>7} "
            f"{r.output_tokens:>8} {r.tokens_per_s:>8.1f} "
            f"{tok_ratio:>6.2f}x {r.steps:>6} {r.host_ms_per_step:>12.2f} {host_ratio:>6.2f}x "
            f"{r.mask_ms_per_step:>12.3f} {r.valid_json:>5}/{r.constrained:<4} {r.compiles_after_warmup:>8}"
        )
    return "\n".join(lines)


def _secs(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds else "-"


def compile_times(engine, repeats: int = 20) -> tuple[float, float, float]:
    """Milliseconds: a new schema compiled cold, the same one cached, one request's matcher."""
    from jaxllm.sampling.guided import GuidedDecodingParams

    schema = {**SCHEMA, "title": f"bench-{time.time_ns()}"}  # text never seen: misses both caches
    started = time.perf_counter()
    engine.guided.check(GuidedDecodingParams(json=schema))
    cold = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        engine.guided.check(GuidedDecodingParams(json=schema))
    cached = (time.perf_counter() - started) / repeats
    template = engine.guided.template(GuidedDecodingParams(json=schema))
    started = time.perf_counter()
    for _ in range(repeats):
        template.deep_copy()
    copy = (time.perf_counter() - started) / repeats
    return 1e3 * cold, 1e3 * cached, 1e3 * copy


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig
    from jaxllm.sampling import GuidedDecodingParams, SamplingParams

    parser = argparse.ArgumentParser(
        prog="jaxllm bench structured",
        formatter_class=HelpFormatter,
        description="Structured output's cost: tokens/s and host time per step of a batch with no request, "
        "one request and every request following a JSON schema; grammar compile time, cold and cached.",
    )
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="passes over the three modes; the fastest of each")
    parser.add_argument("--disable-overlap-scheduler", action="store_true")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch must be >= 2")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    prompt_budget = 64
    max_seq_len = prompt_budget + args.output_len + args.tokens_per_block
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_batch_size=args.batch,
            max_num_tokens=max(256, args.batch),
            max_seq_len=max_seq_len,
            disable_overlap_scheduler=args.disable_overlap_scheduler,
            kv_cache_config=KvCacheConfig(
                tokens_per_block=args.tokens_per_block, max_tokens=args.batch * (max_seq_len + args.tokens_per_block)
            ),
        )
    )
    engine.warmup()
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.encode(f"Record {i}: write one user of a web shop as a JSON object.")[:prompt_budget]
        for i in range(args.batch)
    ]
    free = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_len, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    modes = (("none", 0), (f"1 of {args.batch}", 1), (f"all {args.batch}", args.batch))
    best: dict[str, StructuredRow] = {}
    for _ in range(args.repeat):  # the modes take turns, so a slower spell of a shared machine hits all
        for mode, count in modes:
            row = run_row(engine, prompts, free, constrained, count, mode)
            if mode not in best or row.seconds < best[mode].seconds:
                best[mode] = row
    rows = [best[mode] for mode, _ in modes]
    cold, cached, copy = compile_times(engine)
    print(
        f"model {args.model}, batch {args.batch}, output len {args.output_len}, overlap {engine.overlap}, "
        f"best of {args.repeat} passes"
    )
    print(format_table(rows))
    print(
        f"grammar compile (JSON schema above): cold {cold:.2f} ms, cached {cached:.4f} ms "
        f"({cold / max(cached, 1e-9):.0f}x), per-request matcher copy {copy:.4f} ms"
    )
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
