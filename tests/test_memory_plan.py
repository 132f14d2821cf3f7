"""`jaxllm plan`: per-device weight bytes from the weight declaration alone, checked against the
bytes the engine holds on its devices (same declaration, rules and scale placement), and
DeepSeek-V3's published config: FP8 fits 8 x H200 with EP 8, bfloat16 does not."""

from __future__ import annotations

import jax
import pytest

from jaxllm.bench.quant import held_weight_bytes
from jaxllm.cli.plan import main as plan_main
from jaxllm.models.known_configs import DEEPSEEK_V3
from jaxllm.models.memory_plan import GPU_MEMORY_BYTES, plan_memory
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.quantization import QuantizedWeight
from sharding.mesh import ParallelConfig
from tests.conftest import tiny_engine


def test_plan_equals_what_the_engine_allocates_for_a_quantized_tiny_moe():
    engine = tiny_engine("tiny-moe", quantization="fp8")
    try:
        params = engine.runner.params
        quantized = [
            w
            for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
            if isinstance(w, QuantizedWeight)
        ]
        assert quantized and all(w.value.dtype == jax.numpy.float8_e4m3fn for w in quantized)
        plan = plan_memory(engine.model_config, ParallelConfig())
        assert plan.weights_per_device == held_weight_bytes(params)
        assert plan.scale_bytes == sum(w.scale.nbytes for w in quantized)
    finally:
        engine.close()


def test_deepseek_v3_fp8_fits_eight_h200_with_ep8_and_bf16_does_not(capsys):
    config = ModelConfig.from_hf_config(DEEPSEEK_V3)
    fp8 = plan_memory(config, ParallelConfig(8, 8), device_bytes=GPU_MEMORY_BYTES["h200"])
    # 256 routed experts over 8 ranks: 32 per device, 58 MoE layers of 3 x 7168 x 2048 FP8 weights.
    assert fp8.weight_bytes["routed experts"] == pytest.approx(58 * 32 * 3 * 7168 * 2048 * (1 + 4 / 128**2), rel=1e-3)
    assert 80e9 < fp8.weights_per_device < 95e9
    assert fp8.kv_bytes_per_token == 61 * (512 + 64) * 2  # the bf16 MLA latent cache, whole on every device
    assert fp8.kv_tokens > 500_000
    assert plan_main(["--model", "deepseek-ai/DeepSeek-V3", "--tp", "8", "--ep", "8", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and f"{fp8.kv_tokens:,} tokens fit" in out
    code = plan_main(["--model", "deepseek-v3", "--tp", "8", "--ep", "8", "--gpu", "h200", "--quantization", "none"])
    assert code == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_plan_bad_input_is_one_line(capsys, tmp_path):
    assert plan_main(["--model", str(tmp_path / "nothing"), "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxllm plan: error:") and "\n" not in err
    assert plan_main(["--model", "deepseek-v3", "--tp", "8", "--ep", "3"]) == 2
    assert "moe_expert_parallel_size=3" in capsys.readouterr().err
