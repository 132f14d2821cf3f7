"""Quantized weights under tensor parallelism: TP 2 gives the single-device greedy tokens.

AWQ (4-bit, group 128, `tests.test_awq_gptq`), GGUF Q4_0 (packed int4, with the float and with
an FP8 KV cache split by KV head with scales per layer, `tests.test_gguf_quantized`) and GGUF
Q4_1 (unsigned 4-bit values, scales and offsets split like their weight,
`tests.test_gguf_kept_types`) run in one subprocess on 2 fake CPU devices
(`tests.quantized_tp`); each engine also holds the weight bytes `plan_memory` plans.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from tests.quantized_tp import assert_tp_equals_one_device, tensor_parallel_runs  # noqa: E402
from tests.test_awq_gptq import write_checkpoint  # noqa: E402
from tests.test_gguf_kept_types import _write as write_kept  # noqa: E402
from tests.test_gguf_quantized import _write as write_quantized  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_tp")
    for name in ("awq", "q4_0", "q4_1"):
        (root / name).mkdir()
    _, awq, _ = write_checkpoint(root / "awq", "awq")
    q4_0 = write_quantized(root / "q4_0", "llama", "Q4_0")[2]
    q4_1 = write_kept(root / "q4_1", "llama", "Q4_1")[2]
    return tensor_parallel_runs(
        root, {"awq": (awq, ("auto",)), "q4_0": (q4_0, ("auto", "fp8")), "q4_1": (q4_1, ("auto",))}
    )


def test_awq_tensor_parallel_gives_the_single_device_tokens(runs):
    assert all(r["num_quantized"] == 7 for r in runs["awq"])
    assert_tp_equals_one_device(runs["awq"])


def test_gguf_q4_0_tensor_parallel_gives_the_single_device_tokens(runs):
    assert all(r["num_quantized"] and r["all_packed"] for r in runs["q4_0"])
    assert_tp_equals_one_device(runs["q4_0"], ("auto", "fp8"))


def test_gguf_q4_1_tensor_parallel_gives_the_single_device_tokens(runs):
    assert all(r["num_quantized"] and r["all_unsigned_with_offset"] for r in runs["q4_1"])
    assert_tp_equals_one_device(runs["q4_1"])
