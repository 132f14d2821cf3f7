"""The engine loop: plan (host) -> run the plan (devices) -> apply the sampled tokens.

The planner (`jaxllm.engine.planner`: scheduler, KV block manager, batch building) turns
the active requests into a `StepPlan` of plain host arrays; the runner
(`jaxllm.engine.model_runner`) executes it on the device mesh and returns the sampled
tokens; this loop reads them back, applies stops and reports updates.

Requests are checked once, at admission (`jaxllm.engine.admission`), so an admitted
request cannot make a step fail. As a backstop, an exception while building a step's
host inputs fails only the requests that caused it (found by building each row alone),
or else that step's requests, and the engine goes on; only a failure of the device
program itself propagates (the engine state is then unknown).

With the overlap scheduler (default) step N+1 is scheduled and dispatched before the
tokens of step N are read back, so the device never waits on Python: a generation
request whose previous token is still on the device carries a placeholder on the host
and the step reads the real token from the previous step's output. Stops are therefore
seen one step late; the extra token is discarded.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from concurrent.futures import as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from jaxllm.batch_builder import build_step_batch, choose_token_bucket, token_buckets
from jaxllm.config import CapacitySchedulerPolicy
from jaxllm.engine.attention_dp import AttentionDpPlanner, RankAssignment, RankedKvCaches
from jaxllm.engine.admission import (AdmissionLimits, AdmittedRequest, check_arrival_time,
                                     check_sequence_index, validate_request)
from jaxllm.models.backends import resolve_backends
from jaxllm.engine.beam_search import BeamRun, BeamSearch
from jaxllm.engine.compile_ahead import BucketCompiler
from jaxllm.engine.compile_cache import compile_cache_requested, enable_compile_cache
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.executable_store import ExecutableStore
from jaxllm.engine.followers import mirror, open_session
from jaxllm.engine.load_balancer import OnlineLoadBalancer
from jaxllm.engine.logits_outputs import (LogitsRecord, StepLogitsTargets, plan_step_logits, row_buckets)
from jaxllm.engine.logits_processing import check_batched_processors, host_processor_hook
from jaxllm.engine.model_runner import ModelRunner, plan_num_kv_blocks
from jaxllm.engine.planner import PLACEHOLDER_TOKEN, Planner, TokenEntry
from jaxllm.engine.step_updates import RequestUpdate, StepUpdates
from jaxllm.engine.token_readback import TokenReadback
from jaxllm.kv_cache import KVCacheManager
from jaxllm.kv_cache.events import KvCacheEventBuffer, KvEventRecorder
from jaxllm.kv_cache.retention import check_retention_config
from jaxllm.lora import LoraAdapter, LoRARequest, LoraSlots
from jaxllm.lora.cache import AdapterCache
from jaxllm.lora.weights import empty_slot, init_lora_weights, slot_update
from jaxllm.kv_cache.manager import DecodeRows
from jaxllm.models import load_model_config, load_params
from jaxllm.models.config import numpy_dtype
from jaxllm.models.parallel.ep_moe import EpMoeOptions
from jaxllm.models.partitioning import attention_dp_rules
from jaxllm.models.resolve import resolve_dtype
from jaxllm.request import LlmRequest, LlmRequestState
from jaxllm.sampling import SAMPLER_VARIANTS, SamplingParams, SamplingTensors, resolve_seed
from jaxllm.scheduler import SchedulerOutput, make_scheduler
from jaxllm.tokenizer import load_tokenizer
from sharding import ParallelConfig, make_mesh
from sharding.mesh import expert_parallel_size
from sharding.eplb.statistics import ExpertStatisticsWriter
from sharding.multihost import agree_min, is_multiprocess

logger = logging.getLogger(__name__)

_COMPLETE = LlmRequestState.GENERATION_COMPLETE


@dataclass
class EngineTiming:
    """Where step time goes: host work (scheduling, packing, bookkeeping) vs waiting on the device."""

    steps: int = 0
    host_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    # Part of host_seconds spent handing a step to the runtime (input transfer, program calls).
    dispatch_seconds: float = 0.0


@dataclass
class _PendingStep:
    sampler_output: object
    entries: list[TokenEntry]  # (request, row, index in output_token_ids); DecodeEntries when steady
    wants_logprobs: bool
    stats: dict
    iteration: int = 0
    expert_counts: Any = None  # device array of the step's expert counts, when statistics are recorded
    slot_tables: Optional[dict] = None  # MoE layer -> slot table the step ran with (online balancer)
    beam_entries: Optional[list[TokenEntry]] = None  # rows of beam-search requests (processed apart)
    # Host logits processors of this step (`jaxllm.engine.logits_processing`): their requests and
    # rows, the future of those rows' sampler output (computed on the runner's processor
    # thread), and the callables' failures, filled on that thread.
    processor_requests: tuple = ()
    processor_rows: tuple = ()
    processed_output: Any = None
    processor_failures: Optional[list] = None
    # Steps where some row asks for logits: who gets which rows, and the device arrays.
    logits_targets: Optional[StepLogitsTargets] = None
    context_logits: Any = None
    row_logits: Any = None
    # A steady decode step (entry i is row i of `decode.requests`): the rows and the index in
    # output_token_ids each row's token goes to, so reading back needs no pass over entries.
    decode: Optional[DecodeRows] = None
    decode_index: Optional[np.ndarray] = None


def resolve_model_dir(model: str) -> Path:
    """Preset, downloadable name, .gguf file, model directory or Hub id -> local model directory."""
    from jaxllm.models.resolve import resolve_model

    return resolve_model(model)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        compile_cache_dir = enable_compile_cache() if compile_cache_requested(config.compile_cache) else None
        # Multi-host leader: the followers build this same engine from the config (None otherwise).
        session = open_session(config)
        model_dir = resolve_model_dir(config.model)
        dtype = resolve_dtype(config.dtype)  # "auto": the checkpoint's dtype, float32 on CPU
        # Layer stacks under lax.scan; attention data parallelism keeps per-layer caches (its
        # per-rank cache layout, jaxllm.models.parallel.attention_dp) and so the per-layer loop.
        self.model_config = replace(load_model_config(model_dir, dtype=dtype),
                                    scan_layers=config.scan_layers and not config.enable_attention_dp)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        kv_dtype = numpy_dtype(self.model_config.dtype)
        # The device mesh: every weight and the KV cache are sharded over it at load time.
        parallel = config.parallel_config()
        self.mesh = make_mesh(parallel)
        if config.moe_config.dispatch == "ragged_all_to_all" and self.mesh.devices.flat[0].platform == "cpu":
            raise ValueError("moe dispatch 'ragged_all_to_all' needs a platform that implements "
                             "jax.lax.ragged_all_to_all (XLA:CPU does not); use all_to_all, allgather or auto")
        # Expert parallelism: experts are stored as slots, placed as the load balancer config says.
        balancer = config.moe_config.load_balancer
        # Attention DP: attention and dense weights replicated, experts always stored as slots
        # (the MoE layers dispatch every rank's tokens; see jaxllm.models.parallel.attention_dp).
        self.attention_dp = parallel.enable_attention_dp
        if self.attention_dp and self.model_config.is_mla:
            raise ValueError(f"enable_attention_dp: {self.model_config.architecture} uses multi-head latent "
                             "attention, which attention data parallelism does not support yet")
        num_slots = balancer.num_slots if balancer else None
        if self.attention_dp and num_slots is None and self.model_config.num_experts:
            num_slots = self.model_config.num_experts
        params = load_params(model_dir, self.model_config, mesh=self.mesh,
                             rules=attention_dp_rules(self.model_config, self.mesh) if self.attention_dp else None,
                             slot_assignments=balancer.initial_global_assignments if balancer else None,
                             num_slots=num_slots)
        moe_layers = [i for i in range(self.model_config.num_layers) if self.model_config.is_moe_layer(i)]
        # Offline expert statistics (EXPERT_STATISTIC_ITER_RANGE / EXPERT_STATISTIC_PATH), per expert.
        self.expert_statistics = ExpertStatisticsWriter.from_env(
            num_experts_per_token=self.model_config.num_experts_per_tok,
            ep_size=parallel.moe_expert_parallel_size, layer_ids=moe_layers) if moe_layers else None
        moe_options = EpMoeOptions(dispatch=config.moe_config.dispatch,
                                   capacity_factor=config.moe_config.capacity_factor)
        self.max_seq_len = config.max_seq_len or self.model_config.max_position_embeddings
        kv_cfg = config.kv_cache_config
        tpb = kv_cfg.tokens_per_block
        if config.enable_chunked_prefill and config.max_num_tokens < tpb:
            raise ValueError(f"max_num_tokens ({config.max_num_tokens}) must be at least tokens_per_block ({tpb}): "
                             "prompt chunks are whole blocks, so no prompt could ever start")
        # Under attention DP every device is a rank with this many blocks of its own.
        kv_meshes = [make_mesh(ParallelConfig(), [d]) for d in self.mesh.devices.flat] if self.attention_dp \
            else [self.mesh]
        num_blocks = min(plan_num_kv_blocks(
            model_config=self.model_config, dtype=kv_dtype, tokens_per_block=tpb,
            max_tokens=kv_cfg.max_tokens, free_memory_fraction=kv_cfg.free_gpu_memory_fraction,
            max_batch_size=config.max_batch_size, max_seq_len=self.max_seq_len, mesh=kv_mesh) for kv_mesh in kv_meshes)
        num_blocks = agree_min("kv_cache_blocks", num_blocks)  # every host holds its share of every block
        self.max_blocks_per_seq = math.ceil(self.max_seq_len / tpb)
        # LoRA: adapter slots are a resource of the capacity scheduler (jaxllm.lora.slots).
        self.lora_slots = self._lora_slots(config) if config.enable_lora else None
        self._adapters = AdapterCache(self.model_config, config.max_lora_rank) if config.enable_lora else None
        # KV cache events (stored / removed / updated blocks) for get_kv_cache_events; off at 0.
        self.kv_events = KvCacheEventBuffer(kv_cfg.event_buffer_max_size, window_size=self.max_seq_len) \
            if kv_cfg.event_buffer_max_size > 0 else None

        def rank_planner(rank: Optional[int] = None) -> Planner:
            events = None if self.kv_events is None else KvEventRecorder(self.kv_events, rank)
            kv = KVCacheManager(num_blocks, tpb, self.max_blocks_per_seq, enable_block_reuse=kv_cfg.enable_block_reuse,
                                max_num_sequences=config.max_batch_size, events=events)
            scheduler = make_scheduler(config.scheduler_config, kv, config.max_batch_size, config.max_num_tokens,
                                       config.enable_chunked_prefill, lora_slots=self.lora_slots)
            return Planner(scheduler=scheduler, kv_cache_manager=kv, max_batch_size=config.max_batch_size,
                           max_num_tokens=config.max_num_tokens, min_token_bucket=config.min_token_bucket,
                           max_blocks_per_seq=self.max_blocks_per_seq, max_seq_len=self.max_seq_len,
                           lora_slots=self.lora_slots)

        if self.attention_dp:  # one scheduler and block pool per rank (jaxllm.engine.attention_dp)
            assignment = RankAssignment(len(kv_meshes))
            self.planner = AttentionDpPlanner([rank_planner(rank) for rank in range(len(kv_meshes))], assignment)
            self.kv_cache_manager = RankedKvCaches([p.kv_cache_manager for p in self.planner.planners], assignment)
            self.scheduler = None
            self.num_sampler_rows = self.planner.num_rows
        else:
            self.planner = rank_planner()
            self.kv_cache_manager, self.scheduler = self.planner.kv_cache_manager, self.planner.scheduler
            self.num_sampler_rows = config.max_batch_size
        self.attention_backend, self.moe_backend, attention_fn, moe_fn = resolve_backends(
            config.attention_backend, config.moe_backend)
        online = balancer is not None and balancer.layer_updates_per_iter > 0
        if online and is_multiprocess():
            raise ValueError("moe_config.load_balancer: online expert load balancing (layer_updates_per_iter > 0) "
                             "is not supported in multi-host runs: its slot writes run outside the mirrored step")
        # Compiled forwards and samplers kept beside the compilation cache: a later process with
        # this configuration loads them without tracing (jaxllm.engine.executable_store).
        self.executable_store = (ExecutableStore.beside_compile_cache(compile_cache_dir, config)
                                 if session is None and not is_multiprocess() else None)
        self.runner = ModelRunner(model_config=self.model_config, params=params, num_blocks=num_blocks,
                                  tokens_per_block=tpb, kv_dtype=kv_dtype, attention_fn=attention_fn,
                                  moe_fn=moe_fn, max_batch_size=self.num_sampler_rows, mesh=self.mesh,
                                  moe_options=moe_options, moe_stats=self.expert_statistics is not None or online,
                                  attention_dp=self.attention_dp,
                                  batched_processors=check_batched_processors(config.logits_post_processors),
                                  compile_workers=config.compile_workers,
                                  executable_store=self.executable_store)
        if config.enable_lora:  # zeroed slots next to the weights: the step reads params["lora"]
            self.runner.params["lora"] = init_lora_weights(self.model_config, self.runner.params, config.max_loras,
                                                           config.max_lora_rank, self.model_config.dtype)
        # Online expert load balancing: placements recomputed in the background, slots rewritten in place.
        self.load_balancer = OnlineLoadBalancer(
            config=balancer, params=self.runner.params, moe_layers=moe_layers,
            num_experts=self.model_config.num_experts, ep_size=expert_parallel_size(self.mesh),
            mesh=self.mesh) if online else None
        # On a multi-host leader every step is first sent to the followers, which run it too.
        self.runner = mirror(self.runner, session, config.multihost_plan_channel)
        # Steps run in a compiled bucket while the best fit compiles (jaxllm.engine.compile_ahead);
        # not under attention DP (its planner picks one bucket for all ranks) nor on a multi-host
        # leader (its followers compile on demand).
        self.bucket_compiler: Optional[BucketCompiler] = None
        if config.compile_ahead and session is None and not self.attention_dp:
            self.bucket_compiler = BucketCompiler(
                max_num_tokens=config.max_num_tokens, min_token_bucket=config.min_token_bucket,
                compile_bucket=lambda bucket: self.runner.compile_forward(*self._empty_batch(bucket), wait=False),
                compile_seconds=lambda: self.runner.compile_seconds / max(1, self.runner.num_compiled_variants),
                max_in_flight=self.runner.compile_workers - 1)
            self.planner.choose_bucket = self.bucket_compiler.choose
        # Pausing moves generated tokens into the prompt, which needs them on the host.
        self.overlap = (not config.disable_overlap_scheduler and
                        config.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.MAX_UTILIZATION)
        self.active: dict[int, LlmRequest] = {}
        # Active requests whose sampling reads the token history / wants logprobs, counted so
        # that a step needs no pass over every request to know whether any does.
        self._num_needing_history = 0
        self._num_wanting_logprobs = 0
        self._num_beam_search = 0  # active beam-search requests (each runs every other overlapped step)
        # Active requests with logits outputs or post-processors (jaxllm.engine.logits_outputs).
        self._num_logits_requests = 0
        self._pending: Optional[_PendingStep] = None
        self.readback = TokenReadback(self)  # reads dispatched steps back (jaxllm.engine.token_readback)
        # Counts admissions and finishes: while it is unchanged and every request of a steady
        # decode step stays below max_tokens, the next step's candidates are that step's
        # requests (`_steady_candidates`), found without a pass over the active requests.
        self._active_changes = 0
        self._steady_candidates: Optional[tuple[list[LlmRequest], int]] = None
        # Steady decode batches keep their tokens in a `DecodeTokenLog` instead of writing
        # them into every request each step (jaxllm.engine.token_log); False writes them.
        self.token_log = True
        self._ids = itertools.count()
        self.iteration = 0
        self.iteration_stats: list[dict] = []
        self.max_iteration_stats = 1000
        self.timing = EngineTiming()
        self._wait_seconds = 0.0
        self._failed: list[RequestUpdate] = []  # requests failed while building a step
        # Called after each dispatch with (time the forward was enqueued, sampler output): lets a
        # benchmark watch when each step's device work ends without syncing the step loop.
        self.on_dispatch: Optional[Callable[[float, Any], None]] = None
        kv = self.kv_cache_manager
        self.admission_limits = AdmissionLimits(
            vocab_size=self.model_config.vocab_size, max_seq_len=self.max_seq_len,
            default_end_ids=tuple(sorted(self.eos_ids)), tokens_per_block=tpb,
            max_blocks_per_request=min(kv.max_blocks_per_seq, kv.get_max_resource_count()),
            max_num_tokens=config.max_num_tokens, enable_chunked_prefill=config.enable_chunked_prefill,
            batched_processor_names=tuple(sorted(config.logits_post_processors or ())),
            logits_unsupported=self._logits_unsupported())

    def _logits_unsupported(self) -> Optional[str]:
        if self.attention_dp:
            return "logits outputs and post-processors are not supported with attention data parallelism"
        if is_multiprocess():
            return ("logits outputs and post-processors are not supported in multi-host runs (the followers "
                    "mirror only the plain step)")
        return None

    def _lora_slots(self, config: EngineConfig) -> LoraSlots:
        """The adapter slots, after refusing the layouts LoRA does not run on yet."""
        unsupported = []
        if self.model_config.is_mla:
            unsupported.append(f"{self.model_config.architecture} (multi-head latent attention)")
        if self.mesh.devices.size > 1:
            unsupported.append(f"a mesh of {self.mesh.devices.size} devices (tensor / expert parallelism, "
                               "attention data parallelism)")
        if config.moe_config.load_balancer is not None:
            unsupported.append("expert slots (moe_config.load_balancer)")
        if is_multiprocess():
            unsupported.append("multi-host runs")
        if unsupported:
            raise ValueError(f"enable_lora: LoRA adapters are not supported with {' or '.join(unsupported)}; "
                             "they run on one device with dense or MoE (attention-only adapters) models")
        return LoraSlots(config.max_loras)

    def resolve_lora(self, lora_request: Any) -> Optional[LoraAdapter]:
        """The checked adapter of `lora_request` (None for the base model); ValueError when it
        cannot be served. Safe from any thread; adapters are read once and kept."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a jaxllm.LoRARequest, got {type(lora_request).__name__}")
        if self._adapters is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was built without LoRA "
                             "support; build it with enable_lora=True (CLI: --enable-lora)")
        return self._adapters.get(lora_request)

    def _slot_update(self, adapter: LoraAdapter) -> Any:
        return slot_update(adapter, self.model_config, self.runner.params, self.config.max_lora_rank,
                           self.model_config.dtype)

    def reset_timing(self) -> None:
        self.timing = EngineTiming()

    def token_buckets(self) -> list[int]:
        return self.planner.token_buckets()

    def _empty_batch(self, bucket: int) -> tuple[Any, np.ndarray]:
        """An all-padding step of `bucket` tokens and its feed index (for compiling ahead of traffic)."""
        if self.attention_dp:
            return self.planner.empty_batch(bucket), np.full((self.planner.num_ranks, bucket), -1, np.int32)
        batch = build_step_batch(SchedulerOutput([], [], []), self.kv_cache_manager, token_bucket=bucket,
                                 max_batch_size=self.config.max_batch_size, max_blocks_per_seq=self.max_blocks_per_seq)
        return replace(batch, lora_slots=self.planner.empty_lora_slots(bucket)), np.full((bucket,), -1, np.int32)

    def warmup(self, all_variants: bool = True, progress: Optional[Callable[[int, int], None]] = None,
               background: bool = False) -> None:
        """Compile everything a request can reach before serving, so nothing compiles later:
        the model forward for every token bucket and the sampler for every variant of its
        static switches (`all_variants=False`: only the default greedy sampler). Runs empty
        batches, which write nothing to the KV cache. `progress(done, total)` is called after
        each compiled piece (for a progress bar).

        The programs are independent, so they compile at once on the runner's compile threads
        (`EngineConfig.compile_workers`); the samplers once the smallest bucket's forward gave
        the logits they take. Then each runs once.

        `background`: return once the buckets of the common steps are compiled, the decode
        bucket (the smallest holding `max_batch_size` tokens: every decoding step fits it) and
        the largest (which holds any step), with the greedy sampler. Nothing else compiles
        while the engine is busy unless it pays for itself: a step whose best bucket is not
        compiled runs padded in a compiled one until its padding cost a compile (see
        `jaxllm.engine.compile_ahead`), and another sampler variant compiles on the step of the
        first request that needs it. The other buckets compile when the engine is idle
        (`on_idle`). Needs `compile_ahead` (else everything compiles before returning)."""
        buckets = self.token_buckets()
        variants = SAMPLER_VARIANTS if all_variants else [dict()]
        total = len(buckets) + len(variants)
        if background and self.bucket_compiler is not None:
            self._warm_up_in_background(buckets, progress)
        else:
            self._warm_up_all(buckets, variants, progress, total)
        if self.load_balancer is not None:
            self.load_balancer.warm_up(self.runner.params)
        if self.lora_slots is not None:  # the slot write: slot 0 rewritten with what it holds
            adapter = self.lora_slots.adapter_in(0)
            self.runner.write_lora_slot(0, self._slot_update(adapter) if adapter is not None else empty_slot(
                self.model_config, self.runner.params, self.config.max_lora_rank, self.model_config.dtype))

    def _warm_up_all(self, buckets: list[int], variants: Any, progress: Optional[Callable[[int, int], None]],
                     total: int) -> None:
        batches = [self._empty_batch(bucket) for bucket in buckets]
        samplings = [SamplingTensors.empty(self.num_sampler_rows, self.max_seq_len, **flags)
                     for flags in variants]
        pending = [self.runner.compile_forward(*batch, wait=False) for batch in batches[1:]]
        logits = self.runner.forward(*batches[0], None)  # compiled here, meanwhile the others on the threads
        self.runner.compile_batched_processors(logits)
        done = 1
        if progress is not None:
            progress(done, total)
        if self.config.warmup_logits_outputs and self.admission_limits.logits_unsupported is None:
            # The context-logits variant of every bucket, for every size of its extra output.
            variants_of_logits = [self.runner.compile_forward(*batch, np.zeros(rows, np.int32), wait=False)
                                  for batch in batches for rows in token_buckets(batch[0].token_ids.shape[-1],
                                                                                 self.config.min_token_bucket)]
            pending += variants_of_logits
            self.runner.compile_logits_programs(logits, row_buckets(self.num_sampler_rows))
            total += len(variants_of_logits)
        pending += [self.runner.compile_sampler(logits, sampling, wait=False) for sampling in samplings]
        for future in as_completed(pending):
            future.result()
            done += 1
            if progress is not None:
                progress(done, total)
        if self.bucket_compiler is not None:
            self.bucket_compiler.mark_ready(buckets)
        for batch in batches[1:]:
            logits = self.runner.forward(*batch, None)
        outputs = [self.runner.sample(logits, sampling) for sampling in samplings]
        if not self.attention_dp:
            self.runner.copy_blocks([])  # beam search's copy on write (only padding: copies nothing)
        for out in outputs:
            np.asarray(out.token_ids)

    def decode_bucket(self) -> int:
        """The token bucket every decoding step fits: the smallest holding `max_batch_size` tokens."""
        return choose_token_bucket(self.config.max_batch_size, self.config.max_num_tokens,
                                   self.config.min_token_bucket)

    def _warm_up_in_background(self, buckets: list[int], progress: Optional[Callable[[int, int], None]]) -> None:
        first = sorted({self.decode_bucket(), buckets[-1]})
        # Both compile at once on the compile threads (on a CPU that is the build's cores, idle).
        for future in [self.runner.compile_forward(*self._empty_batch(bucket), wait=False) for bucket in first]:
            future.result()
        for bucket in first:  # each runs once (empty batches write nothing)
            logits = self.runner.forward(*self._empty_batch(bucket), None)
        self.runner.compile_batched_processors(logits)
        greedy = SamplingTensors.empty(self.num_sampler_rows, self.max_seq_len)
        out = self.runner.sample(logits, greedy)
        self.runner.copy_blocks([])  # beam search's copy on write (only padding: copies nothing)
        np.asarray(out.token_ids)
        self.bucket_compiler.mark_ready(first)
        self.bucket_compiler.defer([bucket for bucket in buckets if bucket not in first])
        # Another sampler variant compiles on the step of the first request that needs it (in a
        # fraction of a forward's compile time), not ahead: most runs never use most variants.
        if self.config.warmup_logits_outputs and self.admission_limits.logits_unsupported is None:
            self.runner.compile_logits_programs(logits, row_buckets(self.num_sampler_rows))
            for bucket in buckets:
                for rows in token_buckets(bucket, self.config.min_token_bucket):
                    self.runner.compile_forward(*self._empty_batch(bucket), np.zeros(rows, np.int32), wait=False)
        if progress is not None:
            progress(len(first) + 1, len(first) + 1)

    def on_idle(self) -> None:
        """Nothing to run: compile, on the compile threads, the buckets steps asked for and
        those a background warm-up left for idle time. Called after a run (`step`) and by the
        engine's driver when no request arrived for a while."""
        if self.bucket_compiler is not None:
            self.bucket_compiler.on_idle()

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> int:
        return next(self._ids)

    def validate_request(self, prompt_token_ids: Any, params: Any, *, priority: Any = 0.0,
                         lora_request: Any = None) -> AdmittedRequest:
        """Admission checks (ValueError naming the field); safe to call from any thread, and
        what the executor and the server call before queueing a request."""
        admitted = validate_request(prompt_token_ids, params, self.admission_limits, priority=priority,
                                    tokenizer=self.tokenizer)
        self.resolve_lora(lora_request)
        if params.use_beam_search:  # validate_request checked it is SamplingParams
            self._check_beam_search(params, len(admitted.prompt_token_ids))
        return admitted

    def _check_beam_search(self, params: SamplingParams, prompt_len: int) -> None:
        """What this engine's configuration allows beam search to do (ValueError otherwise)."""
        width = params.beam_width
        if self.attention_dp:
            raise ValueError("use_beam_search is not supported with enable_attention_dp")
        if is_multiprocess():
            raise ValueError("use_beam_search is not supported in multi-host runs (beam forks copy KV blocks "
                             "outside the mirrored step)")
        if self.config.scheduler_config.capacity_scheduler_policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            raise ValueError("use_beam_search needs the GUARANTEED_NO_EVICT capacity scheduler policy: "
                             "MAX_UTILIZATION pauses requests, and paused beams cannot be recomputed")
        if width > self.config.max_batch_size or width > self.config.max_num_tokens:
            raise ValueError(f"use_beam_search: beam width {width} exceeds max_batch_size "
                             f"({self.config.max_batch_size}) or max_num_tokens ({self.config.max_num_tokens}); "
                             "each beam is a row of the step")
        kv = self.kv_cache_manager
        tpb = kv.tokens_per_block
        per_beam = -(-(prompt_len + params.max_tokens) // tpb)
        blocks = width * per_beam - (width - 1) * (prompt_len // tpb)
        if blocks > kv.get_max_resource_count():
            raise ValueError(f"max_tokens: {width} beams of prompt ({prompt_len} tokens) + max_tokens "
                             f"({params.max_tokens}) need up to {blocks} KV blocks, more than the cache holds "
                             f"({kv.get_max_resource_count()})")

    def validate_prompt(self, prompt_token_ids: Any, params: Any) -> None:
        """Alias of `validate_request` with the default priority."""
        self.validate_request(prompt_token_ids, params)

    def add_request(self, prompt_token_ids: Any, sampling_params: Optional[SamplingParams] = None,
                    *, request_id: Optional[int] = None, priority: float = 0.0,
                    arrival_time: Optional[float] = None, sequence_index: int = 0,
                    lora_request: Optional[LoRARequest] = None,
                    kv_cache_retention_config: Any = None) -> LlmRequest:
        """Admit a request (ValueError naming the field if it breaks a limit). `lora_request`:
        the LoRA adapter it runs with (the engine needs enable_lora); `kv_cache_retention_config`:
        retention priorities of its cached KV blocks (`jaxllm.KvCacheRetentionConfig`)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        admitted = self.validate_request(prompt_token_ids, params, priority=priority)
        retention = check_retention_config(kv_cache_retention_config)
        adapter = self.resolve_lora(lora_request)
        sequence_index = check_sequence_index(sequence_index)
        arrival_time = check_arrival_time(arrival_time)
        if request_id is None:
            request_id = self.next_request_id()
        elif not isinstance(request_id, int) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be an int, got {type(request_id).__name__}")
        elif request_id in self.active:
            raise ValueError(f"request_id {request_id} is already in use by an unfinished request")
        request = LlmRequest(
            request_id=request_id, prompt_token_ids=admitted.prompt_token_ids,
            max_new_tokens=params.max_tokens, priority=admitted.priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            sampling_params=params)
        request.seed = resolve_seed(params, sequence_index)
        request.end_ids = admitted.end_ids
        request.lora_adapter = adapter
        request.kv_cache_retention_config = retention
        if params.use_beam_search:
            if request_id < 0:
                raise ValueError(f"request_id must be >= 0 for beam search, got {request_id}")
            request.beam_width = params.beam_width
            end_ids = frozenset(() if params.ignore_eos else admitted.end_ids)
            request.beam = BeamRun(BeamSearch(params.beam_width, params.max_tokens, end_ids,
                                              float(params.length_penalty), params.early_stopping),
                                   [request], params.n)
            self._num_beam_search += 1
            self.planner.beam_search_active = True
        self.active[request.request_id] = request
        self._active_changes += 1
        self._num_needing_history += params.needs_history
        self._num_wanting_logprobs += params.logprobs is not None
        if (params.wants_context_logits or params.return_generation_logits or params.logits_processor is not None
                or params.logits_post_processor_name is not None):
            request.logits_record = LogitsRecord(list(admitted.prompt_token_ids))
            request.reuse_prefix = not params.wants_context_logits  # cached blocks have no logits
            self._num_logits_requests += 1
        return request

    def get_kv_cache_events(self, timeout: Optional[float] = None) -> list[dict]:
        """KV cache events since the previous call (any thread; waits up to `timeout` seconds
        for one). Empty unless `kv_cache_config.event_buffer_max_size > 0`."""
        return [] if self.kv_events is None else self.kv_events.get(timeout)

    def abort_request(self, request_id: int) -> Optional[LlmRequest]:
        """Finish a request as 'cancelled' and free its blocks at once."""
        request = self.active.get(request_id)
        if request is None:
            return None
        self.planner.materialize_tokens()
        self._finish(request, "cancelled", None, self._num_resolved(request))
        return request

    @staticmethod
    def _num_resolved(request: LlmRequest) -> int:
        """Output tokens already read back (the rest are placeholders of a step in flight)."""
        resolved = len(request.output_token_ids)
        while resolved and request.output_token_ids[resolved - 1] == PLACEHOLDER_TOKEN:
            resolved -= 1
        return resolved

    def _fail(self, requests: list[LlmRequest], exc: BaseException, where: str) -> list[RequestUpdate]:
        """Finish requests with 'error' (their blocks are freed) and report why."""
        logger.error("step %s failed for request(s) %s: %r", where, [r.request_id for r in requests], exc)
        message = f"the engine failed this request while {where}: {type(exc).__name__}: {exc}"
        self.planner.materialize_tokens()
        updates = []
        for request in requests:
            if request.is_finished:
                continue
            self._finish(request, "error", None, self._num_resolved(request))
            updates.append(RequestUpdate(request, [], finished=True, error=message))
        return updates

    def has_unfinished_requests(self) -> bool:
        return bool(self.active) or self._pending is not None

    @property
    def num_queued(self) -> int:
        """Active requests that hold no KV sequence yet (waiting to start, or paused)."""
        kv = self.kv_cache_manager
        if not self._num_beam_search and isinstance(kv, KVCacheManager):
            # Every KV sequence belongs to an active request (beams aside): no pass needed.
            return len(self.active) - kv.num_sequences
        return sum(1 for r in self.active.values() if not kv.has_sequence(r))

    # ------------------------------------------------------------------ the step
    def _schedulable(self) -> list[LlmRequest]:
        steady = self._steady_candidates
        if steady is not None and steady[1] == self._active_changes:
            return steady[0]
        self.planner.materialize_tokens()  # the lengths below must count every token
        return [r for r in self.active.values()
                if len(r.output_token_ids) < r.sampling_params.max_tokens and r.state is not _COMPLETE]

    def step(self) -> StepUpdates:
        """Run one iteration; returns the updates of the step whose tokens were read back
        (iterate it for one `RequestUpdate` per request; `StepUpdates.decoded` holds the
        plain decode rows batched)."""
        started = time.perf_counter()
        updates = StepUpdates()
        candidates = self._schedulable()
        pending = self._pending
        if pending is not None and (pending.beam_entries or pending.processor_requests):
            # A beam-search request's next beams are chosen on the host from the in-flight
            # step's candidates, and a host logits processor reads every previous token: such a
            # request sits this step out; the other requests stay overlapped.
            waiting = {id(entry[0].beam) for entry in pending.beam_entries or ()}
            held = {id(r) for r in pending.processor_requests}
            candidates = [r for r in candidates
                          if id(r) not in held and (r.beam is None or id(r.beam) not in waiting)]
        if (pending is not None and self._num_needing_history
                and any(r.sampling_params.needs_history for r in candidates)):
            in_flight = {id(entry[0]) for entry in pending.entries}
            if any(r.sampling_params.needs_history and id(r) in in_flight for r in candidates):
                # Penalties and bad-word lists need every previous token on the host: no overlap here.
                updates += self.readback.process(pending)
                self._pending = None
                candidates = self._schedulable()
        dispatched = self._dispatch(candidates)
        updates += self._failed
        self._failed = []
        if self._pending is not None:
            updates += self.readback.process(self._pending)
        self._pending = dispatched
        self._steady_candidates = None
        if dispatched is not None and dispatched.decode is not None:
            decode = dispatched.decode
            # Each request now holds index + 1 outputs; it stays a candidate below max_tokens.
            if not self.readback.stops_of(decode, dispatched.decode_index).length_due(dispatched.decode_index):
                self._steady_candidates = (decode.requests, self._active_changes)
        if self._pending is not None and not self.overlap:
            updates += self.readback.process(self._pending)
            self._pending = None
        elapsed = time.perf_counter() - started
        self.timing.steps += 1
        self.timing.host_seconds += elapsed - self._wait_seconds
        self.timing.device_wait_seconds += self._wait_seconds
        self._wait_seconds = 0.0
        if self.bucket_compiler is not None and not self.has_unfinished_requests():
            self.on_idle()
        if dispatched is not None:
            dispatched.stats["iterLatencyMS"] = elapsed * 1e3
            dispatched.stats["numCompletedRequests"] = updates.num_finished
            self._record_stats(dispatched.stats)
        return updates

    def _dispatch(self, candidates: list[LlmRequest]) -> Optional[_PendingStep]:
        """Plan and launch one step. Requests that make planning it fail are failed
        (collected in `self._failed`); the step runs for the others."""
        if not candidates:
            return None
        # A steady batch keeps its tokens in a log unless a request needs them every step.
        self.planner.defer_tokens = self.token_log and not (
            self._num_logits_requests or self._num_wanting_logprobs or self._num_needing_history
            or self._num_beam_search)
        try:
            output = self.planner.schedule(candidates)
            if output is None:
                return None
        except Exception as exc:  # no request to single out: those that could run fail
            self._failed += self._fail(candidates, exc, "scheduling a step")
            return None
        in_flight = None if self._pending is None else self._pending.entries
        try:
            plan = self.planner.build(output, in_flight)
        except Exception as exc:
            culprits = self._find_culprits(output, in_flight) or output.all_requests()
            self._failed += self._fail(culprits, exc, "building a step")
            failed = set(culprits)
            output = SchedulerOutput([r for r in output.context_requests if r not in failed],
                                     [r for r in output.generation_requests if r not in failed],
                                     output.paused_requests, output.num_fitting_requests)
            if output.is_empty:
                return None
            try:
                plan = self.planner.build(output, in_flight)
            except Exception as exc:
                self._failed += self._fail(output.all_requests(), exc, "building a step")
                return None
        if self.lora_slots is not None:  # adapters newly given a slot: written before the step reads them
            for slot, adapter in self.lora_slots.take_loads():
                self.runner.write_lora_slot(slot, self._slot_update(adapter))
        targets, processor_failures = None, []
        if self._num_logits_requests:
            fields, targets = plan_step_logits(
                output.all_requests(), len(output.context_requests), plan.batch.cu_q_lens,
                plan.batch.token_ids.shape[-1], self.config.min_token_bucket, self.num_sampler_rows)
            if targets is not None:
                plan = replace(plan, **fields)
        balancer = self.load_balancer
        updated_layers = balancer.apply_round(self.runner.params) if balancer is not None else []
        dispatch_start = time.perf_counter()
        if targets is not None and targets.processors:
            hook = host_processor_hook([request for request, _ in targets.processors], processor_failures)
            sampler_output = self.runner.execute(plan, host_processor=hook)
        else:
            sampler_output = self.runner.execute(plan)
        self.timing.dispatch_seconds += time.perf_counter() - dispatch_start
        if self.on_dispatch is not None:
            self.on_dispatch(self.runner.last_enqueue_time, sampler_output)
        if balancer is not None:
            balancer.after_forward(self.runner.last_expert_counts)
        iteration = self.iteration  # index of this step (stats are recorded once it is dispatched)
        writer = self.expert_statistics
        wanted = balancer is not None or (writer is not None and writer.wants(iteration))
        expert_counts = self.runner.last_expert_counts if wanted else None
        wants_logprobs = bool(self._num_wanting_logprobs) and any(
            r.sampling_params.logprobs is not None for r in output.all_requests())
        num_new = sum(1 for r in output.context_requests if r.is_first_context_chunk)
        entries = self.planner.commit(output)
        beam_entries = None
        if self._num_beam_search:
            beam_entries = [e for e in entries if e[0].beam is not None]
            if beam_entries:
                entries = [e for e in entries if e[0].beam is None]
        decode = getattr(output.kv_placement, "decode", None)
        if decode is not None and decode.entries is not entries:
            decode = None
        stats = {
            "numNewActiveRequests": num_new,
            "inflightBatchingStats": {
                "numScheduledRequests": output.batch_size,
                "numContextRequests": len(output.context_requests),
                "numGenRequests": len(output.generation_requests),
                "numPausedRequests": len(output.paused_requests),
                "numCtxTokens": plan.num_context_tokens,
            },
        }
        if balancer is not None:
            stats["moeLoadBalancerStats"] = balancer.iteration_stats(updated_layers)
        pending = _PendingStep(sampler_output, entries, wants_logprobs, stats, iteration, expert_counts,
                               balancer.tables if balancer is not None else None, beam_entries or None)
        if decode is not None:
            pending.decode, pending.decode_index = decode, entries.index
        if targets is not None and targets.processors:
            pending.processor_requests = tuple(request for request, _ in targets.processors)
            pending.processor_rows = tuple(row for _, row in targets.processors)
            pending.processed_output = self.runner.last_processed
            pending.processor_failures = processor_failures
        if targets is not None:
            pending.logits_targets = targets
            pending.context_logits = self.runner.last_context_logits if targets.context else None
            pending.row_logits = self.runner.last_row_logits if targets.generation else None
            # The pending step holds them now; the runner drops its references, so they are
            # freed as soon as they have been copied to the host.
            self.runner.last_context_logits = self.runner.last_row_logits = None
        return pending

    def _find_culprits(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]]) -> list[LlmRequest]:
        """The requests of a step whose plan cannot be built even alone."""
        alone = [SchedulerOutput([r], []) for r in output.context_requests]
        alone += [SchedulerOutput([], [r]) for r in output.generation_requests]
        culprits = []
        for single in alone:
            try:
                self.planner.build(single, in_flight)
            except Exception:
                culprits += single.all_requests()
        return culprits

    def _finish(self, request: LlmRequest, reason: str, stop_reason, num_outputs: int) -> None:
        self.planner.materialize_tokens()
        del request.output_token_ids[num_outputs:]
        request.stop_reason = stop_reason
        request.finish(reason)
        self.kv_cache_manager.free_resources(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        if self.active.pop(request.request_id, None) is not None:
            self._active_changes += 1
            params = request.sampling_params
            self._num_needing_history -= params.needs_history
            self._num_wanting_logprobs -= params.logprobs is not None
            if request.beam is not None:
                self._num_beam_search -= 1
                self.planner.beam_search_active = self._num_beam_search > 0
            self._num_logits_requests -= request.logits_record is not None

    @staticmethod
    def logits_outputs(request: LlmRequest) -> Optional[dict]:
        """A finished request's logits outputs (`context_logits`, `generation_logits`,
        `prompt_logprobs`, those it asked for), or None when it asked for none."""
        record = request.logits_record
        if record is None:
            return None
        return record.outputs(request.sampling_params, len(request.output_token_ids)) or None

    # ------------------------------------------------------------------ stats
    def close_statistics(self) -> None:
        """Write the expert statistics recorded so far (they are also written once the
        iteration range ends)."""
        if self.expert_statistics is not None:
            self.expert_statistics.save()

    def close(self) -> None:
        """Write pending statistics, stop the load balancer's placement thread and the compile
        threads, and end the multi-host session (the followers drop their copy of the engine)."""
        self.close_statistics()
        if self.bucket_compiler is not None:
            self.bucket_compiler.close()
        if self.load_balancer is not None:
            self.load_balancer.close()
        end_session = getattr(self.runner, "close", None)
        if end_session is not None:
            end_session()

    def _record_stats(self, stats: dict) -> None:
        self.iteration += 1
        stats.update({
            "timestamp": time.time(),
            "iter": self.iteration,
            "numActiveRequests": len(self.active),
            "numQueuedRequests": self.num_queued,
            "maxNumActiveRequests": self.config.max_batch_size,
            "maxBatchSizeRuntime": self.config.max_batch_size,
            "maxNumTokensRuntime": self.config.max_num_tokens,
            "kvCacheStats": self.kv_cache_manager.get_kv_cache_stats().to_dict(),
        })
        self.iteration_stats.append(stats)
        del self.iteration_stats[:-self.max_iteration_stats]
