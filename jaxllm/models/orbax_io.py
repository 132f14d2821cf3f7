"""A converted checkpoint format (orbax) that restores straight into the target sharding.

`jaxllm.models.convert.convert_checkpoint` reads a Hugging Face directory once (layout changes, stacking of
experts, dtype cast) and `write_converted` writes the parameter pytree with orbax-checkpoint next to the
config and tokenizer files. Restoring reads each device's shard directly from the
tensorstore files into its sharding, with none of the per-tensor transforms: the fast
path for restarting a large model. The stored KV heads are never replicated; when the
mesh needs replicas (fewer KV heads than tensor-parallel ranks) k/v are restored
replicated and repeated on device.

Experts are stored as the plain expert stack [E, ...]. Under expert parallelism (or with
an explicit placement) each MoE layer's stack is restored split over the `expert` axis
(replicated on it when E does not divide) and its slots [S, ...] are gathered from it on
the devices, straight into the slot sharding: any placement, redundant slots included,
restores from the same converted checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.partitioning import kv_replicas_for
from jaxllm.models.weights import Params, build_tree, declare_weights
from sharding.rules import ShardingRules, named_sharding

_MARKER = "jaxllm_converted.json"
_PARAMS_DIR = "params"
_FORMAT_VERSION = 1
# Files copied from the source directory so the converted one is a complete model directory.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def is_converted(model_dir: str | Path) -> bool:
    return (Path(model_dir) / _MARKER).is_file()


def write_converted(params: Params, model_dir: Path, output_dir: Path, dtype: str) -> Path:
    """Write `params` (per layer) as an orbax checkpoint in `output_dir`, with `model_dir`'s
    config and tokenizer files and the marker that `is_converted` looks for."""
    import orbax.checkpoint as ocp

    output_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(output_dir / _PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    for name in _SIDE_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, output_dir / name)
    (output_dir / _MARKER).write_text(json.dumps({"version": _FORMAT_VERSION, "dtype": dtype}))
    return output_dir


def restore_converted(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: Any = None,
    *,
    mesh: jax.sharding.Mesh,
    rules: ShardingRules,
    slot_assignments: Optional[Mapping[int, Sequence[int]]] = None,
) -> Params:
    """The parameters of a converted directory, each restored directly into its sharding.
    `slot_assignments` (MoE layer -> expert of each slot, as `load_params` resolves them)
    stores those layers' experts as slots, gathered on the devices from the expert stack."""
    import orbax.checkpoint as ocp

    model_dir = Path(model_dir).absolute()
    try:
        marker = json.loads((model_dir / _MARKER).read_text())
        if not isinstance(marker, dict):
            raise ValueError(f"a JSON object is expected, got {type(marker).__name__}")
    except (ValueError, OSError, RecursionError) as exc:
        raise ValueError(f"{model_dir / _MARKER} is unreadable: {exc}") from None
    if marker.get("version") != _FORMAT_VERSION:
        raise ValueError(f"{model_dir} was converted by an incompatible version ({marker.get('version')})")
    np_dtype = numpy_dtype(dtype or config.dtype)
    replicas = kv_replicas_for(config, mesh, rules)
    stored, final = declare_weights(config, 1), declare_weights(config, replicas, slot_assignments)
    targets = []
    for before, after in zip(stored, final):
        changed = before.shape != after.shape
        axes = before.axes
        if changed and "kv_heads" in axes:  # KV heads to repeat: restored replicated over that axis
            axes = tuple(None if a == "kv_heads" else a for a in axes)
        if changed and axes[:1] == ("experts",) and config.num_experts % _axis_size(mesh, rules.experts):
            axes = (None,) + tuple(axes[1:])  # an expert stack that does not split evenly: replicated
        sharding = named_sharding(mesh, axes, rules)
        targets.append(
            (before.path, jax.ShapeDtypeStruct(before.shape, before.param_dtype(np_dtype), sharding=sharding))
        )
    try:
        restored = ocp.StandardCheckpointer().restore(model_dir / _PARAMS_DIR, build_tree(targets))
    except Exception as exc:  # orbax and tensorstore raise many types for a damaged directory
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{model_dir / _PARAMS_DIR} could not be restored: {first}") from None
    if replicas == 1 and not slot_assignments:
        return restored
    leaves = []
    for before, after, value in zip(stored, final, _leaves_in_order(restored, stored)):
        if before.shape != after.shape:
            sharding = named_sharding(mesh, after.axes, rules)
            if after.axes[:1] == ("experts",):  # the layer's slots, from its expert stack
                rows = jnp.asarray(slot_assignments[after.path[1]], jnp.int32)
                value = jax.jit(lambda x, rows=rows: jnp.take(x, rows, axis=0), out_shardings=sharding)(value)
            else:
                axis = before.axes.index("kv_heads")
                value = jax.jit(lambda x, axis=axis: jnp.repeat(x, replicas, axis=axis), out_shardings=sharding)(value)
        leaves.append((after.path, value))
    return build_tree(leaves)


def _axis_size(mesh: jax.sharding.Mesh, axis: Any) -> int:
    names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    size = 1
    for name in names:
        size *= int(mesh.shape[name])
    return size


def _leaves_in_order(tree: Params, decls) -> list:
    out = []
    for w in decls:
        node = tree
        for key in w.path:
            node = node[key]
        out.append(node)
    return out


def checkpoint_bytes(model_dir: str | Path) -> int:
    return int(sum(p.stat().st_size for p in Path(model_dir).rglob("*") if p.is_file()))


__all__ = ["checkpoint_bytes", "is_converted", "restore_converted", "write_converted"]
