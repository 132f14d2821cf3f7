"""HF AWQ and GPTQ 4-bit checkpoints (group_size 128) kept quantized on the device.

Tiny Llama checkpoints are written here with numpy in the published layouts: AutoAWQ's GEMM
packing (`qweight` [in, out/8], each int32 holding eight output columns in the order
[0, 2, 4, 6, 1, 3, 5, 7]; `qzeros` packed the same; fp16 `scales` [in/128, out]) and GPTQ's
(`qweight` [in/8, out] packed along the inputs, `qzeros` [in/128, out/8] along the outputs,
stored minus one in AutoGPTQ's "gptq" format, as is in "gptq_v2"; `g_idx`). Oracles:

- AutoAWQ's / AutoGPTQ's own unpacking (transcribed in torch below: shifts, `reverse_awq_order`,
  zeros + 1) recovers the integers we packed, so the files follow the formats;
- the loaded 4-bit values times scales plus offsets equal `(q - zero) * scale` element for
  element;
- transformers' Llama on the dequantized weights: logits equal to float32 precision;
- TP 2 gives the single-device greedy tokens (`tests/test_quantized_tp.py`, with the other
  quantized formats).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import save_file  # noqa: E402

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.memory_plan import plan_memory  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight, dense  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402
from tests.gguf_helpers import make_tiny_hf  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402

GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SHAPES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [out, in], zeros [out, in/128], fp16 scales [out, in/128]) of a min/max 4-bit quantizer."""
    g = w.reshape(w.shape[0], -1, GROUP)
    if sym:
        scale = (2 * np.abs(g).max(-1) / 15).astype(np.float16)
        zero = np.full(scale.shape, 8, np.int64)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = ((hi - lo) / 15).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / scale.astype(np.float32)[..., None]) + zero[..., None], 0, 15).astype(np.int64)
    return q.reshape(w.shape), zero, scale


def _pack(ints: np.ndarray, axis: int, order: list[int]) -> np.ndarray:
    """Eight 4-bit ints per int32 along `axis`, the value of entry order[i] in bits 4i."""
    x = np.moveaxis(ints, axis, -1)
    x = x.reshape(*x.shape[:-1], -1, 8)
    word = np.zeros(x.shape[:-1], np.uint32)
    for i, entry in enumerate(order):
        word |= (x[..., entry].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), -1, axis))


def _unpack_reference(packed: np.ndarray, awq: bool, axis: int) -> np.ndarray:
    """The published unpacking: AutoAWQ's `unpack_awq` + `reverse_awq_order` (along the last
    axis), AutoGPTQ's shift-and-mask along the packed axis."""
    t = torch.from_numpy(packed)
    shifts = torch.arange(0, 32, 4)
    if awq:
        ints = torch.bitwise_right_shift(t[:, :, None], shifts[None, None, :]).to(torch.int8).view(t.shape[0], -1)
        reverse = torch.arange(ints.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
        return torch.bitwise_and(ints[:, reverse], 15).numpy().astype(np.int64)
    if axis == 0:  # qweight [in/8, out]
        ints = torch.bitwise_right_shift(t[:, None, :], shifts[None, :, None]).view(-1, t.shape[1])
    else:  # qzeros [groups, out/8]
        ints = torch.bitwise_right_shift(t[:, :, None], shifts[None, None, :]).view(t.shape[0], -1)
    return torch.bitwise_and(ints, 15).numpy().astype(np.int64)


def write_checkpoint(root: Path, method: str, sym: bool = False, fmt: str = "gptq", **qc_extra):
    """A tiny Llama saved as `method` ("awq" / "gptq"); returns (HF model on the dequantized
    weights, checkpoint directory, {module: dequantized [out, in]})."""
    model, _ = make_tiny_hf("llama", root / "float", **SHAPES)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors, dequantized = {}, {}
    for name, value in state.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS):
            tensors[name] = value
            continue
        q, zero, scale = _quantize(value, sym)
        stored_zero = zero - 1 if (method == "gptq" and fmt == "gptq") else zero
        if method == "awq":
            tensors[f"{module}.qweight"] = _pack(q.T, 1, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = _pack(zero.T, 1, AWQ_ORDER)
            assert np.array_equal(_unpack_reference(tensors[f"{module}.qweight"], True, 1), q.T)
            assert np.array_equal(_unpack_reference(tensors[f"{module}.qzeros"], True, 1), zero.T)
        else:
            tensors[f"{module}.qweight"] = _pack(q.T, 0, list(range(8)))
            tensors[f"{module}.qzeros"] = _pack(stored_zero.T & 0xF, 1, list(range(8)))
            tensors[f"{module}.g_idx"] = (np.arange(q.shape[1]) // GROUP).astype(np.int32)
            assert np.array_equal(_unpack_reference(tensors[f"{module}.qweight"], False, 0), q.T)
            stored = _unpack_reference(tensors[f"{module}.qzeros"], False, 1)
            assert np.array_equal(stored + 1 if fmt == "gptq" else stored, zero.T)
        tensors[f"{module}.scales"] = np.ascontiguousarray(scale.T)
        s, z = scale.astype(np.float32)[..., None], zero[..., None].astype(np.float32)
        dequantized[module] = ((q.reshape(q.shape[0], -1, GROUP) - z) * s).reshape(q.shape).astype(np.float32)
    directory = root / method
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "float" / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True}
        config["quantization_config"]["version"] = "gemm"
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": sym,
            "checkpoint_format": fmt,
        }
    config["quantization_config"].update(qc_extra)
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((root / "float" / name).read_text())
    with torch.no_grad():
        for module, value in dequantized.items():
            model.get_submodule(module).weight.copy_(torch.from_numpy(value))
    return model, directory, dequantized


