"""FP8 checkpoints written the way DeepSeek-V3 publishes them, from a Hugging Face model's
weights, with torch (independent of the engine's quantization code):

- every linear projection `<module>.weight` (torch [out, in]) stored as float8_e4m3fn with
  `<module>.weight_scale_inv`, float32 [ceil(out/128), ceil(in/128)], one scale per
  128 x 128 block = amax(|block|) / 448, the weight being `fp8 * scale_inv` per block;
- routed experts in the hub's per-expert layout (`experts.{e}.gate_proj.weight`, ...);
- embeddings, norms, the router and the LM head kept in float;
- `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [128, 128]}` in config.json.

Also the dynamic activation quantization of DeepSeek's `act_quant` (per token, per group of
128 along the features, scale amax / 448) as a torch function, for simulating an FP8
deployment on the HF model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|gate_proj|up_proj|down_proj)\.weight$"
)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK = 128


def block_quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], float32 scale_inv [ceil(out/b), ceil(in/b)])."""
    w = w.float()
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out, :inp] = w
    blocks = padded.reshape(rows, block, cols, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(rows * block, cols * block)[:out, :inp].contiguous(), scale


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """DeepSeek's `weight_dequant`: fp8 * scale_inv of its block, float32."""
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under hub names, experts split per expert (float32)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        elif not name.endswith("rotary_emb.inv_freq"):
            out[name] = t.contiguous()
    return out


def write_fp8_checkpoint(directory: Path, model, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Save `model` as a DeepSeek-style FP8 checkpoint in `directory`; returns the weights the
    checkpoint means (every quantized weight dequantized), under the hub names."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meant = {}, {}
    for name, t in hub_state_dict(model).items():
        if QUANTIZED.search(name) and t.ndim == 2:
            q, s = block_quantize(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            meant[name] = block_dequantize(q, s)
        else:
            tensors[name] = t
            meant[name] = t
    for name in drop:
        tensors.pop(name)
    save_file(tensors, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = FP8_CONFIG
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config))
    return meant


# compressed-tensors' float-quantized FP8 with dynamic per-token activations, as llm-compressor
# writes it ("FP8-dynamic" checkpoints of Llama / Qwen).
COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}


def channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], float32 weight_scale [out, 1] = amax of the row / 448)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (w / scale).to(torch.float8_e4m3fn), scale


def write_channel_fp8_checkpoint(directory: Path, model) -> dict[str, torch.Tensor]:
    """Save `model` as a compressed-tensors FP8 per-channel checkpoint (`weight_scale` [out, 1]);
    returns the weights it means."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meant = {}, {}
    for name, t in hub_state_dict(model).items():
        if QUANTIZED.search(name) and t.ndim == 2:
            q, s = channel_quantize(t)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale"] = q, s
            meant[name] = q.float() * s
        else:
            tensors[name] = meant[name] = t
    save_file(tensors, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = COMPRESSED_TENSORS_CONFIG
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config))
    return meant


def load_meant_weights(model, meant: dict[str, torch.Tensor]) -> None:
    """Put the dequantized hub weights back into `model` (experts fused as transformers holds them)."""
    state = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith("experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                for e in range(t.shape[0]):
                    t[e].copy_(torch.cat([meant[f"{base}{e}.gate_proj.weight"], meant[f"{base}{e}.up_proj.weight"]]))
            elif name.endswith("experts.down_proj"):
                base = name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    t[e].copy_(meant[f"{base}{e}.down_proj.weight"])
            elif name in meant:
                t.copy_(meant[name])


def act_quant(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """DeepSeek's `act_quant` followed by the dequantization an FP8 GEMM applies: per token and
    group of `group` features, scale = amax / 448, x -> e4m3(x / scale) * scale (both
    divisions as products with the float32 reciprocal, the engine's stated rounding)."""
    k = x.shape[-1]
    g = min(group, k)
    pad = -k % g
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, g)
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax * torch.tensor(1.0 / 448.0, dtype=torch.float32), torch.ones_like(amax))
    q = (xf * (1.0 / scale)).to(torch.float8_e4m3fn).float() * scale  # x / scale as the engine rounds it
    return q.reshape(*x.shape[:-1], -1)[..., :k].to(x.dtype)


class _Restore:
    """A handle whose `remove()` puts a module's own forward back."""

    def __init__(self, module) -> None:
        self.module = module

    def remove(self) -> None:
        del self.module.forward


def _quantized_experts_forward(group: int):
    """transformers' fused-experts loop (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) with the
    input of every projection quantized by `act_quant`: the token rows, and the SwiGLU output
    before the down projection, as DeepSeek's FP8 experts run."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        x = act_quant(hidden_states, group)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if len(token) == 0:
                continue
            gate, up = torch.nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = act_quant(self.act_fn(gate) * up, group)
            y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return forward


def simulate_dynamic_activations(model, skip: tuple[str, ...] = ("kv_b_proj",), group: int = BLOCK) -> list:
    """Quantize, as `act_quant` does per `group` features (a group as wide as the features or
    wider: per token), the input of every quantized linear (forward pre-hooks) and of every
    routed expert projection (the experts' forward replaced); returns handles to undo it."""
    import types

    handles: list = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            module.forward = types.MethodType(_quantized_experts_forward(group), module)
            handles.append(_Restore(module))
        elif isinstance(module, torch.nn.Linear) and QUANTIZED.search(name + ".weight"):
            if not any(s in name for s in skip):
                hook = lambda m, args: (act_quant(args[0], group),) + tuple(args[1:])  # noqa: E731
                handles.append(module.register_forward_pre_hook(hook))
    return handles
