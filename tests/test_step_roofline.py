"""Per-step bytes and FLOPs of the engine section's MBU columns, against the published sizes of
the models (Meta: Llama-3-8B 8.03B parameters; Qwen: Qwen3-30B-A3B 30.5B, 3.3B activated)."""

from __future__ import annotations

import pytest

from jaxllm.bench.gpu.engine_plan import LLAMA_3_8B, QWEN3_30B_A3B, plan
from jaxllm.bench.gpu.step_roofline import step_roofline


def test_llama_step_reads_every_weight_but_the_embedding_table():
    roof = step_roofline(LLAMA_3_8B.config(), "bfloat16")
    assert roof.weight_bytes / 2 == pytest.approx(8.03e9, rel=0.01)
    embedding = 128256 * 4096 * 2
    assert roof.decode_bytes(1, 0) == roof.weight_bytes - embedding + 4096 * 2
    assert roof.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head_dim x bf16
    # 2 FLOPs per matmul parameter per token (no MoE), plus q.k and p.v over the cache.
    assert roof.decode_flops(1, 0) == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)
    assert roof.decode_flops(1, 1000) - roof.decode_flops(1, 0) == 32 * 2 * 32 * 2 * 128 * 1000


def test_moe_step_reads_the_experts_its_tokens_activate():
    roof = step_roofline(QWEN3_30B_A3B.config(), "bfloat16")
    assert roof.weight_bytes / 2 == pytest.approx(30.5e9, rel=0.01)
    assert roof.active_experts(1) == pytest.approx(8)
    assert roof.active_experts(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert roof.active_experts(4096) == pytest.approx(128)
    all_read = roof.decode_bytes(4096, 0) - 4096 * roof.embed_row_bytes
    assert all_read == pytest.approx(roof.weight_bytes - 151936 * 2048 * 2)
    activated = roof.decode_flops(1, 0) / 2 + 151936 * 2048  # + the embedding, counted in the 3.3B
    assert activated == pytest.approx(3.3e9, rel=0.03)


def test_gpu_plan_is_the_issue_workload():
    p = plan(False)
    assert [m.config().num_layers for m in p.models] == [32, 48]
    assert (p.input_len, p.output_len, p.concurrencies, p.backends) == (1024, 128, (1, 16, 64, 256), ("pallas", "xla"))
    assert p.num_forwards() == 7
