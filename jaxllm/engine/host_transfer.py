"""Move a step's many small host arrays to the device in one transfer.

A step has ~20 small inputs (token ids, positions, block tables, sampling parameters...).
Each array handed to the runtime costs a fixed overhead (about 0.1 ms of host time on a
busy CPU), which dominates host time at small batch sizes, so the host packs them into
one flat 32-bit buffer (float32 and uint32 leaves keep their bits, booleans become 0/1)
and the compiled program slices them back out with static offsets and reinterprets them.
The layout (shapes, dtypes, offsets and the pytree structure, which carries the
sampler's static switches) is hashable and keys the compiled programs of `ModelRunner`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

_WORD = np.dtype(np.int32)
_BOOL = np.dtype(np.bool_)


@dataclass(frozen=True)
class PackedLayout:
    treedef: Any
    dtypes: tuple[str, ...]  # the packed buffers' dtypes (one 32-bit word buffer)
    leaves: tuple[tuple[str, int, tuple[int, ...]], ...]  # (dtype, offset in words, shape) per leaf

    def __hash__(self) -> int:
        # Computed once: a layout keys the runner's compiled programs, looked up every step.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.treedef, self.dtypes, self.leaves))
            object.__setattr__(self, "_hash", cached)
        return cached


# (treedef, (dtype, shape) per leaf) -> (layout, which leaves are reinterpreted as int32 words or
# None): the layouts a process packs are few (one per compiled program), so each is built once.
_known_layouts: dict[tuple, tuple[PackedLayout, Optional[tuple[bool, ...]]]] = {}


def _layout(treedef: Any, arrays: list[np.ndarray]) -> tuple[PackedLayout, Optional[tuple[bool, ...]]]:
    placement = []
    views = []
    size = 0
    for a in arrays:
        if a.dtype.itemsize != 4 and a.dtype != _BOOL:
            raise TypeError(f"cannot pack a {a.dtype} input: step inputs are 32-bit numbers or booleans")
        placement.append((a.dtype.str, size, a.shape))
        views.append(a.dtype.itemsize == 4 and a.dtype != _WORD)
        size += a.size
    return PackedLayout(treedef, (_WORD.str,), tuple(placement)), (tuple(views) if any(views) else None)


def pack(tree: Any) -> tuple[tuple[np.ndarray, ...], PackedLayout]:
    """One int32 buffer holding every leaf of `tree` (32-bit dtypes and booleans), newly
    allocated per call (the runtime may read it after this returns). Every step packs its
    inputs, so the per-leaf Python work is kept to a reshape: the layout is looked up, and
    the copy is one `np.concatenate` (booleans cast to 0/1, other 32-bit dtypes as words)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    key = (treedef, *[(a.dtype, a.shape) for a in arrays])
    known = _known_layouts.get(key)
    if known is None:
        known = _known_layouts.setdefault(key, _layout(treedef, arrays))
    layout, views = known
    flats = [a.reshape(-1) for a in arrays]
    if views is not None:
        flats = [flat.view(_WORD) if view else flat for flat, view in zip(flats, views)]
    buffer = np.concatenate(flats, dtype=_WORD) if flats else np.empty(0, _WORD)
    return (buffer,), layout


class RepeatPacker:
    """`pack` for a stream of trees that repeat most of their leaves: a steady decode batch's
    sampling tensors differ from one step to the next in `step` only. When every leaf but a
    few is the same object as in the last call, the last buffer is copied and only the new
    leaves are written. The caller never writes a leaf after packing it (so the same object
    holds the same values); a tree with other leaves is packed in full."""

    def __init__(self, max_changed: int = 2) -> None:
        self.max_changed = max_changed
        self._last: Optional[tuple[list, Any, np.ndarray, PackedLayout]] = None  # leaves, treedef, buffer, layout

    def pack(self, tree: Any) -> tuple[tuple[np.ndarray, ...], PackedLayout]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        last = self._last
        if last is not None and len(leaves) == len(last[0]) and treedef == last[1]:
            changed = [i for i, (new, old) in enumerate(zip(leaves, last[0])) if new is not old]
            layout = last[3]
            if len(changed) <= self.max_changed and all(
                np.shape(leaves[i]) == layout.leaves[i][2] and np.asarray(leaves[i]).dtype.str == layout.leaves[i][0]
                for i in changed
            ):
                buffer = last[2].copy()
                for i in changed:
                    _, offset, _ = layout.leaves[i]
                    flat = np.asarray(leaves[i]).reshape(-1)
                    buffer[offset : offset + flat.size] = (
                        flat if flat.dtype == _BOOL or flat.dtype == _WORD else flat.view(_WORD)
                    )
                self._last = (leaves, treedef, buffer, layout)
                return (buffer,), layout
        (buffer,), layout = pack(tree)
        self._last = (leaves, treedef, buffer, layout)
        return (buffer,), layout


def unpack(buffers: tuple[jax.Array, ...], layout: PackedLayout) -> Any:
    (buffer,) = buffers
    leaves = []
    for dtype, offset, shape in layout.leaves:
        x = jax.lax.slice_in_dim(buffer, offset, offset + int(np.prod(shape, dtype=np.int64))).reshape(shape)
        dt = np.dtype(dtype)
        if dt == _BOOL:
            x = x != 0
        elif dt != _WORD:
            x = jax.lax.bitcast_convert_type(x, dt)
        leaves.append(x)
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def put_on_mesh(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """Host arrays (the same on every process) onto `sharding`. In a multi-process run
    `jax.device_put` first checks with a collective that every process passes equal data: a
    gather of the step's inputs each step, and a deadlock when only the leader puts (warm-up
    compiles). Here each process puts just its own devices' pieces."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda a: jax.make_array_from_callback(np.shape(a), sharding, lambda index: np.asarray(a)[index]), tree
    )
