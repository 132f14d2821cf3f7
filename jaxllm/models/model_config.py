"""The model configuration: one hashable description of every supported decoder.

`ModelConfig` is a static argument of the jitted step, so it is frozen and holds only
hashable values. `from_hf_config` reads a Hugging Face `config.json` in either spelling
(hub: `rope_scaling` + `rope_theta` + `torch_dtype`; transformers 5: `rope_parameters`
with `rope_theta` inside + `dtype`) and refuses, with a ValueError naming it, anything
the decoder would silently get wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np

from jaxllm.models.config_fields import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    as_float,
    int_field,
    optional_float,
)
from jaxllm.models.deepseek_config import deepseek_config_fields
from jaxllm.models.quant_config import KvCacheQuant, QuantConfig, parse_quantization_config

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# RoPE base used by transformers when a config names none.
_DEFAULT_ROPE_THETA = {
    "llama": 10000.0,
    "qwen2": 10000.0,
    "qwen3": 10000.0,
    "qwen3_moe": 10000.0,
    "mixtral": 1000000.0,
    "deepseek_v3": 10000.0,
}
_DEFAULT_RMS_EPS = {
    "llama": 1e-6,
    "qwen2": 1e-6,
    "qwen3": 1e-6,
    "qwen3_moe": 1e-6,
    "mixtral": 1e-5,
    "deepseek_v3": 1e-6,
}

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
}

_NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a dtype spelling (jax accepts these, bfloat16 included, as its own)."""
    return _NUMPY_DTYPES[normalize_dtype(dtype)]


