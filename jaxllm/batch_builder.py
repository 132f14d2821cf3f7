"""Turn a scheduling decision into the fixed-shape int32 arrays of one device step.

Layout and padding are defined in `jaxllm/step_batch.py`. Everything here is vectorised
with numpy: Python only loops over requests (to read their positions and last tokens),
never over tokens, and block tables are gathered from the KV cache manager's persistent
table in one operation. A steady decode step (`build_decode_batch`) is built from the KV
cache manager's per-slot arrays without a pass over the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler.output import SchedulerOutput
from jaxllm.step_batch import StepBatch


def token_buckets(max_num_tokens: int, min_bucket: int = 16) -> list[int]:
    """All token-buffer sizes `choose_token_bucket` can return (one compiled step each):
    powers of two from `min_bucket`, capped by `max_num_tokens` (always the last one)."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    buckets = []
    bucket = max(1, min_bucket)
    while bucket < max_num_tokens:
        buckets.append(bucket)
        bucket *= 2
    buckets.append(max_num_tokens)
    return buckets


def choose_token_bucket(num_tokens: int, max_num_tokens: int, min_bucket: int = 16) -> int:
    """Smallest bucket holding `num_tokens`: a power of two >= min_bucket, or
    `max_num_tokens` itself when that is smaller (even if not a power of two)."""
    if num_tokens > max_num_tokens:
        raise ValueError(f"{num_tokens} tokens exceed max_num_tokens ({max_num_tokens})")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    bucket = max(1, min_bucket)
    while bucket < num_tokens:
        bucket *= 2
    return min(bucket, max_num_tokens)


def decode_batch_sizes(max_batch_size: int, decode_bucket: int, sizes: Optional[Sequence[int]] = None) -> list[int]:
    """The row counts of the small decode buckets (`EngineConfig.decode_batch_sizes`): `sizes`
    (None: powers of two from 1), keeping those up to `max_batch_size` and below the decode
    token bucket (a step of more rows runs in that bucket), ascending."""
    if sizes is None:
        sizes = [1 << i for i in range(max(1, max_batch_size).bit_length())]
    return sorted({int(s) for s in sizes if 1 <= s <= max_batch_size and s < decode_bucket})


