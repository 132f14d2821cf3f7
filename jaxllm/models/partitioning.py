"""A model's default sharding rules on a mesh: which logical axes of its weights and caches
split over which mesh axes (`sharding.rules` maps them), checked against the model's sizes."""

from __future__ import annotations

import math

import jax

from jaxllm.models.model_config import ModelConfig
from sharding.mesh import EXPERT_AXIS, TENSOR_AXIS, expert_parallel_size, tensor_parallel_size
from sharding.rules import ShardingRules, kv_head_replicas, model_rules


def rules_for(config: ModelConfig, mesh: jax.sharding.Mesh) -> ShardingRules:
    """The default sharding rules of `config` on `mesh` (checks the split sizes divide)."""
    check_quantized_split(config, int(mesh.shape[TENSOR_AXIS]))
    return model_rules(
        tensor_parallel_size=tensor_parallel_size(mesh),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        vocab_size=config.vocab_size,
        expert_parallel_size=expert_parallel_size(mesh),
    )


def check_quantized_split(config: ModelConfig, moe_tp: int) -> None:
    """With FP8 activations quantized per group of 128, each expert's FFN columns on one device
    must be whole groups: the grouped FFN quantizes its device's share of the hidden activations."""
    q = config.quantization
    if q is None or q.activation_group <= 0 or moe_tp <= 1 or not config.moe_intermediate_size:
        return
    share = config.moe_intermediate_size // moe_tp
    if share % q.activation_group:
        raise ValueError(
            f"FP8 dynamic activations: moe_intermediate_size={config.moe_intermediate_size} over "
            f"{moe_tp} MoE tensor-parallel ranks leaves {share} columns per rank, not a multiple of "
            f"{q.activation_group}; use more expert parallelism or fp8_activation_scheme='none'"
        )


def kv_replicas_for(config: ModelConfig, mesh: jax.sharding.Mesh, rules: ShardingRules | None = None) -> int:
    """Copies of each KV head in the k/v weights: none when `rules` keep the KV heads whole
    (attention data parallelism), else as tensor parallelism over the mesh needs."""
    if rules is not None and rules.kv_heads is None:
        return 1
    return kv_head_replicas(config.num_kv_heads, tensor_parallel_size(mesh))


def attention_dp_rules(config: ModelConfig, mesh: jax.sharding.Mesh) -> ShardingRules:
    """Weights under attention DP: everything but the experts replicated; slots over
    `expert`, each expert's FFN columns over `tensor`."""
    moe_tp = int(mesh.shape[TENSOR_AXIS])
    if config.moe_intermediate_size and config.moe_intermediate_size % moe_tp:
        raise ValueError(
            f"the MoE tensor-parallel size {moe_tp} must divide moe_intermediate_size={config.moe_intermediate_size}"
        )
    check_quantized_split(config, moe_tp)
    check_dp_expert_blocks(config, moe_tp)
    return ShardingRules(
        heads=None,
        kv_heads=None,
        mlp=None,
        vocab=None,
        experts=EXPERT_AXIS if int(mesh.shape[EXPERT_AXIS]) > 1 else None,
        moe_mlp=TENSOR_AXIS if moe_tp > 1 else None,
    )


def check_dp_expert_blocks(config: ModelConfig, moe_tp: int) -> None:
    """The attention-DP MoE layer dequantizes each device's own share of the quantized experts
    inside the step, so each `tensor` rank's FFN columns must be whole scale blocks of every
    expert weight (K-quants: of super-blocks too; and whole bytes of 4-bit values packed two to a byte)."""
    q = config.quantization
    if q is None or moe_tp <= 1 or not config.moe_intermediate_size:
        return
    h, i = config.hidden_size, config.moe_intermediate_size
    step = 1
    for fmt in q.formats():  # a mixed GGUF file: every format its experts may be held in
        packed = 2 if fmt.value_dtype in ("int4", "uint4") else 1
        # gate/up rows, down columns
        step = math.lcm(step, fmt.block_for(i, h)[0] or i, fmt.block_for(h, i)[1] or i, fmt.super_block or 1, packed)
    share = i // moe_tp
    if share % step:
        raise ValueError(
            f"enable_attention_dp: moe_intermediate_size={i} over {moe_tp} MoE tensor-parallel ranks leaves "
            f"{share} columns per rank, not whole quantization blocks of {step}; use more expert parallelism"
        )
