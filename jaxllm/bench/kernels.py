"""GPU timings of the Pallas kernels next to their peers, against measured device ceilings.

Ceilings are measured on the device, not taken from a datasheet: HBM bandwidth from a
large elementwise copy (read + write), bf16 FLOP/s from a large dense matmul. Each row
reports the achieved rate and its share of the ceiling that bounds the case: bandwidth
when the case's arithmetic intensity is below the ridge point (decode attention, MoE at
small batch), FLOP/s above it (prefill, MoE at large batch). Bytes are the unique bytes
the case must move (K/V of every live token once; each active expert's weights once);
FLOPs count only useful work (causal pairs; real rows).

On Hopper the Mosaic GPU kernels get rows of their own next to the Triton ones (`pallas`),
and MoE a `tokamax` row when tokamax is installed.

Peers on the same inputs: JAX's `pallas.ops.gpu.paged_attention` for decode, the XLA
reference (the engine's `xla` backend) for prefill and mixed batches, and
`jax.lax.ragged_dot` (the MoE reference) for MoE. Each row also prints the relative
error against that peer, so a first run on a new GPU doubles as a correctness check.

    jaxllm bench kernels                 # everything (needs a GPU)
    jaxllm bench kernels --only moe --json out.json
    jaxllm bench kernels --only quant     # FP8 / int4 GEMM and FP8 grouped FFN against XLA dequantize + dot
    jaxllm bench kernels --smoke         # tiny shapes, CPU interpret mode
    jaxllm bench kernels --cost-model    # no GPU: grid, working CTAs, bytes, FLOPs, roofline
                                         # on H100/H200 datasheet numbers (pallas_kernels/cost_model.py)
    jaxllm bench kernels --cost-model --kernels mosaic   # the same for the Mosaic GPU (Hopper) kernels
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench.kernel_timing import (  # noqa: F401 - re-exported for the GPU report
    Ceilings,
    Row,
    Settings,
    format_row,
    header,
    measure_ceilings,
    on_hopper,
    record_timing,
)

# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionCase:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


def _attention_inputs(case: AttentionCase, tpb: int, dtype, seed: int) -> dict[str, jax.Array]:
    """Device-resident inputs (one jitted generator); every sequence owns distinct pages
    of a shuffled pool."""
    num_seqs = len(case.q_lens)
    max_blocks = max(-(-kv // tpb) for kv in case.kv_lens)
    num_blocks = num_seqs * max_blocks
    cache_shape = (case.num_kv_heads, num_blocks, tpb, case.head_dim)
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1:] = np.cumsum(case.q_lens)
    q_shape = (int(cu[-1]), case.num_q_heads, case.head_dim)

    @jax.jit
    def generate(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return (
            jax.random.normal(k1, q_shape, dtype),
            jax.random.normal(k2, cache_shape, dtype),
            jax.random.normal(k3, cache_shape, dtype),
            jax.random.permutation(k4, num_blocks).astype(jnp.int32).reshape(num_seqs, max_blocks),
        )

    q, k_cache, v_cache, block_tables = generate(jax.random.PRNGKey(seed))
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        kv_lens=jnp.asarray(case.kv_lens, jnp.int32),
        block_tables=block_tables,
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
    )


def _attention_cost(case: AttentionCase, itemsize: int) -> tuple[float, float]:
    """(unique bytes: each live K/V row once, q and out once; useful causal FLOPs)."""
    d, hq, hkv = case.head_dim, case.num_q_heads, case.num_kv_heads
    kv_bytes = sum(case.kv_lens) * hkv * d * 2 * itemsize
    q_bytes = 2 * sum(case.q_lens) * hq * d * itemsize
    pairs = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(case.q_lens, case.kv_lens))
    return kv_bytes + q_bytes, 4.0 * hq * d * pairs


def _jax_paged_splits(pages_per_seq: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) satisfying JAX paged_attention's divisibility rules."""
    k_splits = 16
    while pages_per_seq % k_splits:
        k_splits //= 2
    per_split = pages_per_seq // k_splits
    ppcb = 8
    while per_split % ppcb:
        ppcb //= 2
    return k_splits, ppcb


