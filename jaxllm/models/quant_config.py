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

Weight-only integer formats: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, written by
`jaxllm.models.gguf`) and HF AWQ / GPTQ 4-bit checkpoints (`jaxllm.models.awq_gptq`).

Activations: "dynamic" quantizes each token's activations per group of 128 to e4m3 at run
time (DeepSeek's `act_quant`), so the numerics match an FP8 deployment; "none" multiplies
the dequantized weights with the unquantized activations (weights-only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
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

    method: str  # "fp8_block" | "fp8_channel" | "int8_block" | "int4_block" | "uint4_block"
    weight_block_size: tuple[int, int] = (BLOCK, BLOCK)
    activation_scheme: str = "dynamic"
    scale_suffix: str = "weight_scale_inv"
    from_checkpoint: bool = True
    ignored: tuple[str, ...] = ()
    offset: bool = False  # a `<name>.weight_offset` per block: weight = value * scale + offset
    packing: str = ""  # "awq" | "gptq" | "gptq_v2": the checkpoint's packed int32 tensors (`awq_gptq`)
    # Quantizing on load an integer-quantized checkpoint: its own format, dequantized while it
    # loads (`jaxllm.models.int_checkpoint_view`).
    stored: Optional[QuantConfig] = None
    # The dtypes the checkpoint (and the device) keep the per-block numbers in: the format's own
    # (float16 for GGUF's `d` and AWQ / GPTQ's scales; integers for K-quant sub-block scales and
    # AWQ / GPTQ's zero points, see `WeightQuant`).
    scale_dtype: str = "float32"
    offset_dtype: str = "float32"
    # Inputs per super-block (GGUF K-quants: 256), each with a float16 `<name>.weight_super_scale`
    # (and `.weight_super_offset`) multiplying its integer block scales (offsets); 0: none.
    super_block: int = 0
    # Files mixing block types (llama.cpp's Q4_K_M): (module, its own format) where a module's
    # format is not this one (`for_tensor`).
    per_module: tuple[tuple[str, QuantConfig], ...] = ()
    # FP8 block weights stored K-major where the Mosaic GPU FP8 kernels will read them
    # (`jaxllm.models.quantization.k_major_eligible`); set when the engine picks those kernels.
    k_major: bool = False
    # The checkpoint's own name of the format (GGUF's "Q4_1", "awq", "gptq"), for messages only.
    name: str = field(default="", compare=False)

    def for_tensor(self, tensor_name: str) -> QuantConfig:
        """The format of the module holding `tensor_name` (`<module>.weight` and its scales)."""
        if not self.per_module:
            return self
        return self._module_formats.get(tensor_name.rsplit(".", 1)[0], self)

    @cached_property
    def _module_formats(self) -> dict[str, QuantConfig]:
        return dict(self.per_module)

    def formats(self) -> tuple[QuantConfig, ...]:
        """Every format some quantized weight of the model is held in."""
        return (self,) + tuple(dict.fromkeys(fmt for _, fmt in self.per_module if fmt != self))

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
        return INT_DTYPES.get(self.method, FP8_DTYPE)

    @property
    def checkpoint_dtype(self) -> str:
        """The safetensors dtype of the quantized weights (GGUF's 4-bit values are stored one to an I8)."""
        return "I8" if self.method in INT_DTYPES else "F8_E4M3"

    @property
    def offset_suffix(self) -> str:
        return "weight_offset"

    def block_tensors(self) -> dict[str, tuple[str, str, bool]]:
        """Each per-block leaf of a quantized weight -> (its checkpoint suffix, numpy dtype,
        whether its block is the super-block)."""
        out = {"scale": (self.scale_suffix, self.scale_dtype, False)}
        if self.offset:
            out["offset"] = (self.offset_suffix, self.offset_dtype, False)
        if self.super_block:
            out["super_scale"] = ("weight_super_scale", "float16", True)
            if self.offset:
                out["super_offset"] = ("weight_super_offset", "float16", True)
        return out

    def block_for(self, out_features: int, in_features: int, super_block: bool = False) -> tuple[int, int]:
        """The (rows, cols) block of one torch [out, in] weight (or its super-block)."""
        if super_block:
            return (1, self.super_block)
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
    if method in ("awq", "gptq"):
        return _parse_awq_gptq(qc, method)
    raise ValueError(
        f"unsupported quantization_config.quant_method={method!r}; supported: 'fp8' (DeepSeek block-scaled "
        "FP8), 'compressed-tensors' (FP8 per-channel), 'awq' / 'gptq' (4-bit, group_size 128) and 'gguf' "
        "(Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights of a converted GGUF file)"
    )


# What the device holds per value for each integer method.
INT_DTYPES = {"int8_block": "int8", "int4_block": "int4", "uint4_block": "uint4"}
# GGUF block types kept quantized on the device: (method, inputs per scale, with an offset,
# scale dtype, offset dtype, inputs per super-block).
GGUF_BLOCK = 32
K_SUPER_BLOCK = 256
GGUF_METHODS = {
    "Q8_0": ("int8_block", GGUF_BLOCK, False, "float16", "float16", 0),  # d * q, q in [-127, 127]
    "Q4_0": ("int4_block", GGUF_BLOCK, False, "float16", "float16", 0),  # d * (q - 8)
    "Q4_1": ("uint4_block", GGUF_BLOCK, True, "float16", "float16", 0),  # d * q + m, q in [0, 15]
    "Q5_0": ("int8_block", GGUF_BLOCK, False, "float16", "float16", 0),  # d * (q - 16), one value to an int8
    "Q5_1": ("int8_block", GGUF_BLOCK, True, "float16", "float16", 0),  # d * q + m, q in [0, 31]
    # (d * sc) * q - dmin * m per 32 of a 256 super-block, sc and m 6-bit (Q5_K: q in [0, 31], one to an int8)
    "Q4_K": ("uint4_block", 32, True, "uint8", "uint8", K_SUPER_BLOCK),
    "Q5_K": ("int8_block", 32, True, "uint8", "uint8", K_SUPER_BLOCK),
    # (d * sc) * (q - 32) per 16 of a 256 super-block, sc int8
    "Q6_K": ("int8_block", 16, False, "int8", "float16", K_SUPER_BLOCK),
    # Not a file type: how a layer stack mixing Q6_K with Q4_K / Q5_K layers is held, each
    # layer's blocks exactly: int8 values, int8 scales and minimums per 16, float16 d and
    # -dmin per 256 (Q6_K's minimums 0; a Q4_K / Q5_K scale repeated over its two 16s).
    "K_INT8": ("int8_block", 16, True, "int8", "int8", K_SUPER_BLOCK),
}


def _parse_gguf(qc: dict) -> QuantConfig:
    """`{quant_method: gguf, weight_type: Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K |
    K_INT8}` (written by `jaxllm.models.gguf`): each quantized `<module>.weight` is int8 [out, in]
    (4-bit types: one value to a byte) with float16 `<module>.weight_scale` [out, in / block]
    (and, for Q4_1 / Q5_1, `<module>.weight_offset`), the weight being `value * scale (+ offset)`
    per block; K-quants hold their integer sub-block scales (and minimums) there, and float16
    `<module>.weight_super_scale` (`.weight_super_offset`: `-dmin`) [out, in / 256]. Modules of
    another type are listed in `weight_types` ({module: type})."""
    kind = qc.get("weight_type")
    per_module = qc.get("weight_types") or {}
    if not isinstance(per_module, dict) or not all(isinstance(k, str) for k in per_module):
        raise ValueError("quantization_config.weight_types must map module names to GGUF types")
    for module, held in per_module.items():
        if held not in GGUF_METHODS:
            raise ValueError(f"unsupported quantization_config.weight_types[{module!r}]={held!r}")
    formats = {t: _gguf_format(t) for t in {kind, *per_module.values()}}
    base = replace(formats[kind], ignored=_ignored(qc))
    return replace(base, per_module=tuple((m, formats[t]) for m, t in sorted(per_module.items()) if t != kind))


def _gguf_format(kind: Any) -> QuantConfig:
    if kind not in GGUF_METHODS:
        raise ValueError(f"unsupported quantization_config.weight_type={kind!r}; one of {sorted(GGUF_METHODS)}")
    method, block, offset, scale_dtype, offset_dtype, super_block = GGUF_METHODS[kind]
    return QuantConfig(
        method,
        (1, block),
        "none",
        "weight_scale",
        True,
        (),
        offset,
        scale_dtype=scale_dtype,
        offset_dtype=offset_dtype,
        super_block=super_block,
        name=kind,
    )


def _parse_awq_gptq(qc: dict, method: str) -> QuantConfig:
    """HF AWQ (`version: gemm`) / GPTQ 4-bit checkpoints with `group_size` 128: unpacked on load
    (`jaxllm.models.awq_gptq`) into 4-bit values with a float16 scale (and int8 zero point
    `-zero`) per 128 inputs. GPTQ's symmetric checkpoints (every zero 8) are signed int4."""
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"unsupported {method} quantization_config.bits={bits!r}; only 4-bit weights load")
    if group != 128:
        raise ValueError(f"unsupported {method} quantization_config.group_size={group!r}; only 128 is implemented")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"unsupported awq quantization_config.version={version!r}; only 'gemm' packing loads")
        if qc.get("zero_point", True) is not True:
            raise ValueError("unsupported awq quantization_config.zero_point=false; only zero-point AWQ loads")
        awq = dict(_INT4_GROUP_DTYPES, name="awq")
        return QuantConfig("uint4_block", (1, group), "none", "weight_scale", True, _ignored(qc), True, "awq", **awq)
    if qc.get("desc_act", False):
        raise ValueError(
            "unsupported gptq quantization_config.desc_act=true (act-order: g_idx permutes the groups); "
            "only desc_act=false checkpoints load"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported gptq quantization_config.checkpoint_format={fmt!r}; 'gptq' or 'gptq_v2'")
    sym = qc.get("sym", True) is True
    return QuantConfig(
        "int4_block" if sym else "uint4_block",
        (1, group),
        "none",
        "weight_scale",
        True,
        _ignored(qc),
        not sym,
        fmt,
        name="gptq",
        **_INT4_GROUP_DTYPES,
    )


# AWQ / GPTQ: the checkpoint's float16 scales; the zero point as an int8 offset in units of the scale.
_INT4_GROUP_DTYPES: dict[str, Any] = {"scale_dtype": "float16", "offset_dtype": "int8"}


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
        return QuantConfig(f"{method}_block", (1, GGUF_BLOCK), "none", "", False, scale_dtype="float16")
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
