"""Section 2: the kernels against their references on the device, at real model shapes.

Attention (Triton and Mosaic GPU ragged paged attention, the latent/MLA variant) runs on
packed batches: decode only, mixed prefill + decode, long prefill; sequences own
distinct pages in random order, block-table entries past a sequence's pages and the
sequence slots past the live ones point at random pages, and a few padding tokens follow
the live ones. Every page no live sequence owns holds NaN in the kernel's cache (finite
values in the reference's), so reading one poisons the output. MoE (Triton grouped,
Triton fused gather/combine, Mosaic GPU, tokamax when importable) runs random top-k
routing with padding rows (sorted path) or padding tokens routed nowhere (fused path).

Quantized weights (`quant_checks`): the FP8 / int4 GEMM kernel and the FP8 grouped FFN
against XLA dequantize-then-compute at DeepSeek-V3 and Qwen3-30B-A3B shapes.

Inputs are bf16; the references accumulate in f32. Error = max |out - ref| over the live
rows, relative = that / max |ref|; a case passes when relative <= tolerance (2e-2 for
bf16), no output is NaN and padding rows are exactly zero. The section fails when any
case does not pass (all cases are still run and reported).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench.gpu import quant_checks
from jaxllm.bench.gpu.report import ChecksFailed, SectionContext, Table
from jaxllm.models.backends import gpu_kernel_flavour, tokamax_moe
from pallas_kernels import mosaic_gpu_interpret
from pallas_kernels.moe_grouped_gemm import moe_fused_ffn, moe_grouped_ffn, moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm import mosaic_gpu as moe_mosaic
from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled
from pallas_kernels.ragged_paged_attention import mosaic_gpu as attention_mosaic
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_latent_attention,
    ragged_paged_latent_attention_reference,
)

BF16_TOL = 2e-2
DENSE_REFERENCE_FLOPS = 2e13  # above this the MoE reference is the tiled XLA FFN (ragged_dot densifies on GPU)


@dataclass(frozen=True)
class AttentionShape:
    model: str
    num_q_heads: int
    num_kv_heads: int  # 1 for a latent cache
    head_dim: int  # latent width for MLA
    value_dim: Optional[int] = None  # MLA: the value columns of the latent rows
    sm_scale_dim: Optional[int] = None  # MLA: 1 / sqrt(qk_nope + qk_rope)


@dataclass(frozen=True)
class Batch:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


@dataclass(frozen=True)
class MoeShape:
    model: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int


def attention_plan(dry_run: bool) -> list[tuple[AttentionShape, Batch]]:
    """(shape, batch) pairs, most informative first (the section may run out of time)."""
    if dry_run:
        gqa = AttentionShape("tiny GQA", 4, 2, 64)
        mla = AttentionShape("tiny MLA", 4, 1, 80, value_dim=64, sm_scale_dim=48)
        mixed = Batch("mixed: 9 prefill after 20 cached + 2 decode", (9, 1, 1), (29, 33, 5))
        return [(gqa, mixed), (mla, mixed)]
    llama = AttentionShape("Llama-3-8B", 32, 8, 128)
    qwen = AttentionShape("Qwen3-30B-A3B", 32, 4, 128)
    mla = AttentionShape("DeepSeek-V3", 128, 1, 576, value_dim=512, sm_scale_dim=192)
    rng = np.random.default_rng(0)
    decode = Batch("decode 64 seqs ctx U[1,4k]", (1,) * 64, tuple(int(x) for x in rng.integers(1, 4096, 64)))
    mixed = Batch("mixed 512 prefill (prefix 1000) + 63 decode ctx 2k", (512,) + (1,) * 63, (1512,) + (2048,) * 63)
    long = Batch("long prefill 4096 + 2048 after 2048 cached", (4096, 2048), (4096, 4096))
    mla_decode = Batch("decode 32 seqs ctx U[1,4k]", (1,) * 32, tuple(int(x) for x in rng.integers(1, 4096, 32)))
    mla_mixed = Batch("mixed 256 prefill + 31 decode ctx 2k", (256,) + (1,) * 31, (256,) + (2048,) * 31)
    return [
        (llama, mixed),
        (llama, decode),
        (mla, mla_decode),
        (qwen, decode),
        (qwen, mixed),
        (llama, long),
        (mla, mla_mixed),
        (qwen, long),
    ]


def moe_plan(dry_run: bool) -> list[tuple[MoeShape, int]]:
    if dry_run:
        return [(MoeShape("tiny MoE", 8, 2, 64, 96), 12)]
    qwen, mixtral, dsv3 = (
        MoeShape("Qwen3-30B-A3B", 128, 8, 2048, 768),
        MoeShape("Mixtral-8x7B", 8, 2, 4096, 14336),
        MoeShape("DeepSeek-V3", 256, 8, 7168, 2048),
    )
    return [(qwen, 64), (mixtral, 64), (qwen, 1024), (dsv3, 32), (mixtral, 1024), (dsv3, 256)]


# ----------------------------------------------------------------------------- inputs

HOST_LIMIT = 1 << 22  # arrays up to this many elements are drawn by numpy (no compile), larger ones on device


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    """bf16 standard normal * scale: numpy for small arrays (the dry run compiles nothing), else on device."""
    if math.prod(shape) <= HOST_LIMIT:
        return jnp.asarray(
            (np.random.default_rng(seed).standard_normal(shape, np.float32) * scale).astype(jnp.bfloat16)
        )
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.bfloat16) * jnp.asarray(scale, jnp.bfloat16)


def poison_pages(cache: jax.Array, unused: np.ndarray) -> jax.Array:
    """NaN in every page of `cache` [Hkv, num_blocks, tpb, D] that `unused` marks."""
    if cache.size <= HOST_LIMIT:
        host = np.array(cache)
        host[:, unused] = np.nan
        return jnp.asarray(host)
    return jnp.where(jnp.asarray(unused)[None, :, None, None], jnp.asarray(jnp.nan, cache.dtype), cache)


def attention_inputs(shape: AttentionShape, batch: Batch, tpb: int, seed: int) -> dict:
    """Packed batch with 3 padding tokens and 2 spare sequence slots; unowned pages NaN for the kernel."""
    rng = np.random.default_rng(seed)
    n = len(batch.q_lens)
    slots, pad_tokens = n + 2, 3
    max_blocks = max(-(-kv // tpb) for kv in batch.kv_lens)
    owned = sum(-(-kv // tpb) for kv in batch.kv_lens)
    num_blocks = owned + max(4, owned // 8)
    pages = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(0, num_blocks, (slots, max_blocks)).astype(np.int32)
    used = 0
    for s, kv in enumerate(batch.kv_lens):
        nb = -(-kv // tpb)
        tables[s, :nb] = pages[used : used + nb]
        used += nb
    unused = np.ones(num_blocks, bool)
    unused[pages[:used]] = False
    cu = np.zeros(slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(batch.q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.zeros(slots, np.int32)
    kv_lens[:n] = batch.kv_lens
    num_tokens = int(cu[n]) + pad_tokens
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    cache_shape = (hkv, num_blocks, tpb, d)
    k_ref, v_ref = normal(seed, cache_shape), normal(seed + 1, cache_shape)
    q = normal(seed + 2, (num_tokens, hq, d))
    k_kernel, v_kernel = poison_pages(k_ref, unused), poison_pages(v_ref, unused)
    meta = tuple(jnp.asarray(a) for a in (kv_lens, tables, cu, np.array([n], np.int32)))
    return dict(q=q, k_ref=k_ref, v_ref=v_ref, k_kernel=k_kernel, v_kernel=v_kernel, meta=meta, valid=int(cu[n]))


def moe_inputs(shape: MoeShape, num_tokens: int, seed: int, pad: int = 5) -> dict:
    """Sorted-path args (rows + `pad` padding rows) and fused-path args (+ 2 tokens routed nowhere)."""
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    rng = np.random.default_rng(seed)
    scores = rng.uniform(size=(num_tokens, e))
    top = np.argsort(scores, axis=1)[:, :k].astype(np.int32)
    routing = np.take_along_axis(scores, top, axis=1)
    routing = (np.exp(routing) / np.exp(routing).sum(axis=1, keepdims=True)).astype(np.float32)
    ids = top.reshape(-1)
    order = np.argsort(ids, kind="stable").astype(np.int32)
    sizes = np.bincount(ids, minlength=e).astype(np.int32)
    tokens = normal(seed, (num_tokens + 2, h))
    rows = jnp.asarray(np.concatenate([order // k, np.zeros(pad, np.int32)]))
    x_sorted = jnp.where(
        (jnp.arange(rows.shape[0]) < order.shape[0])[:, None],
        jnp.take(tokens, rows, axis=0),
        jnp.asarray(7.0, jnp.bfloat16),
    )  # padding rows: non-zero input, zero output
    w = (
        normal(seed + 1, (e, h, i), h**-0.5),
        normal(seed + 2, (e, h, i), h**-0.5),
        normal(seed + 3, (e, i, h), i**-0.5),
    )
    expert_ids = jnp.asarray(np.concatenate([top, np.full((2, k), e, np.int32)]))
    weights = jnp.asarray(np.concatenate([routing, np.ones((2, k), np.float32)]))
    sizes, order = jnp.asarray(sizes), jnp.asarray(order)
    return dict(
        sorted=(x_sorted, sizes, *w),
        fused=(tokens, expert_ids, weights, *w),
        order=order,
        rows=num_tokens * k,
        num_tokens=num_tokens,
    )


# ----------------------------------------------------------------------------- checks


def _errors(out: jax.Array, ref: jax.Array, valid: int) -> tuple[float, float, bool, bool]:
    """(max abs error, relative error, no NaN anywhere, padding rows exactly zero)."""
    out = np.asarray(jax.device_get(out), np.float32)
    ref = np.asarray(jax.device_get(ref), np.float32)
    nan_free = not np.isnan(out).any()
    abs_err = float(np.nanmax(np.abs(out[:valid] - ref[:valid]))) if valid else 0.0
    if np.isnan(out[:valid]).any():
        abs_err = float("nan")
    scale = max(float(np.max(np.abs(ref[:valid]))) if valid else 0.0, 1e-30)
    return abs_err, abs_err / scale, nan_free, bool(np.all(out[valid:] == 0.0))


def _record(
    table: Table,
    failures: list[str],
    *,
    family: str,
    model: str,
    batch: str,
    impl: str,
    reference: str,
    out: jax.Array,
    ref: jax.Array,
    valid: int,
    tol: float = BF16_TOL,
) -> None:
    abs_err, rel, nan_free, zero_pad = _errors(out, ref, valid)
    passed = bool(rel <= tol and nan_free and zero_pad)
    table.add(
        family=family,
        model=model,
        batch=batch,
        impl=impl,
        reference=reference,
        dtype="bf16",
        max_abs_err=abs_err,
        rel_err=rel,
        tol=tol,
        nan_free=nan_free,
        zero_padding=zero_pad,
        passed=passed,
    )
    if not passed:
        failures.append(
            f"{family} {model} {batch} {impl}: rel err {rel:.3g} (tol {tol}), NaN-free {nan_free}, "
            f"zero padding {zero_pad}"
        )


def _skip(table: Table, *, family: str, model: str, batch: str, impl: str, reason: str) -> None:
    table.add(
        family=family,
        model=model,
        batch=batch,
        impl=impl,
        reference="-",
        dtype="bf16",
        passed=None,
        note=f"skipped: {reason}",
    )


def mosaic_unavailable(interpret: bool) -> Optional[str]:
    """Why the Mosaic GPU kernels cannot run here (None: they can)."""
    if interpret:
        return None if mosaic_gpu_interpret.available() else "this jax has no Mosaic GPU interpreter"
    if gpu_kernel_flavour(jax.devices()[0]) != "mosaic":
        return "Mosaic GPU kernels need a Hopper GPU (compute capability 9.x)"
    return None


def tokamax_unavailable(interpret: bool) -> Optional[str]:
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed"
    if interpret:
        return "tokamax kernels do not run in interpret mode"
    return None


def check_attention(
    ctx: SectionContext,
    table: Table,
    failures: list[str],
    shape: AttentionShape,
    batch: Batch,
    tpb: int,
    interpret: bool,
) -> None:
    inp = attention_inputs(shape, batch, tpb, seed=len(batch.q_lens))
    meta, valid = inp["meta"], inp["valid"]
    common = dict(
        family="attention" if shape.value_dim is None else "latent (MLA)", model=shape.model, batch=batch.name
    )
    if shape.value_dim is not None:
        scale = shape.sm_scale_dim**-0.5
        ref = jax.jit(
            functools.partial(ragged_paged_latent_attention_reference, sm_scale=scale, value_dim=shape.value_dim)
        )(inp["q"], inp["k_ref"][0], *meta)
        out = jax.jit(
            functools.partial(
                ragged_paged_latent_attention, sm_scale=scale, value_dim=shape.value_dim, interpret=interpret
            )
        )(inp["q"], inp["k_kernel"][0], *meta)
        _record(table, failures, **common, impl="triton", reference="xla reference", out=out, ref=ref, valid=valid)
        _skip(
            table,
            **common,
            impl="mosaic",
            reason=f"the Mosaic GPU kernel takes no latent cache (one KV head for {shape.num_q_heads} q heads)",
        )
        return
    scale = shape.head_dim**-0.5
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale))(
        inp["q"], inp["k_ref"], inp["v_ref"], *meta
    )
    kernel_args = (inp["q"], inp["k_kernel"], inp["v_kernel"], *meta)
    out = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, interpret=interpret))(*kernel_args)
    _record(table, failures, **common, impl="triton", reference="xla reference", out=out, ref=ref, valid=valid)
    ctx.check_time("the Mosaic GPU attention case")
    reason = mosaic_unavailable(interpret)
    if reason is None and not attention_mosaic.supports(
        jnp.bfloat16, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, tpb
    ):
        reason = "the Mosaic GPU kernel does not take this shape"
    if reason is not None:
        _skip(table, **common, impl="mosaic", reason=reason)
        return
    out = jax.jit(
        functools.partial(attention_mosaic.ragged_paged_attention_mosaic, sm_scale=scale, interpret=interpret)
    )(*kernel_args)
    _record(table, failures, **common, impl="mosaic", reference="xla reference", out=out, ref=ref, valid=valid)


def _fused_from_sorted(
    y_sorted: jax.Array, order: jax.Array, weights: jax.Array, num_tokens: int, top_k: int
) -> jax.Array:
    """Unsort the reference's rows and combine them with the routing weights (f32), padding tokens 0."""
    rows = num_tokens * top_k
    y = jnp.zeros((rows, y_sorted.shape[1]), jnp.float32).at[order].set(y_sorted[:rows].astype(jnp.float32))
    out = jnp.einsum("tkh,tk->th", y.reshape(num_tokens, top_k, -1), weights[:num_tokens].astype(jnp.float32))
    return jnp.concatenate([out, jnp.zeros((weights.shape[0] - num_tokens, out.shape[1]), jnp.float32)])


