"""The tiny DeepSeek-V3 shape the tests share, and the random weights that make its logits
decisive (norms near 1, linear layers 1/sqrt(fan_in), router gain 2, a nonzero correction bias)."""

from __future__ import annotations

import torch

TINY_DEEPSEEK_V3 = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
)


def randomize(module: torch.nn.Module, gen: torch.Generator, bias_scale: float = 0.2) -> None:
    """Decisive random weights in place: norms near 1, linear layers 1/sqrt(fan_in) (LM head gain 3,
    router gain 2), a nonzero router correction bias."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                gain = 3.0 if "lm_head" in name else 2.0 if name.endswith("gate.weight") else 1.0
                p.copy_(noise * gain / p.shape[-1] ** 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_scale * torch.randn(b.shape, generator=gen))
