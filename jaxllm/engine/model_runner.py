"""Device side of the engine: parameters, the paged KV cache and the two compiled programs.

A step runs two executables, dispatched back to back without a host sync:
  * the model forward over a packed `StepBatch`, compiled once per token bucket; it
    returns the float32 logits of each sequence's last token [max_batch_size, vocab] and
    each one's greedy token, and updates the donated KV cache in place;
  * the sampler over those logits, compiled once per sampler variant (the static switches
    of `SamplingTensors`). It holds no model, so its variants compile in a fraction of the
    forward's time and warm-up can compile all of them. A step whose rows all decode
    greedily with no processing (`StepPlan.greedy_only`) skips it: the forward's greedy
    tokens are its tokens.
With an executable store (`jaxllm.engine.executable_store`) both are loaded from disk when a
previous process stored them, without tracing, lowering or compiling; each one compiled here is
stored for the next process.
Under the overlap scheduler a generation token may not be known on the host yet:
`feed_index[t] >= 0` tells the forward to take token `t` from row `feed_index[t]` of the
previous step's sampled tokens, which never leave the device.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.executable_store import (ExecutableStore, UnstableKey, compile_here, describe,
                                            describe_arguments)
from jaxllm.engine.host_transfer import PackedLayout, RepeatPacker, pack, put_on_mesh, unpack
from jaxllm.engine.planner import StepPlan
from jaxllm.lora.weights import write_slot
from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.models import ModelConfig, forward, init_kv_cache, kv_cache_bytes_per_token
from jaxllm.engine.logits_processing import BatchedProcessor, apply_batched
from jaxllm.models.decoder import forward_with_moe_stats, forward_with_rows
from jaxllm.models.kv_cache_spec import init_dp_kv_cache
from jaxllm.models.parallel.attention_dp import forward_attention_dp
from jaxllm.models.parallel.ep_moe import EpMoeOptions
from sharding.rules import param_partition_specs
from sharding.mesh import make_mesh, ParallelConfig
from jaxllm.sampling import SamplerOutput, SamplingTensors, sample
from jaxllm.sampling.sampler import first_argmax
from jaxllm.step_batch import StepBatch

logger = logging.getLogger(__name__)


def _forward_step(params, kv_cache, inputs: tuple, prev_tokens, *, layout: PackedLayout,
                  model_config: ModelConfig, attention_fn: Callable, moe_fn: Callable, mesh: jax.sharding.Mesh,
                  moe_options: Optional[EpMoeOptions] = None, moe_stats: bool = False,
                  attention_dp_specs: Any = None):
    """Model forward of one step: (updated KV cache, float32 logits [S, V] of each sequence,
    with `moe_stats` the step's expert counts int32 [num_moe_layers, num_experts] else None,
    the context logits [E, V] of the packed tokens `context_index` when the inputs carry
    one (the variant for steps where a request asks for its prompt's logits) else None,
    and each row's greedy token int32 [S], the sampler's own argmax, so that a step whose
    rows all decode greedily with no processing needs no sampler program).
    `attention_dp_specs` (the parameters' partition specs) selects the attention-DP forward:
    the batch then has a leading rank axis and the logits are [ranks * S, V]."""
    kv_cache, logits, counts, context = _model_step(
        params, kv_cache, inputs, prev_tokens, layout=layout, model_config=model_config, attention_fn=attention_fn,
        moe_fn=moe_fn, mesh=mesh, moe_options=moe_options, moe_stats=moe_stats, attention_dp_specs=attention_dp_specs)
    return kv_cache, logits, counts, context, first_argmax(logits)


def _model_step(params, kv_cache, inputs: tuple, prev_tokens, *, layout: PackedLayout,
                model_config: ModelConfig, attention_fn: Callable, moe_fn: Callable, mesh: jax.sharding.Mesh,
                moe_options: Optional[EpMoeOptions], moe_stats: bool, attention_dp_specs: Any):
    unpacked = unpack(inputs, layout)
    batch, feed_index = unpacked[0], unpacked[1]
    context_index = unpacked[2] if len(unpacked) > 2 else None
    fed = prev_tokens[jnp.maximum(feed_index, 0)]
    batch = replace(batch, token_ids=jnp.where(feed_index >= 0, fed, batch.token_ids))
    if attention_dp_specs is not None:
        logits, kv_cache, stats = forward_attention_dp(
            params, kv_cache, batch, config=model_config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh,
            param_specs=attention_dp_specs, moe_options=moe_options)
        return kv_cache, logits, stats.expert_counts if moe_stats else None, None
    kwargs = dict(config=model_config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh, moe_options=moe_options)
    if context_index is not None:
        logits, context, kv_cache, stats = forward_with_rows(params, kv_cache, batch, context_index,
                                                             moe_stats=moe_stats, **kwargs)
        return kv_cache, logits.astype(jnp.float32), stats.expert_counts if moe_stats else None, context
    if moe_stats:
        logits, kv_cache, stats = forward_with_moe_stats(params, kv_cache, batch, **kwargs)
        return kv_cache, logits.astype(jnp.float32), stats.expert_counts, None
    logits, kv_cache = forward(params, kv_cache, batch, **kwargs)
    return kv_cache, logits.astype(jnp.float32), None, None


def _gather_rows(logits, rows):
    return logits[rows]


def _scatter_rows(logits, rows, values):
    return logits.at[rows].set(values)


MAX_BLOCK_COPIES = 8
"""Block copies per `copy_blocks` call (one compiled shape): a beam fork copies at most
beam_width - 1 <= 7 blocks."""

_NO_BLOCK = 2**30  # destination of a padding copy: out of range, so the write is dropped


def _copy_pages(kv_cache, src: jax.Array, dst: jax.Array, *, num_blocks: int):
    """Copy KV block `src[i]` to block `dst[i]` in every layer (padding pairs have an
    out-of-range destination and are dropped). Handles per-layer caches and the scanned
    layers' single page pool (layer l owns pages [l * num_blocks, (l + 1) * num_blocks))."""
    def copy(pages: jax.Array, axis: int) -> jax.Array:
        layers = pages.shape[axis] // num_blocks
        offsets = jnp.arange(layers, dtype=jnp.int32)[:, None] * num_blocks
        s, d = (src[None, :] + offsets).ravel(), (dst[None, :] + offsets).ravel()
        index = (slice(None),) * axis
        return pages.at[index + (d,)].set(pages[index + (s,)], mode="drop")

    def layer(cache):
        if isinstance(cache, MhaLayerCache):
            return MhaLayerCache(copy(cache.k, 1), copy(cache.v, 1))
        if isinstance(cache, MlaLayerCache):
            return MlaLayerCache(copy(cache.latent, 0))
        raise TypeError(f"cannot copy KV blocks of a {type(cache).__name__}")

    return [layer(c) for c in kv_cache] if isinstance(kv_cache, list) else layer(kv_cache)


def _sample_step(logits, inputs: tuple, *, layout: PackedLayout) -> SamplerOutput:
    return sample(logits, unpack(inputs, layout))


def default_compile_workers() -> int:
    """Threads that compile programs at once: one per CPU core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def plan_num_kv_blocks(*, model_config: ModelConfig, dtype: Any, tokens_per_block: int,
                       max_tokens: int | None, free_memory_fraction: float,
                       max_batch_size: int, max_seq_len: int, mesh: jax.sharding.Mesh | None = None) -> int:
    """Blocks in the pool: the smaller of `max_tokens` and the memory-fraction budget.

    On accelerators the budget is `fraction` of the device memory still free after the
    weights are loaded, on the device of the mesh with the least free memory (every
    device holds its share of every block, so the tightest one decides). Hosts report no
    such figure, so there the pool holds every sequence at full length, capped by a share
    of the host's available memory.
    """
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
    bytes_per_block = kv_cache_bytes_per_token(model_config, dtype, mesh) * tokens_per_block
    limits = []
    if max_tokens is not None:
        limits.append(math.ceil(max_tokens / tokens_per_block))
    # This process's devices (another host's cannot be asked; `multihost.agree_min` then takes
    # the smallest pool any host can hold).
    stats = [d.memory_stats() or {} for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if all("bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        limits.append(int(free * free_memory_fraction) // bytes_per_block)
    else:
        limits.append(math.ceil(max_batch_size * max_seq_len / tokens_per_block))
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            limits.append(int(available * free_memory_fraction * 0.5) // bytes_per_block)
        except (ValueError, OSError):
            pass
    num_blocks = min(limits)
    if num_blocks < 1:
        raise ValueError("the KV cache budget does not hold a single block; raise "
                         "kv_cache_config.max_tokens or free_gpu_memory_fraction")
    return num_blocks


class ModelRunner:
    """Owns the parameters and the KV cache and runs steps; never reads anything back."""

    def __init__(self, *, model_config: ModelConfig, params: Any, num_blocks: int,
                 tokens_per_block: int, kv_dtype: Any, attention_fn: Callable, moe_fn: Callable,
                 max_batch_size: int, mesh: jax.sharding.Mesh | None = None,
                 moe_options: Optional[EpMoeOptions] = None, moe_stats: bool = False,
                 attention_dp: bool = False,
                 batched_processors: Optional[dict[str, BatchedProcessor]] = None,
                 compile_workers: Optional[int] = None,
                 executable_store: Optional[ExecutableStore] = None) -> None:
        """`attention_dp`: every device of the mesh is an attention-DP rank with its own pool of
        `num_blocks` KV blocks, and `max_batch_size` counts the sampler rows of all ranks.
        `batched_processors`: device-side logits post-processors by name
        (`jaxllm.engine.logits_processing`). `compile_workers`: threads compiling programs in
        the background (default: one per CPU core, at most 8). `executable_store`: where the
        model forwards and samplers are loaded from instead of traced and compiled, and saved to
        once compiled (`jaxllm.engine.executable_store`)."""
        self.model_config = model_config
        self.params = params
        self.max_batch_size = max_batch_size
        self.attention_fn, self.moe_fn = attention_fn, moe_fn
        self.mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
        # Host inputs go to every device of the mesh (replicated).
        self._replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        # One device: host buffers go straight into the compiled calls (see `execute`).
        self._single_device = jax.process_count() == 1 and self.mesh.devices.size == 1
        if attention_dp:
            self.kv_cache = init_dp_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, self.mesh)
        else:
            self.kv_cache = init_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, mesh=self.mesh)
        forward_step = functools.partial(
            _forward_step, model_config=model_config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=self.mesh,
            moe_options=moe_options, moe_stats=moe_stats,
            attention_dp_specs=param_partition_specs(params) if attention_dp else None)
        self._forward_jit = jax.jit(forward_step, static_argnames=("layout",), donate_argnums=(1,))
        self._sample_jit = jax.jit(_sample_step, static_argnames=("layout",))
        # Stored programs: the key text of each program's function and static arguments (the
        # layout and argument shapes are added per program); a program without one is not stored.
        self._store = executable_store
        self._store_keys: dict[str, str] = {}
        if executable_store is not None:
            for kind, fn, options in (("forward", forward_step, "static_argnames=layout donate_argnums=1"),
                                      ("sampler", _sample_step, "static_argnames=layout")):
                key = executable_store.entry_key(kind, fn, options)
                if key is not None:
                    self._store_keys[kind] = key
        self.programs_loaded = 0  # programs loaded from the executable store (not traced or compiled)
        self._copy_jit = jax.jit(functools.partial(_copy_pages, num_blocks=num_blocks), donate_argnums=(0,))
        # Programs of steps where some row asks for logits or has a post-processor: row
        # gathers and scatters (one per row bucket) and the batched processors (one each).
        self._gather_jit = jax.jit(_gather_rows)
        self._scatter_jit = jax.jit(_scatter_rows)
        # Host logits processors run on this thread, off the step's critical path.
        self._processor_pool: Optional[ThreadPoolExecutor] = None
        self.last_processed: Optional[Future] = None
        self._batched_jits = {name: jax.jit(functools.partial(apply_batched, fn=fn))
                              for name, fn in (batched_processors or {}).items()}
        self._logits_exes: dict[tuple, Any] = {}
        # Context logits [E, V] and gathered raw logits rows [R, V] of the last executed step
        # (device arrays; None when that step had none).
        self.last_context_logits: jax.Array | None = None
        self.last_row_logits: jax.Array | None = None
        self._forward_exes: dict[PackedLayout, Any] = {}
        self._sampler_exes: dict[PackedLayout, Any] = {}
        # Compiles under way, by program: a second request for one waits for it (nothing compiles twice).
        self._compiling: dict[tuple[str, PackedLayout], Future] = {}
        self._compile_pool: Optional[ThreadPoolExecutor] = None
        self._closed = False  # no more background compiles (a step may still compile its own)
        self._queued: dict[tuple[str, PackedLayout], Future] = {}  # the compile threads' tasks
        self.compile_workers = compile_workers or default_compile_workers()
        self.compile_seconds = 0.0  # summed over programs (several compile at once), loads included
        self.compile_wait_seconds = 0.0  # time steps spent waiting for a program to compile
        self._compile_lock = threading.Lock()
        self.steps_per_bucket: collections.Counter = collections.Counter()
        self._zero_tokens = put_on_mesh(np.zeros((max_batch_size,), np.int32), self._replicated)
        self._last_tokens: jax.Array | None = None  # sampled tokens of the last executed step
        self._last_greedy: jax.Array | None = None  # greedy tokens of the last forward (see `_forward_step`)
        # Expert counts [num_moe_layers, num_experts] of the last executed step (device array;
        # None unless the runner was built with moe_stats=True).
        self.last_expert_counts: jax.Array | None = None
        self.last_enqueue_time = 0.0  # time.perf_counter() when the last forward was handed to the runtime
        # The layout of plans built already packed (`StepPlan.packed_forward`), per batch shape.
        self._packed_layouts: dict[tuple, PackedLayout] = {}
        # Sampling tensors of a steady batch repeat every array but `step` (SamplingSlots.gather).
        self._sampling_packer = RepeatPacker()

    @property
    def num_forward_variants(self) -> int:
        """Compiled model forwards (one per token bucket seen)."""
        return len(self._forward_exes)

    @property
    def num_sampler_variants(self) -> int:
        """Compiled samplers (one per combination of the sampler's static switches seen)."""
        return len(self._sampler_exes)

    @property
    def num_compiled_variants(self) -> int:
        return len(self._forward_exes) + len(self._sampler_exes)

    def _abstract(self, args: tuple) -> tuple:
        """`args` as shapes, dtypes and shardings only: a program is lowered from these, never
        from live buffers (the KV cache and LoRA slots are donated by the steps meanwhile).
        Host buffers are lowered as what they become on the mesh: replicated device arrays."""
        def spec(leaf: Any) -> Any:
            if isinstance(leaf, np.ndarray):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._replicated)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)

        return jax.tree_util.tree_map(spec, args)

    def _claim(self, kind: str, layout: PackedLayout) -> tuple[Future, bool]:
        """The compile of program `kind` ("forward" or "sampler") for `layout`: (its future, True
        when the caller must run it). A compiled program gives a done future, one under way its
        own future; nothing compiles twice."""
        cache = self._forward_exes if kind == "forward" else self._sampler_exes
        with self._compile_lock:
            future = self._compiling.get((kind, layout))
            if future is not None:
                return future, False
            future = Future()
            exe = cache.get(layout)
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

    def _run_compile(self, kind: str, abstract_args: tuple, layout: PackedLayout, future: Future) -> None:
        """Compile one program (or load it from the executable store, which skips tracing and
        lowering too) and hand it to `future`; a compiled program is stored afterwards."""
        jitted, cache = ((self._forward_jit, self._forward_exes) if kind == "forward"
                         else (self._sample_jit, self._sampler_exes))
        start = time.perf_counter()
        entry = None
        try:
            key = self._store_key(kind, abstract_args, layout)
            exe = self._store.load(key) if key is not None else None
            loaded = exe is not None
            if exe is None:
                exe, compiled_here = compile_here(jitted.lower(*abstract_args, layout=layout))
                if key is not None and not compiled_here:  # from one of JAX's caches: not storable
                    self._store.count_from_jax_cache()
                elif key is not None:  # serialized before anything runs it (XLA:CPU cannot after)
                    entry = self._store.serialize(key, exe)
        except BaseException as exc:
            with self._compile_lock:
                self._compiling.pop((kind, layout), None)
                self._queued.pop((kind, layout), None)
            future.set_exception(exc)
            return
        elapsed = time.perf_counter() - start
        logger.debug("%s a %s variant in %.2fs", "loaded" if loaded else "compiled", kind, elapsed)
        with self._compile_lock:
            self.compile_seconds += elapsed
            self.programs_loaded += loaded
            cache[layout] = exe
            self._compiling.pop((kind, layout), None)
            self._queued.pop((kind, layout), None)
        future.set_result(exe)
        if entry is not None:
            self._store.write(key, entry)

    def _start_compile(self, kind: str, args: tuple, layout: PackedLayout) -> Future:
        """Compile on the compile threads (see `_claim`); returns the compile's future."""
        future, mine = self._claim(kind, layout)
        if mine:
            with self._compile_lock:
                if self._closed:
                    self._compiling.pop((kind, layout), None)
                    future.set_exception(RuntimeError("the model runner is closed"))
                    return future
                if self._compile_pool is None:
                    self._compile_pool = ThreadPoolExecutor(self.compile_workers,
                                                            thread_name_prefix="jaxllm-compile")
                pool = self._compile_pool
            self._queued[(kind, layout)] = pool.submit(self._run_compile, kind, self._abstract(args), layout, future)
        return future

    def _compile(self, kind: str, args: tuple, layout: PackedLayout) -> Any:
        """The executable for `layout`. A program not compiled yet is compiled in this thread
        (never queued behind background compiles); one under way elsewhere is waited for."""
        cache = self._forward_exes if kind == "forward" else self._sampler_exes
        exe = cache.get(layout)
        if exe is not None:
            return exe
        start = time.perf_counter()
        future, mine = self._claim(kind, layout)
        if not mine:  # queued on the compile threads but not started: compile it here, now
            with self._compile_lock:
                task = self._queued.pop((kind, layout), None)
            mine = task is not None and task.cancel()
        if mine:
            self._run_compile(kind, self._abstract(args), layout, future)
        exe = future.result()
        with self._compile_lock:
            self.compile_wait_seconds += time.perf_counter() - start
        return exe

    @property
    def compiles_in_flight(self) -> int:
        """Programs being compiled (or queued for it) on the compile threads."""
        with self._compile_lock:
            return len(self._compiling)

    def close(self) -> None:
        """Stop the compile threads: queued compiles are dropped, one under way finishes."""
        if self._processor_pool is not None:
            self._processor_pool.shutdown(wait=True)
            self._processor_pool = None
        with self._compile_lock:
            self._closed = True
            pool, self._compile_pool = self._compile_pool, None
            queued, self._queued = self._queued, {}
        for key, task in queued.items():
            if task.cancel():
                with self._compile_lock:
                    future = self._compiling.pop(key, None)
                if future is not None:
                    future.set_exception(RuntimeError("the model runner was closed before this program compiled"))
        if pool is not None:
            pool.shutdown(wait=True)

    def _to_device(self, tree: Any) -> tuple[tuple[jax.Array, ...], PackedLayout]:
        """Host inputs packed into one flat buffer per dtype, replicated over the mesh."""
        buffers, layout = pack(tree)
        return tuple(put_on_mesh(buffers, self._replicated)), layout

    def compile_forward(self, batch: StepBatch, feed_index: np.ndarray, context_index: Optional[np.ndarray] = None,
                        *, wait: bool = True) -> Optional[Future]:
        """Compile, without running, the model forward of `batch`'s shape (with `context_index`:
        its variant returning those tokens' logits too), on the compile threads (XLA compiles
        without holding the GIL, so several compile at once). `wait=False`: return the
        compile's future at once (the step that needs it waits for it, and nothing compiles
        twice)."""
        tree = (batch, feed_index) if context_index is None else (batch, feed_index, context_index)
        inputs, layout = pack(tree)
        future = self._start_compile("forward", (self.params, self.kv_cache, inputs, self._zero_tokens), layout)
        if not wait:
            return future
        future.result()
        return None

    def compile_sampler(self, logits: Any, sampling: SamplingTensors, *, wait: bool = True) -> Optional[Future]:
        """Compile, without running, the sampler of `sampling`'s static switches over `logits`
        (an array or a `jax.ShapeDtypeStruct` with its sharding); `wait` as in `compile_forward`."""
        inputs, layout = pack(sampling)
        future = self._start_compile("sampler", (logits, inputs), layout)
        if not wait:
            return future
        future.result()
        return None

    def _logits_program(self, key: tuple, jitted, args: tuple):
        """A small program over a step's logits, compiled once per key (name and shapes)."""
        if not self._single_device:
            args = tuple(put_on_mesh(a, self._replicated) if isinstance(a, np.ndarray) else a for a in args)
        exe = self._logits_exes.get(key)
        if exe is None:
            start = time.perf_counter()
            exe = jitted.lower(*args).compile()
            with self._compile_lock:
                self.compile_seconds += time.perf_counter() - start
                exe = self._logits_exes.setdefault(key, exe)
        return exe(*args)

    def compile_logits_programs(self, logits: jax.Array, row_buckets: list[int]) -> None:
        """Compile (and run on `logits`, harmlessly) the row gather and scatter of every row bucket."""
        vocab = logits.shape[1]
        for size in row_buckets:
            rows = np.zeros(size, np.int32)
            self._logits_program(("gather", size), self._gather_jit, (logits, rows))
            self._logits_program(("scatter", size), self._scatter_jit,
                                 (logits, rows, np.zeros((size, vocab), np.float32)))

    def compile_batched_processors(self, logits: jax.Array) -> None:
        """Compile every registered batched post-processor (warm-up)."""
        S = logits.shape[0]
        for name in self._batched_jits:
            self._apply_batched(logits, name, np.zeros(S, np.int32), np.zeros(S, np.bool_))

    def _apply_batched(self, logits: jax.Array, name: str, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
        return self._logits_program(("batched", name), self._batched_jits[name], (logits, ids, mask))

    def _post_process(self, logits: jax.Array, plan: StepPlan) -> jax.Array:
        """Gather the raw rows asked for, then run the batched post-processors (see
        `jaxllm.engine.logits_processing`); returns the logits the sampler reads."""
        rows = plan.logits_rows
        if rows is not None:
            self.last_row_logits = self._logits_program(("gather", rows.shape[0]), self._gather_jit, (logits, rows))
        for name, ids, mask in plan.batched_processors:
            logits = self._apply_batched(logits, name, ids, mask)
        return logits

    def _resample_processed(self, logits: jax.Array, rows: np.ndarray,
                            host_processor: Callable[[np.ndarray], np.ndarray],
                            sampling: tuple, layout: PackedLayout) -> SamplerOutput:
        """On the processors' thread: the step's rows `rows` through the host processors, then
        the step's sampler again over the rewritten logits (same program, settings and keys)."""
        gathered = self._logits_program(("gather", rows.shape[0]), self._gather_jit, (logits, rows))
        processed = np.ascontiguousarray(host_processor(np.array(gathered)), np.float32)
        rewritten = self._logits_program(("scatter", rows.shape[0]), self._scatter_jit, (logits, rows, processed))
        out = self._sample(rewritten, sampling, layout)
        jax.block_until_ready(out.token_ids)
        return out

    def execute(self, plan: StepPlan,
                host_processor: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> SamplerOutput:
        """Dispatch one planned step (forward, then sampling); returns the sampler output as
        device arrays without waiting for them. Tokens the plan feeds from the previous step
        (`plan.feed_index`) come from the last step this runner executed. The host inputs of
        each program are one flat buffer, handed to the compiled program as a numpy array: its
        C++ call path moves it to the mesh far cheaper than a `jax.device_put` from Python
        (pack allocates a new buffer per call, so the runtime may read it asynchronously).
        On a mesh of several devices the buffers are put on the mesh first (`put_on_mesh`).
        A plan whose rows ask for logits or post-processing runs the extra programs of
        `jaxllm.engine.logits_outputs`; with `host_processor(rows) -> rows` for
        `plan.processor_rows`, `last_processed` is then the future of those rows' sampler
        output, computed on a worker thread (`jaxllm.engine.logits_processing`). A plain plan
        runs exactly the two programs, a greedy-only one the forward alone."""
        if plan.packed_forward is not None and plan.context_index is None:
            batch_buffers, batch_layout = (plan.packed_forward,), self._packed_layout(plan)
        elif plan.context_index is None:
            batch_buffers, batch_layout = pack((plan.batch, plan.feed_index))
        else:  # another layout: the forward variant that also returns these tokens' logits
            batch_buffers, batch_layout = pack((plan.batch, plan.feed_index, plan.context_index))
        # Every row decodes greedily with no processing: the forward's argmax is the token.
        greedy = plan.greedy_only and not plan.has_logits_work
        sampling_buffers, sampling_layout = (None, None) if greedy else self._sampling_packer.pack(plan.sampling)
        if not self._single_device:
            batch_buffers, sampling_buffers = put_on_mesh((batch_buffers, sampling_buffers), self._replicated)
        logits = self._forward(batch_buffers, batch_layout, self._last_tokens)
        self.steps_per_bucket[plan.batch.token_ids.shape[-1]] += 1  # per rank under attention DP
        self.last_row_logits = None
        if greedy:
            self.last_processed = None
            out = SamplerOutput(token_ids=self._last_greedy, logprobs=None, top_ids=None, top_logprobs=None)
            self._last_tokens = out.token_ids
            return out
        if plan.has_logits_work:
            logits = self._post_process(logits, plan)
        out = self._sample(logits, sampling_buffers, sampling_layout)
        self._last_tokens = out.token_ids
        self.last_processed = None
        if plan.processor_rows is not None and host_processor is not None:
            if self._processor_pool is None:
                self._processor_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-logits-processors")
            self.last_processed = self._processor_pool.submit(
                self._resample_processed, logits, plan.processor_rows, host_processor, sampling_buffers,
                sampling_layout)
        return out

    def _packed_layout(self, plan: StepPlan) -> PackedLayout:
        """The layout of `plan.packed_forward`: `pack`'s for the batch's shapes, found with
        `pack` once per shape (which also checks that the buffer is what `pack` builds)."""
        batch = plan.batch
        key = (batch.token_ids.shape, batch.block_tables.shape, batch.logits_indices.shape)
        layout = self._packed_layouts.get(key)
        if layout is None:
            (buffer,), layout = pack((batch, plan.feed_index))
            if not np.array_equal(buffer, plan.packed_forward):
                raise RuntimeError("a plan's packed forward inputs differ from its batch and feed index")
            self._packed_layouts[key] = layout
        return layout

    def write_lora_slot(self, slot: int, update: Any) -> None:
        """Replace LoRA slot `slot` of `params["lora"]` by `update` (host arrays of one slot; see
        `jaxllm.lora.weights`), in place: the old buffers are donated, nothing recompiles."""
        self.params["lora"] = write_slot(self.params["lora"], slot, update)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in place, before the next step reads
        them (a beam fork's copy on write). One compiled shape: pairs are padded to
        `MAX_BLOCK_COPIES` (more are copied in several calls)."""
        for start in range(0, max(len(pairs), 1), MAX_BLOCK_COPIES):
            chunk = pairs[start:start + MAX_BLOCK_COPIES]
            src = np.zeros(MAX_BLOCK_COPIES, np.int32)
            dst = np.full(MAX_BLOCK_COPIES, _NO_BLOCK, np.int32)
            if chunk:
                src[:len(chunk)], dst[:len(chunk)] = zip(*chunk)
            src, dst = put_on_mesh((src, dst), self._replicated)
            self.kv_cache = self._copy_jit(self.kv_cache, src, dst)

    def _forward(self, inputs: tuple, layout: PackedLayout, prev_tokens: jax.Array | None) -> jax.Array:
        prev = self._zero_tokens if prev_tokens is None else prev_tokens
        # Lowered against the zero tokens, as `compile_forward` does: one program per layout.
        exe = self._compile("forward", (self.params, self.kv_cache, inputs, self._zero_tokens), layout)
        args = (self.params, self.kv_cache, inputs, prev)
        self.last_enqueue_time = time.perf_counter()
        self.kv_cache, logits, self.last_expert_counts, self.last_context_logits, self._last_greedy = exe(*args)
        return logits

    def _sample(self, logits: jax.Array, inputs: tuple, layout: PackedLayout) -> SamplerOutput:
        args = (logits, inputs)
        return self._compile("sampler", args, layout)(*args)

    def forward(self, batch: StepBatch, feed_index: np.ndarray, prev_tokens: jax.Array | None) -> jax.Array:
        """Only the model forward: float32 logits [max_batch_size, vocab] on the device."""
        inputs, layout = self._to_device((batch, feed_index))
        return self._forward(inputs, layout, prev_tokens)

    def sample(self, logits: jax.Array, sampling: SamplingTensors) -> SamplerOutput:
        """Only the sampler, over logits [max_batch_size, vocab]."""
        inputs, layout = self._to_device(sampling)
        return self._sample(logits, inputs, layout)
