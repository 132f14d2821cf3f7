"""Strict readers of `config.json` fields: sizes are ints in a sane range, floats are finite.

A hostile or broken config could otherwise declare a million layers or a billion positions
and allocate before anything else is checked, or carry a NaN RoPE base that loads silently.
Every reader raises a one-line ValueError naming the field and the bound.
"""

from __future__ import annotations

import math
from typing import Any, Optional

# Upper bounds on model sizes: far above any released checkpoint, far below what would
# exhaust memory merely by being declared.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_EXPERTS = 4096
MAX_POSITIONS = 1 << 24

_MISSING = object()


def as_int(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]: an int, or a float with no fractional part (JSON's 4096.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range [{low}, {high}]")
    return value


def as_float(value: Any, name: str, *, positive: bool = False) -> float:
    """`value` as a finite float (and > 0 with `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def int_field(hf: dict, key: str, low: int, high: int, default: Any = _MISSING, *, where: str = "config") -> int:
    """hf[key] as an int in [low, high]; a missing (or null) field is `default`, else an error."""
    value = hf.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{where} is missing required field {key!r}")
        return default
    return as_int(value, key, low, high)


def optional_float(hf: dict, key: str, *, positive: bool = False) -> Optional[float]:
    """hf[key] as a finite float, or None when absent."""
    value = hf.get(key)
    return None if value is None else as_float(value, key, positive=positive)
