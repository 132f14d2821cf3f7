"""The engine under expert parallelism, and the offline EPLB workflow end to end
(8 fake CPU devices, in a subprocess; see test_sharding_tp.py).

1. The single-device engine serves a scripted in-flight-batching workload (chunked
   prefill, prefix reuse, prefill and decode in one step) while recording expert
   statistics through EXPERT_STATISTIC_ITER_RANGE / EXPERT_STATISTIC_PATH.
2. The recorded counts are checked (every step's counts sum to top_k x its tokens) and go
   through the offline tools: `report` prints per-layer imbalance and `generate-config`
   writes a placement YAML with redundant slots.
3. EP engines give exactly the single-device greedy tokens: with that YAML
   (`MoeConfig(load_balancer=path)`, all_to_all), with MoE tensor parallelism
   (allgather), and with the default placement (dispatch chosen per bucket).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.multidevice import run_on_cpu_devices
from tests.parallel_workload import run_staggered_requests, small_engine

# (N, E, dispatch, use the generated placement)
CASES = [(8, 8, "all_to_all", True), (4, 2, "allgather", False), (8, 4, "auto", True)]
NUM_SLOTS = 16


def run_engine(directory: Path, tokenizer: Path, **engine_args) -> dict:
    engine = small_engine(directory, tokenizer, **engine_args)
    outputs = run_staggered_requests(engine)
    engine.close_statistics()
    tokens_per_step = [
        s["inflightBatchingStats"]["numCtxTokens"] + s["inflightBatchingStats"]["numGenRequests"]
        for s in engine.iteration_stats
    ]
    mixed = any(
        s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
        for s in engine.iteration_stats
    )
    return dict(
        tokens={str(k): v for k, v in sorted(outputs.items())},
        mixed=mixed,
        tokens_per_step=tokens_per_step,
        reused=engine.kv_cache_manager.get_kv_cache_stats().reused_blocks,
    )


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import io
    from contextlib import redirect_stdout

    import jax
    import numpy as np

    from jaxllm.llm_args import MoeConfig
    from jaxllm.models import materialize_preset
    from sharding.eplb.cli import generate_config_main, report_main
    from sharding.eplb.statistics import load_expert_statistics
    from tests.test_ep_moe import write_checkpoint

    assert len(jax.devices()) == 8
    tokenizer = materialize_preset("tiny-moe")
    directory = write_checkpoint("qwen3_moe", root / "qwen3_moe", seed=5, vocab_size=256)
    stats_dir = root / "stats"
    os.environ["EXPERT_STATISTIC_ITER_RANGE"] = "1-9"
    os.environ["EXPERT_STATISTIC_PATH"] = str(stats_dir)
    base = run_engine(directory, tokenizer)
    del os.environ["EXPERT_STATISTIC_ITER_RANGE"], os.environ["EXPERT_STATISTIC_PATH"]
    stats = load_expert_statistics(stats_dir)
    top_k = stats.num_experts_per_token
    sums_ok = all(
        int(stats.counts[i, layer].sum()) == top_k * base["tokens_per_step"][it]
        for i, it in enumerate(stats.iters)
        for layer in range(len(stats.layers))
    )
    report = io.StringIO()
    with redirect_stdout(report):
        report_main(["--expert_statistic_path", str(stats_dir), "--ep_size", "8"])
    yaml_path = root / "eplb.yaml"
    generate_config_main(
        [
            "--expert_statistic_path",
            str(stats_dir),
            "--ep_size",
            "8",
            "--num_slots",
            str(NUM_SLOTS),
            "--output_path",
            str(yaml_path),
        ]
    )
    print(
        json.dumps(
            dict(
                kind="base",
                stats_iters=stats.iters,
                stats_layers=stats.layers,
                sums_ok=sums_ok,
                report=report.getvalue(),
                **base,
            )
        ),
        flush=True,
    )
    for n, e, mode, placed in CASES:
        moe_config = MoeConfig(load_balancer=str(yaml_path) if placed else None, dispatch=mode)
        result = run_engine(
            directory, tokenizer, tensor_parallel_size=n, moe_expert_parallel_size=e, moe_config=moe_config
        )
        print(json.dumps(dict(kind="ep", n=n, e=e, mode=mode, placed=placed, **result)), flush=True)
    del np


def test_engine_expert_parallel_with_generated_placement(tmp_path):
    results = run_on_cpu_devices("test_engine_ep", "check_all", tmp_path, unset_env=("EXPERT_STATISTIC_ITER_RANGE",))
    base = next(r for r in results if r["kind"] == "base")
    assert len(base["tokens"]) == 5 and all(len(t) == 7 for t in base["tokens"].values())
    assert base["mixed"] and base["reused"] >= 3
    assert base["stats_iters"] == list(range(1, 9)), base["stats_iters"]
    assert base["stats_layers"] == [1], "Qwen3-MoE test model: layer 0 is dense, layer 1 sparse"
    assert base["sums_ok"], "a step's expert counts do not add up to top_k x its tokens"
    assert "average" in base["report"]
    placement = (tmp_path / "eplb.yaml").read_text()
    assert f"num_slots: {NUM_SLOTS}" in placement
    eps = [r for r in results if r["kind"] == "ep"]
    assert len(eps) == len(CASES)
    for r in eps:
        case = f"N{r['n']} E{r['e']} {r['mode']} placed={r['placed']}"
        assert r["tokens"] == base["tokens"], f"{case}: greedy tokens differ from the single-device engine"
        assert r["mixed"], case


def test_parallel_flags_and_placement_from_config_yaml(tmp_path):
    import pytest

    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig, save_eplb_config

    placement = tmp_path / "eplb.yaml"
    save_eplb_config(MoeLoadBalancerConfig(num_slots=16, initial_global_assignments={1: list(range(8)) * 2}), placement)
    llm_yaml = tmp_path / "llm.yaml"
    llm_yaml.write_text(f"moe_config:\n  load_balancer: {placement}\n  dispatch: allgather\n")
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", "--tp-size", "8", "--ep-size", "4", "--config", str(llm_yaml)]
    )
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert config.parallel_config().mesh_shape == (1, 4, 2)
    assert config.moe_config.dispatch == "allgather"
    assert config.moe_config.load_balancer.initial_global_assignments[1] == list(range(8)) * 2
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--tp-size", "8", "--moe-tp-size", "2"])
    assert EngineConfig(model="m", **engine_kwargs(args)).parallel_config().mesh_shape == (1, 4, 2)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--tp-size", "4", "--enable-attention-dp"])
    assert EngineConfig(model="m", **engine_kwargs(args)).parallel_config().enable_attention_dp
    with pytest.raises(ValueError, match="must equal tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=8, moe_expert_parallel_size=2, moe_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(model="m", moe_config={"load_balancer": str(tmp_path / "missing.yaml")})
