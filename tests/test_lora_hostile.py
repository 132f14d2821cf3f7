"""Hostile LoRA adapters: each is refused with a ValueError naming the problem, quickly, and
afterwards the engine serves the same greedy canary as before. One slot's non-finite
weights (crafted past the load checks) cannot reach the rows of other slots or the base model.
"""

from __future__ import annotations

import json
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, KvCacheConfig, LoRARequest, SamplingParams
from jaxllm.lora import patterns
from jaxllm.lora.adapter import target_dims
from jaxllm.models.decoder import lora_delta

CANARY_PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def served():
    llm = LLM(
        "tiny-dense",
        max_batch_size=4,
        max_num_tokens=16,
        max_seq_len=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512),
        warmup="none",  # the tests compile what their steps need
    )
    config = llm.executor.call_on_engine(lambda e: e.model_config)
    canary = llm.generate(CANARY_PROMPT, GREEDY, use_tqdm=False).outputs[0].token_ids
    yield llm, config, canary
    llm.shutdown()


def _write_adapter(path, config, *, peft=None, a=None, prefix="base_model.model.model") -> None:
    from safetensors.numpy import save_file

    d_in, d_out = target_dims(config, "q")
    rng = np.random.default_rng(0)
    a = rng.normal(0, 0.1, (2, d_in)).astype(np.float32) if a is None else a
    tensors = {
        Q_A.replace("base_model.model.model", prefix): a,
        Q_B.replace("base_model.model.model", prefix): rng.normal(0, 0.1, (d_out, 2)).astype(np.float32),
    }
    path.mkdir()
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**base, **(peft or {})}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _nan_a(config):
    a = np.full((2, target_dims(config, "q")[0]), 0.01, np.float32)
    a[1, 3] = np.nan
    return a


CASES = {
    "nan_weight": (dict(a=_nan_a), "holds non-finite values or values above 10000"),
    "huge_weight": (dict(a=lambda c: np.full((2, target_dims(c, "q")[0]), 1e30, np.float32)), "values above 10000"),
    "alpha_1e38": (dict(peft={"lora_alpha": 1e38}), "scaling (lora_alpha / r) is 5e+37; it must be finite"),
    "alpha_nan": (dict(peft={"lora_alpha": float("nan")}), "positive finite 'lora_alpha', got nan"),
    "alpha_inf": (dict(peft={"lora_alpha": float("inf")}), "positive finite 'lora_alpha', got inf"),
    "r_inf": (dict(peft={"r": float("inf")}), "positive integer 'r', got inf"),
    "r_fraction": (dict(peft={"r": 2.5}), "positive integer 'r', got 2.5"),
    "rank_pattern_list": (dict(peft={"rank_pattern": ["q_proj"]}), "rank_pattern must map module patterns"),
    "alpha_pattern_bad_regex": (dict(peft={"alpha_pattern": {"(q_proj": 4}}), "alpha_pattern pattern '(q_proj'"),
    "rank_pattern_float": (dict(peft={"rank_pattern": {"q_proj": 2.5}}), "rank_pattern['q_proj'] must be a positive"),
    "alpha_pattern_inf": (dict(peft={"alpha_pattern": {"q_proj": float("inf")}}), "alpha_pattern['q_proj'] must be"),
    "rank_pattern_long": (dict(peft={"rank_pattern": {"q" * 300: 2}}), "pattern of 300 characters (at most 256)"),
    "catastrophic_regex": (
        dict(peft={"rank_pattern": {"(a+)+$": 2}}, prefix="a" * 60),
        "rank_pattern pattern '(a+)+$' has a repeated group holding a repeat",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_adapter_is_refused_and_the_canary_is_unchanged(served, tmp_path, case):
    llm, config, canary = served
    spec, message = CASES[case]
    spec = dict(spec)
    if callable(spec.get("a")):
        spec["a"] = spec["a"](config)
    _write_adapter(tmp_path / case, config, **spec)
    lora_id = 100 + list(CASES).index(case)
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(
            CANARY_PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest(case, lora_id, str(tmp_path / case))
        )
    assert time.monotonic() - start < 1.0
    assert llm.generate(CANARY_PROMPT, GREEDY, use_tqdm=False).outputs[0].token_ids == canary


def test_valid_rank_pattern_still_applies(served, tmp_path):
    llm, config, canary = served
    _write_adapter(tmp_path / "ok", config, peft={"r": 4, "rank_pattern": {r"layers\.0\.self_attn\.q_proj": 2}})
    out = llm.generate(CANARY_PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest("ok", 90, str(tmp_path / "ok")))
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert llm.generate(CANARY_PROMPT, GREEDY, use_tqdm=False).outputs[0].token_ids == canary


def test_nested_quantifier_check():
    for bad in ["(a+)+$", "(a*)*", "(x|a+){2,}", "((ab)+)+", r"(\w+\.)+q_proj"]:
        assert patterns.has_nested_quantifier(bad), bad
    for ok in ["q_proj", r"layers\.1\.self_attn\.o_proj", "(q|k)_proj", "(a+)?", "[(+]+", r"\(a+\)+", "a+b*"]:
        assert not patterns.has_nested_quantifier(ok), ok


def test_pattern_matching_is_time_bounded(monkeypatch):
    """A pattern that passes the structural check but still backtracks is stopped by the
    child interpreter's time bound."""
    monkeypatch.setattr(patterns, "MATCH_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(ValueError, match="took over 0.5 s"):
        patterns.match_patterns({"rank_pattern": {"(a|a)*$": 2}}, ["a" * 40 + "!"], "lora_path 'x'")
    assert time.monotonic() - start < 5
    assert patterns.match_patterns({"rank_pattern": {"q_proj": 2, "proj": 3}}, ["m.q_proj", "m.v_proj", "xq_proj"], "")[
        "rank_pattern"
    ] == {"m.q_proj": "q_proj", "m.v_proj": None, "xq_proj": None}


def test_nan_in_one_slot_leaves_other_rows_unchanged():
    rng = np.random.default_rng(1)
    slots, d_in, rank, d_out = 3, 16, 4, 12
    a = rng.normal(size=(slots, d_in, rank)).astype(np.float32)
    b = rng.normal(size=(slots, rank, d_out)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(4, d_in)).astype(np.float32))
    slot_of_row = jnp.asarray([0, 1, -1, 2])
    onehot = (slot_of_row[:, None] == jnp.arange(slots)[None, :]).astype(jnp.float32)
    clean = np.asarray(lora_delta(x, {"a": jnp.asarray(a), "b": jnp.asarray(b)}, onehot, None))
    bad_a, bad_b = a.copy(), b.copy()
    bad_a[1, 2, 0], bad_b[1, 0, 3] = np.nan, np.inf
    hit = np.asarray(lora_delta(x, {"a": jnp.asarray(bad_a), "b": jnp.asarray(bad_b)}, onehot, None))
    for row in (0, 2, 3):  # other slots and the base-model row
        assert np.isfinite(hit[row]).all()
        np.testing.assert_array_equal(hit[row], clean[row])
    assert np.all(hit[2] == 0)
    np.testing.assert_allclose(clean[0], np.asarray(x)[0] @ a[0] @ b[0], rtol=1e-5, atol=1e-5)