def normalize_dtype(dtype: Any) -> str:
    """Map a dtype spelling ('bf16', 'torch.bfloat16', jnp.bfloat16, ...) to a canonical name."""
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    name = name.removeprefix("torch.").lower()
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPE_ALIASES[name]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_type` 'linear', 'llama3' or, for DeepSeek-V3, 'yarn');
    unscaled RoPE is None."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp between extrapolated and interpolated frequencies, and the mscale
    # corrections (cos/sin times `attention_factor`; softmax scale times mscale(mscale_all_dim)^2).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    attention_bias: bool  # biases on q/k/v projections
    sliding_window: Optional[int]  # same window on every layer, or None
    num_experts: int = 0  # 0 = dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    dtype: str = "float32"
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Qwen3 attention_bias)
    # Multi-head latent attention (DeepSeek-V3); kv_lora_rank == 0: not MLA. head_dim is then
    # the rotary part qk_rope_head_dim (what RoPE rotates), as in transformers.
    q_lora_rank: Optional[int] = None  # None: a plain q projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary dims in interleaved pairs (DeepSeek's layout)
    # DeepSeek-V3 routing: sigmoid scores, a per-expert correction bias for selection only,
    # top-k within the best `topk_group` of `n_group` expert groups, scaled weights.
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # shared experts (one FFN of n * moe_intermediate_size) in every MoE layer
    # DeepSeek-V3 multi-token-prediction layers the checkpoint carries after the decoder layers
    # (`model.layers.{num_hidden_layers + j}`); loaded only when asked (`load_params(load_mtp=True)`).
    num_nextn_predict_layers: int = 0
    mla_attention: str = "auto"  # MLA form: "auto" (absorbed in decode-bucket programs), "absorbed", "expanded"
    # Run runs of identical layers as one lax.scan over stacked weights and one KV page pool for
    # all layers (compile time independent of depth); off: a per-layer loop over per-layer caches.
    scan_layers: bool = True
    # Weights stored quantized (FP8 values + scales; see jaxllm.models.quant_config), or None.
    quantization: Optional[QuantConfig] = None
    # An integer-quantized checkpoint's own format when its weights load dequantized to `dtype`
    # (`quantized_loading.with_dequantize_on_load`; `quantization` is then None), else None.
    dequantized_from: Optional[QuantConfig] = None
    # KV cache stored as FP8 with per-layer scales (jaxllm.models.kv_quant), or None: the model's dtype.
    kv_cache_quant: Optional[KvCacheQuant] = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.mla_attention not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"mla_attention must be 'auto', 'absorbed' or 'expanded', got {self.mla_attention!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def layer_scan(self) -> bool:
        """Whether runs of identical layers run as lax.scan over stacked weights (`scan_layers`)."""
        return self.scan_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen3-MoE decoder layer; Mixtral has every layer sparse."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, hf: dict, dtype: Optional[str] = None) -> ModelConfig:
        return _from_hf_config(hf, dtype)


def _rope(hf: dict, model_type: str, max_pos: int) -> tuple[float, Optional[RopeScaling]]:
    """Read RoPE settings from `rope_parameters` (transformers 5) or `rope_scaling` (hub)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"unsupported rope_parameters {params!r}")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"unsupported per-layer-type rope_parameters: {sorted(params)}")
    merged: dict = {}
    for part in (scaling, params):
        if part:
            if not isinstance(part, dict):
                raise ValueError(f"unsupported rope_scaling {part!r}")
            merged.update(part)
    theta = merged.get("rope_theta", hf.get("rope_theta"))
    theta = as_float(theta, "rope_theta", positive=True) if theta is not None else _DEFAULT_ROPE_THETA[model_type]
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor={partial} (only full rotary embeddings)")
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "yarn" and model_type == "deepseek_v3":
        return theta, _yarn(hf, merged, max_pos)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if "factor" not in merged:
        raise ValueError(f"rope_scaling type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(merged["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in merged:
            raise ValueError(f"rope_scaling type 'llama3' needs {key!r}")
    original = merged.get("original_max_position_embeddings", hf.get("original_max_position_embeddings", max_pos))
    return theta, RopeScaling(
        "llama3",
        float(merged["factor"]),
        float(merged["low_freq_factor"]),
        float(merged["high_freq_factor"]),
        int(original),
    )


def _yarn(hf: dict, params: dict, max_pos: int) -> RopeScaling:
    """YaRN as transformers' `_compute_yarn_parameters` reads it (a top-level
    `original_max_position_embeddings` wins; a missing factor is max / original)."""
    original = int(
        hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    )
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention_factor = params.get("attention_factor")
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _sliding_window(hf: dict, model_type: str, num_layers: int) -> Optional[int]:
    """One window for all layers, or None; a mix of windowed and full layers is refused."""
    window = hf.get("sliding_window")
    if model_type in ("llama", "deepseek_v3"):
        return None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types {sorted(set(layer_types))} without a sliding_window")
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None and model_type in ("qwen2", "qwen3"):
        first = int(hf.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is not None:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise ValueError(
                "unsupported mix of sliding-window and full-attention layers "
                f"(layer_types / max_window_layers): {sorted(kinds)}"
            )
    return int(window)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _from_hf_config(hf: dict, dtype: Optional[str]) -> ModelConfig:
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str)):
        raise ValueError(
            f"config.json must name exactly one architecture, got architectures={archs!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    archs = archs or []
    if not archs and hf.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        archs = [next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == hf["model_type"])]
    if len(archs) != 1:
        raise ValueError(
            f"config.json must name exactly one architecture, got {archs!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = SUPPORTED_ARCHITECTURES[arch]
    quantization = parse_quantization_config(hf["quantization_config"]) if hf.get("quantization_config") else None
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True")

    where = f"{arch} config"
    hidden = int_field(hf, "hidden_size", 1, MAX_HIDDEN, where=where)
    num_heads = int_field(hf, "num_attention_heads", 1, MAX_HEADS, where=where)
    num_kv = int_field(hf, "num_key_value_heads", 1, MAX_HEADS, num_heads) or num_heads
    if model_type == "deepseek_v3":
        num_kv = num_heads  # MLA: every head has its own key and value (from the shared latent)
    num_layers = int_field(hf, "num_hidden_layers", 1, MAX_LAYERS, where=where)
    head_dim = int_field(hf, "head_dim", 0, MAX_HEAD_DIM, 0) or hidden // num_heads
    if model_type == "deepseek_v3":
        head_dim = int_field(hf, "qk_rope_head_dim", 1, MAX_HEAD_DIM, where=where)  # the rotary dims
    if head_dim < 1:
        raise ValueError(f"hidden_size={hidden} is smaller than num_attention_heads={num_heads}")
    max_pos = int_field(hf, "max_position_embeddings", 0, MAX_POSITIONS, 0) or 2048
    vocab_size = int_field(hf, "vocab_size", 1, MAX_VOCAB, where=where)
    intermediate_size = int_field(hf, "intermediate_size", 0, MAX_INTERMEDIATE, 0)
    rms_norm_eps = optional_float(hf, "rms_norm_eps", positive=True) or _DEFAULT_RMS_EPS[model_type]
    theta, scaling = _rope(hf, model_type, max_pos)

    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if num_experts is None:
            raise ValueError(f"{arch} config is missing required field 'num_experts'")
        num_experts = int_field({"num_experts": num_experts}, "num_experts", 1, MAX_EXPERTS)
        mlp_only = tuple(sorted(int(i) for i in (hf.get("mlp_only_layers") or ())))
        moe = dict(
            num_experts=int(num_experts),
            num_experts_per_tok=int_field(hf, "num_experts_per_tok", 1, MAX_EXPERTS, where=where),
            moe_intermediate_size=int_field(hf, "moe_intermediate_size", 1, MAX_INTERMEDIATE, where=where),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=mlp_only,
        )
    elif model_type == "mixtral":
        num_experts = hf.get("num_local_experts", hf.get("num_experts"))
        if num_experts is None:
            raise ValueError(f"{arch} config is missing required field 'num_local_experts'")
        num_experts = int_field({"num_local_experts": num_experts}, "num_local_experts", 1, MAX_EXPERTS)
        inter = int_field(hf, "intermediate_size", 1, MAX_INTERMEDIATE, where=where)
        # Mixtral's softmax over the top-k logits equals the renormalised full softmax.
        moe = dict(
            num_experts=int(num_experts),
            num_experts_per_tok=int_field(hf, "num_experts_per_tok", 1, MAX_EXPERTS, where=where),
            moe_intermediate_size=inter,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
        )
    elif model_type == "deepseek_v3":
        moe = deepseek_config_fields(hf, arch)
        if not 0 < moe["num_experts"] <= MAX_EXPERTS:
            raise ValueError(f"n_routed_experts={moe['num_experts']} is out of range [1, {MAX_EXPERTS}]")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if hf.get(key) and model_type != "deepseek_v3":
            raise ValueError(f"unsupported option {key}={hf[key]!r} (shared experts)")

    attention_bias = bool(hf.get("attention_bias", False))
    o_proj_bias = attention_bias
    if model_type == "qwen2":
        attention_bias, o_proj_bias = True, False  # Qwen2 always has q/k/v biases, never an o_proj bias
    elif model_type in ("mixtral", "deepseek_v3") and attention_bias:
        raise ValueError(f"unsupported attention_bias=True for {arch}")

    if dtype is None or dtype == "auto":
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    eos = _token_ids(hf.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        sliding_window=_sliding_window(hf, model_type, num_layers),
        eos_token_ids=eos,
        bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
        dtype=normalize_dtype(dtype),
        quantization=quantization,
        **moe,
    )


def load_model_config(model_dir: str | Path, dtype: Optional[str] = None) -> ModelConfig:
    """Read `config.json` (plus the EOS ids of `generation_config.json`, which chat models rely on)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    try:
        config = ModelConfig.from_hf_config(_read_json(path), dtype=dtype)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (TypeError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        raise ValueError(f"{path}: malformed field ({type(exc).__name__}: {exc})") from None
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = _read_json(gen_path)
            if not isinstance(gen, dict):
                raise ValueError(f"must hold a JSON object, got {type(gen).__name__}")
            eos = tuple(dict.fromkeys(_token_ids(gen.get("eos_token_id")) + config.eos_token_ids))
            bos = config.bos_token_id if config.bos_token_id is not None else gen.get("bos_token_id")
            config = replace(config, eos_token_ids=eos, bos_token_id=None if bos is None else int(bos))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{gen_path}: {exc}") from None
    return config


def _read_json(path: Path) -> Any:
    """The JSON in `path`; unreadable, invalid or absurdly nested JSON is a ValueError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
