"""A step in a token bucket samples only its live rows (`Planner.sampler_rows`): the sampler
runs over the smallest sampler row count holding the step's requests instead of
max_batch_size rows. Its tokens and logprobs are those of the engine sampling every row (the
same engine with `sampler_row_sizes` cleared), for every sampling setting, and padding tensors
to more rows (`SamplingTensors.padded`, the fallback while a row count's sampler is not
compiled) changes no row's token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from test_no_step_compiles import VOCAB, _assert_same, _every_setting

from jaxllm.sampling import SamplingParams, SamplingTensors, sample

from conftest import tiny_engine
from engine_helpers import random_prompts


def _run_staggered(engine, prompts, params):
    """Tokens and logprobs per request; a new request joins every other step, so steps hold
    1 to all requests, prompts and decodes mixed."""
    pending = list(zip(prompts, params))
    requests, logprobs, steps = [], {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            request = engine.add_request(*pending.pop(0))
            requests.append(request)
            logprobs[request.request_id] = []
        for update in engine.step():
            logprobs[update.request.request_id] += update.new_logprobs
        steps += 1
    return [(list(r.output_token_ids), logprobs[r.request_id]) for r in requests]


def test_tokens_and_logprobs_do_not_depend_on_the_sampler_rows():
    params = _every_setting(8)
    prompts = random_prompts(len(params), VOCAB, 3, 20, seed=5)
    results, rows_run = [], []
    for live_rows in (True, False):
        engine = tiny_engine(max_seq_len=256)
        try:
            if not live_rows:
                engine.planner.sampler_row_sizes = engine.sampler_variants.row_sizes = []
            engine.warmup(background=True)
            results.append(_run_staggered(engine, prompts, params))
            rows_run.append(dict(engine.runner.sampler_runs_per_rows))
        finally:
            engine.close()
    mine, theirs = results
    _assert_same(mine, theirs)
    # Sampled in token buckets over fewer rows than max_batch_size (8), which the other never did.
    assert any(rows < 8 and count for rows, count in rows_run[0].items()), rows_run[0]
    assert sum(rows_run[0].values()) == sum(rows_run[1].values())


def test_padding_rows_change_no_rows_token():
    vocab, live = 512, 3
    logits = np.random.default_rng(3).standard_normal((8, vocab)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, seed=1, logprobs=2),
        SamplingParams(repetition_penalty=1.4, presence_penalty=0.3),
        SamplingParams(temperature=1.1, top_k=7, min_p=0.02, seed=2),
    ]
    histories = [([1, 2], [3]), ([4, 5, 4], [6, 6]), ([7], [])]
    t = SamplingTensors.build(params, [1, 2, 0], histories, [[0]] * live, live, 16, seeds=[1, 9, 2])
    padded = t.padded(8)
    assert padded.batch_size == 8 and (padded.temperature[live:] == 0).all()
    small = jax.jit(sample)(jnp.asarray(logits[:live]), t)
    large = jax.jit(sample)(jnp.asarray(logits), padded)
    np.testing.assert_array_equal(np.asarray(small.token_ids), np.asarray(large.token_ids)[:live])
    np.testing.assert_allclose(np.asarray(small.logprobs), np.asarray(large.logprobs)[:live], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(small.top_ids), np.asarray(large.top_ids)[:live])
