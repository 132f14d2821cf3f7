"""Decode tokens/s of a DeepSeek-V3-shaped model with absorbed against expanded latent attention.

A random DeepseekV3 checkpoint (no download) is loaded and one decode step (every
sequence of the batch adds one token after `context` cached tokens) is timed with
multi-head latent attention in each form (`jaxllm.models.mla`): absorbed (attention in
latent space over the cache as it is) and expanded (the step's pages expanded to per-head
K/V first). The cache holds random latents: the step's cost does not depend on them.
Also prints the KV cache bytes per token of the latent cache against an equivalent
full-K/V cache, for the model and for DeepSeek-V3's real config.

    jaxllm bench mla --contexts 128,512,2048 --batch 8
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# DeepSeek-V3's attention dimensions (config.json of deepseek-ai/DeepSeek-V3).
DEEPSEEK_V3_ATTENTION = dict(
    num_hidden_layers=61,
    num_attention_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxllm bench mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="128,512,2048", help="cached tokens per sequence, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--q-lora-rank", type=int, default=192)
    p.add_argument("--qk-rope-head-dim", type=int, default=32)
    p.add_argument("--qk-nope-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (the first dense, the rest MoE)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--attention-backend", default=None, help="xla, pallas (default: the platform's)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    return p


def hf_config(args: argparse.Namespace) -> dict:
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=1024,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        moe_intermediate_size=args.hidden_size // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        qk_nope_head_dim=args.qk_nope_head_dim,
        v_head_dim=args.v_head_dim,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def kv_bytes(
    num_layers: int, heads: int, kv_lora_rank: int, qk_rope: int, qk_nope: int, v_head: int, itemsize: int
) -> tuple[int, int]:
    """(latent cache, full K/V cache) bytes per token over all layers."""
    from jaxllm.kv_cache.spec import MlaKvCacheSpec

    latent = MlaKvCacheSpec(num_layers, kv_lora_rank, qk_rope, "float32").bytes_per_token() // 4 * itemsize
    return latent, num_layers * heads * (qk_nope + qk_rope + v_head) * itemsize


def _decode_batch(batch: int, context: int, tokens_per_block: int, vocab: int):
    import numpy as np

    from jaxllm.step_batch import StepBatch

    blocks_per_seq = -(-(context + 1) // tokens_per_block)
    tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    positions = np.full(batch, context, np.int32)
    slots = tables[:, context // tokens_per_block] * tokens_per_block + context % tokens_per_block
    return StepBatch(
        token_ids=np.random.default_rng(0).integers(0, vocab, batch).astype(np.int32),
        positions=positions,
        slot_mapping=slots.astype(np.int32),
        cu_q_lens=np.arange(batch + 1, dtype=np.int32),
        kv_lens=positions + 1,
        block_tables=tables,
        num_seqs=np.array([batch], np.int32),
        logits_indices=np.arange(batch, dtype=np.int32),
    )


def run(args: argparse.Namespace) -> list[dict]:
    from dataclasses import replace

    import jax
    from safetensors.numpy import save_file

    from jaxllm.kv_cache.spec import MlaLayerCache
    from jaxllm.models import ModelConfig, forward, init_kv_cache, load_params
    from jaxllm.models.backends import resolve_backends
    from jaxllm.models.random_checkpoint import random_checkpoint

    hf = hf_config(args)
    config = ModelConfig.from_hf_config(hf)
    backend, _, attention_fn, moe_fn = resolve_backends(args.attention_backend, None)
    contexts = [int(c) for c in args.contexts.split(",")]
    tpb = args.tokens_per_block
    num_blocks = args.batch * -(-(max(contexts) + 1) // tpb)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "config.json").write_text(json.dumps(hf))
        save_file(random_checkpoint(config, 0), str(directory / "model.safetensors"))
        params = load_params(directory, config)
    key = jax.random.PRNGKey(0)
    empty = init_kv_cache(config, num_blocks, tpb, config.dtype)  # a page pool (scan_layers) or per-layer caches
    random_latents = lambda i, c: MlaLayerCache(  # noqa: E731
        jax.random.normal(jax.random.fold_in(key, i), c.latent.shape, c.latent.dtype)
    )
    cache = [random_latents(i, c) for i, c in enumerate(empty)] if isinstance(empty, list) else random_latents(0, empty)
    for context in contexts:
        batch = _decode_batch(args.batch, context, tpb, config.vocab_size)
        row = dict(context=context, batch=args.batch, backend=backend, platform=jax.default_backend())
        for mode in ("absorbed", "expanded"):
            step = jax.jit(
                functools.partial(
                    forward, config=replace(config, mla_attention=mode), attention_fn=attention_fn, moe_fn=moe_fn
                )
            )
            step(params, cache, batch)[0].block_until_ready()  # compile
            samples = []
            for _ in range(args.iters):
                start = time.perf_counter()
                step(params, cache, batch)[0].block_until_ready()
                samples.append(time.perf_counter() - start)
            row[f"{mode}_ms"] = round(statistics.median(samples) * 1e3, 3)
            row[f"{mode}_tok_s"] = round(args.batch / statistics.median(samples), 1)
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rows = run(args)
    model = kv_bytes(
        args.layers, args.heads, args.kv_lora_rank, args.qk_rope_head_dim, args.qk_nope_head_dim, args.v_head_dim, 4
    )
    real = kv_bytes(
        itemsize=2,
        **{
            k: v
            for k, v in zip(
                ("num_layers", "heads", "kv_lora_rank", "qk_rope", "qk_nope", "v_head"), DEEPSEEK_V3_ATTENTION.values()
            )
        },
    )
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(dict(kv_bytes_per_token=dict(model_f32=model, deepseek_v3_bf16=real))))
        return 0
    print(
        f"decode, batch {args.batch}, {args.layers} layers, {args.heads} heads, kv_lora_rank "
        f"{args.kv_lora_rank}, attention backend {rows[0]['backend'] if rows else '-'} on "
        f"{rows[0]['platform'] if rows else '-'}"
    )
    head = (
        f"{'context':>8} {'absorbed ms':>12} {'expanded ms':>12} {'absorbed tok/s':>15} {'expanded tok/s':>15} "
        f"{'speedup':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['context']:>8} {r['absorbed_ms']:>12.2f} {r['expanded_ms']:>12.2f} {r['absorbed_tok_s']:>15.1f} "
            f"{r['expanded_tok_s']:>15.1f} {r['expanded_ms'] / r['absorbed_ms']:>7.2f}x"
        )
    print()
    print(f"{'KV cache bytes/token':<34} {'latent':>12} {'full K/V':>12} {'ratio':>8}")
    for name, (latent, full) in (("this model (f32)", model), ("DeepSeek-V3 (61 layers, bf16)", real)):
        print(f"{name:<34} {latent:>12,} {full:>12,} {full / latent:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
