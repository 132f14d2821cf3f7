"""Hostile input, compile-freedom after warm-up and step-level fault isolation of the engine.

One engine (a one-layer random Qwen3-MoE, token buckets 16/32/64) serves every test of
this module; it is warmed up once, so nothing here compiles after the fixture.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, KvCacheConfig, SamplingParams
from jaxllm.engine import planner
from jaxllm.sampling import MAX_LOGPROBS, SUPPRESS_WIDTH, SamplingTensors

from engine_helpers import make_hf_model, random_prompts

VOCAB = 384
BIG = 2**40
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CANARY = [11, 12, 13, 14, 15]
CANARY_PARAMS = dict(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_1layer")
    make_hf_model("qwen3_moe", path, VOCAB, num_layers=1)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(
        str(model_dir),
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048),
        decode_batch_sizes=[1, 2],  # two decode buckets (of the default four): each compiles 13 samplers
        warmup="all",  # every bucket and sampler variant before the constructor returns
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def canary_tokens(llm):
    return llm.generate(CANARY, SamplingParams(**CANARY_PARAMS), use_tqdm=False).outputs[0].token_ids


def on_engine(llm, fn):
    return llm.executor.call_on_engine(fn, timeout=60)


def assert_engine_healthy(llm, canary_tokens):
    assert llm.executor.is_healthy
    out = llm.generate(CANARY, SamplingParams(**CANARY_PARAMS), use_tqdm=False).outputs[0]
    assert out.token_ids == canary_tokens
    assert on_engine(llm, lambda e: (len(e.active), e.kv_cache_manager.get_kv_cache_stats().used_num_blocks)) == (0, 0)


# ----------------------------------------------------------------------------- hostile input
def _mutated(**fields):
    """Params valid at construction whose fields are changed afterwards (admission re-checks)."""
    params = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


# (how to submit, argument, field the ValueError must name)
HOSTILE = [
    # SamplingParams: strict types, ranges, int32
    ("params", dict(max_tokens="16"), "max_tokens"),
    ("params", dict(max_tokens=True), "max_tokens"),
    ("params", dict(max_tokens=0), "max_tokens"),
    ("params", dict(max_tokens=BIG), "max_tokens"),
    ("params", dict(max_tokens=2.0), "max_tokens"),
    ("params", dict(min_tokens=-1), "min_tokens"),
    ("params", dict(min_tokens=5, max_tokens=4), "min_tokens"),
    ("params", dict(n="2"), "n"),
    ("params", dict(n=0), "n"),
    ("params", dict(n=100_000), "n"),
    ("params", dict(n=2, best_of=1), "best_of"),
    ("params", dict(temperature="0.5"), "temperature"),
    ("params", dict(temperature=float("nan")), "temperature"),
    ("params", dict(temperature=True), "temperature"),
    ("params", dict(temperature=10**400), "temperature"),
    ("params", dict(top_k=True), "top_k"),
    ("params", dict(top_k=BIG), "top_k"),
    ("params", dict(top_k=-2), "top_k"),
    ("params", dict(top_p=0.0), "top_p"),
    ("params", dict(top_p="1"), "top_p"),
    ("params", dict(min_p=1.5), "min_p"),
    ("params", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("params", dict(presence_penalty=3.0), "presence_penalty"),
    ("params", dict(frequency_penalty=float("inf")), "frequency_penalty"),
    ("params", dict(seed=-1), "seed"),
    ("params", dict(seed=2**64), "seed"),
    ("params", dict(seed="7"), "seed"),
    ("params", dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    ("params", dict(logprobs=True), "logprobs"),
    ("params", dict(prompt_logprobs=-1), "prompt_logprobs"),
    ("params", dict(truncate_prompt_tokens=8), "truncate_prompt_tokens"),
    ("params", dict(return_generation_logits=1), "return_generation_logits"),
    ("params", dict(logits_post_processor_name=""), "logits_post_processor_name"),
    ("params", dict(stop_token_ids=[BIG], min_tokens=1), "stop_token_ids"),
    ("params", dict(stop_token_ids=["5"]), "stop_token_ids"),
    ("params", dict(stop_token_ids=[True]), "stop_token_ids"),
    ("params", dict(stop_token_ids=5), "stop_token_ids"),
    ("params", dict(bad_token_ids=[BIG]), "bad_token_ids"),
    ("params", dict(bad_token_ids=[-1]), "bad_token_ids"),
    ("params", dict(end_id=BIG, min_tokens=1), "end_id"),
    ("params", dict(end_id=-2), "end_id"),
    ("params", dict(pad_id="0"), "pad_id"),
    ("params", dict(stop=""), "stop"),
    ("params", dict(bad=[7]), "bad"),
    ("params", dict(ignore_eos="yes"), "ignore_eos"),
    ("params", dict(use_beam_search=True, temperature=0.5), "temperature"),
    ("params", dict(use_beam_search=True, n=9), "use_beam_search"),
    ("params", dict(logits_processor=5), "logits_processor"),
    # limits that depend on the model, checked at admission
    ("submit", dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ("submit", dict(bad_token_ids=[VOCAB + 5]), "bad_token_ids"),
    ("submit", dict(end_id=VOCAB), "end_id"),
    ("submit", dict(min_tokens=2, stop_token_ids=list(range(3, 3 + SUPPRESS_WIDTH + 1))), "stop_token_ids"),
    ("submit", dict(bad_token_ids=list(range(3, 3 + SUPPRESS_WIDTH + 1))), "bad_token_ids"),
    ("submit", dict(logits_post_processor_name="unregistered"), "logits_post_processor_name"),
    ("submit", dict(max_tokens=255), "max_seq_len"),
    # fields changed after construction
    ("mutated", dict(bad_token_ids=[BIG]), "bad_token_ids"),
    ("mutated", dict(end_id=BIG, min_tokens=1), "end_id"),
    ("mutated", dict(max_tokens="4"), "max_tokens"),
    ("mutated", dict(stop_token_ids=[VOCAB + 1]), "stop_token_ids"),
    # generate_async arguments
    ("priority", "high", "priority"),
    ("priority", True, "priority"),
    ("priority", float("nan"), "priority"),
    ("priority", None, "priority"),
    ("prompt", [], "prompt"),
    ("prompt", [5, VOCAB], "prompt_token_ids"),
    ("prompt", [5, -1], "prompt_token_ids"),
    ("prompt", [True, False], "prompt_token_ids"),
    ("prompt", [5, 6.0], "prompt"),
    # engine.add_request arguments (what the executor and server call)
    ("engine", dict(prompt_token_ids=np.array([1.5, 2.5])), "prompt_token_ids"),
    ("engine", dict(prompt_token_ids=np.zeros((2, 2), np.int32)), "prompt_token_ids"),
    ("engine", dict(prompt_token_ids="hello"), "prompt_token_ids"),
    ("engine", dict(sampling_params={"max_tokens": 4}), "sampling_params"),
    ("engine", dict(priority="high"), "priority"),
    ("engine", dict(sequence_index=-1), "sequence_index"),
    ("engine", dict(arrival_time="now"), "arrival_time"),
    ("engine", dict(request_id="7"), "request_id"),
]


def _submit(llm, how, arg):
    if how == "params":
        SamplingParams(max_tokens=arg.pop("max_tokens", 4), **arg)
    elif how == "submit":
        llm.generate_async([5, 6, 7], SamplingParams(**{"max_tokens": 4, **arg})).result(timeout=60)
    elif how == "mutated":
        llm.generate_async([5, 6, 7], _mutated(**arg)).result(timeout=60)
    elif how == "priority":
        llm.generate_async("hello", SamplingParams(max_tokens=4), priority=arg).result(timeout=60)
    elif how == "prompt":
        llm.generate_async(arg, SamplingParams(max_tokens=4)).result(timeout=60)
    elif how == "engine":
        kwargs = {"prompt_token_ids": [5, 6, 7], "sampling_params": SamplingParams(max_tokens=4), **arg}
        on_engine(llm, lambda e: e.add_request(**kwargs))
    else:
        raise AssertionError(how)


def test_hostile_inputs_are_refused_naming_the_field(llm, canary_tokens):
    assert len(HOSTILE) >= 40
    for how, arg, field in HOSTILE:
        arg = dict(arg) if isinstance(arg, dict) else arg
        with pytest.raises(ValueError, match=field):
            _submit(llm, how, arg)
    # the engine refuses a request id that is still in use
    blocker = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    busy_id = on_engine(llm, lambda e: next(iter(e.active)))
    with pytest.raises(ValueError, match="request_id"):
        on_engine(llm, lambda e: e.add_request([5, 6], SamplingParams(max_tokens=2), request_id=busy_id))
    blocker.abort()
    blocker.result(timeout=60)
    assert_engine_healthy(llm, canary_tokens)


def test_accepted_inputs_are_normalised(llm, canary_tokens):
    validate = llm.engine.validate_request  # reads only the engine's fixed limits: any thread
    admitted = validate(np.array(CANARY, np.int64), SamplingParams(max_tokens=4), priority=np.float32(2.5))
    assert admitted.prompt_token_ids == CANARY and all(type(t) is int for t in admitted.prompt_token_ids)
    assert admitted.priority == 2.5 and type(admitted.priority) is float
    params = SamplingParams(max_tokens=np.int64(6), stop_token_ids=np.array([7, 8]), ignore_eos=True)
    assert params.stop_token_ids == [7, 8] and type(params.max_tokens) is int
    # exactly SUPPRESS_WIDTH banned ids fit, and end ids do not count when ignore_eos is set
    ids = list(range(3, 3 + SUPPRESS_WIDTH))
    validate([5], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=ids, ignore_eos=True))
    with pytest.raises(ValueError, match="stop_token_ids"):
        validate([5], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=ids))
    out = llm.generate(
        CANARY, SamplingParams(max_tokens=6, ignore_eos=True, min_tokens=6, stop_token_ids=ids), use_tqdm=False
    ).outputs[0]
    assert len(out.token_ids) == 6 and not set(out.token_ids) & set(ids)
    assert_engine_healthy(llm, canary_tokens)


# ----------------------------------------------------------------------------- no compiles
def test_no_compilation_after_warmup(llm, canary_tokens):
    buckets = on_engine(llm, lambda e: e.token_buckets())
    assert buckets == [16, 32, 64]
    variants = on_engine(llm, lambda e: (e.runner.num_forward_variants, e.runner.num_sampler_variants))
    sizes = on_engine(llm, lambda e: e.program_warmup.decode_sizes())
    rows = on_engine(llm, lambda e: {e.num_sampler_rows, *sizes})
    assert sizes  # the small decode buckets: a forward each, and each sampler variant for their rows
    # Every bucket x forward and the context-logits forward of the largest (any prompt asking for
    # its logits runs in it); the 12 sampler variants and the general one (grammar rows) per row count.
    assert variants == (len(buckets) + len(sizes) + 1, 13 * len(rows))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    before = on_engine(llm, lambda e: dict(e.runner.steps_per_bucket))
    rng = np.random.default_rng(0)
    prompts = random_prompts(12, VOCAB, 1, 150, seed=31) + [list(range(3, 23)), list(range(3, 100))]
    features = [
        dict(),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=5, seed=2),
        dict(temperature=1.0, top_p=0.7, seed=3),
        dict(temperature=0.9, min_p=0.1, seed=4),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.5, frequency_penalty=0.5, temperature=0.7),
        dict(logprobs=3),
        dict(logprobs=0, temperature=1.0, top_k=3, top_p=0.9),
        dict(bad_token_ids=[5, 6, 7]),
        dict(bad=["hello world"], min_tokens=3, stop_token_ids=[9]),
        dict(n=2, temperature=1.0, seed=5),
        dict(n=2, best_of=3, temperature=1.0),
        dict(logprobs=MAX_LOGPROBS, repetition_penalty=1.1),
    ]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 12)), **f) for f in features]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        streamed = list(
            llm.generate_async(
                list(range(200, 225)),  # 25 new tokens alone: the 32 bucket
                SamplingParams(max_tokens=5, temperature=0.5, seed=9),
                streaming=True,
            )
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(o.outputs[0].token_ids for o in outs) and streamed
    assert len(outs[11].outputs) == 2 and len(outs[12].outputs) == 2
    after = on_engine(llm, lambda e: dict(e.runner.steps_per_bucket))
    ran = {b for b in after if after[b] > before.get(b, 0)}  # steps_per_bucket: by tokens per step
    # Prompt chunks in token buckets 32 and 64, decode steps in decode buckets (decode steps of
    # 8 rows or fewer no longer run in token bucket 16).
    assert {32, 64} <= ran and len(ran & set(sizes)) >= 2, (before, after)
    assert compiles == [], f"{len(compiles)} XLA compilations after warm-up"
    assert on_engine(llm, lambda e: e.runner.num_compiled_variants) == sum(variants)
    assert_engine_healthy(llm, canary_tokens)


# ----------------------------------------------------------------------------- fault isolation
def test_a_failure_while_building_a_step_fails_only_its_request(llm, canary_tokens, monkeypatch):
    prompts = random_prompts(4, VOCAB, 5, 40, seed=41)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    # Fault 1: the batch builder raises on one request's first (context) step.
    poisoned_prompt = [7, 7, 7, 7, 7, 7, 7, 7, 7]
    build_step_batch = planner.build_step_batch

    def faulty_build_step_batch(output, *args, **kwargs):
        if any(r.prompt_token_ids[:9] == poisoned_prompt for r in output.context_requests):
            raise RuntimeError("injected batch-building fault")
        return build_step_batch(output, *args, **kwargs)

    # Fault 2: the sampling tensors raise for another request in the middle of its generation.
    # (Its logprobs make its steps take the general SamplingTensors.build path; plain rows are
    # gathered from per-slot arrays instead.)
    poisoned_params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    build = SamplingTensors.build

    def faulty_build(cls, rows, num_generated, *args, **kwargs):
        for p, n in zip(rows, num_generated):
            if p is poisoned_params and n >= 3:
                raise RuntimeError("injected sampling fault")
        return build(rows, num_generated, *args, **kwargs)

    monkeypatch.setattr(planner, "build_step_batch", faulty_build_step_batch)
    monkeypatch.setattr(SamplingTensors, "build", classmethod(faulty_build))
    results = [llm.generate_async(p, params) for p in prompts[:2]]
    bad_context = llm.generate_async(poisoned_prompt + [1, 2], params)
    bad_generation = llm.generate_async(prompts[3][:-1], poisoned_params)
    results += [llm.generate_async(p, params) for p in prompts[2:]]
    with pytest.raises(RuntimeError, match="injected batch-building fault"):
        bad_context.result(timeout=60)
    with pytest.raises(RuntimeError, match="injected sampling fault"):
        bad_generation.result(timeout=60)
    assert [r.result(timeout=60).outputs[0].token_ids for r in results] == reference
    monkeypatch.undo()
    assert_engine_healthy(llm, canary_tokens)
