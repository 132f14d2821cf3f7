"""Structured output (`SamplingParams.guided_decoding`) on a tiny random checkpoint: its free
text is garbage, so every constraint shows. Outputs are checked by oracles the project did not
write (jsonschema, re.fullmatch, llguidance's own numpy mask application) and against the
engine without the feature (unconstrained rows of a mixed batch)."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llnp
import numpy as np
import pytest

from jaxllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from jaxllm.engine.guided_matchers import GuidedMatchers
from jaxllm.sampling.guided import compile_grammar, grammar_cache_info
from jaxllm.sampling.sampler import apply_token_bitmask

from conftest import tiny_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 10000, "maximum": 99999}, "ok": {"type": "boolean"}},
            "required": ["zip", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_seq_len=256)


def _run(engine, prompts_and_params):
    requests = [engine.add_request(p, sp) for p, sp in prompts_and_params]
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def _text(engine, request) -> str:
    return engine.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------- parameters
def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="guided_decoding.choice"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError, match="guided_decoding must be"):
        SamplingParams(guided_decoding={"json": {}})
    with pytest.raises(ValueError, match="guided_decoding is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, guided_decoding=GuidedDecodingParams(regex="a+"))


@pytest.mark.parametrize(
    "guided,field",
    [
        (GuidedDecodingParams(json={"type": "nonsense"}), "guided_decoding.json"),
        (GuidedDecodingParams(json="{not json"), "guided_decoding.json"),
        (GuidedDecodingParams(regex="a(b"), "guided_decoding.regex"),
        (GuidedDecodingParams(grammar="start: undefined_rule"), "guided_decoding.grammar"),
        (GuidedDecodingParams(structural_tag={"structures": []}), "guided_decoding.structural_tag"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(engine, guided, field):
    with pytest.raises(ValueError, match=re.escape(field) + ": "):
        compile_grammar(guided)
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, guided_decoding=guided))
    assert engine.guided.num_active == 0


def test_structural_tags_compile():
    tag = {
        "structures": [{"begin": "<f=add>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f="],
    }
    assert "<f=" in compile_grammar(GuidedDecodingParams(structural_tag=tag))


def test_grammars_are_cached_by_their_text():
    schema = {"type": "object", "properties": {"cached": {"type": "integer"}, "b": {"type": "string"}}}
    compile_grammar(GuidedDecodingParams(json=schema))
    before = grammar_cache_info().hits
    compile_grammar(GuidedDecodingParams(json=schema))
    compile_grammar(GuidedDecodingParams(json=json.dumps(schema, indent=2)))
    assert grammar_cache_info().hits == before + 2
    # Property order is the output's order: another order is another grammar.
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    assert compile_grammar(GuidedDecodingParams(json=reordered)) != compile_grammar(GuidedDecodingParams(json=schema))


def test_json_keys_come_in_the_schema_order(engine):
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}},
        "required": ["zeta", "alpha"],
    }
    (request,) = _run(
        engine, [([5, 6], SamplingParams(max_tokens=30, guided_decoding=GuidedDecodingParams(json=schema)))]
    )
    assert list(json.loads(_text(engine, request))) == ["zeta", "alpha"]


def test_requests_that_cannot_end_are_refused(engine):
    guided = GuidedDecodingParams(regex="[a-z]+")
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request([5, 6], SamplingParams(max_tokens=4, ignore_eos=True, guided_decoding=guided))
    with pytest.raises(ValueError, match="end_id"):
        engine.add_request([5, 6], SamplingParams(max_tokens=4, end_id=-1, guided_decoding=guided))
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request([5, 6], SamplingParams(max_tokens=4, min_tokens=2, guided_decoding=guided))


# ---------------------------------------------------------------------------- the mask
def test_bitmask_matches_llguidance_applied_on_the_host():
    rng = np.random.default_rng(0)
    S, V = 4, 70
    logits = rng.normal(size=(S, V)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(S, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    expected = logits.copy()
    llnp.apply_token_bitmask_inplace(expected, bitmask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), bitmask))
    np.testing.assert_array_equal(got, expected)


def test_mask_covers_a_model_vocabulary_larger_than_the_tokenizer(engine):
    tokenizer = engine.tokenizer
    vocab = len(tokenizer) + 100  # padded embedding rows, as many checkpoints have
    matchers = GuidedMatchers(tokenizer, vocab, engine.eos_ids)
    request = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex=".*"))
    )
    try:
        mask = matchers.fill([None, request], 3)
    finally:
        engine.abort_request(request.request_id)
    assert mask.shape == (3, (vocab + 31) // 32) and mask.dtype == np.int32
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert bits[0].all() and bits[2].all()  # rows without a grammar: untouched
    assert not bits[1, len(tokenizer) :].any()  # ids past the tokenizer's: never allowed
    assert bits[1, : len(tokenizer)].sum() > len(tokenizer) // 2  # ".*" allows most tokens
    assert all(bits[1, e] for e in request.end_ids)  # ".*" accepts at once: the end ids are allowed


# ---------------------------------------------------------------------------- generation
def test_constrained_outputs_follow_their_constraints(engine):
    cases = [
        (GuidedDecodingParams(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (GuidedDecodingParams(json=json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (GuidedDecodingParams(regex=r"[a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t) or 1 / 0),
        (GuidedDecodingParams(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue") or 1 / 0),
        (GuidedDecodingParams(json_object=True), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
        (
            GuidedDecodingParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
            lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t) or 1 / 0,
        ),
    ]
    cases.append(
        (
            GuidedDecodingParams(grammar='root ::= "yes" | "no" | "maybe"'),
            lambda t: t in ("yes", "no", "maybe") or 1 / 0,
        )
    )
    batch = []
    for i, (guided, _) in enumerate(cases):
        for sampled in (False, True):
            temperature = 1.0 if sampled else None
            params = SamplingParams(max_tokens=160, temperature=temperature, seed=i, guided_decoding=guided)
            batch.append(([3 + i, 9, 4, 17 + i], params))
    requests = _run(engine, batch)
    for request, (_, params) in zip(requests, batch):
        text = _text(engine, request)
        assert request.finish_reason == "stop", (params.guided_decoding, text)
        check = cases[[c[0] for c in cases].index(params.guided_decoding)][1]
        check(text)
    assert engine.guided.num_active == 0


def test_unconstrained_rows_are_unchanged_by_constrained_ones(engine):
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    alone = _run(engine, [(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts])
    alone_tokens = [list(r.output_token_ids) for r in alone]
    guided = SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    mixed = _run(
        engine,
        [(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True)), ([5, 6, 7], guided)]
        + [(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts[1:]]
        + [([8, 9], guided)],
    )
    free = [mixed[0], mixed[2], mixed[3]]
    assert [list(r.output_token_ids) for r in free] == alone_tokens


def test_a_constrained_request_sits_out_every_other_step_and_the_others_keep_pace(engine):
    """Under the overlap scheduler a constrained request's mask needs its previous token, so it
    runs every other step while the free requests get a token every step; alone, it runs every
    step (each step is read back before the next)."""
    assert engine.overlap
    free = [engine.add_request([5, 6, 7 + i], SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(3)]
    guided = engine.add_request(
        [5, 6, 9], SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex="[a-z]{300}"))
    )
    for _ in range(20):
        engine.step()
    engine.planner.materialize_tokens()
    assert all(len(r.output_token_ids) == 20 for r in free)  # one token per step (the last in flight)
    assert 9 <= len(guided.output_token_ids) <= 11
    while engine.has_unfinished_requests():
        engine.step()
    assert guided.finish_reason == "length" and len(guided.output_token_ids) == 40
    assert re.fullmatch("[a-z]+", _text(engine, guided))


def test_max_tokens_inside_an_unfinished_structure_is_length(engine):
    (request,) = _run(
        engine, [([5, 6, 7], SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(json=SCHEMA)))]
    )
    assert request.finish_reason == "length"
    assert len(request.output_token_ids) == 3
    assert _text(engine, request).startswith("{")
    assert engine.guided.num_active == 0


def test_aborting_a_constrained_request_frees_its_matcher(engine):
    request = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=50, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    )
    for _ in range(3):
        engine.step()
    assert engine.guided.num_active == 1
    engine.abort_request(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.guided.num_active == 0


def test_logprobs_of_constrained_tokens_are_the_models(engine):
    guided = GuidedDecodingParams(choice=["alpha", "beta"])
    (request,) = _run(engine, [([5, 6, 7], SamplingParams(max_tokens=10, logprobs=1, guided_decoding=guided))])
    assert _text(engine, request) in ("alpha", "beta")
    assert np.isfinite(request.cumulative_logprob) and request.cumulative_logprob < 0


# ---------------------------------------------------------------------------- the LLM API
def test_llm_generate_with_guided_decoding():
    with pytest.raises(ValueError, match="guided_decoding_backend"):
        LLM("tiny-moe", guided_decoding_backend="xgrammar", warmup="none")
    llm = LLM(
        "tiny-moe",
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
        guided_decoding_backend="llguidance",
        warmup="none",
    )
    try:
        params = SamplingParams(max_tokens=160, guided_decoding=GuidedDecodingParams(json=SCHEMA))
        outputs = llm.generate(["a person:", "another one:"], params)
        for out in outputs:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        with pytest.raises(ValueError, match="guided_decoding.regex"):
            llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="(")))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("required", [True, False], ids=["deepseek_r1", "qwen3"])
def test_constraint_applies_after_the_reasoning(required):
    """With a reasoning span the thinking is free text up to the first `</think>` (required, as
    DeepSeek-R1's prompt opens it; optional `<think>...</think>`, as Qwen3 writes it), then the
    schema holds. Checked with llguidance's own matcher on reference strings, the answer part
    with jsonschema."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from jaxllm.models import materialize_preset
    from jaxllm.sampling.guided import ReasoningSpan

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tokenizer = AutoTokenizer.from_pretrained(str(materialize_preset("tiny-moe")))
    grammar = compile_grammar(GuidedDecodingParams(json=schema, reasoning=ReasoningSpan(required=required)))

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    cases = {
        'I weigh it up.</think>\n\n{"a": 12}': required,
        '<think>Let me see { "a": x }</think> {"a": 3}': True,
        '{"a": 12}': not required,
        'so</think> and </think>{"a": 1}': False,  # the first </think> ends the thinking
        '<think>no answer</think>{"b": 1}': False,
    }
    for text, expected in cases.items():
        assert accepted(text) == expected, text
        if expected:
            jsonschema.validate(json.loads(text.rpartition("</think>")[2] or text), schema)
