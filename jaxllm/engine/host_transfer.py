"""Move a step's many small host arrays to the device in one transfer per dtype.

A step has ~20 small inputs (token ids, positions, block tables, sampling parameters...).
Transferring them one by one costs a fixed overhead each, which dominates host time at
small batch sizes, so the host packs them into one flat buffer per dtype and the
compiled program slices them back out with static offsets. The layout (shapes, offsets and
the pytree structure, which carries the sampler's static switches) is hashable and keys
the compiled programs of `ModelRunner`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class PackedLayout:
    treedef: Any
    dtypes: tuple[str, ...]  # one flat buffer per dtype, in this order
    leaves: tuple[tuple[int, int, tuple[int, ...]], ...]  # (buffer index, offset, shape) per leaf


def pack(tree: Any) -> tuple[tuple[np.ndarray, ...], PackedLayout]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    dtypes = tuple(sorted({a.dtype.str for a in arrays}))
    sizes = {d: 0 for d in dtypes}
    placement = []
    for a in arrays:
        placement.append((dtypes.index(a.dtype.str), sizes[a.dtype.str], a.shape))
        sizes[a.dtype.str] += a.size
    buffers = tuple(np.empty(sizes[d], np.dtype(d)) for d in dtypes)
    for a, (b, offset, _) in zip(arrays, placement):
        buffers[b][offset:offset + a.size] = a.ravel()
    return buffers, PackedLayout(treedef, dtypes, tuple(placement))


def unpack(buffers: tuple[jax.Array, ...], layout: PackedLayout) -> Any:
    leaves = [jax.lax.slice_in_dim(buffers[b], offset, offset + int(np.prod(shape, dtype=np.int64))).reshape(shape)
              for b, offset, shape in layout.leaves]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def put_on_mesh(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """Host arrays (the same on every process) onto `sharding`. In a multi-process run
    `jax.device_put` first checks with a collective that every process passes equal data: a
    gather of the step's inputs each step, and a deadlock when only the leader puts (warm-up
    compiles). Here each process puts just its own devices' pieces."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda a: jax.make_array_from_callback(np.shape(a), sharding, lambda index: np.asarray(a)[index]), tree)
