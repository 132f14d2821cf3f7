"""Greedy-only steps take each row's argmax inside the LM head (jaxllm.models.lm_head_argmax).

The fused reduction is checked against the unfused LM head and `first_argmax` (ties included,
chunks that do not divide the vocabulary), the engine's tokens with it on and off for the dense,
MoE and DeepSeek-V3 models (and a Pallas backend in interpret mode), logprobs requests against
the engine with it off, and the compiled program itself: a greedy step's optimized HLO holds no
float32 [rows, vocab] buffer, which the full-logits forward's does (the check can fail).
"""

from __future__ import annotations

import re
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm.models.lm_head_argmax as lm_head_argmax
from jaxllm import SamplingParams
from jaxllm.models.decoder import compute_logits
from jaxllm.models.lm_head_argmax import greedy_tokens, logits_bytes, vocab_chunk
from jaxllm.sampling.sampler import first_argmax

from conftest import tiny_engine
from engine_helpers import random_prompts

SMALL_CHUNKS = 8 * 100  # 8 rows x 100 columns: chunks of 128 columns over the tiny presets' 453


def _head(vocab: int, hidden: int, tied: bool, seed: int = 0) -> tuple[dict, types.SimpleNamespace]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    w[vocab - 3] = w[5]  # exact ties: across chunks (5 and V - 3) and inside one (40 and 41)
    w[41] = w[40]
    # The fields of a ModelConfig the final norm and LM head read.
    config = types.SimpleNamespace(tie_word_embeddings=tied, rms_norm_eps=1e-6, dtype="float32")
    params = {"final_norm": jnp.ones((hidden,), jnp.float32)}
    params.update({"embed": jnp.asarray(w)} if tied else {"lm_head": jnp.asarray(w.T)})
    return params, config


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rows,vocab", [(1, 300), (3, 1000), (8, 453), (16, 1024)])
def test_fused_argmax_is_first_argmax_of_the_lm_head(monkeypatch, tied, rows, vocab):
    monkeypatch.setattr(lm_head_argmax, "CHUNK_ELEMENTS", 8 * 128)
    params, config = _head(vocab, 16, tied)
    residual = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 16)), jnp.float32)
    # Rows whose maxima are the tied columns: a row equal to a tied column's weights maxes there.
    w = np.asarray(params["embed"] if tied else params["lm_head"].T)
    residual = residual.at[0].set(jnp.asarray(w[5] * 10))
    if rows > 1:
        residual = residual.at[1].set(jnp.asarray(w[40] * 10))
    expected = first_argmax(compute_logits(params, residual, config))
    got = jax.jit(lambda p, r: greedy_tokens(p, r, config))(params, residual)
    assert vocab_chunk(rows, vocab) < vocab or rows == 1  # several chunks (one row: one of 300)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert int(got[0]) == 5 and (rows == 1 or int(got[1]) == 40)


def test_logits_bytes_states_what_a_step_writes():
    assert logits_bytes(256, 128256, fused=False) == 4 * 256 * 128256  # 131 MB
    assert logits_bytes(256, 128256, fused=True) == 4 * 256 * 8192 + 4 * 256  # one chunk, the tokens
    assert logits_bytes(1, 128256, fused=True) == 4 * 128256 + 4  # a single chunk


def _tokens(engine, prompts, params) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in prompts]
    out: dict[int, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for update in engine.step():
            out[update.request.request_id] += update.new_token_ids
    return [out[r.request_id] for r in requests]


def _deepseek_dir(path):
    transformers = pytest.importorskip("transformers")
    import torch
    from deepseek_helpers import TINY_DEEPSEEK_V3, randomize

    from jaxllm.models import materialize_preset

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3)).eval()
    randomize(model, torch.Generator().manual_seed(0))
    model.save_pretrained(path)
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, path / name)
    return str(path)


