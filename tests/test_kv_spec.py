"""The MHA KV-cache spec: layout, writes into paged slots, sizes per device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.kv_cache.spec import MhaKvCacheSpec, MhaLayerCache
from jaxllm.models import ModelConfig, kv_cache_bytes_per_token, kv_cache_spec
from sharding import ParallelConfig, ShardingRules, make_mesh


def test_write_scatters_into_slots_and_drops_padding():
    spec = MhaKvCacheSpec(num_layers=2, num_kv_heads=3, head_dim=4, dtype="float32")
    (cache, _) = spec.init(num_blocks=5, tokens_per_block=2)
    assert cache.k.shape == (3, 5, 2, 4) and cache.v.dtype == np.float32 and not np.asarray(cache.k).any()
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((4, 3, 4)).astype(np.float32) for _ in range(2))
    slots = np.array([7, 0, 3, 10], np.int32)  # 10 == num_blocks * tokens_per_block: padding
    new = spec.write(cache, (k, v), slots)
    expected_k, expected_v = np.zeros((3, 10, 4), np.float32), np.zeros((3, 10, 4), np.float32)
    for t, slot in enumerate(slots[:3]):
        expected_k[:, slot], expected_v[:, slot] = k[t], v[t]
    np.testing.assert_array_equal(np.asarray(new.k).reshape(3, 10, 4), expected_k)
    np.testing.assert_array_equal(np.asarray(new.v).reshape(3, 10, 4), expected_v)


def test_sizes_and_sharding():
    spec = MhaKvCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.bytes_per_token() == 2 * 4 * 8 * 128 * 2
    assert spec.bytes_per_token(num_shards=4) == spec.bytes_per_token() // 4
    assert spec.page_bytes(32, num_shards=2) == 32 * spec.bytes_per_token() // 2
    with pytest.raises(ValueError, match="do not split"):
        spec.bytes_per_token(num_shards=3)
    assert spec.partition_spec(ShardingRules()) == MhaLayerCache(
        jax.sharding.PartitionSpec("tensor", None, None, None), jax.sharding.PartitionSpec("tensor", None, None, None)
    )


def test_model_cache_spec_counts_replicated_kv_heads():
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qk_norm=False,
        attention_bias=False,
        sliding_window=None,
    )
    assert kv_cache_spec(config, kv_replicas=4).num_kv_heads == 8
    one = make_mesh(ParallelConfig())
    assert (
        kv_cache_bytes_per_token(config, "float32", one)
        == kv_cache_bytes_per_token(config, "float32")
        == 2 * 2 * 2 * 8 * 4
    )
