"""GGUF's quantized blocks as integer values and float32 per-block scales (and offsets).

The loader keeps a GGUF file's linear projections quantized on the device; this reads each
block type's bytes (gguf/quants.py's layouts, ggml's `dequantize_row_*`) into what the device
holds: one int8 per value and float32 numbers per block, such that `value * scale (+ offset)`
is exactly what ggml's dequantization computes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ([..., 2] bytes) as float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(body: np.ndarray, run: int) -> np.ndarray:
    """4-bit values of bytes [..., m]: per run of `run` bytes, its low nibbles then its high ones."""
    runs = body.reshape(*body.shape[:-1], -1, run)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-1).reshape(*body.shape[:-1], -1)


def unpack_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(int8 values [..., n], float32 scales [..., n / block], float32 offsets or None) of GGUF
    rows ([..., bytes]), the weight being `value * scale (+ offset)` per block, as ggml's
    `dequantize_row_*` (gguf/quants.py) computes it: Q8_0 / Q4_0 (blocks of 32; Q4_0's values
    in [-8, 7]); Q4_1 (`d * q + m`, q in [0, 15]); Q4_K (super-blocks of 256: eight blocks of 32
    with 6-bit scales and minimums, `(d * sc) * q - dmin * m`); Q6_K (super-blocks of 256:
    sixteen blocks of 16 with int8 scales, `(d * sc) * (q - 32)`)."""
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}[kind]
    lead = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(*lead, -1, block_bytes)
    offset = None
    if kind in ("Q8_0", "Q4_0"):
        scale, body = _f16(blocks[..., :2]), blocks[..., 2:]
        if kind == "Q8_0":
            values = body.view(np.int8)
        else:  # element j in the low nibble of byte j, element j + 16 in its high nibble, offset 8
            values = _nibbles(body, 16).astype(np.int8) - 8
    elif kind == "Q4_1":
        scale, offset = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        values = _nibbles(blocks[..., 4:], 16).astype(np.int8)
    elif kind == "Q4_K":
        d, dmin, packed = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), blocks[..., 4:16]
        lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
        scale, offset = d[..., None] * sc, -(dmin[..., None] * mn)
        values = _nibbles(blocks[..., 16:], 32).astype(np.int8)  # block 2c + s: nibble s of bytes 32c..32c+31
    else:  # Q6_K: ql [128], qh [64], int8 scales [16], d
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        scale = _f16(blocks[..., 208:210])[..., None] * sc
        low = _nibbles(ql, 64)  # element 128h + 64s + k: nibble s of ql[64h + k]
        high = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = (high & 0x03).reshape(low.shape)  # element 128h + 32t + k: bits 2t of qh[32h + k]
        values = (low | (high << 4)).astype(np.int8) - 32
    flat = (*lead, -1)
    return values.reshape(flat), scale.reshape(flat), None if offset is None else offset.reshape(flat)