def choose_decode_rows(num_rows: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest of `sizes` (ascending) holding `num_rows`; None when none does."""
    return next((size for size in sizes if size >= num_rows), None)


def build_step_batch(
    output: SchedulerOutput,
    kv: KVCacheManager,
    *,
    token_bucket: int,
    max_batch_size: int,
    max_blocks_per_seq: int,
    generation_tokens: Optional[np.ndarray] = None,
    draft_lens: Optional[np.ndarray] = None,
    draft_tokens: Optional[np.ndarray] = None,
) -> StepBatch:
    """Pack the scheduled requests (context chunks first, then generation tokens) into a
    `StepBatch` of numpy int32 arrays (views of one buffer allocated per call, so nothing
    is overwritten by later steps). Blocks must already be allocated: call
    `kv.prepare_resources(output)` right before; its recorded block-table rows are used
    (and trusted) as long as no sequence was freed in between.

    A context request contributes `prompt[pos : pos + chunk]` at positions `pos ...`; a
    generation request contributes its last output token at position `num_tokens - 1`.
    Each sequence's logits index is its last token in the buffer. `generation_tokens`: the
    generation requests' last output tokens when the caller already gathered them.
    `draft_lens` int[n_gen] / `draft_tokens` (their concatenation): speculative decoding's
    drafts, which follow each generation request's last token at the next positions (a row
    of 1 + k query tokens, packed like a context chunk).
    """
    ctx = output.context_requests
    gen = output.generation_requests
    n_ctx, n_gen = len(ctx), len(gen)
    n = n_ctx + n_gen
    T, S, MB = token_bucket, max_batch_size, max_blocks_per_seq
    if n > S:
        raise ValueError(f"{n} scheduled requests exceed max_batch_size ({S})")
    tpb = kv.tokens_per_block

    # Per-sequence scalars: the only Python loops. Rows and num_tokens come from
    # prepare_resources when it recorded them for this output.
    chunks = [r.context_chunk_size for r in ctx]
    ctx_starts = [r.context_current_position for r in ctx]
    placement = output.kv_placement
    prepared = (
        kv.placement_is_current(placement)
        and len(placement.rows) == n
        and len(placement.generation_num_tokens) == n_gen
    )
    speculating = draft_lens is not None and bool(np.any(draft_lens))
    if prepared and placement.decode is not None and not n_ctx and not speculating:
        return build_decode_batch(
            kv,
            placement.rows,
            placement.generation_num_tokens,
            generation_tokens,
            gen,
            token_bucket=T,
            max_batch_size=S,
            max_blocks_per_seq=MB,
        )[0]
    if prepared:
        rows_list, gen_num_tokens = placement.rows, placement.generation_num_tokens
    else:
        rows_list = kv.get_table_rows(ctx) + kv.get_table_rows(gen)
        gen_num_tokens = [r.orig_prompt_len + len(r.output_token_ids) for r in gen]
    # (a steady batch's placement holds its generation lengths as an array)
    starts_a = np.concatenate([np.asarray(ctx_starts, np.int32), np.asarray(gen_num_tokens, np.int32)]).reshape(n)
    starts_a[n_ctx:] -= 1  # a generation token sits at position num_tokens - 1
    rows = np.array(rows_list, dtype=np.intp).reshape(n)
    q_lens = np.ones(n, dtype=np.int32)
    if n_ctx:
        q_lens[:n_ctx] = chunks
    if speculating:
        q_lens[n_ctx:] += np.asarray(draft_lens, np.int32)

    batch = _zero_batch(T, S, MB)
    token_ids, positions, slot_mapping = batch.token_ids, batch.positions, batch.slot_mapping
    cu_q_lens, kv_lens, block_tables = batch.cu_q_lens, batch.kv_lens, batch.block_tables
    num_seqs, logits_indices = batch.num_seqs, batch.logits_indices

    if n_ctx or speculating:
        np.cumsum(q_lens, out=cu_q_lens[1 : n + 1])
        total = int(cu_q_lens[n])
    else:  # generation only: one token per sequence
        cu_q_lens[: n + 1] = np.arange(n + 1, dtype=np.int32)
        total = n
    if total > T:
        raise ValueError(f"{total} scheduled tokens exceed the token bucket ({T})")
    cu_q_lens[n + 1 :] = total
    live_kv_lens = kv_lens[:n]
    np.add(starts_a, q_lens, out=live_kv_lens)
    if n_ctx and not q_lens[:n_ctx].all():
        bad = [r.request_id for r in ctx if r.context_chunk_size <= 0]
        raise ValueError(f"context requests {bad} are scheduled with an empty chunk")

    table = kv.block_table
    width = table.shape[1]
    if not prepared or width > MB:  # prepare_resources guarantees the blocks otherwise
        held_tokens = kv.row_num_blocks[rows] * tpb
        if (live_kv_lens > held_tokens).any():
            ids = [(ctx + gen)[i].request_id for i in np.flatnonzero(live_kv_lens > held_tokens)]
            raise RuntimeError(
                f"requests {ids} hold too few KV blocks for this step; "
                "call kv.prepare_resources(output) before building the batch"
            )
        if width > MB and n and int(held_tokens.max()) > MB * tpb:
            raise ValueError(f"a sequence holds more than max_blocks_per_seq ({MB}) blocks")

    n_gen_tokens = int(q_lens[n_ctx:].sum())
    n_ctx_tokens = total - n_gen_tokens
    if n_ctx:
        pieces = [r.prompt_array()[p : p + c] for r, p, c in zip(ctx, ctx_starts, chunks)]
        ctx_tokens = np.concatenate(pieces)
        if ctx_tokens.shape[0] != n_ctx_tokens:
            raise ValueError("a context chunk runs past the end of its prompt")
        token_ids[:n_ctx_tokens] = ctx_tokens
        seq_of_token = np.repeat(np.arange(n_ctx), q_lens[:n_ctx])
        offset = starts_a[:n_ctx] - cu_q_lens[:n_ctx]  # position = token index + offset
        np.add(np.arange(n_ctx_tokens, dtype=np.int32), offset[seq_of_token], out=positions[:n_ctx_tokens])
        if not speculating:
            positions[n_ctx_tokens:total] = starts_a[n_ctx:]
        token_rows = np.concatenate((rows[seq_of_token], rows[n_ctx:]))
    else:
        if not speculating:
            positions[:total] = starts_a
        token_rows = rows
    if speculating:
        # Generation rows of 1 + k tokens: the last token, then its drafts at the next positions.
        gen_lens = q_lens[n_ctx:]
        seq_of_gen = np.repeat(np.arange(n_gen), gen_lens)
        first = cu_q_lens[n_ctx:n] - n_ctx_tokens  # each row's first token, counted from the generation tokens
        offset = np.arange(n_gen_tokens, dtype=np.int32) - first[seq_of_gen]
        positions[n_ctx_tokens:total] = starts_a[n_ctx:][seq_of_gen] + offset
        token_rows = np.concatenate((token_rows[:n_ctx_tokens], rows[n_ctx:][seq_of_gen]))
        gen_tokens = token_ids[n_ctx_tokens:total]
        gen_tokens[offset > 0] = np.asarray(draft_tokens, np.int32)
        gen_tokens[first] = (
            generation_tokens if generation_tokens is not None else [r.output_token_ids[-1] for r in gen]
        )
    elif n_gen:
        token_ids[n_ctx_tokens:total] = (
            generation_tokens if generation_tokens is not None else [r.output_token_ids[-1] for r in gen]
        )
    block_index, offset_in_block = np.divmod(positions[:total], tpb)
    np.add(table[token_rows, block_index] * tpb, offset_in_block, out=slot_mapping[:total])
    slot_mapping[total:] = kv.num_kv_slots

    if width == MB:  # mode="clip" skips a bounds-check copy; rows are valid rows
        np.take(table, rows, axis=0, out=block_tables[:n], mode="clip")
    else:
        w = min(width, MB)
        block_tables[:n, :w] = table[rows, :w]
    num_seqs[0] = n
    np.subtract(cu_q_lens[1 : n + 1], 1, out=logits_indices[:n])
    return batch


def _zero_batch(T: int, S: int, MB: int, tail: int = 0) -> StepBatch:
    """A zeroed StepBatch whose fields are views of one allocation (new per call, so a
    batch handed to the runtime is never overwritten by a later step), in field order (the
    order `jaxllm.engine.host_transfer.pack` lays them out), followed by `tail` more words
    (`_buffer_of` gives the whole allocation)."""
    buf = np.zeros(3 * T + (S + 1) + S + S * MB + 1 + S + tail, dtype=np.int32)
    o = 3 * T
    cu_q_lens, kv_lens = buf[o : o + S + 1], buf[o + S + 1 : o + 2 * S + 1]
    o += 2 * S + 1
    block_tables = buf[o : o + S * MB].reshape(S, MB)
    o += S * MB
    return StepBatch(
        token_ids=buf[:T],
        positions=buf[T : 2 * T],
        slot_mapping=buf[2 * T : 3 * T],
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        block_tables=block_tables,
        num_seqs=buf[o : o + 1],
        logits_indices=buf[o + 1 : o + 1 + S],
    )


def _buffer_of(batch: StepBatch) -> np.ndarray:
    """The allocation behind a `_zero_batch` batch (its fields, then the tail)."""
    return batch.token_ids.base


def build_decode_batch(
    kv: KVCacheManager,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    tokens: Optional[np.ndarray],
    requests: Sequence[LlmRequest],
    *,
    token_bucket: int,
    max_batch_size: int,
    max_blocks_per_seq: int,
    feed_index: Optional[np.ndarray] = None,
) -> tuple[StepBatch, np.ndarray, np.ndarray]:
    """`build_step_batch` of a generation-only step from per-slot arrays (no pass over the
    requests): `rows[i]` is the block-table row of sequence i, `num_tokens[i]` its token
    count with this step's token, which `tokens[i]` holds (read from `requests` when None).
    The blocks must be prepared (`kv.prepare_decode`).

    Returns (batch, feed index, packed): the step's `feed_index` (int32[T], a copy of
    `feed_index`, -1 when None) sits right after the batch in one buffer, `packed`, which is
    what `pack((batch, feed index))` would build, so the step's forward inputs need no copy."""
    n = rows.shape[0]
    T, S, MB = token_bucket, max_batch_size, max_blocks_per_seq
    if n > S:
        raise ValueError(f"{n} scheduled requests exceed max_batch_size ({S})")
    if n > T:
        raise ValueError(f"{n} scheduled tokens exceed the token bucket ({T})")
    tpb = kv.tokens_per_block
    table = kv.block_table
    width = table.shape[1]
    if width > MB and n and int(kv.row_num_blocks[rows].max()) > MB:
        raise ValueError(f"a sequence holds more than max_blocks_per_seq ({MB}) blocks")
    batch = _zero_batch(T, S, MB, tail=T)
    packed = _buffer_of(batch)
    feed = packed[-T:]
    feed[:] = -1 if feed_index is None else feed_index
    batch.token_ids[:n] = tokens if tokens is not None else [r.output_token_ids[-1] for r in requests]
    positions = batch.positions[:n]
    np.subtract(num_tokens, 1, out=positions)
    block_index, offset_in_block = np.divmod(positions, tpb)
    np.add(table[rows, block_index] * tpb, offset_in_block, out=batch.slot_mapping[:n])
    batch.slot_mapping[n:] = kv.num_kv_slots
    arange = np.arange(n + 1, dtype=np.int32)
    batch.cu_q_lens[: n + 1] = arange
    batch.cu_q_lens[n + 1 :] = n
    batch.kv_lens[:n] = num_tokens
    if width == MB:
        np.take(table, rows, axis=0, out=batch.block_tables[:n], mode="clip")
    else:
        w = min(width, MB)
        batch.block_tables[:n, :w] = table[rows, :w]
    batch.num_seqs[0] = n
    batch.logits_indices[:n] = arange[:n]
    return batch, feed, packed
