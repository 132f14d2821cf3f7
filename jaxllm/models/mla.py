"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Per token MLA keeps one compressed vector instead of per-head keys and values: the
RMS-normalised KV latent c (kv_lora_rank) and one RoPE'd key k_r shared by all heads
(qk_rope_head_dim). Head h's key is [c @ k_b[h], k_r] and its value c @ v_b[h], so the
cache (`jaxllm.kv_cache.spec.MlaKvCacheSpec`) stores [c, k_r] per token and layer.

Bytes per token, DeepSeek-V3's real config (61 layers, 128 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128) in bfloat16:

    latent cache:  61 x (512 + 64) x 2 B                     =    70,272 B (68.6 KiB)
    full K/V cache: 61 x 128 heads x (192 (K) + 128 (V)) x 2 B = 4,997,120 B (4.77 MiB)

71.1x less (`tests/test_deepseek.py` recomputes both from the specs).

Two equal ways to attend (checked against each other in the tests):

- absorbed (decode): k_b folds into the query, q_lat[h] = q_nope[h] @ k_b[h]^T, so the
  scores are q_lat[h] . c + q_rope[h] . k_r: multi-query attention with one "KV head"
  [c, k_r] of width kv_lora_rank + qk_rope_head_dim whose values are its first
  kv_lora_rank columns. v_b is applied after attention (out[h] = (p @ c) @ v_b[h]). The
  cache is read once per step, never expanded: the form for decode, where each key
  meets one query.
- expanded (prefill): the pages of the step's block tables are expanded to per-head K/V
  and ordinary multi-head paged attention runs over them: cheaper per (query, key) pair
  (qk 192 + v 128 wide instead of 2 x 576), the form for prefill, where each expanded key
  serves many queries.

`mla_attention` picks per program with `config.mla_attention`: "auto" runs absorbed in the
programs whose shapes hold at most one token per sequence (the decode buckets: every key
meets one query) and expanded in the others, or one form always ("absorbed", "expanded";
benchmarks, tests). The choice is made when the program is built: a `lax.cond` on the step's
data would make XLA on a GPU read its predicate back to the host in every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.models.attention import AttentionFn, AttentionMetadata, latent_attention_of
from jaxllm.models.kv_quant import dequantize_kv, quantize_kv, scale_outputs, scale_queries
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.numerics import rms_norm
from jaxllm.models.quantization import dense, qeinsum
from jaxllm.models.rope import yarn_softmax_scale

MLA_MODES = ("auto", "absorbed", "expanded")


def mla_softmax_scale(config: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2."""
    return (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(config)


def apply_mla_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """RoPE over the last axis of x [T, ..., Dr]; cos/sin [T, Dr] (neox halves, as rope_cos_sin
    builds them). `interleave`: DeepSeek's pairs (x0, x1), (x2, x3), ... each rotated by one
    frequency, output de-interleaved ([evens, odds]) as transformers does."""
    extra = (None,) * (x.ndim - 2)
    if not interleave:
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[(slice(None),) + extra] + rotated * sin[(slice(None),) + extra]
    half = x.shape[-1] // 2
    c, s = cos[:, :half][(slice(None),) + extra], sin[:, :half][(slice(None),) + extra]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def mla_projections(
    x: jax.Array,
    p: dict,
    cos: jax.Array,
    sin: jax.Array,
    *,
    config: ModelConfig,
    precision: Optional[jax.lax.Precision],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q_nope [T, Hq, Dn], RoPE'd q_rope [T, Hq, Dr], the cache entries [T, R + Dr])."""
    c = config
    if c.q_lora_rank is not None:
        qa = qeinsum("th,hr->tr", x, p["q_a"], precision=precision)
        qa = rms_norm(qa, p["q_a_norm"], c.rms_norm_eps)
        q = qeinsum("tr,rnd->tnd", qa, p["q_b"], precision=precision)
    else:
        q = qeinsum("th,hnd->tnd", x, p["q"], precision=precision)
    q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
    latent = rms_norm(qeinsum("th,hr->tr", x, p["kv_a"], precision=precision), p["kv_a_norm"], c.rms_norm_eps)
    k_rope = qeinsum("th,hd->td", x, p["k_rope"], precision=precision)
    q_rope = apply_mla_rope(q_rope, cos, sin, c.rope_interleave)
    k_rope = apply_mla_rope(k_rope, cos, sin, c.rope_interleave)
    return q_nope, q_rope, jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)


