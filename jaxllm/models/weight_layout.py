"""How checkpoint tensors map onto parameters: the layout change that turns a stored tensor
into (one part of) a parameter. Shared by the weight declarations (`jaxllm.models.weights`,
`jaxllm.models.deepseek_weights`) and the loader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """How a checkpoint tensor becomes (one part of) a parameter.

    The stored tensor is viewed with shape `view` (a reshape that only splits
    dimensions, e.g. [Hq*D, H] -> [Hq, D, H]); parameter axis j is view axis `perm[j]`,
    starting at `offset[perm[j]]` (fused tensors hold two parameters side by side);
    entries along view axis `repeat_axis` appear `repeat` times in a row.
    """

    view: tuple[int, ...]
    perm: tuple[int, ...]
    offset: tuple[int, ...] = ()
    repeat_axis: int | None = None
    repeat: int = 1


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor that fills a parameter, or part `part` of its first axis."""

    name: str
    shape: tuple[int, ...]  # as stored in the checkpoint
    layout: Layout
    part: int | None = None


def view_groups(stored: tuple[int, ...], view: tuple[int, ...]) -> list[list[int]]:
    """For each stored dimension, the view axes it splits into (in order)."""
    groups, axis = [], 0
    for size in stored:
        group, prod = [], 1
        while prod < size or (not group and axis < len(view)):
            group.append(axis)
            prod *= view[axis]
            axis += 1
        if prod != size:
            raise ValueError(f"view {view} does not split stored shape {stored}")
        groups.append(group)
    return groups
