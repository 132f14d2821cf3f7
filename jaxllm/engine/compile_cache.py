"""Remember compiled steps on disk (JAX's persistent compilation cache), so the next
process that builds an engine with the same model and limits compiles nothing.

On by default for every engine; off with `EngineConfig(compile_cache=False)`, the CLI's
`--no-compile-cache`, or `JAXLLM_COMPILE_CACHE=0` in the environment. The entries live
in `$JAXLLM_CACHE_DIR/xla/<host>` (default ~/.cache/jaxllm/xla/<host>) unless JAX's own cache
directory is already set (`JAX_COMPILATION_CACHE_DIR` or `jax_compilation_cache_dir`), which wins.

Why a hit is always the right program: JAX keys each entry by a hash of everything the
executable depends on: the lowered program (every shape, dtype and sharding, hence the
model's architecture and the engine's limits, plus any constant folded into it), the
devices it is compiled for, the compile options and XLA flags, the backend platform and
version, and the jaxlib version (jax's own lowering shows in the program). Weights are program
arguments, not part of the program, so two checkpoints of one architecture rightly share entries. A different model,
limit, device or jax version is a different key, a miss, never a wrong executable. One
thing the key leaves out is the host CPU's instruction set (CPU executables are native code),
so the default directory has one subdirectory per CPU model and feature set: a home
directory shared by different machines never loads code built for another CPU. We
only lower the thresholds below which JAX skips writing an entry (by default programs
compiled in under a second are not kept, and a tiny model's are all that fast); the key
itself is untouched.

A hit here still costs tracing and lowering the program (the key is computed from the lowered
program); the engine's forwards and samplers skip those too through the executable store kept
in this directory's `executables` subdirectory (`jaxllm.engine.executable_store`), which the
same switches turn off.

The cache holds executable code: like JAX, treat the directory as trusted and keep it
writable only by you. The setting is process-wide (JAX has one cache per process), so
turning it off for one engine only means that engine does not turn it on.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path
from typing import Optional

ENV_SWITCH = "JAXLLM_COMPILE_CACHE"
_OFF = ("0", "false", "no", "off")
_lock = threading.Lock()


def compile_cache_requested(enabled: bool = True) -> bool:
    """`enabled`, unless the environment turns the cache off (JAXLLM_COMPILE_CACHE=0)."""
    return enabled and os.environ.get(ENV_SWITCH, "").strip().lower() not in _OFF


def host_id() -> str:
    """Architecture and a short hash of the CPU's model and feature flags."""
    described = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            described += sorted(
                {line.strip() for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))}
            )
    except OSError:
        pass
    digest = hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]
    return f"{platform.machine() or 'cpu'}-{digest}"


def default_compile_cache_dir() -> Path:
    """$JAXLLM_CACHE_DIR/xla/<host>, else ~/.cache/jaxllm/xla/<host>."""
    from jaxllm.models.cache_dir import cache_root

    return cache_root() / "xla" / host_id()


def enable_compile_cache(directory: Optional[str | Path] = None) -> str:
    """Turn JAX's persistent compilation cache on (idempotent); returns its directory.

    A directory already configured in JAX is kept; otherwise `directory`, else the default.
    """
    import jax

    with _lock:
        path = jax.config.jax_compilation_cache_dir
        if not path:
            path = str(Path(directory) if directory is not None else default_compile_cache_dir())
            Path(path).mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", path)
        # Keep every program, however fast it compiled or small it is (-1: no size floor,
        # and JAX may not raise it for the file system).
        if jax.config.jax_persistent_cache_min_compile_time_secs != 0:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if jax.config.jax_persistent_cache_min_entry_size_bytes != -1:
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        return path
