"""Computed FP8 KV cache scales (`KvCacheConfig(dtype="fp8", calculate_kv_scales=True)`).

Two random Llamas whose keys and values lie outside what scale 1.0 serves, with the float
model unchanged (q/k and v/o weights scaled by reciprocal factors): keys and values ~1e-4 (below
e4m3's smallest subnormal, 2^-9, so scale 1.0 flushes them to zero) and ~1e3 (beyond 448, so
scale 1.0 saturates them). Oracles:

- the computed scales are amax / 448 of the keys and values HF transformers' model caches for
  the same prompt (a recording `DynamicCache`);
- teacher-forced top-1 agreement with the unquantized HF model over 192 positions is at least
  that of scale 1.0 and of a torch simulation of the same cache (transformers' model with a
  cache rounding to e4m3 with the computed scales);
- the engine built with `calculate_kv_scales=True` serves with the scales of a calibration
  prefill of `CALIBRATION_TEXT`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.llm_args import KvCacheConfig  # noqa: E402
from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.kv_calibration import calibrate_kv_scales, calibration_tokens  # noqa: E402
from jaxllm.models.kv_quant import with_kv_cache_dtype  # noqa: E402
from tests.gguf_helpers import make_tiny_hf  # noqa: E402
from tests.test_fp8_kv_cache import PROMPTS, _hf_logits, _ours, _Recording, _rounding_cache, _top1  # noqa: E402

SHAPES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)
CALIBRATION = [int(t) for t in np.random.default_rng(99).integers(0, 200, 64)]


def _model(tmp_path, factor: float):
    """A tiny Llama whose keys and values are `factor` times a plain random one's (same outputs)."""
    model, _ = make_tiny_hf("llama", tmp_path, **SHAPES)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(1 / factor)
            attn.k_proj.weight.mul_(factor)
            attn.v_proj.weight.mul_(factor)
            attn.o_proj.weight.mul_(1 / factor)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("factor", [1e-4, 2e3])
def test_computed_scales_are_hf_amax_and_beat_unit_scales(tmp_path, factor):
    hf = _model(tmp_path, factor)
    config = with_kv_cache_dtype(load_model_config(tmp_path), tmp_path, "fp8")
    assert config.kv_cache_quant.source == "unit"
    params = load_params(tmp_path, config)
    computed = calibrate_kv_scales(params, config, CALIBRATION)
    assert computed.source == "computed"
    _Recording.amax = {}
    _hf_logits(hf, CALIBRATION, _Recording())
    hf_k = [_Recording.amax[i][0] / 448.0 for i in range(len(_Recording.amax))]
    hf_v = [_Recording.amax[i][1] / 448.0 for i in range(len(_Recording.amax))]
    np.testing.assert_allclose(computed.k_scales, hf_k, rtol=1e-4)
    np.testing.assert_allclose(computed.v_scales, hf_v, rtol=1e-4)

    ref = np.concatenate([_hf_logits(hf, t) for t in PROMPTS])
    unit, _ = _ours(tmp_path, "fp8")
    ours, _ = _ours(tmp_path, "fp8", kv_cache_quant=computed)
    sim = np.concatenate([_hf_logits(hf, t, _rounding_cache(computed.k_scales, computed.v_scales)) for t in PROMPTS])
    agree = {
        name: float(np.mean(_top1(x) == _top1(ref))) for name, x in (("unit", unit), ("computed", ours), ("sim", sim))
    }
    print(f"factor {factor}: teacher-forced top-1 agreement over {len(ref)} positions: {agree}")
    assert agree["computed"] >= agree["sim"] - 2 / len(ref)
    assert agree["computed"] >= agree["unit"]
    assert agree["computed"] >= 0.8 > 0.2 > agree["unit"]  # 1.0 flushes (or saturates) the cache


def test_engine_computes_scales_from_the_calibration_prompt(tmp_path):
    from jaxllm import LLM, SamplingParams

    _model(tmp_path, 1e-4)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_batch_size=2,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, dtype="fp8", calculate_kv_scales=True),
        warmup="none",  # the one request compiles what it runs
    )
    try:
        quant = llm.engine.model_config.kv_cache_quant
        assert quant.source == "computed"
        config = replace(llm.engine.model_config, kv_cache_quant=None)
        config = with_kv_cache_dtype(config, tmp_path, "fp8")
        expected = calibrate_kv_scales(load_params(tmp_path, config), config, calibration_tokens(tmp_path))
        np.testing.assert_allclose(quant.k_scales, expected.k_scales, rtol=1e-6)
        np.testing.assert_allclose(quant.v_scales, expected.v_scales, rtol=1e-6)
        out = llm.generate([[5, 17, 33, 2]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_calculate_kv_scales_needs_an_fp8_cache():
    with pytest.raises(ValueError, match="calculate_kv_scales needs dtype='fp8'"):
        KvCacheConfig(calculate_kv_scales=True)
