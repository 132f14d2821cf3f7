"""Device-side work schedule for the grouped GEMM kernels (tiles of rows x groups).

Rows are sorted by group, but group boundaries fall anywhere, so a fixed row tile of
`block_m` rows can straddle several groups. As in megablox's `make_group_metadata`, the
work list has one item per (row tile, group) pair that overlap; an item computes the
whole tile with that group's weights and stores only the rows inside the group, so the
items of one tile write disjoint rows. The padding rows past `sum(group_sizes)` form a
final pseudo-group whose items store zeros without touching any weights. The list is
built in XLA from `group_sizes` in device memory, padded to a static worst-case length
(each of the E + 1 segments adds at most one extra tile), so there is no host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Columns of the work table.
TILE_START, ROW_LO, ROW_HI, EXPERT, ACTIVE = range(5)
NUM_FIELDS = 8  # padded to a power of two


def max_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static bound: cdiv(M, block_m) tiles plus one extra per interior group boundary."""
    return -(-num_rows // block_m) + num_groups


def group_tile_schedule(group_sizes: jax.Array, *, num_rows: int, block_m: int) -> jax.Array:
    """int32[max_work_items, NUM_FIELDS]: per work item its tile, row range and group.

    `ACTIVE` is 1 for items that run the GEMM with group `EXPERT`'s weights and 0 for
    zero-filling items (padding rows) and unused items (whose row range is empty).
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]
    # Segment E is the padding run [total, num_rows).
    seg_start = jnp.concatenate([starts, total[None]])
    seg_end = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    nonempty = seg_end > seg_start
    first_tile = seg_start // block_m
    last_tile = (seg_end - 1) // block_m
    seg_items = jnp.where(nonempty, last_tile - first_tile + 1, 0)
    cum = jnp.cumsum(seg_items)
    first_item = cum - seg_items

    num_items = max_work_items(num_rows, num_groups, block_m)
    item = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cum, item, side="right").astype(jnp.int32), num_groups)
    used = item < cum[-1]
    tile_start = (first_tile[seg] + item - first_item[seg]) * block_m
    row_lo = jnp.where(used, jnp.maximum(seg_start[seg], tile_start), 0)
    row_hi = jnp.where(used, jnp.minimum(seg_end[seg], tile_start + block_m), 0)
    tile_start = jnp.where(used, tile_start, 0)
    active = (used & (seg < num_groups)).astype(jnp.int32)
    expert = jnp.minimum(seg, num_groups - 1)
    zeros = jnp.zeros_like(item)
    fields = [tile_start, row_lo, row_hi, expert, active]
    fields += [zeros] * (NUM_FIELDS - len(fields))
    return jnp.stack(fields, axis=1).astype(jnp.int32)
