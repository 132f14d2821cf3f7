"""DeepSeek-V3 under tensor and expert parallelism (8 fake CPU devices, in a subprocess): the
engine's greedy tokens on the staggered in-flight workload (chunked prefill, prefix reuse,
mixed steps) equal the single-device engine's. Shared experts are replicated, routed
experts stored as slots (a placement with redundant slots for EP 4), the latent cache
replicated and attention heads split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multidevice import run_on_cpu_devices

# (tensor_parallel_size, moe_expert_parallel_size, dispatch, redundant placement)
CASES = [(4, 4, "all_to_all", True), (8, 8, "allgather", False)]


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    from jaxllm.config import MoeConfig
    from sharding.eplb.config import MoeLoadBalancerConfig, save_eplb_config
    from tests.test_deepseek import _engine_outputs, staggered_prompts
    from tests.parallel_workload import small_engine

    assert len(jax.devices()) == 8
    directory = root / "ds"
    config = json.loads((directory / "config.json").read_text())
    arrivals = staggered_prompts(config["vocab_size"])
    num_experts, first_moe = config["n_routed_experts"], config["first_k_dense_replace"]
    placement = root / "eplb.yaml"
    slots = list(range(num_experts))[::-1] + [0, 5, 9, 14]  # 20 slots: 5 per rank at EP 4, 4 experts twice
    save_eplb_config(MoeLoadBalancerConfig(num_slots=len(slots), initial_global_assignments={
        layer: slots for layer in range(first_moe, config["num_hidden_layers"])}), placement)

    def run(**engine_args) -> dict:
        engine = small_engine(directory, directory, **engine_args)
        tokens = _engine_outputs(engine, arrivals, max_tokens=7)
        return {str(k): v for k, v in sorted(tokens.items())}

    print(json.dumps(dict(kind="base", tokens=run())), flush=True)
    for n, e, mode, placed in CASES:
        moe_config = MoeConfig(load_balancer=str(placement) if placed else None, dispatch=mode)
        tokens = run(tensor_parallel_size=n, moe_expert_parallel_size=e, moe_config=moe_config)
        print(json.dumps(dict(kind="ep", n=n, e=e, mode=mode, placed=placed, tokens=tokens)), flush=True)


def test_deepseek_tensor_and_expert_parallel_match_single_device(tmp_path):
    pytest.importorskip("torch")
    from tests.test_deepseek import ENGINE, write_checkpoint

    write_checkpoint(tmp_path / "ds", ENGINE, seed=3, tokenizer=True)
    results = run_on_cpu_devices("test_deepseek_parallel", "check_all", tmp_path,
                                 unset_env=("EXPERT_STATISTIC_ITER_RANGE",))
    base = next(r for r in results if r["kind"] == "base")
    assert len(base["tokens"]) == 5 and all(len(t) == 7 for t in base["tokens"].values())
    eps = [r for r in results if r["kind"] == "ep"]
    assert len(eps) == len(CASES)
    for r in eps:
        assert r["tokens"] == base["tokens"], f"TP {r['n']} EP {r['e']} {r['mode']}: tokens differ from one device"
