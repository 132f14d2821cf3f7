"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`, also Kimi K2's architecture): config, weights, routing, layers.

What differs from the other decoders, and lives here:

- attention is multi-head latent attention over a latent cache (`jaxllm.models.mla`);
- the router scores experts with a sigmoid; `e_score_correction_bias` is added for the
  choice only (the weights stay the plain sigmoid scores): the experts are split into
  `n_group` groups, each group scored by the sum of its best two biased scores, the top-k
  experts are chosen within the best `topk_group` groups, their weights optionally
  renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`;
- every MoE layer adds `n_shared_experts` shared experts (one SwiGLU FFN of
  n_shared_experts * moe_intermediate_size columns) to the routed output; the first
  `first_k_dense_replace` layers are dense;
- the multi-token-prediction layers some checkpoints carry (`model.layers.{num_hidden_layers}...`)
  are skipped by the loader with a log line.

Depth: the layers run through the decoder's `run_layers`, so with `scan_layers` the dense
prefix and the MoE layers are two layer stacks, each one `lax.scan` over a latent page pool
for all layers (`MlaKvCacheSpec.init_pool`): DeepSeek-V3's 61 layers trace as two scan bodies.

Parallelism: attention heads (q_b / q, k_b, v_b, o) are split like MHA heads; the latent
projections (q_a, kv_a, k_rope) and the latent cache are replicated; dense layers are
tensor-parallel; shared experts are replicated on every rank; routed experts run through
`sharding.ep_moe` as slots (expert parallelism) or column-split (MoE tensor parallelism).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MhaKvCacheSpec, MlaKvCacheSpec
from jaxllm.models.attention import AttentionFn, AttentionMetadata
from jaxllm.models.config import ModelConfig
from jaxllm.models.mla import latent_backend, mla_attention, mla_cache_spec
from jaxllm.models.moe import MoeFn, moe_block
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from jaxllm.models.weights import Layout, Source
from jaxllm.step_batch import StepBatch
from sharding.expert_load import MoeStepStats, count_experts
from sharding.kernels import shard_attention, shard_kv_write, shard_moe
from sharding.mesh import ParallelConfig, expert_parallel_size, make_mesh
from sharding.rules import logical_to_physical

if TYPE_CHECKING:
    from sharding.ep_moe import EpMoeOptions

logger = logging.getLogger(__name__)

# transformers' DeepseekV3Config defaults, for keys a config.json leaves out.
_HF_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, first_k_dense_replace=3,
                    norm_topk_prob=True, rope_interleave=True)


def deepseek_config_fields(hf: dict, arch: str) -> dict[str, Any]:
    """The MLA and routing fields of `ModelConfig` from a DeepseekV3 config.json."""
    def get(key: str) -> Any:
        return hf[key] if key in hf else _HF_DEFAULTS[key]

    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"unsupported scoring_func={scoring!r} for {arch} (only 'sigmoid')")
    topk_method = hf.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ValueError(f"unsupported topk_method={topk_method!r} for {arch} (only 'noaux_tc')")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise ValueError(f"unsupported moe_layer_freq={hf['moe_layer_freq']} (every layer after "
                         "first_k_dense_replace is sparse)")
    num_experts = int(hf.get("n_routed_experts", hf.get("num_local_experts", _HF_DEFAULTS["n_routed_experts"])))
    n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_routed_experts={num_experts} must split into n_group={n_group} groups of at least 2")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    q_lora = get("q_lora_rank")
    first_k = int(get("first_k_dense_replace") or 0)
    num_layers = int(hf["num_hidden_layers"])
    return dict(
        num_experts=num_experts, num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=bool(get("norm_topk_prob")),
        decoder_sparse_step=1, mlp_only_layers=tuple(range(min(first_k, num_layers))),
        q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")), rope_interleave=bool(get("rope_interleave")), scoring_func="sigmoid",
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(get("routed_scaling_factor")),
        n_shared_experts=int(get("n_shared_experts") or 0))


# ---------------------------------------------------------------------------------------------
# Weights


def _single(name: str, shape: tuple[int, ...], layout: Layout) -> list[list[Source]]:
    return [[Source(name, shape, layout)]]


def _transposed(out_features: int, in_features: int, offset: tuple[int, int] = ()) -> Layout:
    return Layout((out_features, in_features), (1, 0), offset)


def declare_mla_attention(add: Callable, config: ModelConfig, layer: int) -> None:
    """q_a [H, Rq], q_a_norm [Rq], q_b [Rq, Hq, Dn + Dr] (or q [H, Hq, Dn + Dr]); kv_a [H, R] and
    k_rope [H, Dr] (the two parts of kv_a_proj_with_mqa), kv_a_norm [R]; k_b [R, Hq, Dn] and
    v_b [R, Hq, Dv] (the two parts of each head's rows of kv_b_proj); o [Hq, Dv, H]."""
    c = config
    h, hq, r, dr, dn, dv = (c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim,
                            c.v_head_dim)
    dqk = dn + dr
    pre, at = f"model.layers.{layer}.self_attn", ("layers", layer, "attn")
    if c.q_lora_rank is not None:
        rq = c.q_lora_rank
        add(at + ("q_a",), (h, rq), ("embed", None), _single(f"{pre}.q_a_proj.weight", (rq, h), _transposed(rq, h)),
            "linear")
        add(at + ("q_a_norm",), (rq,), (None,),
            _single(f"{pre}.q_a_layernorm.weight", (rq,), Layout((rq,), (0,))), "norm")
        add(at + ("q_b",), (rq, hq, dqk), (None, "heads", "head_dim"),
            _single(f"{pre}.q_b_proj.weight", (hq * dqk, rq), Layout((hq, dqk, rq), (2, 0, 1))), "linear")
    else:
        add(at + ("q",), (h, hq, dqk), ("embed", "heads", "head_dim"),
            _single(f"{pre}.q_proj.weight", (hq * dqk, h), Layout((hq, dqk, h), (2, 0, 1))), "linear")
    kv_a = f"{pre}.kv_a_proj_with_mqa.weight"
    add(at + ("kv_a",), (h, r), ("embed", None), _single(kv_a, (r + dr, h), _transposed(r + dr, h, (0, 0))), "linear")
    add(at + ("k_rope",), (h, dr), ("embed", None), _single(kv_a, (r + dr, h), _transposed(r + dr, h, (r, 0))),
        "linear")
    add(at + ("kv_a_norm",), (r,), (None,), _single(f"{pre}.kv_a_layernorm.weight", (r,), Layout((r,), (0,))), "norm")
    kv_b = f"{pre}.kv_b_proj.weight"
    for ours, width, start in (("k_b", dn, 0), ("v_b", dv, dn)):
        add(at + (ours,), (r, hq, width), (None, "heads", "head_dim"),
            _single(kv_b, (hq * (dn + dv), r), Layout((hq, dn + dv, r), (2, 0, 1), offset=(0, start, 0))), "linear")
    add(at + ("o",), (hq, dv, h), ("heads", "head_dim", "embed"),
        _single(f"{pre}.o_proj.weight", (h, hq * dv), Layout((h, hq, dv), (1, 2, 0))), "linear")


def declare_moe_extras(add: Callable, config: ModelConfig, layer: int) -> None:
    """The router's correction bias [E] (float32 in every model dtype, as transformers keeps it:
    it decides near ties between experts) and the shared experts (gate/up [H, Is], down [Is, H],
    replicated on every rank)."""
    h, e = config.hidden_size, config.num_experts
    pre = f"model.layers.{layer}.mlp"
    add(("layers", layer, "moe", "router_bias"), (e,), (None,),
        _single(f"{pre}.gate.e_score_correction_bias", (e,), Layout((e,), (0,))), "bias", dtype="float32")
    if config.n_shared_experts:
        inter, shared = config.moe_intermediate_size * config.n_shared_experts, ("layers", layer, "shared")
        for ours in ("gate", "up"):
            add(shared + (ours,), (h, inter), ("embed", None),
                _single(f"{pre}.shared_experts.{ours}_proj.weight", (inter, h), _transposed(inter, h)), "linear")
        add(shared + ("down",), (inter, h), (None, "embed"),
            _single(f"{pre}.shared_experts.down_proj.weight", (h, inter), _transposed(h, inter)), "linear")


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def mtp_tensor_names(config: ModelConfig, names: list[str]) -> list[str]:
    """Checkpoint tensors of the multi-token-prediction layers (`model.layers.{i}` for i >=
    num_hidden_layers), which the decoder does not run."""
    out = []
    for name in names:
        m = _LAYER_NAME.match(name)
        if m and int(m.group(1)) >= config.num_layers:
            out.append(name)
    return out


def log_skipped_mtp(names: list[str]) -> None:
    layers = sorted({int(_LAYER_NAME.match(n).group(1)) for n in names})
    logger.info("skipping %d multi-token-prediction tensors (layers %s): speculative decoding with them is "
                "not implemented", len(names), ", ".join(map(str, layers)))


# ---------------------------------------------------------------------------------------------
# Routing


def route_grouped_sigmoid(router_logits: jax.Array, correction_bias: jax.Array, config: ModelConfig
                          ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's `noaux_tc` routing: (weights float32 [T, k], expert ids int32 [T, k])."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)[None, :]
    num_tokens, num_experts = choice.shape
    groups = config.n_group
    group_scores = jax.lax.top_k(choice.reshape(num_tokens, groups, num_experts // groups), 2)[0].sum(-1)
    _, best_groups = jax.lax.top_k(group_scores, config.topk_group)
    group_mask = jnp.zeros((num_tokens, groups), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
    expert_mask = jnp.repeat(group_mask, num_experts // groups, axis=1)
    _, ids = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Forward


def kv_cache_spec(config: ModelConfig, dtype: str) -> MlaKvCacheSpec:
    return mla_cache_spec(config, dtype)


def _mlp(x: jax.Array, p: dict, precision: Optional[jax.lax.Precision]) -> jax.Array:
    gate = jnp.einsum("th,hi->ti", x, p["gate"], precision=precision)
    up = jnp.einsum("th,hi->ti", x, p["up"], precision=precision)
    return jnp.einsum("ti,ih->th", jax.nn.silu(gate) * up, p["down"], precision=precision)


def _backends(config: ModelConfig, attention_fn: AttentionFn, moe_fn: MoeFn, mesh: Optional[jax.sharding.Mesh],
              dtype: Any) -> tuple[Callable, Callable, Callable, MoeFn]:
    """(expanded MHA attention, latent attention, latent write, MoE FFN); under a mesh in shard_map."""
    latent_fn = latent_backend(attention_fn)
    spec = mla_cache_spec(config, str(jnp.dtype(dtype)))
    if mesh is None:
        return attention_fn, latent_fn, spec.write, moe_fn
    from jaxllm.models.loader import rules_for

    rules = rules_for(config, mesh)
    latent_spec = spec.partition_spec(rules)
    mha_spec = MhaKvCacheSpec(1, config.num_heads, 1, "float32").partition_spec(rules)
    entry_spec = logical_to_physical(("tokens", None), rules)
    return (shard_attention(attention_fn, mesh, rules, mha_spec), shard_attention(latent_fn, mesh, rules, latent_spec),
            shard_kv_write(spec.write, mesh, rules, latent_spec, entry_spec), shard_moe(moe_fn, mesh, rules))


def decode_layers(params: dict, kv_cache: Any, batch: StepBatch, *, config: ModelConfig,
                  attention_fn: AttentionFn, moe_fn: MoeFn, mesh: Optional[jax.sharding.Mesh],
                  moe_options: Optional[EpMoeOptions]) -> tuple[jax.Array, Any, Optional[MoeStepStats]]:
    """Embedding and all decoder layers: the residual stream [T, H], the new cache, MoE stats.

    `kv_cache` is one latent page pool for all layers (`MlaKvCacheSpec.init_pool`; layer
    stacks, including the dense prefix's, run as scans) or a per-layer list (`scan_layers` off)."""
    from jaxllm.models.decoder import cache_geometry, layer_metadata, run_layers

    pool_blocks, tokens_per_block = cache_geometry(config, params, kv_cache)
    prec = matmul_precision(config)
    cache_dtype = jax.tree_util.tree_leaves(kv_cache)[0].dtype
    mha_fn, latent_fn, write_fn, sharded_moe_fn = _backends(config, attention_fn, moe_fn, mesh, cache_dtype)
    md = AttentionMetadata.from_batch(batch)
    x = params["embed"][batch.token_ids]
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(config), jnp.float32)
    factor = rope_attention_factor(config)
    cos, sin = (cos * factor).astype(x.dtype), (sin * factor).astype(x.dtype)
    num_tokens = batch.token_ids.shape[0]
    num_valid = batch.cu_q_lens[batch.num_seqs[0]]
    valid = jnp.arange(num_tokens, dtype=jnp.int32) < num_valid
    decode_only = num_valid == batch.num_seqs[0]

    def layer_fn(x: jax.Array, layer: dict, cache: Any, index: jax.Array | int
                 ) -> tuple[jax.Array, Any, Optional[jax.Array], Optional[jax.Array]]:
        layer_md = md if pool_blocks is None else layer_metadata(md, index, pool_blocks, tokens_per_block,
                                                                 config.num_layers)
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        h, cache = mla_attention(h, layer["attn"], cache, layer_md, cos, sin, config=config, mha_fn=mha_fn,
                                 latent_fn=latent_fn, write_fn=write_fn, decode_only=decode_only, precision=prec)
        x = x + h
        h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        if "moe" not in layer:  # the dense prefix (first_k_dense_replace)
            return x + _mlp(h, layer["mlp"], prec), cache, None, None
        if "slots" in layer["moe"]:
            from sharding.ep_moe import EpMoeOptions, ep_moe_block
            from jaxllm.models.loader import rules_for

            ep_mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
            y, layer_counts, layer_dropped = ep_moe_block(
                h, layer["moe"], config=config, moe_fn=moe_fn, mesh=ep_mesh, rules=rules_for(config, ep_mesh),
                options=moe_options or EpMoeOptions(), valid=valid)
        else:
            if mesh is not None and expert_parallel_size(mesh) > 1:
                raise ValueError(f"layer {index}: an expert-parallel mesh needs the experts loaded as slots "
                                 "(load_params with the same mesh)")
            y, ids = moe_block(h, layer["moe"], config=config, moe_fn=sharded_moe_fn, valid=valid)
            layer_counts, layer_dropped = count_experts(ids, config.num_experts, valid), jnp.zeros((), jnp.int32)
        if config.n_shared_experts:
            y = y + _mlp(h, layer["shared"], prec)
        return x + y, cache, layer_counts, layer_dropped

    return run_layers(params, kv_cache, x, config, layer_fn)
