"""Running Mosaic GPU kernels on CPU: jax's GPU interpreter, where this jax has one.

`plgpu.kernel(..., interpret=params)` runs a Mosaic GPU kernel on CPU while simulating
shared memory, TMA copies, barriers and wgmma (and detecting races). The parameters
class is private in jax 0.10 (`jax._src.pallas.mosaic_gpu.interpret`); this module is
the one place that looks it up, so a jax that moves or drops it only turns the
interpreter off (`available()` is False) instead of breaking imports.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax


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


def detect_races() -> bool:
    """`JAXLLM_MOSAIC_DETECT_RACES=1` turns on the interpreter's race detector (several
    times slower, so off by default); `races_found()` reads its verdict."""
    return os.environ.get("JAXLLM_MOSAIC_DETECT_RACES", "").strip() in ("1", "true", "yes")


def races_found() -> bool:
    """Whether the race detector flagged the most recent interpreted kernel (it keeps
    the state of the last kernel only)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return bool(gpu_callbacks._races is not None and gpu_callbacks._races.races_found)


def interpret_params(interpret: bool) -> Any:
    """The `interpret=` value for `plgpu.kernel`: None (compile for the GPU) or the
    interpreter's parameters; a clear error when the interpreter is missing."""
    if not interpret:
        return None
    cls = _params_class()
    if cls is None:
        raise ValueError("this jax has no Mosaic GPU interpreter: Mosaic GPU kernels need a Hopper GPU here")
    _install_transposing_wgmma()
    return cls(detect_races=True) if detect_races() else cls()


def _transposing_wgmma(original):
    """jax 0.10's interpreter reads wgmma operands through index transforms only, while
    the hardware (and the lowering) also take a transposed shared-memory operand
    (`plgpu.transpose_ref`, how attention reads K as K^T). This wraps the interpreter's
    wgmma: trailing transposes are taken off the operand's transforms and applied to
    the values read, so the simulated product is the one the GPU computes."""
    import numpy as np
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.state.types import TransposeTransform

    def split(transforms):
        transforms = tuple(transforms)
        perms = []
        while transforms and isinstance(transforms[-1], TransposeTransform):
            perms.insert(0, transforms[-1].permutation)
            transforms = transforms[:-1]
        if any(isinstance(t, TransposeTransform) for t in transforms):
            raise NotImplementedError("a wgmma operand transposed before it is indexed")
        return transforms, perms

    def wgmma(*, a_transforms, b_transforms, **kwargs):
        (a_transforms, a_perms), (b_transforms, b_perms) = split(a_transforms), split(b_transforms)
        if not a_perms and not b_perms:
            return original(a_transforms=a_transforms, b_transforms=b_transforms, **kwargs)
        memory = gpu_callbacks._get_shared_memory()
        thread = memory.get_global_thread_id(int(kwargs["device_id"]), int(kwargs["thread_id"]))
        info = gpu_callbacks.interpret_utils.GPULoggingInfo(
            device_id=int(kwargs["device_id"]),
            grid_point_coords=tuple(int(x) for x in kwargs["grid_point_coords"]),
            thread_id=int(kwargs["thread_id"]),
            source_info=kwargs.get("source_info"),
        )

        def read(key, transforms, perms):
            key = gpu_callbacks.HostAllocationKey.from_array(key)
            transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(transforms))
            value, _, _ = memory.get_buffer_content(
                key, gpu_callbacks.interpret_utils.to_range(transforms), thread, logging_info=info
            )
            for perm in perms:
                value = np.transpose(value, perm)
            return value

        a = read(kwargs["a_allocation_key_as_array"], a_transforms, a_perms)
        b = read(kwargs["b_allocation_key_as_array"], b_transforms, b_perms)
        acc_key = gpu_callbacks.HostAllocationKey.from_array(kwargs["acc_allocation_key_as_array"])
        acc_range = gpu_callbacks.interpret_utils.to_range(
            jax.tree.map(int, gpu_callbacks._remove_noop_transforms(kwargs["acc_transforms"]))
        )
        acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
        memory.store_buffer_content(
            acc_key, acc_range, acc + np.matmul(a, b, dtype=kwargs["acc_dtype"]), thread, logging_info=info
        )
        return kwargs["token"]

    wgmma.transposing = True
    return wgmma


def _install_transposing_wgmma() -> None:
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return
    if not getattr(gpu_callbacks.wgmma, "transposing", False):
        gpu_callbacks.wgmma = _transposing_wgmma(gpu_callbacks.wgmma)
