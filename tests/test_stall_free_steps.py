"""Stall-free steps (`EngineConfig.max_num_tokens_with_generation`): a step that carries running
streams takes prompt tokens only up to a small total, in chunks that may end inside a KV block.
Proven against the engine without it: the same requests give the same greedy tokens and
logprobs (within 1e-5), while its steps with generation rows stay within the size."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.batch_builder import token_buckets
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.llm_args import KvCacheConfig
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingParams
from jaxllm.scheduler.micro_batch import ContextChunkingConfig, MicroBatchScheduler

from conftest import tiny_engine


def _request(request_id: int, prompt_len: int, generating: bool = False) -> LlmRequest:
    request = LlmRequest(request_id, list(range(3, 3 + prompt_len)), 8)
    if generating:  # its prompt ran: it decodes now
        request.context_chunk_size = prompt_len
        request.move_to_next_context_chunk()
        request.add_new_token(5)
    return request


def _scheduler(stall_free) -> MicroBatchScheduler:
    return MicroBatchScheduler(
        64, 256, ContextChunkingConfig(chunk_unit_size=32), max_tokens_with_generation=stall_free
    )


@pytest.mark.parametrize("generating, expected", [(0, 256), (1, 15), (4, 12), (7, 9), (8, 224), (40, 192)])
def test_a_step_with_generation_takes_prompt_tokens_up_to_the_size(generating, expected):
    running = [_request(i, 4, generating=True) for i in range(generating)]
    prompt = _request(100, 300)
    context, generation = _scheduler(16).schedule(running + [prompt])
    assert len(generation) == generating and context == [prompt]
    # Not floored to the 32-token unit while a few streams run (15 would be 0 blocks, starving the
    # prompt); from 8 streams on (half the size), whole 32-token blocks of the whole budget.
    assert prompt.context_chunk_size == expected


def test_off_it_is_the_block_chunked_budget():
    running = [_request(0, 4, generating=True)]
    prompt = _request(100, 300)
    _scheduler(None).schedule(running + [prompt])
    assert prompt.context_chunk_size == 224  # 255 floored to whole 32-token blocks


def test_it_is_off_unless_asked_for_and_needs_chunks_and_a_smaller_step():
    assert EngineConfig(model="tiny-moe", max_num_tokens=256).tokens_with_generation() is None
    assert EngineConfig(model="tiny-moe", max_num_tokens_with_generation=0).tokens_with_generation() is None
    assert EngineConfig(model="tiny-moe", max_num_tokens_with_generation=48).tokens_with_generation() == 48
    off = EngineConfig(model="tiny-moe", enable_chunked_prefill=False, max_num_tokens_with_generation=16)
    assert off.tokens_with_generation() is None
    small = EngineConfig(model="tiny-moe", max_num_tokens=16, max_num_tokens_with_generation=16)
    assert small.tokens_with_generation() is None  # no step smaller than the largest


def test_a_size_below_the_smallest_bucket_gets_a_bucket_of_its_own():
    """Else its steps would pad to min_token_bucket and cost as much as that bucket's."""
    assert EngineConfig(model="tiny-moe", max_num_tokens_with_generation=8).min_token_bucket == 8
    assert EngineConfig(model="tiny-moe", max_num_tokens_with_generation=6).min_token_bucket == 8
    assert EngineConfig(model="tiny-moe", max_num_tokens_with_generation=24).min_token_bucket == 16
    assert token_buckets(256, EngineConfig(model="tiny-moe", max_num_tokens_with_generation=8).min_token_bucket)[0] == 8


@pytest.mark.parametrize("bad", [1, -2, True, 2.5, "16"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="max_num_tokens_with_generation"):
        EngineConfig(model="tiny-moe", max_num_tokens_with_generation=bad)


def _arrivals_beside_a_stream(stall_free: int) -> tuple[list, list, list[tuple[int, int]]]:
    """One long stream; prompts of 9..60 tokens (two sharing a prefix) arrive while it decodes.
    Returns each request's tokens and logprobs and (prompt tokens, generation rows) per step."""
    engine = tiny_engine(
        "tiny-moe",
        compile_ahead=False,
        max_num_tokens=64,
        max_num_tokens_with_generation=stall_free,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
    )
    try:
        rng = np.random.default_rng(11)
        shared = rng.integers(3, 300, 20).tolist()
        prompts = [rng.integers(3, 300, 6).tolist()]
        prompts += [rng.integers(3, 300, n).tolist() for n in (60, 9, 33)]
        prompts += [shared + rng.integers(3, 300, 5).tolist(), shared + rng.integers(3, 300, 31).tolist()]
        logprobs: dict[int, list] = {}
        requests = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=40 if i == 0 else 6, ignore_eos=True, logprobs=2)
            requests.append(engine.add_request(prompt, params))
            for _ in range(3 if i else 2):
                for update in engine.step():
                    for token, entry in zip(update.new_token_ids, update.new_logprobs):
                        logprobs.setdefault(update.request.request_id, []).append(entry[token].logprob)
        while engine.has_unfinished_requests():
            for update in engine.step():
                for token, entry in zip(update.new_token_ids, update.new_logprobs):
                    logprobs.setdefault(update.request.request_id, []).append(entry[token].logprob)
        steps = [
            (s["inflightBatchingStats"]["numCtxTokens"], s["inflightBatchingStats"]["numGenRequests"])
            for s in engine.iteration_stats
        ]
        return [list(r.output_token_ids) for r in requests], [logprobs[r.request_id] for r in requests], steps
    finally:
        engine.close()


def test_tokens_and_logprobs_equal_the_engine_without_it():
    tokens_on, logprobs_on, steps_on = _arrivals_beside_a_stream(16)
    tokens_off, logprobs_off, steps_off = _arrivals_beside_a_stream(0)
    assert tokens_on == tokens_off
    for on, off in zip(logprobs_on, logprobs_off):
        np.testing.assert_allclose(on, off, atol=1e-5)
    mixed_on = [ctx + gen for ctx, gen in steps_on if ctx and gen]
    mixed_off = [ctx + gen for ctx, gen in steps_off if ctx and gen]
    assert mixed_on and max(mixed_on) <= 16  # 1 + 15, 2 + 14, ...
    assert max(mixed_off) > 16  # without it, prompts arrive whole beside the stream
    assert len(mixed_on) > len(mixed_off)  # the same prompts in more, smaller steps


def test_a_background_warm_up_compiles_the_stall_free_bucket_before_ready():
    """Else the small steps run padded in the decode bucket and a new prompt pays more in chunks."""
    limits = dict(
        max_batch_size=32, max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512)
    )
    without, with_it = (
        tiny_engine("tiny-moe", **limits),
        tiny_engine("tiny-moe", max_num_tokens_with_generation=16, **limits),
    )
    try:
        assert without.program_warmup.first_buckets() == [32, 256]  # the decode bucket, the first prompts'
        assert with_it.program_warmup.first_buckets() == [16, 32, 256]
    finally:
        without.close()
        with_it.close()


def test_the_flag_reaches_the_engine_config():
    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs

    args = build_parser().parse_args(["generate", "--max-num-tokens-with-generation", "32"])
    assert engine_kwargs(args)["max_num_tokens_with_generation"] == 32
    assert engine_kwargs(build_parser().parse_args(["generate"]))["max_num_tokens_with_generation"] is None
