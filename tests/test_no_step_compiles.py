"""No request waits for a compile after "ready" (jaxllm.engine.sampler_variants,
jaxllm.engine.background_compiles, the token cap of jaxllm.engine.compile_ahead).

A step whose sampler variant is not compiled runs the general variant: the same tokens and
logprobs as the engine that compiles each variant on its step (the engine without the feature),
also when the best-fitting variants finish compiling in the middle of the run. After a
background warm-up, a workload using every sampling setting and prompts longer than the compiled
token buckets compiles nothing on the engine's thread (compiles are counted by thread, from
JAX's compile events and the runner's program cache, never timed)."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from jaxllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from jaxllm.sampling import SAMPLER_VARIANTS, SamplingTensors

from conftest import tiny_engine
from engine_helpers import random_prompts

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # also sent for a persistent-cache hit
VOCAB = 64  # prompt ids drawn below every tiny preset's vocabulary
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


def _every_setting(max_tokens: int = 10) -> list[SamplingParams]:
    """One request per sampling feature the sampler handles (and a few together)."""
    return [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=5, top_p=0.9, seed=2, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=0.7, min_p=0.1, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=max_tokens, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True
        ),
        SamplingParams(max_tokens=max_tokens, min_tokens=4, bad_token_ids=[5, 6, 7], stop_token_ids=[9]),
        SamplingParams(max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(json=SCHEMA)),
    ]


def _run(engine, prompts, params, mid_run=None, at_step: int = 4):
    """Tokens and logprobs of each request, stepping the engine (`mid_run(engine)` after
    `at_step` steps)."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    logprobs: dict[int, list] = {r.request_id: [] for r in requests}
    steps = 0
    while engine.has_unfinished_requests():
        for update in engine.step():
            logprobs[update.request.request_id] += update.new_logprobs
        steps += 1
        if steps == at_step and mid_run is not None:
            mid_run(engine)
    return [(list(r.output_token_ids), logprobs[r.request_id]) for r in requests]


def _assert_same(ours, theirs):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, theirs):
        assert tokens == want_tokens
        assert len(logprobs) == len(want_logprobs)
        for mine, want in zip(logprobs, want_logprobs):
            assert mine.keys() == want.keys()
            for token in want:
                assert mine[token].rank == want[token].rank
                np.testing.assert_allclose(mine[token].logprob, want[token].logprob, atol=1e-5)


def test_general_sampler_variant_gives_the_tokens_of_each_variant_also_when_they_compile_mid_run():
    # One token bucket and no decode buckets: both engines run every step in the same forward,
    # so only the sampler program differs.
    limits = dict(max_seq_len=256, decode_batch_sizes=[])
    params = _every_setting()
    prompts = random_prompts(len(params), VOCAB, 3, 12, seed=11)
    reference = tiny_engine(compile_ahead=False, **limits)  # compiles each variant on its step
    try:
        want = _run(reference, prompts, params)
    finally:
        reference.close()

    engine = tiny_engine(**limits)
    try:
        engine.warmup(background=True)
        variants = engine.sampler_variants
        compiled = []

        def compile_variants(engine):
            """What the background threads do, finished mid-run: the variants of 8 rows with
            penalties and logprobs (those of the steps while the penalized request runs)."""
            compiled.append((variants.general_steps, engine.runner.sampler_runs))
            logits = variants.logits_struct(8)
            for flags in [f for f in SAMPLER_VARIANTS if f["use_penalties"] and f["num_top_logprobs"]]:
                sampling = SamplingTensors.empty(8, engine.max_seq_len, **flags)
                engine.runner.compile_sampler(logits, sampling, wait=True)

        ours = _run(engine, prompts, params, compile_variants)
        general_before, runs_before = compiled[0]
        assert general_before > 0  # steps ran the general variant of their rows' settings
        # Afterwards only steps with a grammar row (no variant of theirs is compiled) run it.
        assert variants.general_steps - general_before < engine.runner.sampler_runs - runs_before
    finally:
        engine.close()
    _assert_same(ours, want)


