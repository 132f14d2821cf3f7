"""Context / generation logits, prompt logprobs and logits post-processors, checked against
Hugging Face transformers on the same tiny random checkpoint.

One engine (a one-layer random Qwen3, token buckets 16/32 so a 40-token prompt is chunked)
serves the whole module.
"""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, KvCacheConfig, SamplingParams

from engine_helpers import make_hf_model, random_prompts

VOCAB = 384
FORCED = 7
LOW = 200  # the batched processor bans every id below this


def ban_low(logits, request_ids, mask):
    """A batched device-side post-processor: ids below LOW are banned."""
    return jnp.where(jnp.arange(logits.shape[-1])[None, :] < LOW, -jnp.inf, logits)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_1layer")
    return path, make_hf_model("qwen3", path, VOCAB, num_layers=1)


@pytest.fixture(scope="module")
def llm(hf_model):
    llm = LLM(
        str(hf_model[0]),
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=128,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
        logits_post_processors={"ban_low": ban_low},
        warmup_logits_outputs=True,
    )
    llm.warmed_up = llm.executor.call_on_engine(
        lambda engine: engine.warmup(all_variants=False) or _compiled(engine), timeout=None
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts():
    long, short, mid, other = random_prompts(4, VOCAB, 7, 12, seed=3)
    return dict(long=(long * 5)[:40], short=short, mid=mid, other=other)


def _compiled(engine) -> tuple[int, int]:
    """Compiled model forwards (plain and context-logits variants) and logits programs."""
    return engine.runner.num_forward_variants, engine.runner.num_logits_programs


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model[1](torch.tensor([ids])).logits[0].numpy()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 5, "temperature": 0, "ignore_eos": True, **kw})


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True, **kw})


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def baseline(llm, prompts):
    """Tokens of requests that ask for nothing, in a batch of their own."""
    outs = run(llm, [prompts["short"], prompts["mid"], prompts["other"]], [greedy(), sampled(), greedy()])
    return [o.outputs[0].token_ids for o in outs]


def close(ours, ref, tol=2e-4):
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


def test_logits_outputs_match_hf_with_chunked_prefill_mixed_with_plain_requests(llm, hf_model, prompts, baseline):
    long = prompts["long"]
    outs = run(
        llm,
        [long, prompts["short"], prompts["mid"], prompts["other"]],
        [
            greedy(return_context_logits=True, return_generation_logits=True, prompt_logprobs=3),
            greedy(),
            sampled(return_generation_logits=True),
            greedy(prompt_logprobs=0),
        ],
    )
    first, plain, gen_only, lp_only = outs

    tokens = first.outputs[0].token_ids
    ref = hf_logits(hf_model, long + tokens)
    assert first.context_logits.shape == (len(long), VOCAB)
    close(first.context_logits, ref[: len(long)])
    gen = first.outputs[0].generation_logits
    assert gen.shape == (len(tokens), VOCAB)
    close(gen, ref[len(long) - 1 : len(long) - 1 + len(tokens)])
    assert tokens == [int(np.argmax(r)) for r in gen]

    # vLLM's prompt_logprobs: None first, then the actual token and the top 3 with their ranks.
    lps = first.prompt_logprobs
    assert first.outputs[0].prompt_logprobs is lps and len(lps) == len(long) and lps[0] is None
    x = ref[: len(long) - 1].astype(np.float64)
    ref_lp = x - x.max(-1, keepdims=True)
    ref_lp -= np.log(np.exp(ref_lp).sum(-1, keepdims=True))
    for i, entry in enumerate(lps[1:]):
        row, token = ref_lp[i], long[i + 1]
        order = np.argsort(-row, kind="stable")
        top = {int(t): rank + 1 for rank, t in enumerate(order[:3])}
        assert set(entry) == set(top) | {token}
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 1e-4
            assert lp.rank == top.get(t, int((row > row[t]).sum()) + 1)

    # The sampled request's generation logits are the rows its tokens were drawn from.
    g_tokens = gen_only.outputs[0].token_ids
    g_ref = hf_logits(hf_model, prompts["mid"] + g_tokens)
    n = len(prompts["mid"])
    close(gen_only.outputs[0].generation_logits, g_ref[n - 1 : n - 1 + len(g_tokens)])
    assert gen_only.context_logits is None and gen_only.prompt_logprobs is None

    assert len(lp_only.prompt_logprobs) == len(prompts["other"])
    assert all(len(e) == 1 for e in lp_only.prompt_logprobs[1:])  # k = 0: only the actual token
    assert lp_only.context_logits is None and lp_only.outputs[0].generation_logits is None
    assert plain.context_logits is None and plain.outputs[0].generation_logits is None
    # Requests that ask for nothing get what they get alone.
    assert [plain.outputs[0].token_ids, gen_only.outputs[0].token_ids, lp_only.outputs[0].token_ids] == baseline


