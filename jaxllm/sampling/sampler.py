"""The on-device sampler: one fixed-shape, fully vectorised function called inside the
jitted step, with no host synchronisation.

Order (vLLM / TensorRT-LLM): penalties -> suppression -> grammar bitmask -> greedy rows take the argmax;
sampled rows: temperature -> top-k -> top-p -> min-p -> categorical draw. The draw uses the
Gumbel-max trick with a key derived only from (request seed, output token index), so a
request's tokens do not depend on its row or on the other requests in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.sampling.tensors import SamplingTensors

_PRNG_IMPL = "threefry2x32"
_ARGMAX_BLOCK = (
    128  # values per block of `first_argmax`  # pinned so that seeded outputs do not depend on the default impl
)


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """A step's tokens. The three logprob fields are None for a step whose tokens came from
    the forward's argmax without a sampler run (`StepPlan.greedy_only`: no row wants them)."""

    token_ids: jax.Array  # int32[S] sampled token per row
    logprobs: Optional[jax.Array]  # f32[S] log-softmax of the raw logits at token_ids
    top_ids: Optional[jax.Array]  # int32[S, N] N highest raw-logit tokens, best first (N = num_top_logprobs)
    top_logprobs: Optional[jax.Array]  # f32[S, N] their raw log-softmax values


def sample(
    logits: jax.Array,
    t: SamplingTensors,
    *,
    num_top_logprobs: Optional[int] = None,
    use_penalties: Optional[bool] = None,
) -> SamplerOutput:
    """Sample one token per row of `logits` (f32 or bf16 [S, V]).

    All switches are static and default to the ones `SamplingTensors.build` recorded on
    `t`, so a jitted step only needs `t` as an ordinary argument. Passing a switch
    overrides it (use_penalties=True is harmless but wasted on a [S, 1] dummy history).
    There is no device-side branching: each switch removes code at trace time.
    """
    n_top = t.num_top_logprobs if num_top_logprobs is None else int(num_top_logprobs)
    penalties = t.use_penalties if use_penalties is None else bool(use_penalties)
    raw = logits.astype(jnp.float32)
    S, V = raw.shape
    if t.temperature.shape[0] != S:
        raise ValueError(f"logits have {S} rows but the sampling tensors have {t.temperature.shape[0]}")

    x = apply_penalties(raw, t) if penalties else raw
    x = apply_suppression(x, t.suppress_ids)
    if t.use_token_bitmask:
        x = apply_token_bitmask(x, t.token_bitmask)

    greedy_ids = first_argmax(x)
    if t.any_random:
        token_ids = jnp.where(t.temperature <= 0.0, greedy_ids, _sample_rows(x, t))
    else:
        token_ids = greedy_ids

    # Logprobs of the raw model distribution (what the model said, before any processing).
    m = jnp.max(raw, axis=-1, keepdims=True)
    shifted = raw - m
    log_z = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(shifted, token_ids[:, None], axis=-1) - log_z
    if n_top > 0:
        top_vals, top_ids = largest(shifted, n_top)
        top_logprobs = top_vals - log_z
    else:
        top_ids = jnp.zeros((S, 0), jnp.int32)
        top_logprobs = jnp.zeros((S, 0), jnp.float32)
    return SamplerOutput(
        token_ids=token_ids, logprobs=chosen[:, 0], top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs
    )


def largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` kept as a top-k: XLA:CPU otherwise turns a top-k whose values feed an
    elementwise fusion into a sort of the whole row (10 ms per 49K-value row, not 0.1 ms)."""
    values, ids = lax.top_k(x, k)
    # The barrier takes the values alone: one over the top-k's whole output tuple makes XLA's
    # TopkDecomposer fail a check (it expects get-tuple-element users) under SPMD partitioning.
    return lax.optimization_barrier(values), ids


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 index of the largest value of each row of x [S, V], the first one on ties, as
    `jnp.argmax` (a row holding NaN takes an unspecified index).

    XLA:CPU runs argmax as a scalar (value, index) reduction at several ns per element (12 ms
    per step for 64 rows of a 49K vocabulary); here the rows are cut into blocks of
    `_ARGMAX_BLOCK`: a plain max per block (vectorised), the argmax over the block maxima,
    then the argmax inside the winning block, plus the tail past the last whole block."""
    S, V = x.shape
    n = V // _ARGMAX_BLOCK
    if n < 2:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    main = n * _ARGMAX_BLOCK
    blocks = x[:, :main].reshape(S, n, _ARGMAX_BLOCK)
    block_max = blocks.max(axis=-1)
    best_block = jnp.argmax(block_max, axis=-1).astype(jnp.int32)
    within = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]
    ids = best_block * _ARGMAX_BLOCK + jnp.argmax(within, axis=-1).astype(jnp.int32)
    if main == V:
        return ids
    tail = x[:, main:]
    best = jnp.take_along_axis(block_max, best_block[:, None], axis=1)[:, 0]
    return jnp.where(tail.max(axis=-1) > best, main + jnp.argmax(tail, axis=-1).astype(jnp.int32), ids)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's definitions: repetition divides positive / multiplies negative logits of every
    token seen in prompt or output; frequency subtracts penalty * output count; presence
    subtracts penalty once for any token present in the output."""
    S, V = logits.shape
    ids = t.history_ids
    valid = ids >= 0
    idx = jnp.where(valid, ids, V)  # out of range: dropped by the scatters
    rows = jnp.arange(S)[:, None]
    counts = (
        jnp.zeros((S, V), jnp.int32).at[rows, idx].add((valid & t.history_is_output).astype(jnp.int32), mode="drop")
    )
    seen = jnp.zeros((S, V), jnp.bool_).at[rows, idx].set(True, mode="drop")

    rep = t.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    x = jnp.where(seen & (rep != 1.0), repeated, logits)
    adjust = t.frequency_penalty[:, None] * counts.astype(jnp.float32) + t.presence_penalty[:, None] * (
        counts > 0
    ).astype(jnp.float32)
    return x - adjust


def apply_suppression(logits: jax.Array, suppress_ids: np.ndarray | jax.Array) -> jax.Array:
    """Set banned ids (end/stop ids before min_tokens, bad words) to -inf; -1 entries are no-ops."""
    S, V = logits.shape
    idx = jnp.where(suppress_ids >= 0, suppress_ids, V)
    return logits.at[jnp.arange(S)[:, None], idx].set(-jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: np.ndarray | jax.Array) -> jax.Array:
    """Set every token whose bit is 0 in `bitmask` int32[S, ceil(V / 32)] (bit t % 32 of word
    t // 32, llguidance's layout) to -inf."""
    S, V = logits.shape
    words = jnp.asarray(bitmask, jnp.int32)
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = lax.shift_right_logical(words[:, :, None], shifts[None, None, :]) & 1
    allowed = bits.reshape(S, -1)[:, :V].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def row_keys(t: SamplingTensors) -> jax.Array:
    """One typed PRNG key per row: the request's seed with the output token index folded in."""

    def one(seed_words: jax.Array, step: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(seed_words, impl=_PRNG_IMPL), step)

    # vmap maps host arrays too and hands `one` jax arrays; its typing keeps `one`'s parameter types
    return jax.vmap(one)(t.seed, t.step)  # type: ignore[arg-type]


def _sample_rows(x: jax.Array, t: SamplingTensors) -> jax.Array:
    """A draw for every row from its temperature-scaled, top-k/top-p/min-p filtered logits."""
    S, V = x.shape
    filtered = filtered_logits(x, t)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(row_keys(t))
    return first_argmax(filtered + gumbel)


def filtered_logits(x: jax.Array, t: SamplingTensors) -> jax.Array:
    """The logits a sampled row draws from: temperature-scaled, top-k/top-p/min-p filtered
    (-inf outside); their softmax is the row's target distribution."""
    S, V = x.shape
    temp = jnp.where(t.temperature > 0, t.temperature, 1.0)
    scaled = x / temp[:, None]

    if t.use_top_k_top_p:
        thr = _top_k_top_p_threshold(scaled, t.top_k, t.top_p)
    else:
        thr = jnp.full((S,), -jnp.inf, jnp.float32)
    # min-p: keep p_i >= min_p * p_max, i.e. logit_i >= logit_max + log(min_p). The most
    # likely token survives top-k/top-p, so renormalising after them does not change this.
    row_max = jnp.max(scaled, axis=-1)
    thr_min_p = jnp.where(t.min_p > 0, row_max + jnp.log(jnp.maximum(t.min_p, 1e-38)), -jnp.inf)
    thr = jnp.maximum(thr, thr_min_p)
    return jnp.where(scaled >= thr[:, None], scaled, -jnp.inf)


TOP_WINDOW = 128
"""Largest values per row `lax.top_k` finds for top-k / top-p; a row whose cut lies further
down (top_k > TOP_WINDOW, or a top-p nucleus wider than the window) finds it by bisection."""


def _top_k_top_p_threshold(
    scaled: jax.Array, top_k: np.ndarray | jax.Array, top_p: np.ndarray | jax.Array
) -> jax.Array:
    """Per row, the smallest logit that survives top-k then top-p (-inf when both are off).

    Top-k keeps every token at least the k-th largest value; top-p then keeps the shortest
    prefix of those tokens, best first, whose probability mass (renormalised over them)
    reaches top_p: a token is kept while the mass before it is < top_p. Ties with the
    threshold value are kept.

    No vocabulary sort (XLA:CPU sorts 49K values in ~11 ms per row): the cut is found among
    the `TOP_WINDOW` largest values of each row (`lax.top_k`), and for a row whose cut lies
    past them by bisection over the float order of its values (32 masked sums per search).
    Both give the exact threshold value, decided per row from that row's values alone, so a
    row's tokens do not depend on its batch. The bisection always runs its 32 halvings (a trip
    count from the data would be read back to the host on every trip by a GPU runtime);
    other backends sort, which is fast there."""
    if jax.default_backend() != "cpu":
        return _sorted_threshold(scaled, top_k, top_p)
    S, V = scaled.shape
    W = min(TOP_WINDOW, V)
    scaled = jnp.where(scaled == 0, 0.0, scaled)  # -0.0 as +0.0: one key per float value
    keys = _ordered_keys(scaled)
    desc, _ = largest(scaled, W)
    k = jnp.asarray(top_k, jnp.int32)
    p = jnp.asarray(top_p, jnp.float32)

    # top-k: the k-th largest value, in the window or by bisection over value counts
    kth_w = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, W - 1)[:, None], axis=-1)[:, 0]
    far_k = (k > W) & (k < V)
    lo, hi = keys.min(axis=-1), keys.max(axis=-1)
    kth_far = _from_ordered_keys(_bisect_keys(lambda mid: jnp.sum(keys > mid[:, None], axis=-1) < k, lo, hi, far_k))
    thr_k = jnp.where((k > 0) & (k < V), jnp.where(far_k, kth_far, kth_w), -jnp.inf)

    # top-p over the tokens top-k kept, renormalised
    kept = scaled >= thr_k[:, None]
    row_max = desc[:, 0]
    weights = jnp.where(kept, jnp.exp(scaled - row_max[:, None]), 0.0)
    total = jnp.sum(weights, axis=-1)
    probs_w = jnp.where(desc >= thr_k[:, None], jnp.exp(desc - row_max[:, None]), 0.0) / total[:, None]
    mass_w = jnp.cumsum(probs_w, axis=-1)
    mass_before = mass_w - probs_w
    n_keep = jnp.maximum(jnp.sum((mass_before < p[:, None]) & (desc >= thr_k[:, None]), axis=-1), 1)
    thr_p_w = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]
    # the window holds the cut when its mass reaches top_p or it holds every kept token
    in_window = (mass_w[:, -1] >= p) | (jnp.sum(kept, axis=-1) <= W)
    far_p = (p < 1.0) & ~in_window
    lo_p = jnp.maximum(lo, _ordered_keys(thr_k))
    budget = p * total
    thr_p_far = _from_ordered_keys(
        _bisect_keys(
            lambda mid: jnp.sum(jnp.where(keys > mid[:, None], weights, 0.0), axis=-1) < budget, lo_p, hi, far_p
        )
    )
    thr_p = jnp.where(p < 1.0, jnp.where(far_p, thr_p_far, thr_p_w), -jnp.inf)
    return jnp.maximum(thr_k, thr_p)


def _sorted_threshold(scaled: jax.Array, top_k: np.ndarray | jax.Array, top_p: np.ndarray | jax.Array) -> jax.Array:
    """`_top_k_top_p_threshold` by one sort of each row's values (no data-dependent loop)."""
    S, V = scaled.shape
    desc = jnp.sort(scaled, axis=-1, descending=True, stable=False)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)[:, 0]
    thr_k = jnp.where((top_k > 0) & (top_k < V), kth, -jnp.inf)
    in_k = desc >= thr_k[:, None]
    probs = jnp.where(in_k, jnp.exp(desc - desc[:, :1]), 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum((mass_before < top_p[:, None]) & in_k, axis=-1), 1)
    thr_p = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)[:, 0]
    thr_p = jnp.where(top_p < 1.0, thr_p, -jnp.inf)
    return jnp.maximum(thr_k, thr_p)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 values, in the same order as the values (-0.0 below +0.0)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    flipped = bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)
    return lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _from_ordered_keys(keys: jax.Array) -> jax.Array:
    """The float32 values of `_ordered_keys`."""
    bits = lax.bitcast_convert_type(keys ^ jnp.uint32(0x80000000), jnp.int32)
    return lax.bitcast_convert_type(bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF), jnp.float32)


def _bisect_keys(holds: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array, active: jax.Array) -> jax.Array:
    """Per row, the smallest key in [lo, hi] where `holds(keys) -> bool[S]` (monotone: false
    then true; true at hi) for the `active` rows (the others get hi). 32 halvings, the most
    a range of uint32 keys needs, whatever the data: the trip count is known when compiled."""
    lo = jnp.where(active, lo, hi)

    def halve(_: int, state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = state
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        busy = lo < hi
        return jnp.where(busy & ~ok, mid + 1, lo), jnp.where(busy & ok, mid, hi)

    return lax.fori_loop(0, _KEY_BITS, halve, (lo, hi))[1]


_KEY_BITS = 32  # halvings that narrow any range of uint32 keys to one key