def _quantized(params) -> list[QuantizedWeight]:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return [w for w in leaves if isinstance(w, QuantizedWeight)]


@pytest.mark.parametrize(
    "method,sym,fmt", [("awq", False, ""), ("gptq", True, "gptq"), ("gptq", False, "gptq"), ("gptq", False, "gptq_v2")]
)
def test_weights_stay_4_bit_and_logits_equal_the_dequantized_hf_model(tmp_path, method, sym, fmt):
    model, directory, dequantized = write_checkpoint(tmp_path, method, sym, fmt or "gptq")
    config = load_model_config(directory, dtype="float32")
    params = load_params(directory, config)
    quantized = _quantized(params)
    assert len(quantized) == 7
    for w in quantized:
        assert w.packed and w.value.dtype == np.uint8 and int(np.prod(w.blocks)) == GROUP
        assert (w.offset is None) == sym and w.unsigned == (not sym)
        assert w.scale.dtype == np.float16  # the checkpoint's own scales
        assert sym or w.offset.dtype == np.int8  # the zero point, -zero, in units of the scale
    assert plan_memory(config, ParallelConfig()).weights_per_device == held_weight_bytes(params)
    # The held 4-bit values, scales and offsets are (q - zero) * scale, element for element
    # (q_proj: parameter [H, Hq, D] = torch [Hq * D, H] transposed).
    (stack,) = params["layer_stacks"]
    q_param = np.asarray(dense(stack["attn"]["q"]))[0]
    want = dequantized["model.layers.0.self_attn.q_proj"].T.reshape(q_param.shape)
    np.testing.assert_allclose(q_param, want, rtol=0, atol=1e-6 * np.abs(want).max())

    tokens = [int(t) for t in np.random.default_rng(1).integers(0, model.config.vocab_size, 40)]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].double().numpy()
    paged = PagedModel(params, config, num_blocks=64, max_blocks_per_seq=16, token_bucket=64)
    ours = paged.all_logits([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 64, 16))])[0]
    assert np.abs(ref).max() > 0.1
    assert rel_err(ours, ref) < 1e-4


def test_act_order_and_other_layouts_are_refused_by_name(tmp_path):
    _, directory, _ = write_checkpoint(tmp_path, "gptq", desc_act=True)
    with pytest.raises(ValueError, match="desc_act"):
        load_model_config(directory, dtype="float32")
    for field, value, needle in (("group_size", 64, "group_size"), ("bits", 8, "bits")):
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, field: value}
        from jaxllm.models.quant_config import parse_quantization_config

        with pytest.raises(ValueError, match=needle):
            parse_quantization_config(qc)
    # g_idx that is not i // 128 (an act-order file labelled desc_act=false)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (directory / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"  # two groups
    tensors[name] = tensors[name][::-1].copy()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="g_idx"):
        load_params(directory, load_model_config(directory, dtype="float32"))


def test_quantizing_on_load_starts_from_the_dequantized_weights(tmp_path):
    """`quantization="int8"` on an AWQ checkpoint: Q8_0 blocks of `(q - zero) * scale`."""
    from jaxllm.models.quantization import quantize_blocks_int
    from jaxllm.models.quantized_loading import with_quantization

    _, directory, dequantized = write_checkpoint(tmp_path, "awq")
    config = with_quantization(load_model_config(directory, dtype="float32"), "int8")
    (stack,) = load_params(directory, config)["layer_stacks"]
    down = stack["mlp"]["down"]  # parameter [I, H] = torch [H, I] transposed
    assert down.value.dtype == np.int8 and down.offset is None
    values, scales = quantize_blocks_int(dequantized["model.layers.1.mlp.down_proj"].T, down.blocks[-2:], 8)
    np.testing.assert_array_equal(np.asarray(down.value)[1], values)
    np.testing.assert_array_equal(np.asarray(down.scale)[1], scales)


def test_written_float_checkpoint_holds_the_dequantized_weights(tmp_path):
    from safetensors.numpy import load_file

    from jaxllm.models.float_checkpoint import write_float_checkpoint

    _, directory, dequantized = write_checkpoint(tmp_path, "gptq", sym=False)
    out = write_float_checkpoint(directory, tmp_path / "float")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx", "weight_scale")) for name in tensors)
    for module, want in dequantized.items():
        np.testing.assert_allclose(tensors[f"{module}.weight"], want, rtol=0, atol=1e-6 * np.abs(want).max())
