"""GGUF Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights kept quantized on the device.

Q4_1 (SmolLM2's file type) holds 4-bit values in [0, 15] with a float16 scale and offset per
block of 32 (`value * scale + offset`, the file's `d` and `m`), packed two to a byte on the
device; Q4_K the same values with its 6-bit sub-block scales and minimums (uint8) per 32 and
float16 `d` / `-dmin` per 256; Q6_K int8 values in [-32, 31] with int8 scales per 16 and a
float16 `d` per 256: what the file stores, about 4.6 / 8.6 bits per weight. Q5_0 / Q5_1 /
Q5_K hold their 5-bit values one to an int8 ([-16, 15] / [0, 31]) with Q4_0's / Q4_1's /
Q4_K's scales. Oracles:

- the `gguf` library's own dequantization (the format's definition): our unpacked values
  times scales plus offsets equal it element for element. Q4_1 / Q5_0 / Q5_1 blocks come from
  `gguf.quantize`; `gguf` has no K-quantizer, so Q4_K / Q6_K blocks are written with numpy
  following its block layout (`tests.gguf_helpers.quantize_k`), Q5_K blocks are random valid
  bytes;
- transformers' GGUF loader (its own dequantization): logits equal to float32 precision;
- `plan_memory`: the weight bytes equal what the loaded parameters hold (and the bits per
  weight are the format's: values plus the file's own per-block numbers);
- tensor parallelism (`tests/test_quantized_tp.py`, with the other quantized formats): TP 2
  gives the single-device greedy tokens.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.gguf import convert_gguf  # noqa: E402
from jaxllm.models.gguf_blocks import unpack_blocks  # noqa: E402
from jaxllm.models.memory_plan import plan_memory  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402
from tests.gguf_helpers import (  # noqa: E402
    K_SHAPES,
    assert_logits_equal_transformers,
    dequantized_blocks,
    quantize_k,
    random_k_quant_blocks,
    write_converted,
)
from tests.gguf_helpers import quantized_leaves as _quantized  # noqa: E402

BLOCK = {"Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
# What the device holds per block: (scale dtype, offset dtype or None, super-block or 0).
HELD = {
    "Q4_1": ("float16", "float16", 0),
    "Q5_0": ("float16", None, 0),
    "Q5_1": ("float16", "float16", 0),
    "Q4_K": ("uint8", "uint8", 256),
    "Q5_K": ("uint8", "uint8", 256),
    "Q6_K": ("int8", None, 256),
}
VALUES = {"Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
PACKED = ("Q4_1", "Q4_K")  # 4-bit values, two to a byte on the device; the others one to an int8


def _raw_blocks(x: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "Q5_K":  # `gguf` has no K-quantizer and `quantize_k` writes Q4_K / Q6_K only
        return random_k_quant_blocks(kind, x.shape, np.random.default_rng(1))
    return quantize_k(x, qtype) if qtype in ("Q4_K", "Q6_K") else gguf.quantize(x, kind)


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_unpacked_blocks_equal_the_gguf_library_dequantization(qtype):
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.01, 3.0, (24, 1))).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    raw = _raw_blocks(x, qtype)
    reference = gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    if qtype != "Q5_K":
        assert np.abs(reference - x).max() < 0.2 * np.abs(x).max()  # the blocks hold the weight
    parts = unpack_blocks(raw, qtype)
    values, scales = parts["weight"], parts["weight_scale"]
    scale_dtype, offset_dtype, super_block = HELD[qtype]
    assert values.dtype == np.int8 and values.shape == x.shape and scales.shape == (24, 512 // BLOCK[qtype])
    assert scales.dtype == scale_dtype
    assert (parts["weight_offset"].dtype if "weight_offset" in parts else None) == offset_dtype
    if super_block:
        assert parts["weight_super_scale"].shape == (24, 2) and parts["weight_super_scale"].dtype == np.float16
    low, high = VALUES[qtype]
    assert low <= values.min() and values.max() <= high
    assert values.min() < low + 4 and values.max() > high - 4  # the fifth / sixth bit is read
    np.testing.assert_array_equal(dequantized_blocks(raw, qtype), reference)


def _write(tmp_path, arch: str, qtype: str, **shapes):
    return write_converted(tmp_path, arch, qtype, **shapes)


@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", "Q4_1"),
        ("qwen3_moe", "Q4_1"),
        ("llama", "Q4_K"),
        ("qwen2", "Q6_K"),
        ("llama", "Q5_0"),
        ("qwen3_moe", "Q5_1"),
        ("llama", "Q5_K"),
    ],
)
def test_weights_stay_quantized_and_logits_equal_transformers_gguf_model(tmp_path, arch, qtype):
    shapes = K_SHAPES if qtype.endswith("_K") else {}
    if arch == "qwen2" and shapes:
        shapes = {k: v for k, v in shapes.items() if k != "head_dim"}
    model, gguf_path, directory = _write(tmp_path, arch, qtype, **shapes)
    config = load_model_config(directory, dtype="float32")
    assert config.quantization.method == ("uint4_block" if qtype in PACKED else "int8_block")
    params = load_params(directory, config)
    quantized = _quantized(params)
    assert len(quantized) >= 7  # attention q/k/v/o and the MLP's (or experts') three projections
    scale_dtype, offset_dtype, super_block = HELD[qtype]
    for w in quantized:
        four_bit = qtype in PACKED
        assert w.packed == w.unsigned == four_bit and (w.offset is not None) == (offset_dtype is not None)
        assert w.value.dtype == (np.uint8 if four_bit else np.int8)
        assert w.scale.dtype == scale_dtype and int(np.prod(w.blocks)) == BLOCK[qtype]
        if offset_dtype is not None:
            assert w.offset.shape == w.scale.shape and w.offset.dtype == offset_dtype
        assert (w.super_scale is not None) == bool(super_block)
        if super_block:
            assert w.super_scale.dtype == np.float16 and int(np.prod(w.super_blocks)) == super_block
    for plain in (params["embed"], params.get("lm_head", params["embed"])):
        assert not isinstance(plain, QuantizedWeight)
    assert plan_memory(config, ParallelConfig()).weights_per_device == held_weight_bytes(params)
    assert_logits_equal_transformers(model, gguf_path, params, config)


def test_k_quants_hold_the_bits_per_weight_of_the_file(tmp_path):
    """The quantized linears of a Q4_K / Q6_K file take the bytes of their GGUF blocks on the
    device, give or take the 6-bit sub-block scales held one to a byte and Q6_K's 6-bit values
    held one to an int8: Q4_K 4.625 bits per weight (the file: 4.5), Q6_K 8.5625 (6.5625)."""
    import gguf

    for qtype, bits in (("Q4_K", 4.625), ("Q6_K", 8.5625)):
        _, gguf_path, directory = _write(tmp_path / qtype, "llama", qtype, **K_SHAPES)
        config = load_model_config(directory, dtype="float32")
        quantized = _quantized(load_params(directory, config))
        held = sum(leaf.nbytes for w in quantized for leaf in jax.tree.leaves(w))
        weights = sum(int(np.prod(w.shape)) for w in quantized)
        assert 8 * held / weights == bits
        file_bits = 8 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1] / 256
        assert file_bits == {"Q4_K": 4.5, "Q6_K": 6.5625}[qtype]


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantizing_a_kept_file_on_load_dequantizes_it_first(tmp_path, method):
    """`quantization="fp8"` / `"int8"` on a Q4_1 file holds exactly what the same quantization
    of the file's dequantized float checkpoint (`keep_quantized=False`) holds."""
    from jaxllm.models.quantized_loading import with_quantization

    _, gguf_path, kept = _write(tmp_path, "llama", "Q4_1")
    float_dir = convert_gguf(gguf_path, tmp_path / "float", progress=False, keep_quantized=False)
    assert load_model_config(float_dir).quantization is None
    a = _quantized(load_params(kept, with_quantization(load_model_config(kept, dtype="float32"), method)))
    b = _quantized(load_params(float_dir, with_quantization(load_model_config(float_dir, dtype="float32"), method)))
    assert len(a) == len(b) >= 7
    for w, v in zip(a, b):
        assert w.offset is None and w.super_scale is None and not w.unsigned and w.blocks == v.blocks
        np.testing.assert_array_equal(np.asarray(w.value).view(np.uint8), np.asarray(v.value).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(w.scale), np.asarray(v.scale))
