"""Tile sizes of the ragged paged attention kernel, chosen from static shapes only (the kernel
compiles once per token bucket), and checked when they are built."""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.triton_backend import check_power_of_two

_TARGET_PROGRAMS = 2048  # enough resident programs to fill an H100 (132 SMs) several times


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class AttentionTiling:
    """Static tile sizes and launch parameters of one kernel instance."""

    block_m: int  # rows per program: block_q tokens x group_pow2 q heads, or one token x block_m heads
    block_k: int  # keys per inner-loop step
    num_kv_splits: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name, minimum in (("block_m", 16), ("block_k", 16), ("num_warps", 1)):
            check_power_of_two("AttentionTiling", name, getattr(self, name), minimum)
        if self.num_kv_splits < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: num_kv_splits and num_stages must be >= 1")


_Q_TILE_BYTES = 64 * 1024  # the q tile's share of shared memory (Hopper has 227 KiB per CTA)


def heads_per_tile(block_m: int, group_pow2: int) -> int:
    """Q heads of one kv head in a tile: the whole (padded) GQA group, or, when a group is
    wider than a tile (MLA's 128 heads over a 576-wide latent), a `block_m`-head slice of it."""
    return min(block_m, group_pow2)


def head_blocks(block_m: int, group_pow2: int) -> int:
    """Programs along the head axis per kv head: 1 unless a tile holds only part of a group."""
    return group_pow2 // heads_per_tile(block_m, group_pow2)


def block_q(block_m: int, group_pow2: int) -> int:
    """Tokens per query tile."""
    return block_m // heads_per_tile(block_m, group_pow2)


def default_tiling(
    num_tokens: int,
    num_seq_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    itemsize: int = 2,
) -> AttentionTiling:
    """Tile sizes from static shapes only (the kernel compiles once per bucket).

    - `block_m`: a decode-only bucket (T <= S) gets the smallest MMA-sized tile, since a
      decode tile holds one token; otherwise 64 rows, so prefill tiles reuse each K/V
      chunk across 64 / group tokens. Either way the MMA stays far below the ridge
      point, so decode remains bandwidth bound. A tile holds at least a whole GQA group,
      unless its q rows would pass 64 KiB of shared memory (MLA: 128 heads x 1024 padded
      columns); then it holds one token and a slice of the group (`head_blocks`).
    - `block_k`: one K (and one V) chunk is at most 16 KiB, which keeps two pipeline
      stages of K and V plus the q tile well inside Ampere's and Hopper's shared memory.
    - `num_kv_splits` (flash-decoding), decode buckets only: doubled while the grid is
      too small to fill the GPU, each split keeps at least four chunks at the longest
      context, and the f32 partial buffers stay under 32 MiB. How many of those split
      slots each sequence uses is decided on device from its length (`schedule.py`). A
      mixed or prefill bucket gets one split: its decode tokens run in a launch of their
      own with the decode tiling (`decode_tiling`), and its prefill tiles fill the GPU.
    """
    group_pow2 = next_pow2(num_q_heads // num_kv_heads)
    head_dim_pow2 = max(16, next_pow2(head_dim))
    max_rows = max(16, _Q_TILE_BYTES // (head_dim_pow2 * itemsize))
    block_m = min(max(16 if num_tokens <= num_seq_slots else 64, group_pow2), max_rows)
    block_k = max(16, min(64, 16384 // (head_dim_pow2 * itemsize)))
    tokens_per_tile = block_q(block_m, group_pow2)
    busy_tiles = max(min(num_seq_slots, num_tokens), -(-num_tokens // tokens_per_tile))
    busy_tiles *= head_blocks(block_m, group_pow2)
    partial_bytes = num_tokens * num_q_heads * head_dim * 4
    splits = 1
    while (
        num_tokens <= num_seq_slots
        and splits < 16
        and busy_tiles * num_kv_heads * splits * 2 <= _TARGET_PROGRAMS
        and max_kv_len >= block_k * 4 * splits * 2
        and partial_bytes * splits * 2 <= 32 * 2**20
    ):
        splits *= 2
    num_warps = 4 if head_dim <= 128 and block_m <= 64 else 8
    return AttentionTiling(block_m, block_k, splits, num_warps, num_stages=2)


def decode_tiling(
    num_seq_slots: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_kv_len: int, itemsize: int = 2
) -> AttentionTiling:
    """The tiling of the decode launch of a mixed bucket: as for a decode-only bucket of
    `num_seq_slots` tokens (the smallest MMA tile, flash-decoding splits)."""
    return default_tiling(num_seq_slots, num_seq_slots, num_q_heads, num_kv_heads, head_dim, max_kv_len, itemsize)


def shared_memory_bytes(tiling: AttentionTiling, head_dim: int, value_dim: int, itemsize: int = 2) -> int:
    """Shared memory one program asks for: the q tile plus `num_stages` K and V chunks, at
    power-of-two widths (what the Triton lowering requested on an H200, to the byte)."""
    head_dim_pow2 = max(16, next_pow2(head_dim))
    value_dim_pow2 = max(16, next_pow2(value_dim))
    q_tile = tiling.block_m * head_dim_pow2
    kv_chunks = tiling.num_stages * tiling.block_k * (head_dim_pow2 + value_dim_pow2)
    return (q_tile + kv_chunks) * itemsize
