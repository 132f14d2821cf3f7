"""The online expert load balancer following a change of skew (`jaxllm bench eplb-online`).

The EP issue's skewed workload, run through the real expert-parallel MoE layers on an EP
mesh: L MoE layers (`jaxllm.models.ep_moe.ep_moe_block`, slot buffers split over the ranks),
each step a fresh batch of T random activations per layer whose router carries a bias
that makes expert popularity Zipf (s=1.2) over the E experts, in a different expert order
per layer (one input feature is held at 1 and its router row is the bias; the other
features add Gaussian noise of about a Gumbel's spread). Halfway through, every layer's
bias is switched to a new random expert order: a new hot set.

The online balancer (`jaxllm.engine.load_balancer.OnlineLoadBalancer`, as the engine runs
it) rebalances k layers per step in place. Each step the tokens every EP rank receives
are measured on the device (from the slots `choose_slots` picks under the live table) and
the imbalance ratio (max - mean) / mean over ranks is averaged over layers. Reported:

- imbalance over time (a PNG with `--plot`), against the static default placement on
  the same routing (computed from the same counts; replicas split tokens round robin);
- steps to recover after the switch: until the moving average (`--window` steps) of
  the imbalance is back under `--target`;
- steady-state imbalance: the mean over the last quarter of each half;
- host placement time (per snapshot of all layers, and per layer), per-layer update time
  (dispatch, and until the new weights are on the devices), step time with and without an
  update in it;
- bytes copied per rebalance, with the move-minimizing mapping, without it (the same run
  again with `minimize_moves=False`), and what a rewrite of every slot would copy.

On CPU the devices are XLA:CPU host-platform devices: the benchmark restarts itself with
`--xla_force_host_platform_device_count` when fewer are visible.

    jaxllm bench eplb-online --plot eplb_online.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class OnlineRun:
    """One run's series and figures."""

    minimize_moves: bool
    imbalance: list[float]  # per step, mean over layers, measured on the device
    static_imbalance: list[float]  # the default placement on the same routing
    step_seconds: list[float]
    update_steps: list[int]  # steps that applied at least one layer update
    layer_update_seconds: list[float]  # per updated layer: dispatch until the weights are on the devices
    layer_dispatch_seconds: list[float]
    placement_seconds: list[float]  # per worker snapshot (all layers)
    rebalances: int
    slots_rewritten: int
    bytes_moved: int
    naive_bytes: int
    full_bytes_per_layer: int  # every slot of one layer
    skipped_small_gain: int
    extra: dict = field(default_factory=dict)


