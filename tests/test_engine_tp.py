"""The engine under tensor parallelism (8 fake CPU devices, in a subprocess; see
test_sharding_tp.py): TP 2/4/8 give exactly the greedy tokens of TP 1 under in-flight
batching with chunked prefill and prefix reuse, with the xla and Pallas backends; and the
step plans recorded at TP 1, replayed on a TP 2/4/8 runner, give the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multidevice import run_on_cpu_devices
from tests.parallel_workload import record_plans, run_staggered_requests, small_engine

# (arch, backend, TP sizes); Qwen3-MoE and Llama have 2 KV heads: TP 4 and 8 replicate them.
CASES = [("qwen3_moe", "xla", (1, 2, 4, 8)), ("qwen3_moe", "pallas", (8,))]  # each against xla at TP 1


def run_engine(directory: Path, tokenizer: Path, tp: int, backend: str, recorded: list | None = None) -> dict:
    """The shared staggered workload (tests/parallel_workload.py) at TP `tp`; with `recorded`,
    every executed plan is appended to it, then the KV pool's size in blocks."""
    import jax

    engine = small_engine(directory, tokenizer, attention_backend=backend, moe_backend=backend, tensor_parallel_size=tp)
    plans = record_plans(engine)
    outputs = run_staggered_requests(engine)
    stats = engine.kv_cache_manager.get_kv_cache_stats()
    chunked = any(
        s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
        for s in engine.iteration_stats
    )
    if recorded is not None:
        recorded.extend(plans)
        recorded.append(engine.kv_cache_manager.num_blocks)
    keys = jax.tree_util.tree_leaves(engine.runner.kv_cache)[0]  # the page pool's keys (or layer 0's)
    return dict(
        tokens={str(k): v for k, v in sorted(outputs.items())},
        reused=stats.reused_blocks,
        mixed=chunked,
        kv_heads_per_device=int(keys.addressable_shards[0].data.shape[0]),
    )


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    from jaxllm.models import materialize_preset
    from tests.test_sharding_tp import hf_config, write_checkpoint

    assert len(jax.devices()) == 8
    tokenizer = materialize_preset("tiny-moe")
    for arch, backend, sizes in CASES:
        directory = root / arch
        if not directory.exists():
            write_checkpoint(arch, directory)
            (directory / "config.json").write_text(json.dumps(dict(hf_config(arch), vocab_size=256)))
            write_checkpoint_vocab(arch, directory)
        recorded: list = []
        for tp in sizes:
            result = run_engine(directory, tokenizer, tp, backend, recorded if tp == 1 else None)
            if tp == 8 and recorded:
                result["replay_same"] = replay(directory, recorded, tp, backend)
            print(json.dumps(dict(arch=arch, backend=backend, tp=tp, **result)), flush=True)


def replay(directory: Path, recorded: list, tp: int, backend: str) -> bool:
    """Execute the plans recorded at TP 1 on a fresh TP-`tp` runner: the plan is
    device-independent, so the sampled tokens must be the same."""
    import numpy as np

    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.models import load_model_config, load_params
    from jaxllm.models.backends import resolve_backends
    from sharding import ParallelConfig, make_mesh

    *steps, num_blocks = recorded
    config = load_model_config(directory, "float32")
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp))
    _, _, attention_fn, moe_fn = resolve_backends(backend, backend)
    runner = ModelRunner(
        model_config=config,
        params=load_params(directory, config, mesh=mesh),
        num_blocks=num_blocks,
        tokens_per_block=8,
        kv_dtype=config.dtype,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        max_batch_size=4,
        mesh=mesh,
    )
    return all(
        np.array_equal(np.asarray(runner.execute(plan).sampled.token_ids), np.asarray(out.sampled.token_ids))
        for plan, out in steps
    )


def write_checkpoint_vocab(arch: str, directory: Path) -> None:
    from safetensors.numpy import save_file

    from jaxllm.models import ModelConfig
    from jaxllm.models.random_checkpoint import random_checkpoint
    from tests.test_sharding_tp import hf_config

    config = ModelConfig.from_hf_config(dict(hf_config(arch), vocab_size=256))
    save_file(random_checkpoint(config, seed=5), str(directory / "model.safetensors"))


def test_engine_tensor_parallel_tokens_match_single_device(tmp_path):
    results = run_on_cpu_devices("test_engine_tp", "check_all", tmp_path)
    assert len(results) == sum(len(sizes) for _, _, sizes in CASES)
    assert sum("replay_same" in r for r in results) == 1
    base = {}
    for r in results:
        case = f"{r['arch']} {r['backend']} TP{r['tp']}"
        assert len(r["tokens"]) == 5 and all(len(t) == 7 for t in r["tokens"].values()), case
        assert r["reused"] >= 3, f"{case}: the shared prefix was not reused"
        assert r["mixed"], f"{case}: no step mixed prefill and decode"
        key = r["arch"]
        if r["tp"] == 1 and r["backend"] == "xla":
            base[key] = r["tokens"]
        assert r["tokens"] == base[key], f"{case}: tokens differ from TP 1"
        assert r["kv_heads_per_device"] == max(1, 2 // r["tp"]), case
        if "replay_same" in r:
            assert r["replay_same"], f"{case}: replaying the TP-1 plans gave other tokens"
