"""A draft model drafting for the target (`DraftTargetDecodingConfig`).

A second, smaller model with the same vocabulary (`speculative_model_dir`) keeps its own KV
page pool, addressed by the target's block ids (one block covers the same tokens in both
pools; the builder counts its bytes per token in the KV budget). After step N is read back
(`StepDrafter`), one jitted program:

1. runs the draft model over step N's packed tokens (the kept tokens at their positions; a
   rejected draft's position gets an entry past the kept sequence, overwritten when that
   position is processed again), writing its KV;
2. feeds each generating row's newest token (the one the target just produced) at the next
   position and chains `max_draft_len` greedy drafts, one token per row per forward (writes
   past the blocks the row holds are dropped).

Drafts are greedy (a one-hot draft distribution), verified as n-gram and MTP drafts are.
Under attention data parallelism the draft model is laid out as the target (replicated weights,
experts as slots), each rank has its own page pool and the program drafts each rank's rows on
its device (`jaxllm.models.parallel.attention_dp_drafting`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.step_drafter import StepDrafter
from jaxllm.models import ModelConfig, forward, init_kv_cache, load_model_config, load_params
from jaxllm.models.draft_chain import model_chain_drafts
from jaxllm.models.kv_cache_spec import init_dp_kv_cache
from jaxllm.models.parallel.attention_dp_drafting import draft_model_attention_dp
from jaxllm.models.partitioning import attention_dp_rules
from jaxllm.models.resolve import resolve_model
from jaxllm.speculative_config import DraftTargetDecodingConfig
from jaxllm.step_batch import StepBatch
from sharding.rules import param_partition_specs


def load_draft_config(config: DraftTargetDecodingConfig, target: ModelConfig) -> tuple[str, ModelConfig]:
    """(directory, config) of the draft model, in the target's dtype; ValueError naming
    `speculative_model_dir` when it cannot be loaded or its vocabulary differs."""
    where = "DraftTargetDecodingConfig.speculative_model_dir"
    try:
        directory = str(resolve_model(config.speculative_model_dir))
        draft = load_model_config(directory, dtype=target.dtype)
    except Exception as exc:
        raise ValueError(f"{where}: cannot load {config.speculative_model_dir!r}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where}: the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}); a draft model must share the target's tokenizer"
        )
    return directory, draft


def _draft_program(
    params, cache, batch, last_tokens, *, num_draft_tokens, config, tokens_per_block, num_blocks, layers
):
    """`layers`: the target runner's attention and MoE functions, mesh and expert-parallel
    options (the draft model's weights and pool are on the target's mesh)."""
    return model_chain_drafts(
        lambda c, b: forward(params, c, b, config=config, **layers),
        cache,
        batch,
        last_tokens,
        num_draft_tokens,
        tokens_per_block=tokens_per_block,
        num_blocks=num_blocks,
    )


class DraftModelDrafter(StepDrafter):
    """Runs the draft model after each step and hands out the next step's drafts."""

    def __init__(self, config: DraftTargetDecodingConfig, runner: Any, num_blocks: int, tokens_per_block: int) -> None:
        super().__init__(runner, config.max_draft_len)
        directory, self.model_config = load_draft_config(config, runner.model_config)
        kv_dtype = jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype
        if runner.attention_dp:
            self._init_attention_dp(directory, num_blocks, tokens_per_block, kv_dtype)
            return
        self.params = load_params(directory, self.model_config, mesh=runner.mesh)
        self.cache = init_kv_cache(self.model_config, num_blocks, tokens_per_block, kv_dtype, mesh=runner.mesh)
        self._jit = jax.jit(
            functools.partial(
                _draft_program,
                num_draft_tokens=self.num_draft_tokens,
                config=self.model_config,
                tokens_per_block=tokens_per_block,
                num_blocks=num_blocks,
                layers=dict(
                    attention_fn=runner.attention_fn,
                    moe_fn=runner.moe_fn,
                    mesh=runner.mesh,
                    moe_options=runner.moe_options,
                ),
            ),
            donate_argnums=(1,),
        )

    def _init_attention_dp(self, directory: str, num_blocks: int, tokens_per_block: int, kv_dtype: Any) -> None:
        """Under attention DP: the draft model laid out as the target (weights replicated,
        experts as slots, per-layer caches), one page pool per rank, each rank drafting its rows."""
        runner, mesh = self.runner, self.runner.mesh
        self.model_config = replace(self.model_config, scan_layers=False)
        self.params = load_params(
            directory,
            self.model_config,
            mesh=mesh,
            rules=attention_dp_rules(self.model_config, mesh),
            num_slots=self.model_config.num_experts or None,
        )
        self.cache = init_dp_kv_cache(self.model_config, num_blocks, tokens_per_block, kv_dtype, mesh)
        self._jit = jax.jit(
            functools.partial(
                draft_model_attention_dp,
                num_draft_tokens=self.num_draft_tokens,
                config=self.model_config,
                tokens_per_block=tokens_per_block,
                num_blocks=num_blocks,
                attention_fn=runner.attention_fn,
                moe_fn=runner.moe_fn,
                mesh=mesh,
                param_specs=param_partition_specs(self.params),
                moe_options=runner.moe_options,
            ),
            donate_argnums=(1,),
        )

    shift = 0  # the draft model takes each position's own token

    def launch(self, batch: StepBatch, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        drafts, self.cache = self._jit(self.params, self.cache, *self._on_mesh((batch, last_tokens)))
        return drafts