@pytest.mark.parametrize("decode_batch_sizes", [None, []], ids=["decode-buckets", "token-buckets"])
def test_no_compile_on_the_engine_thread_after_ready(decode_batch_sizes):
    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(threading.current_thread().name)

    extra = {} if decode_batch_sizes is None else {"decode_batch_sizes": decode_batch_sizes}
    llm = LLM(
        "tiny-moe",
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
        **extra,
    )  # background warm-up: "ready" once the decode token bucket (16) is compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine_thread = llm.executor.call_on_engine(lambda engine: threading.current_thread().name)
        before = llm.executor.call_on_engine(lambda engine: dict(engine.runner.programs.compiles_by_thread))
        params = _every_setting(8)
        # Prompts up to 60 tokens: they need token buckets 32 and 64, not compiled before ready.
        prompts = random_prompts(len(params), VOCAB, 20, 60, seed=12)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # Then a few at a time, so decode steps of fewer rows run too.
        for start in range(0, len(params), 3):
            outputs += llm.generate(prompts[start : start + 3], params[start : start + 3], use_tqdm=False)
        after = llm.executor.call_on_engine(lambda engine: dict(engine.runner.programs.compiles_by_thread))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    assert after.get(engine_thread, 0) == before.get(engine_thread, 0)
    assert engine_thread not in compiles, f"{compiles.count(engine_thread)} compiles on the engine thread"


def test_generation_logits_and_host_processors_compile_nothing_on_a_step_after_ready():
    """Their row gathers and scatters are compiled before ready (cheap), whatever
    `warmup_logits_outputs` says."""
    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(threading.current_thread().name)

    def ban_five(request_id, token_ids, logits):
        logits[5] = -np.inf
        return logits

    llm = LLM(
        "tiny-moe",
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        params = [
            SamplingParams(max_tokens=6, ignore_eos=True, return_generation_logits=True),
            SamplingParams(max_tokens=6, ignore_eos=True, logits_processor=ban_five),
            SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, return_generation_logits=True),
        ]
        prompts = random_prompts(len(params), VOCAB, 5, 40, seed=13)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        outputs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert 5 not in outputs[1].outputs[0].token_ids and 5 not in outputs[3].outputs[0].token_ids
    step_threads = [name for name in compiles if "background" not in name]
    assert not step_threads, f"compiles on {sorted(set(step_threads))}"


def test_prompt_logprobs_and_context_logits_compile_nothing_on_a_step_after_ready():
    """Prompts asking for their logits, of lengths spanning every token bucket, beside a running
    stream: after a background warm-up (which compiles the full context-logits variant of its
    largest bucket) nothing compiles on the engine thread, and the prompt logprobs, context
    logits and tokens equal those of the engine that compiles each variant on its step."""
    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(threading.current_thread().name)

    limits = dict(
        max_batch_size=4, max_num_tokens=64, max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=8)
    )
    prompts = random_prompts(5, VOCAB, 3, 60, seed=14)
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] + [
        SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, return_context_logits=i % 2 == 0)
        for i in range(4)
    ]
    reference = LLM("tiny-moe", compile_ahead=False, warmup="none", **limits)
    try:
        want = reference.generate(prompts, params, use_tqdm=False)
    finally:
        reference.shutdown()
    llm = LLM("tiny-moe", **limits)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine_thread = llm.executor.call_on_engine(lambda engine: threading.current_thread().name)
        stream = llm.generate_async(prompts[0], params[0])
        outputs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts[1:], params[1:])]
        outputs.insert(0, stream.result())
        stand_ins = llm.executor.call_on_engine(lambda engine: engine.programs.context_logits.stand_in_steps)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        llm.shutdown()
    assert engine_thread not in compiles, f"{compiles.count(engine_thread)} compiles on the engine thread"
    assert stand_ins > 0  # some prompts ran in the full variant of a larger bucket
    for ours, theirs in zip(outputs, want):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        if theirs.prompt_logprobs is None:
            assert ours.prompt_logprobs is None
            continue
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs)
        for mine, expected in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert mine.keys() == expected.keys()
            for token in expected:
                np.testing.assert_allclose(mine[token].logprob, expected[token].logprob, atol=1e-5)
        if theirs.context_logits is not None:
            np.testing.assert_allclose(ours.context_logits, theirs.context_logits, atol=1e-4)
