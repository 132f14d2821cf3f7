"""Scheduler behaviour: the reference walkthrough, chunking policies, capacity policies,
priorities, custom schedulers and a randomized soak with the block invariant checked
after every step."""

from __future__ import annotations

import random

import pytest

from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_args import CapacitySchedulerPolicy, ContextChunkingPolicy, SchedulerConfig
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.scheduler import (
    CapacityScheduler,
    ContextChunkingConfig,
    GuaranteedNoEvictScheduler,
    MaxUtilizationScheduler,
    MicroBatchScheduler,
    RequestScheduler,
    SchedulerOutput,
    SimpleScheduler,
    StaticBatchScheduler,
    check_request_admissible,
    make_scheduler,
)

from scheduler_fakes import FakeExecutor, fake_token, make_requests

ALL_POLICIES = list(CapacitySchedulerPolicy)


def _executor(
    *,
    num_blocks=64,
    tokens_per_block=4,
    max_blocks_per_seq=16,
    max_batch_size=4,
    max_num_tokens=12,
    policy="GUARANTEED_NO_EVICT",
    chunking=None,
    reuse=True,
    **kwargs,
) -> FakeExecutor:
    kv = KVCacheManager(num_blocks, tokens_per_block, max_blocks_per_seq, enable_block_reuse=reuse)
    config = SchedulerConfig(policy, chunking or "FIRST_COME_FIRST_SERVED")
    sched = make_scheduler(config, kv, max_batch_size, max_num_tokens, enable_chunked_prefill=chunking is not None)
    return FakeExecutor(sched, kv, max_batch_size, max_num_tokens, **kwargs)


# ----------------------------------------------------------------- walkthrough
@pytest.mark.parametrize("policy", ALL_POLICIES[:2])
def test_inflight_batching_walkthrough(policy):
    """Seed 002: max_batch_size 4, max_num_tokens 12, five 5-token prompts. Request 1
    stops at its 2nd token, which lets request 5 in."""
    ex = _executor(policy=policy, stop_after={1: 2})
    ex.add(*make_requests([5] * 5, 3))

    out = ex.step()  # R1, R2 context (10 tokens); R3 would need 5 of the 2 left
    assert [r.request_id for r in out.context_requests] == [1, 2]
    assert out.generation_requests == []
    assert out.num_tokens == 10

    out = ex.step()  # generation first: R1, R2; then R3, R4 context; R5 blocked by batch size
    assert [r.request_id for r in out.generation_requests] == [1, 2]
    assert [r.request_id for r in out.context_requests] == [3, 4]
    assert out.num_tokens == 12
    assert ex.history[-1].finished == [1]  # G2 of request 1 is its stop token

    out = ex.step()  # request 1 left, so request 5 enters
    assert [r.request_id for r in out.generation_requests] == [2, 3, 4]
    assert [r.request_id for r in out.context_requests] == [5]
    assert ex.history[-1].finished == [2]

    ex.run()
    schedule = [(h.context_ids, h.generation) for h in ex.history]
    assert schedule == [
        ([1, 2], []),
        ([3, 4], [1, 2]),
        ([5], [2, 3, 4]),
        ([], [3, 4, 5]),
        ([], [5]),
    ]
    outputs = {r.request_id: r.output_token_ids for r in ex.finished}
    assert {rid: len(toks) for rid, toks in outputs.items()} == {1: 2, 2: 3, 3: 3, 4: 3, 5: 3}
    assert {r.request_id: r.finish_reason for r in ex.finished} == {
        1: "stop",
        2: "length",
        3: "length",
        4: "length",
        5: "length",
    }


# -------------------------------------------------------------------- chunking
def _chunked_positions(policy: str, unit: int, budget: int, prompt_lens=(25, 25), steps=10):
    kv = KVCacheManager(64, unit, 16)
    sched = SimpleScheduler(
        GuaranteedNoEvictScheduler(8, kv), MicroBatchScheduler(8, budget, ContextChunkingConfig(policy, unit))
    )
    ex = FakeExecutor(sched, kv, 8, budget)
    reqs = make_requests(list(prompt_lens), 1)  # finish right after the context
    ex.add(*reqs)
    positions = []
    for _ in range(steps):
        if not ex.active:
            break
        ex.step()
        positions.append(tuple(r.context_current_position for r in reqs))
    return positions, ex


