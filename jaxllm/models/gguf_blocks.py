"""GGUF's quantized blocks as integer values and their per-block numbers, in the file's precision.

The loader keeps a GGUF file's linear projections quantized on the device; this reads each
block type's bytes (gguf/quants.py's layouts, ggml's `dequantize_row_*`) into what the device
holds: one int8 per value and the block's own numbers as the file stores them (float16 `d` /
`m`; K-quants' 6-bit or int8 sub-block scales and minimums with float16 `d` / `dmin` per
super-block), such that `jaxllm.models.quantization.dense` computes exactly what ggml's
dequantization computes.
"""

from __future__ import annotations

import numpy as np


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ([..., 2] bytes) as float16 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(body: np.ndarray, run: int) -> np.ndarray:
    """4-bit values of bytes [..., m]: per run of `run` bytes, its low nibbles then its high ones."""
    runs = body.reshape(*body.shape[:-1], -1, run)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-1).reshape(*body.shape[:-1], -1)


def unpack_blocks(data: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """The checkpoint tensors of GGUF rows ([..., bytes]) of type `kind`, by suffix: `weight`
    (int8 values [..., n]) and `weight_scale` [..., n / block], with `weight_offset` for the
    types with a minimum and `weight_super_scale` / `weight_super_offset` [..., n / 256] for
    K-quants, as ggml's `dequantize_row_*` (gguf/quants.py) reads them: Q8_0 / Q4_0 (blocks of
    32, float16 `d`; Q4_0's values in [-8, 7]); Q4_1 (`d * q + m`, q in [0, 15], float16 `d`,
    `m`); Q4_K (super-blocks of 256: eight blocks of 32 with 6-bit scales `sc` and minimums
    `m` (uint8), `(d * sc) * q - dmin * m`; the super offset is `-dmin`); Q6_K (super-blocks of
    256: sixteen blocks of 16 with int8 scales, `(d * sc) * (q - 32)`)."""
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}[kind]
    lead = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(*lead, -1, block_bytes)
    out: dict[str, np.ndarray] = {}
    if kind in ("Q8_0", "Q4_0"):
        out["weight_scale"], body = _f16(blocks[..., :2]), blocks[..., 2:]
        if kind == "Q8_0":
            values = body.view(np.int8)
        else:  # element j in the low nibble of byte j, element j + 16 in its high nibble, offset 8
            values = _nibbles(body, 16).astype(np.int8) - 8
    elif kind == "Q4_1":
        out["weight_scale"], out["weight_offset"] = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        values = _nibbles(blocks[..., 4:], 16).astype(np.int8)
    elif kind == "Q4_K":
        d, dmin, packed = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), blocks[..., 4:16]
        lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        out["weight_scale"] = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
        out["weight_offset"] = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        out["weight_super_scale"], out["weight_super_offset"] = d, -dmin
        values = _nibbles(blocks[..., 16:], 32).astype(np.int8)  # block 2c + s: nibble s of bytes 32c..32c+31
    else:  # Q6_K: ql [128], qh [64], int8 scales [16], d
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        out["weight_scale"] = blocks[..., 192:208].view(np.int8)
        out["weight_super_scale"] = _f16(blocks[..., 208:210])
        low = _nibbles(ql, 64)  # element 128h + 64s + k: nibble s of ql[64h + k]
        high = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = (high & 0x03).reshape(low.shape)  # element 128h + 32t + k: bits 2t of qh[32h + k]
        values = (low | (high << 4)).astype(np.int8) - 32
    flat = (*lead, -1)
    out["weight"] = values
    return {name: np.ascontiguousarray(array).reshape(flat) for name, array in out.items()}
