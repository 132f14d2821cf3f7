"""The scheduler interfaces a user subclasses to plug in their own policy.

Two-step scheduling (TensorRT-LLM's design): a `CapacityScheduler` decides which requests
get KV-cache resources this step, then a micro-batch scheduler picks what actually runs
within `max_batch_size` / `max_num_tokens`. `SimpleScheduler` chains the two. A policy
that does not fit that split subclasses `RequestScheduler` and implements
`schedule_request` directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from operator import attrgetter
from typing import Optional

from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.scheduler.output import SchedulerOutput

RequestList = list[LlmRequest]

_by_arrival = attrgetter("arrival_time")
_by_priority = attrgetter("priority")


def order_by_priority(requests: Iterable[LlmRequest]) -> RequestList:
    """Higher priority first, ties by arrival time, remaining ties in the given order."""
    ordered = sorted(requests, key=_by_arrival)
    ordered.sort(key=_by_priority, reverse=True)  # stable, so arrival order survives
    return ordered


class RequestScheduler(ABC):
    """Decides, each step, which requests run and how many prompt tokens each processes."""

    @abstractmethod
    def schedule_request(
        self, active_requests: RequestList, inflight_request_ids: Optional[set[int]] = None
    ) -> SchedulerOutput:
        """:param active_requests: every unfinished request the engine knows about.
        :param inflight_request_ids: requests still running in an overlapped step, or whose
            KV blocks are still arriving from the host tier; they must not be scheduled. The
            set may grow while the capacity scheduler admits requests.
        """


class CapacityScheduler(ABC):
    """Chooses the requests that get KV resources this step (and may pause some).

    Only requests with `no_schedule_until_state <= state < no_schedule_after_state` are
    considered. Estimates must come from the KV cache manager's
    `get_needed_resource_to_completion` / `get_needed_resource_for_step` so they agree
    with what `prepare_resources` allocates.
    """

    no_schedule_until_state = LlmRequestState.CONTEXT_INIT
    no_schedule_after_state = LlmRequestState.GENERATION_COMPLETE
    # LoRA adapter slots handed out with the KV blocks (a `jaxllm.lora.LoraSlots`), or None.
    lora_slots = None

    @abstractmethod
    def schedule_request(self, active_requests: RequestList) -> tuple[RequestList, RequestList]:
        """Returns `(fitting_requests, paused_requests)`."""

    def schedulable_in_order(self, active_requests: Iterable[LlmRequest]) -> RequestList:
        """The schedulable requests, higher priority first, then by arrival."""
        lo, hi = self.no_schedule_until_state, self.no_schedule_after_state
        return order_by_priority(r for r in active_requests if lo <= r.state < hi)
