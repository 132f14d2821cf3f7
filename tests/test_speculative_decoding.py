"""Speculative decoding (n-gram drafts) against the engine without it.

Greedy output must be token-for-token the output without speculation, under in-flight
batching with chunked prefill, prefix reuse, stops, min/max tokens, logprobs and requests
that do not draft, with the n-gram proposer and with a proposer that drafts the reference
continuation with a wrong token in it (so long runs are accepted and rejected). Nothing
compiles after warm-up, and every KV block is back in the pool once all requests finished.
Sampled output: tests/test_speculative_sampling.py.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxllm.engine.speculation import Speculation
from jaxllm.sampling import SamplingParams
from jaxllm.spec_decode import NGramProposer
from jaxllm.speculative_config import (
    DraftTargetDecodingConfig,
    EagleDecodingConfig,
    MTPDecodingConfig,
    NGramDecodingConfig,
    parse_speculative_config,
)

from conftest import tiny_engine

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
NGRAM = NGramDecodingConfig(max_draft_len=4, max_matching_ngram_size=3)
LIMITS = dict(max_batch_size=8, max_num_tokens=32, compile_ahead=False, decode_batch_sizes=[])


# ---------------------------------------------------------------------- configs
def test_configs_parse_from_trtllm_and_vllm_shapes():
    assert parse_speculative_config({"decoding_type": "NGram", "max_draft_len": 3}) == NGramDecodingConfig(
        max_draft_len=3
    )
    assert parse_speculative_config(
        json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2})
    ) == NGramDecodingConfig(max_draft_len=5, max_matching_ngram_size=2)
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2}) == MTPDecodingConfig(
        num_nextn_predict_layers=2
    )
    assert parse_speculative_config({"method": "eagle3", "num_speculative_tokens": 3, "model": "/m"}) == (
        EagleDecodingConfig(max_draft_len=3, speculative_model_dir="/m")
    )
    for bad, field in [
        ({"decoding_type": "NGram", "max_draft_len": 0}, "max_draft_len"),
        ({"decoding_type": "Medusa"}, "decoding_type"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ({"decoding_type": "NGram", "is_public_pool": "yes"}, "is_public_pool"),
        ({"decoding_type": "DraftTarget", "max_draft_len": 2}, "speculative_model_dir"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(ValueError, match=field):
            parse_speculative_config(bad)


def test_yaml_and_cli_flag_reach_the_engine_config(tmp_path):
    import argparse

    from jaxllm.cli.args import add_engine_args, engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineConfig(model="tiny-moe", **engine_kwargs(args)).speculative_config == NGramDecodingConfig(3)
    path = tmp_path / "extra.yaml"
    path.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n  is_public_pool: true\n")
    args = parser.parse_args(["--extra_llm_api_options", str(path)])
    config = EngineConfig(model="tiny-moe", **engine_kwargs(args)).speculative_config
    assert config == NGramDecodingConfig(max_draft_len=2, is_public_pool=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "medusa"}'])


def test_invalid_methods_fail_at_engine_build():
    with pytest.raises(ValueError, match="EagleDecodingConfig.speculative_model_dir: cannot use 'x'"):
        tiny_engine(speculative_config=EagleDecodingConfig(max_draft_len=2, speculative_model_dir="x"))
    with pytest.raises(ValueError, match="DraftTargetDecodingConfig.speculative_model_dir: cannot load 'x'"):
        tiny_engine(speculative_config=DraftTargetDecodingConfig(max_draft_len=2, speculative_model_dir="x"))
    with pytest.raises(ValueError, match="MTPDecodingConfig needs a checkpoint with multi-token-prediction layers"):
        tiny_engine(speculative_config=MTPDecodingConfig(num_nextn_predict_layers=1))
    with pytest.raises(ValueError, match="speculative_config is not supported with cache_transceiver_config"):
        tiny_engine(speculative_config=NGRAM, cache_transceiver_config={"backend": "TCP"})


# ---------------------------------------------------------------------- proposer
def test_ngram_proposer_matches_the_longest_suffix():
    proposer = NGramProposer(NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2))
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 7, 2, 3]
    # The suffix [2, 3] occurred at 1 (oldest, followed by 4 5 9) and at 6 (followed by 7 7 2).
    assert proposer.propose(0, text) == [4, 5, 9]
    newest = NGramProposer(NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2, is_use_oldest=False))
    assert newest.propose(0, text) == [7, 7, 2]
    assert proposer.propose(0, text + [8]) == []  # 8 never occurred before
    assert proposer.propose(0, text + [8, 5], max_len=1) == [9]  # unigram 5 -> 9
    pool = NGramProposer(NGramDecodingConfig(max_draft_len=2, max_matching_ngram_size=2, is_public_pool=True))
    pool.propose(0, [10, 11, 12, 13, 14])
    assert pool.propose(1, [99, 11, 12]) == [13, 14]  # drafted from request 0's text
    assert NGramProposer(NGramDecodingConfig(max_draft_len=2)).propose(1, [99, 11, 12]) == []


# ---------------------------------------------------------------------- engine helpers
class ReferenceProposer:
    """Drafts the reference continuation of a request with every third draft run wrong in
    its last token (so runs are accepted in full, in part, and not at all)."""

    def __init__(self, references: list[list[int]]) -> None:
        self.references = references
        self.calls = 0

    def propose(self, request_id, tokens, max_len=None):
        self.calls += 1
        k = 4 if max_len is None else max_len
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == list(tokens):
                draft = list(ref[len(tokens) : len(tokens) + k])
                if draft and self.calls % 3 == 0:
                    draft[-1] = (draft[-1] + 1) % 300
                return draft
        return [7, 7][:k]

    def request_ids(self):
        return []

    def release(self, request_id):
        pass


def _workload(engine, plain: bool = False):
    """Requests joining while others run: long prompts (chunked prefill: 32-token budget),
    a shared prefix (reused KV blocks), repeated text (n-gram drafts), stop ids, min_tokens,
    logprobs, and a request with a repetition penalty (its verification applies the penalty
    over its history and the drafts before each entry); `plain`: without logprobs
    and penalty (the programs of greedy steps only). Returns each request's (prompt, tokens,
    logprobs) by arrival order, and the number of steps."""
    rng = np.random.default_rng(3)
    phrase = rng.integers(3, 300, 6).tolist()
    shared = rng.integers(3, 300, 40).tolist()
    specs = [
        (phrase * 8, dict(max_tokens=30)),
        (shared + [5, 6], dict(max_tokens=24, logprobs=2)),
        (rng.integers(3, 300, 9).tolist(), dict(max_tokens=20, repetition_penalty=1.3)),
        (shared + [7, 8, 9], dict(max_tokens=26)),
        (phrase * 3 + [1, 2], dict(max_tokens=28, min_tokens=10, stop_token_ids=[phrase[2]])),
        (rng.integers(3, 300, 70).tolist(), dict(max_tokens=18)),
        (phrase * 5, dict(max_tokens=9, stop_token_ids=[phrase[4]])),
    ]
    if plain:
        specs = [(p, {k: v for k, v in kw.items() if k not in ("logprobs", "repetition_penalty")}) for p, kw in specs]
    results: dict[int, list] = {}
    prompts = {}
    order = []
    pending = list(specs)
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            prompt, kw = pending.pop(0)
            request = engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, **kw))
            order.append(request.request_id)
            prompts[request.request_id] = list(prompt)
            results[request.request_id] = [[], []]
        for update in engine.step():
            entry = results[update.request.request_id]
            entry[0] += update.new_token_ids
            entry[1] += [lp[token].logprob for token, lp in zip(update.new_token_ids, update.new_logprobs)]
        steps += 1
        assert steps < 2000
    return [(prompts[rid], results[rid][0], results[rid][1]) for rid in order], steps


def _assert_same(got, expected, skip=()):
    """Same tokens; the logprobs of the same tokens agree (computed in other batch shapes)."""
    for i, ((_, tokens, lps), (_, want_tokens, want_lps)) in enumerate(zip(got, expected, strict=True)):
        if i in skip:
            continue
        assert tokens == want_tokens, i
        np.testing.assert_allclose(lps, want_lps, atol=1e-4)


@pytest.fixture(scope="module")
def reference():
    engine = tiny_engine(**LIMITS)
    try:
        return _workload(engine)
    finally:
        engine.close()


def test_greedy_output_equals_the_engine_without_speculation(reference):
    expected, plain_steps = reference
    assert len(expected[1][2]) == len(expected[1][1]) > 0  # the logprobs request got them
    engine = tiny_engine(speculative_config=NGRAM, **LIMITS)
    try:
        kv = engine.kv_cache_manager
        free_at_start = kv.num_free_blocks
        spec: Speculation = engine.speculation
        spec.adaptive = False
        got, _ = _workload(engine)
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
        _assert_same(got, expected)
        # Drafts from the reference continuation, one run in three with a wrong token (the
        # prompts' blocks are now cached too: the requests reuse them).
        spec.proposer = ReferenceProposer([prompt + tokens for prompt, tokens, _ in expected])
        drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
        proposed_for: list[list[int]] = []
        reference_propose = spec.proposer.propose
        spec.proposer.propose = lambda rid, tokens, max_len=None: (
            proposed_for.append(list(tokens)) or reference_propose(rid, tokens, max_len)
        )
        got, spec_steps = _workload(engine)
        assert 40 < spec.num_accepted_tokens - accepted < spec.num_draft_tokens - drafted
        _assert_same(got, expected)
        penalized = expected[2][0]  # the repetition-penalty request drafted too
        assert any(tokens[: len(penalized)] == penalized for tokens in proposed_for)
        assert spec_steps < plain_steps
        # Adaptive drafting: plain steps overlapped, a read-back before each drafting step.
        spec.adaptive = True
        got, _ = _workload(engine)
        _assert_same(got, expected)
        stats = [s["specDecodingStats"] for s in engine.iteration_stats if "specDecodingStats" in s]
        assert stats and max(s["acceptanceLength"] for s in stats) > 2
        kv.check_invariants()
        assert kv.num_free_blocks == free_at_start
    finally:
        engine.close()


def test_nothing_compiles_after_warmup_whatever_the_draft_lengths(reference):
    """Greedy steps with every draft length 0..4 in every token bucket, beside chunked
    prompts, compile nothing once the engine is warmed up."""
    expected, _ = reference
    engine = tiny_engine(speculative_config=NGRAM, **LIMITS)
    try:
        engine.warmup(all_variants=False)
        spec: Speculation = engine.speculation
        spec.adaptive = False
        proposer = ReferenceProposer([prompt + tokens for prompt, tokens, _ in expected])
        lengths = iter(range(10**6))
        spec.proposer = proposer
        original = proposer.propose
        proposer.propose = lambda rid, tokens, max_len=None: original(rid, tokens, min(max_len or 4, next(lengths) % 5))
        compiles = []

        def listener(event, duration, **kwargs):
            if event == COMPILE_EVENT:
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            got, _ = _workload(engine, plain=True)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert spec.num_draft_tokens > 0
        assert compiles == []
        _assert_same([(p, t, []) for p, t, _ in got], [(p, t, []) for p, t, _ in expected], skip=(2,))
    finally:
        engine.close()