def bench_attention(s: Settings, ceil: Ceilings, case: AttentionCase, *, peer: str) -> None:
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
    from pallas_kernels.ragged_paged_attention.kernel import plan_launches
    from pallas_kernels.ragged_paged_attention.tiling import AttentionTiling, default_tiling

    dtype = jnp.bfloat16
    tpb = s.tokens_per_block
    inputs = _attention_inputs(case, tpb, dtype, s.seed)
    nbytes, flops = _attention_cost(case, jnp.dtype(dtype).itemsize)
    sm_scale = case.head_dim**-0.5
    names = ("q", "k_cache", "v_cache", "kv_lens", "block_tables", "cu_q_lens", "num_seqs")
    args = tuple(inputs[k] for k in names)

    ref_out = None
    if peer == "paged_attention":
        with warnings.catch_warnings():  # deprecated in favour of tokamax on jax >= 0.11; still our decode peer
            warnings.filterwarnings(
                "ignore",
                message="jax.experimental.pallas.ops.gpu.paged_attention is deprecated",
                category=DeprecationWarning,
            )
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        k_splits, ppcb = _jax_paged_splits(inputs["block_tables"].shape[1])
        peer_fn = jax.jit(
            lambda q, k, v, bt, lens: paged_attention(
                q * jnp.asarray(sm_scale, q.dtype),
                k,
                v,
                bt,
                lens,
                k_splits=k_splits,
                pages_per_compute_block=ppcb,
                interpret=s.interpret,
            )
        )
        ref_out = record_timing(
            s,
            ceil,
            "paged_attention",
            case.name,
            "jax.pallas.ops.gpu.paged_attention",
            peer_fn,
            (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["kv_lens"]),
            nbytes,
            flops,
            note=f"k_splits={k_splits} pages/block={ppcb}",
        )
    else:
        peer_fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))
        ref_out = record_timing(s, ceil, "paged_attention", case.name, "xla reference", peer_fn, args, nbytes, flops)

    shape_args = (
        args[0].shape[0],
        len(case.q_lens),
        case.num_q_heads,
        case.num_kv_heads,
        case.head_dim,
        inputs["block_tables"].shape[1] * tpb,
        jnp.dtype(dtype).itemsize,
    )
    base = default_tiling(*shape_args)
    # The default (None): the engine's launch plan, two launches for a mixed bucket.
    tilings: list[Optional[AttentionTiling]] = [None]
    if s.sweep:
        tilings += [
            AttentionTiling(base.block_m, base.block_k, n, base.num_warps, base.num_stages) for n in (1, 2, 4, 8, 16)
        ]
    for tiling in tilings:
        fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale, interpret=s.interpret, tiling=tiling))
        launches = plan_launches(*shape_args, tiling=tiling)
        note = "; ".join(
            f"block_m={la.tiling.block_m} block_k={la.tiling.block_k} splits<={la.tiling.num_kv_splits}"
            for la in launches
        )
        record_timing(s, ceil, "ragged_paged_attention", case.name, "pallas", fn, args, nbytes, flops, ref_out, note)
    if on_hopper(s):
        from pallas_kernels.ragged_paged_attention.mosaic_gpu import (
            default_num_kv_splits,
            ragged_paged_attention_mosaic,
        )

        fn = jax.jit(functools.partial(ragged_paged_attention_mosaic, sm_scale=sm_scale))
        splits = default_num_kv_splits(
            args[0].shape[0], len(case.q_lens), case.num_kv_heads, inputs["block_tables"].shape[1] * tpb, tpb
        )
        record_timing(
            s,
            ceil,
            "ragged_paged_attention",
            case.name,
            "mosaic",
            fn,
            args,
            nbytes,
            flops,
            ref_out,
            f"TMA pages + wgmma, splits={splits}",
        )
    del inputs, args


# ----------------------------------------------------------------------------- MoE


@dataclass(frozen=True)
class MoeCase:
    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int


