"""Speculative decoding through the LLM API, against the same API without it: stop strings
that fall inside an accepted run, streaming (several tokens per step), abort, and the
iteration statistics."""

from __future__ import annotations

import pytest

from jaxllm import LLM, KvCacheConfig, NGramDecodingConfig, SamplingParams

LIMITS = dict(
    max_batch_size=8,
    max_num_tokens=32,
    max_seq_len=160,
    decode_batch_sizes=[],
    compile_ahead=False,
    warmup="none",
    kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
)
PROMPTS = [[40 + (i % 6) for i in range(36)], [90, 91, 92, 93] * 6, list(range(100, 130))]


@pytest.fixture(scope="module")
def llms():
    plain = LLM("tiny-moe", **LIMITS)
    spec = LLM("tiny-moe", speculative_config=NGramDecodingConfig(max_draft_len=4), **LIMITS)
    spec.engine.speculation.adaptive = False  # draft whenever a match exists
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def _outputs(llm, params):
    return [
        (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate(PROMPTS, params, use_tqdm=False)
    ]


def test_text_and_stop_strings_match_the_plain_engine(llms):
    plain, spec = llms
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = _outputs(plain, params)
    assert _outputs(spec, params) == expected
    assert spec.engine.speculation.num_accepted_tokens > 0
    # Stop strings taken from the middle of each reference text: some land inside accepted runs.
    stops = [text[len(text) // 2 : len(text) // 2 + 3] for text, _, _ in expected if len(text) > 8]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=stops)
    stopped = _outputs(plain, params)
    assert any(reason == "stop" for _, _, reason in stopped)
    assert _outputs(spec, params) == stopped


def test_streaming_delivers_several_tokens_per_step_and_abort_frees_blocks(llms):
    plain, spec = llms
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = plain.generate(PROMPTS[1], params, use_tqdm=False).outputs[0].token_ids
    pieces = [list(out.outputs[0].token_ids_diff) for out in spec.generate_async(PROMPTS[1], params, streaming=True)]
    assert sum(pieces, []) == expected
    assert max(map(len, pieces)) > 1  # a step emitted an accepted run

    stats = [s for s in spec.get_stats() if "specDecodingStats" in s]
    assert stats and all(
        s["specDecodingStats"]["numDraftTokens"] >= s["specDecodingStats"]["numAcceptedTokens"] for s in stats
    )

    engine = spec.engine
    free = engine.kv_cache_manager.num_free_blocks
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    result = spec.generate_async(PROMPTS[0], long, streaming=True)
    for out in result:
        if len(out.outputs[0].token_ids) >= 10:
            result.abort()
            break
    final = result.result(timeout=60)
    assert final.outputs[0].finish_reason == "cancelled"
    assert len(final.outputs[0].token_ids) < 120
    # The engine is idle again: every block is back.
    spec.generate(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert engine.kv_cache_manager.num_free_blocks == free
