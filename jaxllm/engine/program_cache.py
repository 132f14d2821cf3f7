"""The runner's compiled programs: one executable per (program, input layout), compiled once.

A step's model forward compiles once per token bucket and its sampler once per variant of
the sampler's static switches. Compiles run on a small pool of threads (XLA compiles without
holding the GIL, so several run at once), or in the step's own thread when a step needs a
program nobody has started; a program under way is waited for, never compiled twice. With an
executable store (`jaxllm.engine.executable_store`) a program stored by an earlier process is
loaded instead, skipping tracing and lowering as well, and each one compiled here is stored.
A compile started with `background=True` (after "ready": it only makes steps cheaper) runs on
the low-priority threads of `jaxllm.engine.background_compiles` instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.background_compiles import BackgroundCompiles
from jaxllm.engine.executable_store import ExecutableStore, UnstableKey, compile_here, describe, describe_arguments
from jaxllm.engine.host_transfer import PackedLayout

logger = logging.getLogger(__name__)


def default_compile_workers() -> int:
    """Threads that compile programs at once: one per CPU core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


class ProgramCache:
    """Compiled executables of a few jitted programs ("forward", "sampler"), keyed by layout."""

    def __init__(
        self,
        jitted: dict[str, Any],
        *,
        replicated: jax.sharding.Sharding,
        compile_workers: Optional[int] = None,
        store: Optional[ExecutableStore] = None,
        store_keys: Optional[dict[str, str]] = None,
    ) -> None:
        """`jitted`: program name -> the `jax.jit` of its function (static argument `layout`).
        `replicated`: the sharding host buffers get on the mesh (programs are lowered for it).
        `store_keys`: the executable store's key text of each stored program's function."""
        self._jitted = jitted
        self._replicated = replicated
        self._store = store
        self._store_keys = dict(store_keys or {})
        self._exes: dict[str, dict[PackedLayout, Any]] = {kind: {} for kind in jitted}
        # Compiles under way, by program: a second request for one waits for it.
        self._compiling: dict[tuple[str, PackedLayout], Future] = {}
        self._queued: dict[tuple[str, PackedLayout], Future] = {}  # the compile threads' tasks
        self._pool: Optional[ThreadPoolExecutor] = None
        self._background: Optional[BackgroundCompiles] = None
        self._closed = False  # no more background compiles (a step may still compile its own)
        self._lock = threading.Lock()
        self.compile_workers = compile_workers or default_compile_workers()
        self.compile_seconds = 0.0  # summed over programs (several compile at once), loads included
        self.compile_wait_seconds = 0.0  # time steps spent waiting for a program to compile
        self.programs_loaded = 0  # programs loaded from the executable store (not traced or compiled)
        # Programs compiled (or loaded) per thread name: a step's own compiles are on its thread.
        self.compiles_by_thread: dict[str, int] = {}

    def num_variants(self, kind: str) -> int:
        return len(self._exes[kind])

    def has(self, kind: str, layout: PackedLayout) -> bool:
        """Whether program `kind` is compiled for `layout`."""
        return layout in self._exes[kind]

    def started(self, kind: str, layout: PackedLayout) -> bool:
        """Whether program `kind` is compiled for `layout`, or its compile is queued or under way."""
        with self._lock:
            return layout in self._exes[kind] or (kind, layout) in self._compiling

    @property
    def background_pending(self) -> int:
        """Background compiles queued or under way."""
        background = self._background
        return 0 if background is None else background.pending

    @property
    def background_done(self) -> int:
        """Background compiles finished."""
        background = self._background
        return 0 if background is None else background.done

    def executables(self, kind: str) -> dict[PackedLayout, Any]:
        """Program `kind`'s executables by layout (a copy)."""
        with self._lock:
            return dict(self._exes[kind])

    @property
    def compiles_in_flight(self) -> int:
        """Programs being compiled (or queued for it) on the compile threads."""
        with self._lock:
            return len(self._compiling)

    def add_compile_seconds(self, seconds: float) -> None:
        """Count a compile made outside this cache (the runner's small logits programs)."""
        with self._lock:
            self.compile_seconds += seconds

    def abstract(self, args: tuple) -> tuple:
        """`args` as shapes, dtypes and shardings only: a program is lowered from these, never
        from live buffers (the KV cache and LoRA slots are donated by the steps meanwhile).
        Host buffers are lowered as what they become on the mesh: replicated device arrays."""

        def spec(leaf: Any) -> Any:
            if isinstance(leaf, np.ndarray):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._replicated)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)

        return jax.tree_util.tree_map(spec, args)

    def _claim(self, kind: str, layout: PackedLayout) -> tuple[Future, bool]:
        """The compile of program `kind` for `layout`: (its future, True when the caller must
        run it). A compiled program gives a done future, one under way its own future."""
        with self._lock:
            future = self._compiling.get((kind, layout))
            if future is not None:
                return future, False
            future = Future()
            exe = self._exes[kind].get(layout)
            if exe is not None:
                future.set_result(exe)
                return future, False
            self._compiling[(kind, layout)] = future
            return future, True

    def _store_key(self, kind: str, abstract_args: tuple, layout: PackedLayout) -> Optional[str]:
        """The executable store's key of this program, None when it is not stored."""
        prefix = self._store_keys.get(kind)
        if prefix is None:
            return None
        try:
            return f"{prefix}\nlayout {describe(layout)}\narguments {describe_arguments(abstract_args)}"
        except UnstableKey as exc:
            logger.debug("a %s variant is not stored: %s", kind, exc)
        except Exception as exc:  # the store is an optimization: never a reason for a step to fail
            logger.warning("a %s variant is not stored: its key could not be built (%r)", kind, exc)
        return None

    def _run_compile(
        self,
        kind: str,
        abstract_args: tuple,
        layout: PackedLayout,
        future: Future,
        run: Callable[..., Any] = lambda fn, *args: fn(*args),
    ) -> None:
        """Compile one program (or load it from the executable store, which skips tracing and
        lowering too) and hand it to `future`; a compiled program is stored afterwards. `run(fn,
        *args)` runs XLA's compile (`BackgroundCompiles.at_low_priority` for a background one)."""
        start = time.perf_counter()
        entry = None
        try:
            key = self._store_key(kind, abstract_args, layout)
            exe = self._store.load(key) if key is not None else None
            loaded = exe is not None
            if exe is None:
                exe, compiled_here = run(compile_here, self._jitted[kind].lower(*abstract_args, layout=layout))
                if key is not None and not compiled_here:  # from one of JAX's caches: not storable
                    self._store.count_from_jax_cache()
                elif key is not None:  # serialized before anything runs it (XLA:CPU cannot after)
                    entry = self._store.serialize(key, exe)
        except BaseException as exc:
            with self._lock:
                self._compiling.pop((kind, layout), None)
                self._queued.pop((kind, layout), None)
            future.set_exception(exc)
            return
        elapsed = time.perf_counter() - start
        logger.debug("%s a %s variant in %.2fs", "loaded" if loaded else "compiled", kind, elapsed)
        thread = threading.current_thread().name
        with self._lock:
            self.compile_seconds += elapsed
            self.programs_loaded += loaded
            self.compiles_by_thread[thread] = self.compiles_by_thread.get(thread, 0) + 1
            self._exes[kind][layout] = exe
            self._compiling.pop((kind, layout), None)
            self._queued.pop((kind, layout), None)
        future.set_result(exe)
        if entry is not None:
            self._store.write(key, entry)

    def start(
        self, kind: str, args: tuple, layout: PackedLayout, *, background: bool = False, idle: bool = False
    ) -> Future:
        """Compile on the compile threads (see `_claim`); returns the compile's future.
        `background`: on the low-priority background threads instead, `idle` there: only
        once the engines of this process are idle (see `jaxllm.engine.background_compiles`)."""
        future, mine = self._claim(kind, layout)
        if mine:
            with self._lock:
                if self._closed:
                    self._compiling.pop((kind, layout), None)
                    future.set_exception(RuntimeError("the model runner is closed"))
                    return future
                if background:
                    if self._background is None:
                        self._background = BackgroundCompiles(
                            max(1, self.compile_workers // 2), hold_while_busy=self._on_cpu()
                        )
                    background = self._background
                    task = background.submit(
                        self._run_compile,
                        kind,
                        self.abstract(args),
                        layout,
                        future,
                        background.at_low_priority,
                        idle=idle,
                    )
                    self._queued[(kind, layout)] = task
                    return future
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.compile_workers, thread_name_prefix="jaxllm-compile")
                pool = self._pool
            self._queued[(kind, layout)] = pool.submit(self._run_compile, kind, self.abstract(args), layout, future)
        return future

    def _on_cpu(self) -> bool:
        """Whether the programs run on CPU devices (whose cores the compiles share)."""
        mesh = getattr(self._replicated, "mesh", None)
        devices = mesh.devices.flat if mesh is not None else jax.local_devices()
        return any(d.platform == "cpu" for d in devices)

    def get(self, kind: str, args: tuple, layout: PackedLayout) -> Any:
        """The executable for `layout`. A program not compiled yet is compiled in this thread
        (never queued behind background compiles); one under way elsewhere is waited for."""
        exe = self._exes[kind].get(layout)
        if exe is not None:
            return exe
        start = time.perf_counter()
        future, mine = self._claim(kind, layout)
        if not mine:  # queued on the compile threads but not started: compile it here, now
            with self._lock:
                task = self._queued.pop((kind, layout), None)
            mine = task is not None and task.cancel()
        if mine:
            self._run_compile(kind, self.abstract(args), layout, future)
        exe = future.result()
        with self._lock:
            self.compile_wait_seconds += time.perf_counter() - start
        return exe

    def close(self) -> None:
        """Stop the compile threads: queued compiles are dropped, one under way finishes."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            background, self._background = self._background, None
            queued, self._queued = self._queued, {}
        for key, task in queued.items():
            if task.cancel():
                with self._lock:
                    future = self._compiling.pop(key, None)
                if future is not None:
                    future.set_exception(RuntimeError("the model runner was closed before this program compiled"))
        if pool is not None:
            pool.shutdown(wait=True)
        if background is not None:
            background.close()
