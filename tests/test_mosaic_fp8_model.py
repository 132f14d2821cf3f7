"""A DeepSeek-V3-style FP8 model (128 x 128 weight blocks, activations quantized per
128-group at run time) on the `mosaic` backend: every dense FP8 projection the Mosaic GPU
FP8 GEMM takes and the routed experts go through the e4m3 x e4m3 wgmma kernels (in jax's
Mosaic GPU interpreter on CPU, under a one-device mesh as in the engine), against the same
model on the XLA path (act_quant, dequantized weights, the hidden activations act_quant'ed
before the experts' down projection), which `tests/test_fp8_weights.py` holds to Hugging
Face transformers. Tolerance: max |logits - ref| / max |ref| < 2e-2 (bf16).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxllm.models import quantized_matmul
from jaxllm.models.backends import resolve_backends
from pallas_kernels import mosaic_gpu_interpret

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not mosaic_gpu_interpret.available(), reason="no Mosaic GPU interpreter")


def test_deepseek_fp8_model_on_the_mosaic_fp8_kernels_gives_the_xla_logits(tmp_path):
    from jaxllm.models import load_model_config, load_params
    from jaxllm.models.decoder import forward_all_logits
    from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
    from sharding.mesh import ParallelConfig, make_mesh
    from tests.fp8_checkpoints import write_fp8_checkpoint
    from tests.model_helpers import PagedModel, SeqChunk, random_block_table
    from tests.test_deepseek import build_hf
    from tests.test_fp8_weights import DS

    write_fp8_checkpoint(tmp_path / "ds", build_hf(dict(DS, num_hidden_layers=2)))
    config = load_model_config(tmp_path / "ds")
    params = load_params(tmp_path / "ds", config)
    assert config.quantization.activation_group == 128
    paged = PagedModel(params, config, num_blocks=32, max_blocks_per_seq=8, token_bucket=16)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 256, 12)]
    batch = paged.batch([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 32, 8))])

    def logits_of(moe_fn, mesh=None):
        fn = functools.partial(forward_all_logits, config=config, moe_fn=moe_fn, mesh=mesh)
        traced = jax.jit(fn).trace(params, paged.empty_cache(), batch)
        logits, _ = traced.lower().compile()(params, paged.empty_cache(), batch)
        return np.asarray(logits[: len(tokens)], np.float64), str(traced.jaxpr)

    ref, _ = logits_of(moe_grouped_ffn_reference)
    with quantized_matmul.use_backend("xla"):
        _, _, _, mosaic_moe = resolve_backends("xla", "mosaic")
    with quantized_matmul.use_backend("triton", interpret=True, mosaic_fp8=True):
        out, program = logits_of(mosaic_moe, make_mesh(ParallelConfig()))
    assert "fp8_block_gemm" in program and "moe_fp8_gate_up" in program and "moe_fp8_down" in program
    assert float(np.std(ref)) > 0.5
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    assert err < 2e-2, err  # 2.9e-3 here
