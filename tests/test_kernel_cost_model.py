"""The kernels' launch cost model: occupancy guards at real model shapes, without a GPU.

The model builds the kernels' own tilings and device work tables, so a tiling change that
leaves most SMs idle at small batches (the review found ~48 working CTAs of 774 for
Qwen3-30B-A3B's MoE gate/up at batch 1) fails here.
"""

from __future__ import annotations

import pytest

from pallas_kernels import cost_model, cost_model_quant
from pallas_kernels.cost_model import H100, MOE_MODELS, AttentionShape, decode_batch, mixed_batch


@pytest.mark.parametrize("model", MOE_MODELS, ids=lambda m: m.name)
def test_moe_fills_the_gpu_at_decode_batch_one(model):
    gate_up, down = cost_model.moe_costs(model, 1)
    assert gate_up.working >= H100.num_sms, gate_up
    assert down.working >= H100.num_sms, down
    # Every working program reads its weight tile; nothing reads less than each active expert's weights once.
    unique_weights = model.top_k * 3 * model.hidden * model.inter * 2
    assert gate_up.bytes + down.bytes >= unique_weights


def test_fused_moe_moves_fewer_bytes_than_the_sorted_rows_path():
    model = MOE_MODELS[0]
    fused = sum(c.bytes for c in cost_model.moe_costs(model, 256))
    sorted_rows = sum(c.bytes for c in cost_model.moe_costs(model, 256, fused=False))
    assert fused < sorted_rows


def test_attention_splits_only_decode_and_uses_decode_tiles_in_mixed_buckets():
    llama = AttentionShape("Llama-3-8B", 32, 8, 128)
    prefill, decode = cost_model.attention_costs(llama, mixed_batch(512, 63, 4096, num_tokens=1024, num_seq_slots=64))
    assert prefill.grid[2] == 1, "prefill tiles must not get flash-decoding splits"
    assert "block_m=16" in decode.note and decode.working >= H100.num_sms
    (one,) = cost_model.attention_costs(llama, decode_batch(16, 4096))
    assert one.working >= H100.num_sms
    assert one.bytes >= 16 * 4096 * 8 * 128 * 2 * 2  # every cached K/V row read at least once


def test_cost_model_table_from_the_command_line(capsys, monkeypatch):
    from jaxllm.bench import kernels

    monkeypatch.setattr(cost_model, "default_cases", lambda: cost_model.moe_costs(MOE_MODELS[1], 1))
    assert kernels.main(["--cost-model", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "moe_gate_up" in out and "H200 us" in out and "H100" not in out


@pytest.mark.parametrize("shape", cost_model_quant.GEMM_SHAPES, ids=lambda s: s.name)
def test_quantized_matmul_fills_the_gpu_at_decode_and_reads_the_weight_once(shape):
    kernel, dequantize, dot = cost_model_quant.quantized_matmul_costs(shape, 1, "fp8")
    assert kernel.working >= H100.num_sms, kernel
    stored = shape.k * shape.n  # one byte per FP8 value
    assert stored <= kernel.bytes < 1.1 * stored + 1e6
    assert kernel.bytes < dequantize.bytes + dot.bytes


def test_fp8_grouped_ffn_reads_less_than_dequantizing_every_expert():
    for tokens in (1, 64):
        *launches, dequantize = cost_model_quant.moe_fp8_costs(MOE_MODELS[2], tokens)
        assert sum(c.bytes for c in launches) < dequantize.bytes
        bf16 = sum(c.bytes for c in cost_model.moe_costs(MOE_MODELS[2], tokens))
        assert sum(c.bytes for c in launches) < bf16


def test_cost_model_quant_rows_from_the_command_line(capsys):
    from jaxllm.bench import kernels

    assert kernels.main(["--cost-model", "--only", "quant", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "quantized_matmul" in out and "moe_gate_up_fp8" in out and "xla_dequantize_experts" in out
    assert "ragged_paged_attention" not in out
