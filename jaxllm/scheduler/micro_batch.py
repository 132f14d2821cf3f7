"""Micro-batch scheduling: what runs in one forward pass, and context chunking.

Limits: `max_batch_size` requests and `max_num_tokens` tokens in the packed buffer.
Generation requests go first (one token each) and the first that would exceed the token
budget stops them. Then context requests, in the order given:

* without chunking each costs its whole remaining prompt and the first that does not fit
  stops admission (a prompt longer than `max_num_tokens`, which can appear after `pause()`
  folded generated tokens into it, is split anyway since it could never run whole);
* with chunking the remaining budget is split by the policy; every chunk except a
  prompt's last is a multiple of `chunk_unit_size` (the KV block size), optionally capped
  at `max_context_length`, and a request whose chunk comes out as 0 does not run:

  - FIRST_COME_FIRST_SERVED: in order, each request takes
    `min(remaining, budget_left, max_context_length)`, floored to the unit if truncated;
  - EQUAL_PROGRESS: rounds of one unit per request until the budget is used.

Stall-free steps (`max_tokens_with_generation`, off by default): while a few generation
requests run (fewer than half that size), a step takes prompt tokens only up to that many
tokens in all, in chunks that may end inside a KV block. Those streams' steps then cost about
that small bucket, not the largest one (as Sarathi-Serve's token budget for stall-free
batching). Steps without generation, or with many generation requests (a batch, whose steps
are large anyway), keep the whole budget, so a batch's prompts are not starved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from jaxllm.llm_args import ContextChunkingPolicy, _coerce_enum
from jaxllm.llm_request import LlmRequestState
from jaxllm.scheduler.base import RequestList

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS


@dataclass(frozen=True)
class ContextChunkingConfig:
    chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    chunk_unit_size: int = 32  # the KV block size, so chunk boundaries fall on blocks

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "chunking_policy", _coerce_enum(ContextChunkingPolicy, self.chunking_policy, "chunking_policy")
        )
        if self.chunk_unit_size < 1:
            raise ValueError(f"chunk_unit_size must be >= 1, got {self.chunk_unit_size}")


class MicroBatchScheduler:
    """Picks the context and generation requests of one forward pass and sets each
    context request's `context_chunk_size`. Subclass and override `schedule` to change it."""

    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: Optional[int] = None,
        chunking: Optional[ContextChunkingConfig] = None,
        *,
        max_context_length: Optional[int] = None,
        max_tokens_with_generation: Optional[int] = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        if max_context_length is not None and max_context_length < 1:
            raise ValueError(f"max_context_length must be >= 1, got {max_context_length}")
        if max_tokens_with_generation is not None and max_tokens_with_generation < 2:
            raise ValueError(f"max_tokens_with_generation must be >= 2, got {max_tokens_with_generation}")
        if chunking is not None and max_context_length is not None and max_context_length < chunking.chunk_unit_size:
            raise ValueError(
                f"max_context_length ({max_context_length}) is smaller than the chunk "
                f"unit ({chunking.chunk_unit_size}): no chunk could ever be scheduled"
            )
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunking = chunking
        self.max_context_length = max_context_length
        self.max_tokens_with_generation = max_tokens_with_generation
        self._token_cap: Optional[int] = None  # a lower budget for now (`cap_tokens`)

    def cap_tokens(self, cap: Optional[int]) -> None:
        """Take at most `cap` tokens per step until called again (None: `max_num_tokens`); the
        engine holds steps to its largest compiled bucket while larger ones compile."""
        if cap is not None and cap < 1:
            raise ValueError(f"a token cap must be >= 1, got {cap}")
        self._token_cap = cap

    @property
    def token_limit(self) -> Optional[int]:
        """The token budget of a step now: `max_num_tokens`, or the cap when lower."""
        cap, limit = self._token_cap, self.max_num_tokens
        return limit if cap is None else cap if limit is None else min(cap, limit)

    def schedule(
        self, active_requests: RequestList, inflight_request_ids: Optional[set[int]] = None
    ) -> tuple[RequestList, RequestList]:
        """Returns `(context_requests, generation_requests)`."""
        # Read as the loop goes: a live set may gain requests the capacity scheduler just admitted.
        inflight = inflight_request_ids if inflight_request_ids is not None else ()
        max_batch = self.max_batch_size
        max_tokens = self.token_limit
        # Generation requests cost one token (and batch row) per beam, `beam_width` for beam
        # search as in the reference; the first over a limit stops them.
        gen_limit = max_batch if max_tokens is None else min(max_batch, max_tokens)
        gen_tokens = 0
        generation: RequestList = []
        candidates: RequestList = []
        gen_open = True
        for req in active_requests:
            state = req.state
            if state is _GENERATION_IN_PROGRESS:
                if gen_open and not (inflight and req.request_id in inflight):
                    width = req.beam_width
                    if gen_tokens + width <= gen_limit:
                        generation.append(req)
                        gen_tokens += width
                    else:
                        gen_open = False
            elif state is _CONTEXT_INIT:
                if not (inflight and req.request_id in inflight):
                    candidates.append(req)
                    req.context_chunk_size = 0
        del candidates[max_batch - gen_tokens :]  # generation goes first
        # A finished prompt still in CONTEXT_INIT (its token not added yet) has nothing to run.
        candidates = [r for r in candidates if r.context_current_position < len(r.prompt_token_ids)]
        budget = None if max_tokens is None else max_tokens - gen_tokens
        if self.chunking is None:
            context = self._schedule_whole_prompts(candidates, budget)
        else:
            unit = self.chunking.chunk_unit_size
            stall_free = self.max_tokens_with_generation
            if stall_free is not None and 0 < 2 * gen_tokens < stall_free:  # a few streams: a small step
                prompt_tokens = stall_free - gen_tokens
                budget = prompt_tokens if budget is None else min(budget, prompt_tokens)
                unit = 1  # chunks of any size (a whole block might not fit)
            context = self._schedule_chunks(candidates, budget, unit)
        return context, generation

    # ------------------------------------------------------------ internal
    def _schedule_whole_prompts(self, candidates: RequestList, budget: Optional[int]) -> RequestList:
        context: RequestList = []
        for req in candidates:
            remaining = req.context_remaining_length
            if budget is not None and remaining > budget:
                limit = self.token_limit
                if limit is None:
                    raise AssertionError("a token budget is only set under max_num_tokens")
                if remaining > limit and budget > 0:
                    req.context_chunk_size = budget  # could never run whole: split it
                    context.append(req)
                break
            req.context_chunk_size = remaining
            context.append(req)
            if budget is not None:
                budget -= remaining
        return context

    def _schedule_chunks(self, candidates: RequestList, budget: Optional[int], unit: int) -> RequestList:
        max_len = self.max_context_length
        wanted = 0
        fits_whole = True
        for req in candidates:
            remaining = req.context_remaining_length
            wanted += remaining
            if max_len is not None and remaining > max_len:
                fits_whole = False
        if fits_whole and (budget is None or wanted <= budget):
            for req in candidates:
                req.context_chunk_size = req.context_remaining_length
            return list(candidates)
        assert self.chunking is not None
        if self.chunking.chunking_policy == ContextChunkingPolicy.EQUAL_PROGRESS:
            self._chunk_equal_progress(candidates, budget, unit)
        else:
            self._chunk_first_come_first_served(candidates, budget, unit)
        return [req for req in candidates if req.context_chunk_size > 0]

    def _chunk_first_come_first_served(self, requests: RequestList, budget: Optional[int], unit: int) -> None:
        max_len = self.max_context_length
        for req in requests:
            if budget is not None and budget <= 0:
                break
            remaining = req.context_remaining_length
            size = remaining
            if budget is not None and size > budget:
                size = budget
            if max_len is not None and size > max_len:
                size = max_len
            if size < remaining:
                size -= size % unit
            req.context_chunk_size = size
            if budget is not None:
                budget -= size

    def _chunk_equal_progress(self, requests: RequestList, budget: Optional[int], unit: int) -> None:
        max_len = self.max_context_length
        used = 0
        progressed = True
        while progressed and (budget is None or used < budget):
            progressed = False
            for req in requests:
                past = req.context_chunk_size
                remaining = req.context_remaining_length
                if past >= remaining:
                    continue
                size = min(past + unit, remaining)
                increment = size - past
                if budget is not None and used + increment > budget:
                    continue
                if max_len is not None and size > max_len:
                    continue
                req.context_chunk_size = size
                used += increment
                progressed = True
