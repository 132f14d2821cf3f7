"""Per-device memory of a model layout, from the weight declaration alone (no weights read).

The bytes each device holds of every parameter follow from the same declaration, sharding
rules and scale placement the loader uses (`declare_weights`, `model_rules`,
`logical_to_physical`, `scale_spec`), so the plan equals what the engine allocates; the
KV cache tokens that fit are the configured fraction of what the weights leave free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from jaxllm.models.kv_cache_spec import kv_cache_spec
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.partitioning import check_quantized_split
from jaxllm.models.quantization import scale_spec
from jaxllm.models.weights import WeightDecl, declare_weights
from sharding.mesh import ATTN_DP_AXIS, EXPERT_AXIS, TENSOR_AXIS, ParallelConfig
from sharding.rules import kv_head_replicas, logical_to_physical, model_rules
from sharding.slot_table import resolve_assignments

# Device memory as nvidia-smi reports it (MiB): H100 SXM 80GB, H200 141GB.
GPU_MEMORY_BYTES = {"h100": 81559 * 2**20, "h200": 143771 * 2**20}
KINDS = (
    "embedding + LM head",
    "attention",
    "dense MLP",
    "shared experts",
    "routed experts",
    "router",
    "norms + biases",
)


@dataclass
class MemoryPlan:
    """Bytes on the most loaded device, by kind of weight, and the KV cache that fits beside them."""

    parallel: ParallelConfig
    weight_bytes: dict[str, int] = field(default_factory=dict)  # kind -> bytes per device
    scale_bytes: int = 0  # of which quantization scales
    kv_bytes_per_token: int = 0  # per device
    device_bytes: Optional[int] = None
    free_memory_fraction: float = 0.9
    num_devices: int = 1

    @property
    def weights_per_device(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache the configured fraction of the memory left after the weights holds."""
        if self.device_bytes is None or self.kv_bytes_per_token == 0:
            return 0
        free = self.device_bytes - self.weights_per_device
        return max(0, int(self.free_memory_fraction * free) // self.kv_bytes_per_token)


def weight_kind(decl: WeightDecl) -> str:
    path = decl.path
    if path[0] in ("embed", "lm_head"):
        return "embedding + LM head"
    leaf = path[-1]
    if decl.init in ("norm", "bias") or leaf.endswith(("_norm", "_bias")) or leaf in ("final_norm",):
        return "norms + biases"
    group = path[2] if len(path) > 3 else ""
    if leaf == "router":
        return "router"
    return {"attn": "attention", "mlp": "dense MLP", "shared": "shared experts", "moe": "routed experts"}.get(
        group, "norms + biases"
    )


def shard_shape(shape: Sequence[int], spec: Any, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """The largest piece of `shape` one device holds under PartitionSpec `spec`."""
    out = []
    for n, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        ranks = int(np.prod([mesh_shape[a] for a in names], dtype=np.int64))
        out.append(-(-int(n) // ranks))
    return tuple(out)


def device_bytes_of(decl: WeightDecl, dtype: Any, rules: Any, mesh_shape: Mapping[str, int]) -> tuple[int, int]:
    """(bytes, of which scales) of `decl` on one device."""
    spec = logical_to_physical(decl.axes, rules)
    shard = shard_shape(decl.shape, spec, mesh_shape)
    if decl.quant is None:
        return math.prod(shard) * decl.param_dtype(dtype).itemsize, 0
    scales = sum(
        math.prod(shard_shape(shape, scale_spec(spec, shape, mesh_shape), mesh_shape)) * dtype.itemsize
        for shape, dtype in decl.quant.block_arrays(decl.shape).values()
    )  # scales, offsets and super-block scales, each in its own dtype
    values = math.prod(shard) * decl.quant.value_dtype().itemsize
    return (values // 2 if decl.quant.packed else values) + scales, scales


def plan_memory(
    config: ModelConfig,
    parallel: ParallelConfig,
    *,
    kv_dtype: Any = None,
    device_bytes: Optional[int] = None,
    free_memory_fraction: float = 0.9,
    num_slots: Optional[int] = None,
) -> MemoryPlan:
    """The per-device weight bytes of `config` split as `parallel` says (experts as slots under
    expert parallelism, `num_slots` of them), and the KV tokens that fit in `device_bytes`."""
    tp, ep = parallel.tensor_parallel_size, parallel.moe_expert_parallel_size or 1
    check_quantized_split(config, tp // ep)
    mesh_shape = {ATTN_DP_AXIS: 1, EXPERT_AXIS: ep, TENSOR_AXIS: tp // ep}
    rules = model_rules(
        tensor_parallel_size=tp,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        vocab_size=config.vocab_size,
        expert_parallel_size=ep,
    )
    replicas = kv_head_replicas(config.num_kv_heads, tp)
    assignments = None
    if config.num_experts and (ep > 1 or num_slots):
        moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        assignments = resolve_assignments(config.num_experts, moe_layers, ep, None, num_slots)
    plan = MemoryPlan(
        parallel,
        {k: 0 for k in KINDS},
        device_bytes=device_bytes,
        free_memory_fraction=free_memory_fraction,
        num_devices=tp,
    )
    for decl in declare_weights(config, replicas, assignments):
        nbytes, scales = device_bytes_of(decl, config.dtype, rules, mesh_shape)
        plan.weight_bytes[weight_kind(decl)] += nbytes
        plan.scale_bytes += scales
    # The engine's KV pool is sized by the same spec (`kv_cache_bytes_per_token`); None: the
    # config's KV cache dtype (float8_e4m3fn for an FP8 KV cache).
    spec = kv_cache_spec(config, kv_dtype, 1 if config.is_mla else replicas)
    plan.kv_bytes_per_token = spec.bytes_per_token(1 if config.is_mla else tp)
    plan.weight_bytes = {k: v for k, v in plan.weight_bytes.items() if v}
    return plan
