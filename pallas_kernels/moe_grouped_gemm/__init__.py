"""Grouped expert FFN: the Pallas GPU kernels (sorted rows, or fused with the token gather and
the weighted combine) and their XLA references."""

from pallas_kernels.moe_grouped_gemm.kernel import moe_fused_ffn, moe_grouped_ffn
from pallas_kernels.moe_grouped_gemm.reference import moe_fused_ffn_reference, moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.tiling import GemmTiling, MoeTiling

__all__ = [
    "GemmTiling",
    "MoeTiling",
    "moe_fused_ffn",
    "moe_fused_ffn_reference",
    "moe_grouped_ffn",
    "moe_grouped_ffn_reference",
]
