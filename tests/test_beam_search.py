"""Beam search against Hugging Face `generate(num_beams=...)` on a tiny random checkpoint,
with plain requests in the same batches, plus the KV manager's beam forks and the errors."""

from __future__ import annotations

import pytest

from jaxllm import LLM, KvCacheConfig, SamplingParams
from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest, LlmRequestState

from engine_helpers import hf_teacher_forcing_check, make_hf_model, random_prompts

VOCAB = 384
SCORE_TOL = 1e-4  # absolute, on scores of about -1 to -20 computed in float32 by both sides


@pytest.fixture(scope="module")
def model_and_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_beam")
    model = make_hf_model("qwen3", path, VOCAB)
    # 4-token blocks: prompts end inside a block, so forks copy partial blocks.
    llm = LLM(
        str(path),
        max_batch_size=16,
        max_num_tokens=64,
        max_seq_len=128,
        kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
        warmup="none",  # what the tests compare compiles when the steps need it
    )
    yield model, llm
    llm.shutdown()


def _hf_beams(model, prompt, params: SamplingParams):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=params.max_tokens,
            num_beams=params.beam_width,
            do_sample=False,
            num_return_sequences=params.n,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=params.end_id,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for i in range(params.n):
        tokens = out.sequences[i, len(prompt) :].tolist()
        if params.end_id in tokens:  # HF pads after the end token
            tokens = tokens[: tokens.index(params.end_id) + 1]
        beams.append((tokens, float(out.sequences_scores[i])))
    return beams


def test_beam_search_matches_hf_with_inflight_plain_requests(model_and_llm):
    import torch

    model, llm = model_and_llm
    prompts = random_prompts(6, VOCAB, 5, 11, seed=7)
    with torch.no_grad():  # an end id the model actually produces, so hypotheses finish early
        greedy = model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
    end = int(greedy[0, len(prompts[0]) + 2])
    beam = [
        SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=8, end_id=end),
        SamplingParams(use_beam_search=True, n=2, max_tokens=6, length_penalty=0.5, early_stopping=True, end_id=end),
        SamplingParams(
            use_beam_search=True, n=3, best_of=4, max_tokens=7, length_penalty=2.0, early_stopping="never", end_id=end
        ),
        SamplingParams(use_beam_search=True, n=1, best_of=2, max_tokens=9, end_id=end),
    ]
    plain = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    # All in one batch: beams of different widths run next to plain generation.
    outs = llm.generate(prompts, beam + plain, use_tqdm=False)
    stats = llm.engine.iteration_stats
    assert max(s["inflightBatchingStats"]["numGenRequests"] for s in stats) > 10  # rows: every beam + plain
    for prompt, params, out in zip(prompts, beam, outs):
        expected = _hf_beams(model, prompt, params)
        assert len(out.outputs) == params.n
        for got, (tokens, score) in zip(out.outputs, expected):
            assert got.token_ids == tokens
            assert got.cumulative_logprob == pytest.approx(score, abs=SCORE_TOL)
            assert got.finish_reason == ("stop" if tokens[-1] == end else "length")
            assert got.text == llm.tokenizer.decode([t for t in tokens if t != end], skip_special_tokens=True)
    assert any(c.token_ids[-1] == end for o in outs[:4] for c in o.outputs)  # some beams end on the end id
    for prompt, out in zip(prompts[4:], outs[4:]):
        hf_teacher_forcing_check(model, prompt, out.outputs[0].token_ids)
        assert out.outputs[0].cumulative_logprob is None
    kv = llm.executor.call_on_engine(lambda engine: engine.kv_cache_manager)
    stats = llm.executor.call_on_engine(
        lambda engine: (engine.kv_cache_manager.check_invariants(), kv.get_kv_cache_stats())[1]
    )
    assert stats.used_num_blocks == 0
    assert llm.executor.call_on_engine(lambda engine: engine.requests.num_beam_search) == 0


