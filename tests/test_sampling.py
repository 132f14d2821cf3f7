"""Sampling parameters, per-step tensors, the on-device sampler and stop checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingTensors,
    apply_penalties,
    check_stop,
    resolve_end_ids,
    resolve_seed,
    sample,
)
from jaxllm.sampling.sampler import first_argmax

sample_jit = jax.jit(sample)
S = 8
V = 64


def _build(params, num_generated=None, histories=None, eos=None, S_=S, H=32, **kw):
    n = len(params)
    return SamplingTensors.build(
        params,
        num_generated if num_generated is not None else [0] * n,
        histories,
        eos if eos is not None else [[] for _ in range(n)],
        S_,
        H,
        **kw,
    )


def _maximal(t: SamplingTensors) -> SamplingTensors:
    """The same rows under the variant that runs every stage (penalties, sort, random draw,
    top logprobs). Rows must come out the same as under their own variant; tests use it to
    share one compiled sampler."""
    hist, is_out = t.history_ids, t.history_is_output
    if hist.shape[1] == 1:
        hist = np.full((hist.shape[0], 32), -1, np.int32)
        is_out = np.zeros(hist.shape, np.bool_)
    return dataclasses.replace(
        t,
        history_ids=hist,
        history_is_output=is_out,
        use_penalties=True,
        num_top_logprobs=MAX_LOGPROBS,
        any_random=True,
        use_top_k_top_p=True,
    )


def _logits(seed: int, rows: int = S, vocab: int = V, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# SamplingParams validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.1), "presence_penalty"),
        (dict(presence_penalty=-2.1), "presence_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=None), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=3), "stop_token_ids"),
        (dict(bad_token_ids=[2, -3]), "bad_token_ids"),
        (dict(stop=5), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(bad=[""]), "bad"),
        (dict(end_id=-2), "end_id"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(logits_processor=5), "logits_processor"),
    ],
)
def test_invalid_field_raises_naming_it(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


def test_beam_search_refuses_sampling():
    with pytest.raises(ValueError, match="temperature: beam search does not sample"):
        SamplingParams(use_beam_search=True, temperature=0.7)


def test_valid_edge_values_accepted():
    for kw in [
        dict(),
        dict(temperature=0),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_p=1.0),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(n=2, best_of=2),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(min_tokens=5, max_tokens=5),
        dict(seed=2**64 - 1),
        dict(stop="x"),
        dict(stop_token_ids=(1, 2)),
        dict(end_id=-1),
    ]:
        SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SamplingParams(stop="a").stop_strings == ["a"]


def test_from_kwargs_rejects_unknown_names():
    with pytest.raises(ValueError, match="bogus, temprature"):
        SamplingParams.from_kwargs(temperature=0.5, bogus=1, temprature=2)
    with pytest.raises(ValueError, match="_bad_word_ids"):
        SamplingParams.from_kwargs(_bad_word_ids=[[1]])
    assert SamplingParams.from_kwargs(top_k=3).top_k == 3


def test_greedy_semantics():
    assert SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6, top_p=0.5).is_greedy
    assert SamplingParams(top_k=1, temperature=2.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(top_p=0.9).is_greedy
    assert not SamplingParams(top_k=-1, temperature=1.0).is_greedy
    assert not SamplingParams(min_p=0.1).is_greedy


def test_resolve_seed_and_end_ids():
    assert resolve_seed(SamplingParams(seed=7)) == 7
    derived = {resolve_seed(SamplingParams(seed=7), i) for i in range(4)}
    assert len(derived) == 4
    assert resolve_seed(SamplingParams(seed=7), 2) == resolve_seed(SamplingParams(seed=7), 2)
    assert resolve_seed(SamplingParams()) != resolve_seed(SamplingParams())
    assert resolve_end_ids(SamplingParams(), [2, 3]) == [2, 3]
    assert resolve_end_ids(SamplingParams(end_id=9), [2]) == [9]
    assert resolve_end_ids(SamplingParams(end_id=-1), [2]) == []


# ---------------------------------------------------------------------------------------------
# SamplingTensors.build


def test_build_padding_and_static_flags():
    t = _build(
        [SamplingParams(temperature=0.5, top_k=4, seed=3), None, SamplingParams(logprobs=2)], num_generated=[5, 0, 1]
    )
    assert t.temperature.shape == (S,) and t.temperature.dtype == np.float32
    np.testing.assert_allclose(t.temperature[:3], [0.5, 0, 0])
    assert (t.temperature[3:] == 0).all() and (t.top_p == 1).all() and (t.top_k[1:] == 0).all()
    assert t.top_k[0] == 4 and t.step[0] == 5
    assert tuple(t.seed[0]) == (0, 3)
    assert (t.suppress_ids == -1).all()
    assert t.history_ids.shape == (S, 1) and not t.use_penalties
    assert t.num_top_logprobs == MAX_LOGPROBS
    assert _build([SamplingParams(logprobs=0)]).num_top_logprobs == 0
    big = _build([SamplingParams(temperature=1.0, seed=2**40 + 5)])
    assert tuple(big.seed[0]) == (2**8, 5)


@pytest.mark.parametrize(
    "params, random, sort, pen",
    [
        ([SamplingParams(), None, SamplingParams(top_k=1, temperature=2.0)], False, False, False),
        ([SamplingParams(temperature=0.7, min_p=0.1, seed=1), SamplingParams()], True, False, False),
        ([SamplingParams(), SamplingParams(temperature=0.7, top_k=3, seed=1)], True, True, False),
        ([SamplingParams(top_p=0.9, seed=1)], True, True, False),
        ([SamplingParams(temperature=0.0, top_p=0.9, presence_penalty=0.1)], False, False, True),
    ],
)
def test_static_switches_and_no_device_branching(params, random, sort, pen):
    t = _build(params, histories=[([1], [2])] * len(params))
    assert (t.any_random, t.use_top_k_top_p, t.use_penalties) == (random, sort, pen)
    # A lax.cond or a while loop on device would make the GPU runtime read its predicate back
    # mid-step; only the top-k / top-p threshold loops on a CPU (instead of sorting the
    # vocabulary), a fixed number of halvings (a scan).
    jaxpr = str(jax.make_jaxpr(sample)(jnp.zeros((S, V)), t))
    assert "cond[" not in jaxpr and "while[" not in jaxpr
    on_cpu = jax.default_backend() == "cpu"
    assert ("scan[" in jaxpr) == (sort and on_cpu)
    assert ("sort[" in jaxpr) == (sort and not on_cpu)


def test_empty_matches_build_variants():
    """Warm-up tensors must have exactly the pytree structure and shapes of real batches."""

    def sig(t):
        leaves, treedef = jax.tree_util.tree_flatten(t)
        return treedef, [(np.shape(x), np.asarray(x).dtype) for x in leaves]

    real = _build(
        [SamplingParams(temperature=0.5, top_p=0.9, seed=1, presence_penalty=0.1, logprobs=2)], histories=[([1], [2])]
    )
    warm = SamplingTensors.empty(
        S, 32, use_penalties=True, num_top_logprobs=MAX_LOGPROBS, any_random=True, use_top_k_top_p=True
    )
    assert sig(real) == sig(warm)
    assert sig(_build([SamplingParams()])) == sig(SamplingTensors.empty(S, 32))
    assert (warm.temperature == 0).all() and (warm.history_ids == -1).all()
    with pytest.raises(ValueError, match="use_top_k_top_p"):
        SamplingTensors.empty(S, 32, use_top_k_top_p=True)
    assert SamplingParams(presence_penalty=0.1).needs_history
    assert SamplingParams(bad="x").needs_history
    assert not SamplingParams(bad_token_ids=[3], min_tokens=2).needs_history


def test_build_errors():
    with pytest.raises(ValueError, match="max_batch_size"):
        _build([None] * (S + 1))
    with pytest.raises(ValueError, match="seed"):
        _build([SamplingParams(temperature=1.0)])
    _build([SamplingParams(temperature=1.0)], seeds=[11])  # a resolved seed is enough
    with pytest.raises(ValueError, match="history_len"):
        _build([SamplingParams(repetition_penalty=1.1)], histories=[(list(range(20)), list(range(20)))], H=16)
    with pytest.raises(ValueError, match="histories"):
        _build([SamplingParams(presence_penalty=0.5)])
    with pytest.raises(ValueError, match="suppress_width"):
        _build([SamplingParams(bad_token_ids=list(range(20)))])


# ---------------------------------------------------------------------------------------------
# Greedy


def test_temperature_zero_is_bitexact_argmax():
    logits = _logits(0)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: the first index wins
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(),
        None,
        SamplingParams(temperature=1e-7, top_p=0.3),
        SamplingParams(top_k=1, temperature=3.0, seed=2),
    ]
    out = sample_jit(jnp.asarray(logits), _build(params))
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(logits, axis=-1))
    assert int(out.token_ids[3]) == 10


@pytest.mark.parametrize("vocab", [300, 512])
def test_blocked_argmax_matches_argmax_with_ties(vocab):
    """The blocked argmax (vocabularies of two blocks and more, with and without a tail) picks
    numpy's index: the first one on ties within a block, across blocks and with the tail."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((8, vocab)).astype(np.float32)
    x[0, [5, 200]] = 9.0  # tie across blocks
    x[1, [130, 140]] = 9.0  # tie inside a block
    x[2, [3, vocab - 2]] = 9.0  # tie of a block with the tail (or the last block)
    x[3, vocab - 1] = 9.0  # the maximum in the last position
    x[4] = -np.inf  # everything suppressed
    x[5] = np.round(x[5])  # many ties
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    greedy = sample_jit(jnp.asarray(x), _build([SamplingParams(temperature=0.0)] * 8, S_=8))
    np.testing.assert_array_equal(np.asarray(greedy.token_ids), np.argmax(x, axis=-1))


