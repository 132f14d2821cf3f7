"""The default scheduler (capacity, then micro-batch), its factory and admission checks."""

from __future__ import annotations

from typing import Optional

from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_args import CapacitySchedulerPolicy, SchedulerConfig
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler.base import CapacityScheduler, RequestList, RequestScheduler
from jaxllm.scheduler.capacity import GuaranteedNoEvictScheduler, MaxUtilizationScheduler, StaticBatchScheduler
from jaxllm.scheduler.micro_batch import ContextChunkingConfig, MicroBatchScheduler
from jaxllm.scheduler.output import SchedulerOutput


class SimpleScheduler(RequestScheduler):
    """Runs the capacity scheduler, then the micro-batch scheduler on what fits."""

    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler) -> None:
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(
        self, active_requests: RequestList, inflight_request_ids: Optional[set[int]] = None
    ) -> SchedulerOutput:
        fitting, paused = self.capacity_scheduler.schedule_request(active_requests)
        context, generation = self.micro_batch_scheduler.schedule(fitting, inflight_request_ids)
        return SchedulerOutput(context, generation, paused, len(fitting))


_CAPACITY_SCHEDULERS: dict[CapacitySchedulerPolicy, type] = {
    CapacitySchedulerPolicy.GUARANTEED_NO_EVICT: GuaranteedNoEvictScheduler,
    CapacitySchedulerPolicy.MAX_UTILIZATION: MaxUtilizationScheduler,
    CapacitySchedulerPolicy.STATIC_BATCH: StaticBatchScheduler,
}


def make_scheduler(
    scheduler_config: Optional[SchedulerConfig],
    kv_cache_manager: KVCacheManager,
    max_batch_size: int,
    max_num_tokens: int,
    enable_chunked_prefill: bool,
    max_context_length: Optional[int] = None,
    lora_slots=None,
    max_tokens_with_generation: Optional[int] = None,
) -> SimpleScheduler:
    """Build the scheduler the engine uses from the user's `SchedulerConfig` (`lora_slots`:
    the engine's `jaxllm.lora.LoraSlots`, a resource of the capacity scheduler)."""
    config = scheduler_config if scheduler_config is not None else SchedulerConfig()
    capacity_cls = _CAPACITY_SCHEDULERS[config.capacity_scheduler_policy]
    capacity = capacity_cls(max_batch_size, kv_cache_manager)
    capacity.lora_slots = lora_slots
    chunking = None
    if enable_chunked_prefill:
        chunking = ContextChunkingConfig(config.context_chunking_policy, kv_cache_manager.tokens_per_block)
    micro = MicroBatchScheduler(
        max_batch_size,
        max_num_tokens,
        chunking,
        max_context_length=max_context_length,
        max_tokens_with_generation=max_tokens_with_generation if chunking is not None else None,
    )
    return SimpleScheduler(capacity, micro)


def check_request_admissible(
    req: LlmRequest,
    kv_cache_manager: KVCacheManager,
    max_seq_len: int,
    *,
    max_num_tokens: Optional[int] = None,
    enable_chunked_prefill: bool = True,
) -> None:
    """Raise ValueError if the request could never complete, instead of letting it wait
    forever: too long for `max_seq_len`, more blocks than a block table row holds, or more
    blocks than the whole KV pool. With chunked prefill off, a prompt must also fit
    `max_num_tokens` (pass it to check that)."""
    prompt_len = req.prompt_len
    total = prompt_len + req.max_new_tokens
    if total > max_seq_len:
        raise ValueError(
            f"request {req.request_id}: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({req.max_new_tokens}) = {total} exceeds max_seq_len ({max_seq_len})"
        )
    kv = kv_cache_manager
    blocks = kv.blocks_for_tokens(total)
    if blocks > kv.max_blocks_per_seq:
        raise ValueError(
            f"request {req.request_id}: {total} tokens need {blocks} KV blocks of "
            f"{kv.tokens_per_block} tokens, more than max_blocks_per_seq ({kv.max_blocks_per_seq})"
        )
    if blocks > kv.get_max_resource_count():
        raise ValueError(
            f"request {req.request_id}: {total} tokens need {blocks} KV blocks but the whole KV "
            f"cache has {kv.get_max_resource_count()} blocks ({kv.num_kv_slots} tokens); increase "
            "KvCacheConfig.max_tokens / free_gpu_memory_fraction or lower max_new_tokens"
        )
    if max_num_tokens is not None and not enable_chunked_prefill and prompt_len > max_num_tokens:
        raise ValueError(
            f"request {req.request_id}: prompt ({prompt_len} tokens) exceeds max_num_tokens "
            f"({max_num_tokens}); enable chunked prefill or raise max_num_tokens"
        )