@pytest.mark.parametrize(
    "policy, budget, expected",
    [
        ("FIRST_COME_FIRST_SERVED", 30, [(25, 5), (25, 25)]),
        ("FIRST_COME_FIRST_SERVED", 15, [(15, 0), (25, 5), (25, 20), (25, 25)]),
        ("EQUAL_PROGRESS", 30, [(15, 15), (25, 25)]),
        ("EQUAL_PROGRESS", 15, [(10, 5), (20, 10), (25, 20), (25, 25)]),
    ],
)
def test_chunking_examples(policy, budget, expected):
    positions, ex = _chunked_positions(policy, 5, budget)
    assert positions == expected
    assert not ex.active
    for h in ex.history:  # every chunk but a prompt's last is a multiple of the unit
        for _rid, pos, chunk in h.context:
            assert chunk > 0
            assert chunk % 5 == 0 or pos + chunk == 25


@pytest.mark.parametrize("policy", list(ContextChunkingPolicy))
def test_chunk_unit_larger_than_budget_schedules_nothing(policy):
    kv = KVCacheManager(64, 20, 16)
    micro = MicroBatchScheduler(8, 10, ContextChunkingConfig(policy, 20))
    sched = SimpleScheduler(GuaranteedNoEvictScheduler(8, kv), micro)
    reqs = make_requests([25, 25], 1)
    out = sched.schedule_request(reqs, set())
    assert out.context_requests == [] and out.generation_requests == []
    assert [r.context_chunk_size for r in reqs] == [0, 0]


@pytest.mark.parametrize("policy", list(ContextChunkingPolicy))
def test_max_context_length_caps_chunks(policy):
    micro = MicroBatchScheduler(8, 100, ContextChunkingConfig(policy, 4), max_context_length=10)
    reqs = make_requests([25], 1)
    ctx, gen = micro.schedule(reqs, set())
    assert ctx == reqs and reqs[0].context_chunk_size == 8  # 10 floored to the unit
    with pytest.raises(ValueError, match="max_context_length"):
        MicroBatchScheduler(8, 100, ContextChunkingConfig(policy, 16), max_context_length=10)


def test_generation_first_and_token_budget_stops_generation():
    micro = MicroBatchScheduler(max_batch_size=8, max_num_tokens=3)
    reqs = make_requests([4, 4, 4, 4, 4], 5)
    for r in reqs[1:]:
        r.context_current_position = 4
        r.add_new_token(1)
    # request 1 is a context request listed first; generation still goes first
    ctx, gen = micro.schedule(reqs, set())
    assert [r.request_id for r in gen] == [2, 3, 4]
    assert ctx == []


def test_batch_size_counts_generation_first():
    micro = MicroBatchScheduler(max_batch_size=3, max_num_tokens=100)
    reqs = make_requests([4, 4, 4, 4], 5)
    for r in reqs[2:]:
        r.context_current_position = 4
        r.add_new_token(1)
    ctx, gen = micro.schedule(reqs, set())  # contexts listed first still yield the slots
    assert [r.request_id for r in gen] == [3, 4]
    assert [r.request_id for r in ctx] == [1]
    assert reqs[1].context_chunk_size == 0


def test_inflight_requests_are_skipped():
    micro = MicroBatchScheduler(max_batch_size=8, max_num_tokens=100)
    reqs = make_requests([4, 4, 4], 5)
    reqs[0].context_current_position = 4
    reqs[0].add_new_token(1)
    ctx, gen = micro.schedule(reqs, {1, 3})
    assert gen == [] and [r.request_id for r in ctx] == [2]


def test_unchunked_prompt_longer_than_budget_still_progresses():
    """A prompt that outgrew max_num_tokens (e.g. after a pause) is split, not starved."""
    micro = MicroBatchScheduler(max_batch_size=8, max_num_tokens=10)
    reqs = make_requests([25], 1)
    ctx, _ = micro.schedule(reqs, set())
    assert ctx == reqs and reqs[0].context_chunk_size == 10


