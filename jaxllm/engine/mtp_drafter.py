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

Drafts are greedy (a one-hot draft distribution): the existing verifier accepts them exactly
(greedy rows) or by rejection sampling (sampled rows). A request that did not run in step N
(preempted, paused) does not draft in step N + 1; a step planned without a read-back
(`Speculation.propose` not called) leaves its positions' MTP entries unwritten, which only
lowers later acceptance, never changes an output token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.models import ModelConfig
from jaxllm.models.mtp import init_mtp_kv_cache, mtp_draft
from jaxllm.speculative_config import MTPDecodingConfig
from jaxllm.step_batch import StepBatch

_GENERATING = LlmRequestState.GENERATION_IN_PROGRESS


def check_mtp_model(config: ModelConfig) -> None:
    """ValueError unless `config` is a model with MTP layers (MTPDecodingConfig needs them)."""
    if not config.is_mla or not config.num_nextn_predict_layers:
        raise ValueError(
            "speculative_config: MTPDecodingConfig needs a checkpoint with multi-token-prediction layers "
            f"(num_nextn_predict_layers in its config); {config.architecture} has none"
        )


def check_mtp_config(config: MTPDecodingConfig) -> None:
    """ValueError for MTP options the engine does not implement."""
    if config.use_relaxed_acceptance_for_thinking:
        raise ValueError(
            "MTPDecodingConfig.use_relaxed_acceptance_for_thinking is not supported: drafts are accepted exactly"
        )


@dataclass
class _Step:
    """A dispatched step the MTP layer has not run over yet."""

    batch: StepBatch  # host arrays
    requests: list[LlmRequest]  # by row
    hidden: jax.Array  # [T, H] the target's final hidden states of the packed tokens


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


class MTPDrafter:
    """Runs the MTP layers after each step and hands out the next step's drafts
    (engine thread only). Also the proposer interface of `Speculation`
    (`propose(request_id, tokens, k)`, `request_ids`, `release`)."""

    def __init__(self, config: MTPDecodingConfig, runner: Any, num_blocks: int, tokens_per_block: int) -> None:
        """`runner`: the target's `ModelRunner` (built with `return_hidden=True`, its params
        holding the MTP layers)."""
        check_mtp_config(config)
        model_config: ModelConfig = runner.model_config
        check_mtp_model(model_config)
        if "mtp" not in runner.params:
            raise ValueError("speculative_config: the model was loaded without its MTP layers (load_mtp)")
        self.num_draft_tokens = config.num_nextn_predict_layers
        self.runner = runner
        kv_dtype = jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype
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
        self._last: Optional[_Step] = None
        self._drafts: dict[int, list[int]] = {}
        self.steps_run = 0  # MTP programs run

    @property
    def num_compiled(self) -> int:
        return int(self._jit._cache_size())

    # ------------------------------------------------------------------ engine hooks
    def dispatched(self, batch: StepBatch, requests: list[LlmRequest]) -> None:
        """Step N was dispatched with `batch` over `requests` (by row): keep what the MTP
        layer runs over once its tokens are read back."""
        hidden = self.runner.last_hidden
        self._last = None if hidden is None else _Step(batch, list(requests), hidden)

    def begin_step(self) -> None:
        """Before the next step's drafts are asked for (every token of step N on the host):
        run the MTP layer over step N and keep each generating row's drafts."""
        step, self._last = self._last, None
        self._drafts = {}
        if step is None:
            return
        mtp_batch, rows = mtp_inputs(step.batch, step.requests)
        drafts, self.cache = self._jit(self.runner.params, self.cache, mtp_batch, step.hidden)
        self.steps_run += 1
        if rows:
            host = np.asarray(drafts)
            self._drafts = {rid: host[row].tolist() for row, rid in rows.items()}

    def warmup(self, batch: StepBatch, hidden: jax.Array) -> None:
        """Compile (and run on an all-padding step) the MTP program of `batch`'s shape."""
        drafts, self.cache = self._jit(self.runner.params, self.cache, batch, hidden)
        jax.block_until_ready(drafts)

    # ------------------------------------------------------------------ proposer interface
    def propose(self, request_id: int, tokens: Any, max_len: Optional[int] = None) -> list[int]:
        draft = self._drafts.get(request_id, [])
        return draft if max_len is None else draft[:max_len]

    def request_ids(self) -> list[int]:
        return []

    def release(self, request_id: int) -> None:
        self._drafts.pop(request_id, None)


def mtp_drafter(config: Any, runner: Any, kv_cache_manager: Any) -> Optional[MTPDrafter]:
    """The drafter of an engine built with `config` (an `MTPDecodingConfig`), else None."""
    if not isinstance(config, MTPDecodingConfig):
        return None
    return MTPDrafter(config, runner, kv_cache_manager.num_blocks, kv_cache_manager.tokens_per_block)


def mtp_inputs(batch: StepBatch, requests: list[LlmRequest]) -> tuple[StepBatch, dict[int, int]]:
    """The MTP program's batch for a read-back step, and {row: request id} of the rows that
    draft: each packed token at position i gets its next token t_{i+1} (0 where it is not
    kept: a rejected draft, a finished request), and a generating row's logits index points
    at its last kept position (len(tokens) - 2: the next token is the one just produced)."""
    token_ids = np.zeros_like(np.asarray(batch.token_ids))
    logits_indices = np.array(batch.logits_indices, copy=True)
    cu = np.asarray(batch.cu_q_lens)
    positions = np.asarray(batch.positions)
    rows: dict[int, int] = {}
    for row, request in enumerate(requests):
        start, end = int(cu[row]), int(cu[row + 1])
        if end <= start:
            continue
        tokens = request.all_token_ids
        first = int(positions[start])
        n = min(end - start, len(tokens) - 1 - first)
        if n > 0:
            token_ids[start : start + n] = tokens[first + 1 : first + 1 + n]
        last = len(tokens) - 2
        if request.state is _GENERATING and first <= last < first + (end - start):
            logits_indices[row] = start + last - first
            rows[row] = request.request_id
    return replace(batch, token_ids=token_ids, logits_indices=logits_indices), rows
