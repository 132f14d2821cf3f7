"""`jaxllm eplb report | generate-config` (also examples/ep_load_balancer/*.py).

Flags are spelled as in the reference scripts (`--expert_statistic_path`); the dashed
spellings (`--expert-statistic-path`) work too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np

from sharding.eplb.eplb_config import MoeLoadBalancerConfig, load_eplb_config, save_eplb_config
from sharding.eplb.placement import ALGORITHMS, DEFAULT_ALGORITHM, placement_from_counts
from sharding.eplb.report import format_report, layer_statistics, plot_heatmaps
from sharding.eplb.statistics import load_expert_statistics


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" only where the help text does not already say what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action) or text


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Adds --snake_case and its --dashed-case spelling."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, **kwargs)


def _stats_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "expert_statistic_path", required=True, help="directory of the expert statistic files")
    _flag(parser, "iter_start", type=int, default=None, help="first iteration used (default: the first recorded)")
    _flag(parser, "iter_stop", type=int, default=None, help="iteration after the last used (default: all)")


def report_parser(prog: str = "jaxllm eplb report") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=_HelpFormatter,
        description="Per-layer load statistics over EP ranks: mean, std and imbalance "
        "ratio (max - mean) / mean, averaged over iterations.",
    )
    _stats_flags(p)
    _flag(p, "per_expert", action="store_true", help="statistics over slots (experts) instead of EP ranks")
    _flag(
        p,
        "projection_eplb_config_path",
        default=None,
        help="project the counts onto this placement YAML (each expert's tokens split over its replicas)",
    )
    _flag(p, "ep_size", type=int, default=None, help="EP ranks (default: the recorded EP size)")
    _flag(p, "plot", default=None, metavar="DIR", help="write PNG heatmaps (tokens per rank / slot per iteration)")
    _flag(p, "plot_layers", type=int, nargs="+", default=None, help="layers to plot (default: the most imbalanced one)")
    return p


def generate_config_parser(prog: str = "jaxllm eplb generate-config") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=_HelpFormatter,
        description="Replicate and place experts from recorded statistics; write the "
        "placement YAML (num_slots, initial_global_assignments, "
        "layer_updates_per_iter).",
    )
    _stats_flags(p)
    _flag(p, "output_path", required=True, help="where to write the YAML")
    _flag(p, "ep_size", type=int, default=None, help="EP size after rebalancing (default: the recorded EP size)")
    _flag(p, "num_slots", type=int, default=None, help="total expert slots (default: the number of experts)")
    _flag(
        p,
        "layer_updates_per_iter",
        type=int,
        default=0,
        help="layers updated per iteration by the online balancer; 0 = static placement",
    )
    _flag(
        p,
        "algorithm",
        choices=ALGORITHMS,
        default=DEFAULT_ALGORITHM,
        help="greedy: TensorRT-LLM's; hierarchical: DeepSeek's rebalance_experts; balanced: local search on "
        "decay-weighted loads",
    )
    _flag(p, "num_groups", type=int, default=1, help="hierarchical: expert groups")
    _flag(p, "num_nodes", type=int, default=1, help="hierarchical: nodes")
    _flag(
        p,
        "decay",
        type=float,
        default=None,
        help="balanced: weight per iteration back (default: chosen on the last quarter of the iterations)",
    )
    return p


def report_main(argv: Optional[list[str]] = None, prog: str = "jaxllm eplb report") -> int:
    args = report_parser(prog).parse_args(argv)
    stats = load_expert_statistics(args.expert_statistic_path, args.iter_start, args.iter_stop)
    ep_size = args.ep_size or stats.ep_size
    config = None
    if args.projection_eplb_config_path:
        config = load_eplb_config(args.projection_eplb_config_path)
        config.validate(stats.num_experts, ep_size)
    per_layer = layer_statistics(stats, ep_size, args.per_expert, config)
    print(format_report(per_layer))
    if args.plot:
        layers = args.plot_layers or [max(per_layer, key=lambda l: per_layer[l]["imbalance-ratio"])]
        unknown = sorted(set(layers) - set(stats.layers))
        if unknown:
            raise ValueError(f"--plot_layers {unknown} were not recorded (layers: {stats.layers})")
        suffix = " (with the placement)" if config is not None else ""
        for path in plot_heatmaps(stats, ep_size, args.plot, layers, config, suffix):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def generate_config(args: argparse.Namespace) -> MoeLoadBalancerConfig:
    stats = load_expert_statistics(args.expert_statistic_path, args.iter_start, args.iter_stop)
    ep_size = args.ep_size or stats.ep_size
    num_slots = args.num_slots or stats.num_experts
    options = {}
    if args.algorithm == "hierarchical":
        options = {"num_groups": args.num_groups, "num_nodes": args.num_nodes}
    elif args.algorithm == "balanced":
        options = {"decay": args.decay}
    tables = placement_from_counts(stats.counts, num_slots, ep_size, args.algorithm, **options)
    config = MoeLoadBalancerConfig(
        num_slots=num_slots,
        initial_global_assignments={layer: np.asarray(t).tolist() for layer, t in zip(stats.layers, tables)},
        layer_updates_per_iter=args.layer_updates_per_iter,
    )
    config.validate(stats.num_experts, ep_size)
    return config


def generate_config_main(argv: Optional[list[str]] = None, prog: str = "jaxllm eplb generate-config") -> int:
    args = generate_config_parser(prog).parse_args(argv)
    config = generate_config(args)
    save_eplb_config(config, args.output_path)
    print(
        f"wrote {args.output_path}: {len(config.initial_global_assignments)} layers, {config.num_slots} slots "
        f"({args.algorithm})",
        file=sys.stderr,
    )
    return 0


COMMANDS = {"report": report_main, "generate-config": generate_config_main}


def main(argv: Optional[list[str]] = None) -> int:
    """`jaxllm eplb COMMAND ...`; bad input prints one line and exits with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: jaxllm eplb COMMAND [options]\n\ncommands:\n"
        "  report           per-layer load statistics of recorded expert counts (--plot: heatmaps)\n"
        "  generate-config  replicate and place experts; write the placement YAML"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"jaxllm eplb: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as exc:
        print(f"jaxllm eplb {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
