"""`EngineConfig` -> the parts of an engine: model, mesh, KV pool, planners, runner.

`build_runner` makes the device half (weights loaded onto the mesh, the KV pool sized, the
`ModelRunner`); a multi-host follower builds only this. `build_engine` adds the host half
on top: tokenizer, per-rank planners with their schedulers and KV block managers, LoRA
slots, KV events, expert statistics and the online load balancer. `LLMEngine` drives the
result; nothing here runs a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import jax

from jaxllm.batch_builder import choose_token_bucket, decode_batch_sizes
from jaxllm.engine.capabilities import Capabilities, Layout, check_engine_speculation, check_layout
from jaxllm.engine.compile_cache import compile_cache_requested, enable_compile_cache
from jaxllm.engine.draft_model_drafter import load_draft_config
from jaxllm.engine.eagle3_drafter import load_head_config
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.executable_store import ExecutableStore
from jaxllm.engine.kv_offload import KvOffloader, build_host_tier
from jaxllm.engine.load_balancer import OnlineLoadBalancer
from jaxllm.engine.logits_processing import check_batched_processors
from jaxllm.engine.memory_budget import check_engine_allocations
from jaxllm.engine.model_runner import ModelRunner
from jaxllm.engine.mtp_drafter import check_mtp_model
from jaxllm.engine.planner import Planner
from jaxllm.engine.ranked_planner import AttentionDpPlanner, RankAssignment, RankedKvCaches
from jaxllm.kv_cache import KVCacheManager
from jaxllm.kv_cache.events import KvCacheEventBuffer, KvEventRecorder
from jaxllm.kv_cache.host_tier import HostTier
from jaxllm.lora import LoraSlots
from jaxllm.lora.cache import AdapterCache
from jaxllm.lora.weights import init_lora_weights
from jaxllm.models import ModelConfig, kv_cache_bytes_per_token, load_model_config, load_params
from jaxllm.models.attention_work import AttentionWorkTiers
from jaxllm.models.backends import mosaic_fp8_selected, resolve_backends
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.kv_calibration import with_computed_kv_scales
from jaxllm.models.kv_quant import kv_storage_dtype, with_kv_cache_dtype
from jaxllm.models.mtp import mtp_kv_cache_spec
from jaxllm.models.partitioning import attention_dp_rules
from jaxllm.models.quantized_loading import with_dequantize_on_load, with_k_major_fp8, with_quantization
from jaxllm.models.random_params import random_params
from jaxllm.models.resolve import resolve_dtype, resolve_model
from jaxllm.scheduler import make_scheduler
from jaxllm.speculative_config import DraftTargetDecodingConfig, EagleDecodingConfig, MTPDecodingConfig
from jaxllm.tokenizer import load_tokenizer
from sharding import ParallelConfig, make_mesh
from sharding.eplb.statistics import ExpertStatisticsWriter
from sharding.mesh import expert_parallel_size
from sharding.multihost import agree_min, is_multiprocess

HOST_KV_CACHE_BYTES = 4 * 2**30
"""The KV pool's budget on a backend that reports no device memory (a CPU), unless
`kv_cache_config.max_tokens` sets the pool's size (vLLM's CPU KV space is 4 GiB too)."""


def plan_num_kv_blocks(
    *,
    model_config: ModelConfig,
    dtype: Any,
    tokens_per_block: int,
    max_tokens: int | None,
    free_memory_fraction: float,
    max_batch_size: int,
    max_seq_len: int,
    mesh: jax.sharding.Mesh | None = None,
    extra_bytes_per_token: int = 0,
) -> int:
    """Blocks in the pool: the smaller of `max_tokens` and the memory-fraction budget.

    On accelerators the budget is `fraction` of the device memory still free after the
    weights are loaded, on the device of the mesh with the least free memory (every
    device holds its share of every block, so the tightest one decides). Hosts report no
    such figure, so there the pool holds every sequence at full length within
    `HOST_KV_CACHE_BYTES` (or `max_tokens` when given, which may be larger): never a share of
    the memory free at start-up, so the same flags always give the same pool, the same
    programs and hits in the compilation cache. `extra_bytes_per_token`: a pool addressed by
    the same blocks (MTP's latent pages) counted in the budget.
    """
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
    bytes_per_block = (kv_cache_bytes_per_token(model_config, dtype, mesh) + extra_bytes_per_token) * tokens_per_block
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
        if max_tokens is None:
            limits.append(HOST_KV_CACHE_BYTES // bytes_per_block)
    num_blocks = min(limits)
    if num_blocks < 1:
        raise ValueError(
            "the KV cache budget does not hold a single block; raise "
            "kv_cache_config.max_tokens or free_gpu_memory_fraction"
        )
    return num_blocks


@dataclass
class RunnerParts:
    """The device half of an engine."""

    model_dir: Path
    model_config: ModelConfig
    mesh: jax.sharding.Mesh
    layout: Layout
    runner: ModelRunner
    num_blocks: int  # KV blocks per pool (per rank under attention DP)
    num_ranks: int  # attention-DP ranks (1 without attention DP)
    max_seq_len: int
    max_blocks_per_seq: int
    moe_layers: list[int]
    expert_statistics: Optional[ExpertStatisticsWriter]
    executable_store: Optional[ExecutableStore]
    attention_backend: str
    moe_backend: str


def drafter_bytes_per_token(config: EngineConfig, model_config: ModelConfig, kv_dtype: Any, mesh: Any) -> int:
    """KV bytes per token of a speculative drafter's own pool (MTP layers, a draft model),
    addressed by the target's blocks and so counted in its budget."""
    spec = config.speculative_config
    if isinstance(spec, MTPDecodingConfig):
        return mtp_kv_cache_spec(model_config, kv_dtype).bytes_per_token()
    if isinstance(spec, DraftTargetDecodingConfig):
        _, draft = load_draft_config(spec, model_config)
        return kv_cache_bytes_per_token(draft, kv_dtype, mesh)
    if isinstance(spec, EagleDecodingConfig):
        head, _ = load_head_config(spec, model_config)
        return kv_cache_bytes_per_token(head.model, kv_dtype, mesh)
    return 0


def check_dummy_weights(config: EngineConfig, use_mtp: bool, num_slots: Optional[int], ep_size: int) -> None:
    """Random weights (`load_format="dummy"`) cover the plain layout only: refuse the rest by name."""
    unsupported = [
        name
        for name, used in (
            ("quantization", config.quantization is not None),
            ("MTP speculative decoding", use_mtp),
            ("expert slots (a load balancer or attention data parallelism)", num_slots is not None),
            ("expert parallelism", ep_size > 1),
            ("kv_cache_config.calculate_kv_scales", config.kv_cache_config.calculate_kv_scales),
        )
        if used
    ]
    if unsupported:
        raise ValueError(f"load_format='dummy' does not support {', '.join(unsupported)}")


def build_runner(config: EngineConfig, *, leader_session: Optional[str] = None) -> RunnerParts:
    """Load the model onto the mesh and size the KV pool: the runner every process of a run
    builds alike (`leader_session`: the multi-host session this leader opened, if any)."""
    compile_cache_dir = enable_compile_cache() if compile_cache_requested(config.compile_cache) else None
    model_dir = resolve_model(config.model)  # preset, .gguf, directory or Hub id -> a directory
    dtype = resolve_dtype(config.dtype)  # "auto": the checkpoint's dtype, float32 on CPU
    # Layer stacks under lax.scan; attention data parallelism keeps per-layer caches (its
    # per-rank cache layout, jaxllm.models.parallel.attention_dp) and so the per-layer loop.
    model_config = replace(
        load_model_config(model_dir, dtype=dtype), scan_layers=config.scan_layers and not config.enable_attention_dp
    )
    model_config = with_quantization(model_config, config.quantization, config.fp8_activation_scheme)
    model_config = with_kv_cache_dtype(model_config, model_dir, config.kv_cache_config.dtype)
    kv_dtype = kv_storage_dtype(model_config)  # float8_e4m3fn for an FP8 KV cache
    parallel = config.parallel_config()
    mesh = make_mesh(parallel)  # every weight and the KV cache are sharded over it at load time
    layout = Layout(
        platform=mesh.devices.flat[0].platform, num_devices=mesh.devices.size, multiprocess=is_multiprocess()
    )
    model_config = with_dequantize_on_load(model_config, config.dequantize_on_load, layout.platform)
    # FP8 block weights stored as the Mosaic GPU FP8 kernels read them, where those run them.
    model_config = with_k_major_fp8(
        model_config, mosaic_fp8_selected(config.moe_backend, layout.platform, mesh.devices.flat[0])
    )
    check_layout(config, model_config, layout)
    use_mtp = isinstance(config.speculative_config, MTPDecodingConfig)
    if use_mtp:
        check_mtp_model(model_config)
    eagle_layers: tuple[int, ...] = ()
    if isinstance(config.speculative_config, EagleDecodingConfig):
        eagle_layers = load_head_config(config.speculative_config, model_config)[1]
    attention_dp = parallel.enable_attention_dp
    max_seq_len = config.max_seq_len or model_config.max_position_embeddings
    num_ranks = mesh.devices.size if attention_dp else 1
    # Before any weight or buffer is allocated: the limits' fixed buffers fit the memory.
    check_engine_allocations(config, model_config, max_seq_len, config.max_batch_size * num_ranks)
    # Expert parallelism: experts are stored as slots, placed as the load balancer config says.
    # Attention DP: attention and dense weights replicated, experts always stored as slots.
    balancer = config.moe_config.load_balancer
    num_slots = balancer.num_slots if balancer else None
    if attention_dp and num_slots is None and model_config.num_experts:
        num_slots = model_config.num_experts
    if config.load_format == "dummy":  # random weights drawn on the devices, no checkpoint read
        check_dummy_weights(config, use_mtp, num_slots, expert_parallel_size(mesh))
        params = random_params(model_config, mesh, seed=config.seed)
    else:
        params = load_params(
            model_dir,
            model_config,
            mesh=mesh,
            rules=attention_dp_rules(model_config, mesh) if attention_dp else None,
            slot_assignments=balancer.initial_global_assignments if balancer else None,
            num_slots=num_slots,
            load_mtp=use_mtp,
        )
    if config.kv_cache_config.calculate_kv_scales:  # FP8 KV scales from a calibration prefill
        if attention_dp:
            raise ValueError("calculate_kv_scales is not supported with attention data parallelism")
        model_config = with_computed_kv_scales(model_config, params, mesh, config.tokenizer or model_dir)
    moe_layers = [i for i in range(model_config.num_layers) if model_config.is_moe_layer(i)]
    # Offline expert statistics (EXPERT_STATISTIC_ITER_RANGE / EXPERT_STATISTIC_PATH), per expert.
    expert_statistics = (
        ExpertStatisticsWriter.from_env(
            num_experts_per_token=model_config.num_experts_per_tok,
            ep_size=parallel.moe_expert_parallel_size,
            layer_ids=moe_layers,
        )
        if moe_layers
        else None
    )
    kv_cfg = config.kv_cache_config
    tpb = kv_cfg.tokens_per_block
    # Under attention DP every device is a rank with this many blocks of its own.
    kv_meshes = [make_mesh(ParallelConfig(), [d]) for d in mesh.devices.flat] if attention_dp else [mesh]
    num_blocks = min(
        plan_num_kv_blocks(
            model_config=model_config,
            dtype=kv_dtype,
            tokens_per_block=tpb,
            max_tokens=kv_cfg.max_tokens,
            free_memory_fraction=kv_cfg.free_gpu_memory_fraction,
            max_batch_size=config.max_batch_size,
            max_seq_len=max_seq_len,
            mesh=kv_mesh,
            extra_bytes_per_token=drafter_bytes_per_token(config, model_config, kv_dtype, kv_mesh),
        )
        for kv_mesh in kv_meshes
    )
    num_blocks = agree_min("kv_cache_blocks", num_blocks)  # every host holds its share of every block
    attention_backend, moe_backend, attention_fn, moe_fn = resolve_backends(
        config.attention_backend, config.moe_backend, num_devices=mesh.size
    )
    online = balancer is not None and balancer.layer_updates_per_iter > 0
    # Compiled forwards and samplers kept beside the compilation cache: a later process with
    # this configuration loads them without tracing (jaxllm.engine.executable_store).
    executable_store = (
        ExecutableStore.beside_compile_cache(compile_cache_dir, config)
        if leader_session is None and not layout.multiprocess
        else None
    )
    runner = ModelRunner(
        model_config=model_config,
        params=params,
        num_blocks=num_blocks,
        tokens_per_block=tpb,
        kv_dtype=kv_dtype,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        max_batch_size=config.max_batch_size * num_ranks,
        mesh=mesh,
        moe_options=EpMoeOptions(
            dispatch=config.moe_config.dispatch, capacity_factor=config.moe_config.capacity_factor
        ),
        moe_stats=expert_statistics is not None or online,
        attention_dp=attention_dp,
        batched_processors=check_batched_processors(config.logits_post_processors),
        compile_workers=config.compile_workers,
        executable_store=executable_store,
        return_hidden=use_mtp or bool(eagle_layers),
        hidden_aux_layers=eagle_layers,
        attention_work=(
            AttentionWorkTiers(model_config, tpb)
            if getattr(attention_fn, "takes_work_bound", False)
            and not model_config.is_mla
            and not attention_dp
            and not layout.multiprocess
            else None
        ),
        fused_argmax=(
            config.fused_lm_head_argmax
            if config.fused_lm_head_argmax is not None
            else mesh.devices.flat[0].platform != "cpu"
        ),
    )
    if config.enable_lora:  # zeroed slots next to the weights: the step reads params["lora"]
        runner.params["lora"] = init_lora_weights(
            model_config, runner.params, config.max_loras, config.max_lora_rank, model_config.dtype
        )
    return RunnerParts(
        model_dir=model_dir,
        model_config=model_config,
        mesh=mesh,
        layout=layout,
        runner=runner,
        num_blocks=num_blocks,
        num_ranks=num_ranks,
        max_seq_len=max_seq_len,
        max_blocks_per_seq=math.ceil(max_seq_len / tpb),
        moe_layers=moe_layers,
        expert_statistics=expert_statistics,
        executable_store=executable_store,
        attention_backend=attention_backend,
        moe_backend=moe_backend,
    )


@dataclass
class EngineParts:
    """The host half of an engine, around its `RunnerParts`."""

    device: RunnerParts
    tokenizer: Any
    eos_ids: set[int]
    planner: Union[Planner, AttentionDpPlanner]
    kv_cache_manager: Union[KVCacheManager, RankedKvCaches]
    scheduler: Any  # None under attention DP (one per rank, inside the planner)
    num_sampler_rows: int  # rows of the sampler: max_batch_size per rank
    capabilities: Capabilities
    lora_slots: Optional[LoraSlots]
    adapters: Optional[AdapterCache]
    kv_events: Optional[KvCacheEventBuffer]
    load_balancer: Optional[OnlineLoadBalancer]
    kv_offload: Optional[KvOffloader] = None  # the host KV tier's copies (kv_cache_config.host_cache_size)


def engine_decode_batch_sizes(config: EngineConfig) -> list[int]:
    """The small decode buckets of `config` (`EngineConfig.decode_batch_sizes`), as rows."""
    decode_bucket = choose_token_bucket(config.max_batch_size, config.max_num_tokens, config.min_token_bucket)
    return decode_batch_sizes(config.max_batch_size, decode_bucket, config.decode_batch_sizes)


def build_engine(config: EngineConfig, *, leader_session: Optional[str] = None) -> EngineParts:
    """Everything `LLMEngine` drives, built from `config` (its speculative config checked first)."""
    check_engine_speculation(config)
    device = build_runner(config, leader_session=leader_session)
    model_config = device.model_config
    tokenizer = load_tokenizer(config.tokenizer or device.model_dir)
    eos_ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)
    kv_cfg = config.kv_cache_config
    # LoRA: adapter slots are a resource of the capacity scheduler (jaxllm.lora.slots).
    lora_slots = LoraSlots(config.max_loras) if config.enable_lora else None
    adapters = AdapterCache(model_config, config.max_lora_rank) if config.enable_lora else None
    # KV cache events (stored / removed / updated blocks) for get_kv_cache_events; off at 0.
    kv_events = (
        KvCacheEventBuffer(kv_cfg.event_buffer_max_size, window_size=device.max_seq_len)
        if kv_cfg.event_buffer_max_size > 0
        else None
    )

    host_tiers: list[HostTier] = []

    def rank_planner(rank: Optional[int] = None) -> Planner:
        events = None if kv_events is None else KvEventRecorder(kv_events, rank)
        host_tier = build_host_tier(
            kv_cfg, device.runner.kv_cache, device.num_blocks, attention_dp=config.enable_attention_dp, events=events
        )
        if host_tier is not None:
            host_tiers.append(host_tier)
        kv = KVCacheManager(
            device.num_blocks,
            kv_cfg.tokens_per_block,
            device.max_blocks_per_seq,
            enable_block_reuse=kv_cfg.enable_block_reuse,
            max_num_sequences=config.max_batch_size,
            events=events,
            host_tier=host_tier,
        )
        scheduler = make_scheduler(
            config.scheduler_config,
            kv,
            config.max_batch_size,
            config.max_num_tokens,
            config.enable_chunked_prefill,
            lora_slots=lora_slots,
            max_tokens_with_generation=config.tokens_with_generation(),
        )
        return Planner(
            scheduler=scheduler,
            kv_cache_manager=kv,
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            min_token_bucket=config.min_token_bucket,
            max_blocks_per_seq=device.max_blocks_per_seq,
            max_seq_len=device.max_seq_len,
            lora_slots=lora_slots,
            # Attention DP runs one bucket for all ranks: token buckets only.
            decode_batch_sizes=[] if config.enable_attention_dp else engine_decode_batch_sizes(config),
        )

    if config.enable_attention_dp:  # one scheduler and block pool per rank (jaxllm.engine.ranked_planner)
        assignment = RankAssignment(device.num_ranks)
        planner = AttentionDpPlanner([rank_planner(rank) for rank in range(device.num_ranks)], assignment)
        kv_cache_manager = planner.kv_cache_manager
        scheduler = None
    else:
        planner = rank_planner()
        kv_cache_manager, scheduler = planner.kv_cache_manager, planner.scheduler
    balancer = config.moe_config.load_balancer
    online = balancer is not None and balancer.layer_updates_per_iter > 0
    # Online expert load balancing: placements recomputed in the background, slots rewritten in place.
    load_balancer = (
        OnlineLoadBalancer(
            config=balancer,
            params=device.runner.params,
            moe_layers=device.moe_layers,
            num_experts=model_config.num_experts,
            ep_size=expert_parallel_size(device.mesh),
            mesh=device.mesh,
        )
        if online
        else None
    )
    return EngineParts(
        device=device,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        planner=planner,
        kv_cache_manager=kv_cache_manager,
        scheduler=scheduler,
        num_sampler_rows=config.max_batch_size * device.num_ranks,
        capabilities=Capabilities.of(config, device.layout),
        lora_slots=lora_slots,
        adapters=adapters,
        kv_events=kv_events,
        load_balancer=load_balancer,
        kv_offload=(
            KvOffloader(
                device.runner,
                host_tiers,
                device.num_blocks,
                attention_dp=config.enable_attention_dp,
                max_batch=device.max_blocks_per_seq,  # a whole sequence's blocks in one copy
            )
            if host_tiers
            else None
        ),
    )
