"""The one declaration of a decoder's weights, from which everything else is derived.

`declare_weights(config)` lists every parameter once: its path in the parameter pytree,
shape, logical axes (which `sharding.rules` maps to mesh axes), how it is initialised in
random presets, and the checkpoint tensors it can be read from with the layout change
that turns each into the parameter. From that list come:

- the pytree of shapes (`param_shapes`) and of PartitionSpecs (`partition_specs`),
- byte counts (`param_bytes`),
- the loader (`jaxllm.models.loader`), which reads each device's shard straight from the
  checkpoint through `jaxllm.models.weight_reading.read_parameter_view`,
- random checkpoints in Hugging Face layout come from it (`jaxllm.models.random_checkpoint`).

With `config.quantization` the linear projections are declared quantized (`WeightDecl.quant`:
quantized values and block scales in the parameter's axis order, `jaxllm.models.quantization`);
shapes, specs and bytes then give a `QuantizedWeight` pair per such parameter.

Parameter layout (the decoder's pytree):

    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied)
    layers[i]: attn_norm [H], mlp_norm [H],
      (DeepSeek-V3: attn is multi-head latent attention, moe adds router_bias [E] and the
       layer has shared experts; see `jaxllm.models.deepseek_weights`)
      attn: q [H, Hq, D], k [H, Hkv', D], v [H, Hkv', D], o [Hq, D, H]
            (+ q_bias [Hq, D], k_bias / v_bias [Hkv', D] with attention_bias;
               o_bias [H] with o_proj_bias; q_norm / k_norm [D] with qk_norm)
      mlp:  gate [H, I], up [H, I], down [I, H]                                (dense layers)
      moe:  router [H, E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H]  (sparse layers)
            (expert parallelism: [S, ...] over S slots, plus `slots`, the layer's
             `sharding.slot_table.SlotTable`, attached by the loader, not declared)

Layer stacks (`ModelConfig.scan_layers`, the default): runs of consecutive layers of one
kind (dense or MoE) are stored stacked, so the decoder runs each run as one `lax.scan`
step and its compile time does not grow with depth:

    layer_stacks[g]: the layer pytree above with every leaf [n, ...] (n layers of the run)
    layers[i]: {} for a layer that lives in a stack

Expert-parallel slot layers stack like the others: their slot buffers become [n, S, ...]
(the leading layer axis never sharded, the slot axis split over `expert`) and their slot
tables [n, ...] (`layer_stacks[g]["moe"]["slots"]`, attached by the loader). The online
balancer still rewrites one layer at a time, in place, through a donated update of row
l of the stacked buffer with l a traced index (`sharding.slot_update`), so one compiled
update serves every layer. `layer_stacks(config, unstacked)` says which layers form which
stack, statically, so the loader and the decoder agree; `stacked_layer_rows(params)` where
each stacked layer's row lives.

Hkv' = Hkv * kv_replicas: with fewer KV heads than tensor-parallel ranks each KV head is
stored `kv_replicas` times in a row (see `sharding.rules.kv_head_replicas`); attention
over repeated heads is the same function, since query head j still meets a copy of
KV head j // (Hq / Hkv).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import jax
import numpy as np

from jaxllm.models.deepseek_weights import declare_mla_attention, declare_moe_extras, declare_mtp_extras
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.quantization import QuantizedWeight, WeightQuant, quantized_decl, value_spec
from jaxllm.models.weight_layout import Layout, Source
from sharding.rules import ShardingRules, logical_to_physical

KeyPath = tuple  # e.g. ("layers", 3, "attn", "q")
Params = dict[str, Any]
# Reads the box `slices` of a checkpoint tensor: (name, slices) -> numpy array.
SliceReader = Callable[[str, tuple[slice, ...]], np.ndarray]


@dataclass(frozen=True)
class WeightDecl:
    path: KeyPath
    shape: tuple[int, ...]
    axes: tuple[Optional[str], ...]  # logical axis of each dimension
    # Ways the checkpoint may spell this parameter; the first is the canonical one (named
    # when the tensor is missing, written by `random_checkpoint`). Each is one tensor, or
    # one tensor per part of the first axis (per-expert weights).
    alternatives: tuple[tuple[Source, ...], ...]
    init: str  # "norm", "embed", "linear", "bias"
    gain: float = 1.0
    # Expert slots: parameter row i is row rows_from[i] of the stack of `source_rows` experts
    # the alternatives describe (a placement may repeat an expert in several slots).
    rows_from: Optional[tuple[int, ...]] = None
    source_rows: int = 0
    dtype: Optional[str] = None  # kept in this dtype whatever the model's (DeepSeek's float32 router bias)
    quant: Optional[WeightQuant] = None  # stored quantized (FP8 / int8 / int4 values + block scales)

    def param_dtype(self, model_dtype: Any) -> np.dtype:
        return numpy_dtype(self.dtype or model_dtype)

    def nbytes(self, model_dtype: Any) -> int:
        if self.quant is not None:
            return self.quant.nbytes(self.shape)
        return int(np.prod(self.shape)) * self.param_dtype(model_dtype).itemsize

    @property
    def checkpoint_names(self) -> set[str]:
        return {src.name for alt in self.alternatives for src in alt}


# ---------------------------------------------------------------------------------------------
# Declaration


def _identity(shape: tuple[int, ...]) -> Layout:
    return Layout(shape, tuple(range(len(shape))))


def _transposed(out_features: int, in_features: int) -> Layout:
    """torch Linear [out, in] -> [in, out]."""
    return Layout((out_features, in_features), (1, 0))


def declare_weights(
    config: ModelConfig,
    kv_replicas: int = 1,
    slot_assignments: Optional[Mapping[int, Sequence[int]]] = None,
    *,
    mtp: bool = False,
) -> list[WeightDecl]:
    """Every parameter of `config`'s decoder, in pytree order.

    `slot_assignments` (MoE layer -> expert of each slot) stores those layers' experts as
    slots, [num_slots, ...] (expert parallelism; see `sharding.slot_table`). `mtp` adds
    DeepSeek-V3's multi-token-prediction layers under `mtp[j]` (see `jaxllm.models.mtp`)."""
    c = config
    h = c.hidden_size
    decls: list[WeightDecl] = []

    def add(
        path: KeyPath,
        shape: tuple[int, ...],
        axes: tuple,
        alternatives: Sequence[Sequence[Source]],
        init: str,
        gain: float = 1.0,
        rows_from: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
    ) -> None:
        if rows_from is not None:
            source_rows, shape = shape[0], (len(rows_from),) + tuple(shape[1:])
            rows_from = tuple(int(r) for r in rows_from)
        else:
            source_rows = 0
        decls.append(
            WeightDecl(
                path,
                tuple(shape),
                tuple(axes),
                tuple(tuple(a) for a in alternatives),
                init,
                gain,
                rows_from,
                source_rows,
                dtype,
            )
        )

    def single(name: str, shape: tuple[int, ...], layout: Layout) -> list[list[Source]]:
        return [[Source(name, shape, layout)]]

    add(
        ("embed",),
        (c.vocab_size, h),
        ("vocab", "embed"),
        single("model.embed_tokens.weight", (c.vocab_size, h), _identity((c.vocab_size, h))),
        "embed",
    )
    for layer in range(c.num_layers):
        _declare_layer(add, c, layer, kv_replicas, (slot_assignments or {}).get(layer))
    add(("final_norm",), (h,), ("embed",), single("model.norm.weight", (h,), _identity((h,))), "norm")
    if not c.tie_word_embeddings:
        add(
            ("lm_head",),
            (h, c.vocab_size),
            ("embed", "vocab"),
            single("lm_head.weight", (c.vocab_size, h), _transposed(c.vocab_size, h)),
            "linear",
            gain=3.0,
        )
    if mtp:
        if not c.num_nextn_predict_layers:
            raise ValueError(f"{c.architecture} config has no multi-token-prediction layers (num_nextn_predict_layers)")
        for j in range(c.num_nextn_predict_layers):
            mtp_add = _moved(add, c.num_layers + j, ("mtp", j))
            declare_mtp_extras(mtp_add, c, c.num_layers + j)
            _declare_layer(mtp_add, c, c.num_layers + j, kv_replicas, (slot_assignments or {}).get(c.num_layers + j))
    return [quantized_decl(d, c) for d in decls] if c.quantization is not None else decls


