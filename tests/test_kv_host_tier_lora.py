"""The host KV tier with LoRA adapters: an adapter's blocks form its own prefix tree, on the host
too, so the same prompt with and without the adapter never shares KV; the outputs with the tier
on equal those with it off while blocks of both trees move between the tiers."""

from __future__ import annotations

import copy

import numpy as np

from jaxllm import LLM, KvCacheConfig, LoRARequest, SamplingParams

from engine_helpers import make_hf_model

VOCAB = 256


def _save_adapter(base, path):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.25)
    model.save_pretrained(path)


def test_adapter_and_base_prefixes_move_between_tiers_without_mixing(tmp_path):
    base = make_hf_model("llama", tmp_path / "base", VOCAB)
    _save_adapter(base, tmp_path / "kv")
    adapter = LoRARequest("kv", 1, str(tmp_path / "kv"))
    rng = np.random.default_rng(4)
    prefixes = [[int(t) for t in rng.integers(3, VOCAB, 40)] for _ in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = []
    for host in (None, "4MiB"):
        llm = LLM(
            str(tmp_path / "base"),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=64,
            max_seq_len=128,
            enable_lora=True,
            max_loras=1,
            max_lora_rank=4,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=96, host_cache_size=host),
            warmup="none",  # the compared runs compile what their steps need
        )
        tokens = []
        for wave in range(3):
            prompts = [p + [3 + wave] for p in prefixes] * 2
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[adapter] * 3 + [None] * 3)
            tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        stats = llm.get_stats(timeout=1)
        results.append((tokens, stats[-1]["kvCacheStats"] if stats else {}))
        llm.shutdown()
    (off, _), (on, stats_on) = results
    assert on == off
    assert any(a != b for a, b in zip(on[0][:3], on[0][3:])), "the adapter changes the tokens"
    assert stats_on.get("onboardedBlocks", 0) > 5
