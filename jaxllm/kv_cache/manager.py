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

Prefix reuse (`enable_block_reuse`): when a request is first added (`add_sequence`, done
by the capacity scheduler at admission, before chunk sizes are chosen) the longest chain
of cached full prompt blocks becomes the start of its block table and
`context_current_position` jumps past those tokens; at least one prompt token is always
left to compute, so the step still produces the first output token.

A full prompt block enters the prefix index in `prepare_resources` of the step that
computes it, so a request admitted in the next step can already reuse it (steps run in
order, so the KV is written before any later step reads it); if the request is freed
before that step ran, the entry is withdrawn again. A block holding generated tokens is
indexed once all its tokens are known on the host, i.e. not including the token fed in
the current step (which an overlapped engine may not have read back yet).

Beam search (`request.beam_width > 1`): the request's beams are sequences of one
`_BeamGroup`, each with its own block-table row. The prompt is computed once, by the
request's own sequence (beam 0); `add_beams` adds the other beams and `fork_beams`
gives each new beam its parent's blocks after every step: full blocks are shared by
reference count, and a partially filled last block that several beams would write into is
copied first (copy on write; the caller copies the device pages). The group reserves the
worst case, `k * ceil((P + M) / tpb) - (k - 1) * (P // tpb)` blocks (only full prompt
blocks are surely shared), and releases every beam's blocks when the request is freed.
Blocks holding generated tokens of beams are not entered in the prefix index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import numpy as np

from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockPool
from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.retention import DEFAULT_RETENTION_PRIORITY
from jaxllm.kv_cache.stats import KvCacheStats
from jaxllm.request import LlmRequest, LlmRequestState

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.scheduler.output import SchedulerOutput

_CONTEXT_INIT = LlmRequestState.CONTEXT_INIT
_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS


def prefix_root(request: LlmRequest) -> int:
    """The node prefixes of `request` hang from: with a LoRA adapter the KV differs from the
    base model's for the same tokens, so each adapter has its own prefix tree (a negative
    root, which no block's node id can equal)."""
    adapter = getattr(request, "lora_adapter", None)
    return ROOT_NODE if adapter is None else -adapter.lora_int_id


@dataclass(eq=False)
class _Sequence:
    """The KV state of one request: its blocks and its row in the block-table array."""

    request: LlmRequest
    row: int
    total_blocks: int  # blocks to completion: ceil((prompt_len + max_new_tokens) / tpb)
    blocks: list[int] = field(default_factory=list)
    # Prefix node of each leading block already in the prefix index. A block whose
    # prefix was indexed first by another sequence keeps that sequence's node.
    nodes: list[int] = field(default_factory=list)
    # Smallest `num_tokens` at which a generation step needs a new block or can index a
    # full one (so the per-step check of a generation request is a single comparison).
    next_event: int = 0
    group: Optional["_BeamGroup"] = None  # the beams of a beam-search request, when it is one

    @property
    def num_registered(self) -> int:
        return len(self.nodes)


@dataclass(eq=False)
class _BeamGroup:
    """The sequences of one beam-search request (beam 0 is the request itself) and the
    blocks the group reserved for the worst case."""

    seqs: list[_Sequence]
    total: int

    def distinct_blocks(self) -> int:
        return len({b for s in self.seqs for b in s.blocks})


@dataclass
class StepPlacement:
    """Where the sequences of a prepared step live, recorded by `prepare_resources` on the
    SchedulerOutput so the batch builder does not look every request up again."""

    manager: "KVCacheManager"
    version: int  # the manager's free counter when recorded: a later free voids the rows
    rows: list[int]  # block-table row per scheduled request, context requests first
    generation_num_tokens: list[int]  # num_tokens of each generation request this step
    # Set on a decode-only step prepared by `prepare_decode`: the same rows as arrays.
    decode: Optional["DecodeRows"] = None


