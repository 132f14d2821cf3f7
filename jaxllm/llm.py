"""`LLM`: the offline entry point (`LLM(model).generate(prompts, sampling_params)`).

A thin front on `GenerationExecutor`: the engine runs on the executor's background
thread, `generate` submits every prompt and waits, `generate_async` returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Optional, Union

from tqdm.auto import tqdm

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.executor.executor import EXECUTOR_FIELDS, ExecutorConfig, GenerationExecutor
from jaxllm.executor.inputs import PromptInput, is_single_prompt, normalize_inputs
from jaxllm.executor.result import GenerationResult
from jaxllm.kv_cache.retention import KvCacheRetentionConfig
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sampling import SamplingParams

_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


WARMUP_MODES = ("background", "all", "none")


class LLM:
    """Loads a model and generates for batches of prompts with in-flight batching.

    `warmup` says what compiles before the constructor returns: "background" (default) the
    steps a lone user needs, the decode token bucket and the one-row decode bucket with the greedy sampler,
    the rest when they pay for themselves or the engine is idle (`LLMEngine.warmup`); "all"
    every bucket and sampler variant; "none" nothing (each program compiles when first needed).
    """

    def __init__(
        self,
        model: str,
        tokenizer: Optional[str] = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        warmup: str = "background",
        **kwargs,
    ) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_FIELDS - set(EXECUTOR_FIELDS))
        if unknown:
            raise ValueError(f"unknown argument(s) for LLM: {', '.join(unknown)}")
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {warmup!r}")
        executor_kwargs = {k: kwargs.pop(k) for k in EXECUTOR_FIELDS if k in kwargs}
        executor_config = ExecutorConfig(**executor_kwargs)
        engine_config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size, **kwargs
        )
        self._executor = GenerationExecutor(engine_config, executor_config)
        self._owns_executor = True
        self.tokenizer = self._executor.tokenizer
        if warmup != "none":
            try:
                self._executor.call_on_engine(
                    lambda engine: engine.warmup(all_variants=True, background=warmup == "background"), timeout=None
                )
            except BaseException:
                self._executor.shutdown()
                raise

    @classmethod
    def from_executor(cls, executor: GenerationExecutor) -> LLM:
        """An `LLM` over an existing executor (e.g. one that also serves HTTP). An explicit
        shutdown() ends the executor; merely dropping the `LLM` does not."""
        llm = cls.__new__(cls)
        llm._executor = executor
        llm._owns_executor = False
        llm.tokenizer = executor.tokenizer
        return llm

    # ----------------------------------------------------------------- accessors
    @property
    def executor(self) -> GenerationExecutor:
        return self._executor

    @property
    def engine(self):
        """The engine; it belongs to the executor's thread, so only inspect it while idle."""
        return self._executor.engine

    def _check_open(self) -> None:
        if self._executor is None or not self._executor.is_healthy:
            error = None if self._executor is None else self._executor.error
            if error is not None:
                raise RuntimeError(f"the LLM failed and is shut down: {error!r}") from error
            raise RuntimeError("the LLM is shut down")

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        inputs,
        sampling_params=None,
        use_tqdm: bool = True,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
        *,
        kv_cache_retention_config=None,
    ) -> Union[RequestOutput, list[RequestOutput]]:
        """Generate for one prompt (returns one output) or a list (returns a list, same order).
        `lora_request`: the LoRA adapter of every prompt, or a list with one (or None) per prompt.

        Every prompt is validated before any is queued, so a bad prompt raises ValueError
        and leaves the engine untouched. `kv_cache_retention_config`: one
        `KvCacheRetentionConfig` for every prompt, or a list with one per prompt.
        """
        self._check_open()
        batch = normalize_inputs(inputs, sampling_params, lora_request, kv_cache_retention_config)
        results = self._executor.submit_batch(batch)
        outputs = []
        try:
            with tqdm(total=len(results), desc="generate", unit="req", disable=not use_tqdm or len(results) < 2) as bar:
                for result in results:
                    outputs.append(result.result())
                    bar.update(1)
        except BaseException:
            for result in results:  # e.g. KeyboardInterrupt: do not leave the batch running
                result.abort()
            raise
        return outputs[0] if batch.single else outputs

    def generate_async(
        self,
        inputs: PromptInput,
        sampling_params: Optional[SamplingParams] = None,
        streaming: bool = False,
        *,
        priority: float = 0.0,
        timeout: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
        kv_cache_retention_config: Optional[KvCacheRetentionConfig] = None,
        disaggregated_params: Optional[DisaggregatedParams] = None,
    ) -> GenerationResult:
        """Submit one prompt and return its `GenerationResult` at once (stream it, or await it);
        `lora_request`: the LoRA adapter to run it with; `kv_cache_retention_config`: retention
        priorities of its cached KV blocks; `disaggregated_params`: a context-only or
        generation-only request (the LLM needs cache_transceiver_config)."""
        self._check_open()
        if not is_single_prompt(inputs):
            raise ValueError("generate_async takes one prompt (a str or a list of int token ids)")
        return self._executor.generate_async(
            inputs,
            sampling_params,
            streaming,
            priority=priority,
            timeout=timeout,
            lora_request=lora_request,
            kv_cache_retention_config=kv_cache_retention_config,
            disaggregated_params=disaggregated_params,
        )

    def get_stats(self, timeout: Optional[float] = 2.0) -> list[dict]:
        """Iteration stats since the previous call, waiting up to `timeout` seconds for one."""
        self._check_open()
        return self._executor.get_stats(timeout)

    def get_kv_cache_events(self, timeout: Optional[float] = 2.0) -> list[dict]:
        """KV cache events (created / stored / removed / updated blocks, TensorRT-LLM's shape)
        since the previous call, waiting up to `timeout` seconds for one. Needs
        `kv_cache_config=KvCacheConfig(event_buffer_max_size=N)`; empty otherwise."""
        self._check_open()
        return self._executor.get_kv_cache_events(timeout)

    def shutdown(self) -> None:
        """Cancel what is still running and stop the background thread (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Threads hold the executor, not the LLM: dropping the last LLM reference ends them.
        try:
            if getattr(self, "_owns_executor", False):
                self.shutdown()
        except Exception:
            pass
