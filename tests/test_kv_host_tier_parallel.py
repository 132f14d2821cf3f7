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


def check_attention_dp(root: Path) -> None:
    """Subprocess entry point (8 devices): attention DP, each rank's pool with its own host tier."""
    import jax

    from jaxllm import KvCacheConfig
    from jaxllm.models import materialize_preset
    from tests.kv_tier_workload import context_tokens, interleaved_prefixes
    from tests.parallel_workload import small_engine
    from tests.test_ep_moe import write_checkpoint

    assert len(jax.devices()) == 8
    directory = write_checkpoint("qwen3_moe", root / "qwen3_moe", seed=5, vocab_size=VOCAB)
    tokenizer = materialize_preset("tiny-moe")
    result: dict = {}
    for host in (None, 2 << 20):
        engine = small_engine(
            directory,
            tokenizer,
            tensor_parallel_size=8,
            moe_expert_parallel_size=8,
            enable_attention_dp=True,
            # 8 blocks per rank: two of the rank's prefixes do not fit together.
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=64, host_cache_size=host),
        )
        workload = dict(WORKLOAD, num_prefixes=16, waves=2)
        tokens = interleaved_prefixes(engine, **workload, step=lambda e: e.kv_cache_manager.check_invariants())
        stats = engine.iteration_stats[-1]["kvCacheStats"]
        managers = engine.kv_cache_manager.managers
        result["on" if host else "off"] = dict(
            tokens=tokens,
            context_tokens=context_tokens(engine),
            onboarded=stats.get("onboardedBlocks", 0),
            ranks_onboarded=sum(1 for m in managers if m.host_tier is not None and m.host_tier.onboarded_blocks),
            host_slots=stats.get("hostMaxNumBlocks", 0),
            free=all(m.num_free_blocks == m.num_blocks for m in managers),
        )
        engine.close()
    print(json.dumps(result), flush=True)


def test_tier_on_matches_tier_off_under_attention_dp(tmp_path):
    """8 fake devices, 8 attention-DP ranks: every rank offloads and onboards its own blocks."""
    (result,) = run_on_cpu_devices("test_kv_host_tier_parallel", "check_attention_dp", tmp_path, num_devices=8)
    off, on = result["off"], result["on"]
    assert on["tokens"] == off["tokens"]
    assert on["onboarded"] > 10 and on["ranks_onboarded"] == 8
    assert on["context_tokens"] < off["context_tokens"]
    assert on["free"] and off["free"]
