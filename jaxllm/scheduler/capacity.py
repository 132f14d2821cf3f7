"""Capacity policies: which requests get KV-cache blocks this step.

A request is *started* once the KV cache manager tracks it (`has_sequence`): it was
admitted before and may hold blocks. Started requests always come before new ones, so a
request that was let in is never starved by later arrivals.

* `GuaranteedNoEvictScheduler`: reserve every started request's blocks to completion,
  then admit new requests in order while their to-completion need fits; the first that
  does not fit stops admission. Never pauses anything.
* `StaticBatchScheduler`: the same, but new requests only enter when nothing is started.
* `MaxUtilizationScheduler`: reserve only this step's blocks; when a request does not
  fit (blocks or request slots), pause the last started request in scheduling order
  (lowest priority, most recent arrival), free its blocks and retry.

New requests are added to the KV cache manager at admission (`add_sequence`), which
applies prefix reuse before the micro-batch scheduler sizes their chunks.

LoRA adapter slots (`lora_slots`, a `jaxllm.lora.LoraSlots`, when the engine serves
adapters) are a second resource: a new request whose adapter is not resident and for which
no slot can be freed (every slot is held by running requests of other adapters) waits,
and the requests behind it go on.
"""

from __future__ import annotations

from typing import Optional

from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.scheduler.base import CapacityScheduler, RequestList, order_by_priority

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS
_GENERATION_TO_COMPLETE = LlmRequestState.GENERATION_TO_COMPLETE


def _check_max_num_requests(max_num_requests: int) -> None:
    if max_num_requests < 1:
        raise ValueError(f"max_num_requests must be >= 1, got {max_num_requests}")


class GuaranteedNoEvictScheduler(CapacityScheduler):
    """Admit a request only if every admitted request can still run to completion."""

    def __init__(self, max_num_requests: int, kv_cache_manager: KVCacheManager, *, static_batch: bool = False) -> None:
        _check_max_num_requests(max_num_requests)
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager
        self.static_batch = static_batch

    def schedule_request(self, active_requests: RequestList) -> tuple[RequestList, RequestList]:
        kv = self.kv_cache_manager
        max_requests = self.max_num_requests
        # Every started request (one the KV cache manager tracks) keeps its reservation
        # to completion, even when it does not get a request slot this step.
        available = kv.get_num_available_blocks() - kv.get_num_reserved_blocks()
        has_sequence = kv.has_sequence
        scheduled: RequestList = []
        pending: RequestList = []
        for req in order_by_priority(active_requests):
            state = req.state
            if state is _CONTEXT_INIT:
                if not has_sequence(req):
                    pending.append(req)
                    continue
            elif state is not _GENERATION_IN_PROGRESS and state is not _GENERATION_TO_COMPLETE:
                continue  # not schedulable
            if len(scheduled) < max_requests:
                scheduled.append(req)
        if self.static_batch and scheduled:
            return scheduled, []
        lora_slots = self.lora_slots
        for req in pending:
            if len(scheduled) >= max_requests:
                break
            needed = kv.get_needed_resource_to_completion(req)
            if needed > available:
                break  # no skipping ahead: keeps arrival (and priority) order fair
            if lora_slots is not None and not lora_slots.acquire(req):
                continue  # no adapter slot until a running request of another adapter ends
            kv.add_sequence(req)
            scheduled.append(req)
            available -= needed
        return scheduled, []


class StaticBatchScheduler(GuaranteedNoEvictScheduler):
    """Run batches to the end: admit new requests only when no request is started."""

    def __init__(self, max_num_requests: int, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(max_num_requests, kv_cache_manager, static_batch=True)


class MaxUtilizationScheduler(CapacityScheduler):
    """Fill the pool step by step; pause started requests when it runs out."""

    def __init__(self, max_num_requests: int, kv_cache_manager: KVCacheManager) -> None:
        _check_max_num_requests(max_num_requests)
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager

    def schedule_request(self, active_requests: RequestList) -> tuple[RequestList, RequestList]:
        kv = self.kv_cache_manager
        max_requests = self.max_num_requests
        order = order_by_priority(active_requests)
        available = kv.get_num_available_blocks()
        needed_for_step = kv.get_needed_resource_for_step
        scheduled: RequestList = []
        paused: RequestList = []
        end = len(order)
        i = 0
        while i < end:
            req = order[i]
            state = req.state
            if (
                state is not _GENERATION_IN_PROGRESS
                and state is not _CONTEXT_INIT
                and state is not _GENERATION_TO_COMPLETE
            ):
                i += 1  # not schedulable
                continue
            if len(scheduled) < max_requests:
                needed = needed_for_step(req)
                if needed <= available:
                    if req.state is _CONTEXT_INIT and not kv.has_sequence(req):
                        if self.lora_slots is not None and not self.lora_slots.acquire(req):
                            i += 1  # waits for an adapter slot
                            continue
                        kv.add_sequence(req)
                    scheduled.append(req)
                    available -= needed
                    i += 1
                    continue
            victim = self._last_pausable(order, i, end)
            if victim is None:
                break  # only new requests are left; they wait
            victim_req = order[victim]
            available += kv.free_resources(victim_req)
            victim_req.pause()
            paused.append(victim_req)
            end = victim  # everything after the victim ranks lower and waits as well
        return scheduled, paused

    def _last_pausable(self, order: RequestList, start: int, end: int) -> Optional[int]:
        """Index of the last request in `order[start:end]` whose pause frees blocks."""
        kv = self.kv_cache_manager
        for j in range(end - 1, start - 1, -1):
            req: LlmRequest = order[j]
            state = req.state
            if (state is _GENERATION_IN_PROGRESS or state is _CONTEXT_INIT) and kv.get_num_allocated_blocks(req) > 0:
                return j
        return None
