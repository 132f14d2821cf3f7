"""EAGLE-3 draft heads in their published checkpoint layout: config, weight declaration, loading.

An EAGLE-3 head (SafeAILab/EAGLE's `traineagle3` model, SGLang's and vLLM's `llama_eagle3`,
TensorRT-LLM's Eagle3 draft model) is one Llama-style decoder layer over the target's fused
hidden states, stored in its own directory (config.json with `draft_vocab_size`, optionally
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`):

    fc.weight                               [H, 3 Ht]    low/mid/high target hidden states -> H
    midlayer.input_layernorm.weight         [H]          RMSNorm of the token embedding
    midlayer.hidden_norm.weight             [H]          RMSNorm of the fused hidden state
    midlayer.self_attn.{q,k,v}_proj.weight  [.., 2H]     over [input_layernorm(embed); hidden_norm(h)]
    midlayer.self_attn.o_proj.weight        [H, Hq D]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight                             [H]
    lm_head.weight                          [Vd, H]      over the reduced draft vocabulary
    d2t                                     int64 [Vd]   target id = draft id + d2t[draft id]
    t2d                                     bool [V]     which target ids the draft vocabulary has
    embed_tokens.weight                     [V, H]       optional: else the target's embedding

The parameters (`declare_eagle3_weights`): fc [3Ht, H], layer {embed_norm, hidden_norm,
mlp_norm, attn {q, k, v [2H, Hkv', D], o}, mlp {gate, up, down}}, norm, lm_head [H, Vd],
optional embed, and the int32 maps d2t [Vd] and bool t2d [V]. The forward is
`jaxllm.models.eagle3`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from safetensors import safe_open

from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.partitioning import kv_replicas_for, rules_for
from jaxllm.models.weight_layout import Layout, Source
from jaxllm.models.weight_reading import read_parameter_view
from jaxllm.models.weights import Params, WeightDecl, build_tree
from sharding.mesh import ParallelConfig, make_mesh
from sharding.rules import named_sharding

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
_MAPS = ("d2t", "t2d")
_OPTIONAL = ("embed_tokens.weight",)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head: its decoder layer's config (a one-layer Llama), the reduced draft
    vocabulary, the target's hidden size and the target layers whose input it fuses (None: the
    engine's default, `jaxllm.models.eagle3.default_aux_layers`)."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: Optional[tuple[int, ...]] = None

    @classmethod
    def from_hf_config(cls, hf: dict, dtype: Optional[str] = None) -> Eagle3Config:
        if not isinstance(hf, dict):
            raise ValueError("an EAGLE-3 config.json must hold a JSON object")
        archs = hf.get("architectures") or ["LlamaForCausalLMEagle3"]
        if len(archs) != 1 or archs[0] not in EAGLE3_ARCHITECTURES:
            raise ValueError(
                f"unsupported EAGLE-3 architecture {archs!r}; supported: {', '.join(EAGLE3_ARCHITECTURES)}"
            )
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"EAGLE-3 heads with num_hidden_layers={hf['num_hidden_layers']} are not supported (only 1)"
            )
        model = ModelConfig.from_hf_config(
            {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}, dtype
        )
        draft_vocab = int(hf.get("draft_vocab_size") or model.vocab_size)
        if not 0 < draft_vocab <= model.vocab_size:
            raise ValueError(f"draft_vocab_size={draft_vocab} must be in [1, vocab_size={model.vocab_size}]")
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or not all(isinstance(i, int) and i >= 0 for i in aux)):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids={aux!r} must be a list of layer indices")
        return cls(
            model=model,
            draft_vocab_size=draft_vocab,
            target_hidden_size=int(hf.get("target_hidden_size") or model.hidden_size),
            aux_layers=tuple(aux) if aux is not None else None,
        )


def load_eagle3_config(model_dir: str | Path, dtype: Optional[str] = None) -> Eagle3Config:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    try:
        return Eagle3Config.from_hf_config(json.loads(path.read_text(encoding="utf-8")), dtype)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _decl(path: tuple, shape: tuple[int, ...], axes: tuple, name: str, stored: tuple[int, ...], layout: Layout) -> Any:
    init = "norm" if len(shape) == 1 else "linear"
    return WeightDecl(path, shape, axes, ((Source(name, stored, layout),),), init)


def declare_eagle3_weights(config: Eagle3Config, kv_replicas: int = 1, *, embed: bool = False) -> list[WeightDecl]:
    """Every float parameter of the head (`embed`: the checkpoint carries its own embedding)."""
    c = config.model
    h, d, hq, hkv, inter = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
    fused, vd = 3 * config.target_hidden_size, config.draft_vocab_size
    mid = "midlayer"
    decls = [
        _decl(("fc",), (fused, h), (None, "embed"), "fc.weight", (h, fused), Layout((h, fused), (1, 0))),
    ]
    for ours, theirs in (("embed_norm", "input_layernorm"), ("hidden_norm", "hidden_norm")):
        decls.append(_decl(("layer", ours), (h,), ("embed",), f"{mid}.{theirs}.weight", (h,), Layout((h,), (0,))))
    for proj, heads, axis, reps in (
        ("q", hq, "heads", 1),
        ("k", hkv, "kv_heads", kv_replicas),
        ("v", hkv, "kv_heads", kv_replicas),
    ):
        decls.append(
            _decl(
                ("layer", "attn", proj),
                (2 * h, heads * reps, d),
                ("embed", axis, "head_dim"),
                f"{mid}.self_attn.{proj}_proj.weight",
                (heads * d, 2 * h),
                Layout((heads, d, 2 * h), (2, 0, 1), repeat_axis=0, repeat=reps),
            )
        )
    decls.append(
        _decl(
            ("layer", "attn", "o"),
            (hq, d, h),
            ("heads", "head_dim", "embed"),
            f"{mid}.self_attn.o_proj.weight",
            (h, hq * d),
            Layout((h, hq, d), (1, 2, 0)),
        )
    )
    decls.append(
        _decl(
            ("layer", "mlp_norm"), (h,), ("embed",), f"{mid}.post_attention_layernorm.weight", (h,), Layout((h,), (0,))
        )
    )
    for ours, shape, axes, stored in (
        ("gate", (h, inter), ("embed", "mlp"), (inter, h)),
        ("up", (h, inter), ("embed", "mlp"), (inter, h)),
        ("down", (inter, h), ("mlp", "embed"), (h, inter)),
    ):
        decls.append(
            _decl(("layer", "mlp", ours), shape, axes, f"{mid}.mlp.{ours}_proj.weight", stored, Layout(stored, (1, 0)))
        )
    decls.append(_decl(("norm",), (h,), ("embed",), "norm.weight", (h,), Layout((h,), (0,))))
    decls.append(_decl(("lm_head",), (h, vd), ("embed", None), "lm_head.weight", (vd, h), Layout((vd, h), (1, 0))))
    if embed:
        v = c.vocab_size
        decls.append(
            _decl(("embed",), (v, h), ("vocab", "embed"), "embed_tokens.weight", (v, h), Layout((v, h), (0, 1)))
        )
    return decls


def eagle3_checkpoint_names(config: Eagle3Config, *, embed: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors of an EAGLE-3 checkpoint and their stored shapes (the vocabulary maps included)."""
    names = {src.name: src.shape for d in declare_eagle3_weights(config, embed=embed) for src in d.alternatives[0]}
    names["d2t"] = (config.draft_vocab_size,)
    names["t2d"] = (config.model.vocab_size,)
    return names


