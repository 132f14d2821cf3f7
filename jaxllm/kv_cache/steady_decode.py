"""Steady decode: the same generation requests, in the same order, step after step.

Their block-table rows and the `num_tokens` at which each next needs a block (or can
index a full one) are kept as arrays, so preparing such a step is a few numpy operations
instead of a pass over the requests: only the sequences at a block boundary are visited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxllm.llm_request import LlmRequest

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.kv_cache.sequence import KvSequence


@dataclass
class DecodeRows:
    """Per-slot arrays of a steady decode batch: block-table rows, prompt lengths, and the
    `num_tokens` at which each sequence next needs a block or can index a full one."""

    requests: list[LlmRequest]
    version: int  # the manager's free counter when recorded (a free voids the rows)
    rows: np.ndarray  # intp[n] block-table row of each request
    orig_prompt_len: np.ndarray  # int64[n]
    next_event: np.ndarray  # int64[n] `KvSequence.next_event` of each request
    num_tokens: np.ndarray  # int64[n] num_tokens of each request in the last prepared step
    # The token entries of the last step committed from these rows (the planner's record).
    entries: list | None = None
    # The planner's `DecodeTokenLog` of these rows (tokens not yet in the requests' lists).
    log: Any | None = None

    @classmethod
    def record(
        cls,
        requests: list[LlmRequest],
        version: int,
        rows: list[int],
        num_tokens: list[int],
        next_events: Iterable[int],
    ) -> DecodeRows:
        """The arrays of a generation-only step just prepared (rows and `num_tokens` of
        its placement, the sequences' `next_event`s)."""
        n = len(requests)
        return cls(
            requests=list(requests),
            version=version,
            rows=np.array(rows, np.intp).reshape(n),
            orig_prompt_len=np.fromiter((r.orig_prompt_len for r in requests), np.int64, n),
            next_event=np.fromiter(next_events, np.int64, n),
            num_tokens=np.array(num_tokens, np.int64).reshape(n),
        )

    def advance(
        self,
        seqs: Mapping[int, KvSequence],
        prepare: Callable[[KvSequence, LlmRequest, int], None],
        flush_rows: Callable[[list[int]], None] | None = None,
    ) -> np.ndarray:
        """Move every slot one token on (each got one token from the step before) and
        return the new `num_tokens`. `prepare(seq, request, num_tokens)` is called for the
        slots at a block boundary (`seqs`: the sequences by request id) and updates their
        `next_event`; `flush_rows(slots)` first brings those slots' read-back tokens into
        their requests (a block is indexed by its tokens) when the caller keeps them
        elsewhere."""
        num_tokens = self.num_tokens + 1
        due = np.flatnonzero(num_tokens >= self.next_event)
        if due.size:
            requests, next_event = self.requests, self.next_event
            due_rows = due.tolist()
            if flush_rows is not None:
                flush_rows(due_rows)
            for i in due_rows:
                request = requests[i]
                seq = seqs[request.request_id]
                prepare(seq, request, int(num_tokens[i]))
                next_event[i] = seq.next_event
        self.num_tokens = num_tokens
        return num_tokens
