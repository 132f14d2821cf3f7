"""Beam search next to its peer, n independent sampled sequences (`jaxllm bench beam`).

The same prompts run through one warmed-up `LLMEngine`, once per row, with EOS ignored
so every sequence reaches `--output-len`:
  * `beam k`: `use_beam_search=True, n=best_of=k` (k beams per request);
  * `sampled k` (the peer): `n=k` sampled sequences per request (temperature 1), each an
    engine request of its own, with prefix reuse sharing the prompt blocks where it can.
Columns: wall seconds, beam / sequence tokens per second (k x output tokens per request
over the run's time), engine steps, the peak of KV blocks in use, what the same sequences
would hold without sharing (each its own copy of every block), block copies made by
copy on write, and programs compiled after warm-up (should be 0).

    jaxllm bench beam --model tiny-moe --widths 2 4 8
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass


@dataclass
class BeamRow:
    mode: str
    width: int
    requests: int
    seconds: float
    tokens_per_s: float
    steps: int
    peak_blocks: int
    peak_unshared_blocks: int
    block_copies: int
    compiles_after_warmup: int


def _compile_count(engine) -> int:
    return engine.runner.num_compiled_variants + engine.runner.num_copy_programs


def run_row(engine, prompts: list[list[int]], params, width: int, mode: str) -> BeamRow:
    kv = engine.kv_cache_manager
    copied_before = engine.runner.blocks_copied
    compiled = _compile_count(engine)
    for prompt in prompts:
        if mode == "beam":
            engine.add_request(prompt, params)
        else:
            for j in range(width):
                engine.add_request(prompt, params, sequence_index=j)
    peak = peak_unshared = steps = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, kv.get_kv_cache_stats().used_num_blocks)
        peak_unshared = max(peak_unshared, sum(len(s.blocks) for s in kv._seqs.values()))
    seconds = time.perf_counter() - started
    copies = engine.runner.blocks_copied - copied_before
    kv.check_invariants()
    tokens = len(prompts) * width * params.max_tokens
    return BeamRow(
        mode,
        width,
        len(prompts),
        seconds,
        tokens / seconds,
        steps,
        peak,
        peak_unshared,
        copies,
        _compile_count(engine) - compiled,
    )


def format_table(rows: list[BeamRow]) -> str:
    head = (
        f"{'mode':<8} {'width':>5} {'reqs':>5} {'seconds':>8} {'tok/s':>8} {'steps':>6} {'peak blocks':>11} "
        f"{'unshared':>9} {'copies':>7} {'compiles':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.mode:<8} {r.width:>5} {r.requests:>5} {r.seconds:>8.2f} {r.tokens_per_s:>8.1f} "
            f"{r.steps:>6} {r.peak_blocks:>11} {r.peak_unshared_blocks:>9} {r.block_copies:>7} "
            f"{r.compiles_after_warmup:>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig
    from jaxllm.sampling import SamplingParams

    parser = argparse.ArgumentParser(
        prog="jaxllm bench beam",
        formatter_class=HelpFormatter,
        description="Beam search (k beams sharing KV blocks) next to n=k independent sampled sequences: "
        "tokens/s, peak KV blocks with and without sharing, block copies, compiles after warm-up.",
    )
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.widths) < 1 or max(args.widths) > 8:
        parser.error("--widths must be in [1, 8]")
    import numpy as np

    max_batch = args.requests * max(args.widths)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_batch_size=max_batch,
            max_num_tokens=max(256, max_batch),
            max_seq_len=args.prompt_len + args.output_len + args.tokens_per_block,
            kv_cache_config=KvCacheConfig(
                tokens_per_block=args.tokens_per_block,
                max_tokens=max_batch * (args.prompt_len + args.output_len + 2 * args.tokens_per_block),
            ),
        )
    )
    engine.warmup()
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    rows = []
    for width in args.widths:
        # Fresh prompts per row, so prefix reuse across rows does not flatter a later row.
        prompts = rng.integers(3, vocab, size=(args.requests, args.prompt_len)).tolist()
        beam = SamplingParams(use_beam_search=True, n=width, max_tokens=args.output_len, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=args.seed)
        for mode, params in (("beam", beam), ("sampled", sampled)):
            rows.append(run_row(engine, prompts, params, width, mode))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
