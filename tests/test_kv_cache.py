"""Paged KV cache manager: allocation, estimates, block tables, prefix reuse, eviction,
statistics and the block invariant."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler import GuaranteedNoEvictScheduler, MicroBatchScheduler, SchedulerOutput, SimpleScheduler

from scheduler_fakes import FakeExecutor, make_requests


def _run_context(kv: KVCacheManager, req: LlmRequest, token: int = 7) -> None:
    """Schedule the whole remaining prompt of `req` and complete it."""
    kv.add_sequence(req)
    req.context_chunk_size = req.context_remaining_length
    kv.prepare_resources(SchedulerOutput([req], [], []))
    assert req.move_to_next_context_chunk()
    req.add_new_token(token)


def _run_generation(kv: KVCacheManager, req: LlmRequest, token: int = 8) -> None:
    kv.prepare_resources(SchedulerOutput([], [req], []))
    req.add_new_token(token)


def test_blocks_follow_the_sequence_length():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4, max_blocks_per_seq=8)
    req = LlmRequest(1, list(range(6)), 10)
    assert kv.get_needed_resource_for_step(req) == 2
    assert kv.get_needed_resource_to_completion(req) == 4  # ceil(16 / 4)
    _run_context(kv, req)
    assert kv.get_block_ids(req) == [0, 1]
    assert req.num_tokens == 7
    for expected_blocks in [2, 2, 3, 3, 3, 3, 4]:  # token fed at position num_tokens - 1
        need = kv.get_needed_resource_for_step(req)
        _run_generation(kv, req)
        assert len(kv.get_block_ids(req)) == expected_blocks
        assert need in (0, 1)
    assert kv.get_needed_resource_to_completion(req) == 0
    row = np.full(8, -1, dtype=np.int32)
    kv.fill_block_table_row(req, row)
    assert row.tolist() == [0, 1, 2, 3, 0, 0, 0, 0] and row.dtype == np.int32
    assert kv.num_kv_slots == 64
    kv.check_invariants()
    assert kv.free_resources(req) == 4
    assert kv.free_resources(req) == 0  # second free is a no-op
    assert kv.get_block_ids(req) == []
    kv.check_invariants()


@pytest.mark.parametrize("reuse", [False, True])
def test_step_estimate_equals_allocation(reuse):
    """The per-step estimate is exactly what prepare_resources takes from the pool."""
    kv = KVCacheManager(num_blocks=60, tokens_per_block=4, max_blocks_per_seq=32, enable_block_reuse=reuse)
    sched = SimpleScheduler(GuaranteedNoEvictScheduler(4, kv), MicroBatchScheduler(4, 16))
    ex = FakeExecutor(sched, kv, 4, 16)
    shared = list(range(900, 913))
    reqs = make_requests([3, 9, 17, 4, 30, 1], [9, 2, 20, 7, 5, 12])
    reqs += [LlmRequest(10 + i, shared + [i] * (i + 1), 6, arrival_time=10.0 + i) for i in range(4)]
    ex.add(*reqs)
    checks = []
    original = kv.prepare_resources

    def checked_prepare(out):
        expected = sum(kv.get_needed_resource_for_step(r) for r in out.all_requests())
        before = kv.num_free_blocks
        original(out)
        checks.append(expected)
        assert before - kv.num_free_blocks == expected

    kv.prepare_resources = checked_prepare
    ex.run()
    assert len(checks) > 10 and sum(checks) > 0
    assert (kv.get_kv_cache_stats().reused_blocks > 0) == reuse


def test_table_rows_are_fixed_width_int32_and_grow():
    kv = KVCacheManager(num_blocks=64, tokens_per_block=2, max_blocks_per_seq=5, max_num_sequences=2)
    reqs = make_requests([3, 4, 5], 2)
    for r in reqs:
        _run_context(kv, r)
    assert kv.block_table.dtype == np.int32 and kv.block_table.shape[1] == 5
    assert kv.block_table.shape[0] >= 3
    rows = kv.get_table_rows(reqs)
    assert [kv.block_table[row, :3].tolist() for row in rows] == [[0, 1, 0], [2, 3, 0], [4, 5, 6]]
    kv.check_invariants()


def test_limits_raise_clear_errors():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=4, max_blocks_per_seq=2, enable_block_reuse=False)
    req = LlmRequest(1, list(range(9)), 1)
    kv.add_sequence(req)
    req.context_chunk_size = 9
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        kv.prepare_resources(SchedulerOutput([req], [], []))
    kv.free_resources(req)
    a, b, c = make_requests([8, 8, 4], 1)
    for r in (a, b):
        _run_context(kv, r)
    kv.add_sequence(c)
    c.context_chunk_size = 4
    with pytest.raises(RuntimeError, match="pool exhausted"):
        kv.prepare_resources(SchedulerOutput([c], [], []))
    with pytest.raises(ValueError, match="already used"):
        kv.add_sequence(LlmRequest(1, [1], 1))  # id 1 belongs to a live request
    with pytest.raises(RuntimeError, match="no KV blocks"):
        kv.prepare_resources(SchedulerOutput([], [LlmRequest(99, [1], 2)], []))


def test_invariant_check_detects_lost_and_double_owned_blocks():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, max_blocks_per_seq=4)
    a, b = make_requests([6, 6], 2)
    _run_context(kv, a)
    _run_context(kv, b)
    kv.check_invariants()
    kv.block_pool.acquire(kv.get_block_ids(a)[0])  # owned twice, listed by one block table
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv2 = KVCacheManager(num_blocks=8, tokens_per_block=4, max_blocks_per_seq=4)
    _run_context(kv2, LlmRequest(1, list(range(6)), 2))
    kv2.block_pool.allocate()  # a block leaves the pool and no block table lists it
    with pytest.raises(AssertionError, match="disagree"):
        kv2.check_invariants()


# ------------------------------------------------------------------ prefix reuse
SHARED = list(range(500, 512))  # 3 full blocks of 4


def test_shared_prefix_allocates_three_fewer_blocks():
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8)
    first = LlmRequest(1, SHARED + [1, 2, 3], 4)
    _run_context(kv, first)
    new_after_first = kv.get_kv_cache_stats().alloc_new_blocks
    assert new_after_first == 4

    second = LlmRequest(2, SHARED + [9, 9, 9, 9, 9], 4)  # first is still running
    # 17 + 4 tokens = 6 blocks, of which the 3 prefix blocks are shared with `first`
    assert kv.get_needed_resource_to_completion(second) == 6 - 3
    assert kv.get_needed_resource_for_step(second) == 5 - 3  # 5 prompt blocks
    reused_tokens = kv.add_sequence(second)
    assert reused_tokens == 12
    assert second.context_current_position == 12 and second.prepopulated_prompt_len == 12
    second.context_chunk_size = second.context_remaining_length
    kv.prepare_resources(SchedulerOutput([second], [], []))
    stats = kv.get_kv_cache_stats()
    assert stats.alloc_new_blocks - new_after_first == 2  # 5 prompt blocks, 3 reused
    assert stats.reused_blocks == 3
    assert stats.alloc_total_blocks == 4 + 5
    assert stats.missed_blocks == 4 + 2
    assert stats.cache_hit_rate == pytest.approx(3 / 9)
    assert kv.get_block_ids(second)[:3] == kv.get_block_ids(first)[:3]
    assert kv.get_kv_cache_stats().used_num_blocks == 6
    kv.check_invariants()
    assert stats.to_dict() == {
        "maxNumBlocks": 32,
        "freeNumBlocks": 26,
        "usedNumBlocks": 6,
        "tokensPerBlock": 4,
        "allocTotalBlocks": 9,
        "allocNewBlocks": 6,
        "reusedBlocks": 3,
        "missedBlocks": 6,
        "cacheHitRate": pytest.approx(1 / 3),
    }
    assert second.move_to_next_context_chunk()  # the step ran
    second.add_new_token(5)
    # shared blocks stay with the other owner when one frees
    assert kv.free_resources(first) == 1  # only its partial last block
    assert kv.free_resources(second) == 5
    kv.check_invariants()
    assert kv.num_cached_blocks == 4  # the shared prefix + second's 4th (full) block


def test_freed_prefix_is_reused_and_last_partial_block_never_shared():
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8)
    a = LlmRequest(1, SHARED, 1)  # exactly three full blocks
    _run_context(kv, a)
    a.finish("length")
    kv.free_resources(a)
    assert kv.num_cached_blocks == 3
    same = LlmRequest(2, SHARED, 1)
    # at least one prompt token is always computed: only 2 of the 3 blocks are reused
    assert kv.add_sequence(same) == 8
    assert same.context_remaining_length == 4
    longer = LlmRequest(3, SHARED + [1], 1)
    assert kv.add_sequence(longer) == 12
    partial = LlmRequest(4, SHARED[:6], 1)  # 1 full block + a partial one
    assert kv.add_sequence(partial) == 4
    kv.check_invariants()


def test_blocks_of_a_step_that_never_ran_are_not_reused():
    """A block enters the prefix index when its step is prepared; if the request is freed
    before the step ran (aborted), the entry is withdrawn since its KV was never written."""
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8)
    a = LlmRequest(1, SHARED + [1], 2)
    kv.add_sequence(a)
    a.context_chunk_size = 8  # first chunk: two blocks
    kv.prepare_resources(SchedulerOutput([a], [], []))
    a.move_to_next_context_chunk()
    a.context_chunk_size = 5  # second chunk is prepared but never runs
    kv.prepare_resources(SchedulerOutput([a], [], []))
    assert kv.add_sequence(LlmRequest(2, SHARED + [1], 2)) == 12  # visible while prepared
    kv.free_resources(kv.live_requests()[2])
    a.finish("cancelled")
    kv.free_resources(a)
    assert kv.num_cached_blocks == 2
    assert kv.add_sequence(LlmRequest(3, SHARED + [1], 2)) == 8
    kv.check_invariants()


def test_generated_tokens_are_cached_too():
    """Full blocks holding generated tokens are indexed once computed, so a follow-up
    prompt that starts with prompt + answer (a chat turn) hits the cache."""
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8)
    req = LlmRequest(1, [1, 2, 3, 4, 5, 6], 8)
    _run_context(kv, req, token=70)
    for tok in [71, 72, 73, 74]:
        _run_generation(kv, req, token=tok)
    req.finish("length")
    kv.free_resources(req)
    follow_up = LlmRequest(2, [1, 2, 3, 4, 5, 6, 70, 71, 72, 73, 99], 4)
    assert kv.add_sequence(follow_up) == 8


def test_eviction_under_pressure_is_lru_and_keeps_correctness():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=4, max_blocks_per_seq=6)
    old = LlmRequest(1, list(range(100, 108)) + [0], 1)
    _run_context(kv, old)
    old.finish("length")
    kv.free_resources(old)  # 2 cached blocks, 1 free
    newer = LlmRequest(2, list(range(200, 208)) + [0], 1)
    _run_context(kv, newer)
    newer.finish("length")
    kv.free_resources(newer)
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == 6
    big = LlmRequest(3, list(range(300, 321)), 1)  # 6 blocks: evicts every cached block
    _run_context(kv, big)
    assert kv.num_cached_blocks == 0
    kv.check_invariants()
    big.finish("length")
    kv.free_resources(big)
    # the evicted prefixes are misses now, the new one is a hit
    assert kv.add_sequence(LlmRequest(4, list(range(100, 108)) + [0], 1)) == 0
    assert kv.add_sequence(LlmRequest(5, list(range(300, 321)), 1)) == 20
    kv.check_invariants()


def test_partial_eviction_takes_the_oldest_prefix_tail_first():
    kv = KVCacheManager(num_blocks=5, tokens_per_block=4, max_blocks_per_seq=5)
    a = LlmRequest(1, list(range(100, 112)) + [0], 1)  # blocks 0,1,2 full + 3 partial
    _run_context(kv, a)
    a.finish("length")
    kv.free_resources(a)
    # one block needed beyond the free ones (block 3 and block 4 are free)
    b = LlmRequest(2, list(range(900, 909)), 1)
    _run_context(kv, b)  # 3 blocks: 2 free + 1 evicted, the tail of a's prefix
    c = LlmRequest(3, list(range(100, 112)) + [0], 1)
    assert kv.add_sequence(c) == 8  # the first two blocks of a's prefix survived
    kv.check_invariants()


def test_reuse_disabled_never_shares():
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8, enable_block_reuse=False)
    a = LlmRequest(1, SHARED + [1], 2)
    _run_context(kv, a)
    a.finish("length")
    kv.free_resources(a)
    assert kv.num_cached_blocks == 0
    b = LlmRequest(2, SHARED + [1], 2)
    assert kv.add_sequence(b) == 0
    assert kv.get_kv_cache_stats().reused_blocks == 0


def test_pause_with_reuse_recomputes_from_cache():
    kv = KVCacheManager(num_blocks=32, tokens_per_block=4, max_blocks_per_seq=8)
    req = LlmRequest(1, list(range(10)), 10)
    _run_context(kv, req, token=50)
    for tok in range(51, 57):
        _run_generation(kv, req, token=tok)
    assert req.num_tokens == 17
    kv.free_resources(req)
    req.pause()
    assert req.prompt_len == 17 and req.max_new_tokens == 3
    # 16 tokens were computed (4 full blocks); at least one token is recomputed
    assert kv.add_sequence(req) == 16
    assert req.context_remaining_length == 1
    kv.check_invariants()


def test_token_fed_this_step_is_indexed_only_once_known():
    """An overlapped engine feeds a generation token that the host has not read back yet
    (a placeholder); blocks are indexed only once all their tokens are known."""
    placeholder = -1
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4, max_blocks_per_seq=4)
    req = LlmRequest(1, [10, 11, 12], 8)
    kv.add_sequence(req)
    req.context_chunk_size = 3
    kv.prepare_resources(SchedulerOutput([req], [], []))
    req.move_to_next_context_chunk()
    req.add_new_token(placeholder)  # dispatched, token still on the device
    kv.prepare_resources(SchedulerOutput([], [req], []))  # feeds it: block 0 is now full
    assert kv.add_sequence(LlmRequest(2, [10, 11, 12, placeholder, 0], 1)) == 0
    req.output_token_ids[-1] = 13  # read back
    req.add_new_token(placeholder)
    kv.prepare_resources(SchedulerOutput([], [req], []))
    assert kv.add_sequence(LlmRequest(3, [10, 11, 12, 13, 0], 1)) == 4
    kv.check_invariants()
