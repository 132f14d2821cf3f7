"""Placements that move less: lay a new placement onto the current one with the fewest rewritten slots.

What a placement does to the load depends only on which experts each rank holds (as a
multiset), not on which rank number holds which set nor on the order of slots inside a
rank. So a new placement may be relabelled before it is applied:

1. whole ranks: new rank a's experts go to physical rank pi(a), where pi maximises the
   experts already in place, an assignment problem over ep x ep (solved exactly by the
   Hungarian algorithm below: no scipy);
2. inside a rank: a slot whose expert stays on that rank keeps it; only the remaining
   slots are rewritten.

The relabelled placement has the same rank loads (up to rank order: the same imbalance)
and rewrites slots only where an expert has to arrive. `map_onto` returns it; with
`moved_slots` a caller counts what an update copies.

Relabelling keeps every slot it can, but a placement computed from scratch still differs
from the current one almost everywhere once loads drift a little (greedy's order of
replicas changes). `incremental_placement` goes the other way: it starts from the current
table and makes the local search's moves (one swap or one replica handed over at a time,
most loaded rank first) only until the predicted imbalance is as good as the fresh
placement's (within a tolerance). On the drifting Zipf workload of `jaxllm bench eplb`
that rewrote 11x fewer slots than relabelling, at the same imbalance.
"""

from __future__ import annotations

import numpy as np

from sharding.eplb.load_metrics import imbalance_ratio, rank_loads, slot_loads
from sharding.eplb.placement import refine_placement


def min_cost_assignment(cost: np.ndarray) -> np.ndarray:
    """Column of each row of a square cost matrix minimising the total (Hungarian algorithm, O(n^3))."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if cost.ndim != 2 or cost.shape[1] != n:
        raise ValueError(f"the assignment needs a square cost matrix, got shape {cost.shape}")
    # Potentials u (rows) and v (columns); p[j]: row matched to column j (1-based, 0 = none).
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    p, way = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    for row in range(1, n + 1):
        p[0], j0 = row, 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            free = np.flatnonzero(~used[1:]) + 1
            reduced = cost[i0 - 1, free - 1] - u[i0] - v[free]
            better = reduced < minv[free]
            minv[free[better]] = reduced[better]
            way[free[better]] = j0
            j1 = free[np.argmin(minv[free])]
            delta = minv[j1]
            u[p[used]] += delta
            v[used] -= delta
            minv[free] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    match = np.empty(n, dtype=np.int64)
    match[p[1:] - 1] = np.arange(n)
    return match


def _keep_in_rank(current: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The rank's slots holding the `wanted` multiset, keeping every current slot it still needs."""
    remaining: dict[int, int] = {}
    for e in wanted.tolist():
        remaining[e] = remaining.get(e, 0) + 1
    out = np.full_like(current, -1)
    for j, e in enumerate(current.tolist()):
        if remaining.get(e, 0):
            out[j] = e
            remaining[e] -= 1
    arrivals = [e for e, c in remaining.items() for _ in range(c)]
    out[out < 0] = arrivals
    return out


def map_onto(current: np.ndarray, new: np.ndarray, ep_size: int) -> np.ndarray:
    """`new` relabelled (whole ranks permuted, slots permuted inside ranks) to rewrite the fewest slots of `current`."""
    current, new = np.asarray(current), np.asarray(new)
    if current.shape != new.shape or current.ndim != 1 or current.size % ep_size:
        raise ValueError(f"placements of {current.shape} and {new.shape} slots over {ep_size} ranks do not match")
    num_experts = int(max(current.max(), new.max())) + 1
    cur, nxt = current.reshape(ep_size, -1), new.reshape(ep_size, -1)
    held_cur = np.stack([np.bincount(r, minlength=num_experts) for r in cur])
    held_new = np.stack([np.bincount(r, minlength=num_experts) for r in nxt])
    kept = np.minimum(held_new[:, None, :], held_cur[None, :, :]).sum(-1)  # [new rank, physical rank]
    target = min_cost_assignment(-kept)
    out = np.empty_like(cur)
    for a, b in enumerate(target):
        out[b] = _keep_in_rank(cur[b], nxt[a])
    return out.reshape(-1)


def moved_slots(current: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Global slot ids whose expert changes (the slots an update rewrites)."""
    return np.flatnonzero(np.asarray(current) != np.asarray(new))


def incremental_placement(
    load: np.ndarray, current: np.ndarray, ep_size: int, target: float, max_moved: int, max_moves: int = 16
) -> np.ndarray | None:
    """`current` improved one local-search move at a time until its predicted imbalance under `load`
    is <= target; None when the search stalls above it, would rewrite `max_moved` slots or more, or
    needs more than `max_moves` moves (each costs a search over the slots: ~2.5 ms at 288 slots)."""
    current = np.asarray(current)
    slots = current.copy()
    for _ in range(max_moves + 1):
        if float(imbalance_ratio(rank_loads(slot_loads(load, slots), ep_size))) <= target:
            return slots
        nxt = refine_placement(load, slots, ep_size, 1)
        if np.array_equal(nxt, slots) or moved_slots(current, nxt).size >= max_moved:
            return None
        slots = nxt
    return None
