"""Section 3: kernel speed against the measured roofline and the launch cost model.

Decode attention (Llama-3-8B heads: 32 q / 8 kv, head_dim 128, pages of 16, bf16) at
batch 1/16/64/256 and context 1k/8k: GB/s of the unique bytes a step must read (every
live K/V row once) and its share of the measured copy bandwidth, for the Triton kernel,
the Mosaic GPU kernel (Hopper) and JAX's `paged_attention` as the peer. MoE grouped FFN
(Qwen3-30B-A3B: 128 experts, top 8, 2048 x 768; then Mixtral-8x7B) at 1/16/64/256/2048
tokens: TFLOP/s of the useful FLOPs and the share of the measured dense bf16 matmul, for
the Triton kernels (sorted rows; fused gather/combine), Mosaic GPU, tokamax, next to
`jax.lax.ragged_dot` and a dense per-expert loop (every expert's FFN over a fixed
capacity of rows: the padded-batch way). Quantized weights (`jaxllm.bench.kernels_quant`): the
FP8 / int4 GEMM kernel against XLA's dequantize + dot at DeepSeek-V3 / Qwen3-30B-A3B projection
shapes, and the FP8 fused grouped FFN against dequantizing every expert + the bf16 kernel.

Timings come from `jaxllm.bench.kernels` (compile, two warm-up calls, then the median of
several timed loops of back-to-back calls, each loop ended by `block_until_ready`). Each
row carries the cost model's roofline time for the same launch
(`pallas_kernels.cost_model`, `cost_model_mosaic`), computed on the measured ceilings
rather than datasheet numbers, so `model_ms / ms` is the share of the modelled ideal.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench import kernels as kbench
from jaxllm.bench import kernels_quant
from jaxllm.bench.gpu.environment import ceilings_of
from jaxllm.bench.gpu.report import SectionContext, Table
from jaxllm.models.backends import gpu_kernel_flavour
from pallas_kernels import cost_model, cost_model_mosaic, cost_model_quant

LLAMA_ATTENTION = cost_model.AttentionShape("Llama-3-8B", 32, 8, 128)
TINY_ATTENTION = cost_model.AttentionShape("tiny", 4, 2, 64)
MOE_SHAPES = (
    cost_model.MoeShape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    cost_model.MoeShape("Mixtral-8x7B", 8, 2, 4096, 14336),
)
TINY_MOE = cost_model.MoeShape("tiny", 8, 2, 64, 96)
TPB = 16
SPEED_PARTS = ("attention", "moe", "quant")  # what --speed-parts selects
MOE_MATMUL_GOAL = 60.0  # % of the dense bf16 matmul at the largest token count


@dataclass(frozen=True)
class SpeedPlan:
    attention: tuple[tuple[int, int], ...]  # (batch, context)
    attention_shape: cost_model.AttentionShape
    moe_tokens: tuple[int, ...]
    moe_shapes: tuple[cost_model.MoeShape, ...]


def plan(dry_run: bool) -> SpeedPlan:
    if dry_run:
        return SpeedPlan(((4, 64),), TINY_ATTENTION, (12,), (TINY_MOE,))
    return SpeedPlan(
        tuple((b, c) for c in (1024, 8192) for b in (1, 16, 64, 256)),
        LLAMA_ATTENTION,
        (1, 16, 64, 256, 2048),
        MOE_SHAPES,
    )


def _gpu_spec(ceil: kbench.Ceilings) -> cost_model.GpuSpec:
    """The cost model's roofline on the measured ceilings (SM count of an H100/H200)."""
    return cost_model.GpuSpec("measured", 132, ceil.bytes_per_s, ceil.flops_per_s)


def _model_ms(costs: list[cost_model.LaunchCost], gpu: cost_model.GpuSpec) -> float:
    return 1e3 * sum(c.roofline_s(gpu) for c in costs)


def _settings(dry_run: bool, interpret: bool) -> kbench.Settings:
    return kbench.Settings(
        interpret=interpret,
        iters=1 if dry_run else 10,
        reps=1 if dry_run else 3,
        tokens_per_block=TPB,
        sweep=False,
        max_ragged_dot_rows=1024,
    )


def _quietly(fn: Callable, *args, **kwargs) -> None:
    """`jaxllm.bench.kernels` prints its own rows; this report prints its own tables instead."""
    with contextlib.redirect_stdout(io.StringIO()):
        fn(*args, **kwargs)