def check_moe(
    ctx: SectionContext, table: Table, failures: list[str], shape: MoeShape, num_tokens: int, interpret: bool
) -> None:
    inp = moe_inputs(shape, num_tokens, seed=num_tokens)
    rows = inp["rows"]
    dense_flops = 6.0 * (rows + 5) * shape.num_experts * shape.hidden * shape.inter
    if interpret or dense_flops <= DENSE_REFERENCE_FLOPS:
        reference, ref_fn = "jax.lax.ragged_dot", moe_grouped_ffn_reference
    else:
        reference, ref_fn = "tiled xla (rows per expert only)", moe_grouped_ffn_tiled
    ref = jax.jit(ref_fn)(*inp["sorted"])
    common = dict(family="moe", model=shape.model, batch=f"{num_tokens} tokens top{shape.top_k}")
    kernels: list[tuple[str, Optional[str], Callable]] = [
        ("triton", None, functools.partial(moe_grouped_ffn, interpret=interpret)),
        (
            "mosaic",
            mosaic_unavailable(interpret)
            or (
                None
                if moe_mosaic.supports(jnp.bfloat16, shape.hidden, shape.inter)
                else "the Mosaic GPU kernel does not take this shape"
            ),
            functools.partial(moe_mosaic.moe_grouped_ffn_mosaic, interpret=interpret),
        ),
        ("tokamax", tokamax_unavailable(interpret), None),
    ]
    for impl, reason, fn in kernels:
        ctx.check_time(f"MoE {impl}")
        if reason is not None:
            _skip(table, **common, impl=impl, reason=reason)
            continue
        fn = fn if fn is not None else tokamax_moe()
        _record(
            table,
            failures,
            **common,
            impl=impl,
            reference=reference,
            out=jax.jit(fn)(*inp["sorted"]),
            ref=ref,
            valid=rows,
        )
    ctx.check_time("MoE triton fused")
    fused_ref = jax.jit(_fused_from_sorted, static_argnums=(3, 4))(
        ref, inp["order"], inp["fused"][2], num_tokens, shape.top_k
    )
    out = jax.jit(functools.partial(moe_fused_ffn, interpret=interpret))(*inp["fused"])
    _record(
        table,
        failures,
        **common,
        impl="triton fused",
        reference=reference + " + combine",
        out=out,
        ref=fused_ref,
        valid=num_tokens,
    )


