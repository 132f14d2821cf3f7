"""FP8 DeepSeek-V3 weights under tensor and expert parallelism (8 fake CPU devices, in a
subprocess): the engine's greedy tokens at TP 2 and at TP 2 x EP 2 with redundant expert
slots (10 slots for 8 experts, so two experts have a replica, each reading its FP8 values
and scales) equal the single-device tokens, and every layout's per-device weight bytes
equal `jaxllm plan`'s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.multidevice import run_on_cpu_devices

MAX_TOKENS = 8
CASES = [(2, 1, None), (2, 2, 10)]  # (tensor_parallel_size, moe_expert_parallel_size, slots)


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    from jaxllm.bench.quant import held_weight_bytes
    from jaxllm.llm_args import MoeConfig
    from jaxllm.models.memory_plan import plan_memory
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from sharding.mesh import ParallelConfig
    from tests.parallel_workload import small_engine
    from tests.test_deepseek import _engine_outputs, staggered_prompts

    assert len(jax.devices()) == 8
    directory = root / "ds"
    arrivals = staggered_prompts(json.loads((directory / "config.json").read_text())["vocab_size"])

    def run(tp: int = 1, ep: int = 1, slots=None) -> dict:
        extra = {}
        if slots:
            balancer = MoeLoadBalancerConfig(num_slots=slots, layer_updates_per_iter=0)
            extra["moe_config"] = MoeConfig(load_balancer=balancer)
        engine = small_engine(directory, directory, tensor_parallel_size=tp, moe_expert_parallel_size=ep, **extra)
        tokens = _engine_outputs(engine, arrivals, max_tokens=MAX_TOKENS)
        plan = plan_memory(engine.model_config, ParallelConfig(tp, ep), num_slots=slots)
        held = held_weight_bytes(engine.runner.params)
        engine.close()
        return dict(
            tp=tp, ep=ep, tokens={str(k): v for k, v in sorted(tokens.items())}, plan=plan.weights_per_device, held=held
        )

    print(json.dumps(dict(kind="base", **run())), flush=True)
    for tp, ep, slots in CASES:
        print(json.dumps(dict(kind="parallel", **run(tp, ep, slots))), flush=True)


def test_fp8_tensor_and_expert_parallel_match_single_device(tmp_path):
    pytest.importorskip("torch")
    from jaxllm.models import materialize_preset
    from tests.fp8_checkpoints import write_fp8_checkpoint
    from tests.test_deepseek import build_hf
    from tests.test_fp8_weights import DS

    # 256 expert columns: 128 per rank at MoE TP 2, whole activation-quantization groups.
    write_fp8_checkpoint(tmp_path / "ds", build_hf(dict(DS, moe_intermediate_size=256), seed=3))
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, tmp_path / "ds" / name)
    results = run_on_cpu_devices("test_fp8_parallel", "check_all", tmp_path, unset_env=("EXPERT_STATISTIC_ITER_RANGE",))
    base = next(r for r in results if r["kind"] == "base")
    assert len(base["tokens"]) == 5 and all(len(t) == MAX_TOKENS for t in base["tokens"].values())
    assert base["plan"] == base["held"]
    parallel = [r for r in results if r["kind"] == "parallel"]
    assert len(parallel) == len(CASES)
    for r in parallel:
        assert r["tokens"] == base["tokens"], f"TP {r['tp']} EP {r['ep']}: tokens differ from one device"
        assert r["plan"] == r["held"], f"TP {r['tp']} EP {r['ep']}: plan {r['plan']} != engine {r['held']} bytes"
