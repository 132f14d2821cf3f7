"""Device mesh, logical-axis sharding rules and shard_map wrappers for kernel backends."""

from sharding.mesh import MESH_AXES, TENSOR_AXIS, ParallelConfig, make_mesh, tensor_parallel_size
from sharding.rules import ShardingRules, kv_head_replicas, logical_to_physical, model_rules, named_sharding

__all__ = [
    "MESH_AXES",
    "TENSOR_AXIS",
    "ParallelConfig",
    "ShardingRules",
    "kv_head_replicas",
    "logical_to_physical",
    "make_mesh",
    "model_rules",
    "named_sharding",
    "tensor_parallel_size",
]
