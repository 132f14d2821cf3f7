"""Launch cost model of the quantized-weight kernels next to the XLA path they replace.

`quantized_matmul` (FP8 128 x 128 blocks, GGUF int8 / int4 with 32-row blocks) reads each
weight tile in its stored type once per row tile; the XLA path dequantizes the whole weight
to bf16 in a pass of its own (read the stored values and scales, write bf16) before the
GEMM reads that copy. (XLA can fuse a convert-and-multiply prologue into its GEMM on some
GPUs; the model counts the unfused pass, so read the XLA rows as the worst case.) The FP8
grouped FFN reads the active experts' e4m3 tiles; the XLA path dequantizes every expert of
the layer (`jaxllm.models.moe.expert_operands`) before the bf16 kernels run. Bytes, FLOPs
and the roofline are counted as in `cost_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.cost_model import MOE_MODELS, LaunchCost, MoeShape, moe_costs

VALUE_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5}
SCALE_BLOCK = {"fp8": (128, 128), "int8": (32, 1), "int4": (32, 1)}


@dataclass(frozen=True)
class GemmShape:
    name: str
    k: int
    n: int


GEMM_SHAPES = (
    GemmShape("DeepSeek-V3 q_a 7168x1536", 7168, 1536),
    GemmShape("DeepSeek-V3 q_b 1536x24576", 1536, 128 * 192),
    GemmShape("DeepSeek-V3 o 16384x7168", 128 * 128, 7168),
    GemmShape("DeepSeek-V3 dense up 7168x18432", 7168, 18432),
    GemmShape("DeepSeek-V3 dense down 18432x7168", 18432, 7168),
    GemmShape("Qwen3-30B-A3B q 2048x4096", 2048, 4096),
)
GEMM_TOKEN_COUNTS = (1, 64, 4096)
MOE_FP8_TOKEN_COUNTS = (1, 64, 1024)


def _scale_bytes(kind: str, k: int, n: int) -> float:
    bk, bn = SCALE_BLOCK[kind]
    return 4.0 * -(-k // bk) * -(-n // bn)


def quantized_matmul_costs(shape: GemmShape, m: int, kind: str = "fp8", itemsize: int = 2) -> list[LaunchCost]:
    """[the kernel's launch, the XLA dequantize pass, the XLA bf16 GEMM] for x [m, K] @ w [K, N]."""
    from pallas_kernels.quantized_matmul.kernel import default_tiling

    k, n = shape.k, shape.n
    t = default_tiling(m, n, k, SCALE_BLOCK[kind][0])
    row_tiles, col_tiles = -(-m // t.block_m), -(-n // t.block_n)
    grid = (row_tiles, col_tiles, t.num_k_splits)
    weight = k * n * VALUE_BYTES[kind] + _scale_bytes(kind, k, n)
    out_bytes = m * n * (4 * 3 + itemsize) if t.num_k_splits > 1 else m * n * itemsize
    kernel_bytes = row_tiles * weight + m * k * itemsize + out_bytes  # activations once (L2 serves column tiles)
    flops = 2.0 * row_tiles * t.block_m * col_tiles * t.block_n * k
    useful = 2.0 * m * k * n
    case = f"{shape.name} {kind} M={m}"
    note = f"block_m={t.block_m} block_n={t.block_n} block_k={t.block_k} split_k={t.num_k_splits}"
    dequant = k * n * VALUE_BYTES[kind] + _scale_bytes(kind, k, n) + k * n * itemsize
    gemm = k * n * itemsize + m * k * itemsize + m * n * itemsize
    return [
        LaunchCost("quantized_matmul", case, grid, grid[0] * grid[1] * grid[2], kernel_bytes, flops, useful, note),
        LaunchCost("xla_dequantize", case, (), 0, dequant, float(k * n), 0.0, "stored values -> bf16 copy"),
        LaunchCost("xla_dot", case, (), 0, gemm, useful, useful, "bf16 GEMM on the dequantized copy"),
    ]


def moe_fp8_costs(shape: MoeShape, num_tokens: int, itemsize: int = 2) -> list[LaunchCost]:
    """The fused grouped FFN on e4m3 experts (its two launches), and the XLA path's pass
    that dequantizes every expert to bf16 before the bf16 kernels."""
    fp8 = moe_costs(shape, num_tokens, itemsize=itemsize, weight_itemsize=1)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    scales = 3 * e * 4.0 * -(-h // 128) * -(-i // 128)
    dequant = 3 * e * h * i * (1 + itemsize) + scales
    return [
        *(
            LaunchCost(c.kernel + "_fp8", c.case, c.grid, c.working, c.bytes, c.flops, c.useful_flops, c.note)
            for c in fp8
        ),
        LaunchCost(
            "xla_dequantize_experts",
            f"{shape.name} T={num_tokens}",
            (),
            0,
            dequant,
            3.0 * e * h * i,
            0.0,
            "all experts e4m3 -> bf16, then the bf16 kernels",
        ),
    ]


def default_cases() -> list[LaunchCost]:
    costs: list[LaunchCost] = []
    for shape in GEMM_SHAPES:
        for m in GEMM_TOKEN_COUNTS:
            costs += quantized_matmul_costs(shape, m, "fp8")
    for m in (1, 64):
        costs += quantized_matmul_costs(GEMM_SHAPES[3], m, "int4")
    for moe in (MOE_MODELS[0], MOE_MODELS[2]):
        for tokens in MOE_FP8_TOKEN_COUNTS:
            costs += moe_fp8_costs(moe, tokens)
    return costs
