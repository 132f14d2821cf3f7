"""A tiny DeepSeek-V3 checkpoint with one random MTP layer (`jaxllm bench spec --method mtp`).

No small published checkpoint carries MTP layers, so the benchmark writes one: DeepSeek-V3's
layout (MLA attention, a dense first layer, MoE after it, one MTP layer under
`model.layers.{num_hidden_layers}`) with random weights and the tiny presets' tokenizer. Random
MTP weights draft tokens the target rarely agrees with: acceptance is near zero, so the figures
measure what drafting costs, not what a trained MTP layer gains.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxllm.models import ModelConfig, materialize_preset
from jaxllm.models.cache_dir import cache_root
from jaxllm.models.random_checkpoint import random_checkpoint

TINY_DEEPSEEK_MTP = "tiny-deepseek-mtp"
HF_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def tiny_deepseek_mtp(seed: int = 0) -> Path:
    """The checkpoint's directory (written under the cache the first time)."""
    from safetensors.numpy import save_file

    target = cache_root() / "bench" / f"{TINY_DEEPSEEK_MTP}-{seed}"
    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(HF_CONFIG, indent=1))
    config = ModelConfig.from_hf_config(HF_CONFIG)
    tensors = random_checkpoint(config, seed, mtp=True)
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, target / name)
    save_file(tensors, str(target / "model.safetensors"))
    return target
