"""What a decode step must read and compute: the numerators of model-bandwidth utilisation
(MBU) and FLOP utilisation in the engine section.

From the one weight declaration (`jaxllm.models.weights.declare_weights`), for a decode step
of T tokens (one per sequence) over sequences holding C cached tokens in all:

    bytes(T, C) = dense + T * embed_row + sum over MoE layers of A(T) * expert + C * kv_token
        dense      every weight every token passes through, read once per step: attention,
                   dense MLPs, norms, routers, shared experts, the LM head (the embedding too
                   when tied, as the LM head)
        embed_row  one embedding row (an untied table is gathered, not read whole)
        expert     one routed expert of a layer (gate + up + down)
        A(T)       routed experts the step's tokens activate, expected value under uniform
                   random routing of top-k of E: A(T) = E * (1 - (1 - k/E)^T)
        kv_token   KV cache bytes of one token over all layers
    flops(T, C) = 2 * T * (dense matmul params + k * expert params per MoE layer) + attention
        attention  per layer 2 * Hq * (Dqk + Dv) * C (q.k and p.v over every cached token;
                   MLA: Dqk = latent + rope width, Dv = latent width, the absorbed form)

    MBU             = bytes / device step time / measured copy bandwidth
    FLOP utilisation = flops / device step time / measured bf16 dense matmul rate

Device step time is the device's busy time for the step (`engine_run`); the ceilings are
the environment section's measurements (`jaxllm.bench.kernels.measure_ceilings`), not the
datasheet (an H200's datasheet says 4.8 TB/s and 989 dense bf16 TFLOP/s). Random routing is
what random weights give; trained routers are less uniform, which lowers A(T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.models.kv_cache_spec import kv_cache_bytes_per_token
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.weights import declare_weights

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class StepRoofline:
    """A model's per-step byte and FLOP counts (see the module docstring)."""

    dense_bytes: int
    embed_row_bytes: int
    expert_bytes: int  # one routed expert of one MoE layer
    moe_layers: int
    num_experts: int
    top_k: int
    dense_matmul_params: int
    expert_params: int  # one routed expert's matmul parameters
    kv_bytes_per_token: int
    attention_flops_per_kv_token: int  # over all layers, per cached token a query attends
    weight_bytes: int  # every declared weight once

    def active_experts(self, tokens: float) -> float:
        """Expected routed experts per MoE layer a step of `tokens` tokens reads."""
        if not self.num_experts or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def decode_bytes(self, tokens: float, kv_tokens: float) -> float:
        experts = self.moe_layers * self.active_experts(tokens) * self.expert_bytes
        return self.dense_bytes + tokens * self.embed_row_bytes + experts + kv_tokens * self.kv_bytes_per_token

    def decode_flops(self, tokens: float, kv_tokens: float) -> float:
        per_token = self.dense_matmul_params + self.moe_layers * self.top_k * self.expert_params
        return 2.0 * tokens * per_token + kv_tokens * self.attention_flops_per_kv_token


def _attention_flops_per_kv_token(config: ModelConfig) -> int:
    if config.is_mla:
        latent = int(config.kv_lora_rank or 0)
        return config.num_layers * 2 * config.num_heads * (latent + int(config.qk_rope_head_dim or 0) + latent)
    return config.num_layers * 2 * config.num_heads * 2 * config.head_dim


def step_roofline(config: ModelConfig, dtype: Any = None) -> StepRoofline:
    """The counts for `config` with weights stored in `dtype` (default: the config's)."""
    model_dtype = numpy_dtype(dtype or config.dtype)
    dense = embed_row = expert_total = 0
    dense_params = expert_params_total = 0
    weight_bytes = 0
    for decl in declare_weights(config):
        nbytes = decl.nbytes(model_dtype)
        weight_bytes += nbytes
        size = int(np.prod(decl.shape))
        if decl.path[0] == "embed":
            embed_row = nbytes // decl.shape[0]
            if config.tie_word_embeddings:  # the LM head reads the whole table
                dense += nbytes
                dense_params += size
        elif len(decl.path) >= 2 and decl.path[-2] == "moe" and decl.path[-1] in _EXPERT_WEIGHTS:
            expert_total += nbytes
            expert_params_total += size
        else:
            dense += nbytes
            if len(decl.shape) >= 2:
                dense_params += size
    moe_layers = sum(1 for i in range(config.num_layers) if config.is_moe_layer(i))
    per_layer_experts = max(1, moe_layers * (config.num_experts or 1))
    return StepRoofline(
        dense_bytes=dense,
        embed_row_bytes=embed_row,
        expert_bytes=expert_total // per_layer_experts if moe_layers else 0,
        moe_layers=moe_layers,
        num_experts=int(config.num_experts or 0),
        top_k=int(config.num_experts_per_tok or 0),
        dense_matmul_params=dense_params,
        expert_params=expert_params_total // per_layer_experts if moe_layers else 0,
        kv_bytes_per_token=kv_cache_bytes_per_token(config, model_dtype),
        attention_flops_per_kv_token=_attention_flops_per_kv_token(config),
        weight_bytes=weight_bytes,
    )


def utilisation(amount: float, seconds: float, ceiling: float) -> float:
    """amount / seconds / ceiling (NaN when the time is not positive)."""
    return amount / seconds / ceiling if seconds > 0 else float("nan")
