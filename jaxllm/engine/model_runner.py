"""Device side of the engine: parameters, the paged KV cache and the compiled step.

One step = model forward over a packed `StepBatch` + on-device sampling. Shapes come
from a few token buckets, so every variant compiles once; the KV cache is donated and
updated in place. Under the overlap scheduler a generation token may not be known on
the host yet: `feed_index[t] >= 0` tells the step to take token `t` from row
`feed_index[t]` of the previous step's sampled tokens, which never leave the device.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.host_transfer import PackedLayout, pack_to_device, unpack
from jaxllm.models import ModelConfig, forward, init_kv_cache, kv_cache_bytes_per_token
from jaxllm.sampling import SamplingTensors, sample
from jaxllm.step_batch import StepBatch

logger = logging.getLogger(__name__)


def _step(params, kv_cache, inputs: tuple, prev_tokens, *, layout: PackedLayout,
          model_config: ModelConfig, attention_fn: Callable, moe_fn: Callable):
    batch, sampling, feed_index = unpack(inputs, layout)
    fed = prev_tokens[jnp.maximum(feed_index, 0)]
    batch = replace(batch, token_ids=jnp.where(feed_index >= 0, fed, batch.token_ids))
    logits, kv_cache = forward(params, kv_cache, batch, config=model_config,
                               attention_fn=attention_fn, moe_fn=moe_fn)
    return kv_cache, sample(logits, sampling)


def plan_num_kv_blocks(*, model_config: ModelConfig, dtype: Any, tokens_per_block: int,
                       max_tokens: int | None, free_memory_fraction: float,
                       max_batch_size: int, max_seq_len: int) -> int:
    """Blocks in the pool: the smaller of `max_tokens` and the memory-fraction budget.

    On accelerators the budget is `fraction` of the device memory still free after the
    weights are loaded. Hosts report no such figure, so there the pool holds every
    sequence at full length, capped by a share of the host's available memory.
    """
    bytes_per_block = kv_cache_bytes_per_token(model_config, dtype) * tokens_per_block
    limits = []
    if max_tokens is not None:
        limits.append(math.ceil(max_tokens / tokens_per_block))
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        limits.append(int(free * free_memory_fraction) // bytes_per_block)
    else:
        limits.append(math.ceil(max_batch_size * max_seq_len / tokens_per_block))
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            limits.append(int(available * free_memory_fraction * 0.5) // bytes_per_block)
        except (ValueError, OSError):
            pass
    num_blocks = min(limits)
    if num_blocks < 1:
        raise ValueError("the KV cache budget does not hold a single block; raise "
                         "kv_cache_config.max_tokens or free_gpu_memory_fraction")
    return num_blocks


class ModelRunner:
    def __init__(self, *, model_config: ModelConfig, params: Any, num_blocks: int,
                 tokens_per_block: int, kv_dtype: Any, attention_fn: Callable, moe_fn: Callable,
                 max_batch_size: int) -> None:
        self.model_config = model_config
        self.params = params
        self.max_batch_size = max_batch_size
        self.kv_cache = init_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype)
        self._jitted = jax.jit(
            functools.partial(_step, model_config=model_config, attention_fn=attention_fn, moe_fn=moe_fn),
            static_argnames=("layout",),
            donate_argnums=(1,),
        )
        self._compiled: dict[tuple, Any] = {}
        self.compile_seconds = 0.0
        self._zero_tokens = jnp.zeros((max_batch_size,), jnp.int32)

    @property
    def num_compiled_variants(self) -> int:
        return len(self._compiled)

    def _executable(self, args: tuple, layout: PackedLayout):
        """The compiled step for this input layout: a token bucket plus the sampler's static
        switches (both are in the layout)."""
        exe = self._compiled.get(layout)
        if exe is None:
            start = time.perf_counter()
            exe = self._jitted.lower(*args, layout=layout).compile()
            self.compile_seconds += time.perf_counter() - start
            logger.debug("compiled a step variant in %.2fs", time.perf_counter() - start)
            self._compiled[layout] = exe
        return exe

    def execute(self, batch: StepBatch, sampling: SamplingTensors, feed_index: np.ndarray,
                prev_tokens: jax.Array | None):
        """Dispatch one step; returns the sampler output as device arrays (no host sync)."""
        inputs, layout = pack_to_device((batch, sampling, feed_index))
        prev = self._zero_tokens if prev_tokens is None else prev_tokens
        args = (self.params, self.kv_cache, inputs, prev)
        self.kv_cache, out = self._executable(args, layout)(*args)
        return out
