"""Watching a speculating engine from a test: each draft its drafter proposes, and each
compile, while a workload runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def recorded_drafts(engine) -> Iterator[tuple[list[tuple[list[int], list[int]]], list[str]]]:
    """(proposals, compiles) filled while the block runs: each proposal as (tokens, the
    drafter's drafts for them at full length), each compile's event name. The drafter's
    `propose` is wrapped for the block only."""
    drafter = engine.speculation.drafter
    seen: list[tuple[list[int], list[int]]] = []
    compiles: list[str] = []
    original = drafter.propose

    def recording(rid, tokens, max_len=None):
        seen.append((list(tokens), original(rid, tokens)))
        return original(rid, tokens, max_len)

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(event)

    drafter.propose = recording
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen, compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        del drafter.propose  # the class's method again


def small_spec_engine(model: str, speculative_config, **fields):
    """An engine with the limits the parallel-layout speculation tests share (4 rows, a 16-token
    budget, 96-token sequences, 8-token blocks, every program compiled on first use, token
    buckets only); `fields`: the layout and the rest."""
    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=16,
            max_seq_len=96,
            compile_ahead=False,
            decode_batch_sizes=[],
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512),
            speculative_config=speculative_config,
            **fields,
        )
    )
