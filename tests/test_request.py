"""LlmRequest state machine and token bookkeeping."""

from __future__ import annotations

import pytest

from jaxllm.llm_request import LlmRequest, LlmRequestState


def test_states_are_ordered_for_schedulability():
    S = LlmRequestState
    assert S.CONTEXT_INIT < S.GENERATION_IN_PROGRESS < S.GENERATION_TO_COMPLETE < S.GENERATION_COMPLETE
    assert not (S.CONTEXT_INIT <= S.UNKNOWN < S.GENERATION_COMPLETE)


def test_construction_validates_and_copies_the_prompt():
    prompt = [1, 2, 3]
    req = LlmRequest(7, prompt, 4, priority=2.0)
    assert req.state == LlmRequestState.CONTEXT_INIT and req.is_context_phase
    assert req.prompt_len == 3 and req.num_tokens == 3 and req.orig_prompt_len == 3
    req.prompt_token_ids.append(9)
    assert prompt == [1, 2, 3]
    with pytest.raises(ValueError, match="prompt is empty"):
        LlmRequest(1, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        LlmRequest(1, [1], 0)
    a, b = LlmRequest(1, [1], 1, arrival_time=0.0), LlmRequest(1, [1], 1, arrival_time=0.0)
    assert a != b and len({a, b}) == 2  # identity semantics


def test_chunked_context_then_generation():
    req = LlmRequest(1, list(range(10)), 3)
    req.context_chunk_size = 4
    assert req.is_first_context_chunk and not req.is_last_context_chunk
    assert req.move_to_next_context_chunk() is False
    assert req.context_current_position == 4 and req.context_chunk_size == 0
    with pytest.raises(ValueError, match="before the prompt was complete"):
        req.add_new_token(5)
    req.context_chunk_size = 6
    assert req.is_last_context_chunk and req.last_token_is_final_context_chunk
    assert req.move_to_next_context_chunk() is True
    req.add_new_token(42)
    assert req.state == LlmRequestState.GENERATION_IN_PROGRESS and req.is_generation_phase
    assert req.num_tokens == 11 and req.output_token_ids == [42]
    with pytest.raises(ValueError, match="not in the context phase"):
        req.move_to_next_context_chunk()
    req.add_new_token(43)
    req.add_new_token(44)
    assert req.reached_max_new_tokens
    req.finish("length")
    assert req.is_finished and req.finish_reason == "length"
    with pytest.raises(ValueError, match="cannot add a token"):
        req.add_new_token(1)
    with pytest.raises(ValueError, match="cannot pause a finished"):
        req.pause()


def test_chunk_past_the_prompt_is_rejected():
    req = LlmRequest(1, [1, 2, 3], 1)
    req.context_chunk_size = 4
    with pytest.raises(ValueError, match="runs past the prompt"):
        req.move_to_next_context_chunk()


def test_pause_moves_generated_tokens_into_the_prompt():
    req = LlmRequest(1, [10, 11, 12], 6)
    req.context_chunk_size = 3
    req.move_to_next_context_chunk()
    for tok in (20, 21):
        req.add_new_token(tok)
    assert req.num_tokens == 5
    req.pause()
    assert req.state == LlmRequestState.CONTEXT_INIT
    assert req.prompt_token_ids == [10, 11, 12, 20, 21] and req.prompt_len == 5
    assert req.max_new_tokens == 4 and req.orig_max_new_tokens == 6
    assert req.output_token_ids == [20, 21]  # user-visible output unchanged
    assert req.orig_prompt_token_ids == [10, 11, 12]
    assert req.context_current_position == 0 and req.num_tokens == 5
    assert req.max_seq_len_needed == 9  # prompt + max_new_tokens is invariant
    assert req.prompt_array().tolist() == [10, 11, 12, 20, 21]

    req.pause()  # nothing new to move: harmless
    assert req.prompt_len == 5 and req.max_new_tokens == 4 and req.num_pauses == 2

    # recompute the extended prompt, then continue generating
    req.context_chunk_size = 5
    assert req.move_to_next_context_chunk()
    req.add_new_token(22)
    assert req.output_token_ids == [20, 21, 22] and req.num_tokens == 6
    assert req.get_tokens(0, 6) == [10, 11, 12, 20, 21, 22]
    assert req.get_tokens(4, 6) == [21, 22] and req.get_tokens(5, 6) == [22]
    req.add_new_token(23)
    req.pause()
    assert req.prompt_token_ids == [10, 11, 12, 20, 21, 22, 23] and req.max_new_tokens == 2
    assert req.all_token_ids == req.prompt_token_ids
    req.context_chunk_size = req.context_remaining_length
    assert req.move_to_next_context_chunk()
    req.add_new_token(24)
    req.add_new_token(25)
    assert req.reached_max_new_tokens and len(req.output_token_ids) == 6


def test_token_accessors_without_pause():
    req = LlmRequest(1, [1, 2, 3, 4], 5)
    req.context_chunk_size = 4
    req.move_to_next_context_chunk()
    req.add_new_token(5)
    req.add_new_token(6)
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert req.get_tokens(2, 5) == [3, 4, 5]
    assert req.prompt_array().dtype.name == "int32"
