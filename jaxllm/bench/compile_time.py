"""Trace + compile time of the model forward against depth: layer stacks under lax.scan
(`scan_layers`, the default) side by side with the unrolled per-layer loop.

The model is random-shaped (only shapes are needed: nothing is loaded or run), by default a
Qwen3-MoE whose first layer is dense (two layer kinds, so two stacks), with a small hidden
size so the figures show the cost of the program's size, not of its matmuls. Each row times
`jax.jit(forward).lower(...)` (tracing + lowering to StableHLO) and `.compile()` (XLA) for
one token bucket, with JAX's persistent compilation cache off, and counts the lowered
program's lines. Run: `jaxllm bench compile --layers 4 30 61`.

`--mla` times a DeepSeek-V3-shaped model instead (multi-head latent attention over a latent
page pool, 3 dense layers then MoE layers with grouped routing and a shared expert, as
DeepSeek-V3's 61 = 3 + 58); `--ep N` runs the step on N devices (8 fake CPU devices by
default on a CPU host) with tensor parallelism N and expert parallelism N, the experts stored
as slots (the layout the online load balancer rewrites): each MoE stack then scans
expert-parallel slot layers. Both combine (`--mla --ep 8`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional


def model_config(arch: str, num_layers: int, hidden: int, scan: bool, heads: int = 4):
    from jaxllm.models import ModelConfig

    if arch == "deepseek_v3":
        return deepseek_config(num_layers, hidden, scan, heads)
    kv_heads, head_dim = 2, max(hidden // 4, 8)
    common = dict(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        sliding_window=None,
        scan_layers=scan,
    )
    if arch == "llama":
        return ModelConfig(architecture="LlamaForCausalLM", qk_norm=False, **common)
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
        **common,
    )


def deepseek_config(num_layers: int, hidden: int, scan: bool, heads: int):
    """A small DeepSeek-V3-shaped model: MLA with q LoRA, 8 experts in 2 groups, a shared expert,
    the first min(3, layers - 1) layers dense."""
    from dataclasses import replace

    from jaxllm.models import ModelConfig

    hf = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 2,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=min(3, num_layers - 1),
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return replace(ModelConfig.from_hf_config(hf), scan_layers=scan)


def _sharded_params(config, mesh) -> Any:
    """Parameter shapes with their shardings on `mesh`, the experts stored as slots (default
    placement) with real slot tables, as `load_params` lays them out."""
    import jax

    from jaxllm.models.loader import _add_slot_tables, slot_assignments_for
    from jaxllm.models.partitioning import kv_replicas_for, rules_for
    from jaxllm.models.weights import build_params, declare_params, layer_stacks
    from sharding.rules import named_sharding

    rules = rules_for(config, mesh)
    assignments = slot_assignments_for(config, mesh)
    decls = declare_params(config, kv_replicas_for(config, mesh, rules), assignments)
    params = build_params(
        (
            (
                d.path,
                jax.ShapeDtypeStruct(
                    d.shape, d.param_dtype(config.dtype), sharding=named_sharding(mesh, d.axes, rules)
                ),
            )
            for d in decls
        ),
        config,
        layer_stacks(config),
    )
    _add_slot_tables(params, config, mesh, assignments)
    return params


def measure(config, *, tokens: int, max_seqs: int, num_blocks: int, tokens_per_block: int, mesh: Any = None) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models import forward, init_kv_cache, param_shapes
    from jaxllm.step_batch import StepBatch

    max_blocks = max(num_blocks // max_seqs, 1)
    batch = StepBatch(
        token_ids=np.zeros(tokens, np.int32),
        positions=np.zeros(tokens, np.int32),
        slot_mapping=np.full(tokens, num_blocks * tokens_per_block, np.int32),
        cu_q_lens=np.zeros(max_seqs + 1, np.int32),
        kv_lens=np.zeros(max_seqs, np.int32),
        block_tables=np.zeros((max_seqs, max_blocks), np.int32),
        num_seqs=np.zeros(1, np.int32),
        logits_indices=np.zeros(max_seqs, np.int32),
    )
    if mesh is None:
        cache = jax.eval_shape(lambda: init_kv_cache(config, num_blocks, tokens_per_block, jnp.dtype(config.dtype)))
        params = param_shapes(config)
    else:  # small: a real (sharded) cache keeps its sharding in the lowered program
        cache = init_kv_cache(config, num_blocks, tokens_per_block, jnp.dtype(config.dtype), mesh)
        params = _sharded_params(config, mesh)
    step = jax.jit(functools.partial(forward, config=config, mesh=mesh), donate_argnums=(1,))
    start = time.perf_counter()
    lowered = step.lower(params, cache, batch)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter() - start
    return dict(trace_s=traced, compile_s=compiled, hlo_lines=len(lowered.as_text().splitlines()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxllm bench compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 30, 61], help="depths to measure")
    parser.add_argument(
        "--arch",
        choices=["qwen3_moe", "llama"],
        default="qwen3_moe",
        help="qwen3_moe: first layer dense, the rest MoE (8 experts); llama: all dense",
    )
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--tokens", type=int, default=64, help="token bucket of the compiled step")
    parser.add_argument("--max-seqs", type=int, default=8, help="sequence slots of the step")
    parser.add_argument("--modes", nargs="+", choices=["loop", "scan"], default=["loop", "scan"])
    parser.add_argument(
        "--mla",
        action="store_true",
        help="a DeepSeek-V3-shaped model (multi-head latent attention, 3 dense layers, then MoE)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=0,
        metavar="N",
        help="tensor and expert parallelism over N devices, experts stored as slots (on a CPU host "
        "with fewer devices the benchmark reruns itself with N fake CPU devices)",
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON line per measurement")
    args = parser.parse_args(argv)
    arch = "deepseek_v3" if args.mla else args.arch
    if args.ep and arch == "llama":
        parser.error("--ep needs a MoE model (--arch qwen3_moe or --mla)")

    import jax

    if args.ep and len(jax.devices()) < args.ep:
        if jax.default_backend() != "cpu" or os.environ.get("_JAXLLM_BENCH_COMPILE_CHILD"):
            print(f"jaxllm bench compile: {args.ep} devices needed, {len(jax.devices())} visible", file=sys.stderr)
            return 2
        env = dict(
            os.environ,
            _JAXLLM_BENCH_COMPILE_CHILD="1",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.ep}".strip(),
        )
        return subprocess.call(
            [sys.executable, "-m", "jaxllm.bench.compile_time", *(argv if argv is not None else sys.argv[1:])], env=env
        )
    mesh = None
    if args.ep:
        from sharding.mesh import ParallelConfig, make_mesh

        mesh = make_mesh(
            ParallelConfig(tensor_parallel_size=args.ep, moe_expert_parallel_size=args.ep), jax.devices()[: args.ep]
        )
    heads = max(4, args.ep)
    jax.config.update("jax_enable_compilation_cache", False)
    layout = f", TP {args.ep} x EP {args.ep} (experts as slots)" if args.ep else ""
    print(
        f"forward of {arch} (hidden {args.hidden}){layout}, bucket {args.tokens} tokens x {args.max_seqs} seqs, "
        f"{jax.devices()[0].platform}, jax {jax.__version__}; seconds, persistent compilation cache off"
    )
    header = f"{'layers':>6}  " + "  ".join(
        f"{m + ' trace':>11} {m + ' compile':>13} {m + ' total':>11} {m + ' HLO lines':>15}" for m in args.modes
    )
    if len(args.modes) == 2:
        header += f"  {'speedup':>8}"
    print(header)
    for num_layers in args.layers:
        row = {}
        for mode in args.modes:
            config = model_config(arch, num_layers, args.hidden, scan=mode == "scan", heads=heads)
            row[mode] = measure(
                config, tokens=args.tokens, max_seqs=args.max_seqs, num_blocks=64, tokens_per_block=16, mesh=mesh
            )
            if args.json:
                print(json.dumps(dict(layers=num_layers, mode=mode, arch=arch, ep=args.ep, **row[mode])), flush=True)
        line = f"{num_layers:>6}  " + "  ".join(
            f"{r['trace_s']:>11.2f} {r['compile_s']:>13.2f} {r['trace_s'] + r['compile_s']:>11.2f} "
            f"{r['hlo_lines']:>15d}"
            for r in row.values()
        )
        if len(row) == 2:
            total = {m: r["trace_s"] + r["compile_s"] for m, r in row.items()}
            line += f"  {total['loop'] / total['scan']:>7.1f}x"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