def attention_speed(
    ctx: SectionContext,
    table: Table,
    s: kbench.Settings,
    ceil: kbench.Ceilings,
    shape: cost_model.AttentionShape,
    batch: int,
    context: int,
) -> None:
    case = kbench.AttentionCase(
        f"decode B={batch} ctx={context}",
        (1,) * batch,
        (context,) * batch,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    first = len(s.rows)
    _quietly(kbench.bench_attention, s, ceil, case, peer="paged_attention")
    gpu = _gpu_spec(ceil)
    cost_batch = cost_model.decode_batch(batch, context, max_kv_len=-(-context // TPB) * TPB)
    predicted = {
        "pallas": _model_ms(cost_model.attention_costs(shape, cost_batch, tokens_per_block=TPB), gpu),
        "mosaic": _model_ms(cost_model_mosaic.mosaic_attention_costs(shape, cost_batch, tokens_per_block=TPB), gpu),
    }
    for row in s.rows[first:]:
        impl = {"pallas": "triton"}.get(row.impl, row.impl)
        model_ms = predicted.get(row.impl)
        table.add(
            batch=batch,
            context=context,
            impl=impl,
            ms=row.ms,
            gb_s=row.gbps,
            pct_copy_bw=100 * row.gbps * 1e9 / ceil.bytes_per_s,
            model_ms=model_ms,
            pct_of_model=100 * model_ms / row.ms if model_ms and row.ms == row.ms else None,
            rel_err=row.rel_err,
            note=row.note,
        )


def dense_expert_loop(capacity: int) -> Callable:
    """Every expert's SwiGLU FFN over `capacity` rows starting at its group's offset (a
    `lax.fori_loop` over experts, dense matmuls of a fixed shape), rows past the group
    masked: the padded-batch formulation, E * capacity rows of work."""

    def moe(x_sorted, group_sizes, w_gate, w_up, w_down):
        rows, hidden = x_sorted.shape
        padded = jnp.pad(x_sorted, ((0, capacity), (0, 0)))
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)[:-1].astype(jnp.int32)])

        def expert(e, out):
            x = jax.lax.dynamic_slice_in_dim(padded, offsets[e], capacity)
            f32 = jnp.float32
            h = jax.nn.silu(jnp.dot(x, w_gate[e], preferred_element_type=f32)) * jnp.dot(
                x, w_up[e], preferred_element_type=f32
            )
            y = jnp.dot(h.astype(x.dtype), w_down[e], preferred_element_type=f32)
            y = jnp.where((jnp.arange(capacity) < group_sizes[e])[:, None], y, 0.0)
            return jax.lax.dynamic_update_slice_in_dim(
                out, jax.lax.dynamic_slice_in_dim(out, offsets[e], capacity) + y, offsets[e], 0
            )

        out = jax.lax.fori_loop(0, group_sizes.shape[0], expert, jnp.zeros((rows + capacity, hidden), jnp.float32))
        return out[:rows].astype(x_sorted.dtype)

    return moe