def test_beam_search_with_one_beam_is_greedy(model_and_llm):
    """Width 1 runs as a beam search of one beam: Hugging Face's `num_beams=1`, i.e. greedy
    decoding, with or without an end id met on the way; extreme but allowed length penalties
    still return a beam, and the engine serves the same greedy tokens afterwards."""
    import torch

    model, llm = model_and_llm
    prompts = random_prompts(3, VOCAB, 5, 11, seed=11)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    end = int(hf[0, len(prompts[0]) + 3])
    cases = [
        SamplingParams(use_beam_search=True, n=1, max_tokens=8, ignore_eos=True),
        SamplingParams(use_beam_search=True, n=1, max_tokens=8, end_id=end),
        SamplingParams(use_beam_search=True, n=1, best_of=1, max_tokens=8, length_penalty=10.0, ignore_eos=True),
        SamplingParams(use_beam_search=True, n=1, max_tokens=8, length_penalty=-10.0, ignore_eos=True),
    ]
    for params in cases:
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out, plain in zip(prompts, outs, before):
            tokens = out.outputs[0].token_ids
            if params.ignore_eos:
                assert tokens == plain
            else:  # Hugging Face's num_beams=1 is greedy decoding up to the end id
                with torch.no_grad():
                    hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=end)
                expected = hf[0, len(prompt) :].tolist()
                expected = expected[: expected.index(end) + 1] if end in expected else expected
                assert tokens == expected
                assert tokens == (plain[: plain.index(end) + 1] if end in plain else plain)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == before
    assert llm.executor.call_on_engine(lambda engine: engine.requests.num_beam_search) == 0


def test_beam_search_streams_final_beams_and_aborts_cleanly(model_and_llm):
    _, llm = model_and_llm
    prompt = random_prompts(1, VOCAB, 9, 9, seed=11)[0]
    params = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=6, ignore_eos=True)
    updates = list(llm.generate_async(prompt, params, streaming=True))
    assert len(updates) == 1 and updates[0].finished  # beams change until the end: only the final beams
    assert [len(o.token_ids) for o in updates[0].outputs] == [6, 6]
    assert updates[0].outputs[0].cumulative_logprob >= updates[0].outputs[1].cumulative_logprob
    # ignore_eos: an end id the best beam starts with changes nothing.
    first = updates[0].outputs[0].token_ids[0]
    again = llm.generate(
        prompt,
        SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=6, ignore_eos=True, end_id=first),
        use_tqdm=False,
    )
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in updates[0].outputs]
    result = llm.generate_async(
        prompt, SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=100, ignore_eos=True)
    )
    llm.executor.abort_request(result.request_id)
    final = result.result(timeout=60)
    assert [o.finish_reason for o in final.outputs] == ["cancelled", "cancelled"]
    used = llm.executor.call_on_engine(
        lambda engine: (
            engine.kv_cache_manager.check_invariants(),
            engine.kv_cache_manager.get_kv_cache_stats().used_num_blocks,
        )[1]
    )
    assert used == 0
    # The copy-on-write page copy has one compiled shape, however many blocks a fork copies.
    assert llm.executor.call_on_engine(lambda engine: engine.runner.num_copy_programs) == 1


