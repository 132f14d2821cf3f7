"""Speculative sampling keeps the target distribution.

The verification program alone, against numpy's softmax of the target logits; and the engine:
on one prompt, the empirical distributions of the tokens that verification emits, with drafts
and without, agree under a chi-square test, while a deliberately wrong acceptance rule (accept
too often) fails the same test.
"""

from __future__ import annotations

import jax
import numpy as np
from scipy.stats import chi2_contingency

from jaxllm.engine.speculation import Speculation
from jaxllm.sampling import SamplingParams
from jaxllm.speculative_config import NGramDecodingConfig

from conftest import tiny_engine

NGRAM = NGramDecodingConfig(max_draft_len=4, max_matching_ngram_size=3)


class FixedProposer:
    """Drafts the same tokens after every text: the draft is a point mass."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft

    def propose(self, request_id, tokens, max_len=None):
        return list(self.draft)[: max_len or len(self.draft)]

    def request_ids(self):
        return []

    def release(self, request_id):
        pass


def _samples(engine, n: int = 600, length: int = 4) -> list[tuple[int, ...]]:
    """The first `length` tokens of `n` seeded samples of one prompt (top-k 4 keeps the
    support small)."""
    prompt = [11, 12, 13, 14, 15, 16]
    requests = []
    for seed in range(n):
        params = SamplingParams(temperature=1.3, top_k=4, seed=seed, max_tokens=length, ignore_eos=True)
        requests.append(engine.add_request(prompt, params))
    while engine.has_unfinished_requests():
        engine.step()
    return [tuple(r.output_token_ids) for r in requests]


def _contingency(a, b):
    keys = sorted(set(a) | set(b))
    return np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])


def test_sampled_distribution_is_kept_and_a_wrong_rule_is_caught():
    """Tokens 1 and 2 come from verification (token 0 from the prompt's step): their
    marginal distributions with and without drafts agree; accepting too often is caught.
    Without drafts a step samples with the engine's ordinary sampler."""
    engine = tiny_engine(
        speculative_config=NGRAM, max_batch_size=16, max_num_tokens=64, compile_ahead=False, decode_batch_sizes=[]
    )
    try:
        spec: Speculation = engine.speculation
        spec.adaptive = False
        spec.proposer = FixedProposer([])
        plain = _samples(engine)
        assert spec.num_draft_tokens == 0
        # Draft each position's most frequent token: often right, often wrong.
        columns = [[s[i] for s in plain] for i in (1, 2)]
        spec.proposer = FixedProposer([max(set(c), key=c.count) for c in columns])
        drafted = _samples(engine)
        assert spec.num_accepted_tokens > 150 and spec.num_draft_tokens - spec.num_accepted_tokens > 150
        assert drafted != plain  # other draws, the same distribution
        for i in (1, 2):
            p_value = chi2_contingency(_contingency(columns[i - 1], [s[i] for s in drafted]))[1]
            assert p_value > 0.01, (i, p_value)
        spec.acceptance_rule = lambda u, p: u < 0.9  # accepts too often
        wrong = _samples(engine)
        assert chi2_contingency(_contingency(columns[0], [s[1] for s in wrong]))[1] < 1e-4
    finally:
        engine.close()


def test_verifier_keeps_the_target_distribution_against_softmax():
    """The verification program alone, many seeds at once: the emitted token's frequencies
    match numpy's softmax of the target logits, for a draft of high and of low probability."""
    from jaxllm.sampling import SamplingTensors
    from jaxllm.sampling.rejection import verify_drafts

    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 0.3], np.float32)
    target = np.exp(logits) / np.exp(logits).sum()
    n = 8000
    t = SamplingTensors.build(
        [SamplingParams(temperature=1.0, seed=s) for s in range(n)], [0] * n, None, [()] * n, n, 8
    )
    for draft in (0, 4):
        out = jax.jit(verify_drafts)(np.tile(logits, (n, 1)), t, np.full(n, draft, np.int32))
        counts = np.bincount(np.asarray(out.token_ids), minlength=6)
        assert chi2_contingency(np.array([counts, np.round(target * n)]))[1] > 0.01
        accepted = np.asarray(out.accepted)
        assert abs(accepted.mean() - target[draft]) < 0.02
        biased = jax.jit(lambda lg, tt, d: verify_drafts(lg, tt, d, acceptance_rule=lambda u, p: u < 0.9))
        counts = np.bincount(np.asarray(biased(np.tile(logits, (n, 1)), t, np.full(n, draft, np.int32)).token_ids))
        assert chi2_contingency(np.array([counts, np.round(target * n)]))[1] < 1e-6


def test_entry_penalties_see_the_drafts_before_them_as_sampling_after_them_would():
    """A verification entry of a row with penalties carries the penalty settings and the token
    history that `SamplingTensors.build` gives the same row once the drafts before the entry
    are its outputs (the tensors sampling without speculation would use at that index)."""
    from jaxllm.sampling import SamplingTensors
    from jaxllm.sampling.rejection import entry_tensors

    prompt, output, drafts = [5, 6, 7], [8, 9], [9, 11, 12]
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(temperature=0.0),
    ]
    rows = SamplingTensors.build(params, [2, 1], [(prompt, output), ([3], [4])], [[0], [0]], 2, 16)
    entries = entry_tensors(rows, np.array([0, 0, 0, 0, 1]), np.array([2, 3, 4, 5, 1], np.int32), [
        drafts[:j] for j in range(4)
    ] + [[]])  # fmt: skip
    for j in range(4):
        after = SamplingTensors.build(params[:1], [2 + j], [(prompt, output + drafts[:j])], [[0]], 1, 16)
        for name in ("history_ids", "history_is_output", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            np.testing.assert_array_equal(np.asarray(getattr(entries, name))[j], np.asarray(getattr(after, name))[0])
    assert entries.use_penalties
    assert entries.repetition_penalty[4] == 1.0 and entries.presence_penalty[4] == 0.0  # the row without