def moe_speed(
    ctx: SectionContext,
    table: Table,
    s: kbench.Settings,
    ceil: kbench.Ceilings,
    shape: cost_model.MoeShape,
    tokens: int,
) -> None:
    case = kbench.MoeCase(shape.name, tokens, shape.num_experts, shape.top_k, shape.hidden, shape.inter)
    first = len(s.rows)
    _quietly(kbench.bench_moe, s, ceil, case)
    gpu = _gpu_spec(ceil)
    rows_of = {(r.kernel, r.impl): r for r in s.rows[first:]}
    predicted = {
        ("moe_grouped_ffn", "pallas"): _model_ms(
            [c for c in cost_model.moe_costs(shape, tokens, fused=False) if c.kernel != "moe_xla_glue"], gpu
        ),
        ("moe_fused_ffn", "pallas"): _model_ms(cost_model.moe_costs(shape, tokens), gpu),
        ("moe_grouped_ffn", "mosaic"): _model_ms(
            [c for c in cost_model_mosaic.mosaic_moe_costs(shape, tokens) if c.kernel != "moe_xla_glue"], gpu
        ),
    }
    ctx.check_time("the dense per-expert loop")
    args, _ = kbench.moe_inputs(case, jnp.bfloat16, s.seed)
    sizes = np.asarray(jax.device_get(args[1]))
    capacity = int(sizes.max())
    nbytes = float(np.count_nonzero(sizes)) * 3 * shape.hidden * shape.inter * 2
    flops = 6.0 * tokens * shape.top_k * shape.hidden * shape.inter
    with contextlib.redirect_stdout(io.StringIO()):
        kbench.record_timing(
            s,
            ceil,
            "moe_grouped_ffn",
            case.name,
            "dense per-expert loop",
            jax.jit(dense_expert_loop(capacity)),
            args,
            nbytes,
            flops,
            note=f"capacity {capacity} rows x {shape.num_experts} experts",
        )
    rows_of[("moe_grouped_ffn", "dense per-expert loop")] = s.rows[-1]
    for (kernel, impl), row in rows_of.items():
        name = ("triton fused" if kernel == "moe_fused_ffn" else "triton") if impl == "pallas" else impl
        model_ms = predicted.get((kernel, impl))
        table.add(
            model=shape.name,
            tokens=tokens,
            impl=name,
            ms=row.ms,
            tflops=row.tflops,
            pct_matmul=100 * row.tflops * 1e12 / ceil.flops_per_s,
            gb_s=row.gbps,
            model_ms=model_ms,
            pct_of_model=100 * model_ms / row.ms if model_ms and row.ms == row.ms else None,
            rel_err=row.rel_err,
            note=row.note,
        )


def quant_speed(table: Table, s: kbench.Settings, ceil: kbench.Ceilings, bench: Callable, case) -> None:
    """One quantized-weight case: the kernel's row and its XLA peer's, with the cost model's
    roofline time for the kernel's launch on the measured ceilings."""
    first = len(s.rows)
    _quietly(bench, s, ceil, case)
    gpu = _gpu_spec(ceil)
    model_ms = None
    if isinstance(case, kernels_quant.QuantGemmCase):
        shape = cost_model_quant.GemmShape(case.name, case.k, case.n)
        model_ms = _model_ms(cost_model_quant.quantized_matmul_costs(shape, case.m, case.kind)[:1], gpu)
    for row in s.rows[first:]:
        table.add(
            kernel=row.kernel,
            case=row.case,
            impl=row.impl,
            ms=row.ms,
            gb_s=row.gbps,
            pct_copy_bw=100 * row.gbps * 1e9 / ceil.bytes_per_s,
            tflops=row.tflops,
            model_ms=model_ms if row.impl == "pallas" else None,
            rel_err=row.rel_err,
            note=row.note,
        )


def default_flavour(interpret: bool) -> str:
    """The Pallas kernels `auto` runs here: Mosaic GPU on Hopper, else Triton."""
    return "triton" if interpret or jax.default_backend() != "gpu" else gpu_kernel_flavour(jax.devices()[0])


def goal_rows(attention: list[dict], moe: list[dict], flavour: str) -> list[dict]:
    """The kernel goals from the tables' rows: the default Pallas decode attention at or above
    JAX's `paged_attention` at every batch and context; the default grouped FFN at
    `MOE_MATMUL_GOAL`% of the dense matmul at its largest token count, and ahead of
    `lax.ragged_dot` at the largest count ragged_dot ran."""
    rows = []
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in attention:
        by_case.setdefault((r["batch"], r["context"]), {})[r["impl"]] = r
    for (batch, context), impls in sorted(by_case.items()):
        ours = impls.get(flavour, {}).get("gb_s")
        peer = next((r.get("gb_s") for impl, r in impls.items() if "paged_attention" in impl), None)
        met = None if ours is None or peer is None or ours != ours or peer != peer else ours >= peer
        case = f"batch {batch} context {context} ({flavour})"
        rows.append(dict(goal="decode attention GB/s", case=case, target=f">= paged_attention {peer}", value=ours))
        rows[-1]["met"] = met
    grouped = "mosaic" if flavour == "mosaic" else "triton"
    for model in dict.fromkeys(r["model"] for r in moe):
        mine = {r["tokens"]: r for r in moe if r["model"] == model and r["impl"] == grouped}
        ragged = {r["tokens"]: r for r in moe if r["model"] == model and r["impl"] == "jax.lax.ragged_dot x3"}
        if mine:
            tokens = max(mine)
            value = mine[tokens].get("pct_matmul")
            rows.append(dict(goal="MoE grouped FFN % of dense matmul", case=f"{model} {tokens} tokens ({grouped})"))
            rows[-1].update(
                target=f">= {MOE_MATMUL_GOAL:.0f}", value=value, met=None if value is None else value >= MOE_MATMUL_GOAL
            )
        timed = [t for t, r in ragged.items() if r.get("ms") is not None and t in mine]
        if timed:
            tokens = max(timed)
            speedup = ragged[tokens]["ms"] / mine[tokens]["ms"] if mine[tokens].get("ms") else None
            rows.append(dict(goal="MoE grouped FFN speed-up over ragged_dot", case=f"{model} {tokens} tokens"))
            rows[-1].update(target="> 1 (well ahead)", value=speedup, met=None if speedup is None else speedup > 1)
    return rows


