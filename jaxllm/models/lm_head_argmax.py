"""The greedy token of each row straight from the LM head, without its float32 logits.

A step whose rows all decode greedily with no processing needs only each row's argmax, yet the
plain forward (`decoder.compute_logits`) writes float32 logits [S, V] to memory and reads them
back to reduce them: 131 MB per step at 256 rows and a 128K vocabulary, on a decode step that
is bound by memory bandwidth. `greedy_tokens` runs the same final norm and LM head matmul in
chunks of the vocabulary under one unrolled `lax.scan` (its trip count a Python int from the shapes),
each chunk's float32 accumulators reduced at once to a running (max, first index) per row, so
no buffer larger than one chunk [S, C] exists; the engine selects it on the host as a forward
variant (`ModelRunner`, `EngineConfig.fused_lm_head_argmax`), never by a device branch.

Each logit is the same float32 dot product as the unfused matmul's (`preferred_element_type`
float32, the model's matmul precision), and ties go to the lowest index as `first_argmax`
does: inside a chunk by `first_argmax`, across chunks by keeping the earlier chunk's on equal
maxima. The vocabulary need not divide into chunks: the last chunk starts at V - C (a
`dynamic_slice` start clamped in range), overlapping the one before it, whose columns then
come again with the same values and indices and change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.weights import Params
from jaxllm.sampling.sampler import first_argmax

CHUNK_ELEMENTS = 1 << 21
"""Float32 logits one chunk holds, rows times columns (8 MiB): a chunk's accumulators stay in
a GPU's L2 cache, and fewer rows take wider chunks (a one-row decode step runs the whole
vocabulary as a single chunk of 512 KiB, no loop at all)."""

_CHUNK_ALIGN = 128  # chunk widths are whole multiples of this (lanes of a GPU's matmul tiles)


def vocab_chunk(rows: int, vocab: int) -> int:
    """Columns of the vocabulary per chunk for `rows` rows: `CHUNK_ELEMENTS` over the rows,
    rounded down to a multiple of 128 (at least 128), at most the vocabulary."""
    width = max(_CHUNK_ALIGN, CHUNK_ELEMENTS // max(1, rows) // _CHUNK_ALIGN * _CHUNK_ALIGN)
    return min(vocab, width)


def logits_bytes(rows: int, vocab: int, fused: bool) -> int:
    """Bytes of float32 logits a step writes for `rows` rows (read back as many again by the
    argmax or sampler): the whole [rows, V], or with the fused reduction one chunk's
    accumulators (which a GPU keeps in its L2 cache) and the int32 tokens."""
    if fused:
        return 4 * rows * vocab_chunk(rows, vocab) + 4 * rows
    return 4 * rows * vocab


def greedy_tokens(params: Params, residual: jax.Array, config: ModelConfig) -> jax.Array:
    """int32 [N]: the argmax of `decoder.compute_logits(params, residual, config)` for residual
    rows [N, H] (the first index on ties), computed chunk by chunk over the vocabulary."""
    h = rms_norm(residual, params["final_norm"], config.rms_norm_eps)
    tied = config.tie_word_embeddings
    weight = params["embed"] if tied else params["lm_head"]  # [V, H] tied, else [H, V]
    vocab = weight.shape[0] if tied else weight.shape[1]
    rows = h.shape[0]
    chunk = vocab_chunk(rows, vocab)
    num_chunks = -(-vocab // chunk)
    prec = matmul_precision(config)

    def step(carry: tuple[jax.Array, jax.Array], i: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        best, index = carry
        start = jnp.minimum(i * chunk, vocab - chunk)  # the last chunk ends at V (see the docstring)
        if tied:
            w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
            logits = jnp.einsum("nh,vh->nv", h, w, precision=prec, preferred_element_type=jnp.float32)
        else:
            w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=1)
            logits = jnp.einsum("nh,hv->nv", h, w, precision=prec, preferred_element_type=jnp.float32)
        top = first_argmax(logits)
        value = jnp.max(logits, axis=-1)
        better = value > best  # an equal maximum keeps the earlier (lower) index
        return (jnp.where(better, value, best), jnp.where(better, top + start, index)), None

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.int32))
    # Unrolled (a trip count of a few dozen at most): a rolled loop body ran single-threaded on
    # XLA:CPU, and on a GPU each iteration paid the loop's own launches.
    (_, index), _ = jax.lax.scan(step, init, jnp.arange(num_chunks, dtype=jnp.int32), unroll=True)
    return index