def moe_inputs(case: MoeCase, dtype, seed: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Random top-k routing (distinct experts per token), generated on device by one jitted
    function: (rows sorted by expert, group sizes, weights) for `moe_grouped_ffn` and
    (tokens, expert ids, routing weights, weights) for `moe_fused_ffn`."""
    e, h, i = case.num_experts, case.hidden, case.inter

    @jax.jit
    def generate(key):
        keys = jax.random.split(key, 5)
        scores = jax.random.uniform(keys[0], (case.num_tokens, e))
        top = jnp.argsort(scores, axis=1)[:, : case.top_k].astype(jnp.int32)
        routing = jax.nn.softmax(jnp.take_along_axis(scores, top, axis=1), axis=1)
        ids = top.reshape(-1)
        group_sizes = jnp.zeros((e,), jnp.int32).at[ids].add(1)
        tokens = jax.random.normal(keys[1], (case.num_tokens, h), dtype)
        x = tokens[jnp.argsort(ids, stable=True) // case.top_k]
        w_gate = (jax.random.normal(keys[2], (e, h, i), jnp.float32) * h**-0.5).astype(dtype)
        w_up = (jax.random.normal(keys[3], (e, h, i), jnp.float32) * h**-0.5).astype(dtype)
        w_down = (jax.random.normal(keys[4], (e, i, h), jnp.float32) * i**-0.5).astype(dtype)
        return (x, group_sizes, w_gate, w_up, w_down), (tokens, top, routing, w_gate, w_up, w_down)

    return generate(jax.random.PRNGKey(seed))


def bench_moe(s: Settings, ceil: Ceilings, case: MoeCase) -> None:
    from pallas_kernels.moe_grouped_gemm import (
        moe_fused_ffn,
        moe_fused_ffn_reference,
        moe_grouped_ffn,
        moe_grouped_ffn_reference,
    )
    from pallas_kernels.moe_grouped_gemm.tiling import default_tiling

    dtype = jnp.bfloat16
    args, fused_args = moe_inputs(case, dtype, s.seed)
    rows = case.num_tokens * case.top_k
    active = int(np.count_nonzero(np.asarray(jax.device_get(args[1]))))
    item = jnp.dtype(dtype).itemsize
    weight_bytes = active * 3 * case.hidden * case.inter * item
    act_bytes = rows * (2 * case.hidden + 2 * case.inter) * item
    nbytes, flops = weight_bytes + act_bytes, 6.0 * rows * case.hidden * case.inter
    name = f"{case.name} T={case.num_tokens}"

    ref_out = None
    if rows <= s.max_ragged_dot_rows:
        ref_out = record_timing(
            s,
            ceil,
            "ragged_dot",
            name,
            "jax.lax.ragged_dot x3",
            jax.jit(moe_grouped_ffn_reference),
            args,
            nbytes,
            flops,
            note=f"active experts {active}/{case.num_experts}",
        )
    else:
        s.rows.append(
            Row("ragged_dot", name, "jax.lax.ragged_dot x3", note=f"skipped: {rows} rows > --max-ragged-dot-rows")
        )
        print(format_row(s.rows[-1]), flush=True)
    tiling = default_tiling(rows, case.num_experts, case.hidden, case.inter)
    fn = jax.jit(functools.partial(moe_grouped_ffn, interpret=s.interpret))
    note = (
        f"block_m={tiling.gate_up.block_m} block_n={tiling.gate_up.block_n}/{tiling.down.block_n} "
        f"split_k={tiling.down.num_k_splits} active experts {active}/{case.num_experts}"
    )
    record_timing(s, ceil, "moe_grouped_ffn", name, "pallas", fn, args, nbytes, flops, ref_out, note)
    # The engine's path: token gather and routing-weighted combine inside the kernels.
    fused_ref = None
    if rows <= s.max_ragged_dot_rows:
        fused_ref = record_timing(
            s,
            ceil,
            "moe_fused_ffn",
            name,
            "ragged_dot x3 + sort/unsort/combine",
            jax.jit(moe_fused_ffn_reference),
            fused_args,
            nbytes,
            flops,
        )
    fn = jax.jit(functools.partial(moe_fused_ffn, interpret=s.interpret))
    record_timing(s, ceil, "moe_fused_ffn", name, "pallas", fn, fused_args, nbytes, flops, fused_ref, note)
    if on_hopper(s):
        from pallas_kernels.moe_grouped_gemm.mosaic_gpu import default_tiling as mosaic_tiling
        from pallas_kernels.moe_grouped_gemm.mosaic_gpu import moe_grouped_ffn_mosaic

        t = mosaic_tiling(rows, case.num_experts, case.hidden, case.inter)
        record_timing(
            s,
            ceil,
            "moe_grouped_ffn",
            name,
            "mosaic",
            jax.jit(moe_grouped_ffn_mosaic),
            args,
            nbytes,
            flops,
            ref_out,
            f"TMA + wgmma block_m={t.gate_up.block_m} n={t.gate_up.block_n}/{t.down.block_n}",
        )
    if not s.interpret and importlib.util.find_spec("tokamax") is not None:
        from jaxllm.models.backends import tokamax_moe

        record_timing(
            s,
            ceil,
            "moe_grouped_ffn",
            name,
            "tokamax ragged_dot x3",
            jax.jit(tokamax_moe()),
            args,
            nbytes,
            flops,
            ref_out,
        )
    del args, fused_args


# ----------------------------------------------------------------------------- cases


def attention_cases(smoke: bool) -> list[tuple[AttentionCase, str]]:
    if smoke:
        return [
            (AttentionCase("decode S=4 ctx<=64", (1,) * 4, (17, 64, 33, 1), 4, 2, 64), "paged_attention"),
            (AttentionCase("mixed 5 prefill + 3 decode", (5, 1, 1, 1), (9, 17, 33, 64), 4, 2, 64), "xla"),
        ]
    cases: list[tuple[AttentionCase, str]] = []
    for num_seqs in (64, 256):
        for ctx in (1024, 8192):
            cases.append(
                (AttentionCase(f"decode S={num_seqs} ctx={ctx}", (1,) * num_seqs, (ctx,) * num_seqs), "paged_attention")
            )
    rng = np.random.default_rng(0)
    ragged = tuple(int(x) for x in rng.integers(128, 4096, 128))
    cases.append((AttentionCase("decode S=128 ctx~U[128,4k)", (1,) * 128, ragged), "paged_attention"))
    for chunk, prefix in ((512, 0), (2048, 0), (2048, 6144)):
        cases.append((AttentionCase(f"prefill chunk={chunk} prefix={prefix}", (chunk,), (chunk + prefix,)), "xla"))
    cases.append(
        (AttentionCase("mixed 512 prefill + 63 decode ctx=4k", (512,) + (1,) * 63, (512,) + (4096,) * 63), "xla")
    )
    return cases


def moe_cases(smoke: bool) -> list[MoeCase]:
    if smoke:
        return [MoeCase("E8 top2 H64 I96", 12, 8, 2, 64, 96)]
    cases = []
    for tokens in (1, 16, 128, 1024, 8192):
        cases.append(MoeCase("E8 top2 H4096 I14336", tokens, 8, 2, 4096, 14336))
        cases.append(MoeCase("E64 top8 H2048 I1408", tokens, 64, 8, 2048, 1408))
        cases.append(MoeCase("E128 top8 H2048 I768", tokens, 128, 8, 2048, 768))
    return cases


# ----------------------------------------------------------------------------- output


def align_columns(header: list[str], rows: list[list[str]], right_aligned: Sequence[int] = ()) -> str:
    """A text table whose column widths come from the content (the widest cell of each column,
    header included); the last column is left unpadded."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            cell.rjust(width) if i in right_aligned else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells[:-1], widths))
        ]
        return " ".join([*padded, cells[-1]]).rstrip()

    return "\n".join(line(cells) for cells in [header, *rows])


