"""How a model's weights are quantized: read from a checkpoint's `quantization_config`, or
asked for at load time (`LLM(..., quantization="fp8")`).

Two FP8 (e4m3) schemes are understood:

- block-scaled, DeepSeek-V3/R1's native format: `{"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`; every quantized linear
  `<name>.weight` (float8_e4m3fn, torch [out, in]) has `<name>.weight_scale_inv` (float32
  [ceil(out/128), ceil(in/128)]), the dequantized weight being `weight * scale_inv` per block;
- per-output-channel, compressed-tensors' float-quantized format (`quant_method:
  "compressed-tensors"`, weights `{num_bits: 8, type: float, strategy: channel}`), with
  `<name>.weight_scale` float32 [out, 1].

Activations: "dynamic" quantizes each token's activations per group of 128 to e4m3 at run
time (DeepSeek's `act_quant`), so the numerics match an FP8 deployment; "none" multiplies
the dequantized weights with the unquantized activations (weights-only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
ACTIVATION_SCHEMES = ("dynamic", "none")
# Values of `LLM(quantization=...)` / `--quantization`: FP8 with 128 x 128 block scales, or
# weight-only int8 / int4 with one scale per 32 inputs (GGUF's Q8_0 / Q4_0 blocks).
QUANTIZATION_METHODS = ("fp8", "int8", "int4")


@dataclass(frozen=True)
class QuantConfig:
    """One model's weight quantization.

    `weight_block_size` (rows, cols) of the torch [out, in] weight share one scale; (1, 0)
    means one scale per output channel. `scale_suffix` names each weight's scale tensor in
    the checkpoint (empty when weights are quantized at load time). `ignored` lists
    checkpoint module prefixes kept unquantized (`modules_to_not_convert` / `ignore`)."""

    method: str  # "fp8_block" | "fp8_channel" | "int8_block" | "int4_block" (GGUF Q8_0 / Q4_0)
    weight_block_size: tuple[int, int] = (BLOCK, BLOCK)
    activation_scheme: str = "dynamic"
    scale_suffix: str = "weight_scale_inv"
    from_checkpoint: bool = True
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme must be one of {ACTIVATION_SCHEMES}, got {self.activation_scheme!r}")

    @property
    def dynamic_activations(self) -> bool:
        return self.activation_scheme == "dynamic"

    @property
    def activation_group(self) -> int:
        """Features per activation scale: 128 (DeepSeek's token-groups), -1 (per token, the
        compressed-tensors dynamic scheme) or 0 (activations not quantized)."""
        if not self.dynamic_activations:
            return 0
        return BLOCK if self.method == "fp8_block" else -1

    @property
    def value_dtype(self) -> str:
        """What the device holds per value: float8_e4m3fn, int8, or int4 (two to a byte)."""
        return {"int8_block": "int8", "int4_block": "int4"}.get(self.method, FP8_DTYPE)

    @property
    def checkpoint_dtype(self) -> str:
        """The safetensors dtype of the quantized weights (GGUF's 4-bit values are stored one to an I8)."""
        return "I8" if self.method in ("int8_block", "int4_block") else "F8_E4M3"

    def block_for(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The (rows, cols) block of one torch [out, in] weight."""
        if self.method == "fp8_channel":
            return (1, in_features)
        return self.weight_block_size

    def keeps_float(self, tensor_name: str) -> bool:
        return any(tensor_name == p or tensor_name.startswith(p.rstrip(".") + ".") for p in self.ignored)


def parse_quantization_config(qc: Any) -> QuantConfig:
    """The `QuantConfig` of a checkpoint's `quantization_config`; anything not understood is a
    ValueError naming the field."""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8_block(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "gguf":
        return _parse_gguf(qc)
    raise ValueError(
        f"unsupported quantization_config.quant_method={method!r}; supported: 'fp8' (DeepSeek block-scaled "
        "FP8), 'compressed-tensors' (FP8 per-channel) and 'gguf' (Q8_0 / Q4_0 weights of a converted GGUF file)"
    )


# GGUF block types kept quantized on the device: one float scale per 32 consecutive inputs.
GGUF_BLOCK = 32
GGUF_METHODS = {"Q8_0": "int8_block", "Q4_0": "int4_block"}


def _parse_gguf(qc: dict) -> QuantConfig:
    """`{quant_method: gguf, weight_type: Q8_0 | Q4_0}` (written by `jaxllm.models.gguf`): each
    quantized `<module>.weight` is int8 [out, in] (Q4_0: values in [-8, 7]) with float32
    `<module>.weight_scale` [out, in / 32], the weight being `value * scale` per block of 32."""
    kind = qc.get("weight_type")
    if kind not in GGUF_METHODS:
        raise ValueError(f"unsupported quantization_config.weight_type={kind!r}; one of {sorted(GGUF_METHODS)}")
    return QuantConfig(GGUF_METHODS[kind], (1, GGUF_BLOCK), "none", "weight_scale", True, _ignored(qc))


def _parse_fp8_block(qc: dict) -> QuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported quantization_config.fmt={fmt!r}; only 'e4m3' FP8 weights load")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"unsupported quantization_config.activation_scheme={scheme!r}; only 'dynamic' is implemented")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("quantization_config.weight_block_size is missing; only [128, 128] block scales load")
    if not isinstance(block, (list, tuple)) or [*block] != [BLOCK, BLOCK]:
        raise ValueError(f"unsupported quantization_config.weight_block_size={block!r}; only [128, 128] is implemented")
    return QuantConfig("fp8_block", (BLOCK, BLOCK), "dynamic", "weight_scale_inv", True, _ignored(qc))


def _parse_compressed_tensors(qc: dict) -> QuantConfig:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config.config_groups must hold exactly one group")
    group = next(iter(groups.values()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ValueError("quantization_config.config_groups.*.weights is missing")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(
            "unsupported compressed-tensors weights "
            f"(num_bits={weights.get('num_bits')!r}, type={weights.get('type')!r}); only 8-bit float loads"
        )
    if weights.get("strategy") != "channel":
        raise ValueError(
            f"unsupported compressed-tensors weights.strategy={weights.get('strategy')!r}; only 'channel' loads"
        )
    acts = group.get("input_activations")
    if acts is not None and not (
        isinstance(acts, dict) and acts.get("dynamic") is True and acts.get("strategy", "token") == "token"
    ):
        raise ValueError(
            "unsupported compressed-tensors input_activations: only dynamic per-token (or none) is implemented"
        )
    scheme = "dynamic" if acts else "none"
    return QuantConfig("fp8_channel", (1, 0), scheme, "weight_scale", True, _ignored(qc, "ignore"))


def _ignored(qc: dict, key: str = "modules_to_not_convert") -> tuple[str, ...]:
    names = qc.get(key) or ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"quantization_config.{key} must be a list of module names")
    return tuple(n for n in names if n != "lm_head")


def on_load_quant_config(method: Optional[str], activation_scheme: str = "dynamic") -> Optional[QuantConfig]:
    """The `QuantConfig` for quantizing an unquantized checkpoint while loading it."""
    if method is None:
        return None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}")
    if method in ("int8", "int4"):
        return QuantConfig(f"{method}_block", (1, GGUF_BLOCK), "none", "", False)
    return QuantConfig("fp8_block", (BLOCK, BLOCK), activation_scheme, "", False)


# Checkpoint tensors holding one layer's KV cache scale (compressed-tensors / ModelOpt names):
# read by `jaxllm.models.kv_quant`, not weights.
KV_SCALE_SUFFIXES = (
    "self_attn.k_scale",
    "self_attn.v_scale",
    "k_proj.k_scale",
    "v_proj.v_scale",
    "k_proj.output_scale",
    "v_proj.output_scale",
)


@dataclass(frozen=True)
class KvCacheQuant:
    """An FP8 (e4m3) KV cache: one float32 scale per layer for its keys and one for its values
    (the MLA latent cache uses the key scale), the cached value being `fp8 * scale`. `source`
    says where they came from: "checkpoint" (`k_scale` / `v_scale` tensors) or "unit" (1.0,
    vLLM's default when a checkpoint carries none)."""

    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    source: str = "unit"

    def __post_init__(self) -> None:
        if len(self.k_scales) != len(self.v_scales):
            raise ValueError("k_scales and v_scales need one entry per layer each")
        bad = [s for s in self.k_scales + self.v_scales if not (s > 0 and s < float("inf"))]
        if bad:
            raise ValueError(f"KV cache scales must be positive finite numbers, got {bad[0]!r}")
