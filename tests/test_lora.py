"""LoRA adapters against Hugging Face PEFT on a tiny random Llama checkpoint.

Three random adapters of different ranks and targets (one with rsLoRA scaling) are saved
with PEFT; one batch mixing them with the base model must give, token for token, the
greedy tokens of PEFT's models (teacher forcing), with fewer device slots than adapters so
the scheduler makes a request wait for a slot and slots are evicted and rewritten. Swapping
adapters in and out compiles nothing after warm-up.
"""

from __future__ import annotations

import copy
import json
import re
import shutil

import numpy as np
import pytest

from jaxllm import LLM, KvCacheConfig, LoRARequest, SamplingParams

from engine_helpers import hf_teacher_forcing_check, make_hf_model, random_prompts

VOCAB = 384
ADAPTERS = {  # name: (r, lora_alpha, use_rslora, target modules, per-module rank / alpha)
    "qv": (4, 8, False, ["q_proj", "v_proj"], {}),
    "all": (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
    "out": (
        2,
        4,
        False,
        ["o_proj", "up_proj", "down_proj"],
        dict(rank_pattern={"down_proj": 4}, alpha_pattern={r"layers\.1\.self_attn\.o_proj": 12}),
    ),
}


def _save_adapter(base, path, r, alpha, rslora, targets, patterns, seed):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0, **patterns),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.25)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_hf_model("llama", root / "base", VOCAB)
    peft_models, requests = {}, {}
    for i, (name, (r, alpha, rslora, targets, patterns)) in enumerate(ADAPTERS.items()):
        peft_models[name] = _save_adapter(base, root / name, r, alpha, rslora, targets, patterns, seed=10 + i)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    llm = LLM(
        str(root / "base"),
        max_batch_size=4,
        max_num_tokens=16,
        max_seq_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
    )
    yield root, base, peft_models, requests, llm
    llm.shutdown()


def test_mixed_adapter_batch_matches_peft(lora_setup):
    _, base, peft_models, requests, llm = lora_setup
    prompts = random_prompts(7, VOCAB, 4, 30, seed=1)
    prompts[4] = list(prompts[0])  # the base model and adapter "qv" on one prompt: no shared prefix KV
    names = ["qv", "all", "out", None, None, "all", "qv"]
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=8, ignore_eos=True),
        use_tqdm=False,
        lora_request=[None if n is None else requests[n] for n in names],
    )
    base_outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, name, out, base_out in zip(prompts, names, outs, base_outs):
        tokens = out.outputs[0].token_ids
        hf_teacher_forcing_check(base if name is None else peft_models[name], prompt, tokens)
        if name is None:
            assert tokens == base_out.outputs[0].token_ids
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, base_outs))
    # three adapters, two slots: one request waited for a slot that a finished request freed
    stats = llm.executor.call_on_engine(lambda e: (e.lora_slots.loads, e.lora_slots.evictions))
    assert stats[0] >= 3 and stats[1] >= 1, stats


def test_swapping_adapters_compiles_nothing(lora_setup):
    import jax.monitoring

    root, _, peft_models, requests, llm = lora_setup
    shutil.copytree(root / "out", root / "out2")  # a new id: read from disk after warm-up too
    requests = {**requests, "out2": LoRARequest("out2", 4, str(root / "out2"))}
    peft_models = {**peft_models, "out2": peft_models["out"]}
    llm.executor.call_on_engine(lambda e: e.warmup(all_variants=False), timeout=300)
    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    before = llm.executor.call_on_engine(lambda e: (e.lora_slots.loads, e.runner.num_compiled_variants))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = random_prompts(6, VOCAB, 3, 20, seed=2)
        order = ["out", "qv", "all", "out2", "qv", "all"]
        for start in range(0, 6, 2):  # two adapters at a time, so each round evicts the oldest
            names = order[start : start + 2]
            outs = llm.generate(
                prompts[start : start + 2],
                SamplingParams(max_tokens=4, ignore_eos=True),
                use_tqdm=False,
                lora_request=[requests[n] for n in names],
            )
            for prompt, name, out in zip(prompts[start : start + 2], names, outs):
                hf_teacher_forcing_check(peft_models[name], prompt, out.outputs[0].token_ids)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    after = llm.executor.call_on_engine(lambda e: (e.lora_slots.loads, e.runner.num_compiled_variants))
    assert after[0] - before[0] >= 4, (before, after)  # adapters were written into slots again
    assert compiles == [] and after[1] == before[1]


