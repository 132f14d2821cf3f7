"""Read a LoRA adapter in the Hugging Face PEFT layout and check it against the base model.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors` with, per adapted linear layer,
`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
PEFT adds `x @ A.T @ B.T * scaling` to the layer's output, with scaling `lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA).

Here each adapted layer becomes `(a [in, r], b [r, out])` in float32 with the scaling
folded into `b`, so the model adds `(x @ a) @ b`. Everything that cannot be served that way
(other target modules, DoRA, trained biases, MoE experts, shapes of another base model,
rank above `max_lora_rank`) is refused with a ValueError, and so is everything that would
let one adapter disturb the rows of others: non-finite or huge weights or scalings, and
`rank_pattern` / `alpha_pattern` regexes that could backtrack for ages (`patterns.py`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxllm.lora.lora_request import LoRARequest
from jaxllm.lora.patterns import check_patterns, is_number, match_patterns
from jaxllm.models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (our name, attention or MLP).
LORA_TARGETS = {
    "q_proj": ("q", "attn"),
    "k_proj": ("k", "attn"),
    "v_proj": ("v", "attn"),
    "o_proj": ("o", "attn"),
    "gate_proj": ("gate", "mlp"),
    "up_proj": ("up", "mlp"),
    "down_proj": ("down", "mlp"),
}
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")

_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# Config fields whose non-default value changes the computation in a way not served here.
_REFUSED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "lora_bias": (False, None),
    "target_parameters": (None, []),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
}


def target_dims(config: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a LoRA target in `config`'s decoder."""
    h, d = config.hidden_size, config.head_dim
    return {
        "q": (h, config.num_heads * d),
        "k": (h, config.num_kv_heads * d),
        "v": (h, config.num_kv_heads * d),
        "o": (config.num_heads * d, h),
        "gate": (h, config.intermediate_size),
        "up": (h, config.intermediate_size),
        "down": (config.intermediate_size, h),
    }[target]


def layer_targets(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections of `layer` an adapter may adapt (MoE experts are not targets)."""
    return ATTENTION_TARGETS if config.is_moe_layer(layer) else ATTENTION_TARGETS + MLP_TARGETS


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter, ready for a device slot: (layer, target) -> (a [in, r], b [r, out] * scaling)."""

    request: LoRARequest
    rank: int  # the largest rank of its modules
    scaling: float  # lora_alpha / r (NaN when rank_pattern / alpha_pattern make it differ per module)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.weights}


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} does not hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"lora_path {str(path)!r}: peft_type {peft_type!r} is not a LoRA adapter")
    for key, allowed in _REFUSED.items():
        if key in config and config[key] not in allowed:
            raise ValueError(
                f"lora_path {str(path)!r}: {key}={config[key]!r} is not supported (supported: {allowed[0]!r})"
            )
    r = config.get("r")
    if not is_number(r) or not 0 < r < math.inf or r != int(r):
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} needs a positive integer 'r', got {r!r}")
    alpha = config.get("lora_alpha")
    if not is_number(alpha) or not 0 < alpha < math.inf:
        raise ValueError(f"lora_path {str(path)!r}: {CONFIG_FILE} needs a positive finite 'lora_alpha', got {alpha!r}")
    for key, value_type in (("rank_pattern", int), ("alpha_pattern", float)):
        check_patterns(config.get(key), key, value_type, f"lora_path {str(path)!r}")
    return config


