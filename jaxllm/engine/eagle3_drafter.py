"""EAGLE-3 drafting inside the engine (`EagleDecodingConfig(eagle3_one_model=True)`).

The head (`speculative_model_dir`, the published EAGLE-3 layout: `jaxllm.models.eagle3`) runs
on the target's low/mid/high hidden states: the runner's forward returns, for every packed
token, the residuals entering the head's three feature layers (`ModelRunner(hidden_aux_layers=)`),
flattened to the fused features [T, 3 H]. After step N is read back (`StepDrafter`), one jitted
program runs the head over step N's packed tokens (position i takes the features of i and the
token t_{i+1}, writing the head's one-layer KV, addressed by the target's block ids and counted
in the KV budget) and chains `max_draft_len` greedy drafts per generating row from its last
kept position, each mapped to a target id through `d2t` and fed back. Drafts are verified as
n-gram and MTP drafts are (one-hot draft distribution). Under attention data parallelism the
head is replicated, each rank has its own page pool and the program drafts each rank's rows on
its device from its own features (`jaxllm.models.parallel.attention_dp_drafting`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.engine.step_drafter import StepDrafter
from jaxllm.models import ModelConfig
from jaxllm.models.eagle3 import aux_layers_for, eagle3_draft, init_eagle3_kv_cache
from jaxllm.models.eagle3_weights import Eagle3Config, load_eagle3_config, load_eagle3_params
from jaxllm.models.kv_cache_spec import init_dp_kv_cache
from jaxllm.models.parallel.attention_dp_drafting import eagle3_draft_attention_dp
from jaxllm.speculative_config import EagleDecodingConfig
from jaxllm.step_batch import StepBatch

_WHERE = "EagleDecodingConfig.speculative_model_dir"


def load_head_config(config: EagleDecodingConfig, target: ModelConfig) -> tuple[Eagle3Config, tuple[int, ...]]:
    """The head's config and the target layers it fuses; ValueError naming the field when the
    head cannot be read or does not fit the target."""
    if not config.eagle3_one_model:
        raise ValueError("EagleDecodingConfig.eagle3_one_model=False (a separate draft engine) is not supported")
    if target.is_mla:
        raise ValueError(f"{_WHERE}: EAGLE-3 heads draft for Llama-style targets, not {target.architecture}")
    try:
        head = load_eagle3_config(str(config.speculative_model_dir), dtype=target.dtype)
        layers = aux_layers_for(head, target.num_layers)
    except Exception as exc:
        raise ValueError(f"{_WHERE}: cannot use {config.speculative_model_dir!r}: {exc}") from None
    if head.target_hidden_size != target.hidden_size or head.model.vocab_size != target.vocab_size:
        raise ValueError(
            f"{_WHERE}: the head is for a target of hidden size {head.target_hidden_size} and vocabulary "
            f"{head.model.vocab_size}, this target has {target.hidden_size} and {target.vocab_size}"
        )
    return head, layers


def _draft_program(params, embed, cache, batch, features, *, num_draft_tokens, config, attention_fn, mesh):
    """The head's chain of drafts, attending with the target's attention backend (a kernel or
    the tiled XLA loop, whose trip counts come from shapes) under the target's mesh."""
    drafts, cache, _ = eagle3_draft(
        params,
        embed,
        cache,
        batch,
        features,
        num_draft_tokens,
        config=config,
        attention_fn=attention_fn,
        mesh=mesh,
        own_blocks_only=True,
    )
    return drafts, cache


class Eagle3Drafter(StepDrafter):
    """Runs the EAGLE-3 head after each step and hands out the next step's drafts."""

    def __init__(self, config: EagleDecodingConfig, runner: Any, num_blocks: int, tokens_per_block: int) -> None:
        super().__init__(runner, config.max_draft_len)
        self.head_config, _ = load_head_config(config, runner.model_config)
        kv_dtype = jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype
        if runner.attention_dp:  # the head replicated, one page pool per rank, each rank drafting its rows
            mesh = runner.mesh
            params = load_eagle3_params(str(config.speculative_model_dir), self.head_config, runner.model_config.dtype)
            self.params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
            self.cache = init_dp_kv_cache(self.head_config.model, num_blocks, tokens_per_block, kv_dtype, mesh)
            self._jit = jax.jit(
                functools.partial(
                    eagle3_draft_attention_dp,
                    num_draft_tokens=self.num_draft_tokens,
                    config=self.head_config,
                    mesh=mesh,
                    attention_fn=runner.attention_fn,
                ),
                donate_argnums=(2,),
            )
            return
        self.params = load_eagle3_params(
            str(config.speculative_model_dir), self.head_config, runner.model_config.dtype, mesh=runner.mesh
        )
        self.cache = init_eagle3_kv_cache(self.head_config, num_blocks, tokens_per_block, kv_dtype, mesh=runner.mesh)
        self._jit = jax.jit(
            functools.partial(
                _draft_program,
                num_draft_tokens=self.num_draft_tokens,
                config=self.head_config,
                attention_fn=runner.attention_fn,
                mesh=runner.mesh,
            ),
            donate_argnums=(2,),
        )

    def launch(self, batch: StepBatch, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        if hidden is None:
            raise RuntimeError("the target's forward returned no hidden states for EAGLE-3")
        embed = self.runner.params["embed"]
        drafts, self.cache = self._jit(self.params, embed, self.cache, self._on_mesh(batch), hidden)
        return drafts
