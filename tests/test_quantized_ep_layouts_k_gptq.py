"""GGUF Q4_K and GPTQ 4-bit experts with the online expert load balancer (EP 2) and with
attention data parallelism (MoE TP 2 for Q4_K, whose ranks each get whole 256-input
super-blocks; EP 2 for GPTQ), on 2 fake CPU devices: the single-device greedy tokens, slots
rewritten in place, the weight bytes `jaxllm plan` counts. The checks and checkpoints are
tests/test_quantized_ep_layouts.py's; this file runs these two formats in a subprocess of
its own so that each stays under a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_quantized_ep_layouts import (
    check_attention_dp_result,
    check_balancer_result,
    check_checkpoints,
    layout_results,
)

HERE = ("gguf_q4_k", "gptq")


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    check_checkpoints(root, HERE)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return layout_results(tmp_path_factory, "test_quantized_ep_layouts_k_gptq", HERE)


@pytest.mark.parametrize("checkpoint", HERE)
def test_online_balancer_moves_quantized_slots_and_keeps_the_single_device_tokens(results, checkpoint):
    check_balancer_result(results, checkpoint)


@pytest.mark.parametrize("checkpoint", HERE)
def test_attention_dp_with_quantized_weights_keeps_the_single_device_tokens(results, checkpoint):
    check_attention_dp_result(results, checkpoint)