@pytest.mark.parametrize(
    "model,backend", [("tiny-dense", "xla"), ("tiny-moe", "xla"), ("deepseek", "xla"), ("tiny-moe", "pallas")]
)
def test_greedy_tokens_identical_with_the_fused_reduction_on_and_off(monkeypatch, tmp_path, model, backend):
    monkeypatch.setattr(lm_head_argmax, "CHUNK_ELEMENTS", SMALL_CHUNKS)  # several chunks, a clamped last one
    name = _deepseek_dir(tmp_path) if model == "deepseek" else model
    prompts = random_prompts(5, 100, 3, 30, seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens, fused_steps = {}, {}
    for fused in (True, False):
        engine = tiny_engine(name, fused_lm_head_argmax=fused, attention_backend=backend, moe_backend=backend)
        try:
            tokens[fused] = _tokens(engine, prompts, params)
            fused_steps[fused] = engine.runner.fused_steps
        finally:
            engine.close()
    assert fused_steps[True] > 0 and fused_steps[False] == 0
    assert tokens[True] == tokens[False]


def test_logprobs_requests_keep_their_logits_beside_greedy_rows():
    prompts = random_prompts(4, 100, 3, 20, seed=3)
    params = [
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0),
    ]
    results = {}
    for fused in (True, False):
        engine = tiny_engine("tiny-dense", fused_lm_head_argmax=fused)
        try:
            requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            out = {r.request_id: ([], []) for r in requests}
            while engine.has_unfinished_requests():
                for u in engine.step():
                    out[u.request.request_id][0].extend(u.new_token_ids)
                    out[u.request.request_id][1].extend(u.new_logprobs)
            results[fused] = [out[r.request_id] for r in requests]
        finally:
            engine.close()
    for (tokens_on, lp_on), (tokens_off, lp_off), sp in zip(results[True], results[False], params):
        assert tokens_on == tokens_off
        if sp.logprobs is None:
            continue
        assert len(lp_on) == len(tokens_on) == len(lp_off)
        for a, b in zip(lp_on, lp_off):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) <= 1e-5


def _f32_row_buffers(hlo: str, rows: int, vocab: int) -> list[str]:
    """Every float32 [rows, vocab] shape in an HLO text (either dimension order, any layout)."""
    return re.findall(rf"f32\[(?:{rows},{vocab}|{vocab},{rows})\]", hlo)


def test_a_greedy_step_compiles_no_float32_rows_by_vocab_buffer(monkeypatch):
    monkeypatch.setattr(lm_head_argmax, "CHUNK_ELEMENTS", SMALL_CHUNKS)
    engine = tiny_engine("tiny-dense", fused_lm_head_argmax=True)
    try:
        engine.warmup()  # every forward, with its fused-argmax variant
        greedy = engine.runner.programs.executables("greedy_forward")
        full = engine.runner.programs.executables("forward")
        assert greedy and set(greedy) < set(full)  # a fused variant per layout but the context-logits one
        checked = 0
        for layout, exe in greedy.items():
            rows, vocab = full[layout].out_info[1].shape  # the full forward's logits [rows, V]
            # The outputs: no logits (None), int32 tokens.
            assert all(info.shape != (rows, vocab) for info in jax.tree_util.tree_leaves(exe.out_info))
            if vocab_chunk(rows, vocab) == vocab:  # few rows: one chunk is the whole vocabulary
                continue
            # No f32 [rows, V] anywhere inside, where the full forward of the layout has its logits.
            assert _f32_row_buffers(exe.as_text(), rows, vocab) == []
            assert _f32_row_buffers(full[layout].as_text(), rows, vocab)
            checked += 1
        assert checked
        # Greedy steps after warm-up run the fused variant and compile nothing.
        before = engine.runner.num_forward_variants
        tokens = _tokens(engine, random_prompts(3, 100, 3, 20, seed=5), SamplingParams(max_tokens=4, ignore_eos=True))
        assert all(len(t) == 4 for t in tokens) and engine.runner.fused_steps > 0
        assert engine.runner.num_forward_variants == before
    finally:
        engine.close()
