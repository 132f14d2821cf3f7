"""Load-imbalance metrics over EP ranks (or slots), as the reference report computes them."""

from __future__ import annotations

from typing import Optional

import numpy as np

STAT_COLUMNS = ("mean", "std", "imbalance-ratio")


def replica_counts(slot_to_expert: np.ndarray, num_experts: int) -> np.ndarray:
    """How many slots each expert occupies."""
    return np.bincount(np.asarray(slot_to_expert), minlength=num_experts)


def slot_loads(expert_counts: np.ndarray, slot_to_expert: np.ndarray) -> np.ndarray:
    """Tokens per slot [..., num_slots] when each expert's tokens split evenly over its replicas
    (what round-robin replica choice does)."""
    expert_counts = np.asarray(expert_counts, dtype=np.float64)
    slots = np.asarray(slot_to_expert)
    replicas = replica_counts(slots, expert_counts.shape[-1])
    if np.any(replicas == 0):
        raise ValueError("every expert needs at least one slot")
    return (expert_counts / replicas)[..., slots]


def rank_loads(slot_counts: np.ndarray, ep_size: int) -> np.ndarray:
    """Tokens per EP rank [..., ep_size]: rank r owns a contiguous 1/ep_size of the slots."""
    slot_counts = np.asarray(slot_counts, dtype=np.float64)
    if slot_counts.shape[-1] % ep_size:
        raise ValueError(f"{slot_counts.shape[-1]} slots cannot be divided among {ep_size} EP ranks")
    return slot_counts.reshape(*slot_counts.shape[:-1], ep_size, -1).sum(-1)


def imbalance_ratio(loads: np.ndarray) -> np.ndarray:
    """(max - mean) / mean over the last axis; 0 is perfect balance (and an idle step)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = loads.max(-1) / mean - 1.0
    return np.where(mean > 0, ratio, 0.0)


def load_statistics(loads: np.ndarray) -> dict[str, float]:
    """mean, unbiased std and imbalance ratio across the last axis of [num_iters, n], averaged over iterations."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[-1] < 2:
        raise ValueError(f"need loads [num_iters, n >= 2], got shape {loads.shape}")
    return {
        "mean": float(loads.mean(-1).mean()),
        "std": float(loads.std(-1, ddof=1).mean()),
        "imbalance-ratio": float(imbalance_ratio(loads).mean()),
    }


def layer_load_statistics(
    expert_counts: np.ndarray, ep_size: int, slot_to_expert: Optional[np.ndarray] = None, per_expert: bool = False
) -> dict[str, float]:
    """Statistics of one layer's counts [num_iters, num_experts] over EP ranks (or over slots with
    per_expert), optionally projected onto a placement first."""
    counts = np.asarray(expert_counts, dtype=np.float64)
    slots = counts if slot_to_expert is None else slot_loads(counts, slot_to_expert)
    return load_statistics(slots if per_expert else rank_loads(slots, ep_size))
