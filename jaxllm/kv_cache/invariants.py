"""The KV cache manager's consistency check (tests and debugging): every block is in exactly
one place, reference counts match the block tables, table rows are current, and the
reserved-block total matches the sequences."""

from __future__ import annotations

from collections.abc import Mapping

from jaxllm.kv_cache.block_pool import BlockPool
from jaxllm.kv_cache.block_table import BlockTable
from jaxllm.kv_cache.sequence import KvSequence


def check_manager_invariants(
    seqs: Mapping[int, KvSequence], table: BlockTable, pool: BlockPool, reserved_total: int, tokens_per_block: int
) -> None:
    """Raise AssertionError if free + owned + cached != pool, a block is lost or in two
    places, reference counts disagree with the block tables, or a table row is stale."""
    counts = [0] * pool.num_blocks
    rows_seen: set[int] = set()
    reserved = 0
    for rid, seq in seqs.items():
        if seq.request.request_id != rid:
            raise AssertionError(f"sequence filed under id {rid} belongs to {seq.request.request_id}")
        blocks = seq.blocks
        if len(set(blocks)) != len(blocks):
            raise AssertionError(f"request {rid} lists a block twice: {blocks}")
        if len(blocks) > table.width:
            raise AssertionError(f"request {rid} holds more than max_blocks_per_seq blocks")
        for b in blocks:
            counts[b] += 1
        if seq.row in rows_seen:
            raise AssertionError(f"block-table row {seq.row} is used by two sequences")
        rows_seen.add(seq.row)
        row = table.block_ids[seq.row].tolist()
        if row[: len(blocks)] != blocks or any(row[len(blocks) :]):
            raise AssertionError(f"block-table row of request {rid} is stale")
        if table.num_blocks[seq.row] != len(blocks):
            raise AssertionError(f"row block count of request {rid} is stale")
        if len(blocks) > seq.total_blocks:
            raise AssertionError(f"request {rid} holds more blocks than it reserved")
        group = seq.group
        if group is None:
            reserved += seq.total_blocks - len(blocks)
        elif group.seqs[0] is seq:
            if any(seqs.get(b.request.request_id) is not b or b.group is not group for b in group.seqs):
                raise AssertionError(f"beam group of request {rid} lists a beam the manager does not track")
            held = group.distinct_blocks()
            if held > group.total:
                raise AssertionError(f"beams of request {rid} hold {held} blocks, more than reserved")
            reserved += group.total - held
        elif seq not in group.seqs:
            raise AssertionError(f"beam {rid} is not in its group")
    free_rows = list(table.free_rows)
    if rows_seen.intersection(free_rows):
        raise AssertionError(f"rows {sorted(rows_seen.intersection(free_rows))} are both free and in use")
    if free_rows and (table.block_ids[free_rows].any() or table.num_blocks[free_rows].any()):
        raise AssertionError("a free block-table row is not cleared")
    if len(rows_seen) + len(free_rows) != table.num_rows:
        raise AssertionError("block-table rows lost")
    if reserved != reserved_total:
        raise AssertionError(f"reserved-block total is {reserved_total}, the sequences add up to {reserved}")
    tpb = tokens_per_block
    beam_blocks = set()
    for seq in seqs.values():
        if seq.group is not None:
            # Beams share full blocks only: the block the next token lands in is private.
            written = seq.request.num_tokens - 1
            for i, b in enumerate(seq.blocks):
                if (i + 1) * tpb <= written:
                    beam_blocks.add(b)
    pool.check_invariants(counts, frozenset(beam_blocks))
