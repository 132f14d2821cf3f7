"""The KV state of one sequence, and the beams of a beam-search request.

Beam search (`request.beam_width > 1`): the request's beams are sequences of one
`BeamGroup`, each with its own block-table row. The prompt is computed once, by the
request's own sequence (beam 0); the other beams are added once it is done, and after
every step `BeamGroup.fork` gives each beam its parent's blocks: full blocks are shared by
reference count, and a partially filled last block that several beams would write into is
copied first (copy on write; the caller copies the device pages). The group reserves the
worst case, `k * ceil((P + M) / tpb) - (k - 1) * (P // tpb)` blocks (only full prompt
blocks are surely shared, see `blocks_to_completion`), and releases every beam's blocks
when the request is freed. Blocks holding generated tokens of beams are not entered in the
prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.kv_cache.block_pool import BlockPool
from jaxllm.llm_request import LlmRequest


def blocks_to_completion(request: LlmRequest, tokens_per_block: int) -> int:
    """Blocks a request may hold at most: every beam at full length, the full prompt
    blocks counted once."""
    tpb = tokens_per_block
    prompt_len = len(request.prompt_token_ids)
    total = -(-(prompt_len + request.max_new_tokens) // tpb)
    k = request.beam_width
    return total if k == 1 else k * total - (k - 1) * (prompt_len // tpb)


@dataclass(eq=False)
class KvSequence:
    """The KV state of one request (or beam): its blocks and its row in the block table."""

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
    group: BeamGroup | None = None  # the beams of a beam-search request, when it is one

    @property
    def num_registered(self) -> int:
        return len(self.nodes)

    def check_growth(self, num_blocks: int, max_blocks_per_seq: int) -> None:
        """Raise unless the sequence may hold `num_blocks` blocks."""
        if num_blocks > max_blocks_per_seq:
            raise ValueError(
                f"request {self.request.request_id} needs {num_blocks} blocks, more than "
                f"max_blocks_per_seq={max_blocks_per_seq}"
            )
        if num_blocks > self.total_blocks:
            raise RuntimeError(
                f"request {self.request.request_id} outgrew prompt_len + max_new_tokens "
                f"({self.total_blocks} blocks); finish it once it reaches max_new_tokens"
            )

    def refresh_next_event(self, tokens_per_block: int, index_blocks: bool) -> None:
        """Recompute `next_event` after the blocks or their indexed prefix changed
        (`index_blocks`: full blocks enter the prefix index, which beams' never do)."""
        tpb = tokens_per_block
        event = len(self.blocks) * tpb + 1  # first token that needs a new block
        if index_blocks and self.group is None:
            # num_tokens at which the next unindexed block is full of known tokens
            fills = (len(self.nodes) + 1) * tpb + 1
            if fills < event:
                event = fills
        self.next_event = event


@dataclass(eq=False)
class BeamGroup:
    """The sequences of one beam-search request (beam 0 is the request itself) and the
    blocks the group reserved for the worst case."""

    seqs: list[KvSequence]
    total: int

    def distinct_blocks(self) -> int:
        return len({b for s in self.seqs for b in s.blocks})

    def fork(
        self, pool: BlockPool, parents: list[int], num_cached_tokens: int, tokens_per_block: int
    ) -> list[tuple[int, int]]:
        """Make beam j continue beam `parents[j]`: it takes that beam's blocks (shared by
        reference count). `num_cached_tokens`: tokens whose KV is written; when the next
        one lands inside a block several beams share, all but one of them get a private
        copy of it. Returns the (source, destination) block copies the device must make
        before the next step; the caller updates the beams' block-table rows."""
        seqs = self.seqs
        new = [list(seqs[p].blocks) for p in parents]
        new_nodes = [list(seqs[p].nodes) for p in parents]
        for blocks in new:
            for block in blocks:
                pool.acquire(block)
        for seq in seqs:
            for block in reversed(seq.blocks):
                pool.release(block)
        copies: list[tuple[int, int]] = []
        tpb = tokens_per_block
        index = num_cached_tokens // tpb
        if num_cached_tokens % tpb:  # the next token is written into a partly filled block
            for blocks in new:
                if index < len(blocks) and pool.ref_count[blocks[index]] > 1:
                    src = blocks[index]
                    dst = pool.allocate()
                    pool.release(src)
                    blocks[index] = dst
                    copies.append((src, dst))
        for seq, blocks, nodes in zip(seqs, new, new_nodes, strict=True):
            seq.blocks = blocks
            seq.nodes = nodes[: len(blocks)]
        return copies

    def disband(self) -> list[KvSequence]:
        """Detach the beams for freeing (nothing stays reserved per beam); returns them
        last beam first, the order they are freed in."""
        for beam in self.seqs:
            beam.group = None
            beam.total_blocks = len(beam.blocks)
        return self.seqs[::-1]
