"""DeepSeek-V3 with a multi-token-prediction layer for tests: a tiny config, random transformers
weights, and the published MTP module composed from transformers' `DeepseekV3DecoderLayer` and
`DeepseekV3RMSNorm` (enorm, hnorm, eh_proj over [enorm(embed); hnorm(hidden)], shared head)."""

from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path

import jax
import numpy as np
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from tests.deepseek_helpers import TINY_DEEPSEEK_V3, randomize
from tests.model_helpers import SeqChunk, build_step_batch, random_block_table

CONFIG = dict(TINY_DEEPSEEK_V3, num_hidden_layers=2, num_nextn_predict_layers=1, num_key_value_heads=4)
TOKENS_PER_BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 32, 8


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


def write_engine_checkpoint(directory: Path):
    """A DeepSeek-V3 checkpoint with one MTP layer under its published names (and the copies
    of the embedding and LM head), with the tiny-moe tokenizer; returns (model, mtp)."""
    from safetensors.numpy import load_file, save_file

    from jaxllm.models import materialize_preset

    model, mtp = hf_with_mtp()
    with saved_with(model, mtp):
        model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    pre = f"model.layers.{CONFIG['num_hidden_layers']}"
    tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, directory / name)
    return model, mtp


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


def torch_mtp_drafts(model, mtp, tokens: list[int], k: int) -> list[np.ndarray]:
    """The MTP chain's logits for the k drafts after `tokens`, from scratch in torch: the
    target's hidden states over tokens[:-1], the MTP layer over the next tokens, each draft
    fed back with the MTP layer's own hidden state (MTP-Eagle). Returns k logit rows."""
    _, hidden = target_hidden(model, tokens[:-1])
    next_tokens = list(tokens[1:])
    rows = []
    with torch.no_grad():
        for _ in range(k):
            out, logits = mtp.predict(model, torch.tensor([next_tokens]), hidden)
            rows.append(logits[0, -1].numpy())
            next_tokens.append(int(logits[0, -1].argmax()))
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return rows


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
