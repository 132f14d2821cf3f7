"""The `xla` attention backend's static work bounds (`jaxllm.models.attention_work`).

Its loop's trip count is fixed when the program compiles (never read from the device), so
the shapes' bound is every token at the longest context. The host counts a step's real
(query tile, KV block) pairs and runs the program compiled for the smallest rung of a ladder
that holds them. The count must be exact (a bound one short drops a pair and changes the
output), and the engine must give the tokens of the shapes' bound.
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import numpy as np
import pytest

from jaxllm.bench.xla_kernels import attention_inputs
from pallas_kernels.ragged_paged_attention import tiled_xla


@pytest.mark.parametrize(
    "decode, tokens, batch", [(True, 4, 4), (True, 16, 16), (False, 64, 4), (False, 64, 8), (False, 16, 8)]
)
def test_the_host_count_is_the_kernels_work(decode, tokens, batch):
    """With one pair per iteration: the counted bound gives the shapes' bound's output exactly,
    one pair fewer does not."""
    rng = np.random.default_rng(tokens + batch)
    inputs = attention_inputs(
        rng,
        decode=decode,
        tokens=tokens,
        batch=batch,
        heads=(4, 2, 16),
        tpb=8,
        max_seq_len=192,
        kv_len=(1, 180),
        prompt_len=(1, 40),
    )
    q_lens, kv_lens = np.diff(np.asarray(inputs[5])), np.asarray(inputs[3])
    need = tiled_xla.step_work_items(q_lens, kv_lens, tokens, batch, 8)
    run = jax.jit(
        functools.partial(tiled_xla.ragged_paged_attention_tiled, sm_scale=0.25, items_per_step=1),
        static_argnames="max_items",
    )
    full = np.asarray(run(*inputs))
    np.testing.assert_array_equal(np.asarray(run(*inputs, max_items=need)), full)
    assert not np.array_equal(np.asarray(run(*inputs, max_items=need - 1)), full)


def test_work_tiers_ladder():
    assert tiled_xla.work_tiers(1024, 256) == (256,)
    assert tiled_xla.work_tiers(4096, 16) == (16, 32, 64, 128, 256, 512, 1024)
    assert tiled_xla.work_tiers(512, 256) == ()  # two iterations at most: no rung worth a program


def test_engine_runs_the_counted_bound_with_the_same_tokens():
    """Short contexts under a long `max_seq_len`: decode steps run rungs below the shapes'
    bound (compiled on the low-priority threads, never on the engine thread) and greedy
    tokens equal the engine's without rungs."""
    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from tests.engine_helpers import random_prompts
    from tests.spec_helpers import COMPILE_EVENT

    def engine() -> LLMEngine:
        config = EngineConfig(
            model="tiny-dense",
            dtype="float32",
            max_batch_size=8,
            max_num_tokens=16,
            max_seq_len=512,
            decode_batch_sizes=[8],
            compile_ahead=False,
            kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=4096),
        )
        return LLMEngine(config)

    prompts = random_prompts(8, 400, 5, 30, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def generate(e: LLMEngine) -> list[list[int]]:
        requests = [e.add_request(p, params) for p in prompts]
        while e.has_unfinished_requests():
            e.step()
        return [list(r.output_token_ids) for r in requests]

    plain = engine()
    assert plain.runner.attention_work is not None
    plain.runner.attention_work = None  # the shapes' bound only
    expected = generate(plain)

    tiered = engine()
    generate(tiered)  # the rungs it needs start compiling in the background
    while tiered.runner.programs.background_pending:  # the low-priority compiles finish
        time.sleep(0.1)
    on_engine_thread: list[str] = []
    main = threading.current_thread()

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT and threading.current_thread() is main:
            on_engine_thread.append(event)

    before = tiered.runner.bounded_steps
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert generate(tiered) == expected
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert tiered.runner.bounded_steps - before >= 20
    assert on_engine_thread == []


def test_the_xla_backend_passes_the_step_bound_to_its_kernel():
    """`AttentionMetadata.kv_work_items` reaches the kernel: a bound of 0 pairs attends to nothing."""
    from jaxllm.kv_cache.spec import MhaLayerCache
    from jaxllm.models.attention import AttentionMetadata, xla_attention

    q, k, v, kv_lens, tables, cu, num_seqs = attention_inputs(
        np.random.default_rng(1),
        decode=True,
        tokens=4,
        batch=4,
        heads=(4, 2, 16),
        tpb=8,
        max_seq_len=64,
        kv_len=(1, 60),
        prompt_len=(1, 1),
    )
    slots = np.zeros(4, np.int32)
    attention = xla_attention()

    def run(bound):
        md = AttentionMetadata(slots, kv_lens, tables, cu, num_seqs, bound)
        return np.asarray(attention(q, MhaLayerCache(k, v), md, sm_scale=0.25))

    full = run(None)
    assert np.abs(full).max() > 0 and np.abs(run(0)).max() == 0
