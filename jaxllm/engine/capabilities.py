"""Which features combine: every "X is not supported with Y" rule of the engine, in one place.

Layout rules are decided once, when the engine is built (`check_layout`, `check_lora_layout`),
and raise a ValueError naming the option. What a request may ask for is decided once per
engine too (`Capabilities`), and each request is checked against it at admission
(`Capabilities.check_beam_search`), so a refused combination never reaches a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.llm_args import CapacitySchedulerPolicy
from jaxllm.models.model_config import ModelConfig
from jaxllm.sampling import SamplingParams


@dataclass(frozen=True)
class Layout:
    """What the rules look at besides the configs: where the engine runs."""

    platform: str  # of the mesh's devices ("cpu", "gpu", ...)
    num_devices: int  # in the mesh
    multiprocess: bool  # a multi-host run


def check_layout(config: EngineConfig, model_config: ModelConfig, layout: Layout) -> None:
    """The engine-wide combinations that cannot run (ValueError naming the option)."""
    if config.moe_config.dispatch == "ragged_all_to_all" and layout.platform == "cpu":
        raise ValueError(
            "moe dispatch 'ragged_all_to_all' needs a platform that implements "
            "jax.lax.ragged_all_to_all (XLA:CPU does not); use all_to_all, allgather or auto"
        )
    tpb = config.kv_cache_config.tokens_per_block
    if config.enable_chunked_prefill and config.max_num_tokens < tpb:
        raise ValueError(
            f"max_num_tokens ({config.max_num_tokens}) must be at least tokens_per_block ({tpb}): "
            "prompt chunks are whole blocks, so no prompt could ever start"
        )
    balancer = config.moe_config.load_balancer
    if balancer is not None and balancer.layer_updates_per_iter > 0 and layout.multiprocess:
        raise ValueError(
            "moe_config.load_balancer: online expert load balancing (layer_updates_per_iter > 0) "
            "is not supported in multi-host runs: its slot writes run outside the mirrored step"
        )
    if config.enable_lora:
        check_lora_layout(config, model_config, layout)


def check_lora_layout(config: EngineConfig, model_config: ModelConfig, layout: Layout) -> None:
    """LoRA adapters run on one device, without expert slots (ValueError otherwise)."""
    unsupported = []
    if model_config.is_mla:
        unsupported.append(f"{model_config.architecture} (multi-head latent attention)")
    if layout.num_devices > 1:
        unsupported.append(
            f"a mesh of {layout.num_devices} devices (tensor / expert parallelism, attention data parallelism)"
        )
    if config.moe_config.load_balancer is not None:
        unsupported.append("expert slots (moe_config.load_balancer)")
    if layout.multiprocess:
        unsupported.append("multi-host runs")
    if unsupported:
        raise ValueError(
            f"enable_lora: LoRA adapters are not supported with {' or '.join(unsupported)}; "
            "they run on one device with dense or MoE (attention-only adapters) models"
        )


@dataclass(frozen=True)
class Capabilities:
    """What requests may ask of this engine: None where a feature works, else why not."""

    logits_outputs: Optional[str]
    beam_search: Optional[str]
    max_batch_size: int
    max_num_tokens: int

    @classmethod
    def of(cls, config: EngineConfig, layout: Layout) -> Capabilities:
        return cls(
            logits_outputs=_logits_unsupported(config, layout),
            beam_search=_beam_search_unsupported(config, layout),
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
        )

    def check_beam_search(
        self, params: SamplingParams, prompt_len: int, tokens_per_block: int, max_blocks: int
    ) -> None:
        """Whether this engine can search `params.beam_width` beams for a prompt of
        `prompt_len` tokens in a cache of `max_blocks` blocks (ValueError otherwise)."""
        if self.beam_search is not None:
            raise ValueError(self.beam_search)
        width = params.beam_width
        if width > self.max_batch_size or width > self.max_num_tokens:
            raise ValueError(
                f"use_beam_search: beam width {width} exceeds max_batch_size "
                f"({self.max_batch_size}) or max_num_tokens ({self.max_num_tokens}); "
                "each beam is a row of the step"
            )
        per_beam = -(-(prompt_len + params.max_tokens) // tokens_per_block)
        blocks = width * per_beam - (width - 1) * (prompt_len // tokens_per_block)
        if blocks > max_blocks:
            raise ValueError(
                f"max_tokens: {width} beams of prompt ({prompt_len} tokens) + max_tokens "
                f"({params.max_tokens}) need up to {blocks} KV blocks, more than the cache holds "
                f"({max_blocks})"
            )


def _logits_unsupported(config: EngineConfig, layout: Layout) -> Optional[str]:
    if config.enable_attention_dp:
        return "logits outputs and post-processors are not supported with attention data parallelism"
    if layout.multiprocess:
        return (
            "logits outputs and post-processors are not supported in multi-host runs (the followers "
            "mirror only the plain step)"
        )
    return None


def _beam_search_unsupported(config: EngineConfig, layout: Layout) -> Optional[str]:
    if config.enable_attention_dp:
        return "use_beam_search is not supported with enable_attention_dp"
    if layout.multiprocess:
        return (
            "use_beam_search is not supported in multi-host runs (beam forks copy KV blocks outside the mirrored step)"
        )
    if config.scheduler_config.capacity_scheduler_policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
        return (
            "use_beam_search needs the GUARANTEED_NO_EVICT capacity scheduler policy: "
            "MAX_UTILIZATION pauses requests, and paused beams cannot be recomputed"
        )
    return None


def check_engine_speculation(config: Any) -> None:
    """ValueError naming what the engine of `config` (an `EngineConfig`) cannot combine with its
    speculative_config (checked before the engine is built). Every method also runs under
    attention DP: n-gram drafts on the host, the drafters with one device pool per rank."""
    # a generation-only request's first tokens never reach a drafter's pool
    if config.speculative_config is not None and config.cache_transceiver_config is not None:
        raise ValueError("speculative_config is not supported with cache_transceiver_config yet")