def _write_tensors(path, tensors: dict, config: dict) -> None:
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_invalid_adapters_are_refused_and_the_engine_serves_on(lora_setup, tmp_path):
    root, base, peft_models, requests, llm = lora_setup
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    _save_adapter(base, tmp_path / "r16", 4, 4, False, ["q_proj"], dict(rank_pattern={"q_proj": 16}), seed=3)
    cases = {
        "r=16 of model.layers.0.self_attn.q_proj exceeds max_lora_rank (8)": LoRARequest(
            "r16", 40, str(tmp_path / "r16")
        ),
        "no such adapter directory": LoRARequest("missing", 41, str(tmp_path / "missing")),
    }
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}
    a = np.zeros((2, 64), np.float32)
    _write_tensors(
        tmp_path / "shape",
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((50, 2), np.float32),
        },
        config,
    )
    cases["an adapter for a different base model"] = LoRARequest("shape", 42, str(tmp_path / "shape"))
    _write_tensors(
        tmp_path / "head",
        {
            "base_model.model.lm_head.lora_A.weight": a,
            "base_model.model.lm_head.lora_B.weight": np.zeros((VOCAB, 2), np.float32),
        },
        config,
    )
    cases["not a LoRA target here"] = LoRARequest("head", 43, str(tmp_path / "head"))
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "adapter_config.json").write_text(json.dumps(config))
    cases["adapter_model.safetensors is missing"] = LoRARequest("nofile", 44, str(tmp_path / "nofile"))
    for message, request in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(prompt, params, use_tqdm=False, lora_request=request)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(tmp_path))
    out = llm.generate(prompt, params, use_tqdm=False, lora_request=requests["all"])
    hf_teacher_forcing_check(peft_models["all"], prompt, out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="lora_int_id 2 already names the adapter"):
        llm.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("again", 2, str(root / "qv")))

    plain = LLM(
        str(root / "base"),
        max_batch_size=2,
        max_num_tokens=16,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256),
    )
    try:
        with pytest.raises(ValueError, match="without LoRA support.*enable_lora=True"):
            plain.generate(prompt, params, use_tqdm=False, lora_request=requests["qv"])
    finally:
        plain.shutdown()


def test_server_selects_adapters_by_model_name(lora_setup):
    import httpx

    from jaxllm.cli.serve import parse_lora_modules
    from jaxllm.server.app import build_app
    from jaxllm.server.server_config import ServerConfig

    from server_helpers import LiveServer

    root, base, peft_models, requests, llm = lora_setup
    modules = parse_lora_modules([f"qv={root / 'qv'}", f"all={root / 'all'}"])
    assert modules["qv"] == requests["qv"] and modules["all"] == requests["all"]  # ids 1, 2 in order
    server = LiveServer(build_app(llm.executor, ServerConfig(served_model_name="base", lora_modules=modules)))
    prompt = [7, 21, 99, 4, 250]
    try:
        with httpx.Client(timeout=60) as http:
            listed = http.get(server.url + "/v1/models").json()["data"]
            assert [m["id"] for m in listed] == ["base", "qv", "all"]
            assert listed[1]["parent"] == "base" and listed[1]["root"] == str(root / "qv")
            for model, oracle in (("base:qv", peft_models["qv"]), ("all", peft_models["all"]), ("base", base)):
                r = http.post(
                    server.url + "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == model
                out = llm.generate(
                    prompt,
                    SamplingParams(max_tokens=4, ignore_eos=True),
                    use_tqdm=False,
                    lora_request=None if oracle is base else modules[model.split(":")[-1]],
                )
                hf_teacher_forcing_check(oracle, prompt, out.outputs[0].token_ids)
                assert r.json()["choices"][0]["text"] == out.outputs[0].text
            r = http.post(server.url + "/v1/completions", json={"model": "base:nope", "prompt": prompt})
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["param"] == "model" and error["type"] == "not_found_error" and "`qv`" in error["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_adapter_slots_are_a_scheduling_resource(policy):
    """One slot, two adapters: the second adapter's request waits (the base request behind it
    runs) until the first adapter's request ends; its slot is then rewritten. Base and adapter
    requests on one prompt never share prefix KV blocks."""
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.llm_args import SchedulerConfig
    from jaxllm.llm_request import LlmRequest
    from jaxllm.lora import LoraAdapter, LoraSlots
    from jaxllm.scheduler import make_scheduler

    kv = KVCacheManager(64, 4, 16, enable_block_reuse=True)
    slots = LoraSlots(1)
    scheduler = make_scheduler(SchedulerConfig(policy), kv, 4, 64, True, lora_slots=slots)
    adapters = [LoraAdapter(LoRARequest(n, i + 1, f"/{n}"), 1, 1.0, {}) for i, n in enumerate("ab")]
    prompt = list(range(3, 15))
    requests = [LlmRequest(i, prompt, 4) for i in range(3)]
    requests[0].lora_adapter, requests[1].lora_adapter = adapters
    out = scheduler.schedule_request(requests, set())
    assert [r.request_id for r in out.context_requests] == [0, 2]  # 1 waits for the slot 0 holds
    assert slots.take_loads() == [(0, adapters[0])] and slots.slot_of(requests[0]) == 0
    assert slots.slot_of(requests[2]) == -1
    kv.prepare_resources(out)
    for r in out.context_requests:  # the prompts are computed: their blocks join the prefix cache
        r.move_to_next_context_chunk()
        r.add_new_token(7)
    kv.prepare_resources(scheduler.schedule_request(requests, set()))
    requests[0].finish("length")
    kv.free_resources(requests[0])
    slots.release(requests[0])
    out = scheduler.schedule_request(requests, set())
    assert [r.request_id for r in out.context_requests] == [1]
    assert slots.take_loads() == [(0, adapters[1])] and slots.evictions == 1
    assert requests[1].prepopulated_prompt_len == 0  # adapter b reuses neither a's nor the base's KV
    late = LlmRequest(3, prompt, 4)  # another base request reuses the base request's prefix
    kv.add_sequence(late)
    assert late.prepopulated_prompt_len == 8


def test_beam_search_runs_every_beam_with_the_adapter(lora_setup):
    import torch

    _, _, peft_models, requests, llm = lora_setup
    prompt = [9, 31, 77, 120, 5, 64]
    params = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=5, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False, lora_request=requests["all"])
    with torch.no_grad():
        hf = peft_models["all"].generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=5,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert [c.token_ids for c in out.outputs] == [hf[i, len(prompt) :].tolist() for i in range(2)]
