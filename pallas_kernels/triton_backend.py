"""What the Triton kernels need from the Pallas Triton backend, on jax 0.10.x and 0.11.x.

jax 0.11.0 deprecated the Pallas Triton backend: every Triton `pallas_call` lowering emits
a DeprecationWarning ("The Pallas Triton backend is deprecated and will be removed in a
future JAX version..."; deprecation id `jax-pallas-triton`). The kernels in
`ragged_paged_attention/kernel.py` and `moe_grouped_gemm/kernel.py` use that backend on
purpose: it runs on Ampere and Hopper alike and is the path for GPUs without a Mosaic GPU
kernel. Users of the engine cannot act on the warning, so the first time a kernel is built
this module installs a process-wide filter for exactly that message and category (nothing
else is silenced). The warning fires when the enclosing jit is lowered, after the kernel
function has returned, so a filter scoped to the call (`warnings.catch_warnings`) would
not see it; the filter is (re)installed each time a kernel is built, so it survives a
caller's `catch_warnings` block ending (pytest runs every test in one).
`JAXLLM_SHOW_TRITON_DEPRECATION=1` leaves the warning visible.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import jax
from jax.experimental.pallas import triton as pltriton

TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def filter_triton_deprecation() -> None:
    """Ignore jax's Triton-backend DeprecationWarning from now on. Idempotent: `warnings`
    drops an identical filter before inserting it again."""
    if os.environ.get("JAXLLM_SHOW_TRITON_DEPRECATION", "") not in ("", "0"):
        return
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Triton launch parameters for a `pallas_call`; building them marks a knowing Triton use."""
    filter_triton_deprecation()
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_power_of_two(owner: str, name: str, value: int, minimum: int = 1) -> None:
    """Triton tensor shapes (and `num_warps`) must be powers of two; interpret mode would
    accept any size and the mistake would surface only when lowering for a GPU."""
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{owner}: {name}={value!r} must be a power of two >= {minimum}")


@contextlib.contextmanager
def cuda_lowering_target(device_kind: str = "NVIDIA H100 80GB HBM3", num_sms: int = 132) -> Iterator[None]:
    """Lets `jit(...).trace(...).lower(lowering_platforms=("cuda",))` lower the Triton kernels
    on a machine without a GPU (tests, the cost model's checks).

    From jax 0.11 the Triton lowering asks the device for its compute capability and, with
    no GPU present, wants an abstract one named by an abstract mesh; jax 0.10 needs none.
    """
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("lowering",),
        abstract_device=jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_sms, platform="gpu"),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield
