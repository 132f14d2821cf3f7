"""Step time of the expert-parallel MoE model per dispatch mode and token bucket.

Runs the full model forward (a Qwen3-MoE-shaped random checkpoint) on an EP mesh for
each token bucket and dispatch mode (`all_to_all`, `allgather`; `ragged_all_to_all` where
the platform implements it), with attention tensor-parallel and with attention data-parallel
(`--attention-dp on`: each device its own share of the step's sequences and its own KV
cache; the bucket is the step's tokens over all ranks, T / N per rank), next to the same
model with tensor parallelism only (E = 1, experts' columns split) and on one device, and
prints a table of median step times. Each variant is compiled before it is timed.
On CPU the devices are XLA:CPU's host-platform devices: the benchmark restarts itself
with `--xla_force_host_platform_device_count` when fewer devices are visible.

    jaxllm bench ep --devices 8 --ep-size 8 --buckets 16,64,256,1024 --attention-dp off,on
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxllm bench ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="devices of the mesh (tensor_parallel_size)")
    p.add_argument("--ep-size", type=int, default=8, help="moe_expert_parallel_size (moe_tp = devices / ep)")
    p.add_argument("--buckets", default="16,64,256,1024", help="token buckets, comma-separated")
    p.add_argument("--modes", default="all_to_all,allgather", help="dispatch modes, comma-separated")
    p.add_argument(
        "--attention-dp", default="off,on", help="attention tensor-parallel (off), data-parallel (on), or both (off,on)"
    )
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="also time all_to_all with this capacity factor (drops overflow rows)",
    )
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--moe-intermediate-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--redundant-slots", type=int, default=0, help="extra slots (a placement with replicas)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-baselines", action="store_true", help="skip the one-device and TP-only rows")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    return p


def _hf_config(args: argparse.Namespace) -> dict:
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=1024,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def _step_batch(bucket: int, max_seqs: int, tokens_per_block: int, num_blocks: int, vocab: int):
    """A batch of `max_seqs` sequences filling `bucket` tokens (decode-like for small buckets)."""
    import numpy as np

    from jaxllm.step_batch import StepBatch

    per_seq = max(1, bucket // max_seqs)
    seqs = min(max_seqs, bucket)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, vocab, bucket).astype(np.int32)
    positions = np.zeros(bucket, np.int32)
    slot_mapping = np.full(bucket, num_blocks * tokens_per_block, np.int32)
    blocks_per_seq = -(-per_seq // tokens_per_block)
    block_tables = np.zeros((max_seqs, blocks_per_seq), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    for s in range(seqs):
        lo = s * per_seq
        block_tables[s] = np.arange(s * blocks_per_seq, (s + 1) * blocks_per_seq) % num_blocks
        pos = np.arange(per_seq)
        positions[lo : lo + per_seq] = pos
        slot_mapping[lo : lo + per_seq] = (
            block_tables[s][pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block
        )
        kv_lens[s] = per_seq
        cu[s + 1] = lo + per_seq
    cu[seqs + 1 :] = cu[seqs]
    logits_indices = np.maximum(cu[1:] - 1, 0).astype(np.int32)
    return StepBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu,
        kv_lens=kv_lens,
        block_tables=block_tables,
        num_seqs=np.array([seqs], np.int32),
        logits_indices=logits_indices,
    )


def _time_variant(
    directory: Path,
    config,
    buckets: list[int],
    iters: int,
    *,
    devices: int,
    ep: int,
    mode: Optional[str],
    slot_assignments,
    capacity_factor: Optional[float] = None,
    attention_dp: bool = False,
) -> dict[int, float]:
    import jax

    from jaxllm.models import forward, init_kv_cache, load_params
    from jaxllm.models.backends import resolve_backends
    from jaxllm.models.ep_moe import EpMoeOptions
    from jaxllm.models.kv_cache_spec import init_dp_kv_cache
    from jaxllm.models.parallel.attention_dp import forward_attention_dp, stack_batches
    from jaxllm.models.partitioning import attention_dp_rules
    from sharding import ParallelConfig, make_mesh
    from sharding.rules import param_partition_specs

    mesh = (
        None if devices == 1 else make_mesh(ParallelConfig(tensor_parallel_size=devices, moe_expert_parallel_size=ep))
    )
    tpb, max_seqs = 16, 16
    num_blocks = max_seqs * -(-max(buckets) // (max_seqs * tpb)) + 1
    _, _, attention_fn, moe_fn = resolve_backends("xla", "xla")
    options = EpMoeOptions(dispatch=mode, capacity_factor=capacity_factor) if mode else None
    if attention_dp:
        params = load_params(
            directory,
            config,
            mesh=mesh,
            rules=attention_dp_rules(config, mesh),
            slot_assignments=slot_assignments,
            num_slots=None if slot_assignments else config.num_experts,
        )
        dp_forward = functools.partial(
            forward_attention_dp,
            config=config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=mesh,
            param_specs=param_partition_specs(params),
            moe_options=options,
        )
        step = jax.jit(lambda p, c, b: dp_forward(p, c, b)[:2], donate_argnums=(1,))
        rank_blocks = -(-num_blocks // devices) + 1
        cache = init_dp_kv_cache(config, rank_blocks, tpb, config.dtype, mesh)
    else:
        params = load_params(directory, config, mesh=mesh, slot_assignments=slot_assignments if ep > 1 else None)
        step = jax.jit(
            functools.partial(
                forward, config=config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh, moe_options=options
            ),
            donate_argnums=(1,),
        )
        cache = init_kv_cache(config, num_blocks, tpb, config.dtype, mesh=mesh)
    times = {}
    for bucket in buckets:
        if attention_dp:  # the step's sequences and tokens shared out over the ranks
            seqs = max(1, max_seqs // devices)
            batch = stack_batches(
                [_step_batch(bucket // devices, seqs, tpb, rank_blocks, config.vocab_size) for _ in range(devices)]
            )
        else:
            batch = _step_batch(bucket, max_seqs, tpb, num_blocks, config.vocab_size)
        for _ in range(2):  # compile; the donated cache comes back committed, which may compile once more
            logits, cache = step(params, cache, batch)
            logits.block_until_ready()
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            logits, cache = step(params, cache, batch)
            logits.block_until_ready()
            samples.append(time.perf_counter() - start)
        times[bucket] = statistics.median(samples)
    return times


def run(args: argparse.Namespace) -> list[dict]:
    import jax
    from safetensors.numpy import save_file

    from jaxllm.models import ModelConfig
    from jaxllm.models.random_checkpoint import random_checkpoint
    from sharding.slot_table import default_assignment

    buckets = [int(b) for b in args.buckets.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    choices = {"off": False, "on": True}
    values = [v.strip() for v in args.attention_dp.split(",") if v.strip()]
    if not values or set(values) - set(choices):
        raise ValueError(f"--attention-dp takes off, on or off,on; got {args.attention_dp!r}")
    dp_settings = [choices[v] for v in values]
    if any(dp_settings) and any(b % args.devices for b in buckets):
        raise ValueError(f"--attention-dp on: every bucket must divide over the {args.devices} ranks")
    hf = _hf_config(args)
    config = ModelConfig.from_hf_config(hf)
    placement = None
    if args.redundant_slots:
        slots = list(default_assignment(args.num_experts, args.num_experts, args.ep_size))
        slots += list(range(args.redundant_slots))  # replicate the first experts
        placement = {layer: slots for layer in range(config.num_layers)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "config.json").write_text(json.dumps(hf))
        save_file(random_checkpoint(config, 0), str(directory / "model.safetensors"))
        variants = (
            []
            if args.no_baselines
            else [("1 device", 1, 1, None, None), (f"TP{args.devices} (E=1)", args.devices, 1, None, None)]
        )
        variants = [(*v, False) for v in variants]
        prefix = f"EP{args.ep_size} x T{args.devices // args.ep_size}"
        for dp in dp_settings:
            suffix = " +attn DP" if dp else ""
            variants += [(f"{prefix} {mode}{suffix}", args.devices, args.ep_size, mode, None, dp) for mode in modes]
            if args.capacity_factor:
                variants.append(
                    (
                        f"{prefix} all_to_all cf={args.capacity_factor:g}{suffix}",
                        args.devices,
                        args.ep_size,
                        "all_to_all",
                        args.capacity_factor,
                        dp,
                    )
                )
        for name, devices, ep, mode, factor, dp in variants:
            if mode == "ragged_all_to_all" and jax.default_backend() == "cpu":
                print(
                    f"jaxllm bench ep: skipping {name}: XLA:CPU does not implement ragged_all_to_all", file=sys.stderr
                )
                continue
            times = _time_variant(
                directory,
                config,
                buckets,
                args.iters,
                devices=devices,
                ep=ep,
                mode=mode,
                slot_assignments=placement,
                capacity_factor=factor,
                attention_dp=dp,
            )
            rows.append(
                dict(
                    variant=name,
                    devices=devices,
                    ep=ep,
                    mode=mode or "-",
                    attention_dp=dp,
                    step_ms={b: round(t * 1e3, 3) for b, t in times.items()},
                    platform=jax.default_backend(),
                )
            )
    return rows


def _print_table(rows: list[dict], buckets: list[int]) -> None:
    head = f"{'variant':<32}" + "".join(f"{f'T={b} ms':>12}" for b in buckets)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:<32}" + "".join(f"{r['step_ms'][b]:>12.2f}" for b in buckets))


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.devices % args.ep_size:
        print(f"jaxllm bench ep: --ep-size {args.ep_size} must divide --devices {args.devices}", file=sys.stderr)
        return 2
    import jax

    if len(jax.devices()) < args.devices:
        if jax.default_backend() != "cpu" or os.environ.get("_JAXLLM_BENCH_EP_CHILD"):
            print(f"jaxllm bench ep: {args.devices} devices needed, {len(jax.devices())} visible", file=sys.stderr)
            return 2
        env = dict(
            os.environ,
            _JAXLLM_BENCH_EP_CHILD="1",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={args.devices}".strip(),
        )
        return subprocess.call(
            [sys.executable, "-m", "jaxllm.bench.ep", *(argv if argv is not None else sys.argv[1:])], env=env
        )
    rows = run(args)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print_table(rows, [int(b) for b in args.buckets.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
