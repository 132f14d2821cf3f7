"""DeepSeek-V3 with a multi-token-prediction layer for tests: a tiny config, random transformers
weights, and the published MTP module composed from transformers' `DeepseekV3DecoderLayer` and
`DeepseekV3RMSNorm` (enorm, hnorm, eh_proj over [enorm(embed); hnorm(hidden)], shared head)."""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from tests.model_helpers import SeqChunk, build_step_batch, random_block_table

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_nextn_predict_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
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
TOKENS_PER_BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 32, 8


def randomize(module, gen) -> None:  # as tests/test_deepseek.py's build_hf
    """Decisive random weights: norms near 1, linear layers 1/sqrt(fan_in) (router gain 2), a
    nonzero router correction bias."""
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
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))


class TorchMtp(hf_ds.DeepseekV3DecoderLayer):
    """The published MTP layer: a DeepseekV3DecoderLayer (index num_hidden_layers: MoE) with
    enorm, hnorm, eh_proj over [enorm(embed); hnorm(hidden)] and shared_head.norm before the
    main model's LM head. Appended to the HF model's layers while saving (`saved_with`), so
    its tensors carry their published names."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        h = config.hidden_size
        self.enorm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

    def predict(self, model, next_tokens, hidden):
        """MTP hidden states [1, n, H] and logits [1, n, V] over a whole (causal) sequence."""
        embeds = model.model.embed_tokens(next_tokens)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = model.model.rotary_emb(x, positions)
        out = self(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return out, model.lm_head(self.shared_head.norm(out))


def hf_with_mtp():
    hf_config = transformers.DeepseekV3Config(**CONFIG)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    randomize(model, gen)
    mtp = TorchMtp(hf_config, CONFIG["num_hidden_layers"]).eval()
    randomize(mtp, gen)
    return model, mtp


@contextlib.contextmanager
def saved_with(model, mtp):
    """The model with the MTP layer as `model.layers.{num_hidden_layers}` (for saving and
    loading weights only: transformers' outputs change with an extra layer attached)."""
    model.model.layers.append(mtp)
    try:
        yield model
    finally:
        del model.model.layers[-1]


def target_hidden(model, tokens):
    """HF's logits and final hidden states before the final norm (what the MTP layer takes)."""
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.setdefault("h", args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    return out, seen["h"]


@functools.cache
def jitted(fn, *static):
    return jax.jit(fn, static_argnames=("config",) + static)


def step_batch(chunks):
    return build_step_batch(
        chunks,
        tokens_per_block=TOKENS_PER_BLOCK,
        num_blocks=NUM_BLOCKS,
        token_bucket=32,
        max_seqs=2,
        max_blocks_per_seq=MAX_BLOCKS,
    )


def draft_inputs(vocab: int, seed: int):
    """A 9-token prompt as the target's step batch and the draft's (shifted by one, same pages)."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, vocab, 9)]
    table = random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS)
    target = step_batch([SeqChunk(prompt[:-1], 0, table)])
    draft = step_batch([SeqChunk(prompt[1:], 0, table)])
    return target, draft, len(prompt) - 1
