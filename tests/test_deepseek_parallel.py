"""DeepSeek-V3 under tensor and expert parallelism (8 fake CPU devices, in a subprocess): the
engine's greedy tokens on the staggered in-flight workload (chunked prefill, prefix reuse,
mixed steps) equal the single-device engine's, with the online expert load balancer
moving slots while it serves. Shared experts are replicated, routed experts stored as
slots (redundant slots: 20 at EP 4, 16 at EP 8), the latent cache replicated and
attention heads split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multidevice import run_on_cpu_devices

# (tensor_parallel_size, moe_expert_parallel_size, dispatch, slots)
CASES = [(4, 4, "all_to_all", 20), (8, 8, "allgather", 16)]
MAX_TOKENS = 12


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    from jaxllm.llm_args import MoeConfig
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from tests.parallel_workload import small_engine
    from tests.test_deepseek import _engine_outputs, staggered_prompts

    assert len(jax.devices()) == 8
    directory = root / "ds"
    config = json.loads((directory / "config.json").read_text())
    arrivals = staggered_prompts(config["vocab_size"])

    def run(**engine_args) -> tuple[dict, int]:
        engine = small_engine(directory, directory, **engine_args)
        tokens = _engine_outputs(engine, arrivals, max_tokens=MAX_TOKENS)
        balancer = engine.load_balancer
        rebalances = 0
        if balancer is not None:
            balancer.worker.wait_idle()
            rebalances = balancer.stats.rebalances
        engine.close()
        return {str(k): v for k, v in sorted(tokens.items())}, rebalances

    print(json.dumps(dict(kind="base", tokens=run()[0])), flush=True)
    for n, e, mode, num_slots in CASES:
        balancer = MoeLoadBalancerConfig(
            num_slots=num_slots, layer_updates_per_iter=1, min_imbalance_gain=-1.0, minimize_moves=False
        )
        tokens, rebalances = run(
            tensor_parallel_size=n,
            moe_expert_parallel_size=e,
            moe_config=MoeConfig(load_balancer=balancer, dispatch=mode),
        )
        print(json.dumps(dict(kind="ep", n=n, e=e, mode=mode, tokens=tokens, rebalances=rebalances)), flush=True)


def test_deepseek_tensor_and_expert_parallel_match_single_device(tmp_path):
    pytest.importorskip("torch")
    from tests.test_deepseek import ENGINE, write_checkpoint

    write_checkpoint(tmp_path / "ds", ENGINE, seed=3, tokenizer=True)
    results = run_on_cpu_devices(
        "test_deepseek_parallel", "check_all", tmp_path, unset_env=("EXPERT_STATISTIC_ITER_RANGE",)
    )
    base = next(r for r in results if r["kind"] == "base")
    assert len(base["tokens"]) == 5 and all(len(t) == MAX_TOKENS for t in base["tokens"].values())
    eps = [r for r in results if r["kind"] == "ep"]
    assert len(eps) == len(CASES)
    for r in eps:
        assert r["tokens"] == base["tokens"], f"TP {r['n']} EP {r['e']} {r['mode']}: tokens differ from one device"
        assert r["rebalances"] >= 1, f"TP {r['n']} EP {r['e']}: the online balancer never moved a slot"
