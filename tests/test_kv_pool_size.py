"""The KV pool's size on a backend without device memory statistics (a CPU) follows the flags
alone: the same flags give the same pool whatever memory is free at start-up (so a second start
finds its programs in the compilation cache), within a fixed budget unless max_tokens sets it."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from jaxllm.engine.builder import HOST_KV_CACHE_BYTES, plan_num_kv_blocks
from jaxllm.models import kv_cache_bytes_per_token, load_model_config, materialize_preset


@pytest.fixture(scope="module")
def model_config():
    return load_model_config(materialize_preset("tiny-moe"), dtype="float32")


def _blocks(model_config, **limits) -> int:
    args = dict(tokens_per_block=8, max_tokens=None, free_memory_fraction=0.9, max_batch_size=8, max_seq_len=128)
    return plan_num_kv_blocks(model_config=model_config, dtype=np.float32, **{**args, **limits})


def test_pool_size_does_not_follow_free_memory(model_config, monkeypatch):
    sizes = []
    for free_pages in (1, 10**4, 10**9):  # what the host reports free: ignored
        monkeypatch.setattr(os, "sysconf", lambda name, pages=free_pages: pages if "PAGES" in name else 4096)
        sizes.append((_blocks(model_config), _blocks(model_config, max_batch_size=10**4, max_seq_len=10**5)))
    assert len(set(sizes)) == 1
    full, capped = sizes[0]
    assert full == math.ceil(8 * 128 / 8)  # every sequence at full length
    bytes_per_block = kv_cache_bytes_per_token(model_config, np.float32) * 8
    assert capped == HOST_KV_CACHE_BYTES // bytes_per_block  # the fixed budget


def test_max_tokens_sets_the_pool_beyond_the_default_budget(model_config):
    bytes_per_block = kv_cache_bytes_per_token(model_config, np.float32) * 8
    budget = HOST_KV_CACHE_BYTES // bytes_per_block
    tokens = (budget + 100) * 8
    assert _blocks(model_config, max_tokens=tokens, max_batch_size=10**4, max_seq_len=10**5) == budget + 100
    assert _blocks(model_config, max_tokens=64) == 8


def test_two_engines_with_the_same_flags_get_the_same_pool_under_different_free_memory(monkeypatch):
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig

    page = 4096
    sizes = []
    for free_bytes in (1 * 2**30, 100 * 2**30):
        monkeypatch.setattr(os, "sysconf", lambda name, pages=free_bytes // page: pages if "PAGES" in name else page)
        engine = LLMEngine(
            EngineConfig(
                model="tiny-moe", max_batch_size=4, max_num_tokens=32, max_seq_len=64, kv_cache_config=KvCacheConfig()
            )
        )
        try:
            sizes.append(engine.kv_cache_manager.get_max_resource_count())
        finally:
            engine.close()
    assert sizes[0] == sizes[1]
