"""GGUF Q4_1, Q4_K and Q6_K weights kept quantized on the device.

Q4_1 (SmolLM2's file type) and Q4_K hold 4-bit values in [0, 15] with a float32 scale and
offset per block of 32 (`value * scale + offset`), packed two to a byte on the device; Q6_K
holds int8 values in [-32, 31] with a float32 scale per 16. Oracles:

- the `gguf` library's own dequantization (the format's definition): our unpacked values
  times scales plus offsets equal it element for element. Q4_1 blocks come from `gguf.quantize`;
  `gguf` has no K-quantizer, so Q4_K / Q6_K blocks are written with numpy following its block
  layout (`tests.gguf_helpers.quantize_k`);
- transformers' GGUF loader (its own dequantization): logits equal to float32 precision;
- `plan_memory`: the weight bytes equal what the loaded parameters hold;
- tensor parallelism (`tests/test_quantized_tp.py`, with the other quantized formats): TP 2
  gives the single-device greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

import transformers  # noqa: E402

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.gguf import convert_gguf  # noqa: E402
from jaxllm.models.gguf_blocks import unpack_blocks  # noqa: E402
from jaxllm.models.memory_plan import plan_memory  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402
from tests.gguf_helpers import make_tiny_hf, quantize_k, write_gguf  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402

# 256-wide rows (K-quant super-blocks): hidden 256, down_proj's inputs 512.
K_SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
BLOCK = {"Q4_1": 32, "Q4_K": 32, "Q6_K": 16}


def _quantized(params) -> list[QuantizedWeight]:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return [w for w in leaves if isinstance(w, QuantizedWeight)]


def _raw_blocks(x: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    return gguf.quantize(x, gguf.GGMLQuantizationType.Q4_1) if qtype == "Q4_1" else quantize_k(x, qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_unpacked_blocks_equal_the_gguf_library_dequantization(qtype):
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.01, 3.0, (24, 1))).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    raw = _raw_blocks(x, qtype)
    reference = gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert np.abs(reference - x).max() < 0.2 * np.abs(x).max()  # the blocks hold the weight
    values, scales, offsets = unpack_blocks(raw, qtype)
    block = BLOCK[qtype]
    assert values.dtype == np.int8 and values.shape == x.shape and scales.shape == (24, 512 // block)
    low, high = (-32, 31) if qtype == "Q6_K" else (0, 15)
    assert low <= values.min() and values.max() <= high
    assert (offsets is None) == (qtype == "Q6_K")
    ours = values.reshape(24, -1, block).astype(np.float32) * scales[..., None]
    if offsets is not None:
        ours = ours + offsets[..., None]
    np.testing.assert_array_equal(ours.reshape(x.shape), reference)


def _write(tmp_path: Path, arch: str, qtype: str, **shapes):
    path = tmp_path / "hf"
    path.mkdir(parents=True)
    model, tokenizer = make_tiny_hf(arch, path, **shapes)
    gguf_path = write_gguf(model, tokenizer, arch, path / f"{qtype}.gguf", qtype)
    return model, gguf_path, convert_gguf(gguf_path, tmp_path / "conv", progress=False)


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen3_moe", "Q4_1"), ("llama", "Q4_K"), ("qwen2", "Q6_K")])
def test_weights_stay_quantized_and_logits_equal_transformers_gguf_model(tmp_path, arch, qtype):
    shapes = K_SHAPES if qtype in ("Q4_K", "Q6_K") else {}
    if arch == "qwen2" and shapes:
        shapes = {k: v for k, v in shapes.items() if k != "head_dim"}
    model, gguf_path, directory = _write(tmp_path, arch, qtype, **shapes)
    config = load_model_config(directory, dtype="float32")
    assert config.quantization.method == {"Q4_1": "uint4_block", "Q4_K": "uint4_block", "Q6_K": "int8_block"}[qtype]
    params = load_params(directory, config)
    quantized = _quantized(params)
    assert len(quantized) >= 7  # attention q/k/v/o and the MLP's (or experts') three projections
    for w in quantized:
        four_bit = qtype != "Q6_K"
        assert w.packed == w.unsigned == four_bit and (w.offset is not None) == four_bit
        assert w.value.dtype == (np.uint8 if four_bit else np.int8)
        assert w.scale.dtype == np.float32 and int(np.prod(w.blocks)) == BLOCK[qtype]
        if four_bit:
            assert w.offset.shape == w.scale.shape and w.offset.dtype == np.float32
    for plain in (params["embed"], params.get("lm_head", params["embed"])):
        assert not isinstance(plain, QuantizedWeight)
    assert plan_memory(config, ParallelConfig()).weights_per_device == held_weight_bytes(params)

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=model.config, dtype=torch.float32
    ).eval()
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, model.config.vocab_size, 40)]
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0].double().numpy()
    paged = PagedModel(params, config, num_blocks=64, max_blocks_per_seq=16, token_bucket=64)
    ours = paged.all_logits([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 64, 16))])[0]
    assert np.abs(ref).max() > 0.1
    assert rel_err(ours, ref) < 1e-4


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
        assert w.offset is None and not w.unsigned and w.blocks == v.blocks
        np.testing.assert_array_equal(np.asarray(w.value).view(np.uint8), np.asarray(v.value).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(w.scale), np.asarray(v.scale))
