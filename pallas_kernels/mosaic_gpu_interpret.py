"""Running Mosaic GPU kernels on CPU: jax's GPU interpreter, where this jax has one.

`plgpu.kernel(..., interpret=params)` runs a Mosaic GPU kernel on CPU while simulating
shared memory, TMA copies, barriers and wgmma (and detecting races). The parameters
class is private in jax 0.10 (`jax._src.pallas.mosaic_gpu.interpret`); this module is
the one place that looks it up, so a jax that moves or drops it only turns the
interpreter off (`available()` is False) instead of breaking imports.
"""

from __future__ import annotations

from typing import Any, Optional


def _params_class() -> Optional[type]:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    public = getattr(plgpu, "InterpretParams", None)
    if public is not None:
        return public
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams


def available() -> bool:
    """Whether this jax can run Mosaic GPU kernels on CPU."""
    return _params_class() is not None


def interpret_params(interpret: bool) -> Any:
    """The `interpret=` value for `plgpu.kernel`: None (compile for the GPU) or the
    interpreter's parameters; a clear error when the interpreter is missing."""
    if not interpret:
        return None
    cls = _params_class()
    if cls is None:
        raise ValueError("this jax has no Mosaic GPU interpreter: Mosaic GPU kernels need a Hopper GPU here")
    return cls()
