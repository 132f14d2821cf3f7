"""Quantized experts (GGUF Q4_0 and Q4_K, AWQ and GPTQ 4-bit, FP8) with the online expert load
balancer and with attention data parallelism, on 2 fake CPU devices in one subprocess
(tests/multidevice.py).

Tiny Qwen3-MoE checkpoints kept quantized on the device: two written as GGUF files, Q4_0 (int4
values packed two to a byte, a float16 scale per 32 inputs) and Q4_K (uint4 values, 6-bit scales
and minimums per 32 with float16 super-block scales per 256), one as an AutoAWQ and one as a
GPTQ checkpoint (uint4 values, a float16 scale and an int8 zero point per 128 inputs), and the
float one quantized to FP8 block scales as it loads (dynamic activation quantization on).
Oracle: the single-device engine on the same checkpoint, without the balancer and without
attention DP.

1. EP 2, 6 slots over 4 experts (both MoE layers one scanned layer stack), the online balancer
   rewriting one layer per step and applying every differing placement: the slot tables change,
   every rewritten slot weight's arrays (values, scales, offsets, super-block scales) are donated
   and rewritten at the same device addresses, and the greedy tokens are the single-device ones;
   the weight bytes held stay what `plan_memory` (`jaxllm plan`) counts.
2. Attention DP over the 2 devices (EP 2, or MoE TP 2 for the GGUF files: each device
   dequantizes its half of every expert's columns with its half of the scales; Q4_K's halves
   are whole super-blocks): the single-device greedy tokens.
3. Both at once on the FP8 checkpoint: attention DP with EP 2 and the online balancer moving
   slots, the single-device greedy tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from tests.balancer_engines import RoundWatch, moving_balancer, staggered_workload
from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

# name -> (directory under the test's root, `quantization` asked of the engine, attention DP's EP size:
# 2, or 1 for MoE TP 2, each device dequantizing its half of every expert's columns and scales)
CHECKPOINTS = {
    "gguf_q4_0": ("gguf_q4_0", None, 1),
    "gguf_q4_k": ("gguf_q4_k", None, 1),
    "awq": ("awq", None, 2),
    "gptq": ("gptq", None, 2),
    "fp8_on_load": ("hf", "fp8", 2),
}
OFFSETS = ("gguf_q4_k", "awq", "gptq")  # formats whose slot weights carry an offset per block
NUM_SLOTS = 6
MOE_SHAPES = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)  # AWQ: whole 128-groups
# K-quant rows: 256 inputs per super-block; MoE TP 2 leaves each rank one super-block of down's 512 inputs.
K_MOE_SHAPES = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=512
)


def write_int4_moe(root: Path, method: str) -> Path:
    """A tiny Qwen3-MoE saved as an AutoAWQ (GEMM layout) or asymmetric GPTQ ("gptq" format, zeros
    stored minus one) checkpoint, every attention and expert projection 4-bit (the router, norms,
    embedding and LM head float), experts per module as the hub has them."""
    from safetensors.numpy import save_file

    from tests.gguf_helpers import _state_dict, make_tiny_hf
    from tests.test_awq_gptq import AWQ_ORDER, GROUP, _pack, _quantize

    float_dir = root / f"float_{method}"
    model, _ = make_tiny_hf("qwen3_moe", float_dir, seed=1, **MOE_SHAPES)
    tensors: dict[str, np.ndarray] = {}

    def add_quantized(module: str, w: np.ndarray) -> None:
        q, zero, scale = _quantize(w, sym=False)
        if method == "awq":
            tensors[f"{module}.qweight"] = _pack(q.T, 1, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = _pack(zero.T, 1, AWQ_ORDER)
        else:
            tensors[f"{module}.qweight"] = _pack(q.T, 0, list(range(8)))
            tensors[f"{module}.qzeros"] = _pack((zero - 1).T & 0xF, 1, list(range(8)))
            tensors[f"{module}.g_idx"] = (np.arange(q.shape[1]) // GROUP).astype(np.int32)
        tensors[f"{module}.scales"] = np.ascontiguousarray(scale.T)

    for name, value in _state_dict(model).items():
        module = name.removesuffix(".weight")
        if (
            module.endswith(".mlp.experts.gate_proj")
            or module.endswith(".mlp.experts.up_proj")
            or module.endswith(".mlp.experts.down_proj")
        ):
            base, proj = module.rsplit(".", 1)
            for e in range(value.shape[0]):
                add_quantized(f"{base}.{e}.{proj}", value[e])
        elif module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            add_quantized(module, value)
        else:
            tensors[name] = np.ascontiguousarray(value)
    directory = root / method
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}
    )
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((float_dir / name).read_text())
    return directory


def write_checkpoints(root: Path, names: tuple[str, ...]) -> None:
    from jaxllm.models.gguf import convert_gguf
    from tests.gguf_helpers import make_tiny_hf, write_gguf

    if "gguf_q4_0" in names or "fp8_on_load" in names:
        # 64 expert columns: two Q4_0 blocks of the down projection's inputs, one per MoE TP rank
        model, tokenizer = make_tiny_hf("qwen3_moe", root / "hf", moe_intermediate_size=64)
        path = write_gguf(model, tokenizer, "qwen3_moe", root / "hf" / "Q4_0.gguf", "Q4_0")
        convert_gguf(path, root / "gguf_q4_0", progress=False)
    if "gguf_q4_k" in names:
        model, tokenizer = make_tiny_hf("qwen3_moe", root / "hf_k", seed=2, **K_MOE_SHAPES)
        path = write_gguf(model, tokenizer, "qwen3_moe", root / "hf_k" / "Q4_K.gguf", "Q4_K")
        convert_gguf(path, root / "gguf_q4_k", progress=False)
    for method in ("awq", "gptq"):
        if method in names:
            write_int4_moe(root, method)


def _workload(engine) -> dict[int, list[int]]:
    """Requests arriving over 12 steps (prompts of 4-30 tokens, chunked), 16 greedy tokens each."""
    return staggered_workload(
        engine, seed=7, last_arrival=12, max_tokens=16, prompt_lengths=(4, 31), token_ids=(3, 400), temperature=0.0
    )


# The formats this file runs; tests/test_quantized_ep_layouts_k_gptq.py runs the others (each
# subprocess stays under a minute).
HERE = ("gguf_q4_0", "awq", "fp8_on_load")


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    check_checkpoints(root, HERE)


def check_checkpoints(root: Path, names: tuple[str, ...]) -> None:
    """One JSON line per checkpoint of `names` and layout (and, for the FP8 one, attention DP with
    the online balancer)."""
    import jax

    from jaxllm import KvCacheConfig
    from jaxllm.bench.quant import held_weight_bytes
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.load_balancer import moe_layer_params
    from jaxllm.llm_args import MoeConfig
    from jaxllm.models.memory_plan import plan_memory
    from jaxllm.models.quantization import QuantizedWeight
    from sharding.expert_pool import SLOT_WEIGHTS
    from sharding.mesh import ParallelConfig

    assert len(jax.devices()) == 2

    def new_engine(directory: Path, **kwargs) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(directory),
                dtype="float32",
                max_batch_size=4,
                max_num_tokens=16,
                max_seq_len=64,
                compile_ahead=False,  # one forward program per engine: the 16-token bucket
                decode_batch_sizes=[],
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, enable_block_reuse=False),
                dequantize_on_load=False,  # integer checkpoints: their weights kept quantized
                **kwargs,
            )
        )

    def balanced(engine: LLMEngine, base_tokens: dict) -> dict:
        """Runs the workload on a balancing engine; what the balancer did and the tokens."""
        balancer = engine.load_balancer
        params = engine.runner.params
        watch = RoundWatch(balancer)
        first = {l: balancer.tables[l].copy() for l in balancer.layers}
        slot_weights = [moe_layer_params(params, l)[n] for l in balancer.layers for n in SLOT_WEIGHTS]
        held_before = held_weight_bytes(params)
        tokens = _workload(engine)
        balancer.worker.wait_idle()
        return dict(
            quantized=all(isinstance(w, QuantizedWeight) for w in slot_weights),
            offsets=all(w.offset is not None for w in slot_weights),
            same_tokens=tokens == base_tokens,
            num_tokens=sum(map(len, tokens.values())),
            tables_changed=any(not np.array_equal(first[l], balancer.tables[l]) for l in balancer.layers),
            rebalances=balancer.stats.rebalances,
            slots_rewritten=balancer.stats.slots_rewritten,
            worker_error=repr(balancer.worker.error),
            # every rewritten slot weight's arrays (two or more: values and scales) donated, rewritten in place
            in_place=watch.in_place and min(r["arrays"] for r in watch.rounds) >= 2,
            stacked=all(row is not None for row in balancer.rows.values()),  # one scanned layer stack
            held_before=held_before,
            held_after=held_weight_bytes(engine.runner.params),
            rounds=watch.rounds,
        )

    for name in names:
        where, quantization, dp_ep = CHECKPOINTS[name]
        directory = root / where
        engine_for = functools.partial(new_engine, quantization=quantization)
        base = engine_for(directory)
        base_tokens = _workload(base)
        base.close()

        balancer_config = moving_balancer(NUM_SLOTS)
        engine = engine_for(
            directory,
            tensor_parallel_size=2,
            moe_expert_parallel_size=2,
            moe_config=MoeConfig(load_balancer=balancer_config),
        )
        plan = plan_memory(
            engine.model_config, ParallelConfig(tensor_parallel_size=2, moe_expert_parallel_size=2), num_slots=NUM_SLOTS
        ).weights_per_device
        print(
            json.dumps(dict(kind="balancer", checkpoint=name, plan=plan, **balanced(engine, base_tokens))), flush=True
        )
        engine.close()

        engine = engine_for(directory, tensor_parallel_size=2, moe_expert_parallel_size=dp_ep, enable_attention_dp=True)
        tokens = _workload(engine)
        print(
            json.dumps(
                dict(
                    kind="attention_dp",
                    checkpoint=name,
                    same_tokens=tokens == base_tokens,
                    num_tokens=sum(map(len, tokens.values())),
                    ranks=int(engine.runner.kv_cache[0].k.shape[0]),
                )
            ),
            flush=True,
        )
        engine.close()

        if name == "fp8_on_load":  # attention DP and the online balancer in one engine
            engine = engine_for(
                directory,
                tensor_parallel_size=2,
                moe_expert_parallel_size=2,
                enable_attention_dp=True,
                moe_config=MoeConfig(load_balancer=balancer_config),
            )
            ranks = int(engine.runner.kv_cache[0].k.shape[0])
            print(
                json.dumps(dict(kind="dp_balancer", checkpoint=name, ranks=ranks, **balanced(engine, base_tokens))),
                flush=True,
            )
            engine.close()


def layout_results(tmp_path_factory, module: str, names: tuple[str, ...]) -> list[dict]:
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("quantized_ep")
    write_checkpoints(root, names)
    return run_on_cpu_devices(module, "check_all", root, num_devices=2, xla_flags=FAST_COMPILE)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return layout_results(tmp_path_factory, "test_quantized_ep_layouts", HERE)


def check_balancer_result(results: list[dict], checkpoint: str) -> None:
    r = next(r for r in results if r["kind"] == "balancer" and r["checkpoint"] == checkpoint)
    assert r["quantized"] and r["offsets"] == (checkpoint in OFFSETS)  # every slot weight, scales beside
    assert r["worker_error"] == "None"
    assert r["tables_changed"] and r["rebalances"] > 0 and r["slots_rewritten"] > 0
    assert r["in_place"], "a quantized slot weight's values or scales were not rewritten in place (donated)"
    assert r["stacked"]  # the rows of a layer stack's slot buffers and scales were rewritten
    assert r["num_tokens"] == 8 * 16
    assert r["same_tokens"], f"{checkpoint}: EP 2 with the online balancer differs from one device"
    assert r["held_before"] == r["held_after"] == r["plan"]


def check_attention_dp_result(results: list[dict], checkpoint: str) -> None:
    r = next(r for r in results if r["kind"] == "attention_dp" and r["checkpoint"] == checkpoint)
    assert r["ranks"] == 2 and r["num_tokens"] == 8 * 16
    assert r["same_tokens"], f"{checkpoint}: attention DP differs from one device"


@pytest.mark.parametrize("checkpoint", HERE)
def test_online_balancer_moves_quantized_slots_and_keeps_the_single_device_tokens(results, checkpoint):
    check_balancer_result(results, checkpoint)


@pytest.mark.parametrize("checkpoint", HERE)
def test_attention_dp_with_quantized_weights_keeps_the_single_device_tokens(results, checkpoint):
    check_attention_dp_result(results, checkpoint)


def test_attention_dp_and_the_online_balancer_together_keep_the_single_device_tokens(results):
    """FP8 block experts under attention DP (EP 2), the balancer moving slots while each device
    dequantizes its own slots inside the step (attention DP runs the layers unstacked)."""
    r = next(r for r in results if r["kind"] == "dp_balancer")
    assert r["ranks"] == 2 and r["quantized"] and r["worker_error"] == "None"
    assert r["tables_changed"] and r["rebalances"] > 0 and r["slots_rewritten"] > 0
    rounds = r["rounds"]
    assert len(rounds) > 1 and all(x["donated"] and x["arrays"] >= 2 for x in rounds), rounds
    # Attention DP keeps each layer's slots apart, so each layer's first rewrite donates arrays as
    # the loader left them (not yet written by a program): the CPU runtime releases them but does
    # not always reuse them for the output, a copy once per layer, memory staying as it was. Every
    # later rewrite of a layer is in place.
    rewritten: set[int] = set()
    later = []
    for x in rounds:
        if rewritten.issuperset(x["layers"]):
            later.append(x)
        rewritten.update(x["layers"])
    assert later and all(x["same_address"] for x in later), rounds
    assert r["num_tokens"] == 8 * 16
    assert r["same_tokens"], "attention DP with the online balancer differs from one device"
    assert r["held_before"] == r["held_after"]


def test_attention_dp_refuses_expert_columns_that_split_a_scale_block():
    """Under attention DP each device dequantizes its own expert columns: with int4 weights (a
    scale per 32 inputs), tiny-moe's 64 columns split over 4 MoE tensor ranks are 16, half a block."""
    from jaxllm.models import load_model_config, materialize_preset
    from jaxllm.models.partitioning import check_dp_expert_blocks
    from jaxllm.models.quantized_loading import with_quantization

    config = with_quantization(load_model_config(materialize_preset("tiny-moe")), "int4")
    check_dp_expert_blocks(config, 2)  # 32 columns: one block each
    with pytest.raises(ValueError, match="leaves 16 columns per rank, not whole quantization blocks of 32"):
        check_dp_expert_blocks(config, 4)
