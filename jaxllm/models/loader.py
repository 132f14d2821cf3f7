"""Load a Hugging Face safetensors checkpoint into the decoder's parameter pytree.

Only safetensors are read (never pickle `.bin` files, never remote code). Every tensor
the config implies must be present with the right shape and nothing else may be: a
silently ignored or missing tensor would give wrong outputs, so both raise ValueError
naming the tensors. MoE experts are accepted per expert (the hub layout, and what
transformers' `save_pretrained` writes) or fused (transformers' in-memory
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]) and are stacked to
[E, H, I] / [E, I, H].
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxllm.models.config import ModelConfig, normalize_dtype
from jaxllm.models.decoder import Params, param_shapes
from jaxllm.models.safetensors_io import SafetensorsFile

_NP_TARGET = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16)}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_SOURCES = ("F64", "F32", "F16", "BF16")
_PROGRESS_MIN_BYTES = 256 * 1024 * 1024
# Buffers some exporters save that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

KeyPath = tuple  # a key path into the params pytree, e.g. ("layers", 3, "attn", "q")


@dataclass(frozen=True)
class _Source:
    """How one checkpoint tensor fills (part of) one parameter."""

    target: KeyPath
    shape: tuple[int, ...]  # shape expected in the checkpoint
    convert: Callable[[np.ndarray], np.ndarray]  # checkpoint layout -> parameter layout
    part: Optional[int] = None  # expert index for per-expert tensors; None = the whole parameter
    primary: bool = True  # the spelling named when the tensor is missing


@dataclass
class _Target:
    shape: tuple[int, ...]
    num_parts: int  # experts for stacked expert weights, else 1
    buffer: Optional[np.ndarray] = None
    filled: set = field(default_factory=set)
    value: Any = None


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _heads_in(num_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[heads*D, H] (torch Linear) -> [H, heads, D]."""
    return lambda w: w.reshape(num_heads, head_dim, -1).transpose(2, 0, 1)


def _heads_out(num_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[H, heads*D] (torch Linear) -> [heads, D, H]."""
    return lambda w: w.reshape(-1, num_heads, head_dim).transpose(1, 2, 0)


def _add(sources: dict[str, list[_Source]], name: str, *entries: _Source) -> None:
    sources.setdefault(name, []).extend(entries)


def _expert_sources(sources: dict[str, list[_Source]], config: ModelConfig, layer: int) -> None:
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    moe = ("layers", layer, "moe")
    if config.model_type == "mixtral":
        block_names = [("block_sparse_moe", True), ("mlp", False)]
        per_expert = (("w1", "w_gate", (i, h)), ("w3", "w_up", (i, h)), ("w2", "w_down", (h, i)))
    else:
        block_names = [("mlp", True)]
        per_expert = (("gate_proj", "w_gate", (i, h)), ("up_proj", "w_up", (i, h)), ("down_proj", "w_down", (h, i)))
    for block, primary in block_names:
        base = f"model.layers.{layer}.{block}"
        _add(sources, f"{base}.gate.weight", _Source(moe + ("router",), (e, h), _t, primary=primary))
        for expert in range(e):
            for hf_name, ours, shape in per_expert:
                _add(sources, f"{base}.experts.{expert}.{hf_name}.weight",
                     _Source(moe + (ours,), shape, _t, part=expert, primary=primary))
        _add(sources, f"{base}.experts.gate_up_proj",
             _Source(moe + ("w_gate",), (e, 2 * i, h), lambda w: w[:, :i].transpose(0, 2, 1), primary=False),
             _Source(moe + ("w_up",), (e, 2 * i, h), lambda w: w[:, i:].transpose(0, 2, 1), primary=False))
        _add(sources, f"{base}.experts.down_proj",
             _Source(moe + ("w_down",), (e, h, i), lambda w: w.transpose(0, 2, 1), primary=False))


def checkpoint_sources(config: ModelConfig) -> dict[str, list[_Source]]:
    """HF tensor name -> the parameters it fills, for every tensor this config may carry."""
    c = config
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    sources: dict[str, list[_Source]] = {}
    _add(sources, "model.embed_tokens.weight", _Source(("embed",), (c.vocab_size, h), lambda w: w))
    _add(sources, "model.norm.weight", _Source(("final_norm",), (h,), lambda w: w))
    if not c.tie_word_embeddings:
        _add(sources, "lm_head.weight", _Source(("lm_head",), (c.vocab_size, h), _t))
    for layer in range(c.num_layers):
        pre = f"model.layers.{layer}"
        attn = ("layers", layer, "attn")
        _add(sources, f"{pre}.input_layernorm.weight", _Source(("layers", layer, "attn_norm"), (h,), lambda w: w))
        _add(sources, f"{pre}.post_attention_layernorm.weight",
             _Source(("layers", layer, "mlp_norm"), (h,), lambda w: w))
        for proj, heads in (("q", hq), ("k", hkv), ("v", hkv)):
            _add(sources, f"{pre}.self_attn.{proj}_proj.weight",
                 _Source(attn + (proj,), (heads * d, h), _heads_in(heads, d)))
            if c.attention_bias:
                _add(sources, f"{pre}.self_attn.{proj}_proj.bias",
                     _Source(attn + (f"{proj}_bias",), (heads * d,), lambda w, n=heads: w.reshape(n, d)))
        _add(sources, f"{pre}.self_attn.o_proj.weight", _Source(attn + ("o",), (h, hq * d), _heads_out(hq, d)))
        if c.o_proj_bias:
            _add(sources, f"{pre}.self_attn.o_proj.bias", _Source(attn + ("o_bias",), (h,), lambda w: w))
        if c.qk_norm:
            for norm in ("q_norm", "k_norm"):
                _add(sources, f"{pre}.self_attn.{norm}.weight", _Source(attn + (norm,), (d,), lambda w: w))
        if c.is_moe_layer(layer):
            _expert_sources(sources, c, layer)
        else:
            mlp, inter = ("layers", layer, "mlp"), c.intermediate_size
            _add(sources, f"{pre}.mlp.gate_proj.weight", _Source(mlp + ("gate",), (inter, h), _t))
            _add(sources, f"{pre}.mlp.up_proj.weight", _Source(mlp + ("up",), (inter, h), _t))
            _add(sources, f"{pre}.mlp.down_proj.weight", _Source(mlp + ("down",), (h, inter), _t))
    return sources


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the sharded index's files, else `model.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
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
        raise ValueError(f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); "
                         "only safetensors checkpoints are loaded")
    raise ValueError(f"no *.safetensors checkpoint in {model_dir}")


def _targets(config: ModelConfig) -> tuple[dict[KeyPath, _Target], Any]:
    """One fill target per parameter leaf, in pytree order, and the pytree structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config, config.dtype))
    targets: dict[KeyPath, _Target] = {}
    for key_path, leaf in leaves:
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
        parts = config.num_experts if path[-1] in ("w_gate", "w_up", "w_down") else 1
        targets[path] = _Target(tuple(leaf.shape), parts)
    return targets, treedef


