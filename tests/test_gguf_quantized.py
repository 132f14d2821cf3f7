"""GGUF Q8_0 / Q4_0 weights kept quantized on the device.

Tiny random Hugging Face models are written to GGUF with the `gguf` package's writer and
quantizer (`tests.gguf_helpers`), converted, and loaded: the linear projections arrive as
int8 (Q8_0) or int4 packed two to a byte (Q4_0) values with one float16 scale per 32
inputs (the file's own `d`), and are dequantized in the jitted step. Oracles:

- the `gguf` library's own dequantization (the format's definition): the unpacked values
  times their scales equal it element for element;
- transformers' GGUF loader (`from_pretrained(gguf_file=...)`, its own dequantization):
  logits equal to float32 precision (Llama with llama.cpp's q/k permutation, Qwen2, and
  Qwen3-MoE's experts);
- `plan_memory`: the per-device weight bytes equal what the loaded parameters hold;
- tensor parallelism (`tests/test_quantized_tp.py`, with the other quantized formats): TP 2
  gives the single-device greedy tokens (2 fake CPU devices), with the float and with an FP8
  KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.gguf import unpack_blocks  # noqa: E402
from jaxllm.models.memory_plan import plan_memory  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402
from tests.gguf_helpers import (  # noqa: E402
    assert_logits_equal_transformers,
    dequantized_blocks,
    write_converted,
)
from tests.gguf_helpers import quantized_leaves as _quantized  # noqa: E402


def _write(tmp_path, arch: str, qtype: str):
    return write_converted(tmp_path, arch, qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_unpacked_blocks_equal_the_gguf_library_dequantization(qtype):
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quantize(x, kind)
    parts = unpack_blocks(raw, qtype)
    values, scales = parts["weight"], parts["weight_scale"]
    assert set(parts) == {"weight", "weight_scale"}
    assert values.dtype == np.int8 and values.shape == x.shape and scales.shape == (48, 8)
    assert scales.dtype == np.float16  # the file's own `d`
    low, high = (-127, 127) if qtype == "Q8_0" else (-8, 7)
    assert low <= values.min() and values.max() <= high
    np.testing.assert_array_equal(dequantized_blocks(raw, qtype), gguf.dequantize(raw, kind))


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3_moe", "Q4_0")])
def test_weights_stay_quantized_and_logits_equal_transformers_gguf_model(tmp_path, arch, qtype):
    model, gguf_path, directory = _write(tmp_path, arch, qtype)
    config = load_model_config(directory, dtype="float32")
    assert config.quantization.method == {"Q8_0": "int8_block", "Q4_0": "int4_block"}[qtype]
    params = load_params(directory, config)
    quantized = _quantized(params)
    # attention q/k/v/o and the (dense or expert) MLP's three projections, stacked over the layers
    assert len(quantized) >= 7
    for w in quantized:
        assert w.value.dtype == (np.int8 if qtype == "Q8_0" else np.uint8) and w.packed == (qtype == "Q4_0")
        assert w.scale.dtype == np.float16 and int(np.prod(w.blocks)) == 32  # 32 inputs per scale
    for plain in (params["embed"], params["lm_head"]):
        assert not isinstance(plain, QuantizedWeight)
    assert plan_memory(config, ParallelConfig()).weights_per_device == held_weight_bytes(params)
    assert_logits_equal_transformers(model, gguf_path, params, config)


def test_packed_int4_takes_half_the_bytes_of_int8(tmp_path):
    _, _, q8 = _write(tmp_path / "q8", "llama", "Q8_0")
    _, _, q4 = _write(tmp_path / "q4", "llama", "Q4_0")
    sizes = {}
    for name, directory in (("q8", q8), ("q4", q4)):
        params = load_params(directory, load_model_config(directory, dtype="float32"))
        sizes[name] = sum(w.value.nbytes for w in _quantized(params))
    assert sizes["q4"] * 2 == sizes["q8"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantizing_on_load_matches_the_gguf_reference_quantizer(tmp_path, qtype):
    """`quantization="int8"` / `"int4"` on a float checkpoint holds, for every linear projection,
    the very values and scales of the GGUF file `gguf.quantize` (ggml's reference quantizer)
    writes from it, so they are GGUF's Q8_0 / Q4_0 blocks."""
    import gguf

    from jaxllm.models.quantization import quantize_blocks_int
    from jaxllm.models.quantized_loading import with_quantization

    x = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    parts = unpack_blocks(gguf.quantize(x, gguf.GGMLQuantizationType[qtype]), qtype)
    ours, our_scales = quantize_blocks_int(x, (1, 32), 8 if qtype == "Q8_0" else 4)
    np.testing.assert_array_equal(ours, parts["weight"])
    np.testing.assert_array_equal(our_scales, parts["weight_scale"])

    _, _, directory = _write(tmp_path, "llama", qtype)
    from_file = load_params(directory, load_model_config(directory, dtype="float32"))
    float_dir = tmp_path / "hf"
    method = "int8" if qtype == "Q8_0" else "int4"
    on_load = load_params(float_dir, with_quantization(load_model_config(float_dir, dtype="float32"), method))
    a, b = _quantized(from_file), _quantized(on_load)
    assert len(a) == len(b) >= 7
    for w, v in zip(a, b):
        assert w.packed == v.packed == (method == "int4") and w.blocks == v.blocks
        np.testing.assert_array_equal(np.asarray(w.value), np.asarray(v.value))
        np.testing.assert_array_equal(np.asarray(w.scale), np.asarray(v.scale))
