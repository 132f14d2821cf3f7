"""The device arrays of the LoRA slots, laid out like the model's layers.

Every adaptable projection of every layer has, over `max_loras` slots and zero-padded to
`max_lora_rank` columns,

    a [slots, in, r_max]    b [slots, r_max, out]     (b carries the adapter's scaling)

A projection an adapter does not adapt stays zero in its slot, so one compiled program
serves every adapter. The tree mirrors the parameters (`params["layer_stacks"]` /
`params["layers"]`): a layer stack's leaves get a leading layer axis, [n, slots, ...], so the
decoder's `lax.scan` slices them with the other stacked weights. It lives under
`params["lora"]`; the decoder reads it from there together with the step's per-token slot
(`StepBatch.lora_slots`, -1 for tokens without an adapter).

Loading an adapter rewrites one slot in place (`write_slot`: a jitted update whose input
buffers are donated), with fixed shapes, so swapping adapters never compiles anything.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora.adapter import LoraAdapter, layer_targets, target_dims
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.weights import Params, stacks_of_params

LoraTree = dict[str, Any]  # {"layer_stacks": [{target: {"a", "b"}}], "layers": [{target: {"a", "b"}} or {}]}


def _stacked(layer: int, params: Params) -> bool:
    """Whether `layer` lives in a layer stack (its leaves have a leading layer axis)."""
    return not params["layers"][layer]


def _build(config: ModelConfig, params: Params, target_leaves) -> LoraTree:
    """The LoRA tree of `params`' layer layout; `target_leaves(layers, target)` gives the
    {"a", "b"} leaves of one target over the layers `layers` of a stack (or one layer)."""
    stacks = stacks_of_params(config, params)
    in_stack = {i for s in stacks for i in range(s.start, s.stop)}
    return {
        "layer_stacks": [
            {t: target_leaves(tuple(range(s.start, s.stop)), t) for t in layer_targets(config, s.start)} for s in stacks
        ],
        "layers": [
            {} if i in in_stack else {t: target_leaves((i,), t) for t in layer_targets(config, i)}
            for i in range(config.num_layers)
        ],
    }


def init_lora_weights(config: ModelConfig, params: Params, max_loras: int, max_rank: int, dtype: Any) -> LoraTree:
    """Zeroed slots (no adapter loaded)."""
    dtype = numpy_dtype(dtype)

    def zeros(layers: tuple[int, ...], target: str) -> dict[str, jax.Array]:
        d_in, d_out = target_dims(config, target)
        lead = (len(layers),) if _stacked(layers[0], params) else ()
        return {
            "a": jnp.zeros(lead + (max_loras, d_in, max_rank), dtype),
            "b": jnp.zeros(lead + (max_loras, max_rank, d_out), dtype),
        }

    return _build(config, params, zeros)


def slot_update(adapter: LoraAdapter, config: ModelConfig, params: Params, max_rank: int, dtype: Any) -> LoraTree:
    """Host arrays of one slot holding `adapter` (zero-padded to `max_rank`; zero where it
    adapts nothing): the tree of `init_lora_weights` without the slot axis."""
    dtype = numpy_dtype(dtype)

    def one_slot(layers: tuple[int, ...], target: str) -> dict[str, np.ndarray]:
        d_in, d_out = target_dims(config, target)
        a_out = np.zeros((len(layers), d_in, max_rank), dtype)
        b_out = np.zeros((len(layers), max_rank, d_out), dtype)
        for row, layer in enumerate(layers):
            pair = adapter.weights.get((layer, target))
            if pair is not None:
                a, b = pair
                a_out[row, :, : a.shape[1]] = a
                b_out[row, : b.shape[0], :] = b
        if not _stacked(layers[0], params):
            a_out, b_out = a_out[0], b_out[0]
        return {"a": a_out, "b": b_out}

    return _build(config, params, one_slot)


def _write_slot(lora: LoraTree, slot: jax.Array, update: LoraTree) -> LoraTree:
    stacks = [
        jax.tree_util.tree_map(lambda w, u: jax.lax.dynamic_update_index_in_dim(w, u.astype(w.dtype), slot, 1), s, u)
        for s, u in zip(lora["layer_stacks"], update["layer_stacks"])
    ]
    layers = [
        jax.tree_util.tree_map(lambda w, u: jax.lax.dynamic_update_index_in_dim(w, u.astype(w.dtype), slot, 0), s, u)
        for s, u in zip(lora["layers"], update["layers"])
    ]
    return {"layer_stacks": stacks, "layers": layers}


@functools.cache
def _write_jit():
    return jax.jit(_write_slot, donate_argnums=(0,))


def write_slot(lora: LoraTree, slot: int, update: LoraTree) -> LoraTree:
    """`lora` with slot `slot` replaced by `update` (`lora`'s buffers are donated: use the result)."""
    return _write_jit()(lora, np.int32(slot), update)


def empty_slot(config: ModelConfig, params: Params, max_rank: int, dtype: Any) -> LoraTree:
    """The update of a slot holding no adapter (zeros; warm-up compiles `write_slot` with it)."""
    return slot_update(LoraAdapter(None, 0, 0.0, {}), config, params, max_rank, dtype)