# Bounds that keep `(x @ a) @ (b * scaling)` finite in float32 and bfloat16 (max ~3.4e38):
# trained LoRA weights are far below 1 and scalings are small multiples of 1.
MAX_WEIGHT = 1e4
MAX_SCALING = 1e4

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the adapter file as float32 numpy. Read here with numpy alone (header
    JSON, then the raw bytes), so admission never runs a JAX program and bfloat16 needs no
    framework."""
    where = f"lora_path {str(path)!r}: {WEIGHTS_FILE}"
    try:
        raw = (path / WEIGHTS_FILE).read_bytes()
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + size])
        data = memoryview(raw)[8 + size :]
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, not a float type")
            if dtype == "bfloat16":
                import ml_dtypes

                dtype = ml_dtypes.bfloat16
            start, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            array = np.frombuffer(data[start:end], dtype=dtype)
            tensors[name] = array.reshape(shape).astype(np.float32)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    except (KeyError, TypeError, IndexError, OSError) as exc:  # a corrupt or truncated file
        raise ValueError(f"{where}: cannot read it ({type(exc).__name__}: {exc})") from None
    return tensors


def load_adapter(request: LoRARequest, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check `request`'s adapter against the base model `config` (ValueError naming
    the problem)."""
    path = Path(request.lora_path).expanduser()
    where = f"lora_path {request.lora_path!r}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such adapter directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{where}: {CONFIG_FILE} is missing (expected a Hugging Face PEFT adapter)")
    if not (path / WEIGHTS_FILE).is_file():
        pickled = (
            " (pickle files such as adapter_model.bin are not loaded)" if (path / "adapter_model.bin").exists() else ""
        )
        raise ValueError(f"{where}: {WEIGHTS_FILE} is missing{pickled}")
    peft = _read_config(path)
    rank_pattern, alpha_pattern = peft.get("rank_pattern") or {}, peft.get("alpha_pattern") or {}
    matched: dict[str, dict[str, str | None]] = {}

    def rank_and_scaling(module_key: str) -> tuple[int, float]:
        """PEFT's per-module rank and scaling: `rank_pattern` / `alpha_pattern` entries whose
        regex matches the end of the module's name override `r` / `lora_alpha`."""
        rank_key = matched.get("rank_pattern", {}).get(module_key)
        alpha_key = matched.get("alpha_pattern", {}).get(module_key)
        r = int(peft["r"] if rank_key is None else rank_pattern[rank_key])
        alpha = float(peft["lora_alpha"] if alpha_key is None else alpha_pattern[alpha_key])
        at = f" of {module_key}" if module_key else ""
        if r > max_rank:
            raise ValueError(f"{where}: adapter rank r={r}{at} exceeds max_lora_rank ({max_rank})")
        scaling = alpha / (math.sqrt(r) if peft.get("use_rslora") else r)
        if not abs(scaling) <= MAX_SCALING:
            raise ValueError(
                f"{where}: LoRA scaling{at} (lora_alpha / r{'' if not peft.get('use_rslora') else ' ** 0.5'}) "
                f"is {scaling!r}; it must be finite and at most {MAX_SCALING:g} in magnitude"
            )
        return r, scaling

    rank_and_scaling("")  # the adapter's own r, before any tensor is read
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    module_keys: dict[tuple[int, str], str] = {}
    for name, tensor in _read_tensors(path).items():
        match = _TENSOR.search(name)
        module = match.group(3) if match else None
        if (
            match is None
            or module not in LORA_TARGETS
            or LORA_TARGETS[module][1] != ("attn" if match.group(2) == "self_attn" else "mlp")
        ):
            raise ValueError(
                f"{where}: tensor {name!r} adapts a module that is not a LoRA target here "
                f"(supported: {', '.join(LORA_TARGETS)} of the decoder layers)"
            )
        layer, target = int(match.group(1)), LORA_TARGETS[module][0]
        if layer >= config.num_layers:
            raise ValueError(
                f"{where}: tensor {name!r} adapts layer {layer}, but the base model has {config.num_layers} layers"
            )
        if target not in layer_targets(config, layer):
            raise ValueError(
                f"{where}: tensor {name!r} adapts MoE layer {layer}'s {module}; expert "
                "weights are not LoRA targets (attention projections are)"
            )
        if not np.isfinite(tensor).all() or float(np.abs(tensor).max(initial=0.0)) > MAX_WEIGHT:
            raise ValueError(
                f"{where}: tensor {name!r} holds non-finite values or values above {MAX_WEIGHT:g} in "
                "magnitude (LoRA weights must be finite and bounded so the update stays finite in "
                "float32 / bfloat16)"
            )
        pairs.setdefault((layer, target), {})[match.group(4)] = tensor
        module_keys[(layer, target)] = _module_key(name)

    matched = match_patterns(
        {"rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}, sorted(set(module_keys.values())), where
    )
    weights = {}
    ranks, scalings = [], []
    for (layer, target), ab in sorted(pairs.items()):
        rank, scaling = rank_and_scaling(module_keys[(layer, target)])
        ranks.append(rank)
        scalings.append(scaling)
        module = next(k for k, v in LORA_TARGETS.items() if v[0] == target)
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"{where}: layer {layer} {module} has lora_{'A' if 'A' in ab else 'B'} "
                f"but no lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        d_in, d_out = target_dims(config, target)
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise ValueError(
                f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this base model with r={rank} needs ({rank}, {d_in}) and ({d_out}, {rank}) "
                "(an adapter for a different base model?)"
            )
        weights[(layer, target)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * scaling))
    if not weights:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(request, max(ranks), scalings[0] if len(set(scalings)) == 1 else float("nan"), weights)


def _module_key(tensor_name: str) -> str:
    """The adapted module's name in the base model, as PEFT matches patterns against it:
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj`."""
    name = tensor_name[: tensor_name.index(".lora_")]
    return name[len("base_model.model.") :] if name.startswith("base_model.model.") else name
