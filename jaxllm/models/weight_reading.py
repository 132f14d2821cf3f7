"""Reading one device's box of a declared parameter straight from checkpoint tensors.

A parameter (`jaxllm.models.weights.WeightDecl`) names the checkpoint tensors it can be read
from and the layout change that turns each into the parameter (`weight_layout.Layout`: a view,
a permutation, repeated KV heads, per-part sources). These functions read only the rows a box
needs, in the checkpoint's axis order, and leave the transpose to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from jaxllm.models.weight_layout import Source, view_groups
from jaxllm.models.weights import SliceReader, StackedDecl, WeightDecl


def read_source_view(
    src: Source, param_shape: tuple[int, ...], index: tuple[slice, ...], read: SliceReader
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The box `index` of the (part of the) parameter that `src` fills, reading only what it needs,
    still in the checkpoint's axis order: returns (block, perm), the box being
    `block.transpose(perm)` (left to the caller: a device transposes far faster than numpy).

    `param_shape` / `index` cover the parameter's axes that `src` maps (for a per-part
    source: all but the first). Whole head ranges along split dimensions are read exactly;
    only sub-ranges of an inner split axis (never produced by the sharding rules) read
    their covering rows.
    """
    lay = src.layout
    nview = len(lay.view)
    offset = lay.offset or (0,) * nview
    lo, hi = [0] * nview, list(lay.view)  # the box of the view to read
    want: list[tuple[int, int]] = [(0, n) for n in lay.view]  # wanted range in parameter units, per view axis
    for j, (s, extent) in enumerate(zip(index, param_shape)):
        a = lay.perm[j]
        start, stop, _ = s.indices(extent)
        want[a] = (start, stop)
        if a == lay.repeat_axis:
            start, stop = start // lay.repeat, (stop - 1) // lay.repeat + 1 if stop > start else start // lay.repeat
        lo[a], hi[a] = start + offset[a], stop + offset[a]
    # View box -> stored box: a stored dimension is read from its outer view axis' range.
    groups = view_groups(src.shape, lay.view)
    stored_slices, sub = [], []
    for group in groups:
        inner = int(np.prod([lay.view[a] for a in group[1:]], dtype=np.int64))
        outer = group[0]
        stored_slices.append(slice(lo[outer] * inner, hi[outer] * inner))
        sub.append(slice(0, hi[outer] - lo[outer]))
        for a in group[1:]:
            sub.append(slice(lo[a], hi[a]))
    raw = read(src.name, tuple(stored_slices))
    block_shape = tuple(hi[g[0]] - lo[g[0]] if k == 0 else lay.view[a] for g in groups for k, a in enumerate(g))
    block = np.asarray(raw).reshape(block_shape)[tuple(sub)]
    if lay.repeat_axis is not None and lay.repeat > 1:
        a = lay.repeat_axis
        start, stop = want[a]
        block = np.repeat(block, lay.repeat, axis=a)
        skip = start - (start // lay.repeat) * lay.repeat
        block = np.take(block, np.arange(skip, skip + stop - start), axis=a)
    return block, lay.perm


def read_parameter(
    decl: WeightDecl, alternative: Sequence[Source], index: tuple[slice, ...], read: SliceReader, dtype: np.dtype
) -> np.ndarray:
    """The box `index` of parameter `decl`, from the checkpoint spelling `alternative`."""
    block, perm = read_parameter_view(decl, alternative, index, read)
    return np.ascontiguousarray(block.transpose(perm)).astype(dtype, copy=False)


def read_stacked_view(
    decl: StackedDecl, alternatives: Sequence[Sequence[Source]], index: tuple[slice, ...], read: SliceReader
) -> tuple[np.ndarray, tuple[int, ...]]:
    """`read_parameter_view` of a stacked parameter: its members' boxes (each read from its own
    spelling in `alternatives`), stacked along a new first axis."""
    index = tuple(index) + (slice(None),) * (len(decl.shape) - len(index))
    views = [
        read_parameter_view(decl.members[r], alternatives[r], index[1:], read)
        for r in range(*index[0].indices(decl.shape[0]))
    ]
    return np.stack([block for block, _ in views]), (0,) + tuple(p + 1 for p in views[0][1])


def read_parameter_view(
    decl: WeightDecl, alternative: Sequence[Source], index: tuple[slice, ...], read: SliceReader
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Like `read_parameter` but untransposed and uncast: (block, perm), the box being
    `block.transpose(perm)`."""
    index = tuple(index) + (slice(None),) * (len(decl.shape) - len(index))
    if decl.rows_from is not None:  # expert slots: each row read from its expert's row of the stack
        stack = replace(decl, shape=(decl.source_rows,) + decl.shape[1:], rows_from=None, source_rows=0)
        views = [
            read_parameter_view(
                stack, alternative, (slice(decl.rows_from[r], decl.rows_from[r] + 1),) + index[1:], read
            )
            for r in range(*index[0].indices(decl.shape[0]))
        ]
        perm = views[0][1]
        assert perm[0] == 0, "expert stacks keep the expert axis first"
        return np.concatenate([block for block, _ in views]), perm
    if alternative[0].part is None:
        return read_source_view(alternative[0], decl.shape, index, read)
    by_part = {src.part: src for src in alternative}
    blocks, perm = [], ()
    for part in range(*index[0].indices(decl.shape[0])):
        block, perm = read_source_view(by_part[part], decl.shape[1:], index[1:], read)
        blocks.append(block)
    return np.stack(blocks), (0,) + tuple(p + 1 for p in perm)
