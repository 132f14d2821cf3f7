"""What one engine step reports: per-request updates, and one batched value for plain decode rows.

A steady decode step gives each of its requests one token; most of those tokens neither end
the request nor carry logprobs. Building a `RequestUpdate` object per request per step for
them costs the step loop more than the rest of reading the step back, so those rows travel
as one `DecodeTokens` (requests and token ids, two lists). `StepUpdates` holds both; the
executor's engine thread hands the batched rows to the output side as one event, and any
other caller iterates it and gets `RequestUpdate`s (made on demand for the batched rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from jaxllm.llm_request import LlmRequest
from jaxllm.outputs import Logprob

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.engine.beam_search import BeamHypothesis


@dataclass(slots=True)
class RequestUpdate:
    """What one processed step produced for one request."""

    request: LlmRequest
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    # Set when the engine failed this request (finish_reason 'error'): what went wrong.
    error: Optional[str] = None
    # Beam search, on the final update: the n best beams, best first (new_token_ids is the best).
    beam_outputs: Optional[list[BeamHypothesis]] = None


@dataclass(slots=True)
class DecodeTokens:
    """One new token for each of `requests` (`token_ids[i]` for `requests[i]`): rows of a
    steady decode step whose token neither finished the request nor carries logprobs."""

    requests: list[LlmRequest]
    token_ids: list[int]
    # The requests' ids, in the same order (kept per steady batch, so reporting a step needs
    # no pass over its requests); never written by a consumer.
    request_ids: list[int]

    def updates(self) -> Iterator[RequestUpdate]:
        return map(_plain_update, self.requests, self.token_ids)


def _plain_update(request: LlmRequest, token: int) -> RequestUpdate:
    return RequestUpdate(request, [token])


class StepUpdates:
    """The updates of one step: `updates` (finished, failed, logprobs, beam-search and general
    path rows) and `decoded` (batched plain decode rows), in the order they were read back.
    Iterating gives every update as a `RequestUpdate`, the per-request ones first (batched rows
    followed by later per-request updates are turned into per-request updates when added)."""

    __slots__ = ("updates", "decoded")

    def __init__(
        self, updates: Optional[list[RequestUpdate]] = None, decoded: Optional[list[DecodeTokens]] = None
    ) -> None:
        self.updates: list[RequestUpdate] = [] if updates is None else updates
        self.decoded: list[DecodeTokens] = [] if decoded is None else decoded

    def __iter__(self) -> Iterator[RequestUpdate]:
        yield from self.updates
        for batch in self.decoded:
            yield from batch.updates()

    def __len__(self) -> int:
        return len(self.updates) + sum(len(batch.requests) for batch in self.decoded)

    def __bool__(self) -> bool:
        return bool(self.updates) or any(batch.requests for batch in self.decoded)

    def __getitem__(self, index: Union[int, slice]) -> Union[RequestUpdate, list[RequestUpdate]]:
        return list(self)[index]

    def __iadd__(self, other: Union[StepUpdates, Iterable[RequestUpdate]]) -> StepUpdates:
        later = other.updates if isinstance(other, StepUpdates) else list(other)
        if later and self.decoded:
            # A step that read back two steps (the one before a drafting or history-needing
            # step, then that step): the earlier batch's tokens come first, so they become
            # per-request updates ahead of the later ones.
            self.updates += [update for batch in self.decoded for update in batch.updates()]
            self.decoded = []
        self.updates += later
        if isinstance(other, StepUpdates):
            self.decoded += other.decoded
        return self

    def __repr__(self) -> str:
        return f"StepUpdates({len(self.updates)} updates, {sum(len(b.requests) for b in self.decoded)} decoded rows)"

    @property
    def num_finished(self) -> int:
        """Requests that finished in this step (batched rows never do)."""
        return sum(u.finished for u in self.updates)
