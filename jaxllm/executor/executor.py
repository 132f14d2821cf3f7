"""`GenerationExecutor`: asynchronous request submission over the engine (TensorRT-LLM's executor).

Three parts, as in vLLM V1's split of client, core and output processor:
  * the caller side (`submit`, `abort_request`, ...) validates input (the one check a
    request gets: the engine thread admits what it is handed without checking it again),
    fans a prompt out into its n sequences and queues them; it never waits on the engine;
  * `EngineCore`, a background thread that alone owns the `LLMEngine` and steps it;
  * the output side, a thread that turns token events into text deltas (in-process, or
    routed to `num_postprocess_workers` processes) and hands them to `GenerationResult`s.

Failure semantics: an error that concerns one request (the engine refusing it, its
detokenization failing) fails that request only; an error of the engine itself fails
every waiter with it, marks the executor unhealthy and shuts it down. `shutdown()`
cancels requests in flight, frees their blocks and joins every thread and process.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from jaxllm.engine.admission import AdmittedRequest
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.executor.core import FATAL, SHUTDOWN_EVENT, EngineCore, SequenceRequest
from jaxllm.executor.generation_request import GenerationRequest
from jaxllm.executor.inputs import PromptBatch, PromptInput, normalize_inputs
from jaxllm.executor.live_results import LiveResults
from jaxllm.executor.output_processor import Delta, OutputProcessor, OutputSpec, event_slices
from jaxllm.executor.postprocess import PostprocessWorkerPool
from jaxllm.executor.result import GenerationResult
from jaxllm.kv_cache.retention import KvCacheRetentionConfig
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sampling import SamplingParams, resolve_seed
from sharding.multihost import on_peer_failure

logger = logging.getLogger(__name__)

_live_executors: weakref.WeakSet[GenerationExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_live_executors() -> None:
    for executor in list(_live_executors):
        executor.shutdown()


@dataclass
class ExecutorConfig:
    """Executor options that are not engine options (names follow TensorRT-LLM's LLM API)."""

    num_postprocess_workers: int = 0
    stream_interval: int = 1
    max_buffered_stats: int = 1000

    def __post_init__(self) -> None:
        for name, low in (("num_postprocess_workers", 0), ("stream_interval", 1), ("max_buffered_stats", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


EXECUTOR_FIELDS = ("num_postprocess_workers", "stream_interval")


_SLICE = 32  # events processed between two GIL releases on the output thread


def _with_request_id(processors: list, request_id: int) -> list:
    """Host logits processors called with the request's id (`RequestOutput.request_id`)
    instead of the engine's id of one of its sequences."""

    def bind(fn):
        @functools.wraps(fn)
        def call(_engine_id, token_ids, logits):
            return fn(request_id, token_ids, logits)

        return call

    return [bind(fn) for fn in processors]


class GenerationExecutor:
    """Runs an `LLMEngine` on a background thread; requests go in, `GenerationResult`s come out."""

    def __init__(self, engine: Union[EngineConfig, Any], config: Optional[ExecutorConfig] = None, **kwargs) -> None:
        if config is None:
            config = ExecutorConfig(**kwargs)
        elif kwargs:
            raise ValueError(f"pass either config or keyword options, not both: {', '.join(sorted(kwargs))}")
        self.config = config
        if isinstance(engine, EngineConfig):
            from jaxllm.engine.llm_engine import LLMEngine

            engine = LLMEngine(engine)
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self._encode_lock = threading.Lock()  # HF fast tokenizers must not encode concurrently
        self._cids = itertools.count()
        self._rids = itertools.count()
        self._live = LiveResults()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._stats: collections.deque = collections.deque(maxlen=config.max_buffered_stats)
        self._stats_cond = threading.Condition()
        self.output_seconds = 0.0
        self.output_batches = 0

        tokenizer_dir = self._tokenizer_dir()
        self._pool: Optional[PostprocessWorkerPool] = None
        self._processor: Optional[OutputProcessor] = None
        if config.num_postprocess_workers > 0:
            if tokenizer_dir is None:
                raise ValueError("num_postprocess_workers needs a tokenizer that can be loaded from a directory")
            self._pool = PostprocessWorkerPool(
                config.num_postprocess_workers, tokenizer_dir, on_deltas=self._apply, on_fatal=self._on_fatal
            )
        else:
            self._processor = OutputProcessor(self._private_tokenizer(tokenizer_dir))
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._output_thread = threading.Thread(target=self._output_loop, name="jaxllm-output", daemon=True)
        self._output_thread.start()
        self._core = EngineCore(engine, self._events.put, self._on_stats)
        # Multi-host: a follower that dies or hangs fails every request (before the process exits).
        self._forget_peer_failure = on_peer_failure(lambda message: self._on_fatal(RuntimeError(message)))
        _live_executors.add(self)

    # ------------------------------------------------------------------ setup helpers
    def _tokenizer_dir(self) -> Optional[str]:
        config = getattr(self._engine, "config", None)
        if config is not None and getattr(config, "tokenizer", None):
            return str(config.tokenizer)
        if config is not None:
            from jaxllm.models.resolve import resolve_model

            try:
                return str(resolve_model(config.model))
            except ValueError:
                pass
        path = getattr(self.tokenizer, "name_or_path", None)
        return str(path) if path and Path(path).is_dir() else None

    def _private_tokenizer(self, tokenizer_dir: Optional[str]):
        """A tokenizer of the output thread's own, so decoding never races caller-side encoding."""
        if tokenizer_dir is not None:
            try:
                from jaxllm.tokenizer import load_tokenizer

                return load_tokenizer(tokenizer_dir)
            except ValueError:
                pass
        return self.tokenizer

    # ------------------------------------------------------------------ properties
    @property
    def postprocess_pids(self) -> list[int]:
        """Process ids of the postprocess workers (empty without them)."""
        return [] if self._pool is None else list(self._pool.pids)

    @property
    def engine(self) -> Any:
        """The engine. Only the executor's engine thread may call it; see `call_on_engine`."""
        return self._engine

    @property
    def is_healthy(self) -> bool:
        return self._error is None and not self._closed and self._core.alive

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def max_seq_len(self) -> int:
        return self._engine.max_seq_len

    @property
    def tokenizer_lock(self) -> threading.Lock:
        """Held around every use of `tokenizer` (HF fast tokenizers must not run concurrently)."""
        return self._encode_lock

    # ------------------------------------------------------------------ input
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        if not prompt.isascii():
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"prompt contains a lone surrogate (U+{ord(prompt[exc.start]):04X}) at index "
                    f"{exc.start}, which is not valid Unicode"
                ) from None
        with self._encode_lock:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def make_request(
        self, prompt: PromptInput, sampling_params: Optional[SamplingParams] = None, streaming: bool = False, **kwargs
    ) -> GenerationRequest:
        """Tokenize (if needed) and build a request; raises ValueError on bad input."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            return GenerationRequest(
                self.encode(prompt, params.add_special_tokens), params, streaming, prompt=prompt, **kwargs
            )
        if isinstance(prompt, (list, tuple, np.ndarray)):  # GenerationRequest checks and converts the ids
            return GenerationRequest(prompt, params, streaming, **kwargs)
        raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def validate(self, request: GenerationRequest) -> AdmittedRequest:
        """Check a request against every limit (ValueError naming the field): the one check a
        request gets. The engine's admission (`LLMEngine.validate_request`) is called from
        here, and the engine thread trusts the `AdmittedRequest` it returns."""
        params = request.sampling_params
        if request.streaming and request.num_sequences > params.n:
            raise ValueError("best_of: streaming is not supported when best_of > n")
        if isinstance(params.bad, (str, list, tuple)) and params.bad:
            with self._encode_lock:  # admission counts the tokenized bad words
                params.setup(self.tokenizer)
        extra = {} if request.lora_request is None else {"lora_request": request.lora_request}
        return self._engine.validate_request(request.prompt_token_ids, params, priority=request.priority, **extra)

    def _sequence_params(self, params: SamplingParams, num_seqs: int, request_id: int) -> list[SamplingParams]:
        """The sampling params of each engine request of a (possibly n > 1) request. A copy
        has its bad words tokenized here, as the engine thread does not check it again."""
        if num_seqs == 1 and params.n == 1 and (params.best_of or 1) == 1:
            seqs = [params]
        else:
            ranked = num_seqs > params.n  # best_of: ranking needs each sequence's cumulative logprob
            seqs = [
                replace(
                    params,
                    n=1,
                    best_of=None,
                    seed=None if params.seed is None else resolve_seed(params, i),
                    logprobs=params.logprobs if params.logprobs is not None or not ranked else 0,
                )
                for i in range(num_seqs)
            ]
        out = []
        for p in seqs:
            if p.logits_processor is not None:  # they see the id the caller knows
                p = replace(p, logits_processor=_with_request_id(p.logits_processors, request_id))
            if p is not params and p.bad:
                with self._encode_lock:
                    p.setup(self.tokenizer)
            out.append(p)
        return out

    # ------------------------------------------------------------------ submission
    def submit(self, request: GenerationRequest) -> GenerationResult:
        """Queue a request and return its result handle at once (ValueError on bad input)."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Queue several requests as one command, so they reach the engine in the same iteration.

        All are validated first: a ValueError queues none of them.
        """
        self._check_open()
        admitted = [self.validate(request) for request in requests]
        results, seqs = [], []
        for request, checked in zip(requests, admitted, strict=True):
            request.id = next(self._cids)
            result = GenerationResult(request, self)
            params = request.sampling_params
            deadline = None if request.timeout is None else request.arrival_time + request.timeout
            children = []
            if params.use_beam_search:  # one engine request; its n best beams are the outputs
                spec = OutputSpec(
                    prompt_tail=request.prompt_token_ids[-8:],
                    streaming=request.streaming,
                    detokenize=params.detokenize,
                    skip_special_tokens=params.skip_special_tokens,
                    stream_interval=self.config.stream_interval,
                )
                rids = [next(self._rids) for _ in range(params.n)]
                children.append(
                    SequenceRequest(
                        rids[0],
                        request.prompt_token_ids,
                        params,
                        spec,
                        priority=request.priority,
                        arrival_time=request.arrival_time,
                        deadline=deadline,
                        lora_request=request.lora_request,
                        kv_cache_retention_config=request.kv_cache_retention_config,
                        beam_siblings=tuple(rids[1:]),
                        admitted=checked,
                    )
                )
                result.attach(rids)
                results.append(result)
                seqs.extend(children)
                continue
            for seq_params in self._sequence_params(params, request.num_sequences, request.id):
                spec = OutputSpec(
                    prompt_tail=request.prompt_token_ids[-8:],
                    streaming=request.streaming,
                    detokenize=params.detokenize,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                    return_logprobs=seq_params.logprobs is not None,
                    stream_interval=self.config.stream_interval,
                )
                children.append(
                    SequenceRequest(
                        next(self._rids),
                        request.prompt_token_ids,
                        seq_params,
                        spec,
                        priority=request.priority,
                        arrival_time=request.arrival_time,
                        deadline=deadline,
                        lora_request=request.lora_request,
                        kv_cache_retention_config=request.kv_cache_retention_config,
                        admitted=checked,
                        disaggregated_params=request.disaggregated_params,
                    )
                )
            result.attach([c.rid for c in children])
            results.append(result)
            seqs.extend(children)
        self._live.add(results)
        try:
            self._core.add(seqs)
        except RuntimeError:
            self._live.forget(results)
            raise
        return results

    def generate_async(
        self,
        prompt: PromptInput,
        sampling_params: Optional[SamplingParams] = None,
        streaming: bool = False,
        *,
        priority: float = 0.0,
        timeout: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
        kv_cache_retention_config: Optional[KvCacheRetentionConfig] = None,
        disaggregated_params: Optional[DisaggregatedParams] = None,
    ) -> GenerationResult:
        """Submit one prompt (text or token ids); returns its `GenerationResult` without waiting.
        `lora_request`: the LoRA adapter to run it with; `kv_cache_retention_config`: retention
        priorities of its cached KV blocks; `disaggregated_params`: a context-only or
        generation-only request of disaggregated serving."""
        self._check_open()
        return self.submit(
            self.make_request(
                prompt,
                sampling_params,
                streaming,
                priority=priority,
                timeout=timeout,
                lora_request=lora_request,
                kv_cache_retention_config=kv_cache_retention_config,
                disaggregated_params=disaggregated_params,
            )
        )

    def submit_batch(self, batch: PromptBatch) -> list[GenerationResult]:
        """Queue a normalised batch (`jaxllm.executor.inputs`); a ValueError queues none of it."""
        return self.submit_many(
            [
                self.make_request(p, sp, lora_request=lr, kv_cache_retention_config=r)
                for p, sp, lr, r in zip(
                    batch.prompts, batch.sampling_params, batch.lora_requests, batch.retention_configs, strict=True
                )
            ]
        )

    def generate(
        self,
        prompts: Union[PromptInput, Sequence[PromptInput]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
        kv_cache_retention_config: Any = None,
    ) -> Union[RequestOutput, list[RequestOutput]]:
        """Generate and wait: one prompt gives one output, a list gives a list in the same order.

        Every prompt is validated before any is queued.
        """
        batch = normalize_inputs(prompts, sampling_params, lora_request, kv_cache_retention_config)
        outputs = [r.result() for r in self.submit_batch(batch)]
        return outputs[0] if batch.single else outputs

    def abort_request(self, request_id: int) -> None:
        """Cancel a request by id: it finishes with 'cancelled' and its blocks are freed. Unknown ids are ignored."""
        result = self._live.get(request_id)
        if result is not None:
            self._core.abort(list(result.engine_request_ids), "cancelled")

    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the executor failed and is shut down: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError("the executor is shut down")

    # ------------------------------------------------------------------ stats
    def _on_stats(self, stats: dict) -> None:
        with self._stats_cond:
            self._stats.append(stats)
            self._stats_cond.notify_all()

    def get_stats(self, timeout: Optional[float] = None) -> list[dict]:
        """Iteration stats (reference JSON shape) since the previous call; waits up to `timeout` for one."""
        with self._stats_cond:
            if not self._stats and timeout:
                self._stats_cond.wait(timeout)
            items = list(self._stats)
            self._stats.clear()
        mem = _device_memory_in_use()
        for item in items:
            item.setdefault("gpuMemUsage", mem)
        return items

    def call_on_engine(self, fn, timeout: Optional[float] = 30.0):
        """Run `fn(engine)` on the engine thread between two steps; returns its value."""
        self._check_open()
        return self._core.call(fn, timeout)

    def get_kv_cache_events(self, timeout: Optional[float] = None, max_events: Optional[int] = None) -> list[dict]:
        """KV cache events (TensorRT-LLM's serialized shape, `jaxllm.kv_cache.events`) since the
        previous call, at most `max_events` (oldest first; the rest stay for the next call);
        waits up to `timeout` seconds for one. Empty unless the engine was built with
        `kv_cache_config.event_buffer_max_size > 0`."""
        get = getattr(self._engine, "get_kv_cache_events", None)
        if get is None:
            return []
        return get(timeout) if max_events is None else get(timeout, max_events)

    def get_kv_cache_stats(self, timeout: Optional[float] = 30.0):
        return self.call_on_engine(lambda engine: engine.kv_cache_manager.get_kv_cache_stats(), timeout)

    def timing(self) -> dict:
        """Host time per engine iteration and per output batch (for overhead measurements);
        under "engine", the engine's step timing (`EngineTiming.as_dict`: host CPU and wall
        time without device waits, blocking device reads), read as the engine thread left it."""
        t = self._core.timing.as_dict()
        t["output_batches"] = self.output_batches
        t["mean_output_batch_ms"] = self.output_seconds / max(self.output_batches, 1) * 1e3
        engine_timing = getattr(self._engine, "timing", None)
        if hasattr(engine_timing, "as_dict"):
            t["engine"] = engine_timing.as_dict()
        return t

    # ------------------------------------------------------------------ output side
    def _output_loop(self) -> None:
        while True:
            events = self._events.get()
            if events is SHUTDOWN_EVENT:
                break
            started = time.perf_counter()
            try:
                if len(events) == 1 and events[0][0] == FATAL:
                    self._on_fatal(events[0][2])
                elif self._pool is not None:
                    self._pool.route(events)
                else:
                    self._process_in_slices(events)
            except BaseException as exc:
                logger.exception("output thread failed")
                self._on_fatal(exc)
            self.output_seconds += time.perf_counter() - started
            self.output_batches += 1
        if self._pool is not None:
            self._pool.close()
        # Nothing can reach the remaining results any more.
        self._live.fail_all(self._error or RuntimeError("the executor is shut down"))

    def _process_in_slices(self, events: list[tuple]) -> None:
        """Process a step's events a slice at a time, yielding the GIL in between, so that the
        engine thread - whose step result may arrive meanwhile - waits for at most one slice
        instead of a whole batch (or a whole switch interval)."""
        slices = event_slices(events, _SLICE)
        for i, part in enumerate(slices):
            self._apply(self._processor.process(part))
            if i + 1 < len(slices):
                time.sleep(0)

    def _apply(self, deltas: list[Delta]) -> None:
        applied = self._live.apply(deltas)
        for result, error in applied.failed:
            self._core.abort(list(result.engine_request_ids), "cancelled")
            result.fail(error)
        if applied.stops:
            self._core.abort(applied.stops, "stop")

    def _on_fatal(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        logger.error("executor failed: %r; failing all requests", error)
        self._core.stop()
        self._live.fail_all(error)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 60.0) -> None:
        """Cancel requests in flight (their blocks are freed), then join all threads and processes."""
        if self._closed:
            return
        self._closed = True
        self._core.stop()
        self._core.join(timeout)
        close = getattr(self._engine, "close", None) or getattr(self._engine, "close_statistics", None)
        if close is not None:  # expert statistics recorded so far; the load balancer's thread; followers
            close()
        self._forget_peer_failure()
        if threading.current_thread() is not self._output_thread:
            self._output_thread.join(timeout)
        _live_executors.discard(self)

    def __enter__(self) -> GenerationExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _device_memory_in_use() -> int:
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return int(stats.get("bytes_in_use", 0))
    except Exception:
        return 0
