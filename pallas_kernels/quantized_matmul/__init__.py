"""GEMM with quantized weights (FP8 block-scaled, int8 / int4 weight-only): the Pallas GPU
kernel and the dequantize-then-matmul reference the models run in XLA."""

from pallas_kernels.quantized_matmul.kernel import QuantTiling, quantized_matmul
from pallas_kernels.quantized_matmul.reference import dequantize, quantized_matmul_reference

__all__ = ["QuantTiling", "dequantize", "quantized_matmul", "quantized_matmul_reference"]