def test_top_k_one_equals_greedy_on_device_path():
    logits = _logits(1)
    t = _build([SamplingParams(temperature=1.3, top_k=5, seed=i) for i in range(S)])
    t.top_k[:] = 1  # bypass the host's top_k=1 -> greedy mapping: the filter itself must do it
    for step in range(3):
        t.step[:] = step
        out = sample_jit(jnp.asarray(logits), t)
        np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(logits, axis=-1))


def test_bf16_logits_accepted():
    logits = _logits(2).astype(jnp.bfloat16)
    out = sample_jit(jnp.asarray(logits), _build([SamplingParams()] * S))
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(np.asarray(logits, np.float32), axis=-1))


# ---------------------------------------------------------------------------------------------
# Seeds


def _generate(params_rows, target_row, logits_row, steps, vocab=V, seeds=None, maximal=False):
    """Tokens of the request in `target_row` over `steps` steps (logits fixed per step)."""
    toks = []
    for step in range(steps):
        n = len(params_rows)
        hist = [([1, 2, 3], [4] * step) for _ in range(n)]
        t = SamplingTensors.build(params_rows, [step] * n, hist, [[0]] * n, S, 32, seeds=seeds)
        if maximal:
            t = _maximal(t)
        logits = _logits(100 + step, vocab=vocab, scale=0.3)
        logits[target_row] = logits_row[step]
        toks.append(int(sample_jit(jnp.asarray(logits), t).token_ids[target_row]))
    return toks


