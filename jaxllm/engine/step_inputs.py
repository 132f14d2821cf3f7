"""A step's packed inputs on the device: unpacked, with the overlap feed applied.

Both model steps (the plain forward and the hidden-state forward of a speculating runner) read
their inputs this way: the packed buffer holds the `StepBatch`, the feed index (where a row's
token is the previous step's sampled token still on the device) and, optionally, the context
logits index.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.engine.host_transfer import PackedLayout, unpack
from jaxllm.step_batch import StepBatch


def fed_step_inputs(
    inputs: tuple, prev_tokens: jax.Array, layout: PackedLayout
) -> tuple[StepBatch, Optional[jax.Array]]:
    """(the batch with fed tokens in place, the context logits index or None)."""
    unpacked = unpack(inputs, layout)
    batch, feed_index = unpacked[0], unpacked[1]
    context_index = unpacked[2] if len(unpacked) > 2 else None
    fed = prev_tokens[jnp.maximum(feed_index, 0)]
    return replace(batch, token_ids=jnp.where(feed_index >= 0, fed, batch.token_ids)), context_index
