"""Verifying draft tokens on the device (speculative sampling), one fixed-shape program.

The verification entries of a step are E target distributions, each with the draft token it
verifies: entry j of a speculating request holds the target's logits after its fed token and
drafts 1..j, and verifies draft j+1 (the last entry, after every draft, verifies nothing and
gives the bonus token). Every entry is processed exactly as the sampler processes a row
(`jaxllm.sampling.sampler`: penalties, suppression, grammar bitmask, temperature, top-k,
top-p, min-p) with the sampling tensors of its request at the output index it produces, so
the target distribution is the one sampling without drafts would draw from.

* Greedy entries accept the draft when it is the target's argmax; the emitted token is the
  argmax (equal to the draft when accepted). With relaxed acceptance (TensorRT-LLM's MTP
  `use_relaxed_acceptance_for_thinking`, greedy entries only), an entry flagged `thinking`
  also accepts a draft among the target's `relaxed_topk` most probable tokens whose
  probability is at least the top token's minus `relaxed_delta`; the emitted token is then the
  draft.
* Sampled entries use rejection sampling for a deterministic draft (the draft's distribution
  is a one-hot, as for n-gram drafts): accept draft d with probability p(d); on rejection
  draw from the residual norm(max(p - onehot(d), 0)), which is p without d, renormalised.
  An entry without a draft draws from p with the sampler's own key. Together they emit a
  token distributed exactly as p (Leviathan et al. 2023; vLLM's and TensorRT-LLM's rejection
  samplers reduce to this for one-hot drafts).

The host takes each request's accepted prefix (entries up to and including the first that
did not accept) from the returned `accepted` and `token_ids`. Random numbers derive from
(request seed, output index), as the sampler's, so a result does not depend on the batch.
`acceptance_rule(u, p_draft)` decides acceptance from a uniform draw and the draft's target
probability; it is a parameter so that a test can show a biased rule changes the output
distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.sampling.sampler import (
    apply_penalties,
    apply_suppression,
    apply_token_bitmask,
    filtered_logits,
    first_argmax,
    row_keys,
)
from jaxllm.sampling.tensors import SamplingTensors

AcceptanceRule = Callable[[jax.Array, jax.Array], jax.Array]

_ACCEPT_STREAM = 1  # fold-in constants of the per-entry key: the acceptance draw, the residual draw
_RESIDUAL_STREAM = 2


def exact_acceptance(u: jax.Array, p_draft: jax.Array) -> jax.Array:
    """Accept a one-hot draft with probability p_target(draft): keeps the target distribution."""
    return u < p_draft


@jax.tree_util.register_dataclass
@dataclass
class VerifyOutput:
    token_ids: jax.Array  # int32[E] the token each entry emits (its draft when accepted)
    accepted: jax.Array  # bool[E] the entry accepted its draft (False for entries without one)
    logprobs: jax.Array  # f32[E] raw log-softmax at token_ids
    top_ids: jax.Array  # int32[E, N]
    top_logprobs: jax.Array  # f32[E, N]


def relaxed_acceptance(x: jax.Array, draft: jax.Array, topk: int, delta: float) -> jax.Array:
    """bool[E]: `draft` is among the `topk` most probable tokens of softmax(x) [E, V] and its
    probability is at least the top token's minus `delta` (TensorRT-LLM's relaxed MTP rule).
    A token the row may not produce (probability 0: suppressed, banned) is never accepted."""
    probs = jax.nn.softmax(x, axis=-1)
    top_probs, top_ids = lax.top_k(probs, min(topk, x.shape[-1]))
    window = (top_ids == draft[:, None]) & (top_probs >= top_probs[:, :1] - delta) & (top_probs > 0)
    return jnp.any(window, axis=-1)


def verify_drafts(
    logits: jax.Array,
    t: SamplingTensors,
    draft_ids: jax.Array,
    thinking: Optional[jax.Array] = None,
    *,
    acceptance_rule: AcceptanceRule = exact_acceptance,
    relaxed_topk: int = 1,
    relaxed_delta: float = 0.0,
) -> VerifyOutput:
    """Verify `draft_ids` int32[E] (-1: no draft) against `logits` [E, V] with the per-entry
    sampling tensors `t` (E rows; `t.step` is the output index each entry emits). `thinking`
    bool[E] (None: none): the greedy entries that accept by the relaxed rule."""
    raw = logits.astype(jnp.float32)
    E, V = raw.shape
    x = apply_penalties(raw, t) if t.use_penalties else raw
    x = apply_suppression(x, t.suppress_ids)
    if t.use_token_bitmask:
        x = apply_token_bitmask(x, t.token_bitmask)
    has_draft = draft_ids >= 0
    draft = jnp.where(has_draft, draft_ids, 0)
    greedy_ids = first_argmax(x)
    accepted = has_draft & (greedy_ids == draft)
    if thinking is not None:
        accepted = accepted | (has_draft & thinking & relaxed_acceptance(x, draft, relaxed_topk, relaxed_delta))
    token_ids = jnp.where(accepted, draft, greedy_ids)
    if t.any_random:
        filtered = filtered_logits(x, t)
        probs = jax.nn.softmax(filtered, axis=-1)
        p_draft = jnp.take_along_axis(probs, draft[:, None], axis=-1)[:, 0]
        keys = row_keys(t)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_STREAM), (), jnp.float32))(keys)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        residual_gumbel = jax.vmap(
            lambda k: jax.random.gumbel(jax.random.fold_in(k, _RESIDUAL_STREAM), (V,), jnp.float32)
        )(keys)
        fresh = first_argmax(filtered + gumbel)  # no draft: the sampler's own draw
        without_draft = filtered.at[jnp.arange(E), draft].set(-jnp.inf)
        residual = first_argmax(without_draft + residual_gumbel)
        sampled_accept = has_draft & acceptance_rule(u, p_draft)
        sampled_token = jnp.where(has_draft, jnp.where(sampled_accept, draft, residual), fresh)
        is_random = t.temperature > 0.0
        accepted = jnp.where(is_random, sampled_accept, accepted)
        token_ids = jnp.where(is_random, sampled_token, token_ids)
    m = jnp.max(raw, axis=-1, keepdims=True)
    shifted = raw - m
    log_z = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(shifted, token_ids[:, None], axis=-1)[:, 0] - log_z[:, 0]
    n_top = t.num_top_logprobs
    if n_top > 0:
        top_vals, top_ids = lax.top_k(shifted, n_top)
        top_logprobs = top_vals - log_z
    else:
        top_ids = jnp.zeros((E, 0), jnp.int32)
        top_logprobs = jnp.zeros((E, 0), jnp.float32)
    return VerifyOutput(token_ids.astype(jnp.int32), accepted, chosen, top_ids.astype(jnp.int32), top_logprobs)


def entry_tensors(
    t: SamplingTensors, rows: np.ndarray, steps: np.ndarray, drafts_before: Optional[list[list[int]]] = None
) -> SamplingTensors:
    """Per-entry sampling tensors: entry e has the settings of row `rows[e]` at output index
    `steps[e]`. With penalties, its token history is the row's followed by the drafts before
    it (`drafts_before[e]`, output tokens), the history sampling at that index would see. No
    grammar or multi-token bad words: rows that need them do not draft."""

    def take(a: Any) -> np.ndarray:
        return np.asarray(a)[rows]

    E = rows.shape[0]
    temperature = take(t.temperature)
    any_random = bool((temperature > 0).any())
    if t.use_penalties:
        history_ids, history_is_output = take(t.history_ids), take(t.history_is_output)
        width = history_ids.shape[1]
        for e, before in enumerate(drafts_before or ()):
            if before:
                n = int((history_ids[e] >= 0).sum())
                if n + len(before) > width:
                    raise ValueError(f"history_len: entry {e} needs {n + len(before)} history slots, more than {width}")
                history_ids[e, n : n + len(before)] = before
                history_is_output[e, n : n + len(before)] = True
        penalties = (take(t.repetition_penalty), take(t.presence_penalty), take(t.frequency_penalty))
    else:
        history_ids, history_is_output = np.full((E, 1), -1, np.int32), np.zeros((E, 1), np.bool_)
        penalties = (np.ones(E, np.float32), np.zeros(E, np.float32), np.zeros(E, np.float32))
    return SamplingTensors(
        temperature=temperature,
        top_k=take(t.top_k),
        top_p=take(t.top_p),
        min_p=take(t.min_p),
        repetition_penalty=penalties[0],
        presence_penalty=penalties[1],
        frequency_penalty=penalties[2],
        seed=take(t.seed),
        step=steps.astype(np.int32),
        suppress_ids=take(t.suppress_ids),
        history_ids=history_ids,
        history_is_output=history_is_output,
        use_penalties=bool(t.use_penalties),
        num_top_logprobs=t.num_top_logprobs,
        any_random=any_random,
        use_top_k_top_p=bool(t.use_top_k_top_p and any_random),
    )