def load_eagle3_params(
    model_dir: str | Path, config: Eagle3Config, dtype: Any = None, *, mesh: Optional[jax.sharding.Mesh] = None
) -> Params:
    """Read an EAGLE-3 head (one `*.safetensors` file or several) into its parameter pytree,
    sharded like a Llama layer over `mesh` (the maps replicated). Missing or unexpected tensors,
    wrong shapes and non-finite weights are refused with the tensor named."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors EAGLE-3 checkpoint in {model_dir}")
    mesh = mesh if mesh is not None else make_mesh(ParallelConfig())
    rules = rules_for(config.model, mesh)
    np_dtype = numpy_dtype(dtype or config.model.dtype)
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    embed = "embed_tokens.weight" in tensors
    expected = eagle3_checkpoint_names(config, embed=embed)
    d2t_present = "d2t" in tensors
    if not d2t_present and config.draft_vocab_size == config.model.vocab_size:
        expected = {n: s for n, s in expected.items() if n not in _MAPS}  # the identity map may be left out
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unexpected:
        raise ValueError(f"unexpected tensors in EAGLE-3 checkpoint {model_dir}: {', '.join(unexpected[:12])}")
    if missing:
        raise ValueError(f"tensors missing from EAGLE-3 checkpoint {model_dir}: {', '.join(missing[:12])}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
        if name not in _MAPS and not np.isfinite(tensors[name]).all():
            raise ValueError(f"tensor {name} holds NaN or infinite values")

    def read(name: str, slices: tuple[slice, ...]) -> np.ndarray:
        return tensors[name][slices]

    leaves = []
    for decl in declare_eagle3_weights(config, kv_replicas_for(config.model, mesh, rules), embed=embed):
        block, perm = read_parameter_view(decl, decl.alternatives[0], tuple(slice(None) for _ in decl.shape), read)
        value = np.ascontiguousarray(block.transpose(perm)).astype(np_dtype)
        leaves.append((decl.path, jax.device_put(value, named_sharding(mesh, decl.axes, rules))))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    d2t, t2d = _vocabulary_maps(tensors, config) if d2t_present else _identity_maps(config)
    leaves.append((("d2t",), jax.device_put(d2t, replicated)))
    leaves.append((("t2d",), jax.device_put(t2d, replicated)))
    return build_tree(leaves)


def _identity_maps(config: Eagle3Config) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(config.draft_vocab_size, np.int32), np.ones(config.model.vocab_size, bool)


def _vocabulary_maps(tensors: dict[str, np.ndarray], config: Eagle3Config) -> tuple[np.ndarray, np.ndarray]:
    """d2t as int32 offsets and t2d as a bool mask, after checking that they agree: every draft
    id maps into the target vocabulary, distinct draft ids to distinct target ids, exactly the
    ids t2d marks."""
    d2t = np.asarray(tensors["d2t"])
    if not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"tensor d2t has dtype {d2t.dtype}; it must hold integer offsets")
    target = np.arange(config.draft_vocab_size, dtype=np.int64) + d2t.astype(np.int64)
    vocab = config.model.vocab_size
    if target.min() < 0 or target.max() >= vocab or len(np.unique(target)) != len(target):
        raise ValueError(f"tensor d2t maps draft ids outside [0, {vocab}) or two draft ids to one target id")
    t2d = np.asarray(tensors["t2d"]).astype(bool)
    marked = np.zeros(vocab, bool)
    marked[target] = True
    if not np.array_equal(marked, t2d):
        raise ValueError("tensors d2t and t2d disagree on which target ids the draft vocabulary holds")
    return d2t.astype(np.int32), t2d
