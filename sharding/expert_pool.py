"""The host-memory pool of every expert's weights, the source of online slot rewrites.

The online balancer copies an expert into a slot from here, never from another device's
slot: a device only ever receives the rows of its own slots, and no collective runs
between devices for a rebalance. One pool serves all the EP ranks this process drives
(one copy per node, as TensorRT-LLM shares its pool between a node's ranks).

The pool is built from the slot buffers themselves (every expert holds at least one slot,
so the slots contain every expert), which keeps it independent of the checkpoint format
and of the model: any MoE layer stored as slots qualifies. A slot weight may be a pytree of
arrays that all share the slot axis (a quantized weight: its values, its block scales and
offsets); the pool keeps the same pytree with numpy leaves, so an expert's values and scales
always move together. Arrays are plain numpy (pageable memory); a device receives each piece
with one host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# The slot-stacked weights of an expert-parallel MoE layer (`jaxllm.models.ep_moe.ep_moe_block`
# reads these names): [num_slots, ...], dimension 0 split over the expert axis.
SLOT_WEIGHTS = ("w_gate", "w_up", "w_down")


@dataclass
class ExpertWeightPool:
    """weights[layer][name]: numpy [num_experts, ...] (or a pytree of them, as the slot weight is),
    expert e's rows of that slot-stacked weight."""

    weights: dict[int, dict[str, Any]]

    @classmethod
    def from_slots(
        cls, layers: Mapping[int, Mapping[str, Any]], tables: Mapping[int, np.ndarray], num_experts: int
    ) -> ExpertWeightPool:
        """Gather each expert's rows from the first slot holding it (layers: MoE layer -> {name: slot
        buffer, or a pytree of buffers [num_slots, ...]})."""
        weights: dict[int, dict[str, Any]] = {}
        for layer, buffers in layers.items():
            table = np.asarray(tables[layer])
            experts, first = np.unique(table, return_index=True)
            if experts.size != num_experts:
                raise ValueError(f"layer {layer}: the slots hold {experts.size} of the {num_experts} experts")
            weights[layer] = {
                name: jax.tree.map(lambda b, first=first: np.ascontiguousarray(np.asarray(b)[first]), buffer)
                for name, buffer in buffers.items()
            }
        return cls(weights)

    def rows(self, layer: int, name: str) -> Any:
        return self.weights[layer][name]

    def row_bytes(self, layer: int) -> int:
        """Bytes of one expert's weights in one layer (all its slot-stacked arrays, scales included)."""
        return int(sum(w[0].nbytes for w in jax.tree.leaves(self.weights[layer])))

    @property
    def nbytes(self) -> int:
        return int(sum(w.nbytes for w in jax.tree.leaves(self.weights)))
