"""StepBatch construction: exact arrays for a small mixed step, padding, bucketing."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.batch_builder import build_step_batch, choose_token_bucket, token_buckets
from jaxllm.engine.planner import Planner
from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler import SchedulerOutput


def test_choose_token_bucket():
    assert choose_token_bucket(0, 8192) == 16
    assert choose_token_bucket(1, 8192) == 16
    assert choose_token_bucket(16, 8192) == 16
    assert choose_token_bucket(17, 8192) == 32
    assert choose_token_bucket(5000, 8192) == 8192
    assert choose_token_bucket(5000, 6000) == 6000  # the cap is a bucket even if not 2^k
    assert choose_token_bucket(10, 12) == 12
    assert choose_token_bucket(3, 64, min_bucket=4) == 4
    with pytest.raises(ValueError, match="exceed max_num_tokens"):
        choose_token_bucket(13, 12)
    assert token_buckets(6000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6000]
    assert token_buckets(16) == [16]
    assert all(choose_token_bucket(n, 6000) in token_buckets(6000) for n in range(0, 6001, 37))


def _mixed_step():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4, max_blocks_per_seq=4, enable_block_reuse=False)
    gen = LlmRequest(2, [20, 21, 22], 5)
    kv.add_sequence(gen)
    gen.context_chunk_size = 3
    kv.prepare_resources(SchedulerOutput([gen], [], []))  # block 0
    gen.move_to_next_context_chunk()
    gen.add_new_token(7)
    ctx = LlmRequest(1, list(range(10, 16)), 5)
    kv.add_sequence(ctx)
    ctx.context_chunk_size = 4
    out = SchedulerOutput([ctx], [gen], [])
    kv.prepare_resources(out)  # blocks 1, 2 for the whole 6-token prompt
    return kv, ctx, gen, out


def test_mixed_context_and_generation_step():
    kv, ctx, gen, out = _mixed_step()
    b = build_step_batch(out, kv, token_bucket=8, max_batch_size=3, max_blocks_per_seq=4)
    assert b.token_ids.tolist() == [10, 11, 12, 13, 7, 0, 0, 0]
    assert b.positions.tolist() == [0, 1, 2, 3, 3, 0, 0, 0]
    assert b.slot_mapping.tolist() == [4, 5, 6, 7, 3, 64, 64, 64]  # padding: one past the pool
    assert b.cu_q_lens.tolist() == [0, 4, 5, 5]
    assert b.kv_lens.tolist() == [4, 4, 0]
    assert b.block_tables.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert b.num_seqs.tolist() == [2]
    assert b.logits_indices.tolist() == [3, 4, 0]
    for name in (
        "token_ids",
        "positions",
        "slot_mapping",
        "cu_q_lens",
        "kv_lens",
        "block_tables",
        "num_seqs",
        "logits_indices",
    ):
        assert getattr(b, name).dtype == np.int32, name
    assert b.num_tokens_padded == 8

    # next step: the rest of the prompt (a chunk starting mid-block) and one more token
    for request, row, index in Planner.advance(out):  # what the engine does once the step ran
        request.output_token_ids[index] = [0, 8][row]
    ctx.context_chunk_size = 2
    out2 = SchedulerOutput([ctx], [gen], [])
    kv.prepare_resources(out2)
    b2 = build_step_batch(out2, kv, token_bucket=4, max_batch_size=2, max_blocks_per_seq=4)
    assert b2.token_ids.tolist() == [14, 15, 8, 0]
    assert b2.positions.tolist() == [4, 5, 4, 0]
    assert b2.slot_mapping.tolist() == [8, 9, 12, 64]  # gen's 2nd block is block 3
    assert b2.kv_lens.tolist() == [6, 5]
    assert b2.block_tables.tolist() == [[1, 2, 0, 0], [0, 3, 0, 0]]
    assert b2.logits_indices.tolist() == [1, 2]


def test_generation_only_and_empty_steps():
    kv, ctx, gen, out = _mixed_step()
    only_gen = SchedulerOutput([], [gen], [])
    b = build_step_batch(only_gen, kv, token_bucket=2, max_batch_size=2, max_blocks_per_seq=4)
    assert b.token_ids.tolist() == [7, 0] and b.positions.tolist() == [3, 0]
    assert b.cu_q_lens.tolist() == [0, 1, 1] and b.logits_indices.tolist() == [0, 0]
    empty = build_step_batch(SchedulerOutput(), kv, token_bucket=2, max_batch_size=2, max_blocks_per_seq=4)
    assert empty.num_seqs.tolist() == [0] and (empty.slot_mapping == 64).all()
    assert empty.cu_q_lens.tolist() == [0, 0, 0]


def test_errors_name_the_problem():
    kv, ctx, gen, out = _mixed_step()
    with pytest.raises(ValueError, match="token bucket"):
        build_step_batch(out, kv, token_bucket=4, max_batch_size=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="max_batch_size"):
        build_step_batch(out, kv, token_bucket=8, max_batch_size=1, max_blocks_per_seq=4)
    ctx.context_chunk_size = 0
    with pytest.raises(ValueError, match="empty chunk"):
        build_step_batch(SchedulerOutput([ctx], [], []), kv, token_bucket=8, max_batch_size=2, max_blocks_per_seq=4)
    late = LlmRequest(3, [1] * 9, 2)
    kv.add_sequence(late)
    late.context_chunk_size = 9
    with pytest.raises(RuntimeError, match="prepare_resources"):
        build_step_batch(SchedulerOutput([late], [], []), kv, token_bucket=16, max_batch_size=2, max_blocks_per_seq=4)


def test_recorded_placement_matches_lookup_and_goes_stale_on_free():
    kv, ctx, gen, out = _mixed_step()
    assert out.kv_placement is not None and kv.placement_is_current(out.kv_placement)
    fast = build_step_batch(out, kv, token_bucket=8, max_batch_size=3, max_blocks_per_seq=4)
    fresh = SchedulerOutput(out.context_requests, out.generation_requests, [])  # nothing recorded
    slow = build_step_batch(fresh, kv, token_bucket=8, max_batch_size=3, max_blocks_per_seq=4)
    for name in (
        "token_ids",
        "positions",
        "slot_mapping",
        "cu_q_lens",
        "kv_lens",
        "block_tables",
        "num_seqs",
        "logits_indices",
    ):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    kv.free_resources(gen)  # a free after prepare_resources voids the recorded rows
    assert not kv.placement_is_current(out.kv_placement)
    with pytest.raises(RuntimeError, match="holds no KV blocks"):
        build_step_batch(out, kv, token_bucket=8, max_batch_size=3, max_blocks_per_seq=4)
