"""How many devices each parallel dimension uses, and the device mesh built from it.

The mesh always has the same three named axes, so code that names an axis never has to
ask whether that dimension is in use: an unused dimension is an axis of size 1.

    attn_dp  data parallelism over groups of devices (reserved: size 1). Attention data
             parallelism over the N devices (`enable_attention_dp`) needs no axis of its
             own: its ranks are the expert x tensor devices (`sharding.dp_ranks`)
    expert   expert parallelism: MoE slots spread over E ranks
    tensor   MoE tensor parallelism: each expert's FFN columns split over T ranks

Sizes follow TensorRT-LLM's LLM API: `tensor_parallel_size` N is the number of devices
the model runs on; attention and dense layers are tensor-parallel over all N (the
`expert` and `tensor` axes together), while the MoE layers use E * T == N as expert x
expert-column parallelism. With E = 1 (the default) the mesh is (1, 1, N): plain TP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np

ATTN_DP_AXIS = "attn_dp"
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
MESH_AXES = (ATTN_DP_AXIS, EXPERT_AXIS, TENSOR_AXIS)


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions (TensorRT-LLM's `Mapping` semantics).

    `tensor_parallel_size` (N) is the device count. `moe_expert_parallel_size` (E) and
    `moe_tensor_parallel_size` (T) split the MoE layers, with E * T == N; when neither is
    given T = N and E = 1 (as TensorRT-LLM derives them), when one is given the other is
    N divided by it. `enable_attention_dp` runs attention data-parallel (each device its
    own requests and KV cache) instead of tensor-parallel.
    """

    tensor_parallel_size: int = 1
    moe_expert_parallel_size: Optional[int] = None
    moe_tensor_parallel_size: Optional[int] = None
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        n, ep, mtp = self.tensor_parallel_size, self.moe_expert_parallel_size, self.moe_tensor_parallel_size
        for name, value in (("moe_expert_parallel_size", ep), ("moe_tensor_parallel_size", mtp)):
            if value is not None and value != -1:  # -1: derive (TensorRT-LLM's spelling)
                _check_positive(name, value)
        ep = None if ep == -1 else ep
        mtp = None if mtp == -1 else mtp
        if ep is None:
            if mtp is None:
                ep, mtp = 1, n
            else:
                if n % mtp:
                    raise ValueError(f"moe_tensor_parallel_size={mtp} must divide tensor_parallel_size={n}")
                ep = n // mtp
        elif mtp is None:
            if n % ep:
                raise ValueError(f"moe_expert_parallel_size={ep} must divide tensor_parallel_size={n}")
            mtp = n // ep
        if ep * mtp != n:
            raise ValueError(
                f"moe_expert_parallel_size * moe_tensor_parallel_size must equal tensor_parallel_size: "
                f"{ep} * {mtp} != {n}"
            )
        if not isinstance(self.enable_attention_dp, bool):
            raise ValueError(f"enable_attention_dp must be a bool, got {self.enable_attention_dp!r}")
        object.__setattr__(self, "moe_expert_parallel_size", ep)
        object.__setattr__(self, "moe_tensor_parallel_size", mtp)

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        ep, mtp = self.moe_expert_parallel_size, self.moe_tensor_parallel_size
        if ep is None or mtp is None:
            raise AssertionError("__post_init__ resolves both MoE sizes")
        return (1, ep, mtp)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def make_mesh(parallel: ParallelConfig, devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
    """A mesh over the first `parallel.num_devices` devices with the axes of `MESH_AXES`."""
    available = list(jax.devices() if devices is None else devices)
    if parallel.num_devices > len(available):
        raise ValueError(
            f"the parallel configuration needs {parallel.num_devices} devices "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}); {len(available)} available"
        )
    from sharding.multihost import check_mesh_devices

    check_mesh_devices(available[: parallel.num_devices])
    grid = np.asarray(available[: parallel.num_devices], dtype=object).reshape(parallel.mesh_shape)
    return jax.sharding.Mesh(grid, MESH_AXES)


def tensor_parallel_size(mesh: jax.sharding.Mesh) -> int:
    """Devices attention and dense layers are split over (the `expert` and `tensor` axes)."""
    return int(mesh.shape[EXPERT_AXIS]) * int(mesh.shape[TENSOR_AXIS])


def expert_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return int(mesh.shape[EXPERT_AXIS])


def moe_tensor_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return int(mesh.shape[TENSOR_AXIS])
