"""Offline expert load balancing on a skewed routing workload (`jaxllm bench eplb`).

The workload: every MoE layer's router adds a bias that makes expert popularity Zipf
(s=1.2 by default) over the experts, in a different expert order per layer; each token
picks its top-k experts from bias + Gumbel noise (sampling without replacement in
proportion to the Zipf weights), and the bias drifts a little (a Gaussian random walk)
from one iteration to the next. Counts are over the global batch of each iteration.

Placements are fitted on the first half of the iterations (the summed counts) and
measured on the second half: per iteration and layer, each expert's tokens split evenly
over its replicas, summed per EP rank, imbalance ratio (max - mean) / mean, averaged over
iterations and layers. `--write-stats DIR` also saves the statistics in the
EXPERT_STATISTIC_PATH format, so `jaxllm eplb report` / `generate-config` can read them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from sharding.eplb.load_metrics import imbalance_ratio, rank_loads, slot_loads
from sharding.eplb.placement import ALGORITHMS, placement_from_counts
from sharding.eplb.statistics import write_expert_statistics
from sharding.slot_table import default_assignment


def skewed_routing_counts(
    num_iters: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    tokens: int,
    zipf_s: float = 1.2,
    drift: float = 0.02,
    seed: int = 0,
) -> np.ndarray:
    """Expert token counts [num_iters, num_layers, num_experts] of a Zipf-biased, drifting router."""
    rng = np.random.default_rng(seed)
    zipf = np.arange(1, num_experts + 1, dtype=np.float64) ** -zipf_s
    bias = np.stack([np.log(zipf / zipf.sum())[rng.permutation(num_experts)] for _ in range(num_layers)])
    counts = np.zeros((num_iters, num_layers, num_experts), dtype=np.int64)
    for it in range(num_iters):
        logits = bias[None] + rng.gumbel(size=(tokens, num_layers, num_experts))
        chosen = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]  # [tokens, layers, k]
        for layer in range(num_layers):
            counts[it, layer] = np.bincount(chosen[:, layer].ravel(), minlength=num_experts)
        bias = bias + rng.normal(0.0, drift, size=bias.shape)
    return counts


def heldout_imbalance(counts: np.ndarray, tables: np.ndarray, ep_size: int) -> float:
    """Mean imbalance ratio over iterations and layers of counts [iters, layers, E] under tables [layers, S]."""
    per_layer = [
        imbalance_ratio(rank_loads(slot_loads(counts[:, l], tables[l]), ep_size)).mean() for l in range(counts.shape[1])
    ]
    return float(np.mean(per_layer))


@dataclass
class Row:
    setting: str
    num_slots: int
    fitted: float
    heldout: float
    seconds: float


def run(args: argparse.Namespace) -> list[Row]:
    counts = skewed_routing_counts(
        args.iters, args.layers, args.experts, args.top_k, args.tokens, args.zipf_s, args.drift, args.seed
    )
    if args.write_stats:
        write_expert_statistics(
            args.write_stats,
            counts,
            iter_start=args.iter_offset,
            num_experts_per_token=args.top_k,
            ep_size=args.ep_size,
        )
    half = args.iters // 2
    fit, held = counts[:half], counts[half:]
    base = np.tile(default_assignment(args.experts, args.experts, args.ep_size), (args.layers, 1))
    rows = [
        Row(
            "no EPLB (default placement)",
            args.experts,
            heldout_imbalance(fit, base, args.ep_size),
            heldout_imbalance(held, base, args.ep_size),
            0.0,
        )
    ]
    for redundancy in args.redundancy:
        num_slots = args.experts + int(round(args.experts * redundancy / 100))
        num_slots += -num_slots % args.ep_size
        for algorithm in args.algorithms:
            start = time.perf_counter()
            tables = placement_from_counts(fit, num_slots, args.ep_size, algorithm)
            seconds = time.perf_counter() - start
            rows.append(
                Row(
                    f"{algorithm}, {redundancy:g}% redundant",
                    num_slots,
                    heldout_imbalance(fit, tables, args.ep_size),
                    heldout_imbalance(held, tables, args.ep_size),
                    seconds,
                )
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxllm bench eplb", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--tokens", type=int, default=512, help="tokens per iteration (global batch)")
    p.add_argument("--iters", type=int, default=100, help="iterations: first half fits, second half measures")
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--drift", type=float, default=0.02, help="std of the router bias random walk per iteration")
    p.add_argument("--redundancy", type=float, nargs="+", default=[0.0, 25.0], help="redundant slots, %% of experts")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-stats", default=None, metavar="DIR", help="also save the counts as a statistics directory")
    p.add_argument("--iter-offset", type=int, default=100, help="first iteration number in the written statistics")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args)
    print(
        f"EPLB on a Zipf(s={args.zipf_s}) routing workload: {args.experts} experts, top-{args.top_k}, "
        f"{args.layers} layers, EP {args.ep_size}, {args.tokens} tokens/iteration, drift {args.drift}, "
        f"fit on iterations [0, {args.iters // 2}), held out [{args.iters // 2}, {args.iters})"
    )
    print("imbalance ratio = (max - mean) / mean of tokens per EP rank, mean over iterations and layers")
    print(f"{'placement':<34} {'slots':>5} {'fitted':>8} {'held-out':>9} {'time (s)':>9}")
    for r in rows:
        print(f"{r.setting:<34} {r.num_slots:>5} {r.fitted:>8.4f} {r.heldout:>9.4f} {r.seconds:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