def test_same_seed_same_tokens_regardless_of_row_and_neighbours():
    req = SamplingParams(temperature=0.9, top_p=0.97, seed=1234)
    rows_logits = [_logits(200 + s, rows=1, scale=0.3)[0] for s in range(12)]
    alone = _generate([req], 0, rows_logits, 12)
    neighbours = [
        SamplingParams(temperature=1.0, seed=9),
        SamplingParams(),
        SamplingParams(
            temperature=0.5, top_k=3, seed=5, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
        ),
        SamplingParams(min_p=0.2, seed=77, logprobs=5),
        None,
    ]
    crowded = _generate(neighbours + [req], 5, rows_logits, 12)
    assert alone == crowded
    assert alone == _generate([req], 0, rows_logits, 12, maximal=True)
    assert len(set(alone)) > 3  # the draws really are random


def test_different_seeds_differ():
    flat = [np.zeros(V, np.float32)] * 10
    a = _generate([SamplingParams(temperature=1.0, seed=1)], 0, flat, 10, maximal=True)
    b = _generate([SamplingParams(temperature=1.0, seed=2)], 0, flat, 10, maximal=True)
    assert a != b
    # the engine-resolved seed overrides and distinguishes unseeded requests
    c = _generate([SamplingParams(temperature=1.0)], 0, flat, 10, seeds=[resolve_seed(None)], maximal=True)
    d = _generate([SamplingParams(temperature=1.0)], 0, flat, 10, seeds=[resolve_seed(None)], maximal=True)
    assert c != d


# ---------------------------------------------------------------------------------------------
# Distributions and filters

BIG_S = 512


