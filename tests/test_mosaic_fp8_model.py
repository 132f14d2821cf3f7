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
import jax.extend
import numpy as np
import pytest

from jaxllm.models import quantized_matmul
from jaxllm.models.backends import resolve_backends
from pallas_kernels import mosaic_gpu_interpret

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not mosaic_gpu_interpret.available(), reason="no Mosaic GPU interpreter")


def _f8_transposes(jaxpr) -> int:
    """Transposes of e4m3 arrays in the step's own program (kernel bodies not counted)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name == "transpose" and "float8" in str(eqn.invars[0].aval.dtype):
            count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _f8_transposes(sub)
    return count


def test_deepseek_fp8_model_on_the_mosaic_fp8_kernels_gives_the_xla_logits(tmp_path):
    """The weights stored K-major (as the engine stores them for these kernels): no e4m3
    weight is transposed inside the step, and the logits are the XLA path's."""
    from jaxllm.models import load_model_config, load_params
    from jaxllm.models.decoder import forward_all_logits
    from jaxllm.models.quantization import dense, is_quantized
    from jaxllm.models.quantized_loading import with_k_major_fp8
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
    k_major_config = with_k_major_fp8(config, True)
    k_major_params = load_params(tmp_path / "ds", k_major_config)
    experts, o_proj = (k_major_params["layer_stacks"][1][m][n] for m, n in (("moe", "w_gate"), ("attn", "o")))
    assert experts.k_major and experts.value.shape == experts.shape[:2] + experts.shape[:1:-1]
    assert not o_proj.k_major  # [heads, D, H]: not a [K, N] the GEMM takes
    quantized = lambda tree: [w for w in jax.tree.leaves(tree, is_leaf=is_quantized) if is_quantized(w)]  # noqa: E731
    pairs = list(zip(quantized(params), quantized(k_major_params)))
    # kv_a in both layers, the dense MLP (layer 0), the shared and routed experts (layer 1)
    assert sum(w.k_major for _, w in pairs) == 2 + 3 + 3 + 3
    for w, kw in pairs:  # the same numbers, whatever the layout
        np.testing.assert_array_equal(np.asarray(dense(kw)), np.asarray(dense(w)))
    paged = PagedModel(params, config, num_blocks=32, max_blocks_per_seq=8, token_bucket=16)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 256, 12)]
    batch = paged.batch([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 32, 8))])

    def logits_of(params, config, moe_fn, mesh=None):
        fn = functools.partial(forward_all_logits, config=config, moe_fn=moe_fn, mesh=mesh)
        traced = jax.jit(fn).trace(params, paged.empty_cache(), batch)
        logits, _ = traced.lower().compile()(params, paged.empty_cache(), batch)
        return np.asarray(logits[: len(tokens)], np.float64), traced.jaxpr

    ref, _ = logits_of(params, config, moe_grouped_ffn_reference)
    # The XLA path reads K-major weights too (dequantized in the parameter's layout).
    ref_k_major, _ = logits_of(k_major_params, k_major_config, moe_grouped_ffn_reference)
    # Summation order differs with the layout, and act_quant's e4m3 rounding turns that into
    # a few ulps of e4m3 downstream: the same tolerance as the kernels'.
    assert float(np.max(np.abs(ref_k_major - ref)) / np.max(np.abs(ref))) < 2e-2
    with quantized_matmul.use_backend("xla"):
        _, _, _, mosaic_moe = resolve_backends("xla", "mosaic")
    mesh = make_mesh(ParallelConfig())
    with quantized_matmul.use_backend("triton", interpret=True, mosaic_fp8=True):
        out, program = logits_of(k_major_params, k_major_config, mosaic_moe, mesh)
        # Weights in the parameter's layout: the experts are made K-major inside the step.
        _, program_transposing = logits_of(params, config, mosaic_moe, mesh)
    text = str(program)
    assert "fp8_block_gemm" in text and "moe_fp8_gate_up" in text and "moe_fp8_down" in text
    assert _f8_transposes(program.jaxpr) == 0 and _f8_transposes(program_transposing.jaxpr) >= 3
    assert float(np.std(ref)) > 0.5
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    assert err < 2e-2, err  # 2.9e-3 here


def test_weights_quantized_on_load_are_stored_k_major_with_the_same_numbers(tmp_path):
    """`quantization="fp8"` on a bf16/f32 checkpoint: quantized on the host, then made K-major
    on the devices, the same numbers as the parameter-layout load."""
    from jaxllm.models import load_model_config, load_params
    from jaxllm.models.quantization import dense, is_quantized
    from jaxllm.models.quantized_loading import with_k_major_fp8, with_quantization
    from tests.test_deepseek import build_hf
    from tests.test_fp8_weights import DS

    build_hf(dict(DS, num_hidden_layers=2)).save_pretrained(tmp_path / "ds", safe_serialization=True)
    config = with_quantization(load_model_config(tmp_path / "ds"), "fp8")
    k_major_config = with_k_major_fp8(config, True)
    quantized = lambda tree: [w for w in jax.tree.leaves(tree, is_leaf=is_quantized) if is_quantized(w)]  # noqa: E731
    pairs = list(
        zip(quantized(load_params(tmp_path / "ds", config)), quantized(load_params(tmp_path / "ds", k_major_config)))
    )
    assert sum(kw.k_major for _, kw in pairs) == 2 + 3 + 3 + 3
    for w, kw in pairs:
        assert kw.shape == w.shape and (not kw.k_major or kw.value.shape == w.value.shape[:-2] + w.value.shape[:-3:-1])
        np.testing.assert_array_equal(np.asarray(dense(kw)), np.asarray(dense(w)))
