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
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.step_drafter import StepDrafter
from jaxllm.models import ModelConfig, forward, init_kv_cache, load_model_config, load_params
from jaxllm.models.draft_chain import follow_up_batch
from jaxllm.models.resolve import resolve_model
from jaxllm.speculative_config import DraftTargetDecodingConfig
from jaxllm.step_batch import StepBatch


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
    _, cache = forward(params, cache, batch, config=config, **layers)
    live = jnp.arange(batch.block_tables.shape[0], dtype=jnp.int32) < batch.num_seqs[0]
    tokens, drafts = last_tokens, []
    for j in range(num_draft_tokens):
        step = follow_up_batch(
            batch, tokens, j + 1, tokens_per_block=tokens_per_block, num_blocks=num_blocks, own_blocks_only=True
        )
        logits, cache = forward(params, cache, step, config=config, **layers)
        tokens = jnp.where(live, jnp.argmax(logits, axis=-1), 0).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), cache


class DraftModelDrafter(StepDrafter):
    """Runs the draft model after each step and hands out the next step's drafts."""

    def __init__(self, config: DraftTargetDecodingConfig, runner: Any, num_blocks: int, tokens_per_block: int) -> None:
        super().__init__(runner, config.max_draft_len)
        directory, self.model_config = load_draft_config(config, runner.model_config)
        self.params = load_params(directory, self.model_config, mesh=runner.mesh)
        kv_dtype = jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype
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

    shift = 0  # the draft model takes each position's own token

    def launch(self, batch: StepBatch, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        drafts, self.cache = self._jit(self.params, self.cache, *self._on_mesh((batch, last_tokens)))
        return drafts
