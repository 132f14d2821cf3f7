"""Trace + compile time of the model forward against depth: layer stacks under lax.scan
(`scan_layers`, the default) side by side with the unrolled per-layer loop.

The model is random-shaped (only shapes are needed: nothing is loaded or run), by default a
Qwen3-MoE whose first layer is dense (two layer kinds, so two stacks), with a small hidden
size so the figures show the cost of the program's size, not of its matmuls. Each row times
`jax.jit(forward).lower(...)` (tracing + lowering to StableHLO) and `.compile()` (XLA) for
one token bucket, with JAX's persistent compilation cache off, and counts the lowered
program's lines. Run: `jaxllm bench compile --layers 4 30 61`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional


def model_config(arch: str, num_layers: int, hidden: int, scan: bool):
    from jaxllm.models import ModelConfig

    heads, kv_heads, head_dim = 4, 2, max(hidden // 4, 8)
    common = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=num_layers,
                  num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
                  rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
                  attention_bias=False, sliding_window=None, scan_layers=scan)
    if arch == "llama":
        return ModelConfig(architecture="LlamaForCausalLM", qk_norm=False, **common)
    return ModelConfig(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=hidden, norm_topk_prob=True, mlp_only_layers=(0,), **common)


def measure(config, *, tokens: int, max_seqs: int, num_blocks: int, tokens_per_block: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models import forward, init_kv_cache, param_shapes
    from jaxllm.step_batch import StepBatch

    max_blocks = max(num_blocks // max_seqs, 1)
    batch = StepBatch(token_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
                      slot_mapping=np.full(tokens, num_blocks * tokens_per_block, np.int32),
                      cu_q_lens=np.zeros(max_seqs + 1, np.int32), kv_lens=np.zeros(max_seqs, np.int32),
                      block_tables=np.zeros((max_seqs, max_blocks), np.int32), num_seqs=np.zeros(1, np.int32),
                      logits_indices=np.zeros(max_seqs, np.int32))
    cache = jax.eval_shape(lambda: init_kv_cache(config, num_blocks, tokens_per_block, jnp.dtype(config.dtype)))
    step = jax.jit(forward, static_argnames="config", donate_argnums=(1,))
    start = time.perf_counter()
    lowered = step.lower(param_shapes(config), cache, batch, config=config)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter() - start
    return dict(trace_s=traced, compile_s=compiled, hlo_lines=len(lowered.as_text().splitlines()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxllm bench compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 30, 61], help="depths to measure")
    parser.add_argument("--arch", choices=["qwen3_moe", "llama"], default="qwen3_moe",
                        help="qwen3_moe: first layer dense, the rest MoE (8 experts); llama: all dense")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--tokens", type=int, default=64, help="token bucket of the compiled step")
    parser.add_argument("--max-seqs", type=int, default=8, help="sequence slots of the step")
    parser.add_argument("--modes", nargs="+", choices=["loop", "scan"], default=["loop", "scan"])
    parser.add_argument("--json", action="store_true", help="also print one JSON line per measurement")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    print(f"forward of {args.arch} (hidden {args.hidden}), bucket {args.tokens} tokens x {args.max_seqs} seqs, "
          f"{jax.devices()[0].platform}, jax {jax.__version__}; seconds, persistent compilation cache off")
    header = f"{'layers':>6}  " + "  ".join(f"{m + ' trace':>11} {m + ' compile':>13} {m + ' total':>11} "
                                            f"{m + ' HLO lines':>15}" for m in args.modes)
    if len(args.modes) == 2:
        header += f"  {'speedup':>8}"
    print(header)
    for num_layers in args.layers:
        row = {}
        for mode in args.modes:
            config = model_config(args.arch, num_layers, args.hidden, scan=mode == "scan")
            row[mode] = measure(config, tokens=args.tokens, max_seqs=args.max_seqs, num_blocks=64,
                                tokens_per_block=16)
            if args.json:
                print(json.dumps(dict(layers=num_layers, mode=mode, arch=args.arch, **row[mode])), flush=True)
        line = f"{num_layers:>6}  " + "  ".join(
            f"{r['trace_s']:>11.2f} {r['compile_s']:>13.2f} {r['trace_s'] + r['compile_s']:>11.2f} "
            f"{r['hlo_lines']:>15d}" for r in row.values())
        if len(row) == 2:
            total = {m: r["trace_s"] + r["compile_s"] for m, r in row.items()}
            line += f"  {total['loop'] / total['scan']:>7.1f}x"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
