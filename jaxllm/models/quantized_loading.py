"""Loading quantized weights: FP8 checkpoints (values and their scale tensors) and quantizing an
unquantized checkpoint while it loads.

What is quantized and how comes from the weight declaration (`WeightDecl.quant`); this module
checks the checkpoint against it from the headers alone, reads the float8 tensors (which the
safetensors numpy reader does not decode) straight from the file, and builds each quantized
parameter as a `QuantizedWeight` of two sharded arrays, the scales split like their weight.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.quant_config import BLOCK, INT_DTYPES, QuantConfig, on_load_quant_config
from jaxllm.models.quantization import (
    FP8,
    QuantizedWeight,
    checkpoint_scales,
    pack_int4,
    quantize_blocks,
    quantize_blocks_int,
    scale_spec,
    unquantized,
    value_spec,
)
from jaxllm.models.weight_layout import Source
from jaxllm.models.weights import ParamDecl, StackedDecl, WeightDecl

FP8_SOURCE = "F8_E4M3"


class Fp8Files:
    """float8_e4m3fn tensors of safetensors files, memory-mapped from their headers."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._where: dict[str, tuple[Path, int, tuple[int, ...]]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in files:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, meta in header.items():
                if name != "__metadata__" and meta.get("dtype") == FP8_SOURCE:
                    begin, end = meta["data_offsets"]
                    shape = tuple(int(n) for n in meta["shape"])
                    if end - begin != int(np.prod(shape)):
                        raise ValueError(f"tensor {name} in {path.name}: data size does not match shape {list(shape)}")
                    self._where[name] = (path, 8 + size + begin, shape)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        path, start, shape = self._where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        flat = self._maps[path][start : start + int(np.prod(shape))]
        return np.asarray(flat.reshape(shape)[slices]).view(FP8)


def tensor_format(config: ModelConfig, weight_name: str) -> QuantConfig:
    """The quantization format of the module holding `weight_name` (a mixed GGUF file's modules
    each have their own)."""
    assert config.quantization is not None
    return config.quantization.for_tensor(weight_name)


def scale_name(config: ModelConfig, weight_name: str, suffix: Optional[str] = None) -> str:
    """The checkpoint's scale tensor of a quantized `<module>.weight` (or, with `suffix`, its
    offset tensor)."""
    return weight_name[: -len("weight")] + (suffix or tensor_format(config, weight_name).scale_suffix)


def _block_tensor_names(config: ModelConfig, weight_name: str) -> list[str]:
    """The per-block tensors of a quantized weight: its scales, and its offsets and super-block
    scales when it has them."""
    fmt = tensor_format(config, weight_name)
    return [scale_name(config, weight_name, suffix) for suffix, _, _ in fmt.block_tensors().values()]


