"""Asynchronous generation: `GenerationExecutor`, `GenerationRequest`, `GenerationResult`.

Imports are lazy so that postprocess worker processes, which import this package, load
neither JAX nor the engine.
"""

from __future__ import annotations

__all__ = ["ExecutorConfig", "GenerationExecutor", "GenerationRequest", "GenerationResult"]


def __getattr__(name: str):
    if name in ("GenerationExecutor", "ExecutorConfig"):
        from jaxllm.executor import executor

        return getattr(executor, name)
    if name == "GenerationRequest":
        from jaxllm.executor.generation_request import GenerationRequest

        return GenerationRequest
    if name == "GenerationResult":
        from jaxllm.executor.result import GenerationResult

        return GenerationResult
    raise AttributeError(name)
