"""Speculative decoding statistics against what the engine emitted: per request (LlmRequest
counts, `CompletionOutput.speculative_decoding`), per iteration (TensorRT-LLM's
`specDecodingStats`) and on /metrics (vLLM's `spec_decode_*` counters).

The oracle for accepted drafts is the update stream: every step a request takes part in emits
one token plus the drafts it accepted, so accepted = tokens emitted - updates received."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm import LLM, KvCacheConfig, NGramDecodingConfig, SamplingParams
from jaxllm.server.server_metrics import ServerMetrics

from conftest import tiny_engine

NGRAM = NGramDecodingConfig(max_draft_len=4, max_matching_ngram_size=3)
LIMITS = dict(max_batch_size=4, max_num_tokens=32, compile_ahead=False, decode_batch_sizes=[])
PROMPTS = [[40 + (i % 6) for i in range(36)], [90, 91, 92, 93] * 6, list(range(100, 130))]


def test_accepted_drafts_equal_tokens_emitted_less_steps_taken():
    engine = tiny_engine(speculative_config=NGRAM, **LIMITS)
    try:
        spec = engine.speculation
        spec.adaptive = False  # draft whenever the n-gram matches
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)
        requests = [engine.add_request(p, params) for p in PROMPTS]
        tokens = {r.request_id: 0 for r in requests}
        updates = {r.request_id: 0 for r in requests}
        while engine.has_unfinished_requests():
            for update in engine.step():
                if update.new_token_ids:
                    tokens[update.request.request_id] += len(update.new_token_ids)
                    updates[update.request.request_id] += 1
        for r in requests:
            assert tokens[r.request_id] == 30
            assert r.num_accepted_draft_tokens == tokens[r.request_id] - updates[r.request_id]
            assert r.num_accepted_draft_tokens <= r.num_draft_tokens
        assert spec.num_accepted_tokens == sum(r.num_accepted_draft_tokens for r in requests) > 0
        assert spec.num_draft_tokens == sum(r.num_draft_tokens for r in requests)
        per_pos = spec.num_accepted_per_pos
        assert sum(per_pos) == spec.num_accepted_tokens
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
        stats = [s["specDecodingStats"] for s in engine.iteration_stats]
        assert len(stats) == engine.iteration  # every iteration of a speculating engine has them
        assert sum(s["numAcceptedTokens"] for s in stats) == spec.num_accepted_tokens
        assert sum(s["numDraftTokens"] for s in stats) == spec.num_draft_tokens
        assert sum(s["numRequestsWithDraftTokens"] for s in stats) == spec.num_verified_rows
        for s in stats:
            rows = s["numRequestsWithDraftTokens"]
            if rows:
                assert s["acceptanceLength"] == (s["numAcceptedTokens"] + rows) / rows
            assert s["iterLatencyMS"] >= 0 and 0 <= s["draftOverhead"] <= 1
    finally:
        engine.close()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_request_outputs_and_prometheus_counters_match_the_engine():
    pytest.importorskip("httpx")
    llm = LLM(
        "tiny-moe",
        speculative_config=NGRAM,
        warmup="none",
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
        max_seq_len=128,
        **LIMITS,
    )
    try:
        llm.engine.speculation.adaptive = False
        metrics = ServerMetrics(llm.executor, "tiny-moe")
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24), use_tqdm=False)
        spec = llm.engine.speculation
        drafted = [o.outputs[0].speculative_decoding for o in outputs]
        assert spec.num_accepted_tokens > 0
        assert sum(d.total_draft_tokens for d in drafted if d) == spec.num_draft_tokens
        assert sum(d.total_accepted_draft_tokens for d in drafted if d) == spec.num_accepted_tokens
        for d in drafted:
            if d:
                assert d.acceptance_rate == d.total_accepted_draft_tokens / d.total_draft_tokens
        for _ in range(2):  # a second scrape counts nothing twice
            samples = _samples(metrics.render().decode())
            assert samples[("jaxllm:spec_decode_num_drafts_total", ())] == spec.num_verified_rows
            assert samples[("jaxllm:spec_decode_num_draft_tokens_total", ())] == spec.num_draft_tokens
            assert samples[("jaxllm:spec_decode_num_accepted_tokens_total", ())] == spec.num_accepted_tokens
            for position, value in enumerate(spec.num_accepted_per_pos):
                key = ("jaxllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(position)),))
                assert samples[key] == value
    finally:
        llm.shutdown()