def cost_model_table(costs: Sequence[Any], gpus: Sequence[Any]) -> str:
    """The launch cost model's table (`--cost-model`): one row per kernel launch, roofline and
    SM-limited time per GPU; columns as wide as their longest case name or number."""
    header = ["kernel", "case", "grid", "programs", "working", "MB", "GFLOP", "useful%"]
    for g in gpus:
        header += [f"{g.name} us", f"{g.name} SM-lim"]
    header.append("note")
    rows = []
    for c in costs:
        useful = f"{100 * c.useful_flops / c.flops:.0f}" if c.flops and c.useful_flops else "-"
        grid = "x".join(str(x) for x in c.grid) if c.grid else "xla"
        row = [c.kernel, c.case, grid, str(c.programs), str(c.working), f"{c.bytes / 1e6:.2f}", f"{c.flops / 1e9:.2f}"]
        row.append(useful)
        for g in gpus:
            row += [f"{c.roofline_s(g) * 1e6:.1f}", f"{c.sm_limited_s(g) * 1e6:.1f}"]
        rows.append([*row, c.note])
    return align_columns(header, rows, right_aligned=range(3, len(header) - 1))


def _family(kernel: str) -> str:
    """`--only`'s name for a cost-model row: quant (quantized weights and the XLA passes they
    replace), moe or attention."""
    if kernel.endswith("_fp8") or kernel.startswith(("quantized", "xla_")):
        return "quant"
    return "moe" if kernel.startswith("moe") else "attention"