def _draws(params_factory, logits_row: np.ndarray, steps: int) -> np.ndarray:
    """Many independent draws from one logits row: BIG_S seeds x `steps` token indices."""
    params = [params_factory(i) for i in range(BIG_S)]
    logits = jnp.asarray(np.tile(logits_row, (BIG_S, 1)))
    out = []
    for step in range(steps):
        t = _build(params, num_generated=[step] * BIG_S, S_=BIG_S)
        out.append(np.asarray(sample_jit(logits, t).token_ids))
    return np.concatenate(out)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi_square(draws: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=len(probs))
    expected = probs * len(draws)
    assert (counts[probs == 0] == 0).all()
    m = probs > 0
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


def test_temperature_sampling_matches_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    draws = _draws(lambda i: SamplingParams(temperature=0.7, seed=i), logits, 8)
    probs = _softmax(logits / 0.7)
    # df = 7; the 0.999 quantile is 24.3. A wrong temperature or a biased draw blows past it.
    assert _chi_square(draws, probs) < 30.0
    wrong = _softmax(logits)  # temperature ignored
    assert _chi_square(draws, wrong) > 100.0


def _ref_allowed(logits: np.ndarray, T: float, k: int, p: float, min_p: float) -> np.ndarray:
    """Numpy reference of the set a sampled row may pick from (top-p over every token top-k
    kept, ties with the k-th value included, as vLLM's value mask)."""
    s = logits.astype(np.float64) / T
    allowed = np.ones_like(s, bool)
    desc = np.sort(s)[::-1]
    if k > 0:
        allowed &= s >= desc[k - 1]
    if p < 1.0:
        kk = int((s >= desc[k - 1]).sum()) if k > 0 else len(s)
        probs = _softmax(desc[:kk])
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        n_keep = int((before < p).sum())
        allowed &= s >= desc[n_keep - 1]
    if min_p > 0:
        allowed &= np.exp(s - s.max()) >= min_p
    return allowed


def _safe_top_p(logits: np.ndarray, T: float, k: int, target: float) -> float:
    """A top_p halfway between two cumulative masses, so float rounding cannot move the cut."""
    desc = np.sort(logits.astype(np.float64) / T)[::-1]
    if k > 0:
        desc = desc[desc >= desc[k - 1]]
    cum = np.cumsum(_softmax(desc))
    i = int(np.searchsorted(cum, target))
    return float((cum[i] + cum[i + 1]) / 2)


@pytest.mark.parametrize(
    "T, k, p, min_p",
    [
        (1.0, 5, None, 0.0),
        (0.8, 0, 0.6, 0.0),
        (1.2, 12, 0.8, 0.0),
        (1.0, 0, None, 0.3),
        (1.5, 20, 0.9, 0.05),
    ],
)
def test_filters_never_leave_allowed_set(T, k, p, min_p):
    logits = _logits(7, rows=1, scale=2.0)[0]
    top_p = 1.0 if p is None else _safe_top_p(logits, T, k, p)
    if min_p:
        ratios = np.exp(logits / T - (logits / T).max())
        assert np.abs(ratios - min_p).min() > 1e-4
    allowed = _ref_allowed(logits, T, k, top_p, min_p)
    assert 1 < allowed.sum() < V
    draws = _draws(
        lambda i: SamplingParams(temperature=T, top_k=k or None, top_p=top_p, min_p=min_p or None, seed=i), logits, 4
    )
    assert allowed[draws].all(), np.unique(draws[~allowed[draws]])
    # ...and sample the allowed set with the renormalised probabilities
    probs = np.where(allowed, _softmax(logits.astype(np.float64) / T), 0.0)
    probs /= probs.sum()
    df = int(allowed.sum()) - 1
    assert _chi_square(draws, probs) < df + 6 * np.sqrt(2 * df) + 10


