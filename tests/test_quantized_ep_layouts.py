"""Quantized experts (GGUF Q4_0, AWQ 4-bit, FP8) with the online expert load balancer and with
attention data parallelism, on 2 fake CPU devices in one subprocess (tests/multidevice.py).

Tiny Qwen3-MoE checkpoints kept quantized on the device: one written as a GGUF file with Q4_0
weights (int4 values packed two to a byte, a float32 scale per 32 inputs), one as an AutoAWQ
checkpoint (uint4 values, a scale and an offset per 128 inputs), and the float one quantized to
FP8 block scales as it loads (dynamic activation quantization on). Oracle: the single-device
engine on the same checkpoint, without the balancer and without attention DP.

1. EP 2, 6 slots over 4 experts (both MoE layers one scanned layer stack), the online balancer
   rewriting one layer per step and applying every differing placement: the slot tables change,
   every rewritten slot weight's arrays (values, scales, offsets) are donated and rewritten at
   the same device addresses, and the greedy tokens are the single-device ones; the weight
   bytes held stay what `plan_memory` (`jaxllm plan`) counts.
2. Attention DP over the 2 devices (EP 2, or MoE TP 2 for the GGUF file: each device
   dequantizes its half of every expert's columns with its half of the scales): the
   single-device greedy tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

# name -> (directory under the test's root, `quantization` asked of the engine, attention DP's EP size:
# 2, or 1 for MoE TP 2, each device dequantizing its half of every expert's columns and scales)
CHECKPOINTS = {"gguf_q4_0": ("gguf_q4_0", None, 1), "awq": ("awq", None, 2), "fp8_on_load": ("hf", "fp8", 2)}
NUM_SLOTS = 6
MOE_SHAPES = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)  # AWQ: whole 128-groups


def write_awq_moe(root: Path) -> Path:
    """A tiny Qwen3-MoE saved in AutoAWQ's GEMM layout, every attention and expert projection
    4-bit (the router, norms, embedding and LM head float), experts per module as the hub has them."""
    from safetensors.numpy import save_file

    from tests.gguf_helpers import _state_dict, make_tiny_hf
    from tests.test_awq_gptq import AWQ_ORDER, GROUP, _pack, _quantize

    model, _ = make_tiny_hf("qwen3_moe", root / "float", seed=1, **MOE_SHAPES)
    tensors: dict[str, np.ndarray] = {}

    def add_quantized(module: str, w: np.ndarray) -> None:
        q, zero, scale = _quantize(w, sym=False)
        tensors[f"{module}.qweight"] = _pack(q.T, 1, AWQ_ORDER)
        tensors[f"{module}.qzeros"] = _pack(zero.T, 1, AWQ_ORDER)
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
    directory = root / "awq"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
    }
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((root / "float" / name).read_text())
    return directory


def write_checkpoints(root: Path) -> None:
    from jaxllm.models.gguf import convert_gguf
    from tests.gguf_helpers import make_tiny_hf, write_gguf

    # 64 expert columns: two Q4_0 blocks of the down projection's inputs, one per MoE TP rank
    model, tokenizer = make_tiny_hf("qwen3_moe", root / "hf", moe_intermediate_size=64)
    path = write_gguf(model, tokenizer, "qwen3_moe", root / "hf" / "Q4_0.gguf", "Q4_0")
    convert_gguf(path, root / "gguf_q4_0", progress=False)
    write_awq_moe(root)


def _workload(engine) -> dict[int, list[int]]:
    """Requests arriving over 12 steps (prompts of 4-30 tokens, chunked), 16 greedy tokens each."""
    from jaxllm import SamplingParams

    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = {
        step: [[int(t) for t in rng.integers(3, 400, int(rng.integers(4, 31)))] for _ in range(2)]
        for step in range(0, 12, 3)
    }
    outputs: dict[int, list[int]] = {}
    first_id = None
    step = 0
    while step in prompts or engine.has_unfinished_requests() or step < max(prompts):
        for p in prompts.get(step, []):
            request = engine.add_request(p, params)
            first_id = request.request_id if first_id is None else first_id
        for update in engine.step():
            outputs.setdefault(update.request.request_id - first_id, []).extend(update.new_token_ids)
        step += 1
    return outputs


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices): one JSON line per checkpoint and layout."""
    import jax

    from jaxllm import KvCacheConfig
    from jaxllm.bench.quant import held_weight_bytes
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.load_balancer import moe_layer_params
    from jaxllm.llm_args import MoeConfig
    from jaxllm.models.memory_plan import plan_memory
    from jaxllm.models.quantization import QuantizedWeight
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
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
                **kwargs,
            )
        )

    for name, (where, quantization, dp_ep) in CHECKPOINTS.items():
        directory = root / where
        engine_for = functools.partial(new_engine, quantization=quantization)
        base = engine_for(directory)
        base_tokens = _workload(base)
        base.close()

        balancer_config = MoeLoadBalancerConfig(
            num_slots=NUM_SLOTS, layer_updates_per_iter=1, min_imbalance_gain=-1.0, minimize_moves=False
        )
        engine = engine_for(
            directory,
            tensor_parallel_size=2,
            moe_expert_parallel_size=2,
            moe_config=MoeConfig(load_balancer=balancer_config),
        )
        balancer = engine.load_balancer
        params = engine.runner.params
        in_place: list[bool] = []  # per rewritten slot weight: every array donated, rewritten where it was
        apply_round = balancer.apply_round

        def checked_round(params, apply_round=apply_round, in_place=in_place):
            def arrays(layer: int) -> dict:
                return {n: jax.tree.leaves(moe_layer_params(params, layer)[n]) for n in SLOT_WEIGHTS}

            def where(a) -> list:
                return [(s.device.id, s.data.unsafe_buffer_pointer()) for s in a.addressable_shards]

            old = {l: arrays(l) for l in balancer.layers}
            before = {
                l: {n: [(a.shape, a.sharding, where(a)) for a in v] for n, v in o.items()} for l, o in old.items()
            }
            updated = apply_round(params)
            for l in updated:
                for n, new in arrays(l).items():
                    jax.block_until_ready(new)
                    kept = [(a.shape, a.sharding, where(a)) for a in new] == before[l][n]
                    in_place.append(len(new) > 1 and kept and all(a.is_deleted() for a in old[l][n]))
            return updated

        balancer.apply_round = checked_round
        first = {l: balancer.tables[l].copy() for l in balancer.layers}
        slot_weights = [moe_layer_params(params, l)[n] for l in balancer.layers for n in SLOT_WEIGHTS]
        quantized = all(isinstance(w, QuantizedWeight) for w in slot_weights)
        offsets = all(w.offset is not None for w in slot_weights)
        held_before = held_weight_bytes(params)
        tokens = _workload(engine)
        balancer.worker.wait_idle()
        plan = plan_memory(
            engine.model_config, ParallelConfig(tensor_parallel_size=2, moe_expert_parallel_size=2), num_slots=NUM_SLOTS
        ).weights_per_device
        print(
            json.dumps(
                dict(
                    kind="balancer",
                    checkpoint=name,
                    quantized=quantized,
                    offsets=offsets,
                    same_tokens=tokens == base_tokens,
                    num_tokens=sum(map(len, tokens.values())),
                    tables_changed=any(not np.array_equal(first[l], balancer.tables[l]) for l in balancer.layers),
                    rebalances=balancer.stats.rebalances,
                    slots_rewritten=balancer.stats.slots_rewritten,
                    worker_error=repr(balancer.worker.error),
                    in_place=bool(in_place) and all(in_place),
                    stacked=all(row is not None for row in balancer.rows.values()),  # one scanned layer stack
                    held_before=held_before,
                    held_after=held_weight_bytes(engine.runner.params),
                    plan=plan,
                )
            ),
            flush=True,
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


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("quantized_ep")
    write_checkpoints(root)
    return run_on_cpu_devices("test_quantized_ep_layouts", "check_all", root, num_devices=2, xla_flags=FAST_COMPILE)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_online_balancer_moves_quantized_slots_and_keeps_the_single_device_tokens(results, checkpoint):
    r = next(r for r in results if r["kind"] == "balancer" and r["checkpoint"] == checkpoint)
    assert r["quantized"] and r["offsets"] == (checkpoint == "awq")  # every slot weight, scales beside
    assert r["worker_error"] == "None"
    assert r["tables_changed"] and r["rebalances"] > 0 and r["slots_rewritten"] > 0
    assert r["in_place"], "a quantized slot weight's values or scales were not rewritten in place (donated)"
    assert r["stacked"]  # the rows of a layer stack's slot buffers and scales were rewritten
    assert r["num_tokens"] == 8 * 16
    assert r["same_tokens"], f"{checkpoint}: EP 2 with the online balancer differs from one device"
    assert r["held_before"] == r["held_after"] == r["plan"]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_attention_dp_with_quantized_weights_keeps_the_single_device_tokens(results, checkpoint):
    r = next(r for r in results if r["kind"] == "attention_dp" and r["checkpoint"] == checkpoint)
    assert r["ranks"] == 2 and r["num_tokens"] == 8 * 16
    assert r["same_tokens"], f"{checkpoint}: attention DP differs from one device"


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