def test_prefix_reuse_is_applied_before_chunking():
    """The reused prefix is claimed at admission, so the micro-batch sizes the chunk from
    the advanced position and the step computes only the rest."""
    ex = _executor(num_blocks=32, tokens_per_block=4, max_num_tokens=64, chunking="FIRST_COME_FIRST_SERVED")
    shared = list(range(100, 112))  # 3 blocks
    a = LlmRequest(1, shared + [1, 2], 2, arrival_time=0.0)
    ex.add(a)
    ex.run()
    b = LlmRequest(2, shared + [7, 8, 9], 2, arrival_time=1.0)
    ex.add(b)
    out = ex.step()
    assert ex.history[-1].context == [(2, 12, 3)]
    assert b.prepopulated_prompt_len == 12 and out.num_context_tokens == 3
    assert ex.kv.get_kv_cache_stats().reused_blocks == 3


def first_context_order(ex: FakeExecutor) -> list[int]:
    """Request ids in the order their first context chunk ran."""
    order: list[int] = []
    for h in ex.history:
        for rid in h.context_ids:
            if rid not in order:
                order.append(rid)
    return order


# ------------------------------------------------------------ capacity policies
def _small_pool_run(policy: str):
    # 4 requests, each 8 prompt + 12 new tokens = 5 blocks of 4; the pool has 12 blocks.
    ex = _executor(
        num_blocks=12, tokens_per_block=4, max_blocks_per_seq=8, max_batch_size=4, max_num_tokens=64, policy=policy
    )
    reqs = make_requests([8, 8, 8, 8], 12)
    ex.add(*reqs)
    max_running = 0
    paused = 0
    while ex.active:
        out = ex.step()
        max_running = max(max_running, out.batch_size)
        paused += len(out.paused_requests)
        assert len(ex.history) < 500
    return ex, reqs, max_running, paused


def test_no_evict_vs_max_utilization_on_small_pool():
    ex_ne, reqs_ne, running_ne, paused_ne = _small_pool_run("GUARANTEED_NO_EVICT")
    ex_mu, reqs_mu, running_mu, paused_mu = _small_pool_run("MAX_UTILIZATION")

    assert paused_ne == 0
    assert running_ne == 2  # only two fit to completion at a time: serialised in pairs
    assert running_mu > running_ne  # max-utilization starts more at once ...
    assert paused_mu > 0  # ... and has to pause some
    assert sum(r.num_pauses for r in reqs_mu) == paused_mu
    for ne, mu in zip(reqs_ne, reqs_mu):  # every request completes with the same tokens
        assert ne.finish_reason == mu.finish_reason == "length"
        assert len(mu.output_token_ids) == 12
        assert mu.output_token_ids == ne.output_token_ids
        assert mu.orig_prompt_token_ids == ne.prompt_token_ids
    # no-evict admitted two, then the next two as soon as the first pair finished
    first_ctx = [h.context_ids for h in ex_ne.history if h.context_ids]
    assert first_ctx == [[1, 2], [3, 4]]
    assert ex_mu.kv.get_kv_cache_stats().free_num_blocks == 12


def test_no_evict_reservation_is_never_exceeded():
    """What no-evict reserves at admission is an upper bound that allocation never passes."""
    ex = _executor(num_blocks=10, tokens_per_block=4, max_blocks_per_seq=8, max_num_tokens=64)
    reqs = make_requests([5, 9, 3, 7], [7, 3, 12, 6])
    ex.add(*reqs)
    reserved = {}
    while ex.active:
        for r in ex.active:
            if r.request_id not in reserved and not ex.kv.has_sequence(r):
                reserved[r.request_id] = ex.kv.get_needed_resource_to_completion(r)
        ex.step()
        for r in reqs:
            assert ex.kv.get_num_allocated_blocks(r) <= reserved.get(r.request_id, 0)


def test_no_evict_does_not_skip_ahead_of_a_request_that_does_not_fit():
    ex = _executor(num_blocks=8, tokens_per_block=4, max_blocks_per_seq=8, max_num_tokens=64)
    big_first = make_requests([8], 12)  # 5 blocks
    ex.add(*big_first)
    ex.step()
    waiting = make_requests([16, 2], [8, 2], start_id=2)  # 6 blocks (does not fit), 1 block (fits)
    ex.add(*waiting)
    out = ex.step()
    assert out.context_requests == [] and not ex.kv.has_sequence(waiting[1])
    ex.run()
    assert first_context_order(ex) == [1, 2, 3]
    admitted = {rid: h.step for h in reversed(ex.history) for rid in h.context_ids}
    assert admitted[3] >= admitted[2]


