"""GGUF files mixing block types per tensor (llama.cpp's Q4_K_M) keep each tensor quantized.

A layer stack holds one layout: a kind every layer stores in one type keeps that type; a kind
whose layers mix K-quants is held in the wider layout that holds each layer's blocks exactly
(Q4_K with Q5_K: Q5_K's int8 values; with Q6_K: "K_INT8", int8 values, scales and minimums per
16); other mixes load dequantized. Oracles:

- the `gguf` library's own dequantization: each type's blocks in each layout it can be held
  in give it element for element;
- transformers' GGUF loader (its own dequantization) on the mixed file: logits equal to
  float32 precision;
- `plan_memory`: the weight bytes equal what the loaded parameters hold.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
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


@pytest.mark.parametrize("qtype,held", [("Q4_K", "Q5_K"), ("Q4_K", "K_INT8"), ("Q5_K", "K_INT8"), ("Q6_K", "K_INT8")])
def test_blocks_held_in_a_wider_layout_equal_the_gguf_library_dequantization(qtype, held):
    import gguf

    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "Q5_K":
        raw = random_k_quant_blocks(kind, (8, 512), rng)
    else:
        raw = quantize_k(rng.standard_normal((8, 512)).astype(np.float32), qtype)
    np.testing.assert_array_equal(dequantized_blocks(raw, qtype, held), gguf.dequantize(raw, kind))


# Layer 0 and layer 1 of a 2-layer Llama, every other linear Q4_K: attn_v Q6_K / Q4_K (held
# K_INT8), ffn_gate Q5_K / Q4_K (held Q5_K), ffn_down Q6_K in both (kept Q6_K), attn_k Q8_0 in
# both (kept Q8_0), attn_output Q8_0 / Q4_K (a mix no layout holds: dequantized).
TYPES = {
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q6_K",
    "blk.0.attn_k.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q8_0",
}
# parameter -> (held type, value dtype, scale dtype, block, with offset, super-block)
EXPECTED = {
    ("attn", "q"): ("Q4_K", np.uint8, np.uint8, 32, True, 256),
    ("attn", "k"): ("Q8_0", np.int8, np.float16, 32, False, 0),
    ("attn", "v"): ("K_INT8", np.int8, np.int8, 16, True, 256),
    ("mlp", "gate"): ("Q5_K", np.int8, np.uint8, 32, True, 256),
    ("mlp", "up"): ("Q4_K", np.uint8, np.uint8, 32, True, 256),
    ("mlp", "down"): ("Q6_K", np.int8, np.int8, 16, False, 256),
}


def test_each_tensor_keeps_its_own_type_and_logits_equal_transformers(tmp_path):
    model, gguf_path, directory = write_converted(tmp_path, "llama", "Q4_K", tensor_types=TYPES, **K_SHAPES)
    qc = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert qc["weight_type"] == "Q4_K"
    assert set(qc["weight_types"].values()) == {"Q8_0", "K_INT8", "Q5_K", "Q6_K"}
    assert qc["modules_to_not_convert"] == [f"model.layers.{i}.self_attn.o_proj" for i in range(2)]
    config = load_model_config(directory, dtype="float32")
    params = load_params(directory, config)
    (stack,) = params["layer_stacks"]
    for (group, leaf), (_, value, scale, block, offset, super_block) in EXPECTED.items():
        w = stack[group][leaf]
        assert isinstance(w, QuantizedWeight), leaf
        assert w.value.dtype == value and w.scale.dtype == scale and int(np.prod(w.blocks)) == block, leaf
        assert (w.offset is not None) == offset and (w.super_scale is not None) == bool(super_block), leaf
        if super_block:
            assert w.super_scale.dtype == np.float16 and int(np.prod(w.super_blocks)) == super_block
    assert not isinstance(stack["attn"]["o"], QuantizedWeight)
    assert plan_memory(config, ParallelConfig()).weights_per_device == held_weight_bytes(params)
    assert_logits_equal_transformers(model, gguf_path, params, config)


def test_a_module_type_not_held_quantized_is_a_named_error():
    from jaxllm.models.quant_config import parse_quantization_config

    qc = {"quant_method": "gguf", "weight_type": "Q4_K", "weight_types": {"model.layers.0.mlp.down_proj": "Q6_K"}}
    fmt = parse_quantization_config(qc).for_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert (fmt.method, fmt.weight_block_size, fmt.scale_dtype) == ("int8_block", (1, 16), "int8")
    qc["weight_types"] = {"model.layers.0.mlp.down_proj": "Q3_K"}
    with pytest.raises(ValueError, match=r"weight_types\['model.layers.0.mlp.down_proj'\]='Q3_K'"):
        parse_quantization_config(qc)
    with pytest.raises(ValueError, match="weight_types must map module names"):
        parse_quantization_config({**qc, "weight_types": ["Q6_K"]})