def _moved(add: Callable, layer: int, prefix: KeyPath) -> Callable:
    """`add` with the paths of `layer` (`("layers", layer, ...)`) moved under `prefix`: the
    multi-token-prediction layers are declared by the decoder layers' code, stored apart."""

    def moved(path: KeyPath, *args: Any, **kwargs: Any) -> None:
        assert path[:2] == ("layers", layer), path
        add(prefix + tuple(path[2:]), *args, **kwargs)

    return moved


def _declare_layer(
    add: Callable, c: ModelConfig, layer: int, kv_replicas: int, slot_to_expert: Optional[Sequence[int]]
) -> None:
    """One decoder layer's parameters (`layers[layer]`, checkpoint `model.layers.{layer}`)."""
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads

    def single(name: str, shape: tuple[int, ...], layout: Layout) -> list[list[Source]]:
        return [[Source(name, shape, layout)]]

    pre, at = f"model.layers.{layer}", ("layers", layer, "attn")
    add(
        ("layers", layer, "attn_norm"),
        (h,),
        ("embed",),
        single(f"{pre}.input_layernorm.weight", (h,), _identity((h,))),
        "norm",
    )
    if c.is_mla:
        declare_mla_attention(add, c, layer)
    else:
        for proj, heads, axis, reps in (
            ("q", hq, "heads", 1),
            ("k", hkv, "kv_heads", kv_replicas),
            ("v", hkv, "kv_heads", kv_replicas),
        ):
            name = f"{pre}.self_attn.{proj}_proj"
            add(
                at + (proj,),
                (h, heads * reps, d),
                ("embed", axis, "head_dim"),
                single(f"{name}.weight", (heads * d, h), Layout((heads, d, h), (2, 0, 1), repeat_axis=0, repeat=reps)),
                "linear",
            )
            if c.attention_bias:
                add(
                    at + (f"{proj}_bias",),
                    (heads * reps, d),
                    (axis, "head_dim"),
                    single(f"{name}.bias", (heads * d,), Layout((heads, d), (0, 1), repeat_axis=0, repeat=reps)),
                    "bias",
                )
        add(
            at + ("o",),
            (hq, d, h),
            ("heads", "head_dim", "embed"),
            single(f"{pre}.self_attn.o_proj.weight", (h, hq * d), Layout((h, hq, d), (1, 2, 0))),
            "linear",
        )
        if c.o_proj_bias:
            add(
                at + ("o_bias",),
                (h,),
                ("embed",),
                single(f"{pre}.self_attn.o_proj.bias", (h,), _identity((h,))),
                "bias",
            )
        if c.qk_norm:
            for norm in ("q_norm", "k_norm"):
                add(
                    at + (norm,),
                    (d,),
                    ("head_dim",),
                    single(f"{pre}.self_attn.{norm}.weight", (d,), _identity((d,))),
                    "norm",
                )
    add(
        ("layers", layer, "mlp_norm"),
        (h,),
        ("embed",),
        single(f"{pre}.post_attention_layernorm.weight", (h,), _identity((h,))),
        "norm",
    )
    if c.is_moe_layer(layer):
        _declare_experts(add, c, layer, slot_to_expert)
        if c.model_type == "deepseek_v3":
            declare_moe_extras(add, c, layer)
    else:
        inter, mlp = c.intermediate_size, ("layers", layer, "mlp")
        for ours, hf in (("gate", "gate_proj"), ("up", "up_proj")):
            add(
                mlp + (ours,),
                (h, inter),
                ("embed", "mlp"),
                single(f"{pre}.mlp.{hf}.weight", (inter, h), _transposed(inter, h)),
                "linear",
            )
        add(
            mlp + ("down",),
            (inter, h),
            ("mlp", "embed"),
            single(f"{pre}.mlp.down_proj.weight", (h, inter), _transposed(h, inter)),
            "linear",
        )


def _declare_experts(
    add: Callable, config: ModelConfig, layer: int, slot_to_expert: Optional[Sequence[int]] = None
) -> None:
    """Router and stacked expert weights; experts stored per expert (the hub layout) or fused
    (transformers' in-memory `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]).
    With `slot_to_expert` the stack holds one row per slot, read from its expert."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    moe = ("layers", layer, "moe")
    if config.model_type == "mixtral":
        blocks = ("block_sparse_moe", "mlp")
        names = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
    else:
        blocks = ("mlp",)
        names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    bases = [f"model.layers.{layer}.{block}" for block in blocks]
    add(
        moe + ("router",),
        (h, e),
        ("embed", None),
        [[Source(f"{b}.gate.weight", (e, h), _transposed(e, h))] for b in bases],
        "linear",
        gain=2.0,
    )
    for ours, axes, stored in (
        ("w_gate", ("experts", "embed", "moe_mlp"), (i, h)),
        ("w_up", ("experts", "embed", "moe_mlp"), (i, h)),
        ("w_down", ("experts", "moe_mlp", "embed"), (h, i)),
    ):
        per_expert = [
            [Source(f"{b}.experts.{x}.{names[ours]}.weight", stored, _transposed(*stored), part=x) for x in range(e)]
            for b in bases
        ]
        if ours == "w_down":
            fused = [[Source(f"{b}.experts.down_proj", (e, h, i), Layout((e, h, i), (0, 2, 1)))] for b in bases]
        else:
            start = 0 if ours == "w_gate" else i
            fused = [
                [
                    Source(
                        f"{b}.experts.gate_up_proj",
                        (e, 2 * i, h),
                        Layout((e, 2 * i, h), (0, 2, 1), offset=(0, start, 0)),
                    )
                ]
                for b in bases
            ]
        shape = (e, h, i) if ours != "w_down" else (e, i, h)
        add(moe + (ours,), shape, axes, per_expert + fused, "linear", rows_from=slot_to_expert)


# ---------------------------------------------------------------------------------------------
# Layer stacks


@dataclass(frozen=True)
class LayerStack:
    """Layers [start, stop), all of one kind, stored as one stacked pytree (leaves [stop - start, ...])."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StackedDecl:
    """One stacked parameter: the same per-layer parameter of every layer of a stack, row i
    being layer `members[i]`'s. Its leading axis is never sharded."""

    path: KeyPath  # ("layer_stacks", g, ...)
    members: tuple[WeightDecl, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.members),) + self.members[0].shape

    @property
    def axes(self) -> tuple[Optional[str], ...]:
        return (None,) + self.members[0].axes

    def param_dtype(self, model_dtype: Any) -> np.dtype:
        return self.members[0].param_dtype(model_dtype)

    @property
    def quant(self) -> Optional[WeightQuant]:
        return self.members[0].quant

    def nbytes(self, model_dtype: Any) -> int:
        return sum(m.nbytes(model_dtype) for m in self.members)


ParamDecl = Union[WeightDecl, StackedDecl]


def layer_stacks(config: ModelConfig, unstacked: Collection[int] = ()) -> tuple[LayerStack, ...]:
    """The maximal runs of consecutive layers of the same kind (dense / MoE), skipping the
    layers in `unstacked`; none when the layers do not run as scans (`config.layer_scan`)."""
    if not config.layer_scan:
        return ()
    stacks: list[LayerStack] = []
    start = None
    for i in range(config.num_layers + 1):
        ends = (
            i == config.num_layers
            or i in unstacked
            or (start is not None and config.is_moe_layer(i) != config.is_moe_layer(start))
        )
        if start is not None and ends:
            stacks.append(LayerStack(start, i))
            start = None
        if start is None and i < config.num_layers and i not in unstacked:
            start = i
    return tuple(stacks)


def stacks_of_params(config: ModelConfig, params: Params) -> tuple[LayerStack, ...]:
    """The stacks a parameter pytree holds (layers stored apart are the non-empty `layers[i]`),
    checked against the stacked leaves' leading axis."""
    layers = params["layers"]
    if len(layers) != config.num_layers:
        raise ValueError(f"params hold {len(layers)} layers, the model {config.num_layers}")
    stored = params.get("layer_stacks", [])
    if not stored:
        return ()
    stacks = layer_stacks(config, [i for i, layer in enumerate(layers) if layer])
    sizes = [int(jax.tree_util.tree_leaves(tree)[0].shape[0]) for tree in stored]
    if sizes != [s.size for s in stacks]:
        raise ValueError(
            f"params hold layer stacks of sizes {sizes}, expected {[s.size for s in stacks]} "
            f"(scan_layers={config.scan_layers})"
        )
    return stacks


def stacked_layer_rows(params: Params) -> dict[int, tuple[int, int]]:
    """Decoder layer -> (stack g, row) of every layer stored in `params["layer_stacks"]`. Stacks
    are runs of consecutive layers in layer order, so the empty `layers[i]`, taken in order,
    fill the stacks in order (each as many as its leading axis says)."""
    sizes = [int(jax.tree_util.tree_leaves(tree)[0].shape[0]) for tree in params.get("layer_stacks", [])]
    empty = [i for i, layer in enumerate(params["layers"]) if not layer]
    if sum(sizes) != len(empty):
        raise ValueError(f"params hold {len(empty)} stacked layers but stacks of sizes {sizes}")
    rows, position = {}, iter(empty)
    for g, size in enumerate(sizes):
        for row in range(size):
            rows[next(position)] = (g, row)
    return rows


def stack_declarations(decls: Sequence[WeightDecl], stacks: Sequence[LayerStack]) -> list[ParamDecl]:
    """`decls` with every layer parameter of a stack folded into one `StackedDecl` (in the place
    of the stack's first layer)."""
    stack_of = {i: g for g, s in enumerate(stacks) for i in range(s.start, s.stop)}
    grouped: dict[KeyPath, list[WeightDecl]] = {}
    out: list[Any] = []
    for decl in decls:
        g = stack_of.get(decl.path[1]) if decl.path[0] == "layers" else None
        if g is None:
            out.append(decl)
            continue
        key = ("layer_stacks", g) + decl.path[2:]
        if key not in grouped:
            grouped[key] = []
            out.append(key)
        grouped[key].append(decl)
    return [StackedDecl(d, tuple(grouped[d])) if isinstance(d, tuple) else d for d in out]


def declare_params(
    config: ModelConfig,
    kv_replicas: int = 1,
    slot_assignments: Optional[Mapping[int, Sequence[int]]] = None,
    *,
    mtp: bool = False,
) -> list[ParamDecl]:
    """The parameters as stored: `declare_weights` with the layer stacks folded in (slot layers
    too: their stacks hold [n, num_slots, ...] buffers)."""
    return stack_declarations(declare_weights(config, kv_replicas, slot_assignments, mtp=mtp), layer_stacks(config))


def build_params(items: Iterable[tuple[KeyPath, Any]], config: ModelConfig, stacks: Sequence[LayerStack]) -> Params:
    """`build_tree` of parameter leaves, with the empty `layers[i]` of stacked layers."""
    empty = [(("layers", i), {}) for s in stacks for i in range(s.start, s.stop)]
    return build_tree(list(items) + empty)


# ---------------------------------------------------------------------------------------------
# Derived views


def build_tree(items: Iterable[tuple[KeyPath, Any]]) -> Params:
    """Nested dicts (string keys) and lists (integer keys) from (path, leaf) pairs."""
    root: dict = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    def finish(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(isinstance(k, int) for k in node):
            return [finish(node[k]) for k in sorted(node)]
        return {k: finish(v) for k, v in node.items()}

    return finish(root)


def param_shapes(config: ModelConfig, dtype: Any = None, kv_replicas: int = 1, *, mtp: bool = False) -> Params:
    """The parameter pytree as `jax.ShapeDtypeStruct`s: the layout the loader produces."""
    dt = dtype or config.dtype
    return build_params(
        ((w.path, param_shape(w, dt)) for w in declare_params(config, kv_replicas, mtp=mtp)),
        config,
        layer_stacks(config),
    )


def param_shape(decl: ParamDecl, dtype: Any) -> Any:
    """One parameter as `jax.ShapeDtypeStruct`s (a `QuantizedWeight` of two when quantized)."""
    if decl.quant is None:
        return jax.ShapeDtypeStruct(decl.shape, decl.param_dtype(dtype))
    q = decl.quant
    blocks = {leaf: jax.ShapeDtypeStruct(shape, dt) for leaf, (shape, dt) in q.block_arrays(decl.shape).items()}
    return QuantizedWeight.like(q, jax.ShapeDtypeStruct(q.value_shape(decl.shape), q.value_dtype()), **blocks)


def partition_specs(config: ModelConfig, rules: ShardingRules, kv_replicas: int = 1, *, mtp: bool = False) -> Params:
    """The parameter pytree as PartitionSpecs (under `rules`; a quantized weight's scales as its
    values, see `scale_spec` for the mesh's uneven splits)."""

    def spec(w: ParamDecl) -> Any:
        s = logical_to_physical(w.axes, rules)
        if w.quant is None:
            return s
        return QuantizedWeight.like(w.quant, value_spec(s, w.quant, len(w.shape)), s, s, super_scale=s, super_offset=s)

    return build_params(
        ((w.path, spec(w)) for w in declare_params(config, kv_replicas, mtp=mtp)),
        config,
        layer_stacks(config),
    )


def param_bytes(config: ModelConfig, dtype: Any = None, kv_replicas: int = 1, *, mtp: bool = False) -> int:
    """Bytes of all parameters (replicated KV heads counted once per copy)."""
    dt = dtype or config.dtype
    return sum(w.nbytes(dt) for w in declare_weights(config, kv_replicas, mtp=mtp))


def num_params(config: ModelConfig) -> int:
    return sum(int(np.prod(w.shape)) for w in declare_weights(config))
