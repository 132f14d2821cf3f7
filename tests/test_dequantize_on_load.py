"""Integer-quantized checkpoints dequantized at load (`EngineConfig.dequantize_on_load`).

A tiny random Llama written as a GGUF Q4_1 file (`tests.gguf_helpers`, the `gguf` package's
quantizer) and converted. Oracle: the same engine with the weights kept quantized
(`dequantize_on_load=False`), which dequantizes them inside each step: the float parameters
of the default (on a CPU) engine equal the kept weights dequantized, and it gives the same
greedy tokens and logits. `jaxllm plan` with `--dequantize-on-load on` plans the bytes that
engine holds; by default it plans for a GPU, which keeps them quantized.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from jaxllm.bench.quant import held_weight_bytes  # noqa: E402
from jaxllm.cli import build_parser  # noqa: E402
from jaxllm.cli.args import engine_kwargs  # noqa: E402
from jaxllm.cli.plan import build_parser as plan_parser  # noqa: E402
from jaxllm.cli.plan import make_plan  # noqa: E402
from jaxllm.engine.engine_config import EngineConfig  # noqa: E402
from jaxllm.models import load_model_config  # noqa: E402
from jaxllm.models.quant_config import parse_quantization_config  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight, dense  # noqa: E402
from jaxllm.models.quantized_loading import dequantizes_on_load, with_dequantize_on_load, with_quantization  # noqa: E402
from tests.fp8_checkpoints import FP8_CONFIG  # noqa: E402
from tests.gguf_helpers import quantized_leaves, write_converted  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64], [300, 8, 1, 77]]


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    _, _, directory = write_converted(tmp_path_factory.mktemp("deq"), "llama", "Q4_1")
    return directory


def _run(directory, **kwargs):
    """(greedy tokens, generation logits, parameters, model config, held weight bytes)."""
    from jaxllm import LLM, KvCacheConfig, SamplingParams

    llm = LLM(
        str(directory),
        dtype="float32",
        max_batch_size=2,
        max_num_tokens=16,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256),
        warmup="none",  # the greedy requests compile what they run
        **kwargs,
    )
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_generation_logits=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        engine = llm.engine
        weights = engine.runner.params
        return (
            [list(o.outputs[0].token_ids) for o in outputs],
            [np.asarray(o.outputs[0].generation_logits) for o in outputs],
            weights,
            engine.model_config,
            held_weight_bytes(weights),
        )
    finally:
        llm.shutdown()


def test_auto_on_cpu_holds_float_weights_with_the_kept_weights_numbers(q4_1):
    assert jax.devices()[0].platform == "cpu"
    tokens, logits, params, config, held = _run(q4_1)  # dequantize_on_load=None: auto
    kept_tokens, kept_logits, kept_params, kept_config, kept_held = _run(q4_1, dequantize_on_load=False)

    assert config.quantization is None and config.dequantized_from.name == "Q4_1"
    assert not quantized_leaves(params) and kept_config.quantization.name == "Q4_1"
    assert len(quantized_leaves(kept_params)) == 7  # q, k, v, o, gate, up, down (layers stacked)
    # Every kept weight, dequantized as the step does, is the float parameter the default engine holds.
    float_leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    kept_leaves = jax.tree_util.tree_leaves_with_path(kept_params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    compared = 0
    for path, leaf in kept_leaves:
        if isinstance(leaf, QuantizedWeight):
            np.testing.assert_allclose(float_leaves[path], dense(leaf, np.float32), rtol=1e-6, atol=1e-7)
            compared += 1
    assert compared == 7 and held > kept_held

    assert tokens == kept_tokens and all(len(t) == 6 for t in tokens)
    for ours, theirs in zip(logits, kept_logits):
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()

    # `jaxllm plan` (a GPU's rule) keeps them quantized unless told; told, it plans the bytes held here.
    kept_plan = make_plan(plan_parser().parse_args(["--model", str(q4_1), "--dtype", "float32"]))[1]
    args = plan_parser().parse_args(["--model", str(q4_1), "--dtype", "float32", "--dequantize-on-load", "on"])
    plan_config, plan = make_plan(args)
    assert plan_config.dequantized_from is not None and plan.scale_bytes == 0
    assert plan.weights_per_device == held
    assert kept_plan.weights_per_device == kept_held and kept_plan.scale_bytes > 0


def test_auto_keeps_integer_weights_off_cpu_and_never_touches_fp8_or_on_load_quantization(q4_1):
    config = load_model_config(q4_1, dtype="float32")
    assert dequantizes_on_load(config, None, "cpu")
    assert not dequantizes_on_load(config, None, "gpu") and not dequantizes_on_load(config, None, "tpu")
    assert dequantizes_on_load(config, True, "gpu") and not dequantizes_on_load(config, False, "cpu")
    assert with_dequantize_on_load(config, None, "gpu") is config
    held = with_dequantize_on_load(config, None, "cpu")
    assert held.quantization is None and held.dequantized_from == config.quantization
    # An FP8 checkpoint and a quantization asked on load keep theirs, even when told.
    fp8 = replace(config, quantization=parse_quantization_config(FP8_CONFIG))
    assert not dequantizes_on_load(fp8, True, "cpu")
    int8 = with_quantization(config, "int8")
    assert int8.quantization.stored is not None and not dequantizes_on_load(int8, True, "cpu")
    float_model = replace(config, quantization=None)
    assert with_dequantize_on_load(float_model, True, "cpu") is float_model


def test_flag_parses_and_bad_values_are_refused():
    for flag, value in (("auto", None), ("on", True), ("off", False)):
        args = build_parser().parse_args(["generate", "--dequantize-on-load", flag])
        assert engine_kwargs(args)["dequantize_on_load"] is value
    assert engine_kwargs(build_parser().parse_args(["generate"]))["dequantize_on_load"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dequantize-on-load", "maybe"])
    for bad in ("yes", 1, "off"):
        with pytest.raises(ValueError, match="dequantize_on_load must be True, False or None"):
            EngineConfig(model="tiny-dense", dequantize_on_load=bad)
