"""The load report: per-layer imbalance table (printed as the reference prints it) and heatmaps."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import numpy as np

from sharding.eplb.eplb_config import MoeLoadBalancerConfig
from sharding.eplb.load_metrics import STAT_COLUMNS, load_statistics, rank_loads, slot_loads
from sharding.eplb.statistics import ExpertStatistics


def slot_counts(stats: ExpertStatistics, layer: int, config: Optional[MoeLoadBalancerConfig] = None) -> np.ndarray:
    """[num_iters, num_slots] tokens per slot of one layer; with a placement, each expert's
    tokens split evenly over its replicas (what running with that placement would give)."""
    counts = stats.layer_counts(layer).astype(np.float64)
    if config is None:
        return counts
    table = config.initial_global_assignments.get(layer)
    if table is None:
        raise ValueError(f"the placement has no slot table for layer {layer}")
    return slot_loads(counts, np.asarray(table))


def layer_statistics(
    stats: ExpertStatistics, ep_size: int, per_expert: bool = False, config: Optional[MoeLoadBalancerConfig] = None
) -> dict[int, dict[str, float]]:
    """{layer: {mean, std, imbalance-ratio}} over EP ranks (or slots with per_expert)."""
    out = {}
    for layer in stats.layers:
        slots = slot_counts(stats, layer, config)
        out[layer] = load_statistics(slots if per_expert else rank_loads(slots, ep_size))
    return out


def _format_column(values: Sequence[float]) -> list[str]:
    """Six decimals, trailing zeros trimmed alike for the whole column (one kept), as pandas shows floats."""
    cells = [f"{v:.6f}" for v in values]
    while all(c.endswith("0") and not c.endswith(".0") for c in cells):
        cells = [c[:-1] for c in cells]
    return cells


def format_table(rows: dict, columns: Sequence[str] = STAT_COLUMNS) -> str:
    """A right-aligned table: one row per key (left-aligned), columns separated by two spaces."""
    labels = [str(k) for k in rows]
    index_width = max(len(label) for label in labels)
    cols = []
    for name in columns:
        cells = _format_column([rows[k][name] for k in rows])
        width = max(len(name), *(len(c) for c in cells))
        cols.append((name.rjust(width), [c.rjust(width) for c in cells]))
    lines = [" " * index_width + "".join("  " + head for head, _ in cols)]
    for i, label in enumerate(labels):
        lines.append(label.ljust(index_width) + "".join("  " + cells[i] for _, cells in cols))
    return "\n".join(lines)


def format_report(per_layer: dict[int, dict[str, float]]) -> str:
    """'Load statistics:' then one row per layer and an `average` row (the mean of the layer rows)."""
    rows: dict = dict(per_layer)
    rows["average"] = {c: float(np.mean([r[c] for r in per_layer.values()])) for c in STAT_COLUMNS}
    return "Load statistics:\n" + format_table(rows)


def plot_heatmaps(
    stats: ExpertStatistics,
    ep_size: int,
    out_dir: str,
    layers: Sequence[int],
    config: Optional[MoeLoadBalancerConfig] = None,
    title_suffix: str = "",
) -> list[str]:
    """PNG heatmaps of tokens per rank (x) and per slot (x) over iterations (y), one pair per layer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'jaxllm[plot]'") from None
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for layer in layers:
        slots = slot_counts(stats, layer, config)
        for kind, data, xlabel in (
            ("ranks", rank_loads(slots, ep_size), "EP rank"),
            ("slots", slots, "expert slot" if config is not None else "expert"),
        ):
            fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
            image = ax.imshow(
                data,
                aspect="auto",
                cmap="viridis",
                interpolation="nearest",
                vmin=0,
                extent=(-0.5, data.shape[1] - 0.5, stats.iters[-1] + 0.5, stats.iters[0] - 0.5),
            )
            ax.set_xlabel(xlabel)
            ax.set_ylabel("iteration")
            what = "rank" if kind == "ranks" else ("slot" if config is not None else "expert")
            ax.set_title(f"layer {layer}: tokens per {what}{title_suffix}", fontsize=10)
            fig.colorbar(image, ax=ax, label="tokens")
            fig.tight_layout()
            path = os.path.join(out_dir, f"layer{layer}_{kind}.png")
            fig.savefig(path)
            plt.close(fig)
            written.append(path)
    return written
