"""MTP speculative decoding in the engine, on a tiny DeepSeek-V3 checkpoint with a random MTP layer.

Greedy output must be token-for-token the engine's without speculation, under in-flight
batching with chunked prefill, prefix reuse, stop ids and requests of several lengths joining
while others run; nothing compiles after warm-up; every KV block goes back to the pool. The
drafts the engine proposes (which depend on the MTP layer's page pool being written at every
kept position across steps, chunks and rejections) must be the drafts of a torch composition
of transformers' DeepseekV3 layers run from scratch over the whole sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from jaxllm.sampling import SamplingParams  # noqa: E402
from jaxllm.speculative_config import MTPDecodingConfig, parse_speculative_config  # noqa: E402
from tests.mtp_helpers import torch_mtp_drafts, write_engine_checkpoint  # noqa: E402
from tests.spec_helpers import recorded_drafts  # noqa: E402

from conftest import tiny_engine  # noqa: E402

LIMITS = dict(max_batch_size=4, max_num_tokens=16, compile_ahead=False, decode_batch_sizes=[], max_kv_tokens=1024)
MTP = MTPDecodingConfig(num_nextn_predict_layers=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A DeepSeek-V3 checkpoint with one MTP layer under its published names (and the
    copies of the embedding and LM head), with the tiny-moe tokenizer."""
    directory = tmp_path_factory.mktemp("deepseek_mtp_engine")
    model, mtp = write_engine_checkpoint(directory)
    return str(directory), model, mtp


def _specs():
    """(prompt, SamplingParams fields) in arrival order, and the prefix two prompts share."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 120, 24).tolist()
    specs = [
        (rng.integers(3, 120, 5).tolist(), dict(max_tokens=14)),
        (rng.integers(3, 120, 40).tolist(), dict(max_tokens=10)),
        (shared + [5, 6], dict(max_tokens=12)),
        (rng.integers(3, 120, 9).tolist(), dict(max_tokens=3)),
        (shared + [7], dict(max_tokens=11, stop_token_ids=[15])),
        (rng.integers(3, 120, 12).tolist(), dict(max_tokens=9)),
    ]
    return specs, shared


def _workload(engine, sampled: bool = False):
    """Requests joining while others run: a 40-token prompt (chunked: 16-token budget), two
    prompts sharing 24 tokens (reused blocks), a stop id, short and long outputs. Returns
    each request's tokens by arrival order."""
    specs, _ = _specs()
    if sampled:  # the first two, sampled
        specs = [(p, dict(kw, temperature=0.8, seed=i)) for i, (p, kw) in enumerate(specs[:2])]
    results: dict[int, list[int]] = {}
    pending, steps = list(specs), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            prompt, kw = pending.pop(0)
            kw = {"temperature": 0.0, **kw}
            request = engine.add_request(prompt, SamplingParams(ignore_eos=True, **kw))
            results[request.request_id] = []
        for update in engine.step():
            results[update.request.request_id] += update.new_token_ids
        steps += 1
        assert steps < 500
    return list(results.values())


def test_vllm_and_trtllm_shapes_parse_to_the_mtp_config():
    assert parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2}') == MTP
    assert parse_speculative_config({"decoding_type": "MTP", "num_nextn_predict_layers": 2}) == MTP


def test_greedy_output_equals_the_engine_without_speculation(checkpoint):
    directory, model, mtp = checkpoint
    base = tiny_engine(directory, **LIMITS)
    try:
        expected = _workload(base)
    finally:
        base.close()
    engine = tiny_engine(directory, speculative_config=MTP, **LIMITS)
    try:
        kv = engine.kv_cache_manager
        free_at_start = kv.num_free_blocks
        engine.warmup(all_variants=False)
        spec = engine.speculation
        spec.adaptive = False  # every step drafts: the drafts are compared with torch's chain
        with recorded_drafts(engine) as (seen, compiles):
            got = _workload(engine)
        assert got == expected
        assert compiles == []
        assert spec.num_draft_tokens > 0 and spec.drafter.steps_run > 0
        # The drafts are the MTP chain's over the whole sequence (ties within 1e-4 allowed).
        # Not checked: the request whose prompt reuses the other's blocks (the MTP entry of the
        # last reused position holds the other request's next token; see the docs).
        reused = tuple(_specs()[0][4][0])
        checked = [(t, d) for t, d in seen if tuple(t[: len(reused)]) != reused]
        assert len(checked) > 20
        for tokens, drafts in checked[::4]:
            assert len(drafts) == 2
            chain = torch_mtp_drafts(model, mtp, tokens, 2)
            assert chain[0][drafts[0]] >= chain[0].max() - 1e-4, (tokens, drafts)
            if int(chain[0].argmax()) == drafts[0]:  # the second draft follows the first
                assert chain[1][drafts[1]] >= chain[1].max() - 1e-4, (tokens, drafts)
        # Sampled rows verify MTP drafts by rejection sampling; all requests finish.
        drafted = spec.num_draft_tokens
        sampled = _workload(engine, sampled=True)
        assert spec.num_draft_tokens > drafted
        assert [len(t) for t in sampled] == [14, 10]
        kv.check_invariants()
        assert kv.num_free_blocks == free_at_start
    finally:
        engine.close()
