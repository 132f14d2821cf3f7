"""Hand-built StepBatches and a tiny paged-cache driver for model tests.

Independent of the engine's batch builder on purpose: these tests check the model
against the StepBatch contract itself (packing, positions, slot mapping, padding).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxllm.models import ModelConfig, forward, forward_all_logits, init_kv_cache
from jaxllm.step_batch import StepBatch


@dataclass
class SeqChunk:
    """One sequence's tokens in a step: `tokens` sit at positions `start, start + 1, ...`."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]


def build_step_batch(
    chunks: Sequence[SeqChunk],
    *,
    tokens_per_block: int,
    num_blocks: int,
    token_bucket: int,
    max_seqs: int,
    max_blocks_per_seq: int,
) -> StepBatch:
    """Pack chunks in the given order (context chunks first, by convention) into fixed shapes."""
    num_tokens = sum(len(c.tokens) for c in chunks)
    if num_tokens > token_bucket or len(chunks) > max_seqs:
        raise ValueError("batch does not fit the bucket")
    pad_slot = num_blocks * tokens_per_block
    token_ids = np.zeros(token_bucket, np.int32)
    positions = np.zeros(token_bucket, np.int32)
    slot_mapping = np.full(token_bucket, pad_slot, np.int32)
    cu_q_lens = np.zeros(max_seqs + 1, np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    block_tables = np.zeros((max_seqs, max_blocks_per_seq), np.int32)
    logits_indices = np.zeros(max_seqs, np.int32)
    offset = 0
    for s, chunk in enumerate(chunks):
        n = len(chunk.tokens)
        pos = chunk.start + np.arange(n)
        table = np.asarray(chunk.block_table, np.int32)
        if (chunk.start + n + tokens_per_block - 1) // tokens_per_block > len(table):
            raise ValueError("block table too short for the sequence")
        token_ids[offset : offset + n] = chunk.tokens
        positions[offset : offset + n] = pos
        slot_mapping[offset : offset + n] = table[pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block
        block_tables[s, : len(table)] = table
        kv_lens[s] = chunk.start + n
        offset += n
        cu_q_lens[s + 1] = offset
        logits_indices[s] = offset - 1
    cu_q_lens[len(chunks) + 1 :] = offset
    return StepBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        block_tables=block_tables,
        num_seqs=np.array([len(chunks)], np.int32),
        logits_indices=logits_indices,
    )


@functools.cache
def jitted(fn):
    return jax.jit(fn, static_argnames=("config",))


@dataclass
class PagedModel:
    """Runs the model step by step over a paged cache with fixed bucket shapes (one compile)."""

    params: dict
    config: ModelConfig
    tokens_per_block: int = 4
    num_blocks: int = 32
    token_bucket: int = 16
    max_seqs: int = 2
    max_blocks_per_seq: int = 8
    cache: list = field(default=None)

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = self.empty_cache()

    def empty_cache(self) -> list:
        return init_kv_cache(self.config, self.num_blocks, self.tokens_per_block, self.config.dtype)

    def batch(self, chunks: Sequence[SeqChunk]) -> StepBatch:
        return build_step_batch(
            chunks,
            tokens_per_block=self.tokens_per_block,
            num_blocks=self.num_blocks,
            token_bucket=self.token_bucket,
            max_seqs=self.max_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )

    def step(self, chunks: Sequence[SeqChunk], cache: list | None = None) -> tuple[np.ndarray, list]:
        """Logits [len(chunks), V] at each chunk's last token, and the updated cache.

        Gathers from the all-token logits so a test compiles one step function per model
        (CPU compile time dominates these tests); `forward` itself is checked against it.
        """
        batch = self.batch(chunks)
        logits, cache = jitted(forward_all_logits)(
            self.params, self.cache if cache is None else cache, batch, config=self.config
        )
        return np.asarray(logits)[batch.logits_indices[: len(chunks)]], cache

    def forward(self, chunks: Sequence[SeqChunk], cache: list | None = None) -> tuple[np.ndarray, list]:
        """The engine entry point `forward`: logits [len(chunks), V] at `logits_indices`."""
        logits, cache = jitted(forward)(
            self.params, self.cache if cache is None else cache, self.batch(chunks), config=self.config
        )
        return np.asarray(logits)[: len(chunks)], cache

    def all_logits(self, chunks: Sequence[SeqChunk], cache: list | None = None) -> tuple[np.ndarray, list]:
        """Logits [num_tokens, V] for every token of the step."""
        logits, cache = jitted(forward_all_logits)(
            self.params, self.cache if cache is None else cache, self.batch(chunks), config=self.config
        )
        return np.asarray(logits)[: sum(len(c.tokens) for c in chunks)], cache


def random_block_table(
    rng: np.random.Generator, num_blocks: int, length: int, exclude: Sequence[int] = ()
) -> list[int]:
    """Distinct, shuffled (hence non-contiguous) block ids."""
    free = np.setdiff1d(np.arange(num_blocks), np.asarray(exclude, dtype=np.int64))
    return [int(b) for b in rng.permutation(free)[:length]]


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