def test_top_p_on_large_vocab():
    vocab = 151_936
    logits = _logits(11, rows=1, vocab=vocab, scale=3.0)[0]
    top_p = _safe_top_p(logits, 1.0, 0, 0.5)
    allowed = _ref_allowed(logits, 1.0, 0, top_p, 0.0)
    t = _build([SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(2)], S_=2)
    out = sample_jit(jnp.asarray(np.tile(logits, (2, 1))), t)
    assert allowed[np.asarray(out.token_ids)].all()


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_cut_matches_sorted_reference_in_and_past_the_window(ties):
    """The sort-free threshold (the largest TOP_WINDOW values, bisection for a cut past them)
    keeps exactly the numpy reference's set, for rows cut inside the window and rows cut far
    past it (top_k > TOP_WINDOW, wide top-p nuclei) in one batch, and the sorting variant
    (other backends) keeps the same set; each row's set does not depend on the other rows."""
    from jaxllm.sampling.sampler import TOP_WINDOW, _sorted_threshold, filtered_logits

    vocab = 4096
    cases = [  # (temperature, top_k, top_p target): window, past it, both filters, ties at the cut
        (1.0, 5, None),
        (1.0, 3 * TOP_WINDOW, None),
        (0.5, 0, 0.3),
        (2.0, 0, 0.9),
        (1.0, 2 * TOP_WINDOW, 0.95),
        (1.5, 40, 0.8),
        (1.0, TOP_WINDOW, None),
        (1.0, vocab, 0.5),
    ]
    logits = _logits(21, rows=len(cases), vocab=vocab, scale=3.0)
    if ties:  # coarse values (as bf16 logits have): many tokens share the cut's value
        logits = np.round(logits * 4) / 4
    logits[0, :7] = -np.inf  # suppressed tokens
    params, allowed = [], []
    for i, (T, k, target) in enumerate(cases):
        top_p = 1.0 if target is None else _safe_top_p(logits[i], T, k, target)
        ref = _ref_allowed(logits[i], T, k, top_p, 0.0)
        assert 1 < ref.sum() < vocab
        allowed.append(ref)
        params.append(SamplingParams(temperature=T, top_k=k or None, top_p=top_p, seed=i))
    t = _build(params, S_=len(cases))
    kept = np.isfinite(np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits), t)))
    for i, case in enumerate(cases):
        np.testing.assert_array_equal(kept[i], allowed[i], err_msg=str(case))
    scaled = logits / t.temperature[:, None]
    sorted_thr = np.asarray(jax.jit(_sorted_threshold)(jnp.asarray(scaled), t.top_k, t.top_p))
    np.testing.assert_array_equal(scaled >= sorted_thr[:, None], kept)
    for i in (1, 3):  # alone, as a one-row batch
        alone = _build([params[i]], S_=1)
        row = np.isfinite(np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits[i : i + 1]), alone)))[0]
        np.testing.assert_array_equal(row, kept[i])


# ---------------------------------------------------------------------------------------------
# Penalties


def _ref_penalties(logits, prompt, output, rep, pres, freq):
    """vLLM: repetition over prompt+output tokens; frequency/presence over output tokens."""
    x = logits.astype(np.float64).copy()
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    counts = np.bincount(np.asarray(output, int), minlength=len(x)) if output else np.zeros(len(x))
    x -= freq * counts
    x -= pres * (counts > 0)
    return x


def test_penalties_match_reference():
    logits = _logits(3, scale=2.0)
    cases = [
        (
            SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
            [1, 2, 2, 9],
            [2, 3, 3, 3, 40],
        ),
        (SamplingParams(repetition_penalty=0.7), [5, 6], [6, 7]),
        (
            SamplingParams(frequency_penalty=-1.5, presence_penalty=-0.4, temperature=1.0, seed=1),
            [10, 11],
            [11, 11, 12],
        ),
        (SamplingParams(), [1, 2, 3], [3, 4]),  # no penalty: untouched
        (None, [], []),
    ]
    params = [c[0] for c in cases]
    hist = [(c[1], c[2]) for c in cases]
    t = _build(params, histories=hist)
    assert t.use_penalties
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), t))
    for i, (p, prompt, output) in enumerate(cases):
        want = (
            logits[i]
            if p is None
            else _ref_penalties(
                logits[i],
                prompt,
                output,
                p.repetition_penalty or 1.0,
                p.presence_penalty or 0.0,
                p.frequency_penalty or 0.0,
            )
        )
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])
    np.testing.assert_array_equal(got[S - 1], logits[S - 1])

    # greedy rows take the argmax of the penalised logits
    greedy = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), SamplingParams()]
    top = np.argsort(-logits[:2], axis=-1)
    hist = [([], [int(top[0, 0])] * 2), ([], [int(top[1, 0])])]
    out = sample_jit(jnp.asarray(logits), _maximal(_build(greedy, histories=hist)))
    want0 = np.argmax(_ref_penalties(logits[0], [], hist[0][1], 2.0, 0.0, 1.0))
    assert int(out.token_ids[0]) == want0 != top[0, 0]
    assert int(out.token_ids[1]) == top[1, 0]  # no penalty on this row


# ---------------------------------------------------------------------------------------------
# Suppression


class _FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") + 10 for c in text]