def expected_scale_shape(fmt: QuantConfig, stored: tuple[int, int], super_block: bool = False) -> tuple[int, int]:
    rows, cols = fmt.block_for(*stored, super_block=super_block)
    return (-(-stored[0] // rows), -(-stored[1] // cols))


# safetensors dtypes of the per-block tensors, by the numpy dtype the device keeps them in.
_BLOCK_SOURCES = {
    "float32": ("F32", "BF16", "F16", "F64"),
    "float16": ("F16",),
    "bfloat16": ("BF16",),
    "int8": ("I8",),
    "uint8": ("U8",),
}


def scale_candidates(decls: Sequence[WeightDecl], config: ModelConfig) -> set[str]:
    """The scale tensor names a float8 checkpoint may hold for these declarations."""
    qc = config.quantization
    if qc is None or not qc.from_checkpoint:
        return set()
    return {
        name
        for d in decls
        if d.quant is not None
        for src in d.alternatives[0]
        for name in _block_tensor_names(config, src.name)
    }


def check_quantized(
    decls: list[WeightDecl],
    chosen: list[Sequence[Source]],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    config: ModelConfig,
) -> tuple[list[WeightDecl], set[str]]:
    """The declarations as this checkpoint stores them (a weight the checkpoint keeps in float
    stays float) and the names of the scale tensors they read. Raises ValueError naming the
    tensor for float8 weights without scales, scales of the wrong shape, or float8 tensors
    where the declaration has none."""
    qc = config.quantization
    out, scales = [], set()
    for decl, alt in zip(decls, chosen):
        stored_quantized = qc.checkpoint_dtype if qc is not None else FP8_SOURCE
        fp8 = [src.name for src in alt if dtypes.get(src.name) == stored_quantized]
        if decl.quant is None or qc is None or not qc.from_checkpoint:
            if fp8:
                why = "config.json has no quantization_config" if qc is None else "it is never quantized"
                raise ValueError(f"tensor {fp8[0]} is float8_e4m3fn but {why}")
            out.append(decl)
            continue
        if not fp8:
            out.append(unquantized(decl))  # what the checkpoint keeps in bf16 stays bf16
            continue
        if len(fp8) != len(alt) or alt is not decl.alternatives[0]:
            raise ValueError(
                f"tensor {fp8[0]}: float8 weights load only in the per-module layout, every part quantized"
            )
        for src in alt:
            fmt = qc.for_tensor(src.name)
            for suffix, dtype, per_super in fmt.block_tensors().values():
                name = scale_name(config, src.name, suffix)
                if name not in shapes:
                    raise ValueError(
                        f"scale tensor {name} of quantized weight {src.name} is missing from the checkpoint"
                    )
                allowed = _BLOCK_SOURCES.get(dtype, ())
                if dtypes.get(name) not in allowed:
                    raise ValueError(
                        f"scale tensor {name} has dtype {dtypes.get(name)}; expected {' or '.join(allowed)}"
                    )
                want = expected_scale_shape(fmt, src.shape, per_super)  # type: ignore[arg-type]
                if tuple(shapes[name]) != want:
                    raise ValueError(f"scale tensor {name} has shape {list(shapes[name])}, expected {list(want)}")
                scales.add(name)
        out.append(decl)
    return out, scales


def _member_scales(
    decl: WeightDecl,
    alt: Sequence[Source],
    config: ModelConfig,
    read_full: Callable[[str], np.ndarray],
    suffix: Optional[str] = None,
    per_super: bool = False,
) -> np.ndarray:
    """One declared weight's scales (or, with `suffix`, another per-block tensor; `per_super`:
    one per super-block) in parameter layout, from the checkpoint's per-block tensors."""
    assert decl.quant is not None
    part = alt[0].part is not None
    all_blocks = decl.quant.super_blocks if per_super else decl.quant.blocks
    blocks = all_blocks[1:] if part else all_blocks
    extent = decl.shape[1:] if part else decl.shape

    def scales_of(src: Source) -> np.ndarray:
        stored_block = tensor_format(config, src.name).block_for(*src.shape, super_block=per_super)  # type: ignore[arg-type]
        return checkpoint_scales(src, extent, blocks, read_full(scale_name(config, src.name, suffix)), stored_block)

    if not part:
        return scales_of(alt[0])
    by_part = {src.part: src for src in alt}
    rows = decl.rows_from if decl.rows_from is not None else range(decl.shape[0])
    return np.stack([scales_of(by_part[r]) for r in rows])


def assemble_quantized(
    decl: ParamDecl,
    alternatives: Sequence[Sequence[Source]],
    config: ModelConfig,
    mesh: jax.sharding.Mesh,
    spec: jax.sharding.PartitionSpec,
    read_full: Callable[[str], np.ndarray],
    assemble_value: Callable[[], jax.Array],
    read_param: Callable[[], np.ndarray],
) -> QuantizedWeight:
    """A quantized parameter on the mesh: the checkpoint's float8 values (each device's box read
    by `assemble_value`) and scales, or, quantizing on load, the whole parameter read in float
    (`read_param`, in parameter layout) quantized here to 128 x 128 blocks."""
    q = decl.quant
    assert q is not None
    members = decl.members if isinstance(decl, StackedDecl) else (decl,)
    value_sharding = jax.sharding.NamedSharding(mesh, spec)
    held: dict[str, np.ndarray] = {}
    qc = config.quantization
    if qc is not None and qc.from_checkpoint:
        value = assemble_value()
        if q.packed:  # 4-bit read as int8 values, packed two to a byte on the device
            value = jax.jit(pack_int4, out_shardings=value_sharding)(value)
        fmt = qc.for_tensor(alternatives[0][0].name)  # every member and part: one format (the converter's rule)
        for leaf, (suffix, _, per_super) in fmt.block_tensors().items():
            out = [_member_scales(m, a, config, read_full, suffix, per_super) for m, a in zip(members, alternatives)]
            held[leaf] = np.stack(out) if isinstance(decl, StackedDecl) else out[0]
    elif q.dtype == FP8.name:
        host, held["scale"] = quantize_blocks(read_param(), q.blocks)
        value = _put(host, value_sharding)
        del host
    else:  # int8 / int4 with GGUF's Q8_0 / Q4_0 blocks of 32 inputs
        host, held["scale"] = quantize_blocks_int(read_param(), q.blocks, 4 if q.packed else 8)
        value = _put(pack_int4(host) if q.packed else host, value_sharding)
        del host
    if q.k_major:  # on the devices, one parameter at a time: its value's splits swap with its axes
        k_major_sharding = jax.sharding.NamedSharding(mesh, value_spec(spec, q, len(decl.shape)))
        value = jax.jit(lambda v: jnp.swapaxes(v, -1, -2), out_shardings=k_major_sharding)(value)
    arrays = {}
    for leaf, (shape, dtype) in q.block_arrays(decl.shape).items():
        host = _exactly(held[leaf], dtype, decl, leaf)
        assert host.shape == shape, (decl.path, leaf, host.shape, shape)
        sharding = jax.sharding.NamedSharding(mesh, scale_spec(spec, host.shape, dict(mesh.shape)))
        arrays[leaf] = _put(host, sharding)
    return QuantizedWeight.like(q, value, **arrays)


def _exactly(host: np.ndarray, dtype: np.dtype, decl: ParamDecl, leaf: str) -> np.ndarray:
    """`host` in `dtype`, which must hold its every number exactly (the format's own precision)."""
    out = np.asarray(host).astype(dtype)
    if not np.array_equal(out.astype(np.float64), np.asarray(host, np.float64)):
        name = ".".join(str(p) for p in decl.path)
        raise ValueError(f"the {leaf} numbers of quantized weight {name} do not fit {dtype.name} exactly")
    return out


def _put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def with_quantization(config: ModelConfig, method: Optional[str], activation_scheme: str = "dynamic") -> ModelConfig:
    """`config` with the weight quantization asked for at load time (`quantization="fp8"`, "int8"
    or "int4"): an unquantized checkpoint is quantized while it loads; an integer one (GGUF,
    AWQ, GPTQ) is dequantized and then quantized as asked; an FP8 one keeps its own (asking
    for int8 / int4 is a ValueError)."""
    qc = config.quantization
    if qc is not None and method is not None and qc.from_checkpoint and qc.method in INT_DTYPES:
        stored = qc.stored or qc
        return replace(config, quantization=replace(on_load_quant_config(method, activation_scheme), stored=stored))
    if config.quantization is not None:
        if method is not None and (method != "fp8" or config.quantization.value_dtype != FP8.name):
            raise ValueError(
                f"quantization={method!r}: the checkpoint is already quantized ({config.quantization.value_dtype})"
            )
        if activation_scheme == "none":  # otherwise the checkpoint's own scheme
            return replace(config, quantization=replace(config.quantization, activation_scheme="none"))
        return config
    return replace(config, quantization=on_load_quant_config(method, activation_scheme))


def dequantizes_on_load(config: ModelConfig, dequantize_on_load: Optional[bool], platform: str) -> bool:
    """Whether an integer-quantized checkpoint (GGUF, AWQ, GPTQ) loads with its weights
    dequantized to the model's dtype: as `dequantize_on_load` says, or (None) on a CPU only.
    There XLA cannot fuse the dequantization into the matmul and writes out the float weights
    in every step; GPU kernels dequantize in registers, so the kept weights cost fewer bytes a
    step. FP8 checkpoints and a quantization asked on load are never affected."""
    qc = config.quantization
    if qc is None or not qc.from_checkpoint or qc.method not in INT_DTYPES:
        return False
    return platform == "cpu" if dequantize_on_load is None else bool(dequantize_on_load)


def with_dequantize_on_load(config: ModelConfig, dequantize_on_load: Optional[bool], platform: str) -> ModelConfig:
    """`config` with plain float weights in place of an integer checkpoint's kept ones when
    `dequantizes_on_load` says so (the loader reads them through `DequantizedTensors`: the
    numbers the in-step dequantization computes), else `config` unchanged."""
    if not dequantizes_on_load(config, dequantize_on_load, platform):
        return config
    return replace(config, quantization=None, dequantized_from=config.quantization)


def with_k_major_fp8(config: ModelConfig, k_major: bool) -> ModelConfig:
    """`config` storing its FP8 block weights K-major (`QuantConfig.k_major`) when `k_major`
    (the engine runs them on the Mosaic GPU FP8 kernels) and it has such weights."""
    qc = config.quantization
    if not k_major or qc is None or qc.method != "fp8_block" or qc.activation_group != BLOCK:
        return config
    return replace(config, quantization=replace(qc, k_major=True))


def describe_weights(config: ModelConfig) -> str:
    """How the weights are held, in a few words (the engine banner, `jaxllm plan`)."""
    qc, stored = config.quantization, config.dequantized_from
    if stored is not None:
        return f"{stored.name or stored.value_dtype} dequantized at load to {config.dtype}"
    if qc is None:
        return config.dtype
    if not qc.from_checkpoint:
        source = f" from {qc.stored.name or qc.stored.value_dtype}" if qc.stored is not None else ""
        return f"{qc.value_dtype} quantized at load{source}"
    if qc.method in INT_DTYPES:
        return f"{qc.name or qc.value_dtype} kept quantized (dequantized in each step)"
    return f"{qc.value_dtype} as stored" + (", K-major" if qc.k_major else "")
