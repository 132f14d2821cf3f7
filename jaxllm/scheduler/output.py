"""What one scheduling decision produces, and how a finished step is applied to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxllm.llm_request import LlmRequest


@dataclass
class SchedulerOutput:
    """Requests of one step. The packed token buffer holds the context chunks first (in
    this order, `context_chunk_size` tokens each), then one token per generation request.

    `paused_requests` were evicted by the capacity scheduler this step; they are already
    paused and their blocks freed (calling `pause()`/`free_resources()` again is a no-op).
    """

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    paused_requests: list[LlmRequest] = field(default_factory=list)
    num_fitting_requests: int = 0  # requests the capacity scheduler let through
    # Context tokens scheduled, taken when the output is built so it stays valid after
    # the step moved the requests past their chunks (for iteration stats).
    num_context_tokens: int = field(init=False)
    # Recorded by KVCacheManager.prepare_resources (a StepPlacement) for the batch builder.
    kv_placement: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_context_tokens = sum(r.context_chunk_size for r in self.context_requests)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_generation_tokens(self) -> int:
        return len(self.generation_requests)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed buffer before padding."""
        return self.num_context_tokens + len(self.generation_requests)

    @property
    def is_generation_only(self) -> bool:
        return not self.context_requests

    @property
    def is_empty(self) -> bool:
        return not self.context_requests and not self.generation_requests

    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests
