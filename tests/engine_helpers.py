"""Tiny random Hugging Face checkpoints for engine tests (written with save_pretrained)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _hf_config(arch: str, vocab_size: int, num_layers: int = 2):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    if arch == "llama":
        return transformers.LlamaConfig(
            **common,
            intermediate_size=96,
            head_dim=24,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, intermediate_size=96, head_dim=16)
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**common, "num_key_value_heads": 1}, intermediate_size=96)
    raise ValueError(arch)


def make_hf_model(arch: str, path: Path, vocab_size: int = 384, seed: int = 0, num_layers: int = 2):
    """Save a random HF model of `arch` (f32) with the tiny-moe tokenizer; returns the torch model."""
    import torch
    import transformers

    from jaxllm.models import materialize_preset

    torch.manual_seed(seed)
    config = _hf_config(arch, vocab_size, num_layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    preset = materialize_preset("tiny-moe")
    for name in TOKENIZER_FILES:
        if (preset / name).exists():
            shutil.copy(preset / name, path / name)
    return model


def hf_teacher_forcing_check(model, prompt: list[int], generated: list[int], tol: float = 1e-4) -> None:
    """Each generated token must be HF's argmax (or within `tol` of its max logit)."""
    import torch

    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
    for i, token in enumerate(generated):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - tol, (
            f"token {i}: chose {token} (logit {row[token]:.6f}), HF argmax {int(row.argmax())} ({row.max():.6f})"
        )


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]
