"""Tiny Hugging Face checkpoints written to GGUF the way llama.cpp's converter writes them.

Names come from the `gguf` library's own tensor-name map, Llama q/k rows get llama.cpp's
RoPE permutation, 2-D weights are quantized with `gguf.quantize` (1-D norms and biases stay
F32, as llama.cpp keeps them) or, for K-quants (which `gguf.quantize` cannot produce), written
as random valid blocks, and the tokenizer is the tiny preset's byte-level BPE written
as llama.cpp's `gpt2` tokenizer metadata. Nothing here uses jaxllm's GGUF reader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxllm.models.presets import CHAT_TEMPLATE

# llama.cpp writes Mixtral as `llama` with experts.
# A tiny Llama whose rows are whole K-quant super-blocks (256): hidden 256, down_proj's inputs 512.
K_SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# llama_ftype of a file whose 2-D weights are all of one type (Q4_K_M: Q4_K and Q6_K mixed).
FILE_TYPE = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K": 14,  # Q4_K_S
    "Q4_K_M": 15,
    "Q5_K": 16,  # Q5_K_S
    "Q6_K": 18,
    "BF16": 32,
}


def hf_config(arch: str, vocab_size: int, **overrides):
    """A 2-layer config of `arch` whose every quantized row length is a multiple of 32.

    `overrides` replace config fields (e.g. a 256-wide model whose rows fit K-quant blocks)."""
    config = _hf_config(arch, vocab_size)
    config.update(overrides)
    return config


def _hf_config(arch: str, vocab_size: int):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=2, head_dim=32, intermediate_size=96)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=1, intermediate_size=96)
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **{**common, "tie_word_embeddings": True}, num_key_value_heads=2, head_dim=32, intermediate_size=96
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    raise ValueError(arch)


def make_tiny_hf(arch: str, path: Path, seed: int = 0, **config_overrides):
    """Save a random f32 HF model with the tiny preset's tokenizer; returns (model, tokenizer.json dict)."""
    import torch
    import transformers

    from jaxllm.models import materialize_preset

    preset = materialize_preset("tiny-moe")
    tokenizer = json.loads((preset / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"]) + sum(
        1 for t in tokenizer["added_tokens"] if t["content"] not in tokenizer["model"]["vocab"]
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch, vocab, **config_overrides), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(preset / name, path / name)
    return model, tokenizer


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q: all heads, k: the KV heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant_blocks(qtype, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random but valid `qtype` (Q4_K, Q5_K or Q6_K) blocks for a [rows, cols] weight, as raw bytes.

    There is no K-quantizer in `gguf`, so the bytes are random except the f16 super-block
    scales (gguf/quants.py's layout), which get small finite values so no NaN/Inf appears."""
    import gguf

    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block_values == 0, f"{qtype.name} rows must be a multiple of {block_values}"
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        scale_bytes = [slice(0, 2), slice(2, 4)]  # d, dmin lead the block
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        scale_bytes = [slice(block_bytes - 2, block_bytes)]  # d ends the block
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    for where in scale_bytes:
        blocks[:, where] = rng.uniform(0.01, 0.05, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_values * block_bytes)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def quantize_k(x: np.ndarray, qtype: str) -> np.ndarray:
    """A [..., cols] float weight as Q4_K or Q6_K blocks (raw bytes [..., cols / 256 * block]),
    written with numpy following gguf/quants.py's block layouts (a plain min/max quantizer, not
    llama.cpp's search; any valid blocks serve as test data)."""
    lead, cols = x.shape[:-1], x.shape[-1]
    assert cols % 256 == 0
    if qtype == "Q6_K":
        b = x.reshape(-1, 16, 16).astype(np.float32)  # super-blocks of sixteen 16-value blocks
        sub = np.abs(b).max(-1) / 31
        d = (sub.max(-1) / 127).astype(np.float16).astype(np.float32)
        d = np.where(d == 0, 1, d)
        sc = np.clip(np.round(sub / d[:, None]), 0, 127).astype(np.int8)
        eff = d[:, None] * sc.astype(np.float32)
        q = np.where(eff[..., None] > 0, np.round(b / np.where(eff == 0, 1, eff)[..., None]), 0)
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
        low, high = (q & 15).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
        ql = low[:, :, 0] | (low[:, :, 1] << 4)  # element 128h + 64s + k: nibble s of ql[64h + k]
        qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    elif qtype == "Q4_K":
        b = x.reshape(-1, 8, 32).astype(np.float32)  # super-blocks of eight 32-value blocks
        mn = np.maximum(0, -b.min(-1))
        sub = (b.max(-1) + mn) / 15
        d = (sub.max(-1) / 63).astype(np.float16).astype(np.float32)
        dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
        d, dmin = np.where(d == 0, 1, d), np.where(dmin == 0, 1, dmin)
        sc = np.clip(np.round(sub / d[:, None]), 0, 63).astype(np.uint8)
        m = np.clip(np.round(mn / dmin[:, None]), 0, 63).astype(np.uint8)
        eff, effm = d[:, None] * sc, dmin[:, None] * m
        q = np.where(eff[..., None] > 0, np.round((b + effm[..., None]) / np.where(eff == 0, 1, eff)[..., None]), 0)
        q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
        qs = q[:, :, 0] | (q[:, :, 1] << 4)  # block 2c + s: nibble s of bytes 32c..32c+31
        scales = np.concatenate(
            [
                sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                m[:, :4] | ((m[:, 4:] >> 4) << 6),
                (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
            ],
            axis=-1,
        )
        blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs.reshape(-1, 128)], axis=-1)
    else:
        raise ValueError(qtype)
    return np.ascontiguousarray(blocks.astype(np.uint8)).reshape(*lead, -1)


def _state_dict(model) -> dict[str, np.ndarray]:
    """HF tensor names -> float32 arrays, MoE experts stacked as [E, out, in] per projection."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if ".mlp.experts." not in name:
            out[name] = value
            continue
        prefix = name.split(".mlp.experts.")[0] + ".mlp.experts"
        rest = name.split(".mlp.experts.")[1]
        if rest == "gate_up_proj":  # transformers' fused [E, 2I, H]
            inter = value.shape[1] // 2
            out[f"{prefix}.gate_proj.weight"] = value[:, :inter]
            out[f"{prefix}.up_proj.weight"] = value[:, inter:]
        elif rest == "down_proj":  # [E, H, I]
            out[f"{prefix}.down_proj.weight"] = value
        else:  # per expert: E.gate_proj.weight
            expert, proj = rest.split(".")[0], rest.split(".")[1]
            out.setdefault(f"{prefix}.{proj}.weight", {})[int(expert)] = value
    for name, value in list(out.items()):
        if isinstance(value, dict):
            out[name] = np.stack([value[e] for e in sorted(value)])
    return out


def write_gguf(
    model,
    tokenizer: dict,
    arch: str,
    path: Path,
    qtype: str = "F32",
    k_quants: tuple[str, ...] = (),
    seed: int = 0,
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write `model` (a transformers model) as llama.cpp would, 2-D weights as `qtype`.

    With `k_quants` (e.g. ("Q4_K", "Q6_K")) the 2-D weights whose rows are a multiple of 256
    are instead random valid blocks of those types in turn (a mixed "Q4_K_M" file, the
    model's values are not kept); the others stay `qtype`, as in llama.cpp's mixed files.
    `tensor_types` gives some tensors (by GGUF name, `blk.0.attn_v.weight`) their own type,
    as llama.cpp's Q4_K_M gives some layers' attn_v / ffn_down Q6_K (Q5_K: random blocks)."""
    import gguf

    rng = np.random.default_rng(seed)
    k_quant_turn = 0

    cfg = model.config
    gguf_arch = GGUF_ARCH[arch]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(
        float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None) else float(cfg.rope_theta)
    )
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(FILE_TYPE["Q4_K_M" if k_quants or tensor_types else qtype])
    if arch == "qwen3_moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "mixtral":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)

    # The tokenizer as llama.cpp's `gpt2` (byte-level BPE) metadata.
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in tokenizer["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    quant = gguf.GGMLQuantizationType[qtype]
    for name, value in _state_dict(model).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        assert gguf_name is not None, f"gguf has no name for {name}"
        if arch in ("llama", "mixtral") and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        value = np.ascontiguousarray(value, dtype=np.float32)
        own = (tensor_types or {}).get(f"{gguf_name}.{suffix}")
        if own is not None and value.ndim == 2:
            kind = gguf.GGMLQuantizationType[own]
            if own in ("Q4_K", "Q6_K"):
                data = quantize_k(value, own)
            elif own == "Q5_K":
                data = random_k_quant_blocks(kind, value.shape, rng)
            else:
                data = gguf.quantize(value, kind)
            writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=kind)
        elif k_quants and value.ndim == 2 and value.shape[1] % 256 == 0:
            k_quant = gguf.GGMLQuantizationType[k_quants[k_quant_turn % len(k_quants)]]
            k_quant_turn += 1
            writer.add_tensor(
                f"{gguf_name}.{suffix}", random_k_quant_blocks(k_quant, value.shape, rng), raw_dtype=k_quant
            )
        elif value.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf_name}.{suffix}", value)
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(f"{gguf_name}.{suffix}", value.astype(np.float16))
        elif qtype in ("Q4_K", "Q6_K"):
            writer.add_tensor(f"{gguf_name}.{suffix}", quantize_k(value, qtype), raw_dtype=quant)
        elif qtype == "Q5_K":
            writer.add_tensor(f"{gguf_name}.{suffix}", random_k_quant_blocks(quant, value.shape, rng), raw_dtype=quant)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quantize(value, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# Shared by the tests of GGUF files kept quantized


def quantized_leaves(params) -> list:
    """The `QuantizedWeight`s of a parameter pytree."""
    import jax

    from jaxllm.models.quantization import QuantizedWeight

    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return [w for w in leaves if isinstance(w, QuantizedWeight)]


def write_converted(
    tmp_path: Path,
    arch: str,
    qtype: str,
    k_quants: tuple[str, ...] = (),
    tensor_types: dict[str, str] | None = None,
    **shapes,
):
    """A tiny random `arch` model written as a `qtype` GGUF file (`write_gguf`'s `k_quants`,
    `tensor_types`) and converted; returns (transformers model, GGUF path, converted directory)."""
    from jaxllm.models.gguf import convert_gguf

    path = tmp_path / "hf"
    path.mkdir(parents=True)
    model, tokenizer = make_tiny_hf(arch, path, **shapes)
    name = "Q4_K_M" if k_quants or tensor_types else qtype
    gguf_path = write_gguf(
        model, tokenizer, arch, path / f"{name}.gguf", qtype, k_quants=k_quants, tensor_types=tensor_types
    )
    return model, gguf_path, convert_gguf(gguf_path, tmp_path / "conv", progress=False)


def assert_logits_equal_transformers(model, gguf_path: Path, params, config, num_tokens: int = 40, seed: int = 1):
    """Our logits of random tokens equal (relative 1e-4) those of transformers' own GGUF model
    (`from_pretrained(gguf_file=...)`, its own dequantization) of the same file."""
    import torch
    import transformers

    from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=model.config, dtype=torch.float32
    ).eval()
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, model.config.vocab_size, num_tokens)]
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0].double().numpy()
    paged = PagedModel(params, config, num_blocks=64, max_blocks_per_seq=16, token_bucket=64)
    ours = paged.all_logits([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 64, 16))])[0]
    assert np.abs(ref).max() > 0.1
    assert rel_err(ours, ref) < 1e-4


def dequantized_blocks(raw: np.ndarray, qtype: str, held: str | None = None) -> np.ndarray:
    """GGUF rows of `qtype` as jaxllm holds them (`unpack_blocks`: values and the file's own
    per-block numbers; with `held`, in the layout of a layer stack mixing types, `as_held`),
    folded back to float32 as the step does."""
    from jaxllm.models.gguf_blocks import as_held, unpack_blocks
    from jaxllm.models.int_checkpoint_view import dequantize_stored
    from jaxllm.models.quant_config import parse_quantization_config

    parts = unpack_blocks(raw, qtype)
    if held is not None:
        parts = as_held(parts, qtype, held)
    qc = parse_quantization_config({"quant_method": "gguf", "weight_type": held or qtype})
    named = {leaf: parts[suffix] for leaf, (suffix, _, _) in qc.block_tensors().items()}
    return dequantize_stored(parts["weight"].astype(np.float32), named, qc)
