"""The host KV tier's copies off the step's critical path: a request whose prefix comes back
from the host waits for its blocks while the other requests run. Oracles: the engine with
the tier off and with the overlap scheduler off (same greedy tokens), and the step counts of
a request running alone."""

from __future__ import annotations

import numpy as np
import pytest
from kv_tier_workload import interleaved_prefixes

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.kv_cache.block_pool import ROOT_NODE
from jaxllm.llm_args import KvCacheConfig
from jaxllm.sampling import SamplingParams

from engine_helpers import make_hf_model

VOCAB = 256
TPB = 8
WORKLOAD = dict(num_prefixes=5, prefix_len=40, waves=2, vocab=VOCAB)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tier_async")
    make_hf_model("qwen3", path, VOCAB)
    return path


def _engine(path, host: int | None, overlap: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_batch_size=8,
            max_num_tokens=64,
            max_seq_len=128,
            disable_overlap_scheduler=not overlap,
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=128, host_cache_size=host),
        )
    )


def test_same_tokens_with_the_tier_and_the_overlap_scheduler_on_and_off(qwen3):
    runs = {}
    waited: dict[bool, int] = {}
    for host in (None, 4 << 20):
        for overlap in (True, False):
            engine = _engine(qwen3, host, overlap)
            runs[host, overlap] = interleaved_prefixes(
                engine, **WORKLOAD, step=lambda e: e.kv_cache_manager.check_invariants()
            )
            if host:
                waited[overlap] = engine.kv_cache_manager.host_tier.waited_requests
                stats = engine.iteration_stats[-1]["kvCacheStats"]
                assert stats["onboardedBlocks"] > 10 and stats["onboardingRequests"] == 0
                assert engine.kv_offload.num_arriving == 0 and engine.kv_offload.num_in_flight == 0
                kv = engine.kv_cache_manager
                assert kv.num_free_blocks == kv.num_blocks and kv.host_tier.num_pending == 0
    reference = runs[None, False]
    assert all(tokens == reference for tokens in runs.values())
    assert waited[True] > 0 and waited[False] > 0  # requests hitting the host did wait for their blocks


def _token_steps(engine, requests, max_steps=50) -> tuple[dict[int, list[int]], list[set[int]]]:
    """Step number (from 1) of each token each request received, by request id, and the
    requests waiting for onboarded blocks after each step."""
    steps: dict[int, list[int]] = {r.request_id: [] for r in requests}
    waiting = []
    for step in range(1, max_steps + 1):
        for update in engine.step():
            if update.request.request_id in steps:
                steps[update.request.request_id] += [step] * len(update.new_token_ids)
        waiting.append(set(engine.kv_cache_manager.waiting_request_ids))
        if not engine.has_unfinished_requests():
            return steps, waiting
    raise AssertionError("the requests did not finish")


def test_a_request_waiting_for_onboarded_blocks_does_not_delay_another(qwen3):
    engine = _engine(qwen3, 4 << 20)
    kv, host = engine.kv_cache_manager, engine.kv_cache_manager.host_tier
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefix = [int(t) for t in rng.integers(3, VOCAB, 48)]
    first_block = tuple(prefix[:TPB])
    engine.add_request(prefix + [4], params)
    while engine.has_unfinished_requests():
        engine.step()
    # Other prefixes push it out of the 16-block device pool into the host tier.
    while kv.block_pool.lookup(ROOT_NODE, first_block) is not None:
        engine.add_request([int(t) for t in rng.integers(3, VOCAB, 48)] + [4], params)
        while engine.has_unfinished_requests():
            engine.step()
    assert host.lookup(ROOT_NODE, first_block) is not None
    alone = engine.add_request([int(t) for t in rng.integers(3, VOCAB, 20)], params)
    alone_steps = _token_steps(engine, [alone])[0][alone.request_id]
    onboarded = engine.kv_offload.counts.onboarded_blocks
    hit = engine.add_request(prefix + [5], params)
    other = engine.add_request([int(t) for t in rng.integers(3, VOCAB, 20)], params)
    steps, waiting = _token_steps(engine, [hit, other])
    # The hit waited for its blocks at least one step; the other request got its tokens at the
    # very steps it gets them alone.
    assert hit.request_id in waiting[0] and all(other.request_id not in w for w in waiting)
    assert steps[other.request_id] == alone_steps
    assert len(steps[hit.request_id]) == 4 and steps[hit.request_id][0] > alone_steps[0]
    assert engine.kv_offload.counts.onboarded_blocks - onboarded == 6  # its whole prefix came back
    assert hit.prepopulated_prompt_len == 48
    # Its tokens are those of the engine without the tier.
    off = _engine(qwen3, None)
    again = off.add_request(prefix + [5], params)
    while off.has_unfinished_requests():
        off.step()
    assert list(again.output_token_ids) == list(hit.output_token_ids)
    kv.check_invariants()


