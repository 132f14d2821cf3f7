"""The Pallas backends (interpret mode on CPU) give the same greedy tokens as the XLA ones."""

from __future__ import annotations

from jaxllm import LLM, KvCacheConfig, SamplingParams

from engine_helpers import make_hf_model, random_prompts

VOCAB = 256


def test_pallas_backends_match_xla_backends(tmp_path):
    make_hf_model("qwen3_moe", tmp_path, VOCAB)
    prompts = random_prompts(3, VOCAB, 3, 40, seed=21)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        with LLM(
            str(tmp_path),
            max_batch_size=4,
            max_num_tokens=32,
            max_seq_len=128,
            attention_backend=backend,
            moe_backend=backend,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512),
            warmup="none",  # greedy: only the programs the steps run compile, no sampler variants
        ) as llm:  # stopped at the end: an idle engine compiles its remaining programs
            assert llm.engine.attention_backend == backend and llm.engine.moe_backend == backend
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["pallas"] == tokens["xla"]


def test_pallas_moe_layer_uses_the_fused_kernel_under_a_mesh(monkeypatch):
    """The engine's MoE layer (on a one-device mesh, as the engine runs it) takes the kernel that
    gathers rows and combines in place, and matches the sorted-rows XLA reference path."""
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels.moe_grouped_gemm as moe_kernels
    from jaxllm.models.backends import resolve_backends
    from jaxllm.models.moe import grouped_expert_ffn
    from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
    from sharding.kernels import shard_moe
    from sharding.mesh import ParallelConfig, make_mesh
    from sharding.rules import ShardingRules

    calls = []
    fused = moe_kernels.moe_fused_ffn
    monkeypatch.setattr(moe_kernels, "moe_fused_ffn", lambda *a, **k: calls.append(1) or fused(*a, **k))
    _, _, _, moe_fn = resolve_backends("xla", "pallas")
    mesh = make_mesh(ParallelConfig())
    sharded = shard_moe(moe_fn, mesh, ShardingRules())
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 32)), jnp.float32)
    ids = jnp.asarray(np.argsort(rng.standard_normal((6, 8)), axis=1)[:, :2], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(6, 2)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) / 6, jnp.float32) for s in ((8, 32, 48), (8, 32, 48), (8, 48, 32))]
    valid = jnp.asarray([True] * 5 + [False])
    out = grouped_expert_ffn(x, ids, weights, *w, moe_fn=sharded, valid=valid)
    ref = grouped_expert_ffn(x, ids, weights, *w, moe_fn=moe_grouped_ffn_reference, valid=valid)
    assert calls, "the fused kernel was not called"
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