def absorbed_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: MlaLayerCache,
    md: AttentionMetadata,
    p: dict,
    *,
    latent_fn: Callable,
    sm_scale: float,
    kv_lora_rank: int,
    precision: Optional[jax.lax.Precision],
    kv_scale: Optional[jax.Array] = None,
) -> jax.Array:
    """Attention in latent space: [T, Hq, Dv]. An FP8 cache's scale is folded into the query
    and the output (`jaxllm.models.kv_quant`)."""
    q_latent = jnp.einsum("tnd,rnd->tnr", q_nope, dense(p["k_b"], q_nope.dtype), precision=precision)
    q = jnp.concatenate([q_latent.astype(q_rope.dtype), q_rope], axis=-1)
    out_latent = latent_fn(scale_queries(q, kv_scale), cache, md, sm_scale=sm_scale, value_dim=kv_lora_rank)
    out_latent = scale_outputs(out_latent, kv_scale)
    v_b = dense(p["v_b"], q_nope.dtype)
    return jnp.einsum("tnr,rnv->tnv", out_latent.astype(q_nope.dtype), v_b, precision=precision)


def expanded_attention(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: MlaLayerCache,
    md: AttentionMetadata,
    p: dict,
    *,
    mha_fn: Callable,
    sm_scale: float,
    kv_lora_rank: int,
    precision: Optional[jax.lax.Precision],
    kv_scale: Optional[jax.Array] = None,
) -> jax.Array:
    """The step's pages expanded to per-head K/V, then paged MHA over them: [T, Hq, Dv]. An FP8
    cache's gathered pages are dequantized first."""
    num_seqs, max_blocks = md.block_tables.shape
    pages = cache.latent[md.block_tables.reshape(-1)]  # [S * MB, tpb, R + Dr]
    if kv_scale is not None:
        pages = dequantize_kv(pages, kv_scale, q_nope.dtype)
    latent, k_rope = pages[..., :kv_lora_rank], pages[..., kv_lora_rank:]
    k_nope = jnp.einsum("bpr,rnd->nbpd", latent, dense(p["k_b"], latent.dtype), precision=precision)
    v = jnp.einsum("bpr,rnv->nbpv", latent, dense(p["v_b"], latent.dtype), precision=precision)
    heads = k_nope.shape[0]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[None], (heads,) + k_rope.shape).astype(k_nope.dtype)], -1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    width = max(k.shape[-1], v.shape[-1])
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])  # noqa: E731
    tables = jnp.arange(num_seqs * max_blocks, dtype=jnp.int32).reshape(num_seqs, max_blocks)
    out = mha_fn(
        pad(q),
        MhaLayerCache(pad(k), pad(v)),
        dataclasses.replace(md, block_tables=tables),
        sm_scale=sm_scale,
        sliding_window=None,
    )
    return out[..., : p["v_b"].shape[-1]]


def mla_attention(
    x: jax.Array,
    p: dict,
    cache: MlaLayerCache,
    md: AttentionMetadata,
    cos: jax.Array,
    sin: jax.Array,
    *,
    config: ModelConfig,
    mha_fn: AttentionFn,
    latent_fn: Callable,
    write_fn: Callable,
    decode_only: bool,
    precision: Optional[jax.lax.Precision],
    kv_scale: Optional[jax.Array] = None,
) -> tuple[jax.Array, MlaLayerCache]:
    """One MLA layer: output [T, H] and the layer cache with this step's latents written
    (quantized with `kv_scale` for an FP8 cache)."""
    q_nope, q_rope, entries = mla_projections(x, p, cos, sin, config=config, precision=precision)
    cache = write_fn(cache, entries if kv_scale is None else quantize_kv(entries, kv_scale), md.slot_mapping)
    common = dict(
        sm_scale=mla_softmax_scale(config), kv_lora_rank=config.kv_lora_rank, precision=precision, kv_scale=kv_scale
    )
    absorbed = lambda: absorbed_attention(q_nope, q_rope, cache, md, p, latent_fn=latent_fn, **common)  # noqa: E731
    expanded = lambda: expanded_attention(q_nope, q_rope, cache, md, p, mha_fn=mha_fn, **common)  # noqa: E731
    mode = config.mla_attention
    use_absorbed = mode == "absorbed" or (mode == "auto" and decode_only)
    out = absorbed() if use_absorbed else expanded()
    y = qeinsum("tnv,nvh->th", out.astype(x.dtype), p["o"], precision=precision)
    return y, cache


def latent_backend(attention_fn: AttentionFn) -> Callable:
    """The latent (absorbed) attention matching an MHA backend (same kernel family)."""
    return latent_attention_of(attention_fn)