@dataclass
class DecodeRows:
    """Per-slot arrays of a steady decode batch (the same generation requests, in the same
    order, step after step), so that preparing a step is a few numpy operations instead of
    a pass over the requests: block-table rows, prompt lengths, and the `num_tokens` at
    which each sequence next needs a block or can index a full one."""

    requests: list[LlmRequest]
    version: int  # the manager's free counter when recorded (a free voids the rows)
    rows: np.ndarray  # intp[n] block-table row of each request
    orig_prompt_len: np.ndarray  # int64[n]
    next_event: np.ndarray  # int64[n] `_Sequence.next_event` of each request
    num_tokens: np.ndarray  # int64[n] num_tokens of each request in the last prepared step
    # The token entries of the last step committed from these rows (the planner's record).
    entries: Optional[list] = None
    # The planner's `DecodeTokenLog` of these rows (tokens not yet in the requests' lists).
    log: Optional[Any] = None


class KVCacheManager:
    """Allocates KV blocks to requests and keeps their block tables.

    Block tables live in one persistent int32 array (a row per live sequence, width
    `max_blocks_per_seq`, unused entries 0) so the batch builder can gather the rows of a
    whole step in one numpy operation.
    """

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        max_blocks_per_seq: int,
        enable_block_reuse: bool = True,
        *,
        max_num_sequences: int = 64,
        events: Optional[KvEventRecorder] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_block_reuse = enable_block_reuse
        self._pool = BlockPool(num_blocks, events=events, clock=clock)
        self._seqs: dict[int, _Sequence] = {}
        rows = max(1, max_num_sequences)
        self._table = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self._row_num_blocks = np.zeros(rows, dtype=np.int32)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        # cumulative statistics
        self._alloc_total = 0
        self._alloc_new = 0
        self._reused = 0
        self._missed = 0
        # Sum over live sequences of get_needed_resource_to_completion (kept incrementally).
        self._reserved = 0
        self._version = 0  # counts frees, so a recorded StepPlacement can tell it is stale

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
        return self._table

    @property
    def row_num_blocks(self) -> np.ndarray:
        """Blocks held by the sequence in each row of `block_table`."""
        return self._row_num_blocks

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
        return self._total_blocks(request) - self._num_shared_prefix_blocks(request)

    def _total_blocks(self, request: LlmRequest) -> int:
        """Blocks a request may hold at most: every beam at full length, the full prompt
        blocks counted once."""
        tpb = self.tokens_per_block
        prompt_len = len(request.prompt_token_ids)
        total = -(-(prompt_len + request.max_new_tokens) // tpb)
        k = request.beam_width
        return total if k == 1 else k * total - (k - 1) * (prompt_len // tpb)

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
                "pause() it so it is recomputed")
        total = len(request.prompt_token_ids) + request.max_new_tokens
        seq = _Sequence(request, self._take_row(), self.blocks_for_tokens(total))
        self._seqs[rid] = seq
        if request.beam_width > 1:
            seq.group = _BeamGroup([seq], self._total_blocks(request))
            self._reserved += seq.group.total
        else:
            self._reserved += seq.total_blocks
        num_prompt_blocks = self.blocks_for_tokens(len(request.prompt_token_ids))
        matched: list[int] = []
        if reuse and self.enable_block_reuse and request.reuse_prefix:
            matched = self._match_prefix(request)
        if matched:
            pool = self._pool
            for block in matched:
                pool.acquire(block)
            config = request.kv_cache_retention_config
            if config is not None:  # the request's priorities apply to the blocks it reuses
                tpb, plen = self.tokens_per_block, request.orig_prompt_len
                for i, block in enumerate(matched):
                    priority, duration = config.block_retention(i, tpb, plen)
                    if priority is not None:
                        pool.set_retention(block, priority, duration)
            k = len(matched)
            seq.blocks = matched
            seq.nodes = [pool.node_of(b) for b in matched]
            self._table[seq.row, :k] = matched
            self._row_num_blocks[seq.row] = k
            reused_tokens = k * self.tokens_per_block
            request.context_current_position = reused_tokens
            request.prepopulated_prompt_len = reused_tokens
            self._reused += k
            self._alloc_total += k
            self._reserved -= k
        self._missed += num_prompt_blocks - len(matched)
        self._refresh_next_event(seq)
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

    def prepare_resources(self, scheduler_output: "SchedulerOutput") -> None:
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
                self._register_computed(
                    seq, request, request.context_current_position + request.context_chunk_size)
            rows.append(seq.row)
        add_row = rows.append
        gen_num_tokens: list[int] = []
        add_num_tokens = gen_num_tokens.append
        for request in scheduler_output.generation_requests:
            seq = seqs.get(request.request_id)
            if seq is None:
                raise RuntimeError(
                    f"generation request {request.request_id} has no KV blocks; it was freed "
                    "or never allocated (pause() a request before dropping its blocks)")
            # num_tokens; the token fed this step is the last of these
            num_tokens = request.orig_prompt_len + len(request.output_token_ids)
            if num_tokens >= seq.next_event:  # once per block boundary
                self._prepare_generation(seq, request, num_tokens)
            add_row(seq.row)
            add_num_tokens(num_tokens)
        scheduler_output.kv_placement = StepPlacement(self, self._version, rows, gen_num_tokens)

    def _prepare_generation(self, seq: _Sequence, request: LlmRequest, num_tokens: int) -> None:
        """A generation step at a block boundary: a new block, or a full block to index."""
        tpb = self.tokens_per_block
        if num_tokens > len(seq.blocks) * tpb:
            self._grow(seq, -(-num_tokens // tpb))
        if self.enable_block_reuse and (num_tokens - 1) // tpb > len(seq.nodes) and seq.group is None:
            self._register_computed(seq, request, num_tokens - 1)

    def decode_rows(self, scheduler_output: "SchedulerOutput") -> DecodeRows:
        """The per-slot arrays of a generation-only step just prepared by
        `prepare_resources`, for `prepare_decode` to prepare the next steps of the same
        requests."""
        requests = scheduler_output.generation_requests
        placement = scheduler_output.kv_placement
        seqs = [self._seqs[r.request_id] for r in requests]
        n = len(seqs)
        return DecodeRows(
            requests=list(requests), version=self._version,
            rows=np.array(placement.rows, np.intp).reshape(n),
            orig_prompt_len=np.fromiter((r.orig_prompt_len for r in requests), np.int64, n),
            next_event=np.fromiter((s.next_event for s in seqs), np.int64, n),
            num_tokens=np.array(placement.generation_num_tokens, np.int64).reshape(n))

    def decode_rows_current(self, decode: DecodeRows) -> bool:
        """True if no sequence was freed since `decode` was recorded (its rows still hold
        the same requests)."""
        return decode.version == self._version

    def prepare_decode(self, scheduler_output: "SchedulerOutput", decode: DecodeRows,
                       flush_rows: Optional[Callable[[list[int]], None]] = None) -> None:
        """`prepare_resources` for the next step of `decode.requests` (the generation
        requests, no context requests), each of which got one token from the step before
        (`decode.num_tokens` advances by one): only sequences at a block boundary are
        visited. Records a placement carrying the arrays. `flush_rows(rows)` brings the
        visited rows' read-back tokens into their requests first (a block is indexed by its
        tokens) when the caller keeps them elsewhere."""
        num_tokens = decode.num_tokens + 1
        due = np.flatnonzero(num_tokens >= decode.next_event)
        if due.size:
            seqs, requests, next_event = self._seqs, decode.requests, decode.next_event
            due = due.tolist()
            if flush_rows is not None:
                flush_rows(due)
            for i in due:
                request = requests[i]
                seq = seqs[request.request_id]
                self._prepare_generation(seq, request, int(num_tokens[i]))
                next_event[i] = seq.next_event
        decode.num_tokens = num_tokens
        scheduler_output.kv_placement = StepPlacement(self, self._version, decode.rows, num_tokens, decode)

    def free_resources(self, request: LlmRequest) -> int:
        """Release the request's blocks (on finish, abort or pause). With reuse on, its
        full computed blocks stay cached for later requests. Returns how many blocks went
        back to the pool (shared blocks stay with their other owners). Safe to call on a
        request that holds nothing."""
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request:
            return 0
        group = seq.group
        if group is not None:
            if group.seqs[0] is not seq:
                raise ValueError(f"request {request.request_id} is a beam of another request; free that request")
            self._reserved -= group.total - group.distinct_blocks()
            returned = 0
            for beam in reversed(group.seqs):
                beam.group = None
                beam.total_blocks = len(beam.blocks)  # nothing left reserved per beam
                returned += self._free_sequence(beam, beam.request)
            return returned
        return self._free_sequence(seq, request)

    def _free_sequence(self, seq: _Sequence, request: LlmRequest) -> int:
        if self.enable_block_reuse:
            computed = self._num_computed_tokens(request)
            self._withdraw_uncomputed(seq, computed)
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
        row = seq.row
        self._table[row, : len(seq.blocks)] = 0
        self._row_num_blocks[row] = 0
        self._free_rows.append(row)
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
            raise ValueError(f"request {request.request_id}: {len(group.seqs) + len(beams)} beams for a beam "
                             f"width of {request.beam_width}")
        for beam in beams:
            if beam.request_id in self._seqs:
                raise ValueError(f"beam id {beam.request_id} is already in use")
            seq = _Sequence(beam, self._take_row(), leader.total_blocks, group=group)
            self._seqs[beam.request_id] = seq
            group.seqs.append(seq)

    def fork_beams(self, request: LlmRequest, parents: list[int], num_cached_tokens: int) -> list[tuple[int, int]]:
        """Make beam j continue beam `parents[j]`: it takes that beam's blocks (shared by
        reference count). `num_cached_tokens`: tokens whose KV is written; when the next
        one lands inside a block several beams share, all but one of them get a private
        copy of it. Returns the (source, destination) block copies the device must make
        before the next step."""
        group = self._seqs[request.request_id].group
        if group is None or len(parents) != len(group.seqs):
            raise ValueError(f"request {request.request_id}: {len(parents)} parents for its beams")
        pool = self._pool
        seqs = group.seqs
        before = group.distinct_blocks()
        new = [list(seqs[p].blocks) for p in parents]
        new_nodes = [list(seqs[p].nodes) for p in parents]
        for blocks in new:
            for block in blocks:
                pool.acquire(block)
        for seq in seqs:
            for block in reversed(seq.blocks):
                pool.release(block)
        copies: list[tuple[int, int]] = []
        tpb = self.tokens_per_block
        index = num_cached_tokens // tpb
        if num_cached_tokens % tpb:  # the next token is written into a partly filled block
            for blocks in new:
                if index < len(blocks) and pool.ref_count[blocks[index]] > 1:
                    src = blocks[index]
                    dst = pool.allocate()
                    pool.release(src)
                    blocks[index] = dst
                    copies.append((src, dst))
            self._alloc_new += len(copies)
            self._alloc_total += len(copies)
        for seq, blocks, nodes in zip(seqs, new, new_nodes):
            old = len(seq.blocks)
            seq.blocks = blocks
            seq.nodes = nodes[:len(blocks)]
            row = seq.row
            self._table[row, :len(blocks)] = blocks
            if old > len(blocks):
                self._table[row, len(blocks):old] = 0
            self._row_num_blocks[row] = len(blocks)
            self._refresh_next_event(seq)
        self._reserved += before - group.distinct_blocks()
        return copies

    # ------------------------------------------------------- block tables
    def placement_is_current(self, placement: Optional[StepPlacement]) -> bool:
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
                f"request {request.request_id} holds {n} blocks but the row has {out_row.shape[0]} entries")
        out_row[:] = 0
        if n:
            out_row[:n] = self._table[seq.row, :n]

    # ------------------------------------------------------------- stats
    def get_kv_cache_stats(self) -> KvCacheStats:
        lookups = self._reused + self._missed
        free = self._pool.num_available
        return KvCacheStats(
            max_num_blocks=self._pool.num_blocks,
            free_num_blocks=free,
            used_num_blocks=self._pool.num_blocks - free,
            tokens_per_block=self.tokens_per_block,
            alloc_total_blocks=self._alloc_total,
            alloc_new_blocks=self._alloc_new,
            reused_blocks=self._reused,
            missed_blocks=self._missed,
            cache_hit_rate=(self._reused / lookups) if lookups else 0.0,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if free + owned + cached != pool, a block is lost or in two
        places, reference counts disagree with the block tables, or a table row is stale."""
        counts = [0] * self._pool.num_blocks
        rows_seen: set[int] = set()
        reserved = 0
        for rid, seq in self._seqs.items():
            if seq.request.request_id != rid:
                raise AssertionError(f"sequence filed under id {rid} belongs to {seq.request.request_id}")
            blocks = seq.blocks
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"request {rid} lists a block twice: {blocks}")
            if len(blocks) > self.max_blocks_per_seq:
                raise AssertionError(f"request {rid} holds more than max_blocks_per_seq blocks")
            for b in blocks:
                counts[b] += 1
            if seq.row in rows_seen:
                raise AssertionError(f"block-table row {seq.row} is used by two sequences")
            rows_seen.add(seq.row)
            row = self._table[seq.row].tolist()
            if row[: len(blocks)] != blocks or any(row[len(blocks):]):
                raise AssertionError(f"block-table row of request {rid} is stale")
            if self._row_num_blocks[seq.row] != len(blocks):
                raise AssertionError(f"row block count of request {rid} is stale")
            if len(blocks) > seq.total_blocks:
                raise AssertionError(f"request {rid} holds more blocks than it reserved")
            group = seq.group
            if group is None:
                reserved += seq.total_blocks - len(blocks)
            elif group.seqs[0] is seq:
                if any(self._seqs.get(b.request.request_id) is not b or b.group is not group for b in group.seqs):
                    raise AssertionError(f"beam group of request {rid} lists a beam the manager does not track")
                held = group.distinct_blocks()
                if held > group.total:
                    raise AssertionError(f"beams of request {rid} hold {held} blocks, more than reserved")
                reserved += group.total - held
            elif seq not in group.seqs:
                raise AssertionError(f"beam {rid} is not in its group")
        free_rows = self._free_rows
        if rows_seen.intersection(free_rows):
            raise AssertionError(f"rows {sorted(rows_seen.intersection(free_rows))} are both free and in use")
        if free_rows and (self._table[free_rows].any() or self._row_num_blocks[free_rows].any()):
            raise AssertionError("a free block-table row is not cleared")
        if len(rows_seen) + len(self._free_rows) != self._table.shape[0]:
            raise AssertionError("block-table rows lost")
        if reserved != self._reserved:
            raise AssertionError(f"reserved-block total is {self._reserved}, the sequences add up to {reserved}")
        tpb = self.tokens_per_block
        beam_blocks = set()
        for seq in self._seqs.values():
            if seq.group is not None:
                # Beams share full blocks only: the block the next token lands in is private.
                written = seq.request.num_tokens - 1
                for i, b in enumerate(seq.blocks):
                    if (i + 1) * tpb <= written:
                        beam_blocks.add(b)
        self._pool.check_invariants(counts, frozenset(beam_blocks))

    # ----------------------------------------------------------- internal
    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._table.shape[0]
            table = np.zeros((old * 2, self.max_blocks_per_seq), dtype=np.int32)
            table[:old] = self._table
            counts = np.zeros(old * 2, dtype=np.int32)
            counts[:old] = self._row_num_blocks
            self._table, self._row_num_blocks = table, counts
            self._free_rows = list(range(old * 2 - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, seq: _Sequence, num_blocks: int) -> int:
        have = len(seq.blocks)
        extra = num_blocks - have
        if extra <= 0:
            return 0
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(
                f"request {seq.request.request_id} needs {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}")
        if num_blocks > seq.total_blocks:
            raise RuntimeError(
                f"request {seq.request.request_id} outgrew prompt_len + max_new_tokens "
                f"({seq.total_blocks} blocks); finish it once it reaches max_new_tokens")
        pool = self._pool
        if extra > pool.num_available:
            raise RuntimeError(
                f"KV cache pool exhausted: request {seq.request.request_id} needs {extra} more "
                f"blocks, {pool.num_available} left; the capacity scheduler admitted more than fits")
        if extra == 1:  # the common case in generation: avoid a list -> array conversion
            block = pool.allocate()
            seq.blocks.append(block)
            self._table[seq.row, have] = block
        else:
            new = pool.allocate_many(extra)
            seq.blocks.extend(new)
            self._table[seq.row, have:num_blocks] = new
        self._row_num_blocks[seq.row] = num_blocks
        self._alloc_new += extra
        self._alloc_total += extra
        self._reserved -= extra
        self._refresh_next_event(seq)
        return extra

    def _refresh_next_event(self, seq: _Sequence) -> None:
        tpb = self.tokens_per_block
        event = len(seq.blocks) * tpb + 1  # first token that needs a new block
        if self.enable_block_reuse and seq.group is None:
            # num_tokens at which the next unindexed block is full of known tokens
            fills = (len(seq.nodes) + 1) * tpb + 1
            if fills < event:
                event = fills
        seq.next_event = event

    def _num_computed_tokens(self, request: LlmRequest) -> int:
        """Tokens whose KV the finished steps have written (works for finished requests,
        which may have stopped in the middle of their prompt)."""
        position = request.context_current_position
        if position < len(request.prompt_token_ids):
            return position
        # Prompt done: every token but the last sampled one (not fed back yet) is in.
        return max(position, request.num_tokens - 1)

    def _register_computed(self, seq: _Sequence, request: LlmRequest, num_computed: int) -> None:
        """Index the sequence's full blocks among its first `num_computed` tokens."""
        tpb = self.tokens_per_block
        full = min(num_computed // tpb, len(seq.blocks))
        start = seq.num_registered
        if full <= start:
            return
        pool = self._pool
        nodes = seq.nodes
        node = nodes[-1] if nodes else prefix_root(request)
        base = start * tpb
        if full * tpb <= len(request.prompt_token_ids):
            tokens, base = request.prompt_token_ids, 0
        else:
            tokens = request.get_tokens(base, full * tpb)
        blocks = seq.blocks
        config = request.kv_cache_retention_config
        if config is None and pool.events is None:  # the common case
            for i in range(start, full):
                lo = i * tpb - base
                node = pool.register(blocks[i], node, tuple(tokens[lo:lo + tpb]))
                nodes.append(node)
        else:
            retentions = None
            if config is not None:
                plen = request.orig_prompt_len
                retentions = []
                for i in range(start, full):
                    priority, duration = config.block_retention(i, tpb, plen)
                    retentions.append((DEFAULT_RETENTION_PRIORITY, None) if priority is None else (priority, duration))
            lora = getattr(request, "lora_adapter", None)
            nodes.extend(pool.register_chain(
                blocks[start:full], node, [tuple(tokens[i * tpb - base:(i + 1) * tpb - base]) for i in range(start, full)],
                retentions, getattr(lora, "lora_int_id", None)))
        self._refresh_next_event(seq)

    def _withdraw_uncomputed(self, seq: _Sequence, num_computed: int) -> None:
        """Un-index blocks registered for a step that never ran (the request was freed in
        between), so nobody reuses KV that was never written."""
        full = num_computed // self.tokens_per_block
        if seq.num_registered <= full:
            return
        pool = self._pool
        for block in seq.blocks[full:seq.num_registered]:
            if pool.ref_count[block] == 1:
                pool.unregister(block)
        del seq.nodes[full:]
        self._refresh_next_event(seq)

    def _match_prefix(self, request: LlmRequest) -> list[int]:
        """Cached blocks holding the longest prefix of the prompt, leaving >= 1 token."""
        tpb = self.tokens_per_block
        prompt = request.prompt_token_ids
        limit = min((len(prompt) - 1) // tpb, self.max_blocks_per_seq)
        pool = self._pool
        node = prefix_root(request)
        matched: list[int] = []
        for i in range(limit):
            block = pool.lookup(node, tuple(prompt[i * tpb:(i + 1) * tpb]))
            if block is None:
                break
            matched.append(block)
            node = pool.node_of(block)
        return matched

    def _num_shared_prefix_blocks(self, request: LlmRequest) -> int:
        """Prefix blocks a new request would share with live sequences at no pool cost
        (cached-but-unowned matches still cost a block: they leave the evictable set)."""
        if not self.enable_block_reuse:
            return 0
        ref = self._pool.ref_count
        return sum(1 for b in self._match_prefix(request) if ref[b] > 0)
