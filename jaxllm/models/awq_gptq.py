"""HF AWQ and GPTQ 4-bit checkpoints, read as the loader's quantized-weight tensors.

An AWQ / GPTQ linear module `<m>` stores int32 words of eight 4-bit values plus fp16 group
scales, one group per `group_size` (128) inputs; the weight is `(q - zero) * scale`:

- AWQ (AutoAWQ's GEMM layout): `qweight` [in, out / 8] and `qzeros` [in / g, out / 8], each
  word holding eight output columns in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble
  i, bits 4i, is column `AWQ_ORDER[i]` of its eight); `scales` [in / g, out].
- GPTQ: `qweight` [in / 8, out] packed along the inputs (nibble j of row r is input 8r + j),
  `qzeros` [in / g, out / 8] packed along the outputs in order, `scales` [in / g, out],
  `g_idx` [in] (the group of each input; `i // g` without act-order). The original format
  ("gptq", AutoGPTQ) stores each zero minus one; "gptq_v2" stores it as is.

`Int4GroupTensors` presents each such module under the names the loader reads for integer
weights (`jaxllm.models.quant_config`): `<m>.weight` int8 [out, in] (the 4-bit values),
`<m>.weight_scale` float16 [out, in / g] (the checkpoint's scales) and, for asymmetric
checkpoints, `<m>.weight_offset` = `-zero` (int8, a zero point in units of the scale), so the
weight is `(value + offset) * scale`. Symmetric
GPTQ (every zero 8) becomes signed values `q - 8` with no offset. The packed tensors are
unpacked on the host one module at a time; the device keeps the 4-bit values packed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Optional

import numpy as np

from jaxllm.models.quant_config import QuantConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble of an AWQ word


def unpack_words(words: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words -> their eight 4-bit values (uint8) along `axis`, nibble i (bits 4i) being
    entry `order[i]` of its eight."""
    u = np.ascontiguousarray(words).view(np.uint32)
    nibbles = np.stack([(u >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=-1).astype(np.uint8)
    placed = np.empty_like(nibbles)
    placed[..., list(order)] = nibbles
    placed = np.moveaxis(placed, -1, axis + 1 if axis >= 0 else axis)
    shape = list(u.shape)
    shape[axis] *= 8
    return placed.reshape(shape)


def unpacked_int4_groups(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, packing: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values uint8 [out, in], zeros uint8 [out, in / g], scales [out, in / g]) of one
    module in torch [out, in] orientation."""
    if packing == "awq":
        values = unpack_words(qweight, 1, AWQ_ORDER)  # [in, out]
        zeros = unpack_words(qzeros, 1, AWQ_ORDER)
    else:
        values = unpack_words(qweight, 0)  # [in, out]
        zeros = unpack_words(qzeros, 1).astype(np.int16)
        if packing == "gptq":  # AutoGPTQ stored zero - 1
            zeros = zeros + 1
    return values.T, np.asarray(zeros).T, np.asarray(scales).T


class Int4GroupTensors:
    """AWQ / GPTQ modules of a checkpoint under the loader's integer-weight names (see module doc)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], qc: QuantConfig) -> None:
        self.qc = qc
        self.group = qc.weight_block_size[1]
        self.modules: dict[str, tuple[int, int]] = {}  # module -> (out, in)
        for name, shape in shapes.items():
            if not name.endswith(".qweight"):
                continue
            module = name.removesuffix(".qweight")
            for part in ("qzeros", "scales"):
                if f"{module}.{part}" not in shapes:
                    raise ValueError(f"{qc.packing} module {module} has a qweight but no {part}")
            if dtypes.get(name) != "I32" or dtypes.get(f"{module}.qzeros") != "I32":
                raise ValueError(f"{qc.packing} module {module}: qweight and qzeros must be int32")
            rows, cols = (int(n) for n in shape)
            size = (cols * 8, rows) if qc.packing == "awq" else (cols, rows * 8)  # (out, in)
            out_features, in_features = size
            if in_features % self.group:
                raise ValueError(
                    f"{qc.packing} module {module}: {in_features} inputs are not whole groups of {self.group}"
                )
            groups = in_features // self.group
            want = {"qzeros": (groups, out_features // 8), "scales": (groups, out_features)}
            if qc.packing != "awq":
                want["g_idx"] = (in_features,)
            for part, expected in want.items():
                got = tuple(shapes.get(f"{module}.{part}", ()))
                if got != expected:
                    raise ValueError(
                        f"{qc.packing} tensor {module}.{part} has shape {list(got)}, expected {list(expected)}"
                    )
            self.modules[module] = (out_features, in_features)
        if not self.modules:
            raise ValueError(f"quantization_config says {qc.packing!r} but the checkpoint has no .qweight tensors")
        self._cache: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()

    def names(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        """Each presented tensor -> (shape, dtype, the real tensor it comes from)."""
        out = {}
        for module, (o, i) in self.modules.items():
            out[f"{module}.weight"] = ((o, i), "I8", f"{module}.qweight")
            out[f"{module}.weight_scale"] = ((o, i // self.group), "F16", f"{module}.scales")
            if self.qc.offset:
                out[f"{module}.weight_offset"] = ((o, i // self.group), "I8", f"{module}.qzeros")
        return out

    def packed_names(self) -> set[str]:
        """The real tensors the presented ones replace."""
        return {f"{m}.{p}" for m in self.modules for p in ("qweight", "qzeros", "scales", "g_idx")}

    def __contains__(self, name: str) -> bool:
        module, _, _ = name.rpartition(".")
        return module in self.modules and name.endswith((".weight", ".weight_scale", ".weight_offset"))

    def read(self, name: str, slices: tuple[slice, ...], read_full: Callable[[str], np.ndarray]) -> np.ndarray:
        module, _, kind = name.rpartition(".")
        return self._module(module, read_full)[kind][slices]

    def _module(self, module: str, read_full: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
        if module in self._cache:
            self._cache.move_to_end(module)
            return self._cache[module]
        values, zeros, scales = unpacked_int4_groups(
            read_full(f"{module}.qweight"),
            read_full(f"{module}.qzeros"),
            read_full(f"{module}.scales"),
            self.qc.packing,
        )
        if self.qc.packing != "awq":
            g_idx = np.asarray(read_full(f"{module}.g_idx"))
            if not np.array_equal(g_idx, np.arange(g_idx.shape[0]) // self.group):
                raise ValueError(
                    f"gptq tensor {module}.g_idx is not i // {self.group} (act-order checkpoint saved with "
                    "desc_act=false?); act-order GPTQ is not supported"
                )
        half = scales.astype(np.float16)
        if not np.array_equal(half.astype(np.float64), scales.astype(np.float64)):
            raise ValueError(f"{self.qc.packing} tensor {module}.scales holds values float16 cannot hold exactly")
        out = {"weight_scale": half}
        if self.qc.offset:
            out["weight"] = values.astype(np.int8)
            out["weight_offset"] = -zeros.astype(np.int8)  # the zero point, in units of the scale
        else:
            if not (zeros == 8).all():
                raise ValueError(f"gptq module {module}: sym=true but its zeros are not all 8")
            out["weight"] = values.astype(np.int8) - 8
        self._cache[module] = out
        while len(self._cache) > 8:
            self._cache.popitem(last=False)
        return out


def int4_group_tensors(
    shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], qc: Optional[QuantConfig]
) -> Optional[Int4GroupTensors]:
    """The AWQ / GPTQ view of a checkpoint whose quantization config says so, else None."""
    if qc is None or not qc.packing:
        return None
    return Int4GroupTensors(shapes, dtypes, qc)
