"""Section 1: the device, the software, the backends `auto` picks, and the roofline.

The roofline is measured, not taken from a datasheet (`jaxllm.bench.kernels.measure_ceilings`):
device-to-device copy bandwidth from an elementwise pass over 1 GiB (bytes read + written
per second) and bf16 dense matmul FLOP/s at 8192^3 (256^3 in a dry run). Later sections
divide their rates by these two (`ctx.shared["ceilings"]`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any, Optional

import jax
import jax.extend

from jaxllm.bench.gpu.report import SectionContext
from jaxllm.bench.kernels import Ceilings, measure_ceilings
from jaxllm.models.backends import gpu_kernel_flavour, resolve_backends


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_plugin_versions() -> dict[str, str]:
    """Installed jax CUDA plugin / PJRT packages (their names carry the CUDA major)."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith(("jax-cuda", "jax_cuda")):
            out[name] = dist.version
    return out


def device_facts(device: Any) -> dict[str, Any]:
    stats = {}
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may not report memory
        stats = {}
    return {
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", device.platform),
        "compute_capability": getattr(device, "compute_capability", None),
        "sm_count": getattr(device, "core_count", None),
        "memory_bytes": stats.get("bytes_limit"),
        "devices": jax.device_count(),
    }


def auto_backends() -> dict[str, str]:
    """What `attention_backend=None, moe_backend=None` resolves to here, with the Pallas flavour."""
    attention, moe, _, _ = resolve_backends(None, None)
    on_gpu = jax.default_backend() == "gpu"
    flavour = gpu_kernel_flavour(jax.devices()[0]) if on_gpu else "triton (interpret)"
    describe = lambda name: f"{name} ({flavour})" if name == "pallas" else name  # noqa: E731
    return {"attention": describe(attention), "moe": describe(moe)}


def run(ctx: SectionContext) -> None:
    device = jax.devices()[0]
    facts = device_facts(device)
    try:
        platform_version = jax.extend.backend.get_backend().platform_version
    except Exception:  # noqa: BLE001
        platform_version = None
    facts.update(
        python=sys.version.split()[0],
        machine=platform.machine(),
        jax=jax.__version__,
        jaxlib=_dist_version("jaxlib"),
        platform_version=platform_version,
        cuda_plugins=cuda_plugin_versions(),
        flax=_dist_version("flax"),
        tokamax=_dist_version("tokamax"),
        auto_backends=auto_backends(),
        kernel_flavour=gpu_kernel_flavour(device) if device.platform == "gpu" else None,
    )
    ctx.data.update(facts)
    table = ctx.table("Device and software", ("item", "value"))
    for key in (
        "device_kind",
        "compute_capability",
        "sm_count",
        "memory_bytes",
        "devices",
        "platform_version",
        "jax",
        "jaxlib",
        "python",
    ):
        table.add(item=key, value=facts[key])
    table.add(item="cuda plugins", value=", ".join(f"{k} {v}" for k, v in facts["cuda_plugins"].items()) or "-")
    table.add(item="auto attention backend", value=facts["auto_backends"]["attention"])
    table.add(item="auto MoE backend", value=facts["auto_backends"]["moe"])
    ctx.check_time("the roofline")
    ceilings: Ceilings = measure_ceilings(smoke=ctx.options.dry_run)
    ctx.shared["ceilings"] = ceilings
    ctx.data.update(
        copy_bytes_per_s=ceilings.bytes_per_s,
        matmul_flops_per_s=ceilings.flops_per_s,
        ridge_flops_per_byte=ceilings.ridge,
        matmul_n=256 if ctx.options.dry_run else 8192,
    )
    roof = ctx.table("Measured roofline", ("ceiling", "value", "unit"))
    roof.add(ceiling="device copy bandwidth", value=ceilings.bytes_per_s / 1e9, unit="GB/s")
    roof.add(ceiling=f"bf16 dense matmul {ctx.data['matmul_n']}^3", value=ceilings.flops_per_s / 1e12, unit="TFLOP/s")
    roof.add(ceiling="ridge point", value=ceilings.ridge, unit="FLOP/byte")


def ceilings_of(ctx: SectionContext) -> Ceilings:
    """The environment section's roofline, or a fresh measurement when that section did not run."""
    ceilings = ctx.shared.get("ceilings")
    if ceilings is None:
        ceilings = measure_ceilings(smoke=ctx.options.dry_run)
        ctx.shared["ceilings"] = ceilings
        ctx.note("roofline measured here (the environment section did not provide it)")
    return ceilings
