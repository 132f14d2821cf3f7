"""The models' quantized matmuls on the Pallas kernels: `qeinsum` (every FP8 / int8 / int4
projection) and the MoE layer's FP8 experts, against the models' own XLA path.

On CPU the kernels run in Pallas interpret mode: the dense kernel is switched on with
`quantized_matmul.use_backend("triton", interpret=True)` (on a GPU `resolve_backends` does
it), the FP8 grouped FFN by the `pallas` MoE backend (its `fused_fp8`). The oracle is the
same model on the XLA path (dequantize, then einsum / the reference grouped FFN), which
`tests/test_fp8_weights.py` holds to Hugging Face transformers on the dequantized weights.
Each check also asserts the kernel is in the traced program, so a silent fallback fails.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import quantized_matmul
from jaxllm.models.backends import resolve_backends
from jaxllm.models.quantization import QuantizedWeight, pack_int4, qeinsum, quantize_blocks, quantize_blocks_int
from jaxllm.models.quantized_matmul import merged_block

F32_TOL = 1e-5


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def test_merged_block_of_flattened_axes():
    assert merged_block((4, 64), (2, 64)) == 128  # a whole inner axis merges with the next one out
    assert merged_block((256, 4, 64), (128, 2, 64)) is None  # ... but not past a partial one
    assert merged_block((4, 192), (1, 64)) == 64  # 192-wide heads in 64-blocks
    assert merged_block((4, 192), (2, 64)) is None  # blocks straddle heads
    assert merged_block((4, 160), (1, 128)) is None  # a partial block inside each head
    assert merged_block((200,), (128,)) == 128  # a partial block at the outermost axis is fine
    assert merged_block((4, 128), (4, 128)) == 512


def _weight(kind: str, shape: tuple[int, ...], blocks: tuple[int, ...], act_group: int, seed: int) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[0])
    if kind == "fp8":
        value, scale = quantize_blocks(w, blocks)
        return QuantizedWeight(jnp.asarray(value), jnp.asarray(scale), blocks, act_group)
    if kind == "q6k":  # GGUF Q6_K as held: int8 values and scales per 16 rows, float16 `d` per 256
        rng = np.random.default_rng(seed)
        value = rng.integers(-32, 32, shape).astype(np.int8)
        scale = rng.integers(-128, 128, (shape[0] // 16, shape[1])).astype(np.int8)
        d = rng.uniform(1e-4, 1e-3, (shape[0] // 256, shape[1])).astype(np.float16)
        return QuantizedWeight(
            jnp.asarray(value), jnp.asarray(scale), blocks, 0, super_scale=jnp.asarray(d), super_blocks=(256, 1)
        )
    value, scale = quantize_blocks_int(w, blocks, 8 if kind == "int8" else 4)
    packed = kind == "int4"
    value = pack_int4(value) if packed else value
    # GGUF's Q8_0 / Q4_0 `d`, held in float16 as the file stores it
    return QuantizedWeight(jnp.asarray(value), jnp.asarray(scale.astype(np.float16)), blocks, 0, packed)


# The models' einsums with the blocks their weights carry (DeepSeek-V3's q_b heads of 192 in
# 64-blocks, o over (heads, v) rows, GGUF's 32-row blocks, a head axis split in whole heads).
CASES = [
    ("th,hi->ti", (5, 256), "fp8", (256, 384), (128, 128), 128),
    ("tr,rnd->tnd", (5, 192), "fp8", (192, 4, 192), (128, 1, 64), 128),
    ("tnv,nvh->th", (5, 4, 128), "fp8", (4, 128, 256), (1, 128, 128), 128),
    ("th,hnd->tnd", (5, 256), "fp8", (256, 4, 64), (128, 2, 64), -1),
    ("th,hi->ti", (5, 256), "int8", (256, 96), (32, 1), 0),
    ("th,hnd->tnd", (5, 256), "int4", (256, 4, 64), (32, 1, 1), 0),
    ("th,hi->ti", (5, 512), "q6k", (512, 96), (16, 1), 0),
]


@pytest.mark.parametrize("spec,x_shape,kind,w_shape,blocks,act_group", CASES)
def test_qeinsum_runs_the_kernel_with_the_xla_numerics(spec, x_shape, kind, w_shape, blocks, act_group):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(x_shape), jnp.float32)
    w = _weight(kind, w_shape, blocks, act_group, seed=1)
    fn = functools.partial(qeinsum, spec, precision=jax.lax.Precision.HIGHEST)
    ref = jax.jit(lambda a, b: fn(a, b))(x, w)
    with quantized_matmul.use_backend("triton", interpret=True):
        program = str(jax.make_jaxpr(lambda a, b: fn(a, b))(x, w))
        out = jax.jit(lambda a, b: fn(a, b))(x, w)
    assert "quantized_matmul" in program, "the kernel did not run"
    assert out.shape == ref.shape and rel_err(out, ref) < F32_TOL


def test_qeinsum_falls_back_to_xla_where_the_kernel_does_not_fit():
    x = jnp.ones((3, 4, 192), jnp.float32)
    w = _weight("fp8", (4, 192, 64), (2, 64, 64), 0, seed=2)  # 64-blocks straddling two heads' rows
    with quantized_matmul.use_backend("triton", interpret=True):
        program = str(jax.make_jaxpr(lambda a, b: qeinsum("tnd,ndh->th", a, b))(x, w))
    assert "pallas_call" not in program
    assert quantized_matmul.backend() == "xla"  # restored after the block
    with pytest.raises(ValueError, match="backend"):
        quantized_matmul.set_backend("cuda")


def test_resolve_backends_keeps_xla_off_gpu():
    resolve_backends(None, "pallas")
    assert quantized_matmul.backend() == "xla"


def test_on_a_gpu_the_kernel_follows_the_moe_backend_on_one_device(monkeypatch):
    from jaxllm.models import backends

    monkeypatch.setattr(backends, "default_platform", lambda: "gpu")
    monkeypatch.setattr(backends, "converts_fp8", lambda device: True)
    with quantized_matmul.use_backend("xla"):  # restores the process-wide choice afterwards
        _, _, _, moe_fn = backends.resolve_backends(None, None)
        assert quantized_matmul.backend() == "triton" and moe_fn.fused_fp8.keywords == {"interpret": False}
        backends.resolve_backends(None, "xla")
        assert quantized_matmul.backend() == "xla"
        backends.resolve_backends(None, "triton", num_devices=2)
        assert quantized_matmul.backend() == "xla"  # a kernel call is not split over a mesh
    assert quantized_matmul.backend() == "xla"


def test_gpus_without_e4m3_conversion_keep_fp8_weights_on_xla(monkeypatch):
    from types import SimpleNamespace

    from jaxllm.models import backends

    assert [backends.converts_fp8(SimpleNamespace(compute_capability=c)) for c in ("8.0", "8.9", "9.0", "10.0")] == [
        False,
        True,
        True,
        True,
    ]
    monkeypatch.setattr(backends, "default_platform", lambda: "gpu")
    monkeypatch.setattr(backends, "converts_fp8", lambda device: False)  # an A100
    x = jnp.ones((3, 256), jnp.float32)
    with quantized_matmul.use_backend("xla"):
        _, _, _, moe_fn = backends.resolve_backends(None, None)
        assert not hasattr(moe_fn, "fused_fp8")
        fp8, int8 = _weight("fp8", (256, 128), (128, 128), 0, 3), _weight("int8", (256, 128), (32, 1), 0, 3)
        assert "pallas_call" not in str(jax.make_jaxpr(lambda a, b: qeinsum("th,hi->ti", a, b))(x, fp8))
        assert "pallas_call" in str(jax.make_jaxpr(lambda a, b: qeinsum("th,hi->ti", a, b))(x, int8))


# ----------------------------------------------------------------------------- whole model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    from jaxllm.models import load_model_config, load_params
    from tests.fp8_checkpoints import write_fp8_checkpoint
    from tests.test_deepseek import build_hf
    from tests.test_fp8_weights import DS

    directory = tmp_path_factory.mktemp("fp8") / "ds"
    write_fp8_checkpoint(directory, build_hf(dict(DS, num_hidden_layers=2)))
    config = load_model_config(directory)
    config = replace(config, quantization=replace(config.quantization, activation_scheme="none"))
    return load_params(directory, config), config


def test_deepseek_fp8_model_on_the_kernels_gives_the_xla_logits(deepseek_fp8):
    """Every FP8 projection through the dense kernel, the routed experts through the FP8
    grouped FFN under shard_map (weights-only, where the XLA and Pallas MoE paths compute
    the same)."""
    from jaxllm.models.decoder import forward_all_logits
    from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
    from sharding.mesh import ParallelConfig, make_mesh
    from tests.model_helpers import PagedModel, SeqChunk, random_block_table

    params, config = deepseek_fp8
    paged = PagedModel(params, config, num_blocks=32, max_blocks_per_seq=8, token_bucket=16)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 256, 12)]
    batch = paged.batch([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 32, 8))])

    def logits_of(moe_fn, mesh=None):
        fn = functools.partial(forward_all_logits, config=config, moe_fn=moe_fn, mesh=mesh)
        traced = jax.jit(fn).trace(params, paged.empty_cache(), batch)
        logits, _ = traced.lower().compile()(params, paged.empty_cache(), batch)
        return logits[: len(tokens)], str(traced.jaxpr)

    ref, _ = logits_of(moe_grouped_ffn_reference)
    _, _, _, pallas_moe = resolve_backends("xla", "pallas")
    with quantized_matmul.use_backend("triton", interpret=True):
        # Under a (one-device) mesh as in the engine: the MoE backend inside shard_map.
        out, program = logits_of(pallas_moe, make_mesh(ParallelConfig()))
    assert "quantized_matmul_float8_e4m3fn" in program and "moe_fused_gate_up" in program
    assert float(np.std(np.asarray(ref))) > 0.5
    assert rel_err(out, ref) < 1e-4


def test_deepseek_fp8_model_step_lowers_for_cuda_on_the_kernels(deepseek_fp8, monkeypatch):
    """The model step as a GPU engine would build it (backends resolved for a GPU) lowers for
    CUDA with every quantized projection and the routed experts on Triton kernels."""
    import re

    from jaxllm.models import backends
    from jaxllm.models.decoder import forward_all_logits
    from pallas_kernels.triton_backend import cuda_lowering_target
    from tests.conftest import verified_triton_lowering
    from tests.model_helpers import PagedModel, SeqChunk

    params, config = deepseek_fp8
    paged = PagedModel(params, config, num_blocks=32, max_blocks_per_seq=8, token_bucket=16)
    batch = paged.batch([SeqChunk(list(range(12)), 0, list(range(8)))])
    monkeypatch.setattr(backends, "default_platform", lambda: "gpu")
    monkeypatch.setattr(backends, "converts_fp8", lambda device: True)
    with quantized_matmul.use_backend("xla"):
        _, _, _, moe_fn = backends.resolve_backends("xla", None)
        fn = functools.partial(forward_all_logits, config=config, moe_fn=moe_fn)
        with cuda_lowering_target(), verified_triton_lowering():
            text = jax.jit(fn).trace(params, paged.empty_cache(), batch).lower(lowering_platforms=("cuda",)).as_text()
    names = set(re.findall(r'name = "([a-z_0-9]+)"', text))
    assert {"quantized_matmul_float8_e4m3fn", "moe_fused_gate_up", "moe_fused_down"} <= names, names


def test_weights_with_an_offset_or_unsigned_values_stay_on_xla():
    """GGUF Q4_1 / Q4_K and AWQ weights (`value * scale + offset`, unsigned nibbles) are not what
    the kernel computes: it declines them and `qeinsum` gives the dequantized einsum."""
    signed = _weight("int4", (64, 32), (32, 1), 0, seed=3)
    offset = jnp.full_like(signed.scale, 0.25)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 64)), jnp.float32)
    with quantized_matmul.use_backend("triton", interpret=True):
        assert quantized_matmul.kernel_einsum("th,hi->ti", x, signed) is not None
        for w in (
            QuantizedWeight(signed.value, signed.scale, (32, 1), 0, True, offset),
            QuantizedWeight(signed.value, signed.scale, (32, 1), 0, True, None, True),
        ):
            assert quantized_matmul.kernel_einsum("th,hi->ti", x, w) is None
            with quantized_matmul.use_backend("xla"):
                ref = qeinsum("th,hi->ti", x, w)
            assert rel_err(qeinsum("th,hi->ti", x, w), ref) == 0.0
