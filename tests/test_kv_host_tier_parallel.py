"""The host KV tier under tensor parallelism and with the MLA latent cache (2 fake CPU devices, in
a subprocess; see tests/multidevice.py): a workload whose prefixes overflow the device pool
gives the same greedy tokens with the tier on and off, and the tier onboarded blocks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multidevice import run_on_cpu_devices

VOCAB = 256
WORKLOAD = dict(num_prefixes=5, prefix_len=40, waves=3, vocab=VOCAB)


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    import jax

    from jaxllm import KvCacheConfig
    from jaxllm.models import materialize_preset
    from tests.engine_helpers import make_hf_model
    from tests.kv_tier_workload import context_tokens, interleaved_prefixes
    from tests.parallel_workload import small_engine
    from tests.test_deepseek import ENGINE, write_checkpoint

    assert len(jax.devices()) == 2
    make_hf_model("qwen3", root / "qwen3", VOCAB)
    write_checkpoint(root / "ds", dict(ENGINE, vocab_size=VOCAB), seed=3, tokenizer=True)
    tokenizer = materialize_preset("tiny-moe")
    for name, tp in (("qwen3", 2), ("ds", 2)):
        result: dict = dict(model=name, tp=tp)
        for host in (None, 8 << 20):
            engine = small_engine(
                root / name,
                tokenizer,
                tensor_parallel_size=tp,
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=96, host_cache_size=host),
            )
            tokens = interleaved_prefixes(engine, **WORKLOAD, step=lambda e: e.kv_cache_manager.check_invariants())
            stats = engine.iteration_stats[-1]["kvCacheStats"]
            leaf = jax.tree_util.tree_leaves(engine.runner.kv_cache)[0]
            result["on" if host else "off"] = dict(
                tokens=tokens,
                context_tokens=context_tokens(engine),
                onboarded=stats.get("onboardedBlocks", 0),
                free=engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks,
                shards=len({s.device for s in leaf.addressable_shards}),
                shard_shape=list(leaf.addressable_shards[0].data.shape),
                shape=list(leaf.shape),
            )
            engine.close()
        print(json.dumps(result), flush=True)


def test_tier_on_matches_tier_off_under_tensor_parallelism_and_mla(tmp_path):
    results = run_on_cpu_devices("test_kv_host_tier_parallel", "check_all", tmp_path, num_devices=2)
    assert [(r["model"], r["tp"]) for r in results] == [("qwen3", 2), ("ds", 2)]
    for r in results:
        case = f"{r['model']} TP{r['tp']}"
        off, on = r["off"], r["on"]
        assert on["tokens"] == off["tokens"], case
        assert on["onboarded"] > 10, case
        assert on["context_tokens"] < off["context_tokens"], case
        assert on["free"] and off["free"], case
        assert on["shards"] == 2, case
    qwen = results[0]["on"]
    assert qwen["shard_shape"][0] * 2 == qwen["shape"][0], "the keys are sharded by KV head"