def test_max_utilization_pauses_most_recent_and_releases_blocks():
    ex = _executor(
        num_blocks=6,
        tokens_per_block=4,
        max_blocks_per_seq=8,
        max_batch_size=4,
        max_num_tokens=64,
        policy="MAX_UTILIZATION",
    )
    reqs = make_requests([8, 8, 8], 8)  # prompts take 2 blocks each: the pool is full
    ex.add(*reqs)
    ex.step()
    assert ex.kv.num_free_blocks == 0
    out = ex.step()  # every request needs a 3rd block: the last one is paused
    assert [r.request_id for r in out.paused_requests] == [3]
    assert reqs[2].state == LlmRequestState.CONTEXT_INIT
    assert reqs[2].prompt_len == 9 and reqs[2].max_new_tokens == 7  # G1 joined the prompt
    assert not ex.kv.has_sequence(reqs[2])
    assert [r.request_id for r in out.generation_requests] == [1, 2]
    ex.run()
    assert all(len(r.output_token_ids) == 8 for r in reqs)


# ----------------------------------------------------------------- priorities
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_priority_orders_admission_in_every_policy(policy):
    # the pool fits one request to completion at a time
    ex = _executor(
        num_blocks=4, tokens_per_block=4, max_blocks_per_seq=4, max_batch_size=4, max_num_tokens=64, policy=policy
    )
    reqs = make_requests([6, 6, 6], 6, priorities=[0.0, 5.0, 1.0])
    ex.add(*reqs)
    ex.run()
    assert first_context_order(ex) == [2, 3, 1]
    assert all(len(r.output_token_ids) == 6 for r in reqs)


def test_priority_ties_break_by_arrival():
    ex = _executor(num_blocks=4, tokens_per_block=4, max_blocks_per_seq=4, max_num_tokens=64)
    reqs = make_requests([6, 6, 6], 6, priorities=[1.0, 1.0, 1.0])
    reqs[0].arrival_time, reqs[2].arrival_time = 5.0, -1.0
    ex.add(*reqs)
    ex.run()
    order = [h.context_ids[0] for h in ex.history if h.context_ids]
    assert order == [3, 2, 1]


def test_max_utilization_high_priority_preempts_lower():
    ex = _executor(num_blocks=4, tokens_per_block=4, max_blocks_per_seq=4, max_num_tokens=64, policy="MAX_UTILIZATION")
    low = LlmRequest(1, list(range(8)), 6, priority=0.0, arrival_time=0.0)
    ex.add(low)
    ex.step()
    ex.step()
    high = LlmRequest(2, list(range(50, 58)), 6, priority=9.0, arrival_time=1.0)
    ex.add(high)
    out = ex.step()
    assert [r.request_id for r in out.context_requests] == [2]
    assert [r.request_id for r in out.paused_requests] == [1]
    ex.run()
    assert ex.finished[0] is high
    assert low.output_token_ids == [fake_token_at(1, i) for i in range(6)]


def fake_token_at(rid: int, index: int) -> int:
    probe = LlmRequest(rid, [0], 1)
    probe.output_token_ids = [0] * index
    return fake_token(probe)


# --------------------------------------------------------------- static batch
def test_static_batch_admits_only_when_idle():
    ex = _executor(num_blocks=64, max_batch_size=2, max_num_tokens=64, policy="STATIC_BATCH")
    reqs = make_requests([4, 4, 4], [2, 5, 2])
    ex.add(*reqs)
    ex.run()
    # request 3 waits for the whole first batch (including the longer request 2)
    ctx_steps = {rid: h.step for h in ex.history for rid in h.context_ids}
    done_2 = next(h.step for h in ex.history if 2 in h.finished)
    assert ctx_steps[1] == ctx_steps[2] == 0
    assert ctx_steps[3] == done_2 + 1


