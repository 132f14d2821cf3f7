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
            out.add(base + self.stored.scale_suffix)
            if self.stored.offset:
                out.add(base + self.stored.offset_suffix)
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
        rows, cols = self.stored.block_for(*values.shape)

        def expanded(per_block: np.ndarray) -> np.ndarray:
            full = np.repeat(np.repeat(np.asarray(per_block, np.float32), rows, 0), cols, 1)
            return full[: values.shape[0], : values.shape[1]]

        out = values * expanded(read_full(base + self.stored.scale_suffix))
        if self.stored.offset:
            out = out + expanded(read_full(base + self.stored.offset_suffix))
        return out
