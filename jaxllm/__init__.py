"""jaxllm: an LLM inference engine in JAX and Pallas.

Everything a user passes to `LLM(...)` or `LLM.generate` is importable from here, as from
TensorRT-LLM's `tensorrt_llm.llmapi`: `from jaxllm import LLM, SamplingParams, KvCacheConfig`."""

import importlib

from jaxllm.llm_args import (
    CacheTransceiverConfig,
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    DisaggregatedParams,
    KvCacheConfig,
    MoeConfig,
    SchedulerConfig,
)

__version__ = "0.1.0"

# Imported on first use so `import jaxllm` stays cheap (e.g. for the CLI's --help): name -> module.
_LAZY = {
    "LLM": "jaxllm.llm",
    "LoRARequest": "jaxllm.lora.lora_request",
    "SamplingParams": "jaxllm.sampling",
    "GuidedDecodingParams": "jaxllm.sampling",
    "KvCacheRetentionConfig": "jaxllm.kv_cache.retention",
    "TokenRangeRetentionConfig": "jaxllm.kv_cache.retention",
    "MoeLoadBalancerConfig": "sharding.eplb.eplb_config",
    "RequestOutput": "jaxllm.outputs",
    "CompletionOutput": "jaxllm.outputs",
    "NGramDecodingConfig": "jaxllm.speculative_config",
    "MTPDecodingConfig": "jaxllm.speculative_config",
    "DraftTargetDecodingConfig": "jaxllm.speculative_config",
    "EagleDecodingConfig": "jaxllm.speculative_config",
}

__all__ = [
    "LLM",
    "SamplingParams",
    "GuidedDecodingParams",
    "LoRARequest",
    "KvCacheConfig",
    "KvCacheRetentionConfig",
    "TokenRangeRetentionConfig",
    "SchedulerConfig",
    "CapacitySchedulerPolicy",
    "ContextChunkingPolicy",
    "MoeConfig",
    "MoeLoadBalancerConfig",
    "CacheTransceiverConfig",
    "DisaggregatedParams",
    "RequestOutput",
    "CompletionOutput",
    "NGramDecodingConfig",
    "MTPDecodingConfig",
    "DraftTargetDecodingConfig",
    "EagleDecodingConfig",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
