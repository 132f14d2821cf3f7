"""Compiling on demand without a warm-up (jaxllm.engine.compile_ahead): a step whose best token
bucket is not compiled runs padded in a compiled larger one while the best fit compiles in the
background; only buckets steps need are compiled, none twice, and the tokens are HF's."""

from __future__ import annotations

import time

import jax
import pytest

from engine_helpers import hf_teacher_forcing_check, make_hf_model, random_prompts
from jaxllm.config import KvCacheConfig
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.sampling import SamplingParams

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
VOCAB = 384


def _run(engine: LLMEngine, requests: list) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    for request in requests:
        assert request.is_finished


def test_steps_run_in_a_compiled_bucket_while_the_best_fit_compiles(tmp_path):
    model = make_hf_model("qwen3", tmp_path / "qwen3", vocab_size=VOCAB)
    jax.clear_caches()  # an identical program compiled by an earlier test in this process is no compile
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "qwen3"), dtype="float32", max_batch_size=4,
                                    max_num_tokens=64, max_seq_len=128, compile_cache=False,
                                    kv_cache_config=KvCacheConfig(tokens_per_block=16, enable_block_reuse=False)))
    assert engine.token_buckets() == [16, 32, 64]
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:  # also recorded for a program read from the persistent cache
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
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

        deadline = time.monotonic() + 600
        while engine.runner.compiles_in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.bucket_compiler.ready == [16, 64]
        padded = engine.bucket_compiler.padded_steps
        later = engine.add_request(random_prompts(1, VOCAB, 3, 4, seed=3)[0], params)
        _run(engine, [later])
        assert engine.runner.steps_per_bucket[16] >= 8  # now in its own bucket, padded no more
        assert engine.bucket_compiler.padded_steps == padded
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.close()
    # Only the buckets steps needed (32 never), each compiled once, and the greedy sampler.
    assert engine.runner.num_forward_variants == 2 and engine.runner.num_sampler_variants == 1
    assert len(compiles) == 3, f"{len(compiles)} XLA compilations for 3 programs"


def test_compile_workers_must_be_positive():
    with pytest.raises(ValueError, match="compile_workers"):
        EngineConfig(model="tiny-dense", compile_workers=0)
