"""Tile sizes and launch parameters of the grouped expert FFN kernels (`kernel.py`), chosen
from static shapes only, so each bucket compiles once: column tiles narrow and the down
projection splits K until a small batch still keeps every SM streaming weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.triton_backend import check_power_of_two

# CTAs a launch should have work for: two per SM on the 132-SM H100 / H200, so a wave's
# tail and per-CTA imbalance still leave every SM busy.
TARGET_WORKING_CTAS = 2 * 132
# f32 accumulator registers per thread above which Triton starts to spill (255 max, and
# the operands and addresses need their share).
MAX_ACC_REGS_PER_THREAD = 128


@dataclass(frozen=True)
class GemmTiling:
    """Static tile sizes and launch parameters of one grouped GEMM kernel.

    `num_k_splits > 1` (split-K) cuts the reduction into that many parts, each program
    adding its partial product into an f32 output with atomics.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    num_k_splits: int = 1

    def __post_init__(self) -> None:
        for name, minimum in (("block_m", 16), ("block_n", 16), ("block_k", 16), ("num_warps", 1), ("num_k_splits", 1)):
            check_power_of_two("GemmTiling", name, getattr(self, name), minimum)
        if self.num_stages < 1:
            raise ValueError(f"{self}: num_stages must be >= 1")

    def acc_regs_per_thread(self, num_accumulators: int) -> int:
        return num_accumulators * self.block_m * self.block_n // (32 * self.num_warps)


@dataclass(frozen=True)
class MoeTiling:
    """Both kernels share `block_m` (they share the work list). The gate/up kernel cannot
    split K (SwiGLU needs the whole sums)."""

    gate_up: GemmTiling
    down: GemmTiling

    def __post_init__(self) -> None:
        if self.gate_up.block_m != self.down.block_m:
            raise ValueError(f"{self}: both kernels must use the same block_m")
        if self.gate_up.num_k_splits != 1:
            raise ValueError(f"{self}: the gate/up kernel cannot split K")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _gemm_tiling(block_m: int, working_items: int, n: int, k: int, num_accumulators: int, split_k: bool) -> GemmTiling:
    """Column tile, warps and split-K for one kernel, given how many work items run a GEMM.

    `block_n` starts at 128 (64 for two accumulators above 32 rows) and halves, down to
    32, while the launch has fewer than `TARGET_WORKING_CTAS` working programs; then K is
    split (down projection only) while that is still short and each split keeps at least
    four K steps. Warps grow until the f32 accumulators fit in registers.
    """
    block_k = 64
    block_n = 64 if num_accumulators > 1 and block_m > 32 else 128
    while block_n > 32 and working_items * _cdiv(n, block_n) < TARGET_WORKING_CTAS:
        block_n //= 2
    splits = 1
    while (
        split_k
        and splits < 8
        and working_items * _cdiv(n, block_n) * splits < TARGET_WORKING_CTAS
        and k >= block_k * 4 * splits * 2
    ):
        splits *= 2
    num_warps = 4
    while num_accumulators * block_m * block_n // (32 * num_warps) > MAX_ACC_REGS_PER_THREAD:
        num_warps *= 2
    return GemmTiling(block_m, block_n, block_k, num_warps, num_stages=3, num_k_splits=splits)


def default_tiling(num_rows: int, num_groups: int, hidden: int, inter: int) -> MoeTiling:
    """Tile sizes from static shapes only (the kernels compile once per bucket).

    `block_m` follows the rows per group, assuming the rows spread over as many groups as
    they can (decode: each row of a token goes to a different expert): 16 rows at decode
    batch sizes (vLLM's and SGLang's small-M configs), up to 64, and 128 once groups
    average 128+ rows (halves weight re-reads). Small batches are weight-bandwidth bound,
    so what matters there is that enough programs stream weights at once; `_gemm_tiling`
    narrows the column tiles (and splits K in the down projection) until about two
    working programs per SM exist. Shared memory per pipeline stage (bf16) stays <= 32 KiB
    (gate/up: an x tile and two weight tiles), so three stages fit on Ampere and Hopper.
    """
    groups_used = max(1, min(num_rows, num_groups))
    if num_rows >= 128 * num_groups:
        block_m = 128
    else:
        block_m = min(64, max(16, _next_pow2(_cdiv(num_rows, groups_used))))
    working_items = max(groups_used, _cdiv(num_rows, block_m))
    return MoeTiling(
        _gemm_tiling(block_m, working_items, inter, hidden, num_accumulators=2, split_k=False),
        _gemm_tiling(block_m, working_items, hidden, inter, num_accumulators=1, split_k=True),
    )
