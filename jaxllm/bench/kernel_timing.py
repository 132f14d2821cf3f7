"""Timing rows of `jaxllm bench kernels`: the measured ceilings, one timed call per row (a
failure becomes a row), and the row's text form. Shared by the kernel families' benchmarks."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench.error_summary import describe_error


@dataclass
class Row:
    kernel: str
    case: str
    impl: str
    ms: float = float("nan")
    gbps: float = float("nan")
    tflops: float = float("nan")
    bound: str = ""
    pct_of_ceiling: float = float("nan")
    rel_err: float = float("nan")
    note: str = ""


@dataclass
class Ceilings:
    bytes_per_s: float
    flops_per_s: float

    @property
    def ridge(self) -> float:
        return self.flops_per_s / self.bytes_per_s


@dataclass
class Settings:
    interpret: bool
    iters: int
    reps: int
    tokens_per_block: int
    sweep: bool
    max_ragged_dot_rows: int
    seed: int = 0
    rows: list[Row] = field(default_factory=list)


def on_hopper(s: Settings) -> bool:
    """The Mosaic GPU kernels (sm_90a) run: a Hopper GPU, not interpret mode."""
    from jaxllm.models.backends import gpu_kernel_flavour

    return not s.interpret and gpu_kernel_flavour(jax.devices()[0]) == "mosaic"


def _time(fn: Callable[..., Any], args: tuple, iters: int, reps: int) -> float:
    """Seconds per call: compile, warm up, then the median of `reps` loops of `iters`
    back-to-back calls (dispatch overlaps execution, as in a serving loop)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return float(np.median(samples))


def measure_ceilings(smoke: bool) -> Ceilings:
    """HBM bandwidth from `x * 2` over a large array (read + write) and bf16 matmul FLOP/s."""
    n_elems = (1 << 16) if smoke else (1 << 28)  # 1 GiB of f32 on GPU
    x = jnp.ones((n_elems,), jnp.float32)
    copy = jax.jit(lambda a: a * 2.0)
    t_copy = _time(copy, (x,), 3 if smoke else 20, 1 if smoke else 3)
    n = 256 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    b = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t_mm = _time(mm, (a, b), 2 if smoke else 20, 1 if smoke else 3)
    return Ceilings(bytes_per_s=2 * x.nbytes / t_copy, flops_per_s=2 * n**3 / t_mm)


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    out = np.asarray(jax.device_get(out), np.float32)
    ref = np.asarray(jax.device_get(ref), np.float32)
    return float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def record_timing(
    s: Settings,
    ceil: Ceilings,
    kernel: str,
    case: str,
    impl: str,
    fn: Callable[..., Any],
    args: tuple,
    nbytes: float,
    flops: float,
    ref_out: Optional[jax.Array] = None,
    note: str = "",
) -> Optional[jax.Array]:
    """Times `fn(*args)` and appends a row; a failure becomes a row, not a crash."""
    row = Row(kernel, case, impl, note=note)
    out = None
    try:
        secs = _time(fn, args, s.iters, s.reps)
        out = fn(*args)
        row.ms = secs * 1e3
        row.gbps = nbytes / secs / 1e9
        row.tflops = flops / secs / 1e12
        if flops / nbytes < ceil.ridge:
            row.bound, row.pct_of_ceiling = "bw", 100 * nbytes / secs / ceil.bytes_per_s
        else:
            row.bound, row.pct_of_ceiling = "flop", 100 * flops / secs / ceil.flops_per_s
        if ref_out is not None:
            row.rel_err = _rel_err(out, ref_out)
    except Exception as e:  # noqa: BLE001 - report the failure in the table and go on
        row.note = f"failed: {describe_error(e, width=80)}"
        out = None
    s.rows.append(row)
    print(format_row(row), flush=True)
    return out


_COLUMNS = (
    ("kernel", 22),
    ("case", 36),
    ("impl", 34),
    ("ms", 9),
    ("GB/s", 8),
    ("TFLOP/s", 8),
    ("bound", 5),
    ("%ceil", 6),
    ("rel_err", 8),
    ("note", 0),
)


def _fmt(v: Any, width: int) -> str:
    if not isinstance(v, float):
        text = str(v)
    elif math.isnan(v):
        text = "-"
    elif 0 < abs(v) < 1e-2:
        text = f"{v:.2e}"
    else:
        text = f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return text.ljust(width) if width else text


def format_row(r: Row) -> str:
    values = (r.kernel, r.case, r.impl, r.ms, r.gbps, r.tflops, r.bound, r.pct_of_ceiling, r.rel_err, r.note)
    return " ".join(_fmt(v, w) for v, (_, w) in zip(values, _COLUMNS))


def header() -> str:
    return " ".join(name.ljust(w) if w else name for name, w in _COLUMNS)