def run(ctx: SectionContext) -> None:
    interpret = ctx.options.interpret
    tpb = 16
    ctx.data.update(tolerance_bf16=BF16_TOL, tokens_per_block=tpb, interpret=interpret)
    table = ctx.table(
        "Kernels against references (bf16)",
        (
            "family",
            "model",
            "batch",
            "impl",
            "reference",
            "max_abs_err",
            "rel_err",
            "tol",
            "nan_free",
            "zero_padding",
            "passed",
            "note",
        ),
    )
    failures: list[str] = []
    attention, moe = attention_plan(ctx.options.dry_run), moe_plan(ctx.options.dry_run)
    # Interleave the families so a short share still covers each.
    plan: list[tuple[str, Callable[[], None]]] = []
    for i in range(max(len(attention), len(moe))):
        if i < len(attention):
            shape, batch = attention[i]
            plan.append(
                (
                    f"attention {shape.model} {batch.name}",
                    functools.partial(check_attention, ctx, table, failures, shape, batch, tpb, interpret),
                )
            )
        if i < len(moe):
            shape, tokens = moe[i]
            plan.append(
                (
                    f"moe {shape.model} {tokens} tokens",
                    functools.partial(check_moe, ctx, table, failures, shape, tokens, interpret),
                )
            )
    # Quantized weights (FP8 / int4 GEMM, FP8 grouped FFN), interleaved after the first cases.
    record = functools.partial(_record, table, failures)
    quant = quant_checks.cases(record, ctx.options.dry_run, interpret, mosaic=mosaic_unavailable(interpret) is None)
    plan = [step for pair in zip(plan, quant) for step in pair] + plan[len(quant) :] + quant[len(plan) :]
    ctx.data["cases_planned"] = len(plan)
    for name, step in plan:
        ctx.check_time("the next case")
        if not ctx.run_case(name, step):
            failures.append(f"{name}: raised (see case_errors)")
    ctx.data["failures"] = failures
    if failures:
        raise ChecksFailed(f"{len(failures)} kernel case(s) outside tolerance: " + "; ".join(failures[:5]))