def test_prompt_logits_come_back_even_when_the_prefix_is_cached(llm, hf_model, prompts):
    long = prompts["long"]
    run(llm, [long], [greedy()])  # its full blocks are now in the prefix cache
    out = run(llm, [long], [greedy(return_context_logits=True, max_tokens=1)])[0]
    close(out.context_logits, hf_logits(hf_model, long)[: len(long)])


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_asking_request_costs_the_others_no_device_memory(llm, prompts):
    """Plain steps keep their compiled programs (same executables, same memory); the variant
    for steps where a row asks adds exactly its E x vocab float32 output; nothing is left on
    the device once the request is done."""

    def snapshot(engine):
        exes = engine.runner.programs.executables("forward")
        return {k: (v, v.memory_analysis()) for k, v in exes.items()}

    run(llm, [prompts["short"], prompts["long"]], [greedy(), greedy()])
    before = llm.executor.call_on_engine(snapshot, timeout=60)
    live_before = llm.executor.call_on_engine(lambda e: _live_bytes(), timeout=60)
    run(
        llm,
        [prompts["short"], prompts["long"], prompts["mid"]],
        [greedy(), greedy(return_context_logits=True, prompt_logprobs=1, return_generation_logits=True), greedy()],
    )
    run(llm, [prompts["short"], prompts["long"]], [greedy(), greedy()])
    after = llm.executor.call_on_engine(snapshot, timeout=60)
    live_after = llm.executor.call_on_engine(lambda e: _live_bytes(), timeout=60)

    plain = {k: v for k, v in after.items() if len(k.treedef.children()) == 2}
    variants = {k: v for k, v in after.items() if len(k.treedef.children()) == 3}
    assert variants, "the asking request never ran the context-logits variant"
    for key, (exe, _stats) in before.items():
        assert after[key][0] is exe  # no step was recompiled or replaced
    for key, (_, stats) in variants.items():
        bucket = key.leaves[0][2][0]  # token_ids' shape: the token bucket
        extra_rows = key.leaves[-1][2][0]  # context_index's shape
        twin = next(s for k, (_, s) in plain.items() if k.leaves[0][2][0] == bucket)
        # The extra [E, vocab] float32 output, plus one 8-byte entry in the output tuple's table.
        assert stats.output_size_in_bytes - twin.output_size_in_bytes == extra_rows * VOCAB * 4 + 8
        assert extra_rows <= bucket
    assert live_after == live_before


def _force(token):
    def processor(request_id, token_ids, logits):
        logits[:] = -np.inf
        logits[token] = 0.0
        return logits

    return processor


def test_host_logits_processors_change_only_their_requests(llm, hf_model, prompts, baseline):
    short, mid, other = prompts["short"], prompts["mid"], prompts["other"]
    banned = set(baseline[2])
    seen = []

    def ban(request_id, token_ids, logits):
        seen.append((request_id, list(token_ids)))
        logits[list(banned)] = -np.inf  # in place, returning None

    def boom(request_id, token_ids, logits):
        if len(token_ids) > len(short) + 1:
            raise RuntimeError("boom in processor")
        return logits

    def wrong_shape(request_id, token_ids, logits):
        return logits[:10]

    params = [
        greedy(logits_processor=_force(FORCED)),
        sampled(),
        greedy(logits_processor=[lambda r, t, x: x, ban]),
        greedy(logits_processor=boom),
        greedy(logits_processor=wrong_shape),
    ]
    results = [llm.generate_async(p, sp) for p, sp in zip([short, mid, other, short, mid], params)]
    forced, plain, banned_out = (r.result(timeout=120).outputs[0].token_ids for r in results[:3])
    with pytest.raises(RuntimeError, match="boom in processor"):
        results[3].result(timeout=120)
    with pytest.raises(RuntimeError, match="shape"):
        results[4].result(timeout=120)

    assert forced == [FORCED] * 5
    assert plain == baseline[1]  # a sampled row beside them draws exactly what it draws alone
    # The banned request takes HF's argmax over the allowed tokens, given its own history,
    # and its processor saw the prompt plus the tokens so far.
    ref = hf_logits(hf_model, other + banned_out)
    for i, token in enumerate(banned_out):
        row = ref[len(other) - 1 + i].copy()
        row[list(banned)] = -np.inf
        assert token == int(np.argmax(row)) and token not in banned
    assert seen == [(results[2].request_id, other + banned_out[:i]) for i in range(len(banned_out))]
    # The engine serves on, and equal requests get equal tokens.
    assert run(llm, [short], [greedy()])[0].outputs[0].token_ids == baseline[0]


