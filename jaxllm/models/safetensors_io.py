"""Zero-copy safetensors reading into numpy, bfloat16 and float8 included.

safetensors' own numpy API refuses bfloat16 (numpy has no such dtype), and most
checkpoints are bfloat16, so this reads the format directly: an 8-byte little-endian
header length, a JSON header of `{name: {dtype, shape, data_offsets}}`, then raw bytes.
The file is memory-mapped, so a tensor is only read when it is converted.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

_NP_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class SafetensorsFile:
    """One memory-mapped .safetensors file: `infos` from its header, `get(name)` as numpy."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError(f"{self.path} is not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"{self.path} is not a safetensors file (header of {header_len} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{self.path} is not a safetensors file: {exc}") from None
        self._data_start = 8 + header_len
        header.pop("__metadata__", None)
        self.infos: dict[str, TensorInfo] = {
            name: TensorInfo(name, meta["dtype"], tuple(meta["shape"]), *meta["data_offsets"])
            for name, meta in header.items()
        }
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if self.infos else None

    def get(self, name: str) -> np.ndarray:
        info = self.infos[name]
        if info.dtype not in _NP_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path.name} has unsupported dtype {info.dtype}")
        raw = self._mmap[self._data_start + info.begin:self._data_start + info.end]
        return raw.view(_NP_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._mmap = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
