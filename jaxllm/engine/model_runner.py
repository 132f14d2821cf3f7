"""Device side of the engine: parameters, the paged KV cache and the two compiled programs.

A step runs two executables, dispatched back to back without a host sync:
  * the model forward over a packed `StepBatch`, compiled once per token bucket; it
    returns the float32 logits of each sequence's last token [max_batch_size, vocab] and
    each one's greedy token, and updates the donated KV cache in place;
  * the sampler over those logits, compiled once per sampler variant (the static switches
    of `SamplingTensors`). It holds no model, so its variants compile in a fraction of the
    forward's time and warm-up can compile all of them. A step whose rows all decode
    greedily with no processing (`StepPlan.greedy_only`) skips it: the forward's greedy
    tokens are its tokens, and where it can (one device, no attention DP, no hidden-state
    outputs, no context logits) it runs the forward's fused variant, which takes each row's
    argmax inside the LM head and writes no float32 logits at all
    (`jaxllm.models.lm_head_argmax`, `EngineConfig.fused_lm_head_argmax`). That variant
    compiles beside the full one; a greedy step whose fused variant is not compiled runs the
    full forward (its argmax output is the same token) while the fused one compiles in idle time.
Their executables live in a `ProgramCache` (`jaxllm.engine.program_cache`: compile threads,
and the executable store that loads them without tracing when an earlier process stored them).
`execute` returns what a step produced as a `StepOutput` (`jaxllm.engine.step_output`); the
runner keeps nothing of a step but the sampled tokens the next step may feed from.
Under the overlap scheduler a generation token may not be known on the host yet:
`feed_index[t] >= 0` tells the forward to take token `t` from row `feed_index[t]` of the
previous step's sampled tokens, which never leave the device.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.executable_store import ExecutableStore
from jaxllm.engine.forward_step import model_forward_step, pad_rows
from jaxllm.engine.host_transfer import PackedLayout, RepeatPacker, pack, put_on_mesh, unpack
from jaxllm.engine.logits_processing import BatchedProcessor, apply_batched
from jaxllm.engine.planner import StepPlan
from jaxllm.engine.program_cache import ProgramCache
from jaxllm.engine.step_output import StepOutput
from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.lora.weights import write_slot
from jaxllm.models import ModelConfig, init_kv_cache
from jaxllm.models.attention_work import AttentionWorkTiers
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.kv_cache_spec import KVCache, init_dp_kv_cache
from jaxllm.sampling import SamplerOutput, SamplingTensors, sample
from jaxllm.step_batch import StepBatch
from sharding.mesh import ParallelConfig, make_mesh
from sharding.rules import param_partition_specs

logger = logging.getLogger(__name__)


def _gather_rows(logits, rows):
    return logits[rows]


def _first_rows(logits, *, rows: int):
    return logits[:rows]


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


def _sample_step(logits, inputs: tuple, *, layout: PackedLayout, fed_rows: int = 0) -> SamplerOutput:
    out = sample(logits, unpack(inputs, layout))
    return replace(out, token_ids=pad_rows(out.token_ids, fed_rows))


class ModelRunner:
    """Owns the parameters and the KV cache and runs steps; never reads anything back."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Any,
        num_blocks: int,
        tokens_per_block: int,
        kv_dtype: Any,
        attention_fn: Callable,
        moe_fn: Callable,
        max_batch_size: int,
        mesh: jax.sharding.Mesh | None = None,
        moe_options: Optional[EpMoeOptions] = None,
        moe_stats: bool = False,
        attention_dp: bool = False,
        batched_processors: Optional[dict[str, BatchedProcessor]] = None,
        compile_workers: Optional[int] = None,
        executable_store: Optional[ExecutableStore] = None,
        return_hidden: bool = False,
        hidden_aux_layers: tuple[int, ...] = (),
        fused_argmax: bool = False,
        attention_work: Optional[AttentionWorkTiers] = None,
    ) -> None:
        """`attention_dp`: every device of the mesh is an attention-DP rank with its own pool of
        `num_blocks` KV blocks, and `max_batch_size` counts the sampler rows of all ranks.
        `batched_processors`: device-side logits post-processors by name
        (`jaxllm.engine.logits_processing`). `compile_workers`: threads compiling programs in
        the background (default: one per CPU core, at most 8). `executable_store`: where the
        model forwards and samplers are loaded from instead of traced and compiled, and saved to
        once compiled (`jaxllm.engine.executable_store`). `return_hidden`: every forward also
        returns its packed tokens' final hidden states (`last_hidden`, for MTP drafting), or with
        `hidden_aux_layers` the residuals entering those layers, flattened (EAGLE-3's features).
        `fused_argmax`: greedy-only steps run the forward variant with the LM head's fused argmax
        (`fused_argmax` is then True only on one device of one process, without attention DP or
        `return_hidden`: elsewhere every step keeps the full-logits forward). `attention_work`: the
        `xla` attention backend's ladder of static work bounds (`jaxllm.models.attention_work`):
        a step runs the forward compiled for the smallest rung holding its work, once compiled."""
        self.model_config = model_config
        self.params = params
        self.attention_dp = attention_dp
        self.max_batch_size = max_batch_size
        self.attention_fn, self.moe_fn, self.moe_options = attention_fn, moe_fn, moe_options
        self.mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
        self.attention_work = attention_work
        # (layout, rung) -> the layout of that rung's program; the rungs whose compile started.
        self._bounded_layouts: dict[tuple[PackedLayout, int], PackedLayout] = {}
        self.bounded_steps = 0  # steps that ran a forward compiled for a smaller work bound
        self.fused_argmax = (
            fused_argmax
            and not attention_dp
            and not return_hidden
            and self.mesh.devices.size == 1
            and jax.process_count() == 1
        )
        # Host inputs go to every device of the mesh (replicated).
        self._replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        # One device: host buffers go straight into the compiled calls (see `execute`).
        self._single_device = jax.process_count() == 1 and self.mesh.devices.size == 1
        if attention_dp:
            self.kv_cache: KVCache = init_dp_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, self.mesh)
        else:
            self.kv_cache = init_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, mesh=self.mesh)
        forward_step = functools.partial(
            model_forward_step,
            model_config=model_config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=self.mesh,
            moe_options=moe_options,
            moe_stats=moe_stats,
            attention_dp_specs=param_partition_specs(params) if attention_dp else None,
            fed_rows=max_batch_size,
            return_hidden=return_hidden,
            aux_layers=tuple(hidden_aux_layers),
        )
        greedy_step = functools.partial(forward_step, fused_argmax=True)
        # The hidden states [T, H] of the last forward (with `return_hidden`), else None.
        self.last_hidden: jax.Array | None = None
        sample_step = functools.partial(_sample_step, fed_rows=max_batch_size)
        # Stored programs: the key text of each program's function and static arguments (the
        # layout and argument shapes are added per program); a program without one is not stored.
        store_keys = {}
        if executable_store is not None:
            for kind, fn, options in (
                ("forward", forward_step, "static_argnames=layout donate_argnums=1"),
                ("greedy_forward", greedy_step, "static_argnames=layout donate_argnums=1"),
                ("sampler", sample_step, "static_argnames=layout"),
            ):
                key = executable_store.entry_key(kind, fn, options)
                if key is not None:
                    store_keys[kind] = key
        self.programs = ProgramCache(
            {
                "forward": jax.jit(forward_step, static_argnames=("layout",), donate_argnums=(1,)),
                "greedy_forward": jax.jit(greedy_step, static_argnames=("layout",), donate_argnums=(1,)),
                "sampler": jax.jit(sample_step, static_argnames=("layout",)),
            },
            replicated=self._replicated,
            compile_workers=compile_workers,
            store=executable_store,
            store_keys=store_keys,
        )
        self._copy_jit = jax.jit(functools.partial(_copy_pages, num_blocks=num_blocks), donate_argnums=(0,))
        self.blocks_copied = 0  # KV blocks copied by `copy_blocks` (beam forks)
        # Programs of steps where some row asks for logits or has a post-processor: row
        # gathers and scatters (one per row bucket) and the batched processors (one each).
        self._gather_jit = jax.jit(_gather_rows)
        self._scatter_jit = jax.jit(_scatter_rows)
        # Host logits processors run on this thread, off the step's critical path.
        self._processor_pool: Optional[ThreadPoolExecutor] = None
        self._batched_jits = {
            name: jax.jit(functools.partial(apply_batched, fn=fn)) for name, fn in (batched_processors or {}).items()
        }
        self._logits_exes: dict[tuple, Any] = {}
        self._first_rows_jits: dict[int, Any] = {}
        self.steps_per_bucket: collections.Counter = collections.Counter()
        self.sampler_runs = 0  # sampler programs run (a greedy-only step runs none)
        self.fused_steps = 0  # steps that ran the fused-argmax forward (no float32 logits)
        # Steps' sampler runs by their row count (a token bucket's samples its live rows).
        self.sampler_runs_per_rows: collections.Counter = collections.Counter()
        self._zero_tokens = put_on_mesh(np.zeros((max_batch_size,), np.int32), self._replicated)
        # Sampled tokens of the step executed before: a plan's `feed_index` reads from them.
        self._fed_tokens: jax.Array | None = None
        # The layout of plans built already packed (`StepPlan.packed_forward`), per batch shape.
        self._packed_layouts: dict[tuple, PackedLayout] = {}
        # Sampling tensors of a steady batch repeat every array but `step` (SamplingSlots.gather).
        self._sampling_packer = RepeatPacker()

    @property
    def num_forward_variants(self) -> int:
        """Compiled model forwards (one per token bucket seen, and its fused-argmax variant)."""
        return self.programs.num_variants("forward") + self.programs.num_variants("greedy_forward")

    @property
    def num_sampler_variants(self) -> int:
        """Compiled samplers (one per combination of the sampler's static switches seen)."""
        return self.programs.num_variants("sampler")

    @property
    def num_compiled_variants(self) -> int:
        return self.num_forward_variants + self.num_sampler_variants

    @property
    def num_logits_programs(self) -> int:
        """Compiled row gathers, scatters and batched processors (steps with logits work)."""
        return len(self._logits_exes)

    @property
    def num_copy_programs(self) -> int:
        """Compiled shapes of the KV block copy (one: pairs are padded to `MAX_BLOCK_COPIES`)."""
        return self._copy_jit._cache_size()  # type: ignore[attr-defined]  # jit's cache size: not in jax's typing

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    @property
    def compile_wait_seconds(self) -> float:
        return self.programs.compile_wait_seconds

    @property
    def compile_workers(self) -> int:
        return self.programs.compile_workers

    @property
    def programs_loaded(self) -> int:
        return self.programs.programs_loaded

    @property
    def compiles_in_flight(self) -> int:
        """Programs being compiled (or queued for it) on the compile threads."""
        return self.programs.compiles_in_flight

    def close(self) -> None:
        """Stop the compile threads: queued compiles are dropped, one under way finishes."""
        if self._processor_pool is not None:
            self._processor_pool.shutdown(wait=True)
            self._processor_pool = None
        self.programs.close()

    def _to_device(self, tree: Any) -> tuple[tuple[jax.Array, ...], PackedLayout]:
        """Host inputs packed into one flat buffer per dtype, replicated over the mesh."""
        buffers, layout = pack(tree)
        return tuple(put_on_mesh(buffers, self._replicated)), layout

    def compile_forward(
        self,
        batch: StepBatch,
        feed_index: np.ndarray,
        context_index: Optional[np.ndarray] = None,
        *,
        wait: bool = True,
        background: bool = False,
        idle: bool = False,
        greedy: bool = False,
    ) -> Optional[Future]:
        """Compile, without running, the model forward of `batch`'s shape (with `context_index`:
        its variant returning those tokens' logits too; with `greedy`: its fused-argmax variant,
        which needs `fused_argmax`), on the compile threads (XLA compiles
        without holding the GIL, so several compile at once). `wait=False`: return the
        compile's future at once (the step that needs it waits for it, and nothing compiles
        twice). `background`, `idle`: see `ProgramCache.start`."""
        if greedy and (not self.fused_argmax or context_index is not None):
            raise ValueError("the fused-argmax forward needs fused_argmax on and no context_index")
        tree = (batch, feed_index) if context_index is None else (batch, feed_index, context_index)
        inputs, layout = pack(tree)
        args = (self.params, self.kv_cache, inputs, self._zero_tokens)
        kind = "greedy_forward" if greedy else "forward"
        future = self.programs.start(kind, args, layout, background=background, idle=idle)
        if not wait:
            return future
        future.result()
        return None

    def compile_sampler(
        self, logits: Any, sampling: SamplingTensors, *, wait: bool = True, background: bool = False, idle: bool = False
    ) -> Optional[Future]:
        """Compile, without running, the sampler of `sampling`'s static switches over `logits`
        (an array or a `jax.ShapeDtypeStruct` with its sharding); the rest as in `compile_forward`."""
        inputs, layout = pack(sampling)
        future = self.programs.start("sampler", (logits, inputs), layout, background=background, idle=idle)
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
            self.programs.add_compile_seconds(time.perf_counter() - start)
            exe = self._logits_exes.setdefault(key, exe)
        return exe(*args)

    def compile_logits_programs(self, logits: jax.Array, row_buckets: list[int]) -> None:
        """Compile (and run on `logits`, harmlessly) the row gather and scatter of every row bucket."""
        vocab = logits.shape[1]
        for size in row_buckets:
            rows = np.zeros(size, np.int32)
            self._logits_program(("gather", size), self._gather_jit, (logits, rows))
            self._logits_program(
                ("scatter", size), self._scatter_jit, (logits, rows, np.zeros((size, vocab), np.float32))
            )

    def _first_rows(self, logits: jax.Array, rows: int) -> jax.Array:
        jitted = self._first_rows_jits.get(rows)
        if jitted is None:
            jitted = self._first_rows_jits[rows] = jax.jit(functools.partial(_first_rows, rows=rows))
        return self._logits_program(("first_rows", rows), jitted, (logits,))

    def compile_row_slices(self, logits: jax.Array, sizes: list[int]) -> None:
        """Compile (and run on `logits`) the slice of the first rows of a token bucket's logits
        for each of `sizes` (`Planner.sampler_rows`)."""
        for rows in sizes:
            if rows < logits.shape[0]:
                self._first_rows(logits, rows)

    def compile_batched_processors(self, logits: jax.Array) -> None:
        """Compile every registered batched post-processor (warm-up)."""
        S = logits.shape[0]
        for name in self._batched_jits:
            self._apply_batched(logits, name, np.zeros(S, np.int32), np.zeros(S, np.bool_))

    def _apply_batched(self, logits: jax.Array, name: str, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
        return self._logits_program(("batched", name), self._batched_jits[name], (logits, ids, mask))

    def _post_process(self, logits: jax.Array, plan: StepPlan) -> tuple[jax.Array, Optional[jax.Array]]:
        """Gather the raw rows asked for, then run the batched post-processors (see
        `jaxllm.engine.logits_processing`); returns (the logits the sampler reads, the raw rows
        or None)."""
        rows, row_logits = plan.logits_rows, None
        if rows is not None:
            row_logits = self._logits_program(("gather", rows.shape[0]), self._gather_jit, (logits, rows))
        for name, ids, mask in plan.batched_processors:
            logits = self._apply_batched(logits, name, ids, mask)
        return logits, row_logits

    def _resample_processed(
        self,
        logits: jax.Array,
        rows: np.ndarray,
        host_processor: Callable[[np.ndarray], np.ndarray],
        sampling: tuple,
        layout: PackedLayout,
    ) -> SamplerOutput:
        """On the processors' thread: the step's rows `rows` through the host processors, then
        the step's sampler again over the rewritten logits (same program, settings and keys)."""
        gathered = self._logits_program(("gather", rows.shape[0]), self._gather_jit, (logits, rows))
        processed = np.ascontiguousarray(host_processor(np.array(gathered)), np.float32)
        rewritten = self._logits_program(("scatter", rows.shape[0]), self._scatter_jit, (logits, rows, processed))
        out = self._sample(rewritten, sampling, layout)
        jax.block_until_ready(out.token_ids)
        return out

    def execute(
        self, plan: StepPlan, host_processor: Optional[Callable[[np.ndarray], np.ndarray]] = None
    ) -> StepOutput:
        """Dispatch one planned step (forward, then sampling); returns its `StepOutput`, device
        arrays not waited for. Tokens the plan feeds from the previous step
        (`plan.feed_index`) come from the last step this runner executed. The host inputs of
        each program are one flat buffer, handed to the compiled program as a numpy array: its
        C++ call path moves it to the mesh far cheaper than a `jax.device_put` from Python
        (pack allocates a new buffer per call, so the runtime may read it asynchronously).
        On a mesh of several devices the buffers are put on the mesh first (`put_on_mesh`).
        A plan whose rows ask for logits or post-processing runs the extra programs of
        `jaxllm.engine.logits_outputs`; with `host_processor(rows) -> rows` for
        `plan.processor_rows`, `StepOutput.processed` is the future of those rows' sampler
        output, computed on a worker thread (`jaxllm.engine.logits_processing`). A plain plan
        runs exactly the two programs, a greedy-only one the forward alone."""
        batch_buffers: tuple[np.ndarray | jax.Array, ...]  # host buffers, then on the mesh with several devices
        if plan.packed_forward is not None and plan.context_index is None:
            batch_buffers, batch_layout = (plan.packed_forward,), self._packed_layout(plan, plan.packed_forward)
        elif plan.context_index is None:
            batch_buffers, batch_layout = pack((plan.batch, plan.feed_index))
        else:  # another layout: the forward variant that also returns these tokens' logits
            batch_buffers, batch_layout = pack((plan.batch, plan.feed_index, plan.context_index))
        if self.attention_work is not None:
            batch_layout = self._work_bounded(plan.batch, batch_buffers, batch_layout)
        # Every row decodes greedily with no processing: the forward's argmax is the token.
        greedy = plan.greedy_only and not plan.has_logits_work
        sampling_buffers, sampling_layout = (None, None) if greedy else self._sampling_packer.pack(plan.sampling)
        if not self._single_device:
            batch_buffers, sampling_buffers = put_on_mesh((batch_buffers, sampling_buffers), self._replicated)
        enqueue_time = time.perf_counter()
        fused = greedy and plan.context_index is None and self._runs_fused(batch_buffers, batch_layout)
        logits, expert_counts, context_logits, greedy_tokens = self.run_forward(
            batch_buffers, batch_layout, self._fed_tokens, fused=fused
        )
        self.steps_per_bucket[plan.batch.token_ids.shape[-1]] += 1  # per rank under attention DP
        self.fused_steps += fused
        if greedy:
            sampled = SamplerOutput(token_ids=greedy_tokens, logprobs=None, top_ids=None, top_logprobs=None)
            self._fed_tokens = sampled.token_ids
            return StepOutput(sampled, expert_counts, context_logits, None, None, enqueue_time)
        if sampling_buffers is None or sampling_layout is None:
            raise AssertionError("a step that samples has packed its sampling inputs")
        row_logits = None
        if plan.has_logits_work:
            logits, row_logits = self._post_process(logits, plan)
        rows = plan.sampling.batch_size
        if rows < logits.shape[0]:  # a token bucket's sampler over its live rows (`Planner.sampler_rows`)
            logits = self._first_rows(logits, rows)
        self.sampler_runs_per_rows[rows] += 1
        sampled = self._sample(logits, sampling_buffers, sampling_layout)
        self._fed_tokens = sampled.token_ids
        processed = None
        if plan.processor_rows is not None and host_processor is not None:
            if self._processor_pool is None:
                self._processor_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-logits-processors")
            processed = self._processor_pool.submit(
                self._resample_processed, logits, plan.processor_rows, host_processor, sampling_buffers, sampling_layout
            )
        return StepOutput(sampled, expert_counts, context_logits, row_logits, processed, enqueue_time)

    def _work_bounded(self, batch: StepBatch, buffers: tuple, layout: PackedLayout) -> PackedLayout:
        """The layout of the forward whose attention loop is compiled for `batch`'s work (the
        smallest rung of `attention_work` holding it): that program once compiled, else the
        shapes' bound while the rung compiles on the low-priority threads (no step waits)."""
        assert self.attention_work is not None
        tier = self.attention_work.choose(batch)
        if tier is None:
            return layout
        key = (layout, tier)
        bounded = self._bounded_layouts.get(key)
        if bounded is None:
            tree = jax.tree_util.tree_unflatten(layout.treedef, [0] * layout.treedef.num_leaves)
            tree = (replace(tree[0], kv_work_items=tier), *tree[1:])
            bounded = PackedLayout(jax.tree_util.tree_structure(tree), layout.dtypes, layout.leaves)
            self._bounded_layouts[key] = bounded
        if self.programs.has("forward", bounded):
            self.bounded_steps += 1
            return bounded
        if not self.programs.started("forward", bounded):
            self.programs.start(
                "forward", (self.params, self.kv_cache, buffers, self._zero_tokens), bounded, background=True
            )
        return layout

    def _packed_layout(self, plan: StepPlan, packed_forward: np.ndarray) -> PackedLayout:
        """The layout of `packed_forward` (the plan's, when set): `pack`'s for the batch's shapes,
        found with `pack` once per shape (which also checks that the buffer is what `pack` builds)."""
        batch = plan.batch
        key = (batch.token_ids.shape, batch.block_tables.shape, batch.logits_indices.shape)
        layout = self._packed_layouts.get(key)
        if layout is None:
            (buffer,), layout = pack((batch, plan.feed_index))
            if not np.array_equal(buffer, packed_forward):
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
        self.blocks_copied += len(pairs)
        for start in range(0, max(len(pairs), 1), MAX_BLOCK_COPIES):
            chunk = pairs[start : start + MAX_BLOCK_COPIES]
            src = np.zeros(MAX_BLOCK_COPIES, np.int32)
            dst = np.full(MAX_BLOCK_COPIES, _NO_BLOCK, np.int32)
            if chunk:
                src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
            src, dst = put_on_mesh((src, dst), self._replicated)
            self.kv_cache = self._copy_jit(self.kv_cache, src, dst)

    def _runs_fused(self, inputs: tuple, layout: PackedLayout) -> bool:
        """Whether a greedy-only step of `layout` runs the fused-argmax forward: when it is
        compiled, or when neither forward is (the step compiles only the fused one). While the
        full forward alone is compiled (or compiling) it runs that one, and the fused variant
        is queued to compile in idle time, so no step waits for it."""
        if not self.fused_argmax:
            return False
        if self.programs.has("greedy_forward", layout):
            return True
        if not self.programs.started("forward", layout):
            return True
        args = (self.params, self.kv_cache, inputs, self._zero_tokens)
        try:
            self.programs.start("greedy_forward", args, layout, background=True, idle=True)
        except Exception as exc:  # closing: the full forward keeps serving these steps
            logger.debug("could not queue the fused-argmax forward: %r", exc)
        return False

    def run_forward(
        self, inputs: tuple, layout: PackedLayout, prev_tokens: jax.Array | None, *, fused: bool = False
    ) -> tuple:
        """The forward program: (logits, expert counts, context logits, greedy tokens); with
        `fused` its fused-argmax variant, whose logits are None."""
        prev = self._zero_tokens if prev_tokens is None else prev_tokens
        # Lowered against the zero tokens, as `compile_forward` does: one program per layout.
        kind = "greedy_forward" if fused else "forward"
        exe = self.programs.get(kind, (self.params, self.kv_cache, inputs, self._zero_tokens), layout)
        outputs = exe(self.params, self.kv_cache, inputs, prev)
        self.kv_cache, logits, expert_counts, context_logits, greedy_tokens = outputs[:5]
        self.last_hidden = outputs[5] if len(outputs) > 5 else None
        return logits, expert_counts, context_logits, greedy_tokens

    def _sample(self, logits: jax.Array, inputs: tuple, layout: PackedLayout) -> SamplerOutput:
        args = (logits, inputs)
        self.sampler_runs += 1
        return self.programs.get("sampler", args, layout)(*args)

    def forward(self, batch: StepBatch, feed_index: np.ndarray, prev_tokens: jax.Array | None) -> jax.Array:
        """Only the model forward: float32 logits [max_batch_size, vocab] on the device."""
        inputs, layout = self._to_device((batch, feed_index))
        return self.run_forward(inputs, layout, prev_tokens)[0]

    def sample(self, logits: jax.Array, sampling: SamplingTensors) -> SamplerOutput:
        """Only the sampler, over logits [max_batch_size, vocab]."""
        inputs, layout = self._to_device(sampling)
        return self._sample(logits, inputs, layout)