def test_a_host_processor_does_not_hold_up_the_step_or_the_other_requests(llm, prompts, baseline):
    """Dispatching a step with a processor row does not wait for the callable (it runs when the
    device gets there), and the request with it sits out the next step instead of draining the
    overlap pipeline: the plain request beside it keeps every step."""
    short, mid = prompts["short"], prompts["mid"]

    def drive(engine):
        gate = threading.Event()
        watchdog = threading.Timer(30, gate.set)  # only if dispatch wrongly waits on the callable

        def slow(request_id, token_ids, logits):
            gate.wait()
            return logits

        plain = engine.add_request(short, greedy())
        held = engine.add_request(mid, greedy(logits_processor=slow))
        watchdog.start()
        try:
            engine.step()  # the prompts' step, holding `slow`'s row
            returned_first = not gate.is_set()
        finally:
            gate.set()
            watchdog.cancel()
        engine.step()  # dispatched while the prompts' step was in flight: the plain request only
        plain_alone = [entry[0] for entry in engine.pending_step.entries] == [plain]
        while engine.has_unfinished_requests():
            engine.step()
        return returned_first, plain_alone, plain.output_token_ids, held.output_token_ids

    returned_first, plain_alone, plain, held = llm.executor.call_on_engine(drive, timeout=300)
    assert returned_first, "dispatch waited for the host logits processor"
    assert plain_alone
    assert plain == baseline[0] and len(held) == 5


def test_batched_device_processor_changes_only_rows_that_select_it(llm, hf_model, prompts, baseline):
    short, mid, other = prompts["short"], prompts["mid"], prompts["other"]
    outs = run(llm, [short, mid, other], [greedy(), sampled(), greedy(logits_post_processor_name="ban_low")])
    assert [outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids] == baseline[:2]
    tokens = outs[2].outputs[0].token_ids
    ref = hf_logits(hf_model, other + tokens)
    for i, token in enumerate(tokens):
        assert token == LOW + int(np.argmax(ref[len(other) - 1 + i][LOW:]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logits_post_processor_name="nope"), "logits_post_processor_name"),
        (dict(logits_post_processor_name=5), "logits_post_processor_name"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(return_context_logits="yes"), "return_context_logits"),
        (dict(logits_processor=[print, 5]), "logits_processor"),
        (dict(return_generation_logits=True, use_beam_search=True, n=2), "return_generation_logits"),
    ],
)
def test_invalid_logits_requests_are_refused_by_name(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate_async([5, 6, 7], SamplingParams(max_tokens=2, **kwargs))


def test_nothing_for_logits_compiled_after_warmup(llm):
    """With warmup_logits_outputs, every forward variant and row program the module's logits
    requests and host processors used was compiled by warm-up."""
    assert llm.executor.call_on_engine(_compiled, timeout=60) == llm.warmed_up


def _reference_prompt_logprobs(logits: np.ndarray, prompt: list[int], k: int) -> list:
    x = logits[: len(prompt) - 1].astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    out = [None]
    for i, token in enumerate(prompt[1:]):
        row = lp[i]
        top = {int(t): rank + 1 for rank, t in enumerate(np.argsort(-row, kind="stable")[:k])}
        out.append({t: (row[t], top.get(t, int((row > row[t]).sum()) + 1)) for t in set(top) | {token}})
    return out


def test_prompt_logprobs_are_computed_per_chunk_without_holding_the_context():
    from jaxllm.engine.logits_outputs import PROMPT_LOGPROBS_ROWS, LogitsRecord

    rng = np.random.default_rng(5)
    n = 2 * PROMPT_LOGPROBS_ROWS + 22
    prompt = rng.integers(0, 50, n).tolist()
    logits = rng.normal(0, 3, (n, 50)).astype(np.float32)
    record = LogitsRecord(prompt, keep_context=False, prompt_k=4)
    for lo, hi in ((0, 70), (70, 100), (70, 100), (100, n)):  # a chunk recomputed after a pause
        record.store_context(lo, logits[lo:hi])
    assert record.context is None  # only the entries are kept
    got = record.outputs(SamplingParams(prompt_logprobs=4), 0)["prompt_logprobs"]
    ref = _reference_prompt_logprobs(logits, prompt, 4)
    assert len(got) == n and got[0] is None
    for entry, expected in zip(got[1:], ref[1:]):
        assert set(entry) == set(expected)
        for t, lp in entry.items():
            assert abs(lp.logprob - expected[t][0]) < 1e-5 and lp.rank == expected[t][1]


def test_prompt_logprobs_alone_match_those_with_context_logits_and_are_capped(llm, prompts):
    long = prompts["long"]
    both, alone = run(
        llm, [long, long], [greedy(return_context_logits=True, prompt_logprobs=5), greedy(prompt_logprobs=5)]
    )
    assert alone.context_logits is None
    ref = _reference_prompt_logprobs(both.context_logits, long, 5)
    for lps in (both.prompt_logprobs, alone.prompt_logprobs):
        assert len(lps) == len(long) and lps[0] is None
        for entry, expected in zip(lps[1:], ref[1:]):
            assert set(entry) == set(expected)
            for t, lp in entry.items():
                assert abs(lp.logprob - expected[t][0]) < 1e-4 and lp.rank == expected[t][1]
    with pytest.raises(ValueError, match=r"prompt_logprobs: the prompt \(4097 tokens\) is longer than the 4096"):
        llm.generate([5] * 4097, greedy(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        llm.generate(long, greedy(prompt_logprobs=21), use_tqdm=False)
    assert run(llm, [long], [greedy()])[0].outputs[0].token_ids == alone.outputs[0].token_ids
