"""Random weights drawn on the devices, in the parameter layout and shardings the loader gives
(`EngineConfig.load_format="dummy"`, TensorRT-LLM's and vLLM's dummy load format).

For benchmarks of full-size models without their checkpoints: writing 16 GB (Llama-3-8B) or
61 GB (Qwen3-30B-A3B) of random safetensors and reading them back takes minutes; drawing them
where they live takes about as long as writing the memory once. Each parameter of the one
weight declaration (`jaxllm.models.weights`) is drawn by a jitted normal draw whose output
sharding is the parameter's (`named_sharding` of its logical axes), scaled as
`random_checkpoint` scales the same tensor (norms near 1, linear layers gain / sqrt(fan_in)),
so activations stay as tame as with a random checkpoint. Stacked and other large parameters
are drawn one row of their leading axis at a time (`lax.map`), so the float32 draw never
needs more than one row's memory beside the result (an embedding's 150K rows are drawn whole:
a loop of that many trips costs more than its 1 GB of float32).

The values are not those of any checkpoint (a seeded draw of jax's generator, not numpy's),
and a KV head stored several times for tensor parallelism gets distinct copies: fine for
speed, not for comparing outputs. Not supported: quantized weights, expert slots (expert
parallelism, a load balancer, attention data parallelism) and MTP layers.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.partitioning import kv_replicas_for, rules_for
from jaxllm.models.weights import Params, StackedDecl, WeightDecl, build_params, declare_params, layer_stacks
from sharding.rules import ShardingRules, named_sharding

ROW_DRAW_MIN_ELEMENTS = 1 << 26  # above this many elements a parameter is drawn row by row,
ROW_DRAW_MAX_ROWS = 1024  # when its leading axis (layers, experts) is short: a loop trip per row


def _scale(decl: WeightDecl, config: ModelConfig) -> tuple[float, float]:
    """(offset, scale) of `random_checkpoint` for this parameter: value = offset + scale * noise."""
    if decl.init == "norm":
        return 1.0, 0.1
    if decl.init == "bias":
        return 0.0, 0.1
    if decl.init == "embed":
        return 0.0, 3.0 / math.sqrt(config.hidden_size) if config.tie_word_embeddings else 1.0
    fan_in = decl.alternatives[0][0].shape[-1]  # the checkpoint tensor's input features, as there
    return 0.0, decl.gain / math.sqrt(fan_in)


@functools.cache
def _drawer(shape: tuple[int, ...], dtype: np.dtype, offset: float, scale: float, sharding: Any) -> Any:
    """A jitted key -> array of `shape` in `sharding` (row by row when large); one per kind of
    parameter, so the layers of an unstacked model share their compiled draws."""

    def draw(key: jax.Array, row_shape: tuple[int, ...]) -> jax.Array:
        return (offset + scale * jax.random.normal(key, row_shape, jnp.float32)).astype(dtype)

    if len(shape) >= 2 and int(np.prod(shape)) > ROW_DRAW_MIN_ELEMENTS and shape[0] <= ROW_DRAW_MAX_ROWS:

        def by_rows(key: jax.Array) -> jax.Array:
            return jax.lax.map(lambda k: draw(k, shape[1:]), jax.random.split(key, shape[0]))

        return jax.jit(by_rows, out_shardings=sharding)
    return jax.jit(lambda key: draw(key, shape), out_shardings=sharding)


def random_params(
    config: ModelConfig,
    mesh: jax.sharding.Mesh,
    rules: Optional[ShardingRules] = None,
    *,
    seed: int = 0,
    dtype: Any = None,
) -> Params:
    """The parameter pytree `load_params` would give for `config` on `mesh` (same paths, shapes,
    dtypes and shardings), filled with seeded random values drawn on the devices."""
    if config.quantization is not None or config.dequantized_from is not None:
        raise ValueError("random (dummy) weights are float only: drop the quantization")
    rules = rules or rules_for(config, mesh)
    np_dtype = numpy_dtype(dtype or config.dtype)
    root = jax.random.key(seed)
    leaves: list[tuple[tuple, jax.Array]] = []
    for i, decl in enumerate(declare_params(config, kv_replicas_for(config, mesh, rules))):
        first = decl.members[0] if isinstance(decl, StackedDecl) else decl
        offset, scale = _scale(first, config)
        sharding = named_sharding(mesh, decl.axes, rules)
        draw = _drawer(decl.shape, decl.param_dtype(np_dtype), offset, scale, sharding)
        leaves.append((decl.path, draw(jax.random.fold_in(root, i))))
    return build_params(leaves, config, layer_stacks(config))
