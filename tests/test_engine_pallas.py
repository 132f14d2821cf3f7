"""The Pallas backends (interpret mode on CPU) give the same greedy tokens as the XLA ones."""

from __future__ import annotations

from engine_helpers import make_hf_model, random_prompts
from jaxllm import LLM, KvCacheConfig, SamplingParams

VOCAB = 256


def test_pallas_backends_match_xla_backends(tmp_path):
    make_hf_model("qwen3_moe", tmp_path, VOCAB)
    prompts = random_prompts(3, VOCAB, 3, 40, seed=21)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(str(tmp_path), max_batch_size=4, max_num_tokens=32, max_seq_len=128,
                  attention_backend=backend, moe_backend=backend,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512))
        assert llm.engine.attention_backend == backend and llm.engine.moe_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["pallas"] == tokens["xla"]
