"""Grouped expert FFN over expert-sorted rows: the Pallas GPU kernels and the XLA reference."""

from pallas_kernels.moe_grouped_gemm.kernel import GemmTiling, MoeTiling, moe_grouped_ffn
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference

__all__ = ["GemmTiling", "MoeTiling", "moe_grouped_ffn", "moe_grouped_ffn_reference"]
