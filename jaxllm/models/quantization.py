"""Quantized weights (FP8, GGUF blocks, AWQ / GPTQ) kept on the device and dequantized inside
the jitted step.

A quantized parameter is a `QuantizedWeight`: its value (float8_e4m3fn, int8, or 4-bit packed),
in the parameter's own layout (the one the weight declaration gives, e.g. q [H, Hq, D]), and
scales in the format's own dtype (`WeightQuant`: float32 for FP8) in the same axis order,
one per block of `blocks[j]` consecutive entries along each axis j. The blocks come from the
checkpoint's [128, 128] blocks of the torch [out, in] weight through the declared layout
change (`param_blocks`): an axis that is a whole stored dimension keeps 128, head axes split
out of a stored dimension get whole heads or the finest block that never straddles a stored
block (DeepSeek's 192-wide q heads: 64).

`dense(w, dtype)` dequantizes (XLA fuses the scale multiply into the matmul's operand);
`qeinsum` also quantizes the activations dynamically per token and group of 128 along
the contraction (DeepSeek's `act_quant`) when the weight says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec

from jaxllm.models import quantized_matmul
from jaxllm.models.quant_config import BLOCK, FP8_DTYPE, FP8_MAX
from jaxllm.models.weight_layout import Source, view_groups
from sharding.rules import swap_last_two

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
INT4 = "int4"  # WeightQuant.dtype of GGUF Q4_0 weights: values in [-8, 7], packed two to a byte
UINT4 = "uint4"  # Q4_1 / Q4_K / AWQ / GPTQ (asymmetric): values in [0, 15], packed two to a byte
PACKED_DTYPES = (INT4, UINT4)


@dataclass(frozen=True)
class WeightQuant:
    """How one declared parameter is stored quantized: `dtype` values and one scale per block of
    `blocks[j]` entries along parameter axis j, held in `scale_dtype` (the format's own: float32
    for FP8, float16 for GGUF's `d` and AWQ / GPTQ's scales); with `offset`, also an offset per
    block in `offset_dtype`, the weight being `value * scale + offset` (GGUF's Q4_1 minimum).

    Two-level formats (GGUF's K-quants) have `super_blocks`: their block scales (and offsets)
    are small integers (6-bit `sc` / `m`, Q6_K's int8 scales), multiplied by a float16 scale
    (and offset) per super-block of `super_blocks[j]` entries (`d`, `-dmin` per 256 inputs). An
    integer offset without super-blocks is a zero point in units of its block's scale (AWQ /
    GPTQ's `-zero`): the weight is `(value + offset) * scale`."""

    blocks: tuple[int, ...]
    act_group: int = BLOCK  # activations quantized per token-group of this many (-1: whole token, 0: not)
    dtype: str = FP8_DTYPE
    offset: bool = False
    scale_dtype: str = "float32"
    offset_dtype: str = "float32"
    super_blocks: tuple[int, ...] = ()
    # The value stored K-major: the last two axes swapped ([..., N, K] for a [..., K, N]
    # parameter), as Hopper's 8-bit wgmma reads its B operand (`k_major_eligible`). Scales keep
    # the parameter's axis order.
    k_major: bool = False

    def scale_shape(self, shape: Sequence[int], blocks: Optional[Sequence[int]] = None) -> tuple[int, ...]:
        """Blocks (or, given `blocks`, those blocks) along each axis of a parameter of `shape`."""
        blocks = tuple(self.blocks if blocks is None else blocks)
        lead = len(shape) - len(blocks)  # stacked layers: a leading axis with blocks of 1
        return tuple(-(-int(n) // b) for n, b in zip(shape, (1,) * lead + blocks))

    @property
    def block_leaves(self) -> tuple[str, ...]:
        """The per-block leaves the parameter holds, of `scale`, `offset`, `super_scale`, `super_offset`."""
        supers = ("super_scale", "super_offset") if self.offset else ("super_scale",)
        return ("scale",) + (("offset",) if self.offset else ()) + (supers if self.super_blocks else ())

    def block_arrays(self, shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of each per-block leaf (`block_leaves`) of a parameter of `shape`."""
        per_block, per_super = self.scale_shape(shape), self.scale_shape(shape, self.super_blocks or None)
        held = {
            "scale": (per_block, self.scale_dtype),
            "offset": (per_block, self.offset_dtype),
            "super_scale": (per_super, "float16"),
            "super_offset": (per_super, "float16"),
        }
        return {leaf: (held[leaf][0], np.dtype(held[leaf][1])) for leaf in self.block_leaves}

    @property
    def packed(self) -> bool:
        """4-bit values are stored two to a byte along the parameter's last axis."""
        return self.dtype in PACKED_DTYPES

    def value_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The stored value array's shape (the last axis halved when packed, the last two
        swapped when K-major)."""
        shape = tuple(int(n) for n in shape)
        if self.k_major:
            return shape[:-2] + (shape[-1], shape[-2])
        if not self.packed:
            return shape
        if shape[-1] % 2:
            raise ValueError(f"4-bit weights of shape {list(shape)}: the last axis must be even to pack")
        return shape[:-1] + (shape[-1] // 2,)

    def value_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.packed else np.dtype(getattr(ml_dtypes, self.dtype, None) or self.dtype)

    def nbytes(self, shape: Sequence[int]) -> int:
        values = int(np.prod(self.value_shape(shape))) * self.value_dtype().itemsize
        return values + sum(int(np.prod(s)) * dt.itemsize for s, dt in self.block_arrays(shape).values())


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """A parameter's leaves: `value` (float8_e4m3fn, int8, or 4-bit packed two to a uint8 along
    the last axis when `packed`, signed or `unsigned`), `scale` and, for asymmetric formats,
    `offset` (shaped like `scale`; None otherwise), each in its format's dtype (`WeightQuant`),
    with the static block of each trailing axis and how matmuls quantize their activations
    (`act_group`: per token-group of that many features, -1 per whole token, 0 not at all).
    K-quants add `super_scale` (and `super_offset`), float16 per block of `super_blocks`.
    `k_major`: the value holds the last two axes swapped (`WeightQuant.k_major`)."""

    def __init__(
        self,
        value: Any,
        scale: Any,
        blocks: tuple[int, ...],
        act_group: int = BLOCK,
        packed: bool = False,
        offset: Any = None,
        unsigned: bool = False,
        super_scale: Any = None,
        super_offset: Any = None,
        super_blocks: tuple[int, ...] = (),
        k_major: bool = False,
    ) -> None:
        self.value, self.scale, self.offset = value, scale, offset
        self.super_scale, self.super_offset = super_scale, super_offset
        self.blocks, self.act_group, self.packed = tuple(blocks), int(act_group), bool(packed)
        self.unsigned, self.super_blocks, self.k_major = bool(unsigned), tuple(super_blocks), bool(k_major)

    def tree_flatten(self):
        children = (self.value, self.scale, self.offset, self.super_scale, self.super_offset)
        return children, (self.blocks, self.act_group, self.packed, self.unsigned, self.super_blocks, self.k_major)

    @classmethod
    def tree_unflatten(cls, aux, children):
        blocks, act_group, packed, unsigned, super_blocks, k_major = aux
        value, scale, offset, super_scale, super_offset = children
        return cls(
            value, scale, blocks, act_group, packed, offset, unsigned, super_scale, super_offset, super_blocks, k_major
        )

    @classmethod
    def like(cls, quant: WeightQuant, value: Any, scale: Any, offset: Any = None, **supers: Any) -> QuantizedWeight:
        """Leaves `value`, `scale` (and `offset`, `super_scale`, `super_offset` where `quant`
        has them) stored as `quant` says."""
        held = quant.block_leaves
        return cls(
            value,
            scale,
            quant.blocks,
            quant.act_group,
            quant.packed,
            offset if "offset" in held else None,
            quant.dtype == UINT4,
            supers.get("super_scale") if "super_scale" in held else None,
            supers.get("super_offset") if "super_offset" in held else None,
            quant.super_blocks,
            quant.k_major,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked, parameter-layout) shape."""
        shape = tuple(self.value.shape)
        if self.k_major:
            return shape[:-2] + (shape[-1], shape[-2])
        return shape[:-1] + (2 * shape[-1],) if self.packed else shape

    def param_value(self) -> Any:
        """The stored values in the parameter's axis order (a K-major value swapped back; XLA
        folds that transpose into whatever reads it)."""
        return jnp.swapaxes(self.value, -1, -2) if self.k_major else self.value

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={getattr(self.value, 'shape', '?')}, blocks={self.blocks})"


# ---------------------------------------------------------------------------------------------
# Blocks in parameter layout


def param_blocks(src: Source, stored_block: tuple[int, int]) -> tuple[int, ...]:
    """The block of each parameter axis (those `src` maps) such that every block lies inside one
    `stored_block` of the stored [out, in] tensor: scales indexed per parameter block are then
    exactly the checkpoint's."""
    lay = src.layout
    offset = lay.offset or (0,) * len(lay.view)
    view_block = [1] * len(lay.view)
    for k, group in enumerate(view_groups(src.shape, lay.view)):
        rem = stored_block[k] or src.shape[k]
        for a in reversed(group):
            n, off = lay.view[a], offset[a]
            if rem % n == 0 and off == 0 and a != group[0]:
                view_block[a], rem = n, rem // n
                continue
            view_block[a] = math.gcd(rem, n if a != group[0] else 0, off)
            break
    blocks = []
    for a in lay.perm:
        b = view_block[a]
        if a == lay.repeat_axis and lay.repeat > 1:
            b *= lay.repeat
        blocks.append(b)
    return tuple(blocks)


def checkpoint_scales(
    src: Source, extent: Sequence[int], blocks: Sequence[int], scale: np.ndarray, stored_block: tuple[int, int]
) -> np.ndarray:
    """The scales of the parameter (part) `src` fills, in parameter layout: entry i holds the
    checkpoint scale of the stored block that parameter entry i * blocks covers."""
    lay = src.layout
    offset = lay.offset or (0,) * len(lay.view)
    rank = len(lay.perm)
    view_coord: dict[int, tuple[int, np.ndarray]] = {}
    for j, (a, n, b) in enumerate(zip(lay.perm, extent, blocks)):
        c = np.arange(-(-int(n) // b)) * b
        if a == lay.repeat_axis and lay.repeat > 1:
            c = c // lay.repeat
        view_coord[a] = (j, c + offset[a])
    index = []
    for k, group in enumerate(view_groups(src.shape, lay.view)):
        stored = np.zeros((1,) * rank, dtype=np.int64)
        for pos, a in enumerate(group):
            stride = int(np.prod([lay.view[x] for x in group[pos + 1 :]], dtype=np.int64))
            j, c = view_coord[a]
            shape = [1] * rank
            shape[j] = len(c)
            stored = stored + (c * stride).reshape(shape)
        index.append(stored // stored_block[k])
    return np.asarray(scale)[tuple(index)]


# ---------------------------------------------------------------------------------------------
# The declaration's quantized weights


# Linear weights that stay unquantized in every FP8 scheme: the router decides which experts
# run (DeepSeek keeps it in bf16) and the LM head sets the logits.
_NEVER_QUANTIZED = ("router", "lm_head")


def quantized_decl(decl: Any, config: Any) -> Any:
    """`decl` stored quantized when `config.quantization` covers it: every linear projection of
    attention, dense MLPs, shared and routed experts (torch [out, in] sources), not the
    embedding, norms, router or LM head, nor modules the quantization config leaves out."""
    qc = config.quantization
    canonical = decl.alternatives[0]
    src = canonical[0]
    if (
        qc is None
        or decl.init != "linear"
        or decl.path[-1] in _NEVER_QUANTIZED
        or len(src.shape) != 2
        or any(qc.keeps_float(s.name) for s in canonical)
    ):
        return decl
    qc = qc.for_tensor(src.name)  # a mixed GGUF file: this module's own block type
    blocks = param_blocks(src, qc.block_for(*src.shape))
    lead = (1,) * (len(decl.shape) - len(blocks))  # per-expert sources and slots: one scale row per expert
    supers = lead + param_blocks(src, qc.block_for(*src.shape, super_block=True)) if qc.super_block else ()
    quant = WeightQuant(
        lead + blocks, qc.activation_group, qc.value_dtype, qc.offset, qc.scale_dtype, qc.offset_dtype, supers
    )
    if config.quantization.k_major and len(blocks) == 2 and k_major_eligible(quant, decl.shape):
        quant = replace(quant, k_major=True)
    return replace(decl, quant=quant)


def k_major_eligible(quant: WeightQuant, shape: Sequence[int]) -> bool:
    """Whether a weight is stored K-major when its model asks (`QuantConfig.k_major`): what the
    Mosaic GPU FP8 kernels read. DeepSeek's scheme (e4m3 values, 128 x 128 blocks, activations
    quantized per 128-group) on a [..., K, N] projection (a dense one or a stack of experts)
    with K and N multiples of 128. Head-split attention projections keep their layout (the
    caller checks the parameter is a plain [K, N] view of its [out, in] source)."""
    k, n = (int(d) for d in shape[-2:])
    return (
        quant.dtype == FP8_DTYPE
        and quant.act_group == BLOCK
        and tuple(quant.blocks[-2:]) == (BLOCK, BLOCK)
        and all(b == 1 for b in quant.blocks[:-2])
        and k % BLOCK == 0
        and n % BLOCK == 0
    )


def unquantized(decl: Any) -> Any:
    return replace(decl, quant=None)


def value_spec(spec: PartitionSpec, quant: WeightQuant, ndim: int) -> PartitionSpec:
    """The partitioning of a quantized weight's stored value, given the parameter's (`spec`):
    a K-major value's last two axes swap their splits."""
    return swap_last_two(spec, ndim) if quant.k_major else spec


def scale_spec(spec: PartitionSpec, scale_shape: Sequence[int], mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """A quantized weight's scales split like the weight (`spec`), except along an axis with
    fewer scale blocks than that split's ranks divide evenly (those scales are replicated)."""
    out = []
    for axis, n in zip(tuple(spec) + (None,) * (len(scale_shape) - len(spec)), scale_shape):
        names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        ranks = int(np.prod([mesh_shape[a] for a in names], dtype=np.int64))
        out.append(axis if n % ranks == 0 else None)
    return PartitionSpec(*out)


# ---------------------------------------------------------------------------------------------
# Host-side quantization (quantize on load, tests)


def _blocked(x: np.ndarray, blocks: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...]]:
    """x padded to whole blocks and viewed as [n0/b0, b0, n1/b1, b1, ...]."""
    blocks = (1,) * (x.ndim - len(blocks)) + tuple(blocks)
    pad = [(0, -n % b) for n, b in zip(x.shape, blocks)]
    xp = np.pad(x, pad)
    shape = [d for n, b in zip(xp.shape, blocks) for d in (n // b, b)]
    return xp.reshape(shape), blocks


def quantize_blocks(x: np.ndarray, blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn values, float32 scales) with scale = amax / 448 per block (1 for an
    all-zero block): `x ~= values * scales` expanded over the blocks."""
    x = np.asarray(x, np.float32)
    xb, full = _blocked(x, blocks)
    amax = np.abs(xb).max(axis=tuple(range(1, xb.ndim, 2)), keepdims=True)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (xb / scale).astype(FP8).reshape([n + (-n % b) for n, b in zip(x.shape, full)])
    q = q[tuple(slice(0, n) for n in x.shape)]
    return np.ascontiguousarray(q), scale.reshape(scale.shape[::2])


def quantize_blocks_int(x: np.ndarray, blocks: Sequence[int], bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales) per block as llama.cpp's reference quantizers make GGUF's
    blocks: 8 bits (`quantize_row_q8_0`): scale amax / 127, values round(x / scale); 4 bits
    (`quantize_row_q4_0`): scale = the block's largest-magnitude value / -8, values
    min(15, trunc(x / scale + 8.5)) - 8, in [-8, 7]."""
    x = np.asarray(x, np.float32)
    xb, full = _blocked(x, blocks)
    axes = tuple(range(1, xb.ndim, 2))
    if bits == 8:
        scale = np.abs(xb).max(axis=axes, keepdims=True) / np.float32(127)
    else:
        flat = np.moveaxis(xb, axes, range(xb.ndim - len(axes), xb.ndim)).reshape(*xb.shape[::2], -1)
        peak = np.take_along_axis(flat, np.abs(flat).argmax(-1)[..., None], -1)[..., 0]
        scale = np.expand_dims(peak / np.float32(-8), axes)
    # The values divide by the float32 scale; the block keeps it rounded to float16.
    inv = np.where(scale == 0, 0, 1 / np.where(scale == 0, 1, scale)).astype(np.float32)
    if bits == 8:
        a = np.abs(xb * inv)
        q = np.sign(xb) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))  # roundf: half away from zero
    else:
        q = np.clip(np.trunc(xb * inv + np.float32(8.5)), 0, 15) - 8
    scale = scale.astype(np.float16).astype(np.float32)
    q = q.astype(np.int8).reshape([n + (-n % b) for n, b in zip(x.shape, full)])
    q = q[tuple(slice(0, n) for n in x.shape)]
    return np.ascontiguousarray(q), scale.reshape(scale.shape[::2])


# ---------------------------------------------------------------------------------------------
# In the jitted step


def _expanded(s: jax.Array, blocks: Sequence[int], shape: Sequence[int]) -> jax.Array:
    """Per-block `s` repeated over its blocks (leading axes: blocks of 1) and cut to `shape`."""
    blocks = (1,) * (len(shape) - len(blocks)) + tuple(blocks)
    for axis, b in enumerate(blocks):
        if b > 1:
            s = jnp.repeat(s, b, axis=axis, total_repeat_length=s.shape[axis] * b)
    return s[tuple(slice(0, int(n)) for n in shape)]


def dense(w: Any, dtype: Any = None) -> jax.Array:
    """The weight as a plain array: a `QuantizedWeight` dequantized (value * scale [+ offset]
    per block, in float32, then cast to `dtype`, by default float32), anything else as is.
    Scales held in float16 or as integers are widened to float32 first; K-quant block scales
    are multiplied by their super-block's (`d * sc`, `-dmin * m`, as ggml computes them)."""
    if not isinstance(w, QuantizedWeight):
        return w
    value = unpack_int4(w.value, w.unsigned) if w.packed else w.param_value()
    shape = value.shape

    def widened(s: jax.Array, blocks: Sequence[int]) -> jax.Array:
        return _expanded(s.astype(jnp.float32), blocks, shape)

    scale = widened(w.scale, w.blocks)
    if w.super_scale is not None:
        scale = scale * widened(w.super_scale, w.super_blocks)
    out = value.astype(jnp.float32) * scale
    if w.offset is not None:
        offset = widened(w.offset, w.blocks)
        if w.super_offset is not None:
            out = out + offset * widened(w.super_offset, w.super_blocks)
        elif jnp.issubdtype(w.offset.dtype, jnp.integer):  # a zero point: (value + offset) * scale
            out = out + offset * scale
        else:
            out = out + offset
    return out.astype(dtype or jnp.float32)


def pack_int4(x: Any) -> Any:
    """int values in [-8, 7] (or [0, 15]), [..., 2n] -> uint8 [..., n]: entry 2i in the low
    nibble, 2i + 1 in the high one (numpy or jax arrays)."""
    if isinstance(x, jax.Array):
        u = jax.lax.bitcast_convert_type(x.astype(jnp.int8), jnp.uint8)  # two's complement bytes
    else:
        u = np.asarray(x, np.int8).view(np.uint8)
    return (u[..., 0::2] & 0xF) | ((u[..., 1::2] & 0xF) << 4)


def unpack_int4(packed: jax.Array, unsigned: bool = False) -> jax.Array:
    """The inverse of `pack_int4`: int8 [..., 2n] (nibbles sign-extended, or in [0, 15] when
    `unsigned`)."""
    if unsigned:
        lo, hi = (packed & 0xF).astype(jnp.int8), (packed >> 4).astype(jnp.int8)
    else:
        v = jax.lax.bitcast_convert_type(packed, jnp.int8)
        lo, hi = jnp.left_shift(v, 4) >> 4, v >> 4  # arithmetic shifts of int8 sign-extend
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def act_quant(x: jax.Array, num_contracted: int, group: int = BLOCK) -> jax.Array:
    """x with its last `num_contracted` axes (flattened) quantized to e4m3 per group of `group`
    features (-1: one group per token), one scale amax / 448 per token and group (DeepSeek's
    `act_quant`; compressed-tensors' dynamic per-token scheme), and dequantized again,
    so the matmul that follows sees exactly what an FP8 GEMM multiplies."""
    lead = x.shape[: x.ndim - num_contracted]
    flat = x.reshape(lead + (-1,)).astype(jnp.float32)
    k = flat.shape[-1]
    g = k if group < 0 else min(group, k)
    pad = -k % g
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    grouped = flat.reshape(lead + (-1, g))
    amax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
    # amax * (1 / 448) and x * (1 / scale), spelled out: XLA turns these divisions into such
    # products anyway (one ulp from the quotient, which can move a value across an e4m3
    # rounding midpoint), so the numerics are stated here rather than left to the compiler.
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), 1.0)
    q = (grouped * (1.0 / scale)).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(lead + (-1,))[..., :k].reshape(x.shape).astype(x.dtype)


def qeinsum(spec: str, x: jax.Array, w: Any, *, precision: Any = None, **kwargs: Any) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain or quantized weight `w`. With a quantized weight the
    weight is dequantized to x's dtype and, when it asks for dynamic activations, x is
    quantized per group of 128 along the axes the einsum contracts (x's trailing axes). Where
    the quantized matmul backend is the Pallas kernel (`quantized_matmul.backend`) and it takes
    the einsum, the kernel multiplies the stored values instead (same numerics)."""
    if isinstance(w, QuantizedWeight):
        inputs, out = spec.split("->")
        xs = inputs.split(",")[0]
        contracted = sum(1 for c in xs if c not in out)
        if w.act_group:
            x = act_quant(x, contracted, w.act_group)
        y = quantized_matmul.kernel_einsum(spec, x, w) if not kwargs else None
        if y is not None:
            return y
        w = dense(w, x.dtype)
    return jnp.einsum(spec, x, w, precision=precision, **kwargs)


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantizedWeight)
