"""DeepSeek-V3 MTP drafting inside the engine: the drafts of step N + 1 come out of step N.

An engine built with `MTPDecodingConfig` loads the checkpoint's MTP layers
(`load_params(load_mtp=True)`), its runner returns every packed token's final hidden state
(`ModelRunner(return_hidden=True)`, `last_hidden`), and the MTP layers keep their own latent
page pool (`init_mtp_kv_cache`, counted in the KV budget) addressed by the target's block ids.

After step N is read back, every token the step processed knows its next token (the prompt's
next token, an accepted draft or the token the target just produced), so one jitted program
(`mtp_draft`) runs over step N's packed tokens with its positions and block tables:

* it writes the MTP layer's KV entry of every position step N processed (position i holds
  (h_i, t_{i+1})); a rejected draft's position gets an entry too, past the kept sequence,
  overwritten when that position is processed again, as the target's;
* from each generating row's last kept position (the one whose next token the target just
  produced) it chains `num_nextn_predict_layers` greedy drafts (TensorRT-LLM's MTP-Eagle:
  the follow-up steps rerun the last MTP layer one token per row, writing scratch entries
  past the kept sequence, overwritten later the same way).

Drafts are greedy (a one-hot draft distribution): the verifier accepts them exactly (greedy
rows; inside a thinking span with `use_relaxed_acceptance_for_thinking`, by TensorRT-LLM's
relaxed rule: `jaxllm.engine.thinking_phase`) or by rejection sampling (sampled rows). A
request that did not run in step N (preempted, paused) does not draft in step N + 1; a step
planned without a read-back (`Speculation.propose` not called) leaves its positions' MTP
entries unwritten, which only lowers later acceptance, never changes an output token.

Under attention data parallelism every rank has its own MTP pool (a leading rank axis split over
the devices, addressed by that rank's block ids) and the program drafts each rank's rows on its
device (`jaxllm.models.parallel.attention_dp_drafting`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.step_drafter import StepDrafter
from jaxllm.models import ModelConfig
from jaxllm.models.mtp import init_mtp_kv_cache, mtp_draft
from jaxllm.models.parallel.attention_dp_drafting import init_dp_mtp_kv_cache, mtp_draft_attention_dp
from jaxllm.speculative_config import MTPDecodingConfig
from jaxllm.step_batch import StepBatch
from sharding.rules import param_partition_specs


def check_mtp_model(config: ModelConfig) -> None:
    """ValueError unless `config` is a model with MTP layers (MTPDecodingConfig needs them)."""
    if not config.is_mla or not config.num_nextn_predict_layers:
        raise ValueError(
            "speculative_config: MTPDecodingConfig needs a checkpoint with multi-token-prediction layers "
            f"(num_nextn_predict_layers in its config); {config.architecture} has none"
        )


def _draft_program(params, cache, batch, hidden, *, num_draft_tokens, config, attention_fn, moe_fn, mesh):
    drafts, cache, _ = mtp_draft(
        params,
        cache,
        batch,
        hidden,
        num_draft_tokens,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        own_blocks_only=True,
    )
    return drafts, cache


class MTPDrafter(StepDrafter):
    """Runs the MTP layers after each step and hands out the next step's drafts."""

    def __init__(self, config: MTPDecodingConfig, runner: Any, num_blocks: int, tokens_per_block: int) -> None:
        """`runner`: the target's `ModelRunner` (built with `return_hidden=True`, its params
        holding the MTP layers)."""
        model_config: ModelConfig = runner.model_config
        check_mtp_model(model_config)
        if "mtp" not in runner.params:
            raise ValueError("speculative_config: the model was loaded without its MTP layers (load_mtp)")
        super().__init__(runner, config.num_nextn_predict_layers)
        kv_dtype = jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype
        if runner.attention_dp:  # one MTP pool per rank, each rank drafting for its own rows
            self.cache = init_dp_mtp_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, runner.mesh)
            self._jit = jax.jit(
                functools.partial(
                    mtp_draft_attention_dp,
                    num_draft_tokens=self.num_draft_tokens,
                    config=model_config,
                    attention_fn=runner.attention_fn,
                    moe_fn=runner.moe_fn,
                    mesh=runner.mesh,
                    param_specs=param_partition_specs(runner.params),
                    moe_options=runner.moe_options,
                ),
                donate_argnums=(1,),
            )
            return
        self.cache = init_mtp_kv_cache(model_config, num_blocks, tokens_per_block, kv_dtype, mesh=runner.mesh)
        self._jit = jax.jit(
            functools.partial(
                _draft_program,
                num_draft_tokens=self.num_draft_tokens,
                config=model_config,
                attention_fn=runner.attention_fn,
                moe_fn=runner.moe_fn,
                mesh=runner.mesh,
            ),
            donate_argnums=(1,),
        )

    def launch(self, batch: StepBatch, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        if hidden is None:
            raise RuntimeError("the target's forward returned no hidden states for MTP")
        drafts, self.cache = self._jit(self.runner.params, self.cache, self._on_mesh(batch), hidden)
        return drafts
