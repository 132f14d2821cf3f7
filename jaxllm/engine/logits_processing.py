"""Logits post-processors: per-request Python callables on the host, and batched jittable
processors on the device registered on the engine by name.

Host processors (`SamplingParams.logits_processor`, TensorRT-LLM's logits_post_processor
signature `(request_id, token_ids, logits) -> logits`, or a list applied in order) run only
for the rows of requests that have one, off the step's critical path. Such a step is
dispatched as usual - forward, then the one sampler over all rows, whose tokens the other
rows keep (their logits, settings and random keys are untouched) - and a worker thread
then gathers the processor rows once the forward is done, runs the callables on the host,
scatters the rewritten rows into a copy of the step's logits and runs the same compiled
sampler again; the processor rows take their tokens (and logprobs) from that second pass,
which is exactly what they would have drawn had the rows been rewritten before sampling.

Why this does not slow the others: dispatching the step waits for nothing, and the engine's
thread goes on planning the next step while the callables run. A request with a processor
needs its token on the host before its next step (the callable reads `token_ids`), so
instead of draining the overlap pipeline for it, the engine leaves it out of the step
dispatched while its own is in flight: it runs every other step (the slower path), and the
other requests keep every step, overlapped. What the others can still pay: reading the
step's tokens back (one step later) waits for the callables if they take longer than a step,
and the second sampler pass runs on the device. Steps without processor rows run the plain
programs unchanged.

`token_ids` is the prompt followed by the tokens generated so far; `logits` a float32 numpy
array [vocab] the callable may modify in place or replace. A callable that
raises, or returns something that is not [vocab] numbers, fails its own request only (its
row keeps the unprocessed logits in that step, whose token is then discarded).

Batched processors (TensorRT-LLM's `logits_post_processor_batched`) are jittable
`fn(logits f32[S, V], request_ids int32[S], mask bool[S]) -> f32[S, V]` over the whole
step, registered in `EngineConfig.logits_post_processors` and selected per request by
`SamplingParams.logits_post_processor_name`. They run on the device, compiled once each
at warm-up, only in steps where some row selected them; rows outside `mask` keep their
logits whatever the function returns for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

BatchedProcessor = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def apply_batched(logits: jax.Array, request_ids: jax.Array, mask: jax.Array, *, fn: BatchedProcessor) -> jax.Array:
    """`fn` over the step's logits, kept only on the rows that selected it."""
    processed = jnp.asarray(fn(logits, request_ids, mask), jnp.float32)
    if processed.shape != logits.shape:
        raise ValueError(
            f"a batched logits post-processor must return logits of shape {logits.shape}, got {processed.shape}"
        )
    return jnp.where(mask[:, None], processed, logits)


def check_batched_processors(processors: Any) -> dict[str, BatchedProcessor]:
    """`EngineConfig.logits_post_processors` as a name -> callable dict (ValueError otherwise)."""
    if processors is None:
        return {}
    if not isinstance(processors, dict) or not all(
        isinstance(k, str) and k and callable(v) for k, v in processors.items()
    ):
        raise ValueError(
            "logits_post_processors must map non-empty names to jittable callables "
            "fn(logits, request_ids, mask) -> logits"
        )
    return dict(processors)


def history(request: Any) -> list[int]:
    """What a host processor gets as `token_ids`: the prompt, then the tokens generated so far."""
    return list(request.prompt_token_ids[: request.orig_prompt_len]) + list(request.output_token_ids)


def run_host_processors(
    requests: list[Any], rows: np.ndarray, histories: Optional[list[list[int]]] = None
) -> tuple[np.ndarray, list[tuple[Any, BaseException]]]:
    """Apply each request's host processors to its row of `rows` [R, V] (row k belongs to
    requests[k]; padding rows past len(requests) are copies of row 0 and get its result).
    `histories` are the requests' token ids (taken now when not given).
    Returns the rewritten rows and the (request, error) pairs of callables that failed."""
    failures: list[tuple[Any, BaseException]] = []
    vocab_size = rows.shape[1]
    for k, request in enumerate(requests):
        params = request.sampling_params
        token_ids = history(request) if histories is None else histories[k]
        original = rows[k].copy()
        try:
            logits = rows[k]
            for fn in params.logits_processors:
                result = fn(request.request_id, token_ids, logits)
                if result is not None:
                    logits = np.asarray(result, dtype=np.float32)
                if logits.shape != (vocab_size,):
                    raise ValueError(
                        f"logits_processor {getattr(fn, '__name__', fn)!r} returned logits of "
                        f"shape {logits.shape}; expected ({vocab_size},)"
                    )
            rows[k] = logits
        except Exception as exc:  # the user's code: fail its request only
            logger.warning("logits_processor of request %s raised %r", request.request_id, exc)
            rows[k] = original
            failures.append((request, exc))
    rows[len(requests) :] = rows[0]
    return rows, failures


def host_processor_hook(requests: list[Any], failures: list) -> Callable[[np.ndarray], np.ndarray]:
    """The runner's callback for one step: rows in, processed rows out; failures appended.
    The requests' token ids are taken now, at dispatch: the callback runs later, on another
    thread, while the engine records the step's tokens-to-come in the requests."""
    histories = [history(r) for r in requests]

    def hook(rows: np.ndarray) -> np.ndarray:
        processed, failed = run_host_processors(requests, rows, histories)
        failures.extend(failed)
        return processed

    return hook
