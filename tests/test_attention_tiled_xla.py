"""The query-tiled XLA attention (the engine's `xla` backend) against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.tiled_xla import default_block_q, ragged_paged_attention_tiled


def _case(rng, q_lens, kv_lens, max_seqs, num_tokens, hq=4, hkv=2, d=16, tpb=4, num_blocks=64, dtype=jnp.float32):
    max_blocks = 16
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    kv = np.zeros(max_seqs, np.int32)
    kv[: len(kv_lens)] = kv_lens
    tables = rng.integers(0, num_blocks, size=(max_seqs, max_blocks)).astype(np.int32)  # garbage beyond use
    for s in range(len(q_lens)):
        tables[s, :max_blocks] = rng.permutation(num_blocks)[:max_blocks]
    q = jnp.asarray(rng.standard_normal((num_tokens, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((hkv, num_blocks, tpb, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, num_blocks, tpb, d)), dtype)
    return q, k, v, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32)


@pytest.mark.parametrize(
    "q_lens, kv_lens, max_seqs, num_tokens, block_q",
    [
        ([1, 1, 1], [1, 4, 37], 4, 8, None),  # decode only: one block, exactly one, many
        ([13], [13], 2, 16, 4),  # prefill only, tile tail
        ([9, 1, 1, 20], [30, 5, 60, 20], 6, 32, 8),  # mixed: chunk over a cached prefix + decodes
        ([5, 1], [5, 9], 3, 64, None),  # mostly padding tokens
    ],
)
@pytest.mark.parametrize("window, cap", [(None, None), (7, None), (None, 5.0)])
def test_tiled_matches_reference(q_lens, kv_lens, max_seqs, num_tokens, block_q, window, cap):
    rng = np.random.default_rng(len(q_lens) * 100 + num_tokens)
    args = _case(rng, q_lens, kv_lens, max_seqs, num_tokens)
    kw = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    want = np.asarray(ragged_paged_attention_reference(*args, **kw))
    got = np.asarray(jax.jit(lambda *a: ragged_paged_attention_tiled(*a, block_q=block_q, **kw))(*args))
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.all(got[sum(q_lens) :] == 0)


def test_bf16_and_mqa():
    rng = np.random.default_rng(7)
    args = _case(rng, [6, 1], [10, 3], 2, 8, hq=4, hkv=1, dtype=jnp.bfloat16)
    want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.25), np.float32)
    got = np.asarray(ragged_paged_attention_tiled(*args, sm_scale=0.25), np.float32)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()


def test_default_block_q():
    assert default_block_q(64, 64) == 1
    assert default_block_q(1024, 64) == 16
    assert default_block_q(8192, 8) == 64


def _random_step(rng, max_seqs, num_tokens, max_kv, tpb, decode_only):
    """Random ragged step metadata: decode rows and prefill chunks over cached prefixes, some KV
    lengths exactly at block boundaries."""
    q_lens, kv_lens, left = [], [], num_tokens
    for _ in range(int(rng.integers(1, max_seqs + 1))):
        q = 1 if decode_only or rng.random() < 0.5 else int(rng.integers(2, 13))
        q = min(q, left)
        if q == 0:
            break
        kv = int(rng.integers(q, max_kv + 1))
        if rng.random() < 0.3:
            kv = max(q, min(max_kv, tpb * int(rng.integers(1, max_kv // tpb + 1))))
        q_lens.append(q)
        kv_lens.append(kv)
        left -= q
    return q_lens, kv_lens


@pytest.mark.parametrize(
    "decode_only, block_q, items_per_step, window, cap",
    [
        (True, None, 3, None, None),  # decode bucket (one token per tile), items split across iterations
        (False, 4, 2, None, 4.0),  # mixed decode + prefill tiles, soft cap
        (False, None, None, 5, None),  # mixed, sliding window
    ],
)
def test_work_list_random_steps_match_reference(decode_only, block_q, items_per_step, window, cap):
    """Random steps of one compiled shape (GQA with 3 query heads per KV head) against the reference."""
    max_seqs, num_tokens, tpb = 6, 24, 4
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    tiled = jax.jit(lambda *a: ragged_paged_attention_tiled(*a, block_q=block_q, items_per_step=items_per_step, **kw))
    reference = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **kw))
    rng = np.random.default_rng(11 + (block_q or 0) + (window or 0))
    for _ in range(4):
        q_lens, kv_lens = _random_step(rng, max_seqs, num_tokens, 64, tpb, decode_only)
        args = _case(rng, q_lens, kv_lens, max_seqs, num_tokens, hq=6, hkv=2, d=8, tpb=tpb)
        want, got = np.asarray(reference(*args)), np.asarray(tiled(*args))
        assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max()), (q_lens, kv_lens)
        assert np.all(got[sum(q_lens) :] == 0)