def _validate(opened: list[SafetensorsFile], sources: dict[str, list[_Source]],
              targets: dict[KeyPath, _Target], config: ModelConfig, model_dir: str | Path) -> None:
    """Check names, shapes and dtypes from the headers alone, before any tensor data is read."""
    unexpected: list[str] = []
    seen: dict[str, str] = {}
    covered: dict[KeyPath, set[int]] = {path: set() for path in targets}
    for st in opened:
        for name, info in st.infos.items():
            if name in seen:
                raise ValueError(f"tensor {name} appears in both {seen[name]} and {st.path.name}")
            seen[name] = st.path.name
            if name not in sources:
                tied_head = config.tie_word_embeddings and name == "lm_head.weight"
                if not (tied_head or name.endswith(_IGNORED_SUFFIXES)):
                    unexpected.append(name)
                continue
            if info.shape != sources[name][0].shape:
                raise ValueError(f"tensor {name} in {st.path.name} has shape {list(info.shape)}, "
                                 f"expected {list(sources[name][0].shape)}")
            if info.dtype not in _FLOAT_SOURCES:
                raise ValueError(f"tensor {name} in {st.path.name} has dtype {info.dtype}; "
                                 "only unquantized float checkpoints are supported")
            for src in sources[name]:
                parts = {src.part} if src.part is not None else set(range(targets[src.target].num_parts))
                if covered[src.target] & parts:
                    raise ValueError(f"tensor {name} repeats weights another tensor already gives "
                                     "(fused and per-expert expert tensors mixed?)")
                covered[src.target] |= parts
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint for {config.architecture}: "
                         f"{_summary(sorted(unexpected))}")
    missing = [name for name, entries in sources.items()
               if any(src.primary and len(covered[src.target]) < targets[src.target].num_parts
                      and (src.part is None or src.part not in covered[src.target]) for src in entries)]
    if missing:
        raise ValueError(f"tensors missing from checkpoint in {model_dir}: {_summary(missing)}")


def _summary(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def load_params(model_dir: str | Path, config: ModelConfig, dtype: Any = None) -> Params:
    """Read the checkpoint in `model_dir` into the pytree of `decoder.param_shapes(config)`."""
    np_dtype = _NP_TARGET[normalize_dtype(dtype or config.dtype)]
    opened = [SafetensorsFile(f) for f in checkpoint_files(model_dir)]
    sources = checkpoint_sources(config)
    targets, treedef = _targets(config)
    _validate(opened, sources, targets, config, model_dir)
    total_bytes = sum(info.end - info.begin for f in opened for info in f.infos.values())
    with tqdm(total=sum(len(f.infos) for f in opened), desc="Loading weights", unit="tensor",
              disable=total_bytes < _PROGRESS_MIN_BYTES) as bar:
        for st in opened:
            with st:
                for name in st.infos:
                    bar.update(1)
                    if name in sources:
                        array = st.get(name)
                        for src in sources[name]:
                            _fill(targets[src.target], src, array, np_dtype)
    return jax.tree_util.tree_unflatten(treedef, [t.value for t in targets.values()])


def _fill(target: _Target, src: _Source, array: np.ndarray, np_dtype: np.dtype) -> None:
    """Copy one checkpoint tensor into its parameter; move the parameter to device once whole."""
    value = np.asarray(src.convert(array)).astype(np_dtype, copy=False)
    if src.part is None:
        target.value = jax.device_put(np.ascontiguousarray(value))
        return
    if target.buffer is None:
        target.buffer = np.empty(target.shape, np_dtype)
    target.buffer[src.part] = value
    target.filled.add(src.part)
    if len(target.filled) == target.num_parts:
        target.value = jax.device_put(target.buffer)
        target.buffer = None
