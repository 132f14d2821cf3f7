"""DeepSeek-V3 multi-token prediction: the MTP layer loaded from a checkpoint in the published
layout (`model.layers.{N}.enorm / hnorm / eh_proj / shared_head.*` beside a decoder layer) and
run over its own paged latent cache, against a torch composition of Hugging Face's
`DeepseekV3DecoderLayer` and `DeepseekV3RMSNorm` wired as published; the target's hidden-state
side outputs against transformers' hidden states."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.hidden_states import forward_with_hidden_states  # noqa: E402
from jaxllm.models.mtp import init_mtp_kv_cache, mtp_draft, mtp_forward, mtp_kv_cache_spec, mtp_logits  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402
from tests.mtp_helpers import (  # noqa: E402
    CONFIG,
    MAX_BLOCKS,
    NUM_BLOCKS,
    TOKENS_PER_BLOCK,
    hf_with_mtp,
    jitted,
    saved_with,
    step_batch,
    target_hidden,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_mtp")
    model, mtp = hf_with_mtp()
    with saved_with(model, mtp):
        model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    pre = f"model.layers.{CONFIG['num_hidden_layers']}"
    assert f"{pre}.eh_proj.weight" in tensors and f"{pre}.shared_head.norm.weight" in tensors
    tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]  # the published copies
    tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    config = load_model_config(directory)
    return directory, config, model, mtp, load_params(directory, config, load_mtp=True)


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
    slotted = load_params(directory, config, load_mtp=True, num_slots=10)  # experts as slots: the MTP layer's too
    assert slotted["mtp"][0]["moe"]["w_up"].shape == (10, 32, 16) and "slots" in slotted["mtp"][0]["moe"]


def test_draft_batch_shifts_each_sequence_by_one_token():
    from jaxllm.models.draft_chain import draft_batch

    a, b = [5, 6, 7, 8], [9, 10, 11]
    target = step_batch([SeqChunk(a, 3, [0, 1, 2]), SeqChunk(b, 0, [3])])
    shifted = draft_batch(target, jnp.asarray([40, 41], jnp.int32))
    expected = step_batch([SeqChunk(a[1:] + [40], 3, [0, 1, 2]), SeqChunk(b[1:] + [41], 0, [3])])
    for field in ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "logits_indices"):
        np.testing.assert_array_equal(np.asarray(getattr(shifted, field)), getattr(expected, field), field)


def test_target_hidden_side_outputs_and_logits_match_hf(checkpoint):
    _, config, model, _, params = checkpoint
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 11)]
    out, pre_norm = target_hidden(model, tokens)
    table = random_block_table(np.random.default_rng(0), NUM_BLOCKS, MAX_BLOCKS)
    batch = step_batch([SeqChunk(tokens, 0, table)])
    rows = jnp.arange(len(tokens), dtype=jnp.int32)
    cache = PagedModel(params, config, TOKENS_PER_BLOCK, NUM_BLOCKS).empty_cache()
    fn = jitted(forward_with_hidden_states, "aux_layers", "moe_stats")
    logits, _, hidden, aux, stats = fn(params, cache, batch, rows, config=config, aux_layers=(0, 1), moe_stats=True)
    # one MoE layer (layer 1): every token picks num_experts_per_tok experts
    assert (
        np.asarray(stats.expert_counts).shape == (1, 8)
        and int(np.asarray(stats.expert_counts).sum()) == len(tokens) * 2
    )
    assert rel_err(np.asarray(hidden), pre_norm[0].double().numpy()) < TOL
    for k, layer in enumerate((0, 1)):  # transformers' hidden_states[i]: the input of layer i
        assert rel_err(np.asarray(aux[:, k]), out.hidden_states[layer][0].double().numpy()) < TOL
    with torch.no_grad():  # (transformers' logits are asked apart: output_hidden_states changes them)
        ref_logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1].double().numpy()
    assert rel_err(np.asarray(logits[0]), ref_logits) < TOL


def test_mtp_forward_matches_the_torch_composition(checkpoint):
    """All positions of one prompt chunk (expanded MLA), logits and hidden states."""
    _, config, model, mtp, params = checkpoint
    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(0, config.vocab_size, 13)]
    _, pre_norm = target_hidden(model, tokens[:-1])
    with torch.no_grad():
        ref_hidden, ref_logits = mtp.predict(model, torch.tensor([tokens[1:]]), pre_norm)
    table = random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS)
    batch = step_batch([SeqChunk(tokens[1:], 0, table)])
    hidden = jnp.zeros((32, config.hidden_size)).at[:12].set(jnp.asarray(pre_norm[0].numpy()))
    cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    logits, out, _ = jitted(mtp_forward, "layer")(params, cache, batch, hidden, config=config)
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
        _, pre_norm = target_hidden(model, prompt[:-1])
        chunks.append(SeqChunk(prompt[1:], 0, table))
        hidden_rows.append(pre_norm[0].numpy())
        seq, h, drafts, step_logits = list(prompt[1:]), pre_norm, [], []
        for _ in range(3):  # the torch chain recomputes the whole MTP sequence each step
            with torch.no_grad():
                out, logits = mtp.predict(model, torch.tensor([seq]), h)
            drafts.append(int(logits[0, -1].argmax()))
            step_logits.append(logits[0, -1].double().numpy())
            seq, h = seq + [drafts[-1]], torch.cat([h, out[:, -1:]], dim=1)
        expected.append(drafts)
        expected_logits.append(step_logits)
    batch = step_batch(chunks)
    packed = np.concatenate(hidden_rows)
    hidden = jnp.zeros((32, config.hidden_size)).at[: len(packed)].set(jnp.asarray(packed))
    cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    drafts, _, logits = jitted(mtp_draft, "num_draft_tokens", "return_logits")(
        params, cache, batch, hidden, num_draft_tokens=3, config=config, return_logits=True
    )
    assert np.asarray(drafts).tolist() == expected
    assert len({d for row in expected for d in row}) > 1, "the drafts are one repeated token"
    for s in range(2):
        for j in range(3):
            assert rel_err(np.asarray(logits[s, j]), expected_logits[s][j]) < TOL, (s, j)
