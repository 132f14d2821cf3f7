"""One generation request as the scheduler and the KV cache see it.

The names follow TensorRT-LLM's `LlmRequest` so a user of that runtime recognises them.
A request moves through the states of `LlmRequestState`; its per-step bookkeeping lives
here (`move_to_next_context_chunk`, `add_new_token`, `pause`, `finish`) so the engine and
any test driver advance requests the same way.

Token accounting, for a request that was never paused::

    prompt_token_ids = p0 .. p{P-1}            (prompt_len = P)
    output_token_ids = g0 .. g{G-1}            (user-visible output)
    num_tokens       = P + G                   (tokens whose KV is or will be cached)

When the KV cache runs short, `pause()` frees the request and folds its generated tokens
into the prompt so that they are *recomputed* as context later instead of regenerated:
the prompt grows by G, `max_new_tokens` shrinks by G, `output_token_ids` is unchanged.
`orig_prompt_len` keeps the user-visible split between prompt and output.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


class LlmRequestState(enum.IntEnum):
    """Lifecycle of a request; ordered, a request is schedulable while
    `CONTEXT_INIT <= state < GENERATION_COMPLETE`."""

    UNKNOWN = 0  # known to the engine but not yet schedulable
    CONTEXT_INIT = 1  # prompt (or the rest of it) still has to go through the model
    GENERATION_IN_PROGRESS = 2  # prompt done, one token per step
    GENERATION_TO_COMPLETE = 3  # last token produced, awaiting final bookkeeping; not run again
    GENERATION_COMPLETE = 4  # finished or aborted; holds no resources


@dataclass(eq=False)
class LlmRequest:
    """A request plus the progress the scheduler tracks for it.

    `eq=False` keeps identity semantics: two requests with equal fields are still two
    requests, and they can be used in sets and as dict keys.
    """

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    priority: float = 0.0  # higher runs first; ties are broken by arrival_time
    arrival_time: float = field(default_factory=time.monotonic)
    sampling_params: Any = None  # opaque to the scheduler
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    # Tokens of the (possibly pause-extended) prompt already in the KV cache.
    context_current_position: int = 0
    # Prompt tokens scheduled in the current step (set by the micro-batch scheduler).
    context_chunk_size: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    # Prompt tokens that were found in the prefix cache instead of being computed.
    prepopulated_prompt_len: int = 0
    num_pauses: int = 0
    # Set by the engine at admission and as tokens come back:
    seed: Optional[int] = None  # this sequence's sampling seed (None: unseeded)
    end_ids: tuple[int, ...] = ()  # token ids that end generation
    cumulative_logprob: float = 0.0  # sum of the chosen tokens' logprobs (when logprobs are requested)
    stop_reason: Any = None  # the stop string or token id that finished the request, if any
    # Row of this request in the step that sampled its newest output token, while that token
    # is still on the device (the engine's placeholder); the next step reads it from there.
    feed_row: int = -1
    # The request's LoRA adapter (a `jaxllm.lora.LoraAdapter`), None for the base model.
    lora_adapter: Any = None
    # KvCacheRetentionConfig: retention priorities of this request's cached blocks (None: default).
    kv_cache_retention_config: Any = None
    # Beam search: beams kept per step (the KV cache reserves blocks for all of them), and the
    # engine's beam state (`jaxllm.engine.beam_search`) while the request runs.
    beam_width: int = 1
    beam: Any = None
    # False: compute the whole prompt even if its prefix is cached (its logits are wanted).
    reuse_prefix: bool = True
    # Logits outputs asked for and gathered so far (jaxllm.engine.logits_outputs.LogitsRecord).
    logits_record: Any = None
    # Speculative decoding: draft tokens this request verified, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    orig_prompt_len: int = field(init=False)
    orig_max_new_tokens: int = field(init=False)
    _prompt_array: Optional[np.ndarray] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Own copy: pause() extends the prompt and must not touch the caller's list.
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.orig_prompt_len = len(self.prompt_token_ids)
        self.orig_max_new_tokens = self.max_new_tokens

    # ------------------------------------------------------------------ lengths
    @property
    def prompt_len(self) -> int:
        """Current prompt length, including generated tokens folded in by `pause()`."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is or will be in the cache: prompt + generated tokens not yet
        folded into the prompt. The last generated token's KV is written by the next step."""
        return self.orig_prompt_len + len(self.output_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def orig_prompt_token_ids(self) -> list[int]:
        """The prompt as the user sent it."""
        return self.prompt_token_ids[: self.orig_prompt_len]

    @property
    def context_remaining_length(self) -> int:
        return len(self.prompt_token_ids) - self.context_current_position

    def get_context_remaining_length(self) -> int:
        return len(self.prompt_token_ids) - self.context_current_position

    @property
    def reached_max_new_tokens(self) -> bool:
        """True once the user-visible output holds `max_new_tokens` (as first requested)."""
        return len(self.output_token_ids) >= self.orig_max_new_tokens

    @property
    def max_seq_len_needed(self) -> int:
        """Upper bound on the sequence length: prompt + max_new_tokens. Invariant under pause."""
        return len(self.prompt_token_ids) + self.max_new_tokens

    # ------------------------------------------------------------------- phases
    @property
    def is_context_phase(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    @property
    def is_generation_phase(self) -> bool:
        return (
            self.state == LlmRequestState.GENERATION_IN_PROGRESS or self.state == LlmRequestState.GENERATION_TO_COMPLETE
        )

    @property
    def is_finished(self) -> bool:
        return self.state == LlmRequestState.GENERATION_COMPLETE

    @property
    def is_first_context_chunk(self) -> bool:
        """No prompt token has been computed yet (reused prefix tokens do not count)."""
        return self.context_current_position == self.prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        """The chunk scheduled this step finishes the prompt (so the step samples a token)."""
        return self.context_current_position + self.context_chunk_size == len(self.prompt_token_ids)

    # Alias under the name TensorRT-LLM's Python bindings use.
    last_token_is_final_context_chunk = is_last_context_chunk

    # ------------------------------------------------------------------- tokens
    def get_tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the full sequence (prompt then pending generated tokens)."""
        prompt = self.prompt_token_ids
        plen = len(prompt)
        if end <= plen:
            return prompt[start:end]
        moved = plen - self.orig_prompt_len
        out = self.output_token_ids
        if start >= plen:
            return out[moved + start - plen : moved + end - plen]
        return prompt[start:] + out[moved : moved + end - plen]

    @property
    def all_token_ids(self) -> list[int]:
        """The full sequence: prompt followed by generated tokens not folded into it."""
        return self.get_tokens(0, self.num_tokens)

    def prompt_array(self) -> np.ndarray:
        """The prompt as an int32 array, cached so batch building avoids list conversion."""
        arr = self._prompt_array
        if arr is None or arr.shape[0] != len(self.prompt_token_ids):
            arr = np.asarray(self.prompt_token_ids, dtype=np.int32)
            self._prompt_array = arr
        return arr

    # ------------------------------------------------------- step bookkeeping
    def move_to_next_context_chunk(self) -> bool:
        """Account for the chunk that just ran. Returns True if the prompt is now complete
        (the step then also produced this request's next token: call `add_new_token`)."""
        if self.state != LlmRequestState.CONTEXT_INIT:
            raise ValueError(f"request {self.request_id}: not in the context phase ({self.state.name})")
        position = self.context_current_position + self.context_chunk_size
        if position > len(self.prompt_token_ids):
            raise ValueError(
                f"request {self.request_id}: chunk of {self.context_chunk_size} at position "
                f"{self.context_current_position} runs past the prompt ({len(self.prompt_token_ids)})"
            )
        self.context_current_position = position
        self.context_chunk_size = 0
        return position == len(self.prompt_token_ids)

    def add_new_token(self, token_id: int) -> None:
        """Append a sampled token; after the last context chunk this starts generation."""
        state = self.state
        if state == LlmRequestState.CONTEXT_INIT:
            if self.context_current_position != len(self.prompt_token_ids):
                raise ValueError(
                    f"request {self.request_id}: token added before the prompt was complete "
                    f"({self.context_current_position}/{len(self.prompt_token_ids)}); "
                    "call move_to_next_context_chunk() first"
                )
            self.state = LlmRequestState.GENERATION_IN_PROGRESS
        elif state == LlmRequestState.GENERATION_COMPLETE or state == LlmRequestState.UNKNOWN:
            raise ValueError(f"request {self.request_id}: cannot add a token in state {state.name}")
        self.output_token_ids.append(token_id)

    def finish(self, reason: Optional[str] = None) -> None:
        """Mark the request complete ('stop', 'length', 'cancelled', ...). The caller frees
        its KV blocks in the same step (`KVCacheManager.free_resources`)."""
        self.state = LlmRequestState.GENERATION_COMPLETE
        self.finish_reason = reason
        self.context_chunk_size = 0

    def pause(self) -> None:
        """Send the request back to CONTEXT_INIT so it is recomputed later.

        Generated tokens join the prompt and `max_new_tokens` shrinks by the same count, so
        the final output is unchanged. The caller frees the KV blocks first (with prefix
        reuse on, the blocks stay cached and the recompute is mostly a cache hit).
        Pausing twice in a row is harmless: the second call has nothing to move.
        """
        if self.state == LlmRequestState.GENERATION_COMPLETE:
            raise ValueError(f"request {self.request_id}: cannot pause a finished request")
        moved = len(self.prompt_token_ids) - self.orig_prompt_len
        pending = self.output_token_ids[moved:]
        if pending:
            self.prompt_token_ids.extend(pending)
            self.max_new_tokens -= len(pending)
            self._prompt_array = None
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = 0
        self.prepopulated_prompt_len = 0
        self.num_pauses += 1
