"""GGUF Q8_0 / Q4_0 weights kept quantized on the device.

Tiny random Hugging Face models are written to GGUF with the `gguf` package's writer and
quantizer (`tests.gguf_helpers`), converted, and loaded: the linear projections arrive as
int8 (Q8_0) or int4 packed two to a byte (Q4_0) values with one float32 scale per 32
inputs, and are dequantized in the jitted step. Oracles:

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

from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

import transformers  # noqa: E402

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.gguf import convert_gguf, unpack_blocks  # noqa: E402
from jaxllm.models.memory_plan import plan_memory  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402
from tests.gguf_helpers import make_tiny_hf, write_gguf  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402


def _quantized(params) -> list[QuantizedWeight]:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return [w for w in leaves if isinstance(w, QuantizedWeight)]


def _write(tmp_path: Path, arch: str, qtype: str):
    model, tokenizer = make_tiny_hf(arch, tmp_path / "hf")
    gguf_path = write_gguf(model, tokenizer, arch, tmp_path / "hf" / f"{qtype}.gguf", qtype)
    return model, gguf_path, convert_gguf(gguf_path, tmp_path / "conv", progress=False)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_unpacked_blocks_equal_the_gguf_library_dequantization(qtype):
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quantize(x, kind)
    values, scales, offsets = unpack_blocks(raw, qtype)
    assert offsets is None
    assert values.dtype == np.int8 and values.shape == x.shape and scales.shape == (48, 8)
    low, high = (-127, 127) if qtype == "Q8_0" else (-8, 7)
    assert low <= values.min() and values.max() <= high
    ours = (values.reshape(48, 8, 32).astype(np.float32) * scales[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(ours, gguf.dequantize(raw, kind))


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
        assert w.scale.dtype == np.float32 and int(np.prod(w.blocks)) == 32  # 32 inputs per scale
    for plain in (params["embed"], params["lm_head"]):
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
    values, scales, _ = unpack_blocks(gguf.quantize(x, gguf.GGMLQuantizationType[qtype]), qtype)
    ours, our_scales = quantize_blocks_int(x, (1, 32), 8 if qtype == "Q8_0" else 4)
    np.testing.assert_array_equal(ours, values)
    np.testing.assert_array_equal(our_scales, scales)

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


def test_a_mixed_k_quant_file_keeps_its_most_common_type_where_every_layer_has_it(tmp_path):
    """Q4_K / Q6_K attention and MLP weights (random valid blocks) next to Q8_0 down projections,
    as in llama.cpp's mixed files: the linears of the most common type stay quantized when every
    layer stores that kind in it; a kind some layer stores in another type loads as float in
    every layer (so each layer stack holds one kind of weight, and it is listed in
    `modules_to_not_convert`); the logits are transformers' on the same file."""
    import json
    from collections import Counter

    from gguf import GGUFReader

    path = tmp_path / "hf"
    path.mkdir()
    model, tokenizer = make_tiny_hf(
        "llama", path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=384
    )
    gguf_path = write_gguf(model, tokenizer, "llama", path / "Q4_K_M.gguf", "Q8_0", k_quants=("Q4_K", "Q6_K"))
    linears = {
        t.name: t.tensor_type.name
        for t in GGUFReader(str(gguf_path)).tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name
    }
    kept = Counter(linears.values()).most_common(1)[0][0]
    by_kind: dict[str, set[str]] = {}
    for name, kind in linears.items():
        by_kind.setdefault(name.split(".", 2)[2], set()).add(kind)
    uniform = {k for k, kinds in by_kind.items() if kinds == {kept}}
    assert uniform and len(uniform) < len(by_kind)  # some kinds kept, some mixed
    directory = convert_gguf(gguf_path, tmp_path / "conv", progress=False)
    qc = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert qc["weight_type"] == kept
    config = load_model_config(directory, dtype="float32")
    params = load_params(directory, config)
    (stack,) = params["layer_stacks"]
    param_of = {
        "attn_q.weight": ("attn", "q"),
        "attn_k.weight": ("attn", "k"),
        "attn_v.weight": ("attn", "v"),
        "attn_output.weight": ("attn", "o"),
        "ffn_gate.weight": ("mlp", "gate"),
        "ffn_up.weight": ("mlp", "up"),
        "ffn_down.weight": ("mlp", "down"),
    }
    for kind, (group, leaf) in param_of.items():
        assert isinstance(stack[group][leaf], QuantizedWeight) == (kind in uniform), kind
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), gguf_file=gguf_path.name, config=model.config, dtype=torch.float32
    ).eval()
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, model.config.vocab_size, 24)]
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0].double().numpy()
    paged = PagedModel(params, config, num_blocks=64, max_blocks_per_seq=16, token_bucket=64)
    ours = paged.all_logits([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 64, 16))])[0]
    assert rel_err(ours, ref) < 1e-4
