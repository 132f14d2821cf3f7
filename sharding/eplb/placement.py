"""Replication and placement of experts into slots (the host half of EPLB).

Input: one layer's (or every layer's) expert loads, e.g. token counts summed over the
recorded iterations. Output: a slot -> expert table of num_slots entries, rank r owning
slots [r*S/ep, (r+1)*S/ep), every expert in at least one slot (`initial_global_assignments`
layout). Three algorithms:

* `greedy`: TensorRT-LLM's host algorithm. Replicate the expert with the largest
  load / replica count until the slots are used, then put replicas, heaviest first, on the
  least-loaded rank that still has a free slot.
* `hierarchical`: DeepSeek's EPLB `rebalance_experts` (groups packed onto nodes, replicas
  made within nodes, replicas packed onto GPUs); with one group and one node it is the
  global policy.
* `balanced` (jaxllm's): the same replication, packed two ways (greedy's, and heaviest
  first keeping an expert's replicas on different ranks), each refined by local search:
  swap two slots between the most loaded rank and another, or hand a slot of a replicated
  expert to another expert, while the most loaded rank gets lighter (or, at the same
  maximum, the loads get more even); the better result wins. `placement_from_counts` feeds
  it decay-weighted loads (recent iterations count more) so the placement holds up on
  iterations not yet seen. Optionally (`spread`) a rank is scored as its expected tokens
  plus `spread` standard deviations; on the skewed benchmark that gained nothing
  measurable, so it is off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

ALGORITHMS = ("greedy", "hierarchical", "balanced")
DEFAULT_ALGORITHM = "balanced"


def _check(load: np.ndarray, num_slots: int, ep_size: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 1 or load.size == 0:
        raise ValueError(f"expert loads must be a non-empty vector, got shape {load.shape}")
    if np.any(load < 0) or not np.all(np.isfinite(load)):
        raise ValueError("expert loads must be finite and non-negative")
    if ep_size <= 0 or num_slots % ep_size:
        raise ValueError(f"num_slots={num_slots} must be a positive multiple of ep_size={ep_size}")
    if num_slots < load.size:
        raise ValueError(f"num_slots={num_slots} is smaller than the {load.size} experts (each needs a slot)")
    return load


# ----------------------------------------------------------------------------- replication
def replicate_by_load(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica count per expert: one each, then each spare slot to the largest load / count
    (lowest expert id on ties). Zero total load: num_slots // E each, the first num_slots % E one more."""
    load = np.asarray(load, dtype=np.float64)
    num_experts = load.size
    if load.sum() <= 0:
        counts = np.full(num_experts, num_slots // num_experts, dtype=np.int64)
        counts[: num_slots % num_experts] += 1
        return counts
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_slots - num_experts):
        counts[int(np.argmax(load / counts))] += 1
    return counts


# ----------------------------------------------------------------------------- greedy (TensorRT-LLM)
def greedy_placement(load: np.ndarray, num_slots: int, ep_size: int) -> np.ndarray:
    """TensorRT-LLM's replication then placement: replicas sorted by load / count, heaviest
    first (lower expert id first on ties), each onto the least-loaded rank with a free slot
    (lowest rank on ties)."""
    load = _check(load, num_slots, ep_size)
    counts = replicate_by_load(load, num_slots)
    per_rank = num_slots // ep_size
    share = load / counts
    replicas = [e for e in np.argsort(-share, kind="stable") for _ in range(counts[e])]
    rank_load = np.zeros(ep_size)
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    for expert in replicas:
        open_ranks = [r for r in range(ep_size) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda i: rank_load[i])
        ranks[r].append(int(expert))
        rank_load[r] += share[expert]
    return np.array([e for rank in ranks for e in rank], dtype=np.int64)


