"""DeepSeek-V3 multi-token prediction: the MTP layer loaded from a checkpoint in the published
layout (`model.layers.{N}.enorm / hnorm / eh_proj / shared_head.*` beside a decoder layer) and
run over its own paged latent cache, against a torch composition of Hugging Face's
`DeepseekV3DecoderLayer` and `DeepseekV3RMSNorm` wired as published; the target's hidden-state
side outputs against transformers' hidden states."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

from jaxllm.models import forward, load_model_config, load_params  # noqa: E402
from jaxllm.models.decoder import forward_with_hidden_states  # noqa: E402
from jaxllm.models.mtp import init_mtp_kv_cache, mtp_draft, mtp_forward, mtp_kv_cache_spec, mtp_logits  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, build_step_batch, random_block_table, rel_err  # noqa: E402

TOL = 1e-4
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


def _randomize(module, gen) -> None:
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


class TorchMtp(torch.nn.Module):
    """The published MTP module: enorm, hnorm, eh_proj over [enorm(embed); hnorm(hidden)], one
    DeepseekV3DecoderLayer (index num_hidden_layers: MoE), shared_head.norm, shared LM head."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = hf_ds.DeepseekV3DecoderLayer(config, layer_idx)
        self.head_norm = hf_ds.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, model, next_tokens, hidden):
        """MTP hidden states [1, n, H] and logits [1, n, V] over a whole (causal) sequence."""
        embeds = model.model.embed_tokens(next_tokens)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x, attention_mask=mask, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions)
        )
        out = out[0] if isinstance(out, tuple) else out
        return out, model.lm_head(self.head_norm(out))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_mtp")
    hf_config = transformers.DeepseekV3Config(**CONFIG)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    _randomize(model, gen)
    mtp = TorchMtp(hf_config, CONFIG["num_hidden_layers"]).eval()
    _randomize(mtp, gen)
    model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    pre = f"model.layers.{CONFIG['num_hidden_layers']}"
    published = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "head_norm": "shared_head.norm"}
    for name, value in mtp.state_dict().items():
        first, rest = name.split(".", 1)
        ours = f"{pre}.{rest}" if first == "layer" else f"{pre}.{published[first]}.{rest}"
        tensors[ours] = value.numpy()
    tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]  # the published copies
    tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    config = load_model_config(directory)
    return directory, config, model, mtp, load_params(directory, config, load_mtp=True)


def _target_hidden(model, tokens):
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
def _jitted(fn, *static):
    return jax.jit(fn, static_argnames=("config",) + static)


def _batch(chunks):
    return build_step_batch(
        chunks,
        tokens_per_block=TOKENS_PER_BLOCK,
        num_blocks=NUM_BLOCKS,
        token_bucket=32,
        max_seqs=2,
        max_blocks_per_seq=MAX_BLOCKS,
    )


def test_config_reads_mtp_layers_and_the_default_load_skips_them(checkpoint, caplog):
    directory, config, _, _, params = checkpoint
    assert config.num_nextn_predict_layers == 1
    assert sorted(params["mtp"][0]) == sorted(
        ["enorm", "hnorm", "eh_proj", "head_norm", "attn_norm", "attn", "mlp_norm", "moe", "shared"]
    )
    assert params["mtp"][0]["eh_proj"].shape == (64, 32) and params["mtp"][0]["moe"]["w_gate"].shape == (8, 32, 16)
    with caplog.at_level(logging.INFO, logger="jaxllm.models.deepseek_weights"):
        plain = load_params(directory, config)
    assert "mtp" not in plain and "multi-token-prediction tensors (layers 2)" in caplog.text
    assert mtp_kv_cache_spec(config).bytes_per_token() == 1 * (16 + 8) * 4
    from dataclasses import replace

    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        load_params(directory, replace(config, num_nextn_predict_layers=0), load_mtp=True)


