"""Speculative decoding in the engine under tensor and expert parallelism (8 fake CPU devices,
in a subprocess; see tests/multidevice.py), on the tiny DeepSeek-V3 with an MTP layer
(tests/mtp_helpers.py): greedy output is token-for-token the single-device engine's without
speculation

- with n-gram drafts at TP 2 (its greedy outputs fall into loops, which the drafts follow:
  runs of several drafts are accepted), and
- with MTP drafts at TP 2, at TP 2 with EP 2 (the experts dispatched to the rank owning
  each) and at EP 2 with the online expert load balancer moving slots meanwhile; the drafts
  proposed there are the MTP chain of a torch composition of transformers' DeepseekV3 layers
  run from scratch over each sequence.

Requests join while others run, a long prompt is chunked (16-token budget), so verification
rows share steps with context chunks and plain decode rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

MAX_TOKENS = [20, 10, 18, 8]
PARALLEL = {"tp2": dict(tensor_parallel_size=2), "ep2": dict(tensor_parallel_size=2, moe_expert_parallel_size=2)}
# EP 2 with the online expert load balancer rewriting slots in place while MTP drafts (20 slots
# for 16 experts; every step a layer may move, whatever the gain).
PARALLEL["ep2-eplb"] = PARALLEL["ep2"]
RUNS = [
    ("base", None, "one"),
    ("ngram", "ngram", "tp2"),
    ("mtp", "mtp", "tp2"),
    ("mtp", "mtp", "ep2"),
    ("mtp", "mtp", "ep2-eplb"),
]


def _prompts(vocab: int) -> list[list[int]]:
    """In arrival order: a 4-token phrase repeated, a long prompt (chunked), another
    repeated phrase, a short prompt."""
    import numpy as np

    rng = np.random.default_rng(0)
    phrases = [[int(t) for t in rng.integers(3, vocab, 4)] for _ in range(7)]
    return [phrases[2] * 4, [int(t) for t in rng.integers(3, vocab, 37)], phrases[6] * 4, phrases[0][:3] + [5, 6, 7]]


def _run(engine) -> dict:
    """Greedy tokens per arrival, a request joining every second step; with speculation,
    every step drafts (no timing-based fallback), and each proposal comes back with the
    tokens it followed."""
    from jaxllm import SamplingParams

    spec = engine.speculation
    proposals: list[tuple[list[int], list[int]]] = []
    if spec is not None:
        spec.adaptive = False
        propose = spec.proposer.propose

        def recording(rid, tokens, max_len=None):
            proposals.append((list(tokens), list(propose(rid, tokens, max_len))))
            return proposals[-1][1]

        spec.proposer.propose = recording
    pending = list(zip(_prompts(engine.model_config.vocab_size), MAX_TOKENS))
    results: dict[int, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            prompt, max_tokens = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            results[engine.add_request(prompt, params).request_id] = []
        for update in engine.step():
            results[update.request.request_id] += update.new_token_ids
        steps += 1
        assert steps < 400
    engine.kv_cache_manager.check_invariants()
    out = dict(tokens=list(results.values()), steps=steps)
    if spec is not None:
        out.update(proposals=proposals, drafted=spec.num_draft_tokens, accepted=spec.num_accepted_tokens)
    return out


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    from jaxllm.llm_args import MoeConfig
    from jaxllm.speculative_config import MTPDecodingConfig, NGramDecodingConfig
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from tests.spec_helpers import small_spec_engine

    assert len(jax.devices()) == 8
    methods = {
        None: None,
        "ngram": NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2),
        "mtp": MTPDecodingConfig(num_nextn_predict_layers=2),
    }
    balancer = MoeLoadBalancerConfig(num_slots=20, layer_updates_per_iter=1, min_imbalance_gain=-1.0)
    for name, method, layout in RUNS:
        extra = dict(moe_config=MoeConfig(load_balancer=balancer)) if layout == "ep2-eplb" else {}
        engine = small_spec_engine(str(root / "ds"), methods[method], **PARALLEL.get(layout, {}), **extra)
        try:
            result = _run(engine)
            if engine.load_balancer is not None:
                result["slots_rewritten"] = engine.load_balancer.stats.slots_rewritten
        finally:
            engine.close()
        print(json.dumps(dict(name=name, layout=layout, **result)), flush=True)


def test_speculative_greedy_output_under_tp_and_ep_equals_one_device_without_speculation(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.mtp_helpers import torch_mtp_drafts, write_engine_checkpoint

    (tmp_path / "ds").mkdir()
    model, mtp = write_engine_checkpoint(tmp_path / "ds")
    results = run_on_cpu_devices("test_speculative_parallel", "check_all", tmp_path, xla_flags=FAST_COMPILE)
    assert [(r["name"], r["layout"]) for r in results] == [(name, layout) for name, _, layout in RUNS]
    base, *speculative = results
    assert [len(t) for t in base["tokens"]] == MAX_TOKENS
    for r in speculative:
        case = f"{r['name']} at {r['layout']}"
        assert r["tokens"] == base["tokens"], f"{case}: tokens differ from one device without speculation"
        assert r["drafted"] > 0, f"{case}: nothing was drafted"
    ngram = speculative[0]
    assert ngram["accepted"] >= 10, f"n-gram at TP 2 accepted only {ngram['accepted']} drafts"
    assert ngram["steps"] < base["steps"]
    # The MTP drafts under TP and EP are the torch chain's (ties within 1e-4 allowed; the
    # second draft is checked where the first is the chain's argmax).
    assert speculative[-1]["slots_rewritten"] > 0, "the balancer moved no slot"
    for r in speculative[1:]:
        drafted = [(tokens, drafts) for tokens, drafts in r["proposals"] if drafts]
        assert len(drafted) > 20, r["layout"]
        for tokens, drafts in drafted[::3]:
            chain = torch_mtp_drafts(model, mtp, tokens, 2)
            assert chain[0][drafts[0]] >= chain[0].max() - 1e-4, (r["layout"], tokens, drafts)
            if len(drafts) > 1 and int(chain[0].argmax()) == drafts[0]:
                assert chain[1][drafts[1]] >= chain[1].max() - 1e-4, (r["layout"], tokens, drafts)
