"""In-flight batching scheduler (TensorRT-LLM names): capacity policies, micro-batching
with context chunking, and the `SimpleScheduler` that combines them."""

from jaxllm.scheduler.base import CapacityScheduler, RequestList, RequestScheduler, order_by_priority
from jaxllm.scheduler.capacity import GuaranteedNoEvictScheduler, MaxUtilizationScheduler, StaticBatchScheduler
from jaxllm.scheduler.micro_batch import ContextChunkingConfig, MicroBatchScheduler
from jaxllm.scheduler.output import SchedulerOutput
from jaxllm.scheduler.simple import SimpleScheduler, check_request_admissible, make_scheduler

__all__ = [
    "CapacityScheduler",
    "ContextChunkingConfig",
    "GuaranteedNoEvictScheduler",
    "MaxUtilizationScheduler",
    "MicroBatchScheduler",
    "RequestList",
    "RequestScheduler",
    "SchedulerOutput",
    "SimpleScheduler",
    "StaticBatchScheduler",
    "check_request_admissible",
    "make_scheduler",
    "order_by_priority",
]