def test_target_hidden_side_outputs_match_hf_and_leave_the_logits_alone(checkpoint):
    _, config, model, _, params = checkpoint
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 11)]
    out, pre_norm = _target_hidden(model, tokens)
    table = random_block_table(np.random.default_rng(0), NUM_BLOCKS, MAX_BLOCKS)
    batch = _batch([SeqChunk(tokens, 0, table)])
    rows = jnp.arange(len(tokens), dtype=jnp.int32)
    cache = PagedModel(params, config, TOKENS_PER_BLOCK, NUM_BLOCKS).empty_cache()
    fn = _jitted(forward_with_hidden_states, "aux_layers")
    logits, _, hidden, aux = fn(params, cache, batch, rows, config=config, aux_layers=(0, 1))
    assert rel_err(np.asarray(hidden), pre_norm[0].double().numpy()) < TOL
    for k, layer in enumerate((0, 1)):  # transformers' hidden_states[i]: the input of layer i
        assert rel_err(np.asarray(aux[:, k]), out.hidden_states[layer][0].double().numpy()) < TOL
    plain, _ = _jitted(forward)(params, cache, batch, config=config)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))


def test_mtp_forward_matches_the_torch_composition(checkpoint):
    """All positions of one prompt chunk (expanded MLA), logits and hidden states."""
    _, config, model, mtp, params = checkpoint
    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(0, config.vocab_size, 13)]
    _, pre_norm = _target_hidden(model, tokens[:-1])
    with torch.no_grad():
        ref_hidden, ref_logits = mtp(model, torch.tensor([tokens[1:]]), pre_norm)
    table = random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS)
    batch = _batch([SeqChunk(tokens[1:], 0, table)])
    hidden = jnp.zeros((32, config.hidden_size)).at[:12].set(jnp.asarray(pre_norm[0].numpy()))
    cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    logits, out, _ = _jitted(mtp_forward, "layer")(params, cache, batch, hidden, config=config)
    assert ref_logits.std() > 0.5, "test MTP layer has near-uniform logits"
    assert rel_err(np.asarray(out[:12]), ref_hidden[0].double().numpy()) < TOL
    assert rel_err(np.asarray(logits[0]), ref_logits[0, -1].double().numpy()) < TOL
    all_logits = mtp_logits(params, out[:12], config)
    assert rel_err(np.asarray(all_logits), ref_logits[0].double().numpy()) < TOL


def test_chained_drafts_of_two_sequences_match_the_torch_chain(checkpoint):
    """Three greedy drafts per sequence: the first step over both prompts (expanded), two more
    of one token per sequence (absorbed, reading the MTP pages the first step wrote)."""
    _, config, model, mtp, params = checkpoint
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (12, 7)]
    table_a = random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS)
    tables = [table_a, random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS, exclude=table_a)]
    chunks, hidden_rows, expected, expected_logits = [], [], [], []
    for prompt, table in zip(prompts, tables):
        _, pre_norm = _target_hidden(model, prompt[:-1])
        chunks.append(SeqChunk(prompt[1:], 0, table))
        hidden_rows.append(pre_norm[0].numpy())
        seq, h, drafts, step_logits = list(prompt[1:]), pre_norm, [], []
        for _ in range(3):  # the torch chain recomputes the whole MTP sequence each step
            with torch.no_grad():
                out, logits = mtp(model, torch.tensor([seq]), h)
            drafts.append(int(logits[0, -1].argmax()))
            step_logits.append(logits[0, -1].double().numpy())
            seq, h = seq + [drafts[-1]], torch.cat([h, out[:, -1:]], dim=1)
        expected.append(drafts)
        expected_logits.append(step_logits)
    batch = _batch(chunks)
    packed = np.concatenate(hidden_rows)
    hidden = jnp.zeros((32, config.hidden_size)).at[: len(packed)].set(jnp.asarray(packed))
    cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    drafts, _, logits = _jitted(mtp_draft, "num_draft_tokens", "return_logits")(
        params, cache, batch, hidden, num_draft_tokens=3, config=config, return_logits=True
    )
    assert np.asarray(drafts).tolist() == expected
    assert len({d for row in expected for d in row}) > 1, "the drafts are one repeated token"
    for s in range(2):
        for j in range(3):
            assert rel_err(np.asarray(logits[s, j]), expected_logits[s][j]) < TOL, (s, j)