def test_end_and_stop_ids_suppressed_until_min_tokens():
    eos, stop = 7, 5
    logits = _logits(4)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    p = SamplingParams(min_tokens=3, stop_token_ids=[stop], temperature=0.0)
    q = SamplingParams(min_tokens=3, stop_token_ids=[stop], temperature=1.0, seed=3)
    r = SamplingParams(min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    for gen in range(5):
        t = _maximal(_build([p, q, r], num_generated=[gen] * 3, eos=[[eos]] * 3))
        toks = np.asarray(sample_jit(jnp.asarray(logits), t).token_ids)
        if gen < 3:
            masked = logits.copy()
            masked[:, [eos, stop]] = -np.inf
            assert toks[0] == np.argmax(masked[0])
            assert toks[1] not in (eos, stop)
            assert toks[2] == eos  # ignore_eos: the end id is just a token
        else:
            assert toks[0] == eos and toks[1] == eos
    assert (
        int(np.asarray(sample_jit(jnp.asarray(logits), _build([p], num_generated=[3], eos=[[eos]])).token_ids)[0])
        == eos
    )


def test_bad_words_always_suppressed():
    logits = _logits(5)
    logits[:, 3] = 30.0
    logits[:, 11] = 20.0  # 'b' in the fake tokenizer
    p = SamplingParams(bad_token_ids=[3], bad="ab").setup(_FakeTokenizer())
    assert p.bad_word_ids == [[3], [10, 11]]
    # after 'a' (10) the continuation 'b' (11) is banned; otherwise it is not
    t = _build([p, p], num_generated=[1, 1], histories=[([1], [10]), ([10], [1])])
    toks = np.asarray(sample_jit(jnp.asarray(logits), t).token_ids)
    masked = logits[0].copy()
    masked[[3, 11]] = -np.inf
    assert toks[0] == np.argmax(masked)
    assert toks[1] == 11
    with pytest.raises(ValueError, match="setup"):
        _build([SamplingParams(bad="ab")])


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_raw_log_softmax():
    logits = _logits(6, scale=3.0)
    best = int(np.argmax(logits[3]))
    logits[3, best] += 10.0  # stays the greedy pick after its penalty, so its logprob must be raw
    params = [
        SamplingParams(temperature=0.6, top_k=10, seed=1, logprobs=5, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
        SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2, logprobs=1),
    ]
    t = _build(params, histories=[([1, 2], [3]), ([], []), ([], []), ([], [best, best])])
    out = sample_jit(jnp.asarray(logits), t)
    assert int(out.token_ids[3]) == best
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    toks = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(S), toks], rtol=1e-6, atol=1e-6)
    assert out.top_ids.shape == (S, MAX_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-ref, axis=-1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), np.sort(ref, axis=-1)[:, ::-1][:, :MAX_LOGPROBS], rtol=1e-6, atol=1e-6
    )
    none = sample_jit(jnp.asarray(logits), _build([SamplingParams()]))
    assert none.top_ids.shape == (S, 0) and none.top_logprobs.shape == (S, 0)


def test_jitted_sampler_needs_no_host_transfer():
    logits = jax.device_put(jnp.asarray(_logits(8)))
    t = _maximal(
        _build(
            [SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05, seed=4, presence_penalty=0.2)],
            histories=[([1], [2])],
        )
    ).as_device()
    sample_jit(logits, t)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        out = sample_jit(logits, t)
        out.token_ids.block_until_ready()


# ---------------------------------------------------------------------------------------------
# Stop checks


def test_check_stop():
    eos = {2}
    p = SamplingParams(max_tokens=5, stop_token_ids=[9])
    assert check_stop(p, [], eos) == (None, None)
    assert check_stop(p, [4, 5], eos) == (None, None)
    assert check_stop(p, [4, 2], eos) == ("stop", None)
    assert check_stop(p, [4, 9], eos) == ("stop", 9)
    assert check_stop(p, [4, 5, 6, 7, 8], eos) == ("length", None)
    assert check_stop(p, [4, 5, 6, 7, 2], eos) == ("stop", None)  # a stop on the last token wins
    assert check_stop(p, [9, 5], eos) == (None, None)  # only the newest token is checked
    m = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[9])
    assert check_stop(m, [2], eos) == (None, None)
    assert check_stop(m, [1, 9], eos) == (None, None)
    assert check_stop(m, [1, 1, 9], eos) == ("stop", 9)
    g = SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[9])
    assert check_stop(g, [2], eos) == (None, None)
    assert check_stop(g, [2, 9], eos) == ("stop", 9)
    assert check_stop(g, [2, 2, 2], eos) == ("length", None)