def run(ctx: SectionContext) -> None:
    ceil = ceilings_of(ctx)
    p = plan(ctx.options.dry_run)
    s = _settings(ctx.options.dry_run, ctx.options.interpret)
    ctx.data.update(
        copy_bytes_per_s=ceil.bytes_per_s,
        matmul_flops_per_s=ceil.flops_per_s,
        iters=s.iters,
        reps=s.reps,
        tokens_per_block=TPB,
        attention_shape=p.attention_shape.name,
    )
    attention = ctx.table(
        f"Decode attention ({p.attention_shape.name}: {p.attention_shape.num_q_heads} q / "
        f"{p.attention_shape.num_kv_heads} kv heads, head_dim {p.attention_shape.head_dim}, bf16)",
        ("batch", "context", "impl", "ms", "gb_s", "pct_copy_bw", "model_ms", "pct_of_model", "rel_err", "note"),
    )
    parts = set(ctx.options.speed_parts or SPEED_PARTS)
    with ctx.share(0.45 if parts - {"attention"} else 1.0):  # the rest for MoE
        for batch, context in p.attention if "attention" in parts else ():
            ctx.check_time("the next attention case")
            ctx.run_case(
                f"attention batch {batch} context {context}",
                functools.partial(attention_speed, ctx, attention, s, ceil, p.attention_shape, batch, context),
            )
    moe = ctx.table(
        "MoE grouped FFN (bf16)",
        (
            "model",
            "tokens",
            "impl",
            "ms",
            "tflops",
            "pct_matmul",
            "gb_s",
            "model_ms",
            "pct_of_model",
            "rel_err",
            "note",
        ),
    )
    with ctx.share(0.7 if "quant" in parts else 1.0):  # the rest for the quantized-weight kernels
        for shape in p.moe_shapes if "moe" in parts else ():
            for tokens in p.moe_tokens:
                ctx.check_time("the next MoE case")
                ctx.run_case(
                    f"moe {shape.name} {tokens} tokens", functools.partial(moe_speed, ctx, moe, s, ceil, shape, tokens)
                )
    quant = ctx.table(
        "Quantized weights: Pallas kernels against XLA dequantize + compute (bf16 activations)",
        ("kernel", "case", "impl", "ms", "gb_s", "pct_copy_bw", "tflops", "model_ms", "rel_err", "note"),
    )
    gemms, moes = kernels_quant.quant_gemm_cases(ctx.options.dry_run), kernels_quant.moe_fp8_cases(ctx.options.dry_run)
    if not ctx.options.dry_run:  # decode and a small batch first: the bandwidth-bound cases the kernels are for
        gemms = sorted(gemms, key=lambda c: c.m)
    steps = [(f"quantized matmul {c.name} {c.kind} M={c.m}", kernels_quant.bench_quantized_matmul, c) for c in gemms]
    steps += [(f"moe fp8 {c.name} T={c.num_tokens}", kernels_quant.bench_moe_fp8, c) for c in moes]
    if "quant" not in parts:
        steps = []
    for name, bench, case in steps:
        ctx.check_time("the next quantized-weight case")
        ctx.run_case(name, functools.partial(quant_speed, quant, s, ceil, bench, case))
    goals = ctx.table("Goals", ("goal", "case", "target", "value", "met"))
    for row in goal_rows(attention.rows, moe.rows, default_flavour(ctx.options.interpret)):
        goals.add(**row)
    failed = [r for r in s.rows if r.note.startswith("failed")]
    ctx.data["failed_runs"] = [f"{r.kernel} {r.case} {r.impl}: {r.note}" for r in failed]
