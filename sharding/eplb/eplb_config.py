"""The expert placement file (`generate-config` output) and its loader.

A placement says, for every MoE layer, which expert each global slot holds. Slots are
divided evenly among the EP ranks: rank r owns global slots [r*S/ep, (r+1)*S/ep). The
YAML layout is TensorRT-LLM's::

    num_slots: 80
    initial_global_assignments:
      0: [12, 3, 40, ...]     # layer -> expert id per global slot, length num_slots
    layer_updates_per_iter: 0  # 0 = static placement; k > 0 = online, k layers per step

With k > 0 the online balancer (`jaxllm.engine.load_balancer`) also reads
`placement_algorithm` (greedy: fast enough to follow the traffic), `min_imbalance_gain`
(skip an update whose predicted imbalance gain is smaller) and `minimize_moves` (lay a new
placement onto the current one so that the fewest slots are rewritten).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import numpy as np
import yaml


@dataclass
class MoeLoadBalancerConfig:
    """Expert load balancer settings: slot count, per-layer slot -> expert table, update cadence."""

    num_slots: Optional[int] = None
    initial_global_assignments: dict[int, list[int]] = field(default_factory=dict)
    layer_updates_per_iter: int = 0
    # Online balancer only (layer_updates_per_iter > 0):
    placement_algorithm: str = "greedy"
    min_imbalance_gain: float = 0.02  # predicted (max - mean) / mean drop below which an update is skipped
    minimize_moves: bool = True

    def __post_init__(self) -> None:
        if self.layer_updates_per_iter is None or int(self.layer_updates_per_iter) < 0:
            raise ValueError(f"layer_updates_per_iter must be >= 0, got {self.layer_updates_per_iter!r}")
        self.layer_updates_per_iter = int(self.layer_updates_per_iter)
        from sharding.eplb.placement import ALGORITHMS

        if self.placement_algorithm not in ALGORITHMS:
            raise ValueError(f"placement_algorithm must be one of {list(ALGORITHMS)}, got {self.placement_algorithm!r}")
        try:
            self.min_imbalance_gain = float(self.min_imbalance_gain)
        except (TypeError, ValueError):
            raise ValueError(f"min_imbalance_gain must be a number, got {self.min_imbalance_gain!r}") from None
        if not isinstance(self.minimize_moves, bool):
            raise ValueError(f"minimize_moves must be true or false, got {self.minimize_moves!r}")
        if self.num_slots is not None:
            if int(self.num_slots) <= 0:
                raise ValueError(f"num_slots must be positive, got {self.num_slots!r}")
            self.num_slots = int(self.num_slots)
        table: dict[int, list[int]] = {}
        for layer, slots in (self.initial_global_assignments or {}).items():
            try:
                layer_id = int(layer)
            except (TypeError, ValueError):
                raise ValueError(f"initial_global_assignments: layer key {layer!r} is not an integer") from None
            experts = [int(e) for e in slots]
            if self.num_slots is not None and len(experts) != self.num_slots:
                raise ValueError(
                    f"initial_global_assignments[{layer_id}] has {len(experts)} slots, num_slots is {self.num_slots}"
                )
            if any(e < 0 for e in experts):
                raise ValueError(f"initial_global_assignments[{layer_id}] holds a negative expert id")
            table[layer_id] = experts
        self.initial_global_assignments = table
        if self.num_slots is None and table:
            self.num_slots = len(next(iter(table.values())))

    def validate(self, num_experts: int, ep_size: int) -> None:
        """Raise ValueError unless every layer's table is a valid placement for this model and EP size."""
        if self.num_slots is None:
            raise ValueError("num_slots is not set")
        for layer, experts in self.initial_global_assignments.items():
            validate_assignment(np.asarray(experts), num_experts, ep_size, where=f"layer {layer}")
        if self.num_slots % ep_size:
            raise ValueError(f"num_slots={self.num_slots} is not divisible by the EP size {ep_size}")
        if self.num_slots < num_experts:
            raise ValueError(f"num_slots={self.num_slots} is smaller than the {num_experts} experts")

    def to_dict(self) -> dict[str, Any]:
        """The reference file's fields (the online options are read, not written)."""
        return {
            "num_slots": self.num_slots,
            "initial_global_assignments": {
                int(k): [int(e) for e in v] for k, v in self.initial_global_assignments.items()
            },
            "layer_updates_per_iter": self.layer_updates_per_iter,
        }


def validate_assignment(slot_to_expert: np.ndarray, num_experts: int, ep_size: int, where: str = "") -> None:
    """A placement is valid when slots split evenly over ranks and every expert has a slot."""
    prefix = f"{where}: " if where else ""
    slots = np.asarray(slot_to_expert)
    if slots.ndim != 1:
        raise ValueError(f"{prefix}a slot table is one list of expert ids per layer, got shape {slots.shape}")
    if len(slots) % ep_size:
        raise ValueError(f"{prefix}{len(slots)} slots cannot be divided among {ep_size} EP ranks")
    if slots.size and (slots.min() < 0 or slots.max() >= num_experts):
        raise ValueError(f"{prefix}expert ids must lie in [0, {num_experts}), got {slots.min()}..{slots.max()}")
    missing = np.setdiff1d(np.arange(num_experts), slots)
    if missing.size:
        raise ValueError(f"{prefix}experts {missing[:8].tolist()} have no slot (every expert needs at least one)")


def load_eplb_config(
    source: Union[str, os.PathLike, Mapping[str, Any], MoeLoadBalancerConfig],
) -> MoeLoadBalancerConfig:
    """A MoeLoadBalancerConfig from a YAML path, a mapping with its fields, or itself."""
    if isinstance(source, MoeLoadBalancerConfig):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"expert load balancer config {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping with num_slots and initial_global_assignments")
        data = dict(data)
    known = {f.name for f in fields(MoeLoadBalancerConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown expert load balancer field(s) {unknown}; expected {sorted(known)}")
    return MoeLoadBalancerConfig(**data)


class _InlineListDumper(yaml.SafeDumper):
    """Writes each slot list on one line, as the reference tool does."""


def _inline_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_InlineListDumper.add_representer(list, _inline_list)


def save_eplb_config(config: MoeLoadBalancerConfig, path: Union[str, os.PathLike]) -> None:
    """Write the placement YAML (num_slots, initial_global_assignments, layer_updates_per_iter)."""
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.dump(config.to_dict(), f, Dumper=_InlineListDumper, width=float("inf"), sort_keys=False)