def test_a_beam_request_sits_out_the_next_step_instead_of_draining_the_others(model_and_llm):
    """With the overlap scheduler, the step dispatched while a beam request's step is in flight
    runs the plain request alone (the beams are chosen on the host first); both finish."""
    _, llm = model_and_llm
    beam_prompt, plain_prompt = random_prompts(2, VOCAB, 6, 9, seed=13)

    def drive(engine):
        beam = engine.add_request(beam_prompt, SamplingParams(use_beam_search=True, n=2, max_tokens=4, ignore_eos=True))
        plain = engine.add_request(plain_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine.step()  # both prompts
        engine.step()  # dispatched while the prompts' step is in flight
        second = [entry[0] for entry in engine.pending_step.entries + (engine.pending_step.beam_entries or [])]
        while engine.has_unfinished_requests():
            engine.step()
        return second == [plain], beam.is_finished and plain.is_finished

    plain_alone, finished = llm.executor.call_on_engine(drive, timeout=300)
    assert plain_alone
    assert finished


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=2, temperature=0.8), "temperature"),
        (dict(n=2, top_p=0.9), "top_p"),
        (dict(n=9), "beam width"),
        (dict(n=2, logprobs=2), "logprobs"),
        (dict(n=2, repetition_penalty=1.2), "repetition_penalty"),
        (dict(n=2, stop=["x"]), "stop"),
        (dict(n=2, early_stopping="sometimes"), "early_stopping"),
        (dict(n=2, length_penalty=1e308), r"length_penalty must be a finite number in \[-10, 10\], got 1e\+308"),
        (dict(n=2, length_penalty=-1e308), r"length_penalty must be a finite number in \[-10, 10\]"),
        (dict(n=2, length_penalty=10.5), "length_penalty"),
        (dict(n=2, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_invalid_beam_search_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(use_beam_search=True, **kwargs)


def test_beam_knobs_without_beam_search_are_refused():
    with pytest.raises(ValueError, match="length_penalty applies to beam search only"):
        SamplingParams(length_penalty=2.0)
    assert SamplingParams(use_beam_search=True, n=2, best_of=4).beam_width == 4
    assert SamplingParams(use_beam_search=True, n=3).beam_width == 3


def _beam_request(rid, prompt_len, max_new, width):
    request = LlmRequest(request_id=rid, prompt_token_ids=list(range(3, 3 + prompt_len)), max_new_tokens=max_new)
    request.beam_width = width
    return request


def _generation_beam(rid, leader):
    beam = LlmRequest(
        request_id=rid,
        prompt_token_ids=leader.prompt_token_ids,
        max_new_tokens=leader.max_new_tokens,
        state=LlmRequestState.GENERATION_IN_PROGRESS,
    )
    beam.context_current_position = leader.prompt_len
    return beam


def test_kv_beam_forks_share_full_blocks_and_copy_partial_ones():
    kv = KVCacheManager(64, 4, 16, enable_block_reuse=True, max_num_sequences=4)
    leader = _beam_request(0, 10, 6, 3)  # blocks [0..3], [4..7], [8, 9 | ...]
    assert kv.get_needed_resource_to_completion(leader) == 3 * 4 - 2 * 2
    kv.add_sequence(leader)
    leader.context_chunk_size = 10
    kv.allocate_for_step(leader)
    leader.move_to_next_context_chunk()
    leader.add_new_token(50)
    beams = [_generation_beam(-2, leader), _generation_beam(-3, leader)]
    kv.add_beams(leader, beams)
    prompt_blocks = kv.get_block_ids(leader)
    # Every beam continues beam 0 (the prompt): full blocks shared, the partial third copied twice.
    copies = kv.fork_beams(leader, [0, 0, 0], num_cached_tokens=10)
    assert len(copies) == 2 and all(src == prompt_blocks[2] for src, _ in copies)
    tables = [kv.get_block_ids(r) for r in [leader] + beams]
    assert all(t[:2] == prompt_blocks[:2] for t in tables) and len({t[2] for t in tables}) == 3
    for beam in beams:
        beam.output_token_ids = [51]
    kv.check_invariants()
    assert kv.get_needed_resource_to_completion(leader) == 8 - 5
    # Beam 2 dies, beam 1 forks twice; the next token starts a new block: nothing to copy.
    for r in [leader] + beams:
        r.output_token_ids = [50, 51, 52]
    assert kv.fork_beams(leader, [0, 1, 1], num_cached_tokens=12) == []
    assert kv.get_block_ids(beams[0]) == kv.get_block_ids(beams[1])
    kv.check_invariants()
    assert kv.free_resources(leader) > 0
    kv.check_invariants()
    assert kv.num_sequences == 0 and kv.get_num_reserved_blocks() == 0
    assert kv.get_kv_cache_stats().used_num_blocks == 0
