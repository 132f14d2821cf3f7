"""Test-session setup: one persistent compilation cache for the whole run.

Many tests build engines with the same model and limits, and subprocess tests (CLI,
multi-device) start fresh interpreters; all of them share one JAX compilation cache in a
directory made for this session (set through the environment, so subprocesses inherit
it), so an identical program is compiled once per run. The directory starts empty and is
removed at the end, so no run depends on an earlier one, and nothing is written to the
user's own cache (~/.cache/jaxllm/xla). Under pytest-xdist the controller makes the directory
and every worker uses it (`_SHARED_DIR_ENV`), so a program one worker compiled is a hit in the
other; the controller removes it at the end. (JAX writes an entry in place: a worker reading
one while the other still writes it fails to decompress it, warns and compiles it itself.)

Every program of the run compiles with LLVM's optimizations off (`multidevice.FAST_COMPILE`:
about two thirds of the compile time, XLA's own passes unchanged; tiny models run about as
fast). The flags go into XLA_FLAGS before JAX starts its CPU backend, so subprocesses inherit
them, and the multi-device helper adds them to the flags it sets: outputs compared with each
other, in one process or across processes, come from programs built the same way (the
multi-host processes of tests/multihost.py set their own flags and are optimized; their greedy
tokens equal this process's all the same). Results may differ from an optimized build's in the
last bits, as any two builds' may. JAXLLM_TEST_FAST_COMPILE=0 keeps LLVM's optimizations.

A hit in this cache still goes through JAX's compile path (and its
'/jax/core/compile/backend_compile_duration' event), so tests that count compilations
after warm-up still see anything that was not compiled during warm-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

import pytest

_SESSION_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
_SHARED_DIR_ENV = "JAXLLM_TEST_SESSION_XLA_CACHE"
_cache_dir: str | None = None  # the directory this process made (and removes)


def pytest_configure(config) -> None:
    global _cache_dir
    from multidevice import FAST_COMPILE  # here: subprocesses import this module without tests/ on the path

    flags = os.environ.get("XLA_FLAGS", "")
    fast = os.environ.get("JAXLLM_TEST_FAST_COMPILE", "").strip().lower() not in ("0", "false", "no", "off")
    if fast and FAST_COMPILE not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()
    if os.environ.get("JAXLLM_COMPILE_CACHE", "").strip().lower() in ("0", "false", "no", "off"):
        return
    shared = os.environ.get(_SHARED_DIR_ENV)
    if hasattr(config, "workerinput") and shared and os.path.isdir(shared):
        directory = shared  # an xdist worker: the controller's directory
    else:
        directory = _cache_dir = tempfile.mkdtemp(prefix="jaxllm-test-xla-")
    os.environ.update(_SESSION_ENV, JAX_COMPILATION_CACHE_DIR=directory, **{_SHARED_DIR_ENV: directory})
    import jax  # noqa: F401  (may already be imported by a plugin: set the values directly too)

    from jaxllm.engine.compile_cache import enable_compile_cache

    jax.config.update("jax_compilation_cache_dir", directory)
    enable_compile_cache(directory)


def pytest_unconfigure(config) -> None:
    if _cache_dir is not None:
        shutil.rmtree(_cache_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_logging():
    """Tests that run the CLI in-process get its logging setup (`jaxllm.cli.startup.quiet_logs`: the
    `jaxllm` logger stops propagating, the root logger gets a stderr handler bound to that
    test's captured output); undo it so later tests' `caplog` sees jaxllm's records."""
    root, ours = logging.getLogger(), logging.getLogger("jaxllm")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.level, ours.propagate)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    ours.handlers[:], ours.level, ours.propagate = saved[2], saved[3], saved[4]


def tiny_engine(model: str = "tiny-moe", *, max_kv_tokens: int = 2048, **limits):
    """An `LLMEngine` on a tiny preset with small limits: 8 rows, one 16-token bucket, 128-token
    sequences, 8-token KV blocks and a 2048-token pool (override any of them; `max_kv_tokens`
    sizes the pool). Context chunks come in whole KV blocks, so a full batch of 8 decoding
    requests still leaves room for a chunk of a waiting prompt."""
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig

    fields = dict(
        max_batch_size=8,
        max_num_tokens=16,
        max_seq_len=128,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=max_kv_tokens),
    )
    return LLMEngine(EngineConfig(model=model, **{**fields, **limits}))


@contextlib.contextmanager
def verified_triton_lowering():
    """Runs the MLIR verifier on every Triton module Pallas lowers inside the block.

    Pallas hands the module to XLA unverified, so an op the Triton dialect rejects (a
    masked atomic whose mask is not in the value's shape, say) otherwise shows up only
    when a GPU compiles it ("Failed to parse Triton module"). Verifying here turns that
    into a CPU test failure."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    original = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = original
        assert lowering.lower_jaxpr_to_triton_module is original
