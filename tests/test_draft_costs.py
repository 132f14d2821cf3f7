"""The adaptive policy charges a drafter's own costs (its drafting program and its runs over
prompt chunks) to the drafting decision.

The target (tiny-moe) drafts for itself, so nearly every draft is accepted and each drafting
step emits close to 1 + k tokens. Step and drafter times are fixed numbers fed to the policy in
place of the measured ones (nothing here depends on how fast this machine is): a plain step
1.0 s, a verifying step 1.2 s. With a cheap drafter drafting pays and the drafter keeps running
over new prompts; with a costly drafting program or costly prompt runs it does not, so the
engine stops drafting and stops running the draft model over prompts. The greedy output is
the engine's without speculation either way.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative_decoding import LIMITS

from jaxllm.models import materialize_preset
from jaxllm.sampling import SamplingParams
from jaxllm.speculative_config import DraftTargetDecodingConfig

from conftest import tiny_engine

PLAIN_STEP, VERIFY_STEP = 1.0, 1.2


def _phases() -> list[list[list[int]]]:
    rng = np.random.default_rng(7)
    return [[rng.integers(3, 300, n).tolist() for n in (40, 20)] for _ in range(3)]


def _run(engine, phases, on_phase=None) -> list[list[int]]:
    """Each phase's requests run to completion before the next phase's arrive."""
    outputs = []
    for i, prompts in enumerate(phases):
        if on_phase is not None:
            on_phase(i)
        requests = [
            engine.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)) for p in prompts
        ]
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            assert steps < 500
        outputs += [list(r.output_token_ids) for r in requests]
    return outputs


@pytest.fixture(scope="module")
def reference():
    engine = tiny_engine(**LIMITS)
    try:
        return _run(engine, _phases())
    finally:
        engine.close()


@pytest.mark.parametrize(
    "prompt_run, drafting_program, pays",
    [(0.01, 0.5, True), (0.01, 10.0, False), (100.0, 0.5, False)],
    ids=["cheap drafter", "costly drafting program", "costly prompt runs"],
)
def test_a_drafter_that_costs_more_than_it_gains_stops_drafting_and_its_prompt_runs(
    reference, prompt_run, drafting_program, pays
):
    config = DraftTargetDecodingConfig(max_draft_len=3, speculative_model_dir=str(materialize_preset("tiny-moe")))
    engine = tiny_engine(speculative_config=config, **LIMITS)
    try:
        spec = engine.speculation
        policy, drafter = spec.policy, spec.drafter
        assert spec.adaptive
        phase = [0]
        prompt_runs, drafts = [0, 0, 0], [0, 0, 0]  # per phase

        def on_phase(i):
            phase[0] = i

        real_begin = drafter.begin_step

        def timed_begin():
            context = drafter.pending_context
            real_begin()
            prompt_runs[phase[0]] += context
            return prompt_run if context else drafting_program

        drafter.begin_step = timed_begin
        kind = [None]
        real_planned, real_observe = policy.planned, policy.observe

        def planned(k, tokens, rows):
            kind[0] = k
            real_planned(k, tokens, rows)

        def observe(seconds):
            real_observe(VERIFY_STEP if kind[0] == "spec" else PLAIN_STEP)
            kind[0] = None

        policy.planned, policy.observe = planned, observe
        real_verified = policy.verified

        def verified(rid, accepted, drafted):
            drafts[phase[0]] += drafted
            real_verified(rid, accepted, drafted)

        policy.verified = verified
        got = _run(engine, _phases(), on_phase)
        assert got == reference
        assert spec.num_accepted_tokens >= 0.5 * spec.num_draft_tokens > 0  # most drafts are good
        assert prompt_runs[0] > 0
        if pays:
            assert prompt_runs[2] > 0 and drafts[2] > 0, (prompt_runs, drafts)
        else:
            assert prompt_runs[1:] == [0, 0] and drafts[1:] == [0, 0], (prompt_runs, drafts)
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        engine.close()
