"""Block-table rows: the block ids of every live sequence in one persistent int32 array,
and the rows of a prepared step (`StepPlacement`).

A row per sequence, `width` (= max_blocks_per_seq) entries wide, unused entries 0, plus
the number of blocks in each row, so the batch builder gathers the rows of a whole step
in one numpy operation. Rows are reused after their sequence is freed; when more
sequences are live than rows exist, both arrays are replaced by ones twice as tall.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.kv_cache.manager import KVCacheManager
    from jaxllm.kv_cache.steady_decode import DecodeRows


@dataclass
class StepPlacement:
    """Where the sequences of a prepared step live, recorded by `prepare_resources` on the
    SchedulerOutput so the batch builder does not look every request up again."""

    manager: KVCacheManager
    version: int  # the manager's free counter when recorded: a later free voids the rows
    # block-table row per scheduled request, context requests first (arrays on a decode-only step)
    rows: list[int] | np.ndarray
    generation_num_tokens: list[int] | np.ndarray  # num_tokens of each generation request this step
    # Set on a decode-only step prepared by `prepare_decode`: the same rows as arrays.
    decode: DecodeRows | None = None


class BlockTable:
    """The block-id rows, the block count of each row and the free rows."""

    def __init__(self, rows: int, width: int) -> None:
        self.width = width
        self.block_ids = np.zeros((rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int32)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.block_ids.shape[0]

    @property
    def free_rows(self) -> tuple[int, ...]:
        """Rows no sequence holds (a copy)."""
        return tuple(self._free_rows)

    def take_row(self) -> int:
        """A cleared row for a new sequence (the arrays double when none is free)."""
        if not self._free_rows:
            old = self.block_ids.shape[0]
            table = np.zeros((old * 2, self.width), dtype=np.int32)
            table[:old] = self.block_ids
            counts = np.zeros(old * 2, dtype=np.int32)
            counts[:old] = self.num_blocks
            self.block_ids, self.num_blocks = table, counts
            self._free_rows = list(range(old * 2 - 1, old - 1, -1))
        return self._free_rows.pop()

    def release_row(self, row: int, num_blocks: int) -> None:
        """Clear the row's first `num_blocks` entries and its count, and free it."""
        self.block_ids[row, :num_blocks] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def append_block(self, row: int, index: int, block: int) -> None:
        """Set entry `index` of the row (its new last block)."""
        self.block_ids[row, index] = block
        self.num_blocks[row] = index + 1

    def extend_row(self, row: int, start: int, blocks: list[int]) -> None:
        """Set entries `start..start+len(blocks)` of the row (its new last blocks)."""
        end = start + len(blocks)
        self.block_ids[row, start:end] = blocks
        self.num_blocks[row] = end

    def assign_row(self, row: int, blocks: list[int]) -> None:
        """Make `blocks` the row's whole content (entries past it cleared)."""
        old = int(self.num_blocks[row])
        n = len(blocks)
        self.block_ids[row, :n] = blocks
        if old > n:
            self.block_ids[row, n:old] = 0
        self.num_blocks[row] = n