# ------------------------------------------------------------------ admission
def test_admission_rejects_requests_that_can_never_run():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, max_blocks_per_seq=16)
    check_request_admissible(LlmRequest(1, [1] * 20, 12), kv, max_seq_len=64)  # 8 blocks: fits
    with pytest.raises(ValueError, match="whole KV cache has 8 blocks"):
        check_request_admissible(LlmRequest(2, [1] * 20, 13), kv, max_seq_len=64)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        check_request_admissible(LlmRequest(3, [1] * 20, 10), kv, max_seq_len=24)
    small = KVCacheManager(num_blocks=64, tokens_per_block=4, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        check_request_admissible(LlmRequest(4, [1] * 10, 10), small, max_seq_len=64)
    with pytest.raises(ValueError, match="enable chunked prefill"):
        check_request_admissible(LlmRequest(5, [1] * 20, 1), kv, 64, max_num_tokens=16, enable_chunked_prefill=False)


# ----------------------------------------------------------- custom schedulers
class ShortestPromptFirstScheduler(RequestScheduler):
    """A one-step policy: keep every generating request, then start the shortest prompts
    that fit the KV pool to completion."""

    def __init__(self, kv: KVCacheManager, max_batch_size: int) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size

    def schedule_request(self, active_requests, inflight_request_ids=None) -> SchedulerOutput:
        generation = [r for r in active_requests if r.state == LlmRequestState.GENERATION_IN_PROGRESS]
        available = self.kv.get_num_available_blocks()
        available -= sum(self.kv.get_needed_resource_to_completion(r) for r in generation)
        context = []
        waiting = [r for r in active_requests if r.state == LlmRequestState.CONTEXT_INIT]
        for req in sorted(waiting, key=lambda r: r.prompt_len):
            if len(generation) + len(context) >= self.max_batch_size:
                break
            need = self.kv.get_needed_resource_to_completion(req)
            if need <= available:
                self.kv.add_sequence(req)
                req.context_chunk_size = req.context_remaining_length
                context.append(req)
                available -= need
        return SchedulerOutput(context, generation, [])


def test_custom_request_scheduler_plugs_in():
    kv = KVCacheManager(64, 4, 16)
    ex = FakeExecutor(ShortestPromptFirstScheduler(kv, max_batch_size=2), kv, 2, 64)
    ex.add(*make_requests([9, 3, 6], 2))
    ex.run()
    starts = [h.context_ids for h in ex.history if h.context_ids]
    assert starts == [[2, 3], [1]]
    assert all(len(r.output_token_ids) == 2 for r in ex.finished)


class MaxRequestsCapacityScheduler(CapacityScheduler):
    """Seed-000 style: admit up to N requests in arrival order, reserving to completion."""

    def __init__(self, max_num_requests: int, kv: KVCacheManager) -> None:
        self.max_num_requests = max_num_requests
        self.kv = kv

    def schedule_request(self, active_requests):
        fitting = []
        available = self.kv.get_num_available_blocks()
        for req in self.schedulable_in_order(active_requests):
            if len(fitting) >= self.max_num_requests:
                break
            need = self.kv.get_needed_resource_to_completion(req)
            if not self.kv.has_sequence(req):
                if need > available:
                    break
                self.kv.add_sequence(req)
            fitting.append(req)
            available -= need
        return fitting, []


def test_custom_capacity_scheduler_plugs_into_simple_scheduler():
    kv = KVCacheManager(64, 4, 16)
    sched = SimpleScheduler(MaxRequestsCapacityScheduler(1, kv), MicroBatchScheduler(8, 64))
    ex = FakeExecutor(sched, kv, 8, 64)
    ex.add(*make_requests([4, 4], 2))
    ex.run()
    assert [(h.context_ids, h.generation) for h in ex.history] == [([1], []), ([], [1]), ([2], []), ([], [2])]


def test_make_scheduler_builds_the_configured_policies():
    kv = KVCacheManager(16, 4, 8)
    for policy, cls in [
        ("GUARANTEED_NO_EVICT", GuaranteedNoEvictScheduler),
        ("max_utilization", MaxUtilizationScheduler),
        ("STATIC_BATCH", StaticBatchScheduler),
    ]:
        s = make_scheduler(SchedulerConfig(policy, "EQUAL_PROGRESS"), kv, 8, 128, True, 64)
        assert type(s.capacity_scheduler) is cls
        assert s.micro_batch_scheduler.chunking == ContextChunkingConfig(ContextChunkingPolicy.EQUAL_PROGRESS, 4)
        assert s.micro_batch_scheduler.max_context_length == 64
    assert make_scheduler(None, kv, 8, 128, False).micro_batch_scheduler.chunking is None


# ------------------------------------------------------------------------ soak
@pytest.mark.parametrize(
    "policy, chunking, reuse, seed",
    [
        ("GUARANTEED_NO_EVICT", "FIRST_COME_FIRST_SERVED", True, 1),
        ("MAX_UTILIZATION", "EQUAL_PROGRESS", True, 2),
        ("MAX_UTILIZATION", None, True, 3),
        ("GUARANTEED_NO_EVICT", "EQUAL_PROGRESS", True, 4),
        ("STATIC_BATCH", "FIRST_COME_FIRST_SERVED", True, 5),
        ("MAX_UTILIZATION", "FIRST_COME_FIRST_SERVED", False, 6),
    ],
)
def test_randomized_soak(policy, chunking, reuse, seed):
    rng = random.Random(seed)
    tpb = 4
    ex = _executor(
        num_blocks=40,
        tokens_per_block=tpb,
        max_blocks_per_seq=16,
        max_batch_size=6,
        max_num_tokens=24,
        policy=policy,
        chunking=chunking,
        reuse=reuse,
    )
    ex.stop_after = {}
    system_prompts = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 10]))] for _ in range(3)]
    next_id = 1
    submitted = []
    steps = 0
    paused = 0
    while steps < 1000 or ex.active:
        if steps < 1000 and rng.random() < 0.35:
            prefix = rng.choice(system_prompts) if rng.random() < 0.6 else []
            plen = rng.randint(1, 24)
            prompt = (prefix + [rng.randrange(1000) for _ in range(plen)])[:40]
            req = LlmRequest(
                next_id,
                prompt,
                rng.randint(1, 64 - len(prompt)),
                priority=rng.choice([0.0, 0.0, 1.0]),
                arrival_time=float(steps),
            )
            if rng.random() < 0.15:
                ex.stop_after[next_id] = rng.randint(1, req.max_new_tokens)
            check_request_admissible(req, ex.kv, max_seq_len=64)
            ex.add(req)
            submitted.append(req)
            next_id += 1
        if ex.active and rng.random() < 0.02:
            ex.abort(rng.choice(ex.active))
        out = ex.step()  # checks the block invariant and the KV contents every step
        paused += len(out.paused_requests)
        steps += 1
        assert steps < 5000, "requests starve"
    assert ex.kv.num_sequences == 0
    stats = ex.kv.get_kv_cache_stats()
    assert stats.used_num_blocks == 0 and stats.free_num_blocks == 40
    if reuse:
        assert stats.reused_blocks > 0
    if policy != "MAX_UTILIZATION":
        assert paused == 0
    for req in submitted:
        assert req.is_finished
        if req.finish_reason == "cancelled":
            continue
        expected_len = ex.stop_after.get(req.request_id, req.orig_max_new_tokens)
        assert len(req.output_token_ids) == expected_len
        assert req.output_token_ids == [fake_token_at(req.request_id, i) for i in range(expected_len)]


def test_scheduler_overhead_benchmark_runs(capsys):
    from jaxllm.bench.scheduler_overhead import main

    assert main(["--running", "8", "--steps", "3", "--max-num-tokens", "256", "--max-seq-len", "256"]) == 0
    table = capsys.readouterr().out
    assert "GUARANTEED_NO_EVICT" in table and "MAX_UTILIZATION" in table and "mixed" in table
    assert (
        main(
            [
                "--running",
                "8",
                "--steps",
                "3",
                "--max-num-tokens",
                "256",
                "--max-seq-len",
                "256",
                "--scenario",
                "mixed",
                "--policy",
                "GUARANTEED_NO_EVICT",
                "--kv",
                "retention+events",
            ]
        )
        == 0
    )
    assert "retention+events" in capsys.readouterr().out