# ----------------------------------------------------------------------------- DeepSeek EPLB
def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items (heaviest first) to the lightest pack that has room; every pack gets n / num_packs items."""
    num_layers, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        return np.tile(np.arange(num_items), (num_layers, 1)), np.zeros_like(weight, dtype=np.int64)
    pack_index = np.full(weight.shape, -1, dtype=np.int64)
    rank_in_pack = np.full(weight.shape, -1, dtype=np.int64)
    for i in range(num_layers):
        pack_weights = [0.0] * num_packs
        pack_items = [0] * num_packs
        for item in np.argsort(-weight[i], kind="stable"):
            pack = min((p for p in range(num_packs) if pack_items[p] < per_pack), key=pack_weights.__getitem__)
            pack_index[i, item] = pack
            rank_in_pack[i, item] = pack_items[pack]
            pack_weights[pack] += weight[i, item]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def _replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spare physical experts go one by one to the largest weight / count: phy2log, rank, logcnt."""
    num_layers, num_log = weight.shape
    phy2log = np.tile(np.arange(num_phy), (num_layers, 1))
    rank = np.zeros((num_layers, num_phy), dtype=np.int64)
    logcnt = np.ones((num_layers, num_log), dtype=np.int64)
    rows = np.arange(num_layers)
    for i in range(num_log, num_phy):
        pick = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = pick
        rank[:, i] = logcnt[rows, pick]
        logcnt[rows, pick] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_layers, num_logical = weight.shape
    if num_logical % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_physical % num_gpus:
        raise ValueError(
            f"hierarchical EPLB needs experts % groups == groups % nodes == gpus % nodes == "
            f"slots % gpus == 0 (experts={num_logical}, groups={num_groups}, nodes={num_nodes}, "
            f"gpus={num_gpus}, slots={num_physical})"
        )
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus
    # 1. expert groups onto nodes
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = _balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[..., None] + np.arange(group_size)).reshape(
        num_layers, -1
    )
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate_experts(tokens_per_mlog, num_physical // num_nodes)
    # 3. replicas onto the node's GPUs
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
    pack_index, rank_in_pack = _balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack_index * phy_per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    pphy2mlog = (
        pphy2mlog.reshape(num_layers, num_nodes, -1)
        + np.arange(0, num_logical, num_logical // num_nodes).reshape(1, -1, 1)
    ).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB: weight [L, E] -> phy2log [L, R], log2phy [L, E, max count] (-1 padded), logcnt [L, E].

    Hierarchical when the groups divide evenly over the nodes, else the global policy."""
    weight = np.asarray(weight, dtype=np.float64)
    num_layers, num_logical = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    maxcnt = int(logcnt.max())
    log2phy = np.full((num_layers, num_logical * maxcnt), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * maxcnt + phyrank,
        np.broadcast_to(np.arange(num_replicas), (num_layers, num_replicas)),
        axis=-1,
    )
    return phy2log, log2phy.reshape(num_layers, num_logical, maxcnt), logcnt


def hierarchical_placement(
    load: np.ndarray, num_slots: int, ep_size: int, num_groups: int = 1, num_nodes: int = 1
) -> np.ndarray:
    """DeepSeek's rebalance_experts for one layer, EP ranks as its GPUs."""
    load = _check(load, num_slots, ep_size)
    phy2log, _, _ = rebalance_experts(load[None], num_slots, num_groups, num_nodes, ep_size)
    return phy2log[0]


# ----------------------------------------------------------------------------- balanced (jaxllm)
def _pack_apart(share: np.ndarray, counts: np.ndarray, ep_size: int, per_rank: int) -> np.ndarray:
    """Heaviest replica first onto the lightest open rank not already holding that expert."""
    rank_load = np.zeros(ep_size)
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    for expert in np.argsort(-share, kind="stable"):
        for _ in range(counts[expert]):
            open_ranks = [r for r in range(ep_size) if len(ranks[r]) < per_rank]
            apart = [r for r in open_ranks if expert not in ranks[r]] or open_ranks
            r = min(apart, key=lambda i: rank_load[i])
            ranks[r].append(int(expert))
            rank_load[r] += share[expert]
    return np.array([e for rank in ranks for e in rank], dtype=np.int64)


def _objective(score: np.ndarray) -> tuple[float, float]:
    return float(score.max()), float(np.square(score).sum())


def _better(new: tuple[float, float], old: tuple[float, float], tol: float) -> bool:
    return new[0] < old[0] - tol or (new[0] <= old[0] + tol and new[1] < old[1] - tol * max(old[0], 1.0))


def _rank_scores(load: np.ndarray, variance: np.ndarray, slots: np.ndarray, ep_size: int, spread: float) -> np.ndarray:
    counts = np.bincount(slots, minlength=load.size)
    mean = (load / counts)[slots].reshape(ep_size, -1).sum(-1)
    var = (variance / counts**2)[slots].reshape(ep_size, -1).sum(-1)
    return mean + spread * np.sqrt(np.maximum(var, 0.0))


def _improve(
    load: np.ndarray, variance: np.ndarray, slots: np.ndarray, ep_size: int, spread: float, max_rounds: int
) -> np.ndarray:
    """Local search on the slot table (see the module docstring).

    A rank's score is its expected load plus `spread` standard deviations of it (each
    replica carries 1/count of its expert's tokens, so 1/count^2 of the variance): with
    spread > 0 the search also avoids stacking volatile experts on one rank. Every accepted
    move lowers (max score, sum of squared scores) lexicographically, so it terminates."""
    num_experts, num_slots = load.size, slots.size
    per_rank = num_slots // ep_size
    slot_rank = np.arange(num_slots) // per_rank
    tol = 1e-9 * max(float(load.sum()), 1.0)

    def scores(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        return mean + spread * np.sqrt(np.maximum(var, 0.0))

    for _ in range(max_rounds):
        counts = np.bincount(slots, minlength=num_experts)
        share, share_var = load / counts, variance / counts**2
        held = np.zeros((num_experts, ep_size), dtype=np.int64)  # replicas of expert e on rank r
        np.add.at(held, (slots, slot_rank), 1)
        rank_mean, rank_var = held.T @ share, held.T @ share_var
        rank_score = scores(rank_mean, rank_var)
        hot = int(np.argmax(rank_score))
        best, best_move = _objective(rank_score), None
        # (a) swap a slot of the hottest rank with a slot elsewhere
        mine = np.flatnonzero(slot_rank == hot)
        other = np.flatnonzero(slot_rank != hot)
        d_mean = share[slots[other]][None, :] - share[slots[mine]][:, None]
        d_var = share_var[slots[other]][None, :] - share_var[slots[mine]][:, None]
        ro = slot_rank[other][None, :]
        hot_new = scores(rank_mean[hot] + d_mean, rank_var[hot] + d_var)
        other_new = scores(rank_mean[ro] - d_mean, rank_var[ro] - d_var)
        pair_max = np.maximum(hot_new, other_new)
        for i, j in zip(*np.unravel_index(np.argsort(pair_max, axis=None)[:64], pair_max.shape)):
            if pair_max[i, j] >= rank_score[hot] - tol:
                break
            a, b = mine[i], other[j]
            ea, eb, rb = slots[a], slots[b], slot_rank[b]
            if ea == eb:
                continue
            trial = rank_score.copy()
            trial[hot], trial[rb] = hot_new[i, j], other_new[i, j]
            if _better(_objective(trial), best, tol):
                best, best_move = _objective(trial), ("swap", a, b)
            break
        # (b) a replicated expert's slot goes to another expert: one of the hottest rank's or
        # of the heaviest per-replica shares (the ones an extra replica relieves most)
        heavy = np.argsort(-share, kind="stable")[: 2 * ep_size]
        gainers = np.union1d(np.unique(slots[mine]), heavy)
        g_share, g_var = load[gainers] / (counts[gainers] + 1), variance[gainers] / (counts[gainers] + 1) ** 2
        g_mean_delta = held[gainers] * (g_share - share[gainers])[:, None]  # [gainers, ranks]
        g_var_delta = held[gainers] * (g_var - share_var[gainers])[:, None]
        for s in np.flatnonzero(counts[slots] > 1):
            donor, rs = slots[s], slot_rank[s]
            d_share, d_var = load[donor] / (counts[donor] - 1), variance[donor] / (counts[donor] - 1) ** 2
            mean = rank_mean + held[donor] * (d_share - share[donor]) + g_mean_delta
            var = rank_var + held[donor] * (d_var - share_var[donor]) + g_var_delta
            mean[:, rs] += g_share - d_share
            var[:, rs] += g_var - d_var
            trial = scores(mean, var)
            peak, even = trial.max(1), np.square(trial).sum(1)
            ok = gainers != donor
            for k in np.flatnonzero(ok)[np.lexsort((even[ok], peak[ok]))][:1]:
                if _better((float(peak[k]), float(even[k])), best, tol):
                    best, best_move = (float(peak[k]), float(even[k])), ("give", s, gainers[k])
        if best_move is None:
            break
        if best_move[0] == "swap":
            _, a, b = best_move
            slots[a], slots[b] = slots[b], slots[a]
        else:
            _, s, gainer = best_move
            slots[s] = gainer
    return slots


def balanced_placement(
    load: np.ndarray,
    num_slots: int,
    ep_size: int,
    variance: Optional[np.ndarray] = None,
    spread: float = 0.0,
    max_rounds: int = 2000,
) -> np.ndarray:
    """Replication by load, two packings, local search on the rank scores, the better kept.

    `load` is the expected load per expert and `variance` its variance (same units, e.g. the
    per-iteration mean and variance of the recorded counts); without a variance only the
    expected loads count (and `spread` 0, the default, ignores it)."""
    load = _check(load, num_slots, ep_size)
    variance = np.zeros_like(load) if variance is None else np.asarray(variance, dtype=np.float64)
    if variance.shape != load.shape:
        raise ValueError(f"variance shape {variance.shape} differs from the loads' {load.shape}")
    counts = replicate_by_load(load, num_slots)
    starts = [
        _pack_apart(load / counts, counts, ep_size, num_slots // ep_size),
        greedy_placement(load, num_slots, ep_size),
    ]
    results = [_improve(load, variance, start, ep_size, spread, max_rounds) for start in starts]
    return min(results, key=lambda slots: _objective(_rank_scores(load, variance, slots, ep_size, spread)))


def refine_placement(load: np.ndarray, slot_to_expert: np.ndarray, ep_size: int, max_moves: int = 1) -> np.ndarray:
    """Up to `max_moves` moves of `balanced`'s local search (a slot swap between the most loaded rank
    and another, or a replicated expert's slot handed to another expert) starting from a given table."""
    load = _check(load, len(slot_to_expert), ep_size)
    slots = np.array(slot_to_expert, dtype=np.int64)
    return _improve(load, np.zeros_like(load), slots, ep_size, 0.0, max_moves)


# ----------------------------------------------------------------------------- entry point
_PLACERS: dict[str, Callable[..., np.ndarray]] = {
    "greedy": greedy_placement,
    "hierarchical": hierarchical_placement,
    "balanced": balanced_placement,
}


def compute_placement(
    loads: np.ndarray, num_slots: int, ep_size: int, algorithm: str = DEFAULT_ALGORITHM, **options
) -> np.ndarray:
    """Slot tables [num_layers, num_slots] from expert loads [num_layers, num_experts] (or one
    layer's [num_experts])."""
    if algorithm not in _PLACERS:
        raise ValueError(f"unknown placement algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    loads = np.asarray(loads, dtype=np.float64)
    single = loads.ndim == 1
    table = np.stack([_PLACERS[algorithm](row, num_slots, ep_size, **options) for row in np.atleast_2d(loads)])
    return table[0] if single else table


DECAY_CHOICES = (1.0, 0.98, 0.95, 0.9, 0.8)


def weighted_moments(counts: np.ndarray, decay: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-iteration mean and variance of counts [num_iters, ...], iteration i weighted decay^(n-1-i)
    (recent iterations count more, as in the online balancer's decayed load)."""
    counts = np.asarray(counts, dtype=np.float64)
    w = decay ** np.arange(counts.shape[0] - 1, -1, -1, dtype=np.float64)
    w = (w / w.sum()).reshape(-1, *([1] * (counts.ndim - 1)))
    mean = (w * counts).sum(0)
    return mean, (w * np.square(counts - mean)).sum(0)


def _balanced_layers(counts: np.ndarray, num_slots: int, ep_size: int, decay: float, **options) -> np.ndarray:
    mean, var = weighted_moments(counts, decay)
    return np.stack([balanced_placement(m, num_slots, ep_size, variance=v, **options) for m, v in zip(mean, var)])


def choose_decay(counts: np.ndarray, num_slots: int, ep_size: int, **options) -> float:
    """The decay whose placement, fitted on the first 3/4 of the iterations, balances the last 1/4 best."""
    from sharding.eplb.load_metrics import imbalance_ratio, rank_loads, slot_loads

    cut = counts.shape[0] * 3 // 4
    if cut < 4 or counts.shape[0] - cut < 2:
        return 0.95
    # at most 8 layers, spread over the model, decide (keeps many-layer models quick)
    layers = np.unique(np.linspace(0, counts.shape[1] - 1, min(8, counts.shape[1])).round().astype(int))
    fit, check = counts[:cut, layers], counts[cut:, layers]
    scores = []
    for decay in DECAY_CHOICES:
        tables = _balanced_layers(fit, num_slots, ep_size, decay, **options)
        scores.append(
            np.mean(
                [
                    imbalance_ratio(rank_loads(slot_loads(check[:, l], tables[l]), ep_size)).mean()
                    for l in range(len(layers))
                ]
            )
        )
    return DECAY_CHOICES[int(np.argmin(scores))]


def placement_from_counts(
    counts: np.ndarray,
    num_slots: int,
    ep_size: int,
    algorithm: str = DEFAULT_ALGORITHM,
    decay: Optional[float] = None,
    **options,
) -> np.ndarray:
    """Slot tables [num_layers, num_slots] from recorded counts [num_iters, num_layers, num_experts].

    greedy and hierarchical use the summed counts (as the references do). balanced uses the
    per-iteration mean and variance with recent iterations weighted more (`decay` per
    iteration back; by default picked from DECAY_CHOICES by fitting on the first 3/4 of the
    iterations and checking on the rest), because expert popularity drifts."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 3:
        raise ValueError(f"counts must be [num_iters, num_layers, num_experts], got shape {counts.shape}")
    if algorithm not in _PLACERS:
        raise ValueError(f"unknown placement algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    if algorithm != "balanced":
        return compute_placement(counts.sum(0), num_slots, ep_size, algorithm, **options)
    if decay is None:
        decay = choose_decay(counts, num_slots, ep_size, **options)
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must lie in (0, 1], got {decay}")
    return _balanced_layers(counts, num_slots, ep_size, decay, **options)
