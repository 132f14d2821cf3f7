"""An integer-quantized checkpoint read as float weights, so it can be quantized another way.

A converted GGUF file (Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K linears) or an AWQ / GPTQ checkpoint
loads with its integer weights kept; asking for another quantization on load
(`quantization="fp8"` / `"int8"` / `"int4"`) instead reads each such `<m>.weight` as the
float32 `value * scale (+ offset)` of its blocks (the stored format's `QuantConfig`,
`QuantConfig.stored`), which the loader then quantizes as it would a float checkpoint's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from jaxllm.models.quant_config import QuantConfig


class DequantizedTensors:
    """The integer weights of a checkpoint stored as `stored` says, presented as float32."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], stored: QuantConfig) -> None:
        self.stored = stored
        self.weights: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            base = name.removesuffix("weight")
            if dtypes.get(name) == stored.checkpoint_dtype and name.endswith(".weight"):
                if base + stored.scale_suffix not in shapes:
                    raise ValueError(f"integer weight {name} has no {base + stored.scale_suffix}")
                self.weights[name] = tuple(shape)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def names(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        """Each presented tensor -> (shape, dtype, the real tensor it comes from)."""
        return {name: (shape, "F32", name) for name, shape in self.weights.items()}

    def hidden_names(self) -> set[str]:
        """The per-block tensors folded into the presented weights."""
        out = set()
        for name in self.weights:
            base = name.removesuffix("weight")
            out.update(base + suffix for suffix, _, _ in self.stored.for_tensor(name).block_tensors().values())
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def read(self, name: str, slices: tuple[slice, ...], read_full: Callable[[str], np.ndarray]) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self._dequantized(name, read_full)
            while len(self._cache) > 8:
                self._cache.popitem(last=False)
        return self._cache[name][slices]

    def _dequantized(self, name: str, read_full: Callable[[str], np.ndarray]) -> np.ndarray:
        base = name.removesuffix("weight")
        values = np.asarray(read_full(name), np.float32)  # [out, in]
        fmt = self.stored.for_tensor(name)
        parts = {leaf: read_full(base + suffix) for leaf, (suffix, _, _) in fmt.block_tensors().items()}
        return dequantize_stored(values, parts, fmt)


def dequantize_stored(values: np.ndarray, parts: Mapping[str, np.ndarray], stored: QuantConfig) -> np.ndarray:
    """float32 [out, in] weight from its integer `values` and per-block tensors (`scale`,
    `offset`, `super_scale`, `super_offset`, as `QuantConfig.block_tensors` names them), with
    the arithmetic of `jaxllm.models.quantization.dense`."""

    def expanded(leaf: str, per_super: bool = False) -> np.ndarray:
        rows, cols = stored.block_for(*values.shape, super_block=per_super)
        full = np.repeat(np.repeat(np.asarray(parts[leaf], np.float32), rows, 0), cols, 1)
        return full[: values.shape[0], : values.shape[1]]

    scale = expanded("scale")
    if "super_scale" in parts:
        scale = scale * expanded("super_scale", True)
    out = values * scale
    if "offset" in parts:
        offset = expanded("offset")
        if "super_offset" in parts:
            out = out + offset * expanded("super_offset", True)
        elif np.issubdtype(np.asarray(parts["offset"]).dtype, np.integer):  # a zero point
            out = out + offset * scale
        else:
            out = out + offset
    return out
