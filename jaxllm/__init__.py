"""jaxllm: an LLM inference engine in JAX and Pallas."""

from jaxllm.llm_args import KvCacheConfig, MoeConfig, SchedulerConfig

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "KvCacheConfig",
    "KvCacheRetentionConfig",
    "MoeConfig",
    "SchedulerConfig",
    "TokenRangeRetentionConfig",
    "__version__",
]


def __getattr__(name: str):
    # Import the heavy parts lazily so `import jaxllm` stays cheap (e.g. for the CLI's --help).
    if name == "LLM":
        from jaxllm.llm import LLM

        return LLM
    if name == "LoRARequest":
        from jaxllm.lora.lora_request import LoRARequest

        return LoRARequest
    if name in ("KvCacheRetentionConfig", "TokenRangeRetentionConfig"):
        from jaxllm.kv_cache import retention

        return getattr(retention, name)
    if name == "SamplingParams":
        from jaxllm.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
