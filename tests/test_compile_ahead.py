"""Compiling on demand without a warm-up (jaxllm.engine.compile_ahead): a step whose best token
bucket is not compiled runs padded in a compiled larger one while the best fit compiles in the
background; only buckets steps need are compiled, none twice, and the tokens are HF's. The
background warm-up (`LLM(...)`'s default) compiles the decode token bucket and the one-row decode
bucket, nothing more while the engine is busy, and the other buckets once it is idle. Compilations are counted, never
timed."""

from __future__ import annotations

import time

import jax
import pytest

from jaxllm import LLM
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.llm_args import KvCacheConfig
from jaxllm.sampling import SamplingParams

from engine_helpers import hf_teacher_forcing_check, make_hf_model, random_prompts

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
VOCAB = 384


def _counting_compiles(compiles: list):
    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:  # also recorded for a program read from the persistent cache
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return listener


def _wait_for_compiles(engine: LLMEngine, decode_sizes: tuple = ()) -> None:
    """Until nothing compiles and the decode buckets `decode_sizes` are ready (a decode bucket's
    general sampler starts compiling once its forward is done)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        decode = engine.decode_compiler
        if not engine.runner.compiles_in_flight and (
            decode is None or decode.ready == list(decode_sizes or decode.ready)
        ):
            time.sleep(0.2)
            if not engine.runner.compiles_in_flight:
                return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return path, make_hf_model("qwen3", path, vocab_size=VOCAB)


LIMITS = dict(
    dtype="float32",
    max_batch_size=4,
    max_num_tokens=64,
    max_seq_len=128,
    kv_cache_config=KvCacheConfig(tokens_per_block=16, enable_block_reuse=False),
)


def _run(engine: LLMEngine, requests: list) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    for request in requests:
        assert request.is_finished


def test_steps_run_in_a_compiled_bucket_while_the_best_fit_compiles(qwen3):
    path, model = qwen3
    jax.clear_caches()  # an identical program compiled by an earlier test in this process is no compile
    # Token buckets only: decode steps of few rows would run in decode buckets otherwise.
    engine = LLMEngine(EngineConfig(model=str(path), compile_cache=False, decode_batch_sizes=[], **LIMITS))
    assert engine.token_buckets() == [16, 32, 64]
    compiles = []
    listener = _counting_compiles(compiles)
    try:
        # First step: 40 + 3 x 5 prompt tokens, bucket 64, compiled by the step itself. Then 4
        # decoding requests: best fit 16, not compiled, so they run in 64 while 16 compiles.
        prompts = [random_prompts(1, VOCAB, 40, 41, seed=1)[0]] + random_prompts(3, VOCAB, 5, 6, seed=2)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        requests = [engine.add_request(p, params) for p in prompts]
        _run(engine, requests)
        assert engine.bucket_compiler.padded_steps >= 1
        assert engine.runner.steps_per_bucket[64] > 1  # the decoding steps that ran padded
        for prompt, request in zip(prompts, requests):
            hf_teacher_forcing_check(model, prompt, request.output_token_ids)

        engine.on_idle()  # what the engine's driver calls once idle: bucket 16, if steps did not pay it yet
        _wait_for_compiles(engine)
        assert engine.bucket_compiler.ready == [16, 64]
        padded = engine.bucket_compiler.padded_steps
        later = engine.add_request(random_prompts(1, VOCAB, 3, 4, seed=3)[0], params)
        _run(engine, [later])
        assert engine.runner.steps_per_bucket[16] >= 8  # now in its own bucket, padded no more
        assert engine.bucket_compiler.padded_steps == padded
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.close()
    # Only the buckets steps needed (32 never), each compiled once; greedy steps with no
    # processing take the forward's argmax and run no sampler.
    assert engine.runner.num_forward_variants == 2 and engine.runner.num_sampler_variants == 0
    assert len(compiles) == 2, f"{len(compiles)} XLA compilations for 2 programs"


def test_background_warm_up_compiles_what_a_lone_user_needs_and_the_rest_when_idle(qwen3):
    path, model = qwen3
    jax.clear_caches()
    engine = LLMEngine(EngineConfig(model=str(path), compile_cache=False, **LIMITS))
    compiles = []
    listener = _counting_compiles(compiles)
    try:
        engine.warmup(background=True)
        # The decode token bucket (4 rows -> 16), the prompt bucket (256 tokens capped to 64) and
        # the decode buckets of 1 and 2 rows, the greedy sampler and the general sampler of 4, 2
        # and 1 rows (a token bucket samples its live rows), and the context-logits forward of
        # bucket 64 (with 64 rows: any prompt asking for its logits can run in it); 32 and decode
        # bucket 4 left for idle time.
        assert engine.decode_bucket() == 16
        assert engine.bucket_compiler.ready == [16, 64] and engine.bucket_compiler.deferred == [32]
        assert engine.decode_compiler.ready == [1, 2] and engine.decode_compiler.deferred == [4]
        assert (engine.runner.num_forward_variants, engine.runner.num_sampler_variants) == (5, 4)
        assert engine.runner.compiles_in_flight == 0

        # First step: 10 + 3 x 2 prompt tokens in 16, then decoding steps of 4 rows, whose
        # decode bucket is not compiled: they run in token bucket 16. One request samples: its
        # steps run the general sampler variant, and its own variant compiles once idle.
        prompts = [random_prompts(1, VOCAB, 10, 10, seed=4)[0]] + random_prompts(3, VOCAB, 2, 2, seed=5)
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        requests = [engine.add_request(p, greedy) for p in prompts[:3]]
        requests.append(
            engine.add_request(prompts[3], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))
        )
        busy_forwards, busy_in_flight = set(), set()
        while engine.has_unfinished_requests():
            busy_forwards.add(engine.runner.num_forward_variants)
            busy_in_flight.add(engine.runner.compiles_in_flight)
            engine.step()
        assert busy_forwards == {5} and busy_in_flight == {0}  # nothing compiled while busy
        assert engine.bucket_compiler.padded_steps == 0 and engine.runner.steps_per_bucket[16] == 6
        assert engine.runner.num_sampler_variants == 4 and engine.sampler_variants.general_steps == 6
        for prompt, request in zip(prompts[:3], requests):
            hf_teacher_forcing_check(model, prompt, request.output_token_ids)

        engine.on_idle()  # what the engine's driver calls once no request came for a while
        _wait_for_compiles(engine, (1, 2, 4))
        assert engine.bucket_compiler.ready == [16, 32, 64] and engine.bucket_compiler.deferred == []
        assert engine.decode_compiler.ready == [1, 2, 4] and engine.decode_compiler.deferred == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.close()
    assert engine.runner.num_forward_variants == 7
    # 7 forwards (one with context logits), 5 samplers (greedy, the sampled request's, the
    # general one of 4, 1 and 2 rows: decode bucket 4 shares the token buckets' rows), the
    # (empty) KV block copy, the slices
    # of a token bucket's first 1 and 2 rows (its sampler's live rows) and the row gathers and
    # scatters of 1, 2 and 4 rows (generation logits, host processors), each compiled once.
    assert engine.runner.num_sampler_variants == 5
    assert len(compiles) == 21, f"{len(compiles)} XLA compilations for 21 programs"


def test_llm_warms_up_in_the_background_and_compiles_the_rest_once_idle(qwen3):
    path, _ = qwen3
    with pytest.raises(ValueError, match="warmup"):
        LLM(str(path), warmup="eager")
    llm = LLM(str(path), **LIMITS)
    try:

        def state(e):
            return e.bucket_compiler.ready, e.runner.num_forward_variants, e.runner.num_sampler_variants

        assert llm.executor.call_on_engine(state) == ([16, 64], 5, 4)
        # No request comes: after EngineCore.IDLE_SECONDS the engine compiles the rest. (Each
        # look at the engine is a command that restarts the idle clock, so look rarely.)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(3)
            if llm.executor.call_on_engine(
                lambda e: e.runner.compiles_in_flight == 0 and e.runner.num_forward_variants == 7
            ):
                break
        # With each decode bucket its general sampler variant (4 rows: the token buckets' one).
        assert llm.executor.call_on_engine(state) == ([16, 32, 64], 7, 4)
    finally:
        llm.shutdown()


def test_compile_workers_must_be_positive():
    with pytest.raises(ValueError, match="compile_workers"):
        EngineConfig(model="tiny-dense", compile_workers=0)
