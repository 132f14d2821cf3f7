"""End-to-end engine tests against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, KvCacheConfig, SamplingParams, SchedulerConfig

from engine_helpers import hf_teacher_forcing_check, make_hf_model, random_prompts

VOCAB = 384


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    model = make_hf_model("qwen3_moe", path, VOCAB)
    return path, model


def make_llm(path, **overrides) -> LLM:
    """An LLM on `path` with small limits (override any), without warm-up: each program
    compiles when a step first needs it. Use it as a context manager, so that it stops when
    the test ends instead of compiling programs once idle."""
    kwargs = dict(
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
        warmup="none",
    )
    kwargs.update(overrides)
    return LLM(str(path), **kwargs)


@pytest.fixture(scope="module")
def moe_llm(moe_model):
    with make_llm(moe_model[0]) as llm:
        yield llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral"])
def test_greedy_generation_matches_hf_dense_and_moe(arch, tmp_path):
    model = make_hf_model(arch, tmp_path, VOCAB)
    prompts = random_prompts(3, VOCAB, 5, 40, seed=1)  # 40 > 32 tokens forces a chunked prefill
    with make_llm(tmp_path, max_num_tokens=32) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == 12
        assert out.outputs[0].finish_reason == "length"
        hf_teacher_forcing_check(model, prompt, out.outputs[0].token_ids)


def test_greedy_generation_matches_hf_qwen3_moe(moe_model, moe_llm):
    _, model = moe_model
    prompts = random_prompts(4, VOCAB, 3, 70, seed=2)
    outs = moe_llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        hf_teacher_forcing_check(model, prompt, out.outputs[0].token_ids)


def test_inflight_batching_is_invisible(moe_model):
    path, _ = moe_model
    prompts = random_prompts(18, VOCAB, 1, 60, seed=3)
    rng = np.random.default_rng(3)
    params = [SamplingParams(max_tokens=int(rng.integers(1, 16)), ignore_eos=True) for _ in prompts]
    # 30 blocks of 8 tokens cannot hold all requests at once (about 3 times as many tokens):
    # queuing + chunked prefill.
    small_pool = KvCacheConfig(tokens_per_block=8, max_tokens=240)
    with make_llm(path, max_num_tokens=32, kv_cache_config=small_pool) as llm:
        together = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.iteration_stats
        assert max(s["inflightBatchingStats"]["numScheduledRequests"] for s in stats) > 1
        assert llm.engine.kv_cache_manager.get_kv_cache_stats().used_num_blocks == 0
    with make_llm(path, max_batch_size=1) as alone_llm:
        for prompt, p, out in zip(prompts, params, together):
            alone = alone_llm.generate(prompt, p, use_tqdm=False)
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_prefix_reuse_gives_same_outputs(moe_model):
    path, _ = moe_model
    shared = random_prompts(1, VOCAB, 40, 40, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts(6, VOCAB, 1, 12, seed=5)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for reuse in (True, False):
        # moe_llm's limits: its compiled programs are found in the session's compilation cache
        kv_cache_config = KvCacheConfig(tokens_per_block=8, max_tokens=2048, enable_block_reuse=reuse)
        with make_llm(path, kv_cache_config=kv_cache_config) as llm:
            first = llm.generate(prompts[0], params, use_tqdm=False)
            rest = llm.generate(prompts[1:], params, use_tqdm=False)
            outs[reuse] = [o.outputs[0].token_ids for o in [first, *rest]]
            if reuse:
                assert llm.engine.kv_cache_manager.get_kv_cache_stats().reused_blocks >= 5 * 4
    assert outs[True] == outs[False]


def test_seeded_sampling_is_reproducible_and_batch_independent(moe_llm):
    prompt = random_prompts(1, VOCAB, 10, 10, seed=6)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = moe_llm.generate(prompt, params, use_tqdm=False).outputs[0].token_ids
    others = random_prompts(5, VOCAB, 3, 30, seed=7)
    mixed = moe_llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_tokens=9, temperature=0.7, seed=i) for i in range(3)]
        + [params]
        + [SamplingParams(max_tokens=5)] * 2,
        use_tqdm=False,
    )
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = moe_llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True), use_tqdm=False
    )
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(moe_llm):
    prompts = random_prompts(3, VOCAB, 5, 20, seed=8)
    greedy = moe_llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    top1 = moe_llm.generate(
        prompts, SamplingParams(max_tokens=10, top_k=1, temperature=1.0, seed=5, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_logprobs_and_stop_token_ids(moe_llm):
    prompt = random_prompts(1, VOCAB, 8, 8, seed=9)[0]
    out = moe_llm.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token].logprob <= 0.0
        assert entry[token].logprob >= max(lp.logprob for lp in entry.values()) - 1e-5  # greedy = top-1
    stop_at = completion.token_ids[2]
    stopped = moe_llm.generate(
        prompt, SamplingParams(max_tokens=6, stop_token_ids=[stop_at], ignore_eos=True), use_tqdm=False
    ).outputs[0]
    assert stopped.token_ids == completion.token_ids[: completion.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(inputs=[[]]), "empty"),
        (dict(inputs=[[5, VOCAB + 3]]), "vocabulary"),
        (dict(inputs=[list(range(3, 300))]), "max_seq_len"),
        (dict(params=dict(temperature=-0.5)), "temperature"),
        (dict(params=dict(top_p=1.5)), "top_p"),
        (dict(params=dict(top_p=0.0)), "top_p"),
        (dict(params=dict(max_tokens=0)), "max_tokens"),
        (dict(params=dict(bogus_field=1)), "bogus_field"),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_serving(moe_llm, bad, field):
    with pytest.raises(ValueError, match=field):
        params = SamplingParams.from_kwargs(**bad.get("params", {"max_tokens": 4}))
        moe_llm.generate(bad.get("inputs", [[5, 6, 7]]), params, use_tqdm=False)
    assert not moe_llm.engine.has_unfinished_requests()
    good = moe_llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(good.outputs[0].token_ids) == 3


def test_unknown_llm_kwarg_raises(moe_model):
    with pytest.raises(ValueError, match="not_an_option"):
        LLM(str(moe_model[0]), not_an_option=3)


def test_max_utilization_policy_completes_everything(moe_model, moe_llm):
    path, _ = moe_model
    prompts = random_prompts(12, VOCAB, 10, 40, seed=11)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with make_llm(
        path,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=200),
        scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION"),
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv_cache_manager.get_kv_cache_stats().used_num_blocks == 0
    reference = moe_llm.generate(prompts, params, use_tqdm=False)  # the default policy, a large pool
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_token_budget_smaller_than_a_block_is_refused(moe_model):
    with pytest.raises(ValueError, match="max_num_tokens"):
        make_llm(moe_model[0], max_num_tokens=4).shutdown()


def test_steady_decode_path_changes_no_output(moe_llm, monkeypatch):
    """Decode steps planned from per-slot arrays (and their tokens applied in one pass) give
    the same tokens, finish and stop reasons as the general path: lengths, stop tokens, end
    ids, seeded sampling, requests finishing at different steps."""
    prompts = random_prompts(6, VOCAB, 3, 30, seed=11)
    free_run = moe_llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(free_run):
        tokens = out.outputs[0].token_ids
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=14, stop_token_ids=[tokens[3 + i]], ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=5 + i, temperature=0.9, seed=i))
        else:
            params.append(SamplingParams(max_tokens=14, ignore_eos=True))
    planner = moe_llm.engine.planner
    kv = planner.kv_cache_manager
    steady_steps = []
    prepare_decode = kv.prepare_decode
    monkeypatch.setattr(kv, "prepare_decode", lambda *a: steady_steps.append(1) or prepare_decode(*a))
    results = []
    for steady in (True, False):
        planner.steady_decode = steady
        try:
            outs = moe_llm.generate(prompts, params, use_tqdm=False)
        finally:
            planner.steady_decode = True
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs])
        if steady:
            assert len(steady_steps) > 5
    assert results[0] == results[1]
    assert {r[1] for r in results[0]} == {"stop", "length"}


def test_steady_decode_steps_report_plain_rows_batched(moe_llm):
    """A steady decode step reports the rows whose token neither ends the request nor needs
    checking as one batched value (`StepUpdates.decoded`); iterated, every step's updates
    are token for token, finish for finish, those of the general path (which builds one
    `RequestUpdate` per row)."""
    prompts = random_prompts(5, VOCAB, 3, 20, seed=12)

    def run(engine, steady: bool):
        engine.planner.steady_decode = steady
        try:
            index = {}
            for i, prompt in enumerate(prompts):
                params = SamplingParams(
                    max_tokens=6 + 2 * i, ignore_eos=True, stop_token_ids=[int(prompt[0])] if i == 2 else None
                )
                index[engine.add_request(prompt, params).request_id] = i
            steps, batched = [], 0
            while engine.has_unfinished_requests():
                updates = engine.step()
                batched += sum(len(b.requests) for b in updates.decoded)
                assert len(updates) == len(list(updates))
                steps.append(sorted((index[u.request.request_id], tuple(u.new_token_ids), u.finished) for u in updates))
            return steps, batched
        finally:
            engine.planner.steady_decode = True

    fast, batched = moe_llm.executor.call_on_engine(lambda engine: run(engine, True), timeout=300)
    general, none = moe_llm.executor.call_on_engine(lambda engine: run(engine, False), timeout=300)
    assert batched > 10 and none == 0
    assert fast == general
    assert sum(finished for step in fast for _, _, finished in step) == len(prompts)


def test_token_log_changes_no_output(moe_llm, monkeypatch):
    """Steady decode batches keep their tokens in a `DecodeTokenLog` (written into the
    requests every few steps, for rows whose full block the KV cache indexes, and before any
    other path reads the requests). With the log on and off, with and without overlap, every
    step reports the same updates; an abort, a stop token, a request arriving mid-batch and
    the log filling up change nothing; the final outputs, the KV cache's prefix index (a
    follow-up prompt made of a finished output hits the same blocks) and its counters agree."""
    from jaxllm.engine.token_log import DecodeTokenLog

    calls = {"record": 0, "flush_rows": 0}
    for name in calls:
        original = getattr(DecodeTokenLog, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(DecodeTokenLog, name, counted)
    prompts = random_prompts(6, VOCAB, 3, 20, seed=21)
    free_run = moe_llm.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    free_tokens = free_run[0].outputs[0].token_ids
    # A token first sampled late: the first request stops there, several blocks in.
    stop_token = free_tokens[next(i for i in range(6, 30) if free_tokens[i] not in free_tokens[:i])]

    def run(engine, log: bool, overlap: bool, capacity: int = 64):
        engine.token_log, engine.overlap = log, overlap
        engine.planner.token_log_capacity = capacity  # 3: the log fills up every third step
        kv = engine.kv_cache_manager
        start = kv.get_kv_cache_stats()
        try:
            rids, steps, step = {}, [], 0
            for i, prompt in enumerate(prompts[:5]):
                params = SamplingParams(
                    max_tokens=26 + 3 * i, ignore_eos=True, stop_token_ids=[stop_token] if i == 0 else None
                )
                rids[engine.add_request(prompt, params).request_id] = i
            finished = {}
            while engine.has_unfinished_requests():
                if step == 21:
                    aborted = next(r for r in engine.active.values() if rids[r.request_id] == 3)
                    engine.abort_request(aborted.request_id)
                    finished[3] = (list(aborted.output_token_ids), aborted.finish_reason)
                if step == 24:
                    rids[engine.add_request(prompts[5], SamplingParams(max_tokens=9, ignore_eos=True)).request_id] = 5
                updates = engine.step()
                kv.check_invariants()
                # Blocks are indexed under their 8 read-back tokens, never a partial or unread one.
                assert all(len(key) == 8 and -1 not in key for _, key, _ in kv.block_pool.cached_prefixes().values())
                for u in updates:
                    if u.finished:
                        finished[rids[u.request.request_id]] = (
                            list(u.request.output_token_ids),
                            u.request.finish_reason,
                        )
                steps.append(sorted((rids[u.request.request_id], tuple(u.new_token_ids), u.finished) for u in updates))
                step += 1
            # Each whole sequence as a new prompt: the blocks its steps indexed are found.
            follow = [
                engine.add_request(prompts[i] + finished[i][0], SamplingParams(max_tokens=1)) for i in sorted(finished)
            ]
            while engine.has_unfinished_requests():
                engine.step()
            stats = kv.get_kv_cache_stats()
            return (
                steps,
                sorted(finished.items()),
                [r.prepopulated_prompt_len for r in follow],
                stats.reused_blocks - start.reused_blocks,
                stats.alloc_total_blocks - start.alloc_total_blocks,
            )
        finally:
            engine.token_log, engine.overlap = True, True
            engine.planner.token_log_capacity = 64

    # Every run then starts from the same cached blocks (these prompts' and outputs').
    moe_llm.executor.call_on_engine(lambda engine: run(engine, False, True), timeout=300)
    for overlap, capacity in ((True, 64), (False, 3)):
        before = dict(calls)
        logged = moe_llm.executor.call_on_engine(lambda engine: run(engine, True, overlap, capacity), timeout=300)
        assert calls["record"] - before["record"] >= 5 and calls["flush_rows"] > before["flush_rows"]
        during = dict(calls)
        written = moe_llm.executor.call_on_engine(lambda engine: run(engine, False, overlap), timeout=300)
        assert calls == during  # no log without it
        assert logged == written, overlap
        steps, finished, prefix_hits = logged[:3]
        assert [reason for _, (_, reason) in finished] == ["stop", "length", "length", "cancelled", "length", "length"]
        assert finished[0][1][0][-1] == stop_token and len(finished[0][1][0]) >= 7
        # Every full block of every sequence (generated tokens included, all but the last
        # token are in the cache) was indexed under its tokens.
        assert prefix_hits == [(len(prompts[i]) + len(out) - 1) // 8 * 8 for i, (out, _) in finished]


def test_greedy_steps_take_the_forward_argmax_without_a_sampler(moe_llm, monkeypatch):
    """A step whose rows all decode greedily with no processing takes each token from the
    forward's argmax (the sampler's own function) and runs no sampler program. Its tokens
    equal the sampler's, alone and beside a seeded sampled request (whose steps sample)."""
    from dataclasses import replace

    runner = moe_llm.engine.runner
    runs_before, execute = runner.sampler_runs, runner.execute
    prompts = random_prompts(4, VOCAB, 3, 20, seed=31)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=5)

    def run(params):
        outs = moe_llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    fast = run(greedy)
    assert runner.sampler_runs == runs_before
    mixed = run([greedy, greedy, seeded, greedy])
    assert runner.sampler_runs > runs_before and [mixed[i] for i in (0, 1, 3)] == [fast[i] for i in (0, 1, 3)]
    # Every step through the sampler instead.
    monkeypatch.setattr(runner, "execute", lambda plan, **kw: execute(replace(plan, greedy_only=False), **kw))
    assert run(greedy) == fast
    assert run([greedy, greedy, seeded, greedy]) == mixed
