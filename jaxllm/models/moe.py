"""Mixture-of-experts layer: routing, sort by expert, grouped FFN, unsort, weighted combine.

The pieces stay separate so they can be rearranged: `route_topk` gives each token its
top-k ids and weights; `grouped_expert_ffn` takes ids as they should address the
stacked weights (an expert-parallel layout maps ExpertIds to SlotIds in between, see
`jaxllm.models.ep_moe`) and calls `moe_fn(x_sorted, group_sizes, w_gate, w_up, w_down)`, the
grouped GEMM backend; `expert_rows_ffn` and `combine` are its two halves, which the
expert-parallel layer runs on different devices. A backend whose `moe_fn` carries a
`fused` attribute (`fused(x, ids, weights, w_gate, w_up, w_down) -> [T, H]`, the Pallas
kernel that gathers the token rows and applies the routing weights itself) replaces
the sort, unsort and combine here (under tensor parallelism too, `sharding.kernels.shard_moe`;
the expert-parallel layer keeps the sorted-rows path). One carrying `fused_fp8` (the same with
e4m3 expert weights and their block scales, `+ block=`) takes FP8 experts as they are stored
(the expert-parallel layer too, row by row: `fp8_expert_rows_ffn`); without it they are
dequantized first (`expert_operands`). `fused_fp8_dynamic` (same call) multiplies e4m3
activations too, for layers whose activations are quantized per 128-group (`fp8_experts_fn`).
Shapes are static: every (token, k) pair is one row, M = T * top_k; padding tokens are
sorted past the last group so the backend sees them as padding rows and skips them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.quantization import act_quant, dense, is_quantized
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled

MoeFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def route_topk(router_logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts, keep the top k (optionally renormalised to sum to 1).

    Returns (weights float32 [T, k], expert ids int32 [T, k]). With renormalisation this
    equals Mixtral's softmax over the top-k logits.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def sort_by_expert(ids: jax.Array, num_groups: int, valid: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """Order of the flattened (token, k) rows grouped by id, and the row count of each group.

    Rows of invalid tokens get the id `num_groups`, so they sort last and are not counted.
    """
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, num_groups)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_groups).astype(jnp.int32)
    return order, group_sizes


def expert_rows_ffn(
    x: jax.Array,
    ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    moe_fn: MoeFn,
    rows_per_token: int = 1,
) -> jax.Array:
    """FFN_{ids[r]}(x[r // rows_per_token]) for every row r of `ids` (flat int32[R]), in row order.

    Rows with id >= the number of weight groups are padding and come out as zeros.
    """
    order, group_sizes = sort_by_expert(ids.reshape(-1, 1), w_gate.shape[0])
    y_sorted = moe_fn(x[order // rows_per_token], group_sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)


def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
    """float32 sum_k weights[t, k] * y[t * top_k + k] for expert outputs y [T * top_k, H]."""
    num_tokens, top_k = weights.shape
    return jnp.einsum("tkh,tk->th", y.reshape(num_tokens, top_k, -1).astype(jnp.float32), weights.astype(jnp.float32))


def grouped_expert_ffn(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    moe_fn: MoeFn,
    valid: Optional[jax.Array] = None,
) -> jax.Array:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); the combine runs in float32."""
    num_groups = w_gate.shape[0]
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, num_groups)
        weights = jnp.where(valid[:, None], weights, 0.0)
    fused = getattr(moe_fn, "fused", None)
    if fused is not None:
        return fused(x, ids, weights, w_gate, w_up, w_down).astype(x.dtype)
    y = expert_rows_ffn(x, ids.reshape(-1), w_gate, w_up, w_down, moe_fn=moe_fn, rows_per_token=ids.shape[1])
    return combine(y, weights).astype(x.dtype)


def route(x: jax.Array, router: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The softmax router of one layer: (weights float32 [T, k], expert ids int32 [T, k])."""
    router_logits = jnp.einsum("th,he->te", x, router, preferred_element_type=jnp.float32)
    return route_topk(router_logits, config.num_experts_per_tok, config.norm_topk_prob)


def route_grouped_sigmoid(
    router_logits: jax.Array, correction_bias: jax.Array, config: ModelConfig
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


def route_layer(x: jax.Array, p: dict, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The router of a MoE layer's params `p`: softmax top-k, or DeepSeek-V3's grouped sigmoid
    routing with its correction bias (`route_grouped_sigmoid`), whose router runs in float32."""
    if config.scoring_func != "sigmoid":
        return route(x, p["router"], config)
    router_logits = jnp.einsum(
        "th,he->te", x.astype(jnp.float32), p["router"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return route_grouped_sigmoid(router_logits, p["router_bias"], config)


def moe_block(
    x: jax.Array, p: dict, *, config: ModelConfig, moe_fn: MoeFn, valid: Optional[jax.Array] = None
) -> tuple[jax.Array, jax.Array]:
    """The sparse FFN of one layer and the router's expert ids [T, k].
    p: router [H, E], w_gate/w_up [E, H, I], w_down [E, I, H]."""
    weights, ids = route_layer(x, p, config)
    fused_fp8 = fp8_experts_fn(moe_fn, p)
    if fused_fp8 is not None:
        # The backend's FP8 grouped FFN reads the e4m3 experts and their block scales itself.
        xq, experts, block = fp8_expert_operands(x, p, fused_fp8)
        if valid is not None:
            ids = jnp.where(valid[:, None], ids, experts[0].shape[0])
            weights = jnp.where(valid[:, None], weights, 0.0)
        out = fused_fp8(xq, ids, weights, *experts, block=block)
        return out.astype(x.dtype), ids
    xq, w_gate, w_up, w_down = expert_operands(x, p)
    out = grouped_expert_ffn(xq, ids, weights, w_gate, w_up, w_down, moe_fn=moe_fn, valid=valid)
    return out.astype(x.dtype), ids


def takes_fp8_experts(p: dict) -> bool:
    """The layer's experts are FP8 with one scale block shape the FP8 grouped kernel takes
    (its 64-deep K steps inside one block: DeepSeek's 128 x 128, or per channel)."""
    ws = [p[n] for n in ("w_gate", "w_up", "w_down")]
    return all(
        is_quantized(w)
        and not w.packed
        and w.value.dtype == jnp.float8_e4m3fn
        and w.value.ndim == 3
        and len(w.blocks) == 3
        and w.blocks[-2:] == ws[0].blocks[-2:]
        and w.blocks[-2] % 64 == 0
        for w in ws
    )


def fp8_experts_fn(moe_fn: MoeFn, p: dict) -> Optional[Callable]:
    """The backend's FP8 grouped FFN for this layer's experts (`takes_fp8_experts`), or None:
    its `fused_fp8_dynamic` (e4m3 activations into the MMA: only for activations quantized
    per token-group of 128) where it has one and the weights ask for that, else `fused_fp8`."""
    if not takes_fp8_experts(p):
        return None
    dynamic = getattr(moe_fn, "fused_fp8_dynamic", None)
    if dynamic is not None and p["w_gate"].act_group == 128:
        return dynamic
    return getattr(moe_fn, "fused_fp8", None)


def fp8_expert_operands(
    x: jax.Array, p: dict, fused_fp8: Callable
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[int, int]]:
    """(x, experts, block) as the backend's `fused_fp8` takes them (`takes_fp8_experts(p)`):
    experts are the e4m3 w_gate, w_up, w_down values then their float32 block scales, and x
    is quantized per token-group when the weights ask for dynamic activations. The values come
    in the parameter's layout ([E, K, N]), or K-major ([E, N, K]) to a `fused_fp8` that reads
    them so (its `reads_k_major`): as stored when the engine stored them K-major, else
    transposed here, in the step."""
    ws = [p[n] for n in ("w_gate", "w_up", "w_down")]
    xq = act_quant(x, 1, ws[0].act_group) if ws[0].act_group else x
    if getattr(fused_fp8, "reads_k_major", False):
        values = tuple(w.value if w.k_major else jnp.swapaxes(w.value, -1, -2) for w in ws)
    else:
        values = tuple(w.param_value() for w in ws)
    return xq, (*values, *(w.scale for w in ws)), tuple(ws[0].blocks[-2:])


def fp8_expert_rows_ffn(
    x: jax.Array,
    ids: jax.Array,
    *experts: jax.Array,
    fused_fp8: Callable,
    block: tuple[int, int],
    rows_per_token: int = 1,
) -> jax.Array:
    """`expert_rows_ffn` on FP8 experts (`fp8_expert_operands`) through a backend's `fused_fp8`:
    each row is its own token with one expert and weight 1, so the kernel's combine leaves the
    rows apart; ids >= the number of weight groups are padding and come out as zeros."""
    flat = ids.reshape(-1, 1)
    rows = x if rows_per_token == 1 else x[jnp.arange(flat.shape[0]) // rows_per_token]
    return fused_fp8(rows, flat, jnp.ones(flat.shape, jnp.float32), *experts, block=block)


def quantized_moe_fn(moe_fn: MoeFn, config: ModelConfig) -> MoeFn:
    """`moe_fn` quantizing the experts' SwiGLU output before the down projection (per token-group,
    as the FP8 weights' dynamic activation scheme asks) where the backend takes a `hidden_fn`:
    the plain-XLA backends (the tiled `xla` one and the ragged_dot reference). The Pallas
    kernels run the down projection on the float hidden activations."""
    group = config.quantization.activation_group if config.quantization is not None else 0
    base = getattr(moe_fn, "func", moe_fn)
    if not group or base not in (moe_grouped_ffn_reference, moe_grouped_ffn_tiled):
        return moe_fn
    return functools.partial(moe_fn, hidden_fn=functools.partial(act_quant, num_contracted=1, group=group))


def expert_operands(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(x, w_gate, w_up, w_down) as the grouped FFN backends take them: FP8 expert weights
    dequantized here (the backends take float weights; `moe_block` hands FP8 experts to a
    backend's `fused_fp8` instead), and x
    quantized per token-group of 128 when the weights ask for dynamic activations."""
    w_gate = p["w_gate"]
    if is_quantized(w_gate) and w_gate.act_group:
        x = act_quant(x, 1, w_gate.act_group)
    return (x,) + tuple(dense(p[n], x.dtype) for n in ("w_gate", "w_up", "w_down"))  # type: ignore[return-value]
