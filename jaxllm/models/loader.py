"""Load a Hugging Face safetensors checkpoint into the decoder's parameter pytree, sharded.

Only safetensors are read (never pickle `.bin` files, never remote code). Every tensor
the config implies must be present with the right shape and nothing else may be: a
silently ignored or missing tensor would give wrong outputs, so both raise ValueError
naming the tensors. What each tensor is and where it goes comes from the one weight
declaration (`jaxllm.models.weights`); MoE experts are accepted per expert (the hub
layout) or fused (transformers' in-memory `experts.gate_up_proj` / `experts.down_proj`).

Loading is per device shard: for each parameter and each device, the box of the
parameter that device holds is read from the file with `safe_open(...).get_slice`, put
on that device, and dropped from host memory before the next one is read; the global
array is assembled from the per-device pieces. A sharded tensor therefore never exists
whole in host memory or on one device. A directory written by `jaxllm convert` (orbax)
is restored instead, directly into the same shardings.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jaxllm.models.awq_gptq import int4_group_tensors
from jaxllm.models.deepseek_weights import log_skipped_mtp, mtp_shared_copies, mtp_tensor_names
from jaxllm.models.int_checkpoint_view import DequantizedTensors
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.orbax_io import is_converted, restore_converted
from jaxllm.models.partitioning import kv_replicas_for, rules_for
from jaxllm.models.quant_config import KV_SCALE_SUFFIXES
from jaxllm.models.quantization import FP8
from jaxllm.models.quantized_loading import (
    FP8_SOURCE,
    Fp8Files,
    assemble_quantized,
    check_quantized,
    scale_candidates,
)
from jaxllm.models.weight_layout import Source
from jaxllm.models.weight_reading import read_parameter_view, read_stacked_view
from jaxllm.models.weights import (
    Params,
    StackedDecl,
    WeightDecl,
    build_params,
    declare_params,
    declare_weights,
    layer_stacks,
    stack_declarations,
    stacked_layer_rows,
)
from sharding.mesh import ParallelConfig, expert_parallel_size, make_mesh
from sharding.rules import ShardingRules, named_sharding
from sharding.slot_table import default_assignment, make_slot_table, make_stacked_slot_table, resolve_assignments

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_SOURCES = ("F64", "F32", "F16", "BF16")
_PROGRESS_MIN_BYTES = 256 * 1024 * 1024
# Buffers some exporters save that carry no weights, and KV cache scales (read by
# `jaxllm.models.kv_quant` for an FP8 KV cache).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# What safetensors or numpy raise on a truncated, garbled or inconsistent file.
_FILE_ERRORS = (SafetensorError, OSError, ValueError, TypeError, OverflowError, MemoryError, RecursionError)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the sharded index's files, else `model.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, AttributeError, RecursionError, OSError) as exc:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"checkpoint shards listed in {index.name} are missing: {', '.join(absent)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES) if model_dir.is_dir() else []
    if pickles:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); only safetensors checkpoints are loaded"
        )
    raise ValueError(f"no *.safetensors checkpoint in {model_dir}")


def slot_assignments_for(
    config: ModelConfig,
    mesh: jax.sharding.Mesh,
    slot_assignments: Optional[dict[int, Sequence[int]]] = None,
    num_slots: Optional[int] = None,
) -> Optional[dict[int, np.ndarray]]:
    """Slot -> expert of every MoE layer when the experts are stored as slots (expert
    parallelism on `mesh`, or an explicit placement), else None (the plain expert stack)."""
    ep = expert_parallel_size(mesh)
    if not config.num_experts:
        if slot_assignments or num_slots:
            raise ValueError(f"an expert placement was given but {config.architecture} has no experts")
        return None
    if ep == 1 and not slot_assignments and num_slots is None:
        return None
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    return resolve_assignments(config.num_experts, moe_layers, ep, slot_assignments, num_slots)


def param_shardings(
    config: ModelConfig, mesh: jax.sharding.Mesh, rules: Optional[ShardingRules] = None, *, mtp: bool = False
) -> Params:
    """The parameter pytree as NamedShardings on `mesh` (with `mtp`, the MTP layers' too)."""
    rules = rules or rules_for(config, mesh)
    decls = declare_params(config, kv_replicas_for(config, mesh, rules), mtp=mtp)
    return build_params(((w.path, named_sharding(mesh, w.axes, rules)) for w in decls), config, layer_stacks(config))


class _Header:
    """Names, shapes and dtypes of every tensor in the checkpoint's files (headers only)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.files = list(files)
        self.file_of: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        for path in self.files:
            try:
                self._read(path)
            except ValueError as exc:
                if str(path) in str(exc) or path.name in str(exc):
                    raise
                raise ValueError(f"{path} is not a valid safetensors file: {exc}") from None
            except _FILE_ERRORS as exc:
                raise ValueError(f"{path} is not a valid safetensors file: {_first_line(exc)}") from None

    def _read(self, path: Path) -> None:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                if name in self.file_of:
                    raise ValueError(f"tensor {name} appears in both {self.file_of[name].name} and {path.name}")
                sl = f.get_slice(name)
                self.file_of[name] = path
                self.shape[name] = tuple(sl.get_shape())
                self.dtype[name] = sl.get_dtype()

    def substitute(self, presented: dict[str, tuple[tuple[int, ...], str, str]], replaced: set[str]) -> None:
        """Tensors read through a view (AWQ / GPTQ modules): `presented` name -> (shape, dtype,
        the real tensor it comes from) take the place of the `replaced` real ones."""
        for name in replaced:
            self.shape.pop(name, None)
            self.dtype.pop(name, None)
        for name, (shape, dtype, source) in presented.items():
            self.shape[name], self.dtype[name], self.file_of[name] = shape, dtype, self.file_of[source]

    def check_layers(self, config: ModelConfig, model_dir: str | Path) -> None:
        """Every layer the config declares has tensors in the checkpoint (checked before the
        weights are declared, so an absurd layer count costs nothing)."""
        present = {int(m.group(1)) for n in self.shape if (m := _LAYER_NAME.match(n))}
        missing = [i for i in range(config.num_layers) if i not in present]
        if missing:
            raise ValueError(
                f"config.json in {model_dir} declares num_hidden_layers={config.num_layers} but the checkpoint "
                f"has no tensors for {len(missing)} of them (first: layer {missing[0]})"
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _choose_alternatives(
    header: _Header,
    decls: list[WeightDecl],
    config: ModelConfig,
    model_dir: str | Path,
    scales: set[str],
    load_mtp: bool = False,
) -> list[Sequence[Source]]:
    """For each parameter, the one spelling the checkpoint uses, after checking names, shapes
    and dtypes from the headers alone (before any tensor data is read). `scales`: the scale
    tensors a float8 checkpoint may hold (checked by `quantized_loading.check_quantized`).
    Multi-token-prediction tensors are skipped with a log line unless `load_mtp` declared
    them; their copies of the embedding and LM head are never read."""
    known: dict[str, Source] = {src.name: src for w in decls for alt in w.alternatives for src in alt}
    if config.quantization is None:
        fp8 = sorted(n for n, dt in header.dtype.items() if dt == FP8_SOURCE)
        if fp8:
            raise ValueError(f"tensor {fp8[0]} is float8_e4m3fn but config.json has no quantization_config")
    if config.model_type == "deepseek_v3":
        mtp = mtp_tensor_names(config, [n for n in header.shape if n not in known])
        if load_mtp:
            copies = {
                n for j in range(config.num_nextn_predict_layers) for n in mtp_shared_copies(config.num_layers + j)
            }
            mtp = [n for n in mtp if n in copies]
        elif mtp:
            log_skipped_mtp(mtp)
        known_or_skipped = set(mtp)
    else:
        known_or_skipped = set()
    unexpected = sorted(
        n
        for n in header.shape
        if n not in known
        and n not in scales
        and n not in known_or_skipped
        and not (config.tie_word_embeddings and n == "lm_head.weight")
        and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint for {config.architecture}: {_summary(unexpected)}")
    for name, shape in header.shape.items():
        if name not in known:
            continue
        where = header.file_of[name].name
        if shape != known[name].shape:
            raise ValueError(f"tensor {name} in {where} has shape {list(shape)}, expected {list(known[name].shape)}")
        quantized = (config.quantization.checkpoint_dtype,) if config.quantization is not None else ()
        if header.dtype[name] not in _FLOAT_SOURCES + (FP8_SOURCE,) + quantized:
            raise ValueError(
                f"tensor {name} in {where} has dtype {header.dtype[name]}; "
                "only float and float8_e4m3fn checkpoints (and GGUF's int8 values) are supported"
            )
    chosen, missing = [], []
    for decl in decls:
        present = [alt for alt in decl.alternatives if any(src.name in header.shape for src in alt)]
        if len(present) > 1:
            names = sorted({src.name for alt in present for src in alt if src.name in header.shape})
            raise ValueError(
                f"tensors {_summary(names, 4)} give the same weights twice (fused and per-expert expert tensors mixed?)"
            )
        alt = present[0] if present else decl.alternatives[0]
        absent = [src.name for src in alt if src.name not in header.shape]
        missing.extend(absent)
        chosen.append(alt)
    if missing:
        raise ValueError(f"tensors missing from checkpoint in {model_dir}: {_summary(sorted(set(missing)))}")
    return chosen


def _summary(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


@functools.cache
def _to_layout(perm: tuple[int, ...], dtype: np.dtype):
    """Transpose and cast one device piece on its device (cached per layout; a device
    transposes far faster than numpy, and the host never copies the piece twice)."""
    return jax.jit(lambda a: jnp.transpose(a, perm).astype(dtype))


def assemble_array(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    read_box: Callable[[tuple[slice, ...]], tuple[np.ndarray, tuple[int, ...]]],
    dtype: np.dtype,
) -> jax.Array:
    """A global array whose every device piece is read by `read_box(index)` -> (block, perm)
    and put on its device (then transposed by perm and cast there) before the next is read:
    host memory holds one piece at a time (replicas of the same box are read once)."""
    pieces: dict[jax.Device, jax.Array] = {}
    by_box: dict[tuple, list[jax.Device]] = {}
    index_map = sharding.addressable_devices_indices_map(shape)
    for device, index in index_map.items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        by_box.setdefault(key, []).append(device)
    for key, devices in by_box.items():
        block, perm = read_box(tuple(slice(a, b) for a, b in key))
        identity = perm == tuple(range(len(perm))) and block.dtype == dtype
        for device in devices:
            piece = jax.device_put(block, device)
            pieces[device] = piece if identity else _to_layout(perm, dtype)(piece)
        del block
    arrays = [pieces[d] for d in index_map]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_params(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: Any = None,
    *,
    mesh: Optional[jax.sharding.Mesh] = None,
    rules: Optional[ShardingRules] = None,
    slice_hook: Optional[Callable[[str, tuple[slice, ...], np.ndarray], None]] = None,
    slot_assignments: Optional[dict[int, Sequence[int]]] = None,
    num_slots: Optional[int] = None,
    load_mtp: bool = False,
) -> Params:
    """Read the checkpoint in `model_dir` into the parameter pytree, sharded over `mesh`.

    `mesh` defaults to a one-device mesh; `rules` to `rules_for(config, mesh)`.
    With expert parallelism (or an explicit placement: `slot_assignments`, MoE layer ->
    expert of each of `num_slots` slots, missing layers placed by default) each device
    reads its slots' experts, and every MoE layer gets its `SlotTable` under "slots".
    With `config.scan_layers` the other layers are read straight into their layer stacks
    (see `jaxllm.models.weights`), each device piece stacked on the host from the layers' boxes.
    `slice_hook(name, slices, array)` sees every read from the files (for measurements).
    `load_mtp` also reads DeepSeek-V3's multi-token-prediction layers into `params["mtp"]`
    (`jaxllm.models.mtp`; under expert parallelism their experts in the default placement of
    the main layers' slot count); by default they are skipped.
    """
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
    rules = rules or rules_for(config, mesh)
    assignments = slot_assignments_for(config, mesh, slot_assignments, num_slots)
    mtp_assignments = _mtp_slot_assignments(config, model_dir, mesh, assignments) if load_mtp else {}
    if is_converted(model_dir):
        if config.quantization is not None:
            raise ValueError(
                f"{model_dir} is a converted (orbax) checkpoint: quantized weights load from safetensors only"
            )
        restored = restore_converted(model_dir, config, dtype, mesh=mesh, rules=rules, slot_assignments=assignments)
        params = stack_params(restored, config, mesh, rules, delete_layers=True)
        _add_slot_tables(params, config, mesh, assignments)
        return params
    np_dtype = numpy_dtype(dtype or config.dtype)
    header = _Header(checkpoint_files(model_dir))
    header.check_layers(config, model_dir)
    # An integer checkpoint's format, to dequantize (then quantize as asked, or keep in float).
    stored = config.quantization.stored if config.quantization is not None else config.dequantized_from
    int4_groups = int4_group_tensors(header.shape, header.dtype, stored or config.quantization)
    if int4_groups is not None:
        header.substitute(int4_groups.names(), int4_groups.packed_names())
    dequantized = DequantizedTensors(header.shape, header.dtype, stored) if stored is not None else None
    if dequantized is not None:
        header.substitute(dequantized.names(), dequantized.hidden_names())
    all_assignments = None if assignments is None else {**assignments, **mtp_assignments}
    decls = declare_weights(config, kv_replicas_for(config, mesh, rules), all_assignments, mtp=load_mtp)
    chosen = _choose_alternatives(header, decls, config, model_dir, scale_candidates(decls, config), load_mtp)
    decls, _ = check_quantized(decls, chosen, header.shape, header.dtype, config)
    chosen_for = dict(zip((d.path for d in decls), chosen))
    stacks = layer_stacks(config)
    param_decls = stack_declarations(decls, stacks)
    fp8_files = Fp8Files(header.files) if any(dt == FP8_SOURCE for dt in header.dtype.values()) else None
    total_bytes = sum(int(np.prod(s)) * _ITEMSIZE.get(header.dtype[n], 1) for n, s in header.shape.items())
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="np")) for path in header.files}

        def raw(name: str) -> np.ndarray:
            return handles[header.file_of[name]].get_tensor(name)

        def stored_tensor(name: str) -> np.ndarray:  # in the checkpoint's integer format
            return int4_groups.read(name, (Ellipsis,), raw) if int4_groups and name in int4_groups else raw(name)

        def read(name: str, slices: tuple[slice, ...]) -> np.ndarray:
            try:
                if fp8_files is not None and name in fp8_files:
                    array = fp8_files.read(name, slices)
                elif dequantized is not None and name in dequantized:
                    array = dequantized.read(name, slices, stored_tensor)
                elif int4_groups is not None and name in int4_groups:
                    array = int4_groups.read(name, slices, raw)
                else:
                    array = handles[header.file_of[name]].get_slice(name)[slices]
            except _FILE_ERRORS as exc:
                raise ValueError(f"tensor {name} in {header.file_of[name]} is unreadable: {_first_line(exc)}") from None
            # NaN or infinite weights would load silently and make every output garbage.
            if not np.isfinite(array).all():
                raise ValueError(f"tensor {name} in {header.file_of[name]} holds NaN or infinite values")
            if slice_hook is not None:
                slice_hook(name, slices, array)
            return array

        def read_box(decl: WeightDecl | StackedDecl, index: tuple[slice, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
            if isinstance(decl, StackedDecl):
                return read_stacked_view(decl, [chosen_for[m.path] for m in decl.members], index, read)
            return read_parameter_view(decl, chosen_for[decl.path], index, read)

        def read_full(name: str) -> np.ndarray:
            return read(name, tuple(slice(None) for _ in header.shape[name]))

        def read_param(decl: WeightDecl | StackedDecl) -> np.ndarray:
            block, perm = read_box(decl, tuple(slice(None) for _ in decl.shape))
            return np.ascontiguousarray(block.transpose(perm)).astype(np.float32, copy=False)

        leaves: list[tuple[tuple, Any]] = []
        with tqdm(
            total=len(param_decls), desc="Loading weights", unit="tensor", disable=total_bytes < _PROGRESS_MIN_BYTES
        ) as bar:
            for decl in param_decls:
                sharding = named_sharding(mesh, decl.axes, rules)
                if decl.quant is not None:
                    if isinstance(decl, StackedDecl) and len({m.quant for m in decl.members}) > 1:
                        raise ValueError(f"layers of stack {decl.path[1]} mix float8 and float {decl.path[2:]} weights")
                    alts = (
                        [chosen_for[m.path] for m in decl.members]
                        if isinstance(decl, StackedDecl)
                        else [chosen_for[decl.path]]
                    )
                    leaves.append(
                        (
                            decl.path,
                            assemble_quantized(
                                decl,
                                alts,
                                config,
                                mesh,
                                sharding.spec,
                                read_full,
                                functools.partial(
                                    assemble_array,
                                    decl.shape,
                                    sharding,
                                    functools.partial(read_box, decl),
                                    FP8 if decl.quant.dtype == FP8.name else np.dtype(np.int8),
                                ),
                                functools.partial(read_param, decl),
                            ),
                        )
                    )
                    bar.update(1)
                    continue
                leaves.append(
                    (
                        decl.path,
                        assemble_array(
                            decl.shape, sharding, functools.partial(read_box, decl), decl.param_dtype(np_dtype)
                        ),
                    )
                )
                bar.update(1)
    params = build_params(leaves, config, stacks)
    _add_slot_tables(params, config, mesh, assignments)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for layer, slot_to_expert in mtp_assignments.items():
        moe = params["mtp"][layer - config.num_layers]["moe"]
        moe["slots"] = make_slot_table(slot_to_expert, config.num_experts, replicated)
    return params


def _mtp_slot_assignments(
    config: ModelConfig, model_dir: str | Path, mesh: jax.sharding.Mesh, assignments: Optional[dict]
) -> dict[int, np.ndarray]:
    """The MTP layers' expert slots (layer -> expert of each slot) when the main layers have
    slots, else none; refuses configs without MTP layers and converted checkpoints."""
    if config.model_type != "deepseek_v3" or not config.num_nextn_predict_layers:
        raise ValueError(
            f"load_mtp: {config.architecture} config in {model_dir} has no multi-token-prediction layers "
            "(num_nextn_predict_layers)"
        )
    if is_converted(model_dir):
        raise ValueError(f"load_mtp: {model_dir} is a converted (orbax) checkpoint; MTP layers load from safetensors")
    if assignments is None:
        return {}
    num_slots = len(next(iter(assignments.values()))) if assignments else config.num_experts
    ep = expert_parallel_size(mesh)
    layers = range(config.num_layers, config.num_layers + config.num_nextn_predict_layers)
    return {layer: default_assignment(config.num_experts, num_slots, ep) for layer in layers}


def _add_slot_tables(
    params: Params, config: ModelConfig, mesh: jax.sharding.Mesh, assignments: Optional[dict[int, np.ndarray]]
) -> None:
    """Each slot layer's `SlotTable`: in `layers[i]["moe"]` for a layer stored apart, else one
    table of [n, ...] arrays in its stack's `moe` (row r: the stack's r-th layer)."""
    if assignments is None:
        return
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = stacked_layer_rows(params)
    by_stack: dict[int, dict[int, np.ndarray]] = {}
    for layer, slot_to_expert in assignments.items():
        if layer in rows:
            g, row = rows[layer]
            by_stack.setdefault(g, {})[row] = slot_to_expert
        else:
            params["layers"][layer]["moe"]["slots"] = make_slot_table(slot_to_expert, config.num_experts, replicated)
    for g, tables in by_stack.items():
        if sorted(tables) != list(range(len(tables))) or "moe" not in params["layer_stacks"][g]:
            raise ValueError(f"layer stack {g} mixes slot layers with other layers")
        params["layer_stacks"][g]["moe"]["slots"] = make_stacked_slot_table(
            [tables[r] for r in range(len(tables))], config.num_experts, replicated
        )


def stack_params(
    params: Params,
    config: ModelConfig,
    mesh: Optional[jax.sharding.Mesh] = None,
    rules: Optional[ShardingRules] = None,
    *,
    delete_layers: bool = False,
) -> Params:
    """Per-layer parameters (the `scan_layers=False` layout) in `config`'s layer stacks, on
    the devices (slot layers too; their slot tables, when present, stacked alike). Each stacked
    leaf is built on the devices; with `delete_layers` its per-layer arrays are deleted before
    the next, so the extra memory is one leaf's stack (`params` is unusable afterwards)."""
    if params.get("layer_stacks"):
        return params
    stacks = layer_stacks(config)
    if not stacks:
        return params
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
    rules = rules or rules_for(config, mesh)
    decls = declare_weights(config, kv_replicas_for(config, mesh, rules))
    by_path = {d.path: d for d in decls}
    layers = list(params["layers"])
    leaves = [(d.path, _lookup(params, d.path)) for d in decls if d.path[0] != "layers"]
    for decl in stack_declarations([by_path[p] for p in by_path if p[0] == "layers"], stacks):
        if not isinstance(decl, StackedDecl):
            continue
        members = [_lookup(params, m.path) for m in decl.members]
        sharding = named_sharding(mesh, decl.axes, rules)
        leaves.append((decl.path, jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*members)))
        if delete_layers:
            for member in members:
                member.delete()
    tree = build_params(leaves, config, stacks)
    for g, s in enumerate(stacks):  # slot tables are not declared weights
        tables = [layers[i].get("moe", {}).get("slots") for i in range(s.start, s.stop)]
        if all(t is not None for t in tables):
            tree["layer_stacks"][g]["moe"]["slots"] = jax.tree.map(lambda *rows: jnp.stack(rows), *tables)
    return tree


def _lookup(tree: Params, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree
