"""The host KV tier through the other cache layout and the `LLM` API: per-layer caches
(`scan_layers` off) and beam search next to offloading, the same outputs with the tier on and off."""

from __future__ import annotations

import pytest
from kv_tier_workload import interleaved_prefixes
from test_kv_host_tier import DEVICE_TOKENS, TPB, VOCAB, WORKLOAD, _check, _engine

from jaxllm.llm_args import KvCacheConfig
from jaxllm.sampling import SamplingParams

from engine_helpers import make_hf_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tier_api")
    return path, make_hf_model("qwen3", path, VOCAB)


def test_per_layer_caches_move_too(qwen3):
    """Layers run as a loop (one cache per layer, not one scanned page pool)."""
    path, _ = qwen3
    workload = dict(WORKLOAD, num_prefixes=4, waves=2)
    off = interleaved_prefixes(_engine(path, None, scan_layers=False), **workload)
    on_engine = _engine(path, 4 << 20, scan_layers=False)
    assert isinstance(on_engine.runner.kv_cache, list)
    assert interleaved_prefixes(on_engine, **workload, step=_check) == off
    assert on_engine.kv_offload.counts.onboarded_blocks > 5


def test_llm_api_with_beam_search_gives_the_same_outputs_with_the_tier(qwen3):
    """Through `LLM.generate`: waves of greedy and beam-search requests over prefixes that
    overflow the device pool (beam forks copy blocks while host copies are queued)."""
    import numpy as np

    from jaxllm import LLM

    path, _ = qwen3
    rng = np.random.default_rng(2)
    prefixes = [[int(t) for t in rng.integers(3, VOCAB, 40)] for _ in range(5)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    beams = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=5, ignore_eos=True)
    results = []
    for host in (None, "4MiB"):
        llm = LLM(
            str(path),
            dtype="float32",
            max_batch_size=8,
            max_num_tokens=64,
            max_seq_len=128,
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=DEVICE_TOKENS, host_cache_size=host),
            warmup="none",  # the compared runs compile what their steps need
        )
        tokens = []
        for wave, params in enumerate((greedy, beams, greedy)):
            outputs = llm.generate([p + [3 + wave] for p in prefixes], params)
            tokens.append([[list(c.token_ids) for c in o.outputs] for o in outputs])
        stats = llm.get_stats(timeout=1)
        results.append((tokens, stats[-1]["kvCacheStats"] if stats else {}))
        llm.shutdown()
    (off, _), (on, stats_on) = results
    assert on == off
    assert stats_on.get("onboardedBlocks", 0) > 5