def test_a_copy_whose_block_was_given_out_again_is_not_written_and_waiters_follow_their_own_copy():
    """Request 1 waits for an onboarded block; it is freed and the block evicted while the copy
    is in transit, then the block comes back for request 2 from another host slot: the first
    copy is stale (not written), request 2 waits for the second; a device hit on a block
    still arriving waits for it too."""
    from jaxllm.kv_cache.block_pool import BlockPool
    from jaxllm.kv_cache.host_tier import HostTier, match_and_onboard
    from jaxllm.llm_request import LlmRequest

    pool = BlockPool(2)
    host = HostTier(4, 1)
    pool.offload = host.offload
    for tokens in ((1,), (2,)):  # two one-token prefixes, offloaded
        block = pool.allocate()
        pool.register(block, ROOT_NODE, tokens)
        pool.release(block)
    pool.allocate_many(2)
    for b in (0, 1):
        pool.release(b)
    host.take_transfers()
    (block,) = match_and_onboard(pool, host, LlmRequest(1, [1, 9], 1), 1, 4)
    assert host.waiting_ids == {1}
    (twin,) = match_and_onboard(pool, host, LlmRequest(2, [1, 8], 1), 1, 4)  # a device hit, still arriving
    assert twin == block and host.waiting_ids == {1, 2}
    ((_, _, first),) = host.take_transfers()[1]
    for rid in (1, 2):
        host.forget(rid)
        pool.release(block)
    pool.allocate_many(2)  # evicts it while its copy is in transit: dropped, not offloaded
    for b in (0, 1):
        pool.release(b)
    assert not host.is_current(block, first) and host.waiting_ids == set()
    (again,) = match_and_onboard(pool, host, LlmRequest(3, [2, 7], 1), 1, 4)
    ((_, _, second),) = host.take_transfers()[1]
    host.arrived([(again, first)])  # the stale copy
    assert host.waiting_ids == {3}
    host.arrived([(again, second)])
    assert host.waiting_ids == set() and host.num_pending == 0
    host.check_invariants()


def test_copy_programs_compile_at_warmup_and_batches_stay_within_their_cap(qwen3):
    """After `warmup` the tier's copies compile nothing on the engine thread (JAX's compile
    events, counted by thread)."""
    import threading

    import jax

    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(threading.current_thread().name)

    engine = _engine(qwen3, 4 << 20, overlap=False)
    try:
        assert engine.kv_offload.max_batch == 16  # max_seq_len 128 / 8 tokens per block
        engine.warmup(all_variants=False)
        jax.monitoring.register_event_duration_secs_listener(listener)
        interleaved_prefixes(engine, num_prefixes=8, prefix_len=40, waves=2, vocab=VOCAB, max_tokens=2)
        assert threading.current_thread().name not in compiles
        assert engine.kv_offload.counts.onboarded_blocks > 10
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.close()


def test_more_blocks_than_one_batch_holds_go_in_several_batches_byte_exact():
    """One flush offloading 12 blocks and one onboarding 12 with batches of at most 8: two
    reads and two writes of the compiled sizes, every block back bit for bit."""
    import types

    import jax.numpy as jnp

    from jaxllm.engine.kv_blocks import block_bytes
    from jaxllm.engine.kv_offload import KvOffloader
    from jaxllm.kv_cache.host_tier import HostTier
    from jaxllm.kv_cache.spec import MhaLayerCache

    num_blocks = 24
    shape = (2, 2 * num_blocks, 4, 8)  # [heads, layers * blocks, tokens, dim]
    keys = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    runner = types.SimpleNamespace(kv_cache=MhaLayerCache(jnp.asarray(keys), jnp.asarray(-keys)))
    tier = HostTier(16, block_bytes(runner.kv_cache, num_blocks))
    offloader = KvOffloader(runner, [tier], num_blocks, max_batch=8)
    sizes: list[int] = []
    read, start = offloader.copier.read, offloader.copier.start
    offloader.copier.read = lambda src, ranks, rows: sizes.append(len(src)) or read(src, ranks, rows)
    offloader.copier.start = lambda rows, size: sizes.append(size) or start(rows, size)
    for block in range(12):
        assert tier.offload(block, (0, (block,)), 100 + block, 35)
    offloader.flush()
    assert sizes == [8, 8]
    for block in range(12):
        slot = tier.lookup(0, (block,))
        tier.take(slot)
        tier.queue_onboard(slot, 12 + block, 200 + block)
    offloader.flush()
    offloader.poll(wait=True)
    assert sizes == [8, 8, 8, 8] and offloader.counts.onboarded_blocks == 12
    after = np.asarray(runner.kv_cache.k)
    for layer in range(2):
        for block in range(12):
            src, dst = layer * num_blocks + block, layer * num_blocks + 12 + block
            assert np.array_equal(after[:, dst], keys[:, src])
    assert np.array_equal(np.asarray(runner.kv_cache.v)[:, 12:24], -keys[:, :12])
