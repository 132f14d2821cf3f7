"""Attention data parallelism's ranks on the mesh: every device of the `expert` x `tensor`
axes (E x T, rank d = e * T + t) is one rank, and per-rank arrays carry a leading rank
axis split over those devices (the step's inputs, each rank's KV block pool). The forward
that runs on them is `jaxllm.models.parallel.attention_dp`."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from sharding.mesh import EXPERT_AXIS, TENSOR_AXIS

DP_AXES = (EXPERT_AXIS, TENSOR_AXIS)
"""The mesh axes whose devices are the attention-DP ranks (rank = expert index * T + tensor index)."""
RANK_SPEC = P(DP_AXES)


def attention_dp_size(mesh: jax.sharding.Mesh) -> int:
    return int(mesh.shape[EXPERT_AXIS]) * int(mesh.shape[TENSOR_AXIS])
