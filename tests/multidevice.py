"""Multi-device checks on fake CPU devices.

XLA fixes the CPU device count when jax starts, and the rest of the suite runs on one device
in the same pytest process, so a multi-device check runs in a fresh interpreter with
`--xla_force_host_platform_device_count`. The check prints one JSON object per line; the test
gets them back as dicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Compiles in about two thirds of the CPU time (LLVM's optimizations off): every program of the
# subprocess is built the same way, so outputs compared within it stay comparable.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def run_on_cpu_devices(
    module: str,
    function: str,
    workdir: Path,
    *,
    num_devices: int = 8,
    timeout: float = 900,
    unset_env: tuple[str, ...] = (),
    xla_flags: str = "",
    fast_compile: bool = True,
) -> list[dict]:
    """Run `tests.<module>.<function>(workdir)` on `num_devices` CPU devices; returns its JSON
    lines. The subprocess compiles with `FAST_COMPILE` when this process does (the test
    session's setting, tests/conftest.py) unless `fast_compile` is False (a check whose
    tolerance holds for the optimized build's rounding only); `xla_flags`: more XLA flags for it."""
    fast = FAST_COMPILE if fast_compile and FAST_COMPILE in os.environ.get("XLA_FLAGS", "") else ""
    flags = " ".join(dict.fromkeys(f"--xla_force_host_platform_device_count={num_devices} {fast} {xla_flags}".split()))
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    for name in unset_env:
        env.pop(name, None)
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.{module} import {function}; "
        f"from pathlib import Path; {function}(Path({str(workdir)!r}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
