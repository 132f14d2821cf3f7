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
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
    lead = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(*lead, -1, block_bytes[kind])
    out: dict[str, np.ndarray] = {}
    if kind in ("Q5_0", "Q5_1"):  # d (, m), qh: bit j the fifth bit of element j, then Q4_0's nibbles
        out["weight_scale"] = _f16(blocks[..., 0:2])
        head = 2 if kind == "Q5_0" else 4
        if kind == "Q5_1":
            out["weight_offset"] = _f16(blocks[..., 2:4])
        high = np.unpackbits(blocks[..., head : head + 4], axis=-1, bitorder="little")
        values = (_nibbles(blocks[..., head + 4 :], 16) | (high << 4)).astype(np.int8) - (16 if kind == "Q5_0" else 0)
    elif kind in ("Q8_0", "Q4_0"):
        out["weight_scale"], body = _f16(blocks[..., :2]), blocks[..., 2:]
        if kind == "Q8_0":
            values = body.view(np.int8)
        else:  # element j in the low nibble of byte j, element j + 16 in its high nibble, offset 8
            values = _nibbles(body, 16).astype(np.int8) - 8
    elif kind == "Q4_1":
        out["weight_scale"], out["weight_offset"] = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        values = _nibbles(blocks[..., 4:], 16).astype(np.int8)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin, packed = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), blocks[..., 4:16]
        lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        out["weight_scale"] = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
        out["weight_offset"] = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        out["weight_super_scale"], out["weight_super_offset"] = d, -dmin
        if kind == "Q4_K":
            values = _nibbles(blocks[..., 16:], 32).astype(np.int8)  # block 2c + s: nibble s of bytes 32c..32c+31
        else:  # qh [32] then Q4_K's nibbles; element 32b + k's fifth bit is bit b of qh[k]
            bits = np.unpackbits(blocks[..., 16:48], axis=-1, bitorder="little")  # 8k + b
            high = np.swapaxes(bits.reshape(*bits.shape[:-1], 32, 8), -1, -2).reshape(bits.shape)
            values = (_nibbles(blocks[..., 48:], 32) | (high << 4)).astype(np.int8)
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


# The K-quant types a layer stack of mixed types holds exactly as the wider one (`held_type`).
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def held_type(types: set[str]) -> str:
    """The block type a layer stack whose layers store `types` is held in on the device: a
    stack of one type keeps it; Q4_K with Q5_K layers is held as Q5_K (its values, one to an
    int8, hold Q4_K's exactly, the scales alike); Q6_K with Q4_K / Q5_K layers as "K_INT8"
    (int8 values, int8 scales and minimums per 16, float16 d and -dmin per 256), which holds
    each layer's blocks exactly. Empty for other mixes (the stack loads dequantized)."""
    if len(types) == 1:
        return next(iter(types))
    if not types <= set(K_QUANTS):
        return ""
    return "K_INT8" if "Q6_K" in types else "Q5_K"


def as_held(parts: dict[str, np.ndarray], kind: str, held: str) -> dict[str, np.ndarray]:
    """`unpack_blocks(..., kind)` in the layout of `held` (`held_type`): the same numbers, a
    Q4_K / Q5_K scale and minimum repeated over the two blocks of 16 of its 32 and Q6_K's
    minimums 0 for "K_INT8"."""
    if held in (kind, "Q5_K"):
        return parts
    out = dict(parts)
    if kind == "Q6_K":
        out["weight_offset"] = np.zeros_like(parts["weight_scale"])
        out["weight_super_offset"] = np.zeros_like(parts["weight_super_scale"])
        return out
    for name in ("weight_scale", "weight_offset"):  # 6-bit values: they fit an int8
        out[name] = np.repeat(parts[name], 2, axis=-1).astype(np.int8)
    return out
