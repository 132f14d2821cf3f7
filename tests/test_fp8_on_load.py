"""Quantizing an unquantized checkpoint while it loads (`quantization="fp8"`), and
compressed-tensors' FP8 per-channel checkpoints, against Hugging Face transformers.

- Llama / Qwen3-MoE quantized at load time equal HF on the same 128 x 128 blocks quantized
  by torch (float32 precision), and the FP8 weights take half their bfloat16 bytes on the
  device (counted from the arrays the engine holds);
- a compressed-tensors FP8 per-channel Llama (`weight_scale` [out, 1], dynamic per-token
  activations) equals HF on its dequantized weights, and the torch simulation of its
  activation scheme.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from jaxllm.models.quantized_loading import with_quantization  # noqa: E402
from tests.fp8_checkpoints import (  # noqa: E402
    block_dequantize,
    block_quantize,
    load_meant_weights,
    simulate_dynamic_activations,
)
from tests.model_helpers import rel_err  # noqa: E402
from tests.test_fp8_weights import LLAMA, QWEN3_MOE, TOL, _logits, _ours, _randomize, _tokens  # noqa: E402


def _quantized_hf(model):
    """HF model whose quantizable linear weights hold torch's 128 x 128 block quantization."""
    from tests.fp8_checkpoints import QUANTIZED, hub_state_dict

    meant = {}
    for name, t in hub_state_dict(model).items():
        if QUANTIZED.search(name) and t.ndim == 2:
            meant[name] = block_dequantize(*block_quantize(t))
    load_meant_weights(model, meant)
    return model


@pytest.mark.parametrize(
    "arch,kwargs",
    [("LlamaForCausalLM", LLAMA), ("Qwen3MoeForCausalLM", QWEN3_MOE)],
    ids=["llama", "qwen3_moe"],
)
def test_quantize_on_load_equals_hf_on_block_quantized_weights_and_halves_bytes(tmp_path, arch, kwargs):
    hf_config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kwargs)
    hf = _randomize(getattr(transformers, arch)(hf_config), seed=2)
    hf.save_pretrained(tmp_path)
    tokens = _tokens(20, seed=3)
    config = load_model_config(tmp_path)
    ref = _logits(_quantized_hf(hf), tokens)
    quantized = with_quantization(config, "fp8", "none")
    params = load_params(tmp_path, quantized)
    assert rel_err(_ours(params, quantized, tokens), ref) < TOL
    # Bytes on the device, counted from the arrays the engine holds: FP8 values + float32 scales
    # against the same weights in bfloat16, and the whole model against its bfloat16 load.
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    quant = [w for w in leaves if isinstance(w, QuantizedWeight)]
    fp8_bytes = sum(w.value.nbytes + w.scale.nbytes for w in quant)
    bf16_bytes = sum(w.value.size * 2 for w in quant)
    assert 0.5 < fp8_bytes / bf16_bytes < 0.51
    full = jax.tree.leaves(load_params(tmp_path, replace(config, dtype="bfloat16")))
    ours_total = sum(a.nbytes for a in jax.tree.leaves(params) if a.dtype != np.float32) + sum(
        w.scale.nbytes for w in quant
    )
    assert ours_total < 0.75 * sum(a.nbytes for a in full)


def test_compressed_tensors_fp8_per_channel_checkpoint_matches_hf(tmp_path):
    """Llama in compressed-tensors' FP8 per-channel format: weights-only logits equal HF on the
    dequantized weights; with its dynamic per-token activations, the torch simulation's."""
    from tests.fp8_checkpoints import write_channel_fp8_checkpoint

    hf = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), seed=4)
    load_meant_weights(hf, write_channel_fp8_checkpoint(tmp_path, hf))
    config = load_model_config(tmp_path)
    assert config.quantization.method == "fp8_channel" and config.quantization.activation_group == -1
    tokens = _tokens(20, seed=6)
    ref = _logits(hf, tokens)
    weights_only = with_quantization(config, None, "none")
    params = load_params(tmp_path, weights_only)
    assert params["layer_stacks"][0]["attn"]["q"].scale.shape == (2, 1, 4, 64)  # one scale per output channel
    assert rel_err(_ours(params, weights_only, tokens), ref) < TOL
    handles = simulate_dynamic_activations(hf, group=1 << 30)
    try:
        sim = _logits(hf, tokens)
    finally:
        for h in handles:
            h.remove()
    per_token = np.abs(_ours(load_params(tmp_path, config), config, tokens) - sim).max(-1) / np.abs(sim).max()
    assert np.mean(per_token < 1e-4) >= 0.5 and np.mean(per_token < 0.1) >= 0.95
    assert rel_err(sim, ref) > 1e-3


def test_cli_flags_and_refused_combinations():
    import argparse

    from jaxllm.cli.args import add_engine_args, engine_kwargs
    from jaxllm.engine.capabilities import Layout, check_layout
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.llm_args import MoeConfig
    from jaxllm.models.partitioning import attention_dp_rules, check_dp_expert_blocks, check_quantized_split
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--quantization", "fp8", "--fp8-activation-scheme", "none"]))
    assert kwargs["quantization"] == "fp8" and kwargs["fp8_activation_scheme"] == "none"
    with pytest.raises(ValueError, match="quantization must be 'fp8', 'int8', 'int4' or None, got 'nf4'"):
        EngineConfig(model="tiny-moe", quantization="nf4")
    with pytest.raises(ValueError, match="fp8_activation_scheme must be"):
        EngineConfig(model="tiny-moe", fp8_activation_scheme="static")
    config = with_quantization(load_model_config(_tiny_moe_dir()), "fp8")
    online = MoeConfig(load_balancer=MoeLoadBalancerConfig(num_slots=8, layer_updates_per_iter=1))
    engine = EngineConfig(model="tiny-moe", moe_config=online)
    check_layout(engine, config, Layout("cpu", 1, False))  # the online balancer moves FP8 slots with their scales
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("attn_dp", "expert", "tensor"))
    attention_dp_rules(config, mesh)  # attention DP takes FP8 weights
    # attention DP dequantizes each device's expert columns: they must be whole 128 x 128 blocks
    with pytest.raises(ValueError, match="leaves 32 columns per rank, not whole quantization blocks of 128"):
        check_dp_expert_blocks(with_quantization(config, "fp8", "none"), 2)
    # tiny-moe's 64 expert columns over MoE TP 2: 32 per rank, not whole groups of 128
    with pytest.raises(ValueError, match="leaves 32 columns per rank, not a multiple of 128"):
        check_quantized_split(config, 2)
    check_quantized_split(with_quantization(config, "fp8", "none"), 2)


def _tiny_moe_dir():
    from jaxllm.models import materialize_preset

    return materialize_preset("tiny-moe")
