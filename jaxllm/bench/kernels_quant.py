"""`jaxllm bench kernels` rows for the quantized-weight kernels, next to the XLA path they
replace on the same inputs.

- `quantized_matmul`: x [M, K] (bf16) @ an FP8 (128 x 128 block scales) or int4 (GGUF Q4_0
  blocks of 32) weight [K, N], the Pallas kernel against XLA's dequantize-then-dot (the
  models' path, `quantized_matmul_reference`), at DeepSeek-V3 / Qwen3-30B-A3B projection
  shapes and 1 / 64 / 4096 rows.
- `moe_fused_ffn_fp8`: the fused grouped FFN on e4m3 experts against the XLA path of the
  engine today (all experts dequantized to bf16, then the bf16 fused kernel).
- On Hopper also the Mosaic GPU e4m3 x e4m3 wgmma kernels (`mosaic fp8` rows), with the
  weights already K-major (as the engine stores them for these kernels) and made K-major in
  the call (what storing them in the parameter's layout would cost).

Bytes are what each must move at least: the stored weight (values and scales) once, plus
activations and outputs; the `%ceil` column is against the measured copy bandwidth or
bf16 matmul rate, whichever bounds the case (`jaxllm.bench.kernels.record_timing`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench.kernel_timing import Ceilings, Settings, on_hopper, record_timing


@dataclass(frozen=True)
class QuantGemmCase:
    name: str
    m: int
    k: int
    n: int
    kind: str  # fp8 | int4


def quant_gemm_cases(smoke: bool) -> list[QuantGemmCase]:
    if smoke:
        return [QuantGemmCase("tiny", 5, 256, 192, "fp8"), QuantGemmCase("tiny", 5, 256, 192, "int4")]
    shapes = (
        ("DeepSeek-V3 q_a", 7168, 1536),
        ("DeepSeek-V3 o", 16384, 7168),
        ("DeepSeek-V3 dense up", 7168, 18432),
        ("Qwen3-30B-A3B q", 2048, 4096),
    )
    cases = [QuantGemmCase(name, m, k, n, "fp8") for name, k, n in shapes for m in (1, 64, 4096)]
    cases += [QuantGemmCase("DeepSeek-V3 dense up", m, 7168, 18432, "int4") for m in (1, 64)]
    return cases


def quant_gemm_inputs(case: QuantGemmCase, seed: int) -> tuple[tuple[jax.Array, ...], tuple[int, int], bool]:
    """((x, value, scale), block, packed), generated on device by one jitted function."""
    k, n = case.k, case.n
    block = (128, 128) if case.kind == "fp8" else (32, 1)
    packed = case.kind == "int4"

    @jax.jit
    def generate(key):
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (case.m, k), jnp.bfloat16)
        scale = jax.random.uniform(k3, (-(-k // block[0]), -(-n // block[1])), jnp.float32, 0.5, 1.5) * k**-0.5
        if packed:
            value = jax.random.randint(k2, (k, n // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        else:
            value = (jax.random.normal(k2, (k, n), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
        return x, value, scale

    return generate(jax.random.PRNGKey(seed)), block, packed


def bench_quantized_matmul(s: Settings, ceil: Ceilings, case: QuantGemmCase) -> None:
    from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference
    from pallas_kernels.quantized_matmul.kernel import default_tiling

    args, block, packed = quant_gemm_inputs(case, s.seed)
    x, value, scale = args
    nbytes = float(value.nbytes + scale.nbytes + x.nbytes + case.m * case.n * 2)
    flops = 2.0 * case.m * case.k * case.n
    name = f"{case.name} {case.kind} M={case.m}"
    ref = jax.jit(functools.partial(quantized_matmul_reference, block=block, packed=packed))
    ref_out = record_timing(s, ceil, "quantized_matmul", name, "xla dequantize + dot", ref, args, nbytes, flops)
    t = default_tiling(case.m, case.n, case.k, block[0])
    note = f"block_m={t.block_m} block_n={t.block_n} block_k={t.block_k} split_k={t.num_k_splits}"
    fn = jax.jit(functools.partial(quantized_matmul, block=block, packed=packed, interpret=s.interpret))
    record_timing(s, ceil, "quantized_matmul", name, "pallas", fn, args, nbytes, flops, ref_out, note)
    if case.kind == "fp8" and on_hopper(s):
        bench_fp8_gemm_mosaic(s, ceil, case, args, nbytes, flops, ref_out)


def bench_fp8_gemm_mosaic(s: Settings, ceil: Ceilings, case: QuantGemmCase, args, nbytes, flops, ref_out) -> None:
    """Hopper only: the e4m3 x e4m3 wgmma GEMM (activations quantized per 128-group in the
    call, so rel_err includes that), with the weight already K-major (as the engine stores it
    for this kernel) and made K-major in the call (the cost of the parameter's layout)."""
    from pallas_kernels.quantized_matmul.mosaic_gpu_fp8 import default_tiling, fp8_block_matmul, k_major

    x, value, scale = args
    t = default_tiling(case.m, case.n)
    note = f"block_m={t.block_m} block_n={t.block_n} e4m3 activations"
    name = f"{case.name} {case.kind} M={case.m}"
    in_call = jax.jit(lambda a, v, sc: fp8_block_matmul(a, k_major(v), sc))
    record_timing(
        s,
        ceil,
        "quantized_matmul",
        name,
        "mosaic fp8 (w to K-major in call)",
        in_call,
        args,
        nbytes,
        flops,
        ref_out,
        note,
    )
    value_t = jax.block_until_ready(jax.jit(k_major)(value))
    record_timing(
        s,
        ceil,
        "quantized_matmul",
        name,
        "mosaic fp8 (K-major w)",
        fp8_block_matmul,
        (x, value_t, scale),
        nbytes,
        flops,
        ref_out,
        note,
    )


@dataclass(frozen=True)
class MoeFp8Case:
    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    inter: int


def moe_fp8_cases(smoke: bool) -> list[MoeFp8Case]:
    if smoke:
        return [MoeFp8Case("E8 top2 H256 I128", 6, 8, 2, 256, 128)]
    models = (("DeepSeek-V3 E256 top8", 256, 8, 7168, 2048), ("Qwen3-30B-A3B E128 top8", 128, 8, 2048, 768))
    return [MoeFp8Case(name, t, e, k, h, i) for name, e, k, h, i in models for t in (1, 64, 1024)]


def moe_fp8_inputs(case: MoeFp8Case, seed: int) -> tuple[jax.Array, ...]:
    """(tokens, expert ids, routing weights, e4m3 w_gate / w_up / w_down, their 128 x 128 block
    scales): random top-k routing, generated on device by one jitted function."""
    e, h, i = case.num_experts, case.hidden, case.inter

    @jax.jit
    def generate(key):
        keys = jax.random.split(key, 8)
        scores = jax.random.uniform(keys[0], (case.num_tokens, e))
        top = jnp.argsort(scores, axis=1)[:, : case.top_k].astype(jnp.int32)
        routing = jax.nn.softmax(jnp.take_along_axis(scores, top, axis=1), axis=1)
        tokens = jax.random.normal(keys[1], (case.num_tokens, h), jnp.bfloat16)
        values, scales = [], []
        for n, (rows, cols) in enumerate(((h, i), (h, i), (i, h))):
            values.append((jax.random.normal(keys[2 + n], (e, rows, cols)) * 64).astype(jnp.float8_e4m3fn))
            shape = (e, -(-rows // 128), -(-cols // 128))
            scales.append(jax.random.uniform(keys[5 + n], shape, jnp.float32, 0.5, 1.5) / (64 * rows**0.5))
        return (tokens, top, routing, *values, *scales)

    return generate(jax.random.PRNGKey(seed))


def bench_moe_fp8(s: Settings, ceil: Ceilings, case: MoeFp8Case) -> None:
    from pallas_kernels.moe_grouped_gemm import moe_fused_ffn
    from pallas_kernels.moe_grouped_gemm.fp8 import dequantize_experts, moe_fused_ffn_fp8

    args = moe_fp8_inputs(case, s.seed)
    ids = args[1]
    active = int(np.count_nonzero(np.bincount(np.asarray(ids).reshape(-1), minlength=case.num_experts)))
    nbytes = float(active * 3 * case.hidden * case.inter + 2 * case.num_tokens * case.hidden * 2)
    flops = 6.0 * case.num_tokens * case.top_k * case.hidden * case.inter
    name = f"{case.name} T={case.num_tokens}"

    def xla_path(x, i, r, wg, wu, wd, sg, su, sd):
        d = functools.partial(dequantize_experts, block=(128, 128), dtype=x.dtype)
        return moe_fused_ffn(x, i, r, d(wg, sg), d(wu, su), d(wd, sd), interpret=s.interpret)

    ref_out = record_timing(
        s,
        ceil,
        "moe_fused_ffn_fp8",
        name,
        "dequantize all experts + bf16 pallas",
        jax.jit(xla_path),
        args,
        nbytes,
        flops,
    )
    fn = jax.jit(functools.partial(moe_fused_ffn_fp8, interpret=s.interpret))
    note = f"active experts {active}/{case.num_experts}"
    record_timing(s, ceil, "moe_fused_ffn_fp8", name, "pallas", fn, args, nbytes, flops, ref_out, note)
    if on_hopper(s):
        # The e4m3 x e4m3 wgmma kernels (activations and hidden quantized per 128-group, so
        # rel_err includes that): experts made K-major in the call (the parameter's layout)
        # and already K-major (as the engine stores them for these kernels).
        from pallas_kernels.moe_grouped_gemm.mosaic_gpu_fp8 import k_major, moe_fused_ffn_fp8_mosaic

        mosaic = jax.jit(moe_fused_ffn_fp8_mosaic)
        record_timing(
            s,
            ceil,
            "moe_fused_ffn_fp8",
            name,
            "mosaic fp8 (experts to K-major in call)",
            mosaic,
            args,
            nbytes,
            flops,
            ref_out,
            note,
        )
        at_rest = jax.block_until_ready(jax.jit(lambda *w: tuple(k_major(v) for v in w))(*args[3:6]))
        fn_t = jax.jit(functools.partial(moe_fused_ffn_fp8_mosaic, weights_k_major=True))
        record_timing(
            s,
            ceil,
            "moe_fused_ffn_fp8",
            name,
            "mosaic fp8 (K-major experts)",
            fn_t,
            (*args[:3], *at_rest, *args[6:]),
            nbytes,
            flops,
            ref_out,
            note,
        )


def run(s: Settings, ceil: Ceilings, smoke: bool) -> None:
    for case in quant_gemm_cases(smoke):
        bench_quantized_matmul(s, ceil, case)
    for moe_case in moe_fp8_cases(smoke):
        bench_moe_fp8(s, ceil, moe_case)
