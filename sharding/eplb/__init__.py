"""Offline expert load balancing (EPLB): statistics files, imbalance report, placement, config.

Workflow: record per-iteration expert counts (`ExpertStatisticsWriter`, enabled by
EXPERT_STATISTIC_ITER_RANGE / EXPERT_STATISTIC_PATH) -> `jaxllm eplb report` ->
`jaxllm eplb generate-config` -> run with the YAML (`MoeLoadBalancerConfig`).
This package is host-side numpy only; it never imports the model or the engine.
"""

from sharding.eplb.eplb_config import MoeLoadBalancerConfig, load_eplb_config, save_eplb_config, validate_assignment
from sharding.eplb.load_metrics import imbalance_ratio, load_statistics, rank_loads, slot_loads
from sharding.eplb.placement import (
    ALGORITHMS,
    compute_placement,
    placement_from_counts,
    rebalance_experts,
    replicate_by_load,
)
from sharding.eplb.statistics import (
    ExpertStatistics,
    ExpertStatisticsWriter,
    load_expert_statistics,
    parse_iter_range,
    write_expert_statistics,
)

__all__ = [
    "ALGORITHMS",
    "ExpertStatistics",
    "ExpertStatisticsWriter",
    "MoeLoadBalancerConfig",
    "compute_placement",
    "imbalance_ratio",
    "load_eplb_config",
    "load_expert_statistics",
    "load_statistics",
    "parse_iter_range",
    "placement_from_counts",
    "rank_loads",
    "rebalance_experts",
    "replicate_by_load",
    "save_eplb_config",
    "slot_loads",
    "validate_assignment",
    "write_expert_statistics",
]
