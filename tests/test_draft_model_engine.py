"""Speculative decoding with a draft model (`DraftTargetDecodingConfig`) against the engine without it.

Greedy output must be token-for-token the output without speculation (the workload of
tests/test_speculative_decoding.py: in-flight batching, chunked prefill, prefix reuse, stops,
min/max tokens, logprobs, a request with a penalty that never drafts), with a different tiny
random model of the same vocabulary as the draft and with the target as its own draft, where
greedy drafts must nearly all be accepted (a draft model whose KV cache were written at wrong
positions would not be). Nothing compiles after warm-up; every block goes back to the pool.
"""

from __future__ import annotations

import jax
import pytest
from test_speculative_decoding import COMPILE_EVENT, LIMITS, _assert_same, _workload

from jaxllm.bench.tiny_mtp import tiny_deepseek_mtp
from jaxllm.models import materialize_preset
from jaxllm.speculative_config import DraftTargetDecodingConfig, parse_speculative_config

from conftest import tiny_engine


def _config(preset: str, k: int = 3) -> DraftTargetDecodingConfig:
    return DraftTargetDecodingConfig(max_draft_len=k, speculative_model_dir=str(materialize_preset(preset)))


@pytest.fixture(scope="module")
def reference():
    engine = tiny_engine(**LIMITS)
    try:
        return _workload(engine)[0]
    finally:
        engine.close()


def test_cli_shape_and_a_draft_of_another_vocabulary_is_refused():
    parsed = parse_speculative_config('{"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-dense"}')
    assert parsed == DraftTargetDecodingConfig(max_draft_len=2, speculative_model_dir="tiny-dense")
    other = DraftTargetDecodingConfig(max_draft_len=2, speculative_model_dir=str(tiny_deepseek_mtp()))
    with pytest.raises(ValueError, match="DraftTargetDecodingConfig.speculative_model_dir: the draft model's vocab"):
        tiny_engine(speculative_config=other, **LIMITS)


def test_the_target_as_its_own_draft_is_accepted_and_compiles_nothing_after_warmup(reference):
    engine = tiny_engine(speculative_config=_config("tiny-moe"), **LIMITS)
    try:
        kv = engine.kv_cache_manager
        free_at_start = kv.num_free_blocks
        engine.warmup(all_variants=False)
        spec = engine.speculation
        spec.adaptive = False  # every step drafts (on a CPU the draft model's steps do not pay)
        compiles = []

        def listener(event, duration, **kwargs):
            if event == COMPILE_EVENT:
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            got, _ = _workload(engine, plain=True)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == []
        _assert_same([(p, t, []) for p, t, _ in got], [(p, t, []) for p, t, _ in reference], skip=(2,))
        assert spec.num_draft_tokens > 50
        assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, (
            spec.num_accepted_tokens,
            spec.num_draft_tokens,
        )
        kv.check_invariants()
        assert kv.num_free_blocks == free_at_start
    finally:
        engine.close()


def test_another_model_drafting_keeps_the_greedy_output(reference):
    engine = tiny_engine(speculative_config=_config("tiny-dense", k=2), **LIMITS)
    engine.speculation.adaptive = False
    try:
        got, _ = _workload(engine)
        _assert_same(got, reference)
        assert engine.speculation.num_draft_tokens > 0
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        engine.close()


def test_a_drafter_that_never_matches_stops_drafting_and_running(reference):
    """Adaptive fallback of a drafter: every draft is wrong (one more than the token the
    engine without speculation produced there), so each request stops drafting once its
    acceptance estimate falls below the threshold (three rejected rows from the prior), and
    the draft model's program then stops running too (it still runs over prompt chunks). The
    output stays the engine's without speculation. The step-cost half of the policy is held
    to 'worth it' so the test does not depend on timings."""
    engine = tiny_engine(speculative_config=_config("tiny-dense", k=2), **LIMITS)
    try:
        spec, vocab = engine.speculation, engine.model_config.vocab_size
        assert spec.adaptive
        spec.policy.worth_it = lambda *args, **kwargs: True
        full = [list(prompt) + list(tokens) for prompt, tokens, _ in reference]
        drafter = spec.drafter
        real = drafter.propose

        def never_matching(rid, tokens, max_len=None):
            real(rid, tokens, max_len)  # what the draft model proposed, discarded
            tokens = list(tokens)
            (want,) = [f for f in full if f[: len(tokens)] == tokens]
            following = want[len(tokens) :] + [0] * 4
            return [(t + 1) % vocab for t in following[: max_len or 2]]

        drafter.propose = never_matching
        runs: list[int] = []
        original_begin = drafter.begin_step

        def counting_begin():
            runs.append(engine.iteration)
            return original_begin()

        drafter.begin_step = counting_begin
        got, steps = _workload(engine)
        _assert_same(got, reference)
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == 0
        # Six requests may draft (one has a penalty); each verifies at most three rows.
        assert 0 < spec.num_verified_rows <= 3 * 6
        assert runs and max(runs) < steps - 8, (runs, steps)
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        engine.close()