def main(argv: Optional[list[str]] = None) -> int:
    from jaxllm.cli.args import HelpFormatter
    from pallas_kernels.triton_backend import filter_triton_deprecation

    parser = argparse.ArgumentParser(
        prog="jaxllm bench kernels", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes in Pallas interpret mode (runs on CPU; timings meaningless)"
    )
    parser.add_argument("--only", choices=("all", "attention", "moe", "quant"), default="all")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed loop (default 20; smoke 1)")
    parser.add_argument("--reps", type=int, default=None, help="timed loops, median reported (default 3)")
    parser.add_argument("--tokens-per-block", type=int, default=None, help="KV cache page size (default 16)")
    parser.add_argument("--sweep", action="store_true", help="also time every kv-split count for attention")
    parser.add_argument(
        "--max-ragged-dot-rows",
        type=int,
        default=16384,
        help="skip the ragged_dot peer above this many rows (XLA may densify it)",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--kernels",
        choices=("triton", "mosaic", "both"),
        default="triton",
        help="--cost-model: which kernels' launches (mosaic: the Hopper kernels)",
    )
    parser.add_argument(
        "--cost-model",
        action="store_true",
        help="print the launch cost model at real model shapes instead (no GPU needed): grid, "
        "working CTAs, bytes, FLOPs, roofline time on datasheet numbers",
    )
    parser.add_argument(
        "--gpu", choices=("h100", "h200", "both"), default="both", help="datasheet numbers the cost model uses"
    )
    args = parser.parse_args(argv)

    if args.cost_model:
        from pallas_kernels import cost_model

        gpus = [cost_model.GPUS[g] for g in (("h100", "h200") if args.gpu == "both" else (args.gpu,))]
        costs = cost_model.default_cases() if args.kernels in ("triton", "both") else []
        if args.kernels in ("triton", "both"):
            from pallas_kernels import cost_model_quant

            costs += cost_model_quant.default_cases()
        if args.kernels in ("mosaic", "both"):
            from pallas_kernels import cost_model_mosaic

            costs += cost_model_mosaic.default_cases()
        if args.only != "all":
            costs = [c for c in costs if _family(c.kernel) == args.only]
        print(cost_model_table(costs, gpus))
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(
                    [
                        dict(
                            asdict(c),
                            programs=c.programs,
                            **{f"{g.name}_roofline_us": c.roofline_s(g) * 1e6 for g in gpus},
                        )
                        for c in costs
                    ],
                    f,
                    indent=1,
                )
        return 0

    if not args.smoke and jax.default_backend() != "gpu":
        print(
            f"jaxllm bench kernels: no GPU found (jax backend is {jax.default_backend()!r}, devices "
            f"{jax.devices()}). The kernels are GPU kernels; run on a CUDA machine, or pass --smoke "
            "to exercise the benchmark on CPU in interpret mode.",
            file=sys.stderr,
        )
        return 2

    filter_triton_deprecation()  # the peers (JAX's paged_attention) lower through Triton as well
    s = Settings(
        interpret=args.smoke,
        iters=args.iters or (1 if args.smoke else 20),
        reps=args.reps or (1 if args.smoke else 3),
        tokens_per_block=args.tokens_per_block or (16 if not args.smoke else 8),
        sweep=args.sweep,
        max_ragged_dot_rows=args.max_ragged_dot_rows,
    )
    device = jax.devices()[0]
    ceil = measure_ceilings(args.smoke)
    print(
        f"device: {getattr(device, 'device_kind', device.platform)}  jax {jax.__version__}  "
        f"{'interpret mode (smoke)' if args.smoke else 'compiled'}"
    )
    print(
        f"ceilings: copy {ceil.bytes_per_s / 1e9:.0f} GB/s, bf16 matmul {ceil.flops_per_s / 1e12:.1f} TFLOP/s, "
        f"ridge {ceil.ridge:.0f} FLOP/byte"
    )
    print(header())
    if args.only in ("all", "attention"):
        for case, peer in attention_cases(args.smoke):
            bench_attention(s, ceil, case, peer=peer)
    if args.only in ("all", "moe"):
        for moe_case in moe_cases(args.smoke):
            bench_moe(s, ceil, moe_case)
    if args.only in ("all", "quant"):
        from jaxllm.bench import kernels_quant

        kernels_quant.run(s, ceil, args.smoke)

    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "device": str(getattr(device, "device_kind", device.platform)),
                    "jax": jax.__version__,
                    "copy_bytes_per_s": ceil.bytes_per_s,
                    "bf16_flops_per_s": ceil.flops_per_s,
                    "rows": [asdict(r) for r in s.rows],
                },
                f,
                indent=1,
            )
    failed = [r for r in s.rows if r.note.startswith("failed") and r.impl == "pallas"]
    if failed:
        print(f"{len(failed)} pallas kernel run(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
