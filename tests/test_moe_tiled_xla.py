"""The tiled XLA grouped FFN (the engine's `xla` MoE backend) against the ragged_dot reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.tiled_xla import default_tile_rows, moe_grouped_ffn_tiled


@pytest.mark.parametrize(
    "num_rows, sizes, tile_rows",
    [
        (40, [0, 7, 0, 16, 9, 0], 8),  # empty first/middle/last groups, tails, padding rows
        (33, [33, 0, 0], 8),  # one group, no padding
        (1, [0, 1, 0, 0], None),  # a single token
        (24, [0, 0, 0], 8),  # all groups empty
        (64, [5, 20, 3, 30], None),  # default tile
    ],
)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_tiled_matches_reference(num_rows, sizes, tile_rows, dtype, tol):
    rng = np.random.default_rng(sum(sizes) + num_rows)
    groups, hidden, inter = len(sizes), 32, 24
    x = jnp.asarray(rng.standard_normal((num_rows, hidden)), dtype)
    w_gate = jnp.asarray(rng.standard_normal((groups, hidden, inter)) * 0.2, dtype)
    w_up = jnp.asarray(rng.standard_normal((groups, hidden, inter)) * 0.2, dtype)
    w_down = jnp.asarray(rng.standard_normal((groups, inter, hidden)) * 0.2, dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(moe_grouped_ffn_reference(x, group_sizes, w_gate, w_up, w_down), np.float32)
    got = np.asarray(
        jax.jit(moe_grouped_ffn_tiled, static_argnames="tile_rows")(
            x, group_sizes, w_gate, w_up, w_down, tile_rows=tile_rows
        ),
        np.float32,
    )
    scale = max(np.abs(want).max(), 1e-6)
    assert np.abs(got - want).max() / scale < tol
    assert np.all(got[sum(sizes) :] == 0)


def test_default_tile_rows_is_a_bounded_power_of_two():
    assert default_tile_rows(256, 32) == 8
    assert default_tile_rows(4096, 32) == 128
    assert default_tile_rows(1, 8) == 8
