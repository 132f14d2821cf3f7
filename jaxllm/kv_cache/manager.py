"""Paged KV cache bookkeeping: which physical blocks each request's tokens live in.

The device holds one KV pool of `num_blocks * tokens_per_block` slots; token `p` of a
sequence lives in slot `block_table[p // tokens_per_block] * tokens_per_block +
p % tokens_per_block`. This module owns the block tables (host side only) and answers
the capacity scheduler's questions with the *same* arithmetic it uses to allocate, so
what the scheduler reserves is exactly what allocation can take:

* a context-phase request is given blocks for its whole prompt on its first scheduled
  chunk (later chunks need nothing new);
* a generation-phase request needs blocks for `num_tokens` (the token fed this step
  included);
* to completion a request needs `ceil((prompt_len + max_new_tokens) / tokens_per_block)`
  blocks in total; `get_needed_resource_to_completion` returns what is still missing.

Prefix reuse (`enable_block_reuse`, `jaxllm.kv_cache.prefix_reuse`): `add_sequence`
(done by the capacity scheduler at admission, before chunk sizes are chosen) claims the
cached prefix of the prompt; `prepare_resources` indexes the prompt blocks its step
computes, and generated blocks once all their tokens are known on the host (not the token
fed this step, which an overlapped engine may not have read back yet).

Beam search (`request.beam` set, one beam included; `jaxllm.kv_cache.sequence`): `add_beams` adds the
beams of a request whose prompt is computed, and `fork_beams` gives each beam its parent's
blocks after every step (copy on write for a shared, partly filled last block).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.kv_cache.block_pool import BlockPool
from jaxllm.kv_cache.block_table import BlockTable, StepPlacement
from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.host_tier import HostTier, claim_matched, match_and_onboard
from jaxllm.kv_cache.invariants import check_manager_invariants
from jaxllm.kv_cache.prefix_reuse import PrefixReuse, num_computed_tokens
from jaxllm.kv_cache.sequence import BeamGroup, KvSequence, blocks_to_completion
from jaxllm.kv_cache.stats import AllocationCounts, KvCacheStats
from jaxllm.kv_cache.steady_decode import DecodeRows
from jaxllm.llm_request import LlmRequest, LlmRequestState

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.scheduler.output import SchedulerOutput

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS


class KVCacheManager:
    """Allocates KV blocks to requests and keeps their block tables.

    Composes the physical blocks (`BlockPool`), the block-table rows (`BlockTable`: one
    persistent int32 array the batch builder gathers a whole step's rows from), one
    `KvSequence` per request or beam (`BeamGroup` for beam search), prefix reuse
    (`PrefixReuse`) and the arrays of steady decode steps (`DecodeRows`).
    """

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        max_blocks_per_seq: int,
        enable_block_reuse: bool = True,
        *,
        max_num_sequences: int = 64,
        events: KvEventRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        host_tier: HostTier | None = None,
    ) -> None:
        """`host_tier`: a second tier that keeps evicted reusable blocks (`jaxllm.kv_cache.host_tier`)."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_block_reuse = enable_block_reuse
        self._pool = BlockPool(
            num_blocks, events=events, clock=clock, num_secondary_blocks=0 if host_tier is None else host_tier.num_slots
        )
        self.host_tier = host_tier
        if host_tier is not None:
            self._pool.offload = host_tier.offload
            host_tier.clock = clock  # retention durations run out on the same clock in both tiers
        self._prefix = PrefixReuse(self._pool, tokens_per_block, max_blocks_per_seq)
        self._seqs: dict[int, KvSequence] = {}
        self._table = BlockTable(max(1, max_num_sequences), max_blocks_per_seq)
        self._counts = AllocationCounts()
        # Sum over live sequences of get_needed_resource_to_completion (kept incrementally).
        self._reserved = 0
        self._version = 0  # counts frees, so a recorded StepPlacement can tell it is stale
        # Requests whose onboarded blocks are still arriving (the host tier's live set).
        self.waiting_request_ids: set[int] = set() if host_tier is None else host_tier.waiting_ids

    # ------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_kv_slots(self) -> int:
        """Token slots in the device pool; also the padding slot index (writes dropped)."""
        return self._pool.num_blocks * self.tokens_per_block

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free list plus evictable cached blocks)."""
        return self._pool.num_available

    @property
    def num_cached_blocks(self) -> int:
        """Unowned blocks kept for prefix reuse."""
        return self._pool.num_evictable

    @property
    def block_pool(self) -> BlockPool:
        """The physical blocks (reference counts, eviction order, retention priorities)."""
        return self._pool

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def block_table(self) -> np.ndarray:
        """The persistent [rows, max_blocks_per_seq] table; index it with `get_table_rows`.
        The array may be replaced when more sequences are live than rows exist, so fetch
        it again each step."""
        return self._table.block_ids

    @property
    def row_num_blocks(self) -> np.ndarray:
        """Blocks held by the sequence in each row of `block_table`."""
        return self._table.num_blocks

    @property
    def num_unshared_blocks(self) -> int:
        """Blocks the live sequences would hold without sharing (each its own copy of every
        block its table lists)."""
        return sum(len(seq.blocks) for seq in self._seqs.values())

    def live_requests(self) -> dict[int, LlmRequest]:
        """Every request and beam holding KV state, by request id (a new dict, for tests
        and inspection)."""
        return {rid: seq.request for rid, seq in self._seqs.items()}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # ------------------------------------------------- scheduler estimates
    def get_max_resource_count(self) -> int:
        """Total blocks in the pool."""
        return self._pool.num_blocks

    def get_num_available_blocks(self) -> int:
        """Blocks not owned by any sequence (free or evictable)."""
        return self._pool.num_available

    def get_num_reserved_blocks(self) -> int:
        """Blocks the live sequences may still take from the pool before they complete
        (the sum of `get_needed_resource_to_completion` over them)."""
        return self._reserved

    def has_sequence(self, request: LlmRequest) -> bool:
        """True once the request was added (it may hold blocks, possibly none yet)."""
        return request.request_id in self._seqs

    def get_num_allocated_blocks(self, request: LlmRequest) -> int:
        seq = self._seqs.get(request.request_id)
        return 0 if seq is None else len(seq.blocks)

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        """Blocks this request still has to take from the pool to finish in the worst case:
        `ceil((prompt_len + max_new_tokens) / tokens_per_block)` minus blocks it holds (for
        a request not yet added: minus prefix blocks it would share with running ones)."""
        seq = self._seqs.get(request.request_id)
        if seq is not None:
            if seq.group is not None:
                return seq.group.total - seq.group.distinct_blocks()
            need = seq.total_blocks - len(seq.blocks)
            return need if need > 0 else 0
        return blocks_to_completion(request, self.tokens_per_block) - self._num_shared_prefix_blocks(request)

    def get_needed_resource_for_step(self, request: LlmRequest) -> int:
        """Blocks this request takes from the pool if it runs this step (0 when it already
        holds them). A context request gets its whole prompt on its first chunk."""
        state = request.state
        seq = self._seqs.get(request.request_id)
        if state is _GENERATION_IN_PROGRESS:
            num_tokens = request.orig_prompt_len + len(request.output_token_ids)
            if seq is not None and num_tokens <= len(seq.blocks) * self.tokens_per_block:
                return 0  # the common case: the fed token fits the last block
            target = -(-num_tokens // self.tokens_per_block)
            if seq is not None and seq.group is not None:  # every beam grows (or copies) a block
                return len(seq.group.seqs) * max(target - len(seq.blocks), 1)
        elif state is _CONTEXT_INIT:
            target = -(-len(request.prompt_token_ids) // self.tokens_per_block)
        else:
            return 0
        if seq is None:
            return target - self._num_shared_prefix_blocks(request)
        need = target - len(seq.blocks)
        return need if need > 0 else 0

    # --------------------------------------------------------- allocation
    def add_sequence(self, request: LlmRequest, *, reuse: bool = True) -> int:
        """Start tracking a request that has no KV yet; with prefix reuse, claim the longest
        cached prefix of its prompt and advance `context_current_position` past it.
        Returns the number of reused prompt tokens. A no-op for a request already added."""
        rid = request.request_id
        seq = self._seqs.get(rid)
        if seq is not None:
            if seq.request is not request:
                raise ValueError(f"request id {rid} is already used by another live request")
            return 0
        if request.state != _CONTEXT_INIT or request.context_current_position != 0:
            raise ValueError(
                f"request {rid} has no KV blocks but is not at the start of its prompt "
                f"(state {request.state.name}, position {request.context_current_position}); "
                "pause() it so it is recomputed"
            )
        total = len(request.prompt_token_ids) + request.max_new_tokens
        seq = KvSequence(request, self._table.take_row(), self.blocks_for_tokens(total))
        self._seqs[rid] = seq
        if request.beam_width > 1 or request.beam is not None:  # beam search, one beam included
            seq.group = BeamGroup([seq], blocks_to_completion(request, self.tokens_per_block))
            self._reserved += seq.group.total
        else:
            self._reserved += seq.total_blocks
        num_prompt_blocks = self.blocks_for_tokens(len(request.prompt_token_ids))
        matched: list[int] = []
        host = self.host_tier
        if reuse and self.enable_block_reuse and request.reuse_prefix:
            if host is None:
                matched = self._prefix.match(request)
                if matched:
                    self._prefix.claim(seq, matched)
            else:
                matched = match_and_onboard(self._pool, host, request, self.tokens_per_block, self.max_blocks_per_seq)
                claim_matched(self._pool, seq, matched, self.tokens_per_block)
        if matched:
            k = len(matched)
            self._table.extend_row(seq.row, 0, matched)
            reused_tokens = k * self.tokens_per_block
            request.context_current_position = reused_tokens
            request.prepopulated_prompt_len = reused_tokens
            self._counts.reused += k
            self._counts.alloc_total += k
            self._reserved -= k
        self._counts.missed += num_prompt_blocks - len(matched)
        seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)
        return len(matched) * self.tokens_per_block

    def allocate_for_step(self, request: LlmRequest) -> int:
        """Give the request the blocks it needs to run this step (see module docstring).
        Returns the number of new blocks."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            self.add_sequence(request, reuse=False)
            seq = self._seqs[request.request_id]
        if request.state == _CONTEXT_INIT:
            num_tokens = len(request.prompt_token_ids)
            indexable = request.context_current_position + request.context_chunk_size
        else:
            num_tokens = request.num_tokens
            indexable = num_tokens - 1  # the token fed this step may not be known yet
        new = self._grow(seq, -(-num_tokens // self.tokens_per_block))
        if self.enable_block_reuse:
            if seq.group is not None:
                indexable = min(indexable, len(request.prompt_token_ids))
            self._register_computed(seq, request, indexable)
        return new

    def allocate_to_completion(self, request: LlmRequest) -> int:
        """Give the request every block it can ever need. Returns the number of new blocks."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            self.add_sequence(request)
            seq = self._seqs[request.request_id]
        return self._grow(seq, seq.total_blocks)

    def prepare_resources(self, scheduler_output: SchedulerOutput) -> None:
        """Allocate blocks so every scheduled request can hold this step's tokens.

        A request the capacity scheduler did not add yet is added here *without* prefix
        reuse, because its chunk was already sized from `context_current_position`.
        Prompt blocks this step completes, and generated blocks whose tokens are all known,
        enter the prefix index.
        """
        tpb = self.tokens_per_block
        reuse = self.enable_block_reuse
        seqs = self._seqs
        rows: list[int] = []
        for request in scheduler_output.context_requests:
            seq = seqs.get(request.request_id)
            if seq is None:
                self.add_sequence(request, reuse=False)
                seq = seqs[request.request_id]
            need = -(-len(request.prompt_token_ids) // tpb)
            if need > len(seq.blocks):
                self._grow(seq, need)
            if reuse:
                self._register_computed(seq, request, request.context_current_position + request.context_chunk_size)
            rows.append(seq.row)
        add_row = rows.append
        gen_num_tokens: list[int] = []
        add_num_tokens = gen_num_tokens.append
        for request in scheduler_output.generation_requests:
            seq = seqs.get(request.request_id)
            if seq is None:
                raise RuntimeError(
                    f"generation request {request.request_id} has no KV blocks; it was freed "
                    "or never allocated (pause() a request before dropping its blocks)"
                )
            # num_tokens; the token fed this step is the last of these
            num_tokens = request.orig_prompt_len + len(request.output_token_ids)
            if num_tokens >= seq.next_event:  # once per block boundary
                self._prepare_generation(seq, request, num_tokens)
            add_row(seq.row)
            add_num_tokens(num_tokens)
        scheduler_output.kv_placement = StepPlacement(self, self._version, rows, gen_num_tokens)

    def _prepare_generation(self, seq: KvSequence, request: LlmRequest, num_tokens: int) -> None:
        """A generation step at a block boundary: a new block, or a full block to index."""
        tpb = self.tokens_per_block
        if num_tokens > len(seq.blocks) * tpb:
            self._grow(seq, -(-num_tokens // tpb))
        if (
            self.enable_block_reuse
            and (num_tokens - 1) // tpb > len(seq.nodes)
            and seq.group is None
            and self._prefix.register_computed(seq, request, num_tokens - 1)
        ):
            seq.refresh_next_event(tpb, self.enable_block_reuse)

    # ------------------------------------------------------- speculative decoding
    def grow_for_drafts(self, request: LlmRequest, num_tokens: int) -> int:
        """Give a generation request blocks for `num_tokens` tokens (its fed token plus the
        draft tokens a speculative step verifies); nothing is indexed (drafts are not known
        tokens). Returns the number of new blocks. Stays within the request's reservation as
        long as the drafts do not run past max_tokens."""
        seq = self._seqs[request.request_id]
        return self._grow(seq, -(-num_tokens // self.tokens_per_block))

    def roll_back(self, request: LlmRequest, num_tokens: int) -> int:
        """Keep only the blocks of the first `num_tokens` tokens (never an indexed one): the
        blocks taken by `grow_for_drafts` for drafts that were rejected go back to the pool.
        Returns the number of blocks released."""
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request or seq.group is not None:
            return 0
        keep = max(-(-num_tokens // self.tokens_per_block), len(seq.nodes))
        extra = seq.blocks[keep:]
        if not extra:
            return 0
        del seq.blocks[keep:]
        for block in reversed(extra):
            self._pool.release(block)
        self._table.assign_row(seq.row, seq.blocks)
        self._reserved += len(extra)
        self._version += 1
        seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)
        return len(extra)

    # -------------------------------------------------------- steady decode
    def decode_rows(self, scheduler_output: SchedulerOutput) -> DecodeRows:
        """The per-slot arrays of a generation-only step just prepared by
        `prepare_resources`, for `prepare_decode` to prepare the next steps of the same
        requests."""
        requests = scheduler_output.generation_requests
        placement = scheduler_output.kv_placement
        next_events = [self._seqs[r.request_id].next_event for r in requests]
        return DecodeRows.record(requests, self._version, placement.rows, placement.generation_num_tokens, next_events)

    def decode_rows_current(self, decode: DecodeRows) -> bool:
        """True if no sequence was freed since `decode` was recorded (its rows still hold
        the same requests)."""
        return decode.version == self._version

    def prepare_decode(
        self,
        scheduler_output: SchedulerOutput,
        decode: DecodeRows,
        flush_rows: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`prepare_resources` for the next step of `decode.requests` (the generation
        requests, no context requests), each of which got one token from the step before
        (`decode.num_tokens` advances by one): only sequences at a block boundary are
        visited. Records a placement carrying the arrays. `flush_rows(rows)` brings the
        visited rows' read-back tokens into their requests first (a block is indexed by its
        tokens) when the caller keeps them elsewhere."""
        num_tokens = decode.advance(self._seqs, self._prepare_generation, flush_rows)
        scheduler_output.kv_placement = StepPlacement(self, self._version, decode.rows, num_tokens, decode)

    # ------------------------------------------------------------- freeing
    def free_resources(self, request: LlmRequest) -> int:
        """Release the request's blocks (on finish, abort or pause). With reuse on, its
        full computed blocks stay cached for later requests. Returns how many blocks went
        back to the pool (shared blocks stay with their other owners). Safe to call on a
        request that holds nothing."""
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request:
            return 0
        if self.host_tier is not None:
            self.host_tier.forget(request.request_id)
        group = seq.group
        if group is not None:
            if group.seqs[0] is not seq:
                raise ValueError(f"request {request.request_id} is a beam of another request; free that request")
            self._reserved -= group.total - group.distinct_blocks()
            return sum(self._free_sequence(beam, beam.request) for beam in group.disband())
        return self._free_sequence(seq, request)

    def _free_sequence(self, seq: KvSequence, request: LlmRequest) -> int:
        if self.enable_block_reuse:
            computed = num_computed_tokens(request)
            if self._prefix.withdraw_uncomputed(seq, computed):
                seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)
            if request.beam_width > 1 or request.request_id < 0:  # generated beam blocks stay unindexed
                computed = min(computed, len(request.prompt_token_ids))
            self._register_computed(seq, request, computed)
        del self._seqs[request.request_id]
        self._version += 1
        self._reserved -= seq.total_blocks - len(seq.blocks)
        pool = self._pool
        returned = 0
        # Tail first: the end of a prefix is evicted before its beginning.
        for block in reversed(seq.blocks):
            if pool.release(block):
                returned += 1
        self._table.release_row(seq.row, len(seq.blocks))
        return returned

    # ----------------------------------------------------------- beam search
    def add_beams(self, request: LlmRequest, beams: list[LlmRequest]) -> None:
        """Track the beams 1..k-1 of a beam-search request (beam 0 is `request`, already
        added). They hold no blocks until `fork_beams` gives them their parents'."""
        leader = self._seqs.get(request.request_id)
        if leader is None or leader.group is None:
            raise ValueError(f"request {request.request_id} is not a beam-search request with KV blocks")
        group = leader.group
        if len(group.seqs) + len(beams) != request.beam_width:
            raise ValueError(
                f"request {request.request_id}: {len(group.seqs) + len(beams)} beams for a beam "
                f"width of {request.beam_width}"
            )
        for beam in beams:
            if beam.request_id in self._seqs:
                raise ValueError(f"beam id {beam.request_id} is already in use")
            seq = KvSequence(beam, self._table.take_row(), leader.total_blocks, group=group)
            self._seqs[beam.request_id] = seq
            group.seqs.append(seq)

    def fork_beams(self, request: LlmRequest, parents: list[int], num_cached_tokens: int) -> list[tuple[int, int]]:
        """Make beam j continue beam `parents[j]` (see `BeamGroup.fork`). Returns the
        (source, destination) block copies the device must make before the next step."""
        group = self._seqs[request.request_id].group
        if group is None or len(parents) != len(group.seqs):
            raise ValueError(f"request {request.request_id}: {len(parents)} parents for its beams")
        before = group.distinct_blocks()
        copies = group.fork(self._pool, parents, num_cached_tokens, self.tokens_per_block)
        self._counts.alloc_new += len(copies)
        self._counts.alloc_total += len(copies)
        for seq in group.seqs:
            self._table.assign_row(seq.row, seq.blocks)
            seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)
        self._reserved += before - group.distinct_blocks()
        return copies

    # ------------------------------------------------------- block tables
    def placement_is_current(self, placement: StepPlacement | None) -> bool:
        """True if `placement` was recorded by this manager and no sequence was freed since
        (so its rows still belong to the same requests and hold this step's blocks)."""
        return placement is not None and placement.manager is self and placement.version == self._version

    def get_block_ids(self, request: LlmRequest) -> list[int]:
        seq = self._seqs.get(request.request_id)
        return [] if seq is None else list(seq.blocks)

    def get_table_row(self, request: LlmRequest) -> int:
        """Row of `block_table` holding this request's blocks."""
        return self._seqs[request.request_id].row

    def get_table_rows(self, requests: Iterable[LlmRequest]) -> list[int]:
        seqs = self._seqs
        try:
            return [seqs[r.request_id].row for r in requests]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]} holds no KV blocks") from None

    def fill_block_table_row(self, request: LlmRequest, out_row: np.ndarray) -> None:
        """Write the request's block ids into a fixed-width int32 row (rest zero-filled,
        0 being a valid block id)."""
        seq = self._seqs.get(request.request_id)
        n = 0 if seq is None else len(seq.blocks)
        if n > out_row.shape[0]:
            raise ValueError(
                f"request {request.request_id} holds {n} blocks but the row has {out_row.shape[0]} entries"
            )
        out_row[:] = 0
        if seq is not None and n:
            out_row[:n] = self._table.block_ids[seq.row, :n]

    # ------------------------------------------------------------- stats
    def get_kv_cache_stats(self) -> KvCacheStats:
        return self._counts.stats(self._pool.num_blocks, self._pool.num_available, self.tokens_per_block)

    def check_invariants(self) -> None:
        """Raise AssertionError if free + owned + cached != pool, a block is lost or in two
        places, reference counts disagree with the block tables, or a table row is stale."""
        check_manager_invariants(self._seqs, self._table, self._pool, self._reserved, self.tokens_per_block)
        if self.host_tier is not None:
            self.host_tier.check_invariants()

    # ----------------------------------------------------------- internal
    def _grow(self, seq: KvSequence, num_blocks: int) -> int:
        have = len(seq.blocks)
        extra = num_blocks - have
        if extra <= 0:
            return 0
        seq.check_growth(num_blocks, self.max_blocks_per_seq)
        pool = self._pool
        if extra > pool.num_available:
            raise RuntimeError(
                f"KV cache pool exhausted: request {seq.request.request_id} needs {extra} more "
                f"blocks, {pool.num_available} left; the capacity scheduler admitted more than fits"
            )
        if extra == 1:  # the common case in generation: avoid a list -> array conversion
            block = pool.allocate()
            seq.blocks.append(block)
            self._table.append_block(seq.row, have, block)
        else:
            new = pool.allocate_many(extra)
            seq.blocks.extend(new)
            self._table.extend_row(seq.row, have, new)
        self._counts.alloc_new += extra
        self._counts.alloc_total += extra
        self._reserved -= extra
        seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)
        return extra

    def _register_computed(self, seq: KvSequence, request: LlmRequest, num_computed: int) -> None:
        """Index the sequence's full blocks among its first `num_computed` tokens."""
        if self._prefix.register_computed(seq, request, num_computed):
            seq.refresh_next_event(self.tokens_per_block, self.enable_block_reuse)

    def _num_shared_prefix_blocks(self, request: LlmRequest) -> int:
        """Prefix blocks a new request would share with live sequences (`PrefixReuse.num_shared`)."""
        return self._prefix.num_shared(request) if self.enable_block_reuse else 0
