"""How many devices each parallel dimension uses, and the device mesh built from it.

The mesh always has the same three named axes, so code that names an axis never has to
ask whether that dimension is in use: an unused dimension is an axis of size 1.

    attn_dp  attention data parallelism (each group of devices runs its own requests'
             attention; reserved: size 1 until the KV manager is split per group)
    expert   expert parallelism (experts spread over devices; reserved: size 1)
    tensor   tensor parallelism (heads, MLP columns, vocabulary split over devices)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import numpy as np

ATTN_DP_AXIS = "attn_dp"
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
MESH_AXES = (ATTN_DP_AXIS, EXPERT_AXIS, TENSOR_AXIS)


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions; their product is the number of devices used."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # reserved
    attention_data_parallel_size: int = 1  # reserved

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "attention_data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.expert_parallel_size != 1 or self.attention_data_parallel_size != 1:
            raise ValueError("expert_parallel_size and attention_data_parallel_size are reserved and must be 1")

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.expert_parallel_size * self.attention_data_parallel_size

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.attention_data_parallel_size, self.expert_parallel_size, self.tensor_parallel_size)


def make_mesh(parallel: ParallelConfig, devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
    """A mesh over the first `parallel.num_devices` devices with the axes of `MESH_AXES`."""
    available = list(jax.devices() if devices is None else devices)
    if parallel.num_devices > len(available):
        raise ValueError(f"the parallel configuration needs {parallel.num_devices} devices "
                         f"(tensor_parallel_size={parallel.tensor_parallel_size}); {len(available)} available")
    grid = np.asarray(available[:parallel.num_devices], dtype=object).reshape(parallel.mesh_shape)
    return jax.sharding.Mesh(grid, MESH_AXES)


def tensor_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return int(mesh.shape[TENSOR_AXIS])