def hf_config(args: argparse.Namespace) -> dict:
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=128,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=8,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def zipf_bias(num_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Router bias: log of Zipf(s) weights over the experts in a random order."""
    zipf = np.arange(1, num_experts + 1, dtype=np.float64) ** -s
    return np.log(zipf / zipf.sum())[rng.permutation(num_experts)].astype(np.float32)


class SkewedMoeWorkload:
    """L expert-parallel MoE layers with Zipf-biased routers, their parameters and one jitted step."""

    def __init__(self, args: argparse.Namespace, mesh: Any) -> None:
        import jax

        from jaxllm.models import ModelConfig
        from jaxllm.models.backends import resolve_backends
        from jaxllm.models.partitioning import rules_for
        from sharding.rules import named_sharding
        from sharding.slot_table import default_assignment, make_slot_table

        self.args, self.mesh = args, mesh
        self.config = ModelConfig.from_hf_config(hf_config(args))
        self.rules = rules_for(self.config, mesh)
        self.num_slots = args.num_slots
        self.ep_size = args.ep_size
        self.rng = np.random.default_rng(args.seed)
        e, h, i = args.experts, args.hidden_size, args.moe_intermediate_size
        self.default_table = default_assignment(e, self.num_slots, self.ep_size)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        up = named_sharding(mesh, ("experts", "embed", "moe_mlp"), self.rules)
        down = named_sharding(mesh, ("experts", "moe_mlp", "embed"), self.rules)
        self.noise = self.rng.normal(0.0, args.noise / np.sqrt(h - 1), size=(args.layers, h - 1, e)).astype(np.float32)
        layers = []
        for layer in range(args.layers):
            experts = {
                "w_gate": self.rng.normal(0, 0.1, (e, h, i)),
                "w_up": self.rng.normal(0, 0.1, (e, h, i)),
                "w_down": self.rng.normal(0, 0.1, (e, i, h)),
            }
            moe = {
                name: jax.device_put(w[self.default_table].astype(np.float32), down if name == "w_down" else up)
                for name, w in experts.items()
            }
            moe["router"] = jax.device_put(self._router(layer, zipf_bias(e, args.zipf_s, self.rng)), replicated)
            moe["slots"] = make_slot_table(self.default_table, e, replicated)
            layers.append({"moe": moe})
        self.params = {"layers": layers}
        self._replicated = replicated
        _, _, _, moe_fn = resolve_backends(None, None)
        self.step_fn = jax.jit(self._make_step(moe_fn))

    def _router(self, layer: int, bias: np.ndarray) -> np.ndarray:
        return np.concatenate([bias[None], self.noise[layer]], axis=0)

    def switch_hot_set(self) -> None:
        """Every layer's router bias gets a new random expert order (same shapes: nothing recompiles)."""
        import jax

        for layer, entry in enumerate(self.params["layers"]):
            bias = zipf_bias(self.args.experts, self.args.zipf_s, self.rng)
            entry["moe"]["router"] = jax.device_put(self._router(layer, bias), self._replicated)

    def _make_step(self, moe_fn):
        import jax
        import jax.numpy as jnp

        from jaxllm.models.ep_moe import EpMoeOptions, ep_moe_block
        from jaxllm.models.moe import route
        from sharding.slot_table import choose_slots

        config, mesh, rules = self.config, self.mesh, self.rules
        tokens, hidden = self.args.tokens, self.args.hidden_size
        per_rank = self.num_slots // self.ep_size
        ep = self.ep_size

        def step(params, key):
            counts, loads, checksum = [], [], jnp.zeros((), jnp.float32)
            for i, entry in enumerate(params["layers"]):
                p = entry["moe"]
                x = jax.random.normal(jax.random.fold_in(key, i), (tokens, hidden), jnp.float32).at[:, 0].set(1.0)
                out, layer_counts, _ = ep_moe_block(
                    x, p, config=config, moe_fn=moe_fn, mesh=mesh, rules=rules, options=EpMoeOptions()
                )
                _, ids = route(x, p["router"], config)
                slots = choose_slots(ids, p["slots"])
                loads.append(jnp.bincount(slots.reshape(-1) // per_rank, length=ep))
                counts.append(layer_counts)
                checksum = checksum + out.sum()
            return jnp.stack(counts), jnp.stack(loads), checksum

        return step


def _imbalance(loads: np.ndarray) -> np.ndarray:
    from sharding.eplb.load_metrics import imbalance_ratio

    return imbalance_ratio(np.asarray(loads, dtype=np.float64))


def run_online(args: argparse.Namespace, *, minimize_moves: bool, mesh: Any = None) -> OnlineRun:
    """One run of `args.steps` steps with the hot set switched at `args.steps // 2`."""
    import jax

    from jaxllm.engine.load_balancer import (
        OnlineLoadBalancer,
        moe_layer_params,
        slot_counts,
    )
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from sharding.expert_pool import SLOT_WEIGHTS
    from sharding.mesh import ParallelConfig, make_mesh

    if mesh is None:
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=args.devices, moe_expert_parallel_size=args.ep_size))
    work = SkewedMoeWorkload(args, mesh)
    params = work.params
    layers = list(range(args.layers))
    config = MoeLoadBalancerConfig(
        num_slots=args.num_slots,
        layer_updates_per_iter=args.layer_updates_per_iter,
        placement_algorithm=args.algorithm,
        min_imbalance_gain=args.min_gain,
        minimize_moves=minimize_moves,
    )
    balancer = OnlineLoadBalancer(
        config=config, params=params, moe_layers=layers, num_experts=args.experts, ep_size=args.ep_size, mesh=mesh
    )
    balancer.warm_up(params)
    key = jax.random.PRNGKey(args.seed)
    for _ in range(2):  # compile and warm the step
        jax.block_until_ready(work.step_fn(params, key))
    baseline = []  # the same step with no balancer work at all
    for step in range(args.baseline_steps):
        start = time.perf_counter()
        np.asarray(work.step_fn(params, jax.random.fold_in(key, 10**6 + step))[1])
        baseline.append(time.perf_counter() - start)
    imbalance, static, step_seconds, update_steps = [], [], [], []
    layer_update_seconds, layer_dispatch_seconds = [], []
    try:
        for step in range(args.steps):
            if step == args.steps // 2:
                work.switch_hot_set()
            start = time.perf_counter()
            updated = balancer.apply_round(params)
            if updated:
                dispatched = time.perf_counter()
                jax.block_until_ready([moe_layer_params(params, l)[n] for l in updated for n in SLOT_WEIGHTS])
                ready = time.perf_counter()
                layer_dispatch_seconds += [(dispatched - start) / len(updated)] * len(updated)
                layer_update_seconds += [(ready - start) / len(updated)] * len(updated)
                update_steps.append(step)
                start = time.perf_counter()  # the step's own time, without the (timed) update
            counts, loads, _ = work.step_fn(params, jax.random.fold_in(key, step))
            balancer.after_forward(counts)
            loads = np.asarray(loads)
            step_seconds.append(time.perf_counter() - start)
            imbalance.append(float(_imbalance(loads).mean()))
            counts = np.asarray(counts)
            static_loads = [slot_counts(c, work.default_table).reshape(args.ep_size, -1).sum(-1) for c in counts]
            static.append(float(_imbalance(np.stack(static_loads)).mean()))
            if args.sync_worker:  # deterministic runs (tests): let the worker finish each snapshot
                balancer.worker.wait_idle()
    finally:
        balancer.close()
    stats = balancer.stats
    row_bytes = balancer.pool.row_bytes(0)
    return OnlineRun(
        minimize_moves=minimize_moves,
        imbalance=imbalance,
        static_imbalance=static,
        step_seconds=step_seconds,
        update_steps=update_steps,
        layer_update_seconds=layer_update_seconds,
        layer_dispatch_seconds=layer_dispatch_seconds,
        placement_seconds=list(balancer.worker.stats.seconds),
        rebalances=stats.rebalances,
        slots_rewritten=stats.slots_rewritten,
        bytes_moved=stats.bytes_moved,
        naive_bytes=stats.naive_bytes,
        full_bytes_per_layer=row_bytes * args.num_slots,
        skipped_small_gain=balancer.worker.stats.skipped_small_gain,
        extra=dict(baseline_step_seconds=baseline),
    )


def host_placement_ms(
    num_layers: int, num_experts: int, num_slots: int, ep_size: int, zipf_s: float, *, switched: bool, seed: int = 0
) -> float:
    """Worker time (ms per layer) to plan every layer at a given scale from synthetic Zipf loads: the
    tables fitted to one set of loads, then planned for drifted loads (or, `switched`, a new hot set)."""
    from sharding.eplb.online import PlacementWorker
    from sharding.eplb.placement import greedy_placement

    rng = np.random.default_rng(seed)
    loads = np.stack([np.exp(zipf_bias(num_experts, zipf_s, rng)) * 1e4 for _ in range(num_layers)])
    tables = {l: greedy_placement(loads[l], num_slots, ep_size) for l in range(num_layers)}
    if switched:
        later = np.stack([np.exp(zipf_bias(num_experts, zipf_s, rng)) * 1e4 for _ in range(num_layers)])
    else:
        later = loads * rng.lognormal(0.0, 0.2, loads.shape)
    worker = PlacementWorker(num_slots=num_slots, ep_size=ep_size)
    try:
        start = time.perf_counter()
        worker.plan(later, tables, list(range(num_layers)))
        return 1e3 * (time.perf_counter() - start) / num_layers
    finally:
        worker.close()


def moving_average(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    c = np.cumsum(np.insert(v, 0, 0.0))
    out = np.empty_like(v)
    for i in range(v.size):
        lo = max(0, i - window + 1)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def steps_to_recover(values: list[float], switch: int, window: int, target: float) -> Optional[int]:
    """Steps after `switch` until the trailing `window`-step mean (of steps after the switch only) is <= target."""
    after = moving_average(values[switch:], window)
    hits = np.flatnonzero(after[window - 1 :] <= target)
    return int(hits[0]) + window - 1 + 1 if hits.size else None


def steady_state(values: list[float], start: int, stop: int) -> float:
    """Mean over the last quarter of [start, stop)."""
    return float(np.mean(values[start + 3 * (stop - start) // 4 : stop]))


def summarize(run: OnlineRun, args: argparse.Namespace) -> dict:
    half = args.steps // 2
    per_rebalance = run.bytes_moved / max(run.rebalances, 1)
    quiet = [t for s, t in enumerate(run.step_seconds) if s not in set(run.update_steps)]
    return dict(
        minimize_moves=run.minimize_moves,
        steady_before=steady_state(run.imbalance, 0, half),
        steady_after=steady_state(run.imbalance, half, args.steps),
        static_before=steady_state(run.static_imbalance, 0, half),
        static_after=steady_state(run.static_imbalance, half, args.steps),
        recover_steps=steps_to_recover(run.imbalance, half, args.window, args.target),
        first_settle_steps=steps_to_recover(run.imbalance, 0, args.window, args.target),
        rebalances=run.rebalances,
        skipped_small_gain=run.skipped_small_gain,
        slots_rewritten=run.slots_rewritten,
        bytes_per_rebalance=per_rebalance,
        naive_bytes_per_rebalance=run.naive_bytes / max(run.rebalances, 1),
        full_layer_bytes=run.full_bytes_per_layer,
        placement_ms_per_snapshot=1e3 * statistics.median(run.placement_seconds) if run.placement_seconds else None,
        placement_ms_per_layer=(
            1e3 * statistics.median(run.placement_seconds) / args.layers if run.placement_seconds else None
        ),
        layer_update_ms=1e3 * statistics.median(run.layer_update_seconds) if run.layer_update_seconds else None,
        layer_dispatch_ms=1e3 * statistics.median(run.layer_dispatch_seconds) if run.layer_dispatch_seconds else None,
        step_ms=1e3 * statistics.median(quiet) if quiet else None,
        step_ms_with_update=(
            1e3 * statistics.median([run.step_seconds[s] for s in run.update_steps]) if run.update_steps else None
        ),
        baseline_step_ms=(
            1e3 * statistics.median(run.extra["baseline_step_seconds"])
            if run.extra.get("baseline_step_seconds")
            else None
        ),
    )


def plot(runs: list[OnlineRun], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=100)
    steps = np.arange(args.steps)
    ax.plot(
        steps, moving_average(runs[0].static_imbalance, args.window), color="tab:gray", label="static default placement"
    )
    for run, color in zip(runs, ("tab:blue", "tab:orange")):
        label = "online, move-minimizing" if run.minimize_moves else "online, raw placements"
        ax.plot(steps, moving_average(run.imbalance, args.window), color=color, label=label)
    ax.axvline(args.steps // 2, color="k", linestyle=":", label="hot set switched")
    ax.axhline(args.target, color="tab:red", linestyle="--", linewidth=1, label=f"target {args.target:g}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"imbalance (max-mean)/mean, {args.window}-step mean")
    ax.set_yscale("log")
    ax.set_title(
        f"Online EPLB: Zipf s={args.zipf_s:g}, {args.experts} experts / {args.num_slots} slots, "
        f"EP {args.ep_size}, {args.layers} layers, k={args.layer_updates_per_iter}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxllm bench eplb-online", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--num-slots", type=int, default=72, help="expert slots (redundant ones replicate hot experts)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per step and layer")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--moe-intermediate-size", type=int, default=32)
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--noise", type=float, default=1.28, help="std of the router's input-dependent logit noise")
    p.add_argument("--steps", type=int, default=400, help="steps; the hot set switches at steps // 2")
    p.add_argument("--layer-updates-per-iter", type=int, default=1)
    p.add_argument("--algorithm", default="greedy")
    p.add_argument("--min-gain", type=float, default=0.02, help="skip updates with a smaller predicted gain")
    p.add_argument("--target", type=float, default=0.10, help="imbalance a recovery must reach")
    p.add_argument("--window", type=int, default=10, help="steps of the moving average")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sync-worker", action="store_true", help="wait for the placement worker after each step (reproducible runs)"
    )
    p.add_argument("--no-compare", action="store_true", help="skip the run without the move-minimizing mapping")
    p.add_argument("--baseline-steps", type=int, default=20, help="steps timed before, with no balancer")
    p.add_argument(
        "--host-scale",
        default="58,256,288,32",
        metavar="L,E,S,EP",
        help="also time the host placement alone at this scale (DeepSeek-V3: 58 MoE layers, 256 "
        "experts, 288 slots, EP 32); empty to skip",
    )
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--json", action="store_true")
    return p


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"Online EPLB: Zipf s={args.zipf_s} over {args.experts} experts, {args.num_slots} slots, EP {args.ep_size}, "
        f"top-{args.top_k}, {args.layers} layers, {args.tokens} tokens/step, k={args.layer_updates_per_iter} "
        f"layers/step, {args.algorithm}, min gain {args.min_gain}; hot set switched at step {args.steps // 2}"
    )
    names = [("online, min-moves" if r["minimize_moves"] else "online, raw") for r in rows]
    print(f"{'':<38}" + "".join(f"{n:>18}" for n in names))
    lines = [
        ("static placement imbalance (before/after)", lambda r: f"{r['static_before']:.3f}/{r['static_after']:.3f}"),
        ("steady-state imbalance (before/after)", lambda r: f"{r['steady_before']:.3f}/{r['steady_after']:.3f}"),
        (f"steps to recover (<= {args.target:g})", lambda r: _fmt(r["recover_steps"])),
        ("rebalances (layer updates)", lambda r: _fmt(r["rebalances"])),
        ("updates skipped (small gain)", lambda r: _fmt(r["skipped_small_gain"])),
        ("KiB moved per rebalance", lambda r: f"{r['bytes_per_rebalance'] / 1024:.1f}"),
        ("KiB per rebalance, raw placement", lambda r: f"{r['naive_bytes_per_rebalance'] / 1024:.1f}"),
        ("KiB of every slot of a layer", lambda r: f"{r['full_layer_bytes'] / 1024:.1f}"),
        ("host placement ms / snapshot", lambda r: _fmt(r["placement_ms_per_snapshot"])),
        ("host placement ms / layer", lambda r: _fmt(r["placement_ms_per_layer"])),
        ("layer update ms (dispatch)", lambda r: _fmt(r["layer_dispatch_ms"])),
        ("layer update ms (weights on devices)", lambda r: _fmt(r["layer_update_ms"])),
        ("step ms, no balancer (median)", lambda r: _fmt(r["baseline_step_ms"])),
        ("step ms, balancer on, no update", lambda r: _fmt(r["step_ms"])),
        ("step ms, balancer on, update step", lambda r: _fmt(r["step_ms_with_update"])),
    ]
    for label, cell in lines:
        print(f"{label:<38}" + "".join(f"{cell(r):>18}" for r in rows))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import jax

    if len(jax.devices()) < args.devices:
        if jax.default_backend() != "cpu" or os.environ.get("_JAXLLM_BENCH_EPLB_ONLINE_CHILD"):
            print(
                f"jaxllm bench eplb-online: {args.devices} devices needed, {len(jax.devices())} visible",
                file=sys.stderr,
            )
            return 2
        env = dict(
            os.environ,
            _JAXLLM_BENCH_EPLB_ONLINE_CHILD="1",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={args.devices}".strip(),
        )
        return subprocess.call(
            [sys.executable, "-m", "jaxllm.bench.eplb_online", *(argv if argv is not None else sys.argv[1:])], env=env
        )
    runs = [run_online(args, minimize_moves=True)]
    if not args.no_compare:
        runs.append(run_online(args, minimize_moves=False))
    rows = [summarize(r, args) for r in runs]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_table(rows, args)
    if args.host_scale:
        layers, experts, slots, ep = (int(v) for v in args.host_scale.split(","))
        for switched in (False, True):
            ms = host_placement_ms(layers, experts, slots, ep, args.zipf_s, switched=switched, seed=args.seed)
            what = "hot set switched" if switched else "loads drifted"
            print(
                f"host placement at {layers} layers x {experts} experts / {slots} slots, EP {ep} ({what}): "
                f"{ms:.2f} ms per layer, {ms * layers:.0f} ms per snapshot"
            )
    if args.plot:
        plot(runs, args, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
