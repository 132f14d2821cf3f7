"""How much work the `xla` attention backend's loop is compiled for, chosen per step on the host.

The tiled XLA attention (`pallas_kernels.ragged_paged_attention.tiled_xla`) loops over the
step's (query tile, KV block) pairs with a trip count fixed when the program compiles: a
trip count read from the device would cost a host round trip per iteration on a GPU. The
bound from the shapes alone is every token at the longest context, which for short
contexts under a long `max_seq_len` is most of the work (a decode step of 4 rows at 100
tokens of context under a 2048-token limit does 64 blocks per row instead of 4). The host
knows each sequence's query and KV lengths, so it counts the step's real pairs
(`step_work_items`) and picks the smallest rung of a short ladder of static bounds
(`work_tiers`: powers of two of one loop iteration, each at most a quarter of the shapes'
bound) that holds them; each rung is a program of its own (`StepBatch.kv_work_items`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxllm.models.model_config import ModelConfig
from jaxllm.step_batch import StepBatch
from pallas_kernels.ragged_paged_attention.tiled_xla import (
    default_items_per_step,
    max_tiles_of,
    max_work_items,
    step_work_items,
    tile_size,
    work_tiers,
)


class AttentionWorkTiers:
    """The ladder of static work bounds of one model's steps, and the rung each step needs."""

    def __init__(self, config: ModelConfig, tokens_per_block: int) -> None:
        if config.is_mla:
            raise ValueError("work tiers are for multi-head attention caches (MLA attends over its latent pages)")
        self.tokens_per_block = tokens_per_block
        self.per_step = default_items_per_step(config.num_kv_heads, tokens_per_block, config.head_dim)
        self._tiers: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def tiers(self, num_tokens: int, max_seqs: int, max_blocks: int) -> tuple[int, ...]:
        """The rungs below the shapes' own bound for a step of these shapes (often none)."""
        key = (num_tokens, max_seqs, max_blocks)
        tiers = self._tiers.get(key)
        if tiers is None:
            bq = tile_size(num_tokens, max_seqs)
            bound = max_work_items(max_tiles_of(num_tokens, max_seqs, bq), max_blocks, self.tokens_per_block, bq, None)
            tiers = self._tiers[key] = work_tiers(bound, self.per_step)
        return tiers

    def choose(self, batch: StepBatch) -> Optional[int]:
        """The smallest rung holding `batch`'s (tile, block) pairs, or None (the shapes' bound)."""
        num_tokens = int(batch.token_ids.shape[0])
        max_seqs, max_blocks = (int(n) for n in batch.block_tables.shape)
        tiers = self.tiers(num_tokens, max_seqs, max_blocks)
        if not tiers:
            return None
        num_seqs = int(batch.num_seqs[0])
        q_lens = np.diff(batch.cu_q_lens[: num_seqs + 1])
        need = step_work_items(q_lens, batch.kv_lens[:num_seqs], num_tokens, max_seqs, self.tokens_per_block)
        return next((tier for tier in tiers if tier >= need), None)
