"""Chain drafting: k draft tokens per sequence from a one-layer draft module run k times.

A draft module (DeepSeek-V3's MTP layer, an EAGLE-3 head) maps, at position i, the hidden
state of position i and the token of position i + 1 to logits for position i + 2 and its
own hidden state. The first step runs over the step's packed tokens (the target's tokens
shifted by one, the last one being the token the target just produced); each further
step runs one token per sequence, the previous step's draft at the next position, fed
the previous step's hidden state of that sequence. Every step writes the draft module's
own KV cache at its positions, through the sequences' block tables.

Shapes stay fixed: the follow-up steps are [S]-token batches (S = the batch's sequence
slots), built on the device from the first step's batch, so a chain compiles once per
token bucket and draft length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.step_batch import StepBatch

# (cache, batch, hidden [T, H], step) -> (logits [S, V'] at batch.logits_indices, hidden [T, H], cache)
DraftStep = Callable[[Any, StepBatch, jax.Array, int], tuple[jax.Array, jax.Array, Any]]


def draft_batch(batch: StepBatch, next_tokens: jax.Array) -> StepBatch:
    """The first draft step's batch from the target's: the same positions and slots, each
    sequence's tokens shifted left by one and its last one replaced by `next_tokens` [S] (the
    token the target just produced, or the prompt's next token after a partial chunk)."""
    num_tokens = batch.token_ids.shape[0]
    live = jnp.arange(batch.logits_indices.shape[0], dtype=jnp.int32) < batch.num_seqs[0]
    last = jnp.where(live, batch.logits_indices, num_tokens)
    shifted = jnp.roll(jnp.asarray(batch.token_ids), -1).at[last].set(next_tokens.astype(jnp.int32), mode="drop")
    valid = jnp.arange(num_tokens, dtype=jnp.int32) < batch.cu_q_lens[batch.num_seqs[0]]
    return replace(batch, token_ids=jnp.where(valid, shifted, 0).astype(jnp.int32))


def follow_up_batch(
    batch: StepBatch,
    tokens: jax.Array,
    offset: int,
    *,
    tokens_per_block: int,
    num_blocks: int,
    own_blocks_only: bool = False,
) -> StepBatch:
    """One token per live sequence of `batch`: `tokens` [S] at `offset` positions past each
    sequence's last token (its `logits_indices` row), same block tables. Padding sequences,
    and a position past the block table, get the padding slot (their KV write is dropped);
    with `own_blocks_only` so does a position past the blocks the sequence's KV length covers
    (an engine's block table may name other sequences' blocks there)."""
    max_seqs, max_blocks = batch.block_tables.shape
    seq = jnp.arange(max_seqs, dtype=jnp.int32)
    live = seq < batch.num_seqs[0]
    pos = jnp.where(live, batch.positions[batch.logits_indices] + offset, 0).astype(jnp.int32)
    block = pos // tokens_per_block
    page = jnp.take_along_axis(batch.block_tables, jnp.minimum(block, max_blocks - 1)[:, None], axis=1)[:, 0]
    pad_slot = num_blocks * tokens_per_block
    own = block < max_blocks
    if own_blocks_only:
        own = own & (block < (batch.kv_lens + tokens_per_block - 1) // tokens_per_block)
    slots = jnp.where(live & own, page * tokens_per_block + pos % tokens_per_block, pad_slot)
    return StepBatch(
        token_ids=jnp.where(live, tokens, 0).astype(jnp.int32),
        positions=pos,
        slot_mapping=slots.astype(jnp.int32),
        cu_q_lens=jnp.minimum(jnp.arange(max_seqs + 1, dtype=jnp.int32), batch.num_seqs[0]),
        kv_lens=jnp.where(live, pos + 1, 0).astype(jnp.int32),
        block_tables=batch.block_tables,
        num_seqs=batch.num_seqs,
        logits_indices=jnp.where(live, seq, 0),
    )


def chain_drafts(
    step: DraftStep,
    cache: Any,
    batch: StepBatch,
    hidden: jax.Array,
    num_draft_tokens: int,
    *,
    tokens_per_block: int,
    num_blocks: int,
    to_target: Optional[Callable[[jax.Array], jax.Array]] = None,
    return_logits: bool = False,
    own_blocks_only: bool = False,
) -> tuple[jax.Array, Any, Optional[jax.Array]]:
    """Greedy chain of `num_draft_tokens` drafts per sequence: int32 [S, k] target token ids
    (rows past `num_seqs` are 0), the draft cache, and with `return_logits` the float32 draft
    logits [S, k, V'] each draft was taken from (`own_blocks_only`: see `follow_up_batch`).
    `to_target` maps draft-vocabulary ids to the
    target's (EAGLE-3's `d2t`); the chain feeds the target ids back as the next tokens."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    live = jnp.arange(batch.block_tables.shape[0], dtype=jnp.int32) < batch.num_seqs[0]
    drafts, all_logits = [], []
    current, rows = batch, batch.logits_indices
    for j in range(num_draft_tokens):
        logits, hidden, cache = step(cache, current, hidden, j)
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = jnp.where(live, to_target(ids) if to_target is not None else ids, 0).astype(jnp.int32)
        drafts.append(tokens)
        all_logits.append(logits)
        if j + 1 < num_draft_tokens:
            hidden = hidden[rows]
            current = follow_up_batch(
                batch,
                tokens,
                j + 1,
                tokens_per_block=tokens_per_block,
                num_blocks=num_blocks,
                own_blocks_only=own_blocks_only,
            )
            rows = current.logits_indices
    stacked = jnp.stack(all_logits, axis=1) if return_logits else None
    return jnp.stack(drafts, axis=1), cache, stacked


def model_chain_drafts(
    forward_fn: Callable[[Any, StepBatch], tuple[jax.Array, Any]],
    cache: Any,
    batch: StepBatch,
    last_tokens: jax.Array,
    num_draft_tokens: int,
    *,
    tokens_per_block: int,
    num_blocks: int,
) -> tuple[jax.Array, Any]:
    """A draft model's greedy chain: `forward_fn(cache, batch) -> (logits [S, V] at
    batch.logits_indices, cache)` runs over the step's packed tokens (writing its KV), then
    feeds each live sequence's newest token `last_tokens` [S] at the next position and chains
    `num_draft_tokens` greedy drafts, one token per sequence per forward (writes past the blocks
    a sequence holds are dropped). Returns the drafts int32 [S, k] and the cache."""
    _, cache = forward_fn(cache, batch)
    live = jnp.arange(batch.block_tables.shape[0], dtype=jnp.int32) < batch.num_seqs[0]
    tokens, drafts = last_tokens, []
    for j in range(num_draft_tokens):
        step = follow_up_batch(
            batch, tokens, j + 1, tokens_per_block=tokens_per_block, num_blocks=num_blocks, own_blocks_only=True
        )
        logits, cache = forward_fn(cache, step)
        tokens = jnp.where(live, jnp.argmax(logits, axis=-1), 0).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), cache
