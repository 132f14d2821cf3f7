"""The FP8 KV cache in the kernels, the planner and the engine.

- every attention backend (plain XLA reference, tiled XLA, the Triton kernel and its latent
  variant in interpret mode) reads a float8_e4m3fn cache, with the per-tensor scales folded
  into the queries and the output, as the reference reads the dequantized cache;
- `jaxllm plan --kv-cache-dtype fp8` / `plan_memory`: the KV bytes per token are those of the
  cache the engine allocates (same spec), a quarter of float32's;
- the engine with `KvCacheConfig(dtype="fp8")` and a host tier gives the tokens of the same
  engine without the tier, with the offloaded blocks moving as fp8 bytes;
- a bad `dtype` is a one-line ValueError; the CLI flag reaches the config.

Accuracy against Hugging Face transformers: `tests.test_fp8_kv_cache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_tier_workload import interleaved_prefixes

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.llm_args import KvCacheConfig
from jaxllm.models.kv_quant import FP8_KV, dequantize_kv, quantize_kv, scale_outputs, scale_queries
from jaxllm.models.memory_plan import plan_memory
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_latent_attention
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    ragged_paged_latent_attention_reference,
)
from pallas_kernels.ragged_paged_attention.tiled_xla import ragged_paged_attention_tiled
from sharding.mesh import ParallelConfig
from tests.conftest import tiny_engine

from engine_helpers import make_hf_model


def _problem(seed: int, num_kv_heads: int, head_dim: int, q_heads: int):
    """Two sequences (a 5-token prefill chunk over 12 cached tokens, one decode token over 9)
    over a shuffled page table: (q, fp8 k, fp8 v, metadata, k scale, v scale)."""
    rng = np.random.default_rng(seed)
    num_blocks, tpb = 16, 4
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(0.02)
    k = rng.normal(0, 4.0, (num_kv_heads, num_blocks, tpb, head_dim)).astype(np.float32)
    v = rng.normal(0, 3.0, (num_kv_heads, num_blocks, tpb, head_dim)).astype(np.float32)
    q = jnp.asarray(rng.normal(0, 1.0, (8, q_heads, head_dim)).astype(np.float32))
    tables = jnp.asarray(rng.permutation(num_blocks)[:8].reshape(2, 4), jnp.int32)
    md = (jnp.asarray([12, 9], jnp.int32), tables, jnp.asarray([0, 5, 6], jnp.int32), jnp.asarray([2], jnp.int32))
    return q, quantize_kv(jnp.asarray(k), k_scale), quantize_kv(jnp.asarray(v), v_scale), md, k_scale, v_scale


@pytest.mark.parametrize("backend", ["tiled_xla", "triton_interpret"])
def test_mha_backends_read_an_fp8_cache_as_the_reference_reads_it_dequantized(backend):
    q, k8, v8, md, ks, vs = _problem(0, num_kv_heads=2, head_dim=32, q_heads=4)
    assert k8.dtype == FP8_KV
    expected = ragged_paged_attention_reference(
        q, dequantize_kv(k8, ks, jnp.float32), dequantize_kv(v8, vs, jnp.float32), *md, sm_scale=0.2
    )
    kernel = {
        "tiled_xla": ragged_paged_attention_tiled,
        "triton_interpret": lambda *a, **kw: ragged_paged_attention(*a, interpret=True, **kw),
    }[backend]
    got = scale_outputs(kernel(scale_queries(q, ks), k8, v8, *md, sm_scale=0.2), vs)
    assert np.abs(np.asarray(expected)).max() > 0.1
    np.testing.assert_allclose(np.asarray(got)[:6], np.asarray(expected)[:6], rtol=1e-5, atol=1e-5)
    # The plain reference takes the fp8 cache the same way.
    plain = scale_outputs(ragged_paged_attention_reference(scale_queries(q, ks), k8, v8, *md, sm_scale=0.2), vs)
    np.testing.assert_allclose(np.asarray(plain)[:6], np.asarray(expected)[:6], rtol=1e-5, atol=1e-5)


def test_latent_kernel_reads_an_fp8_latent_cache_as_the_reference_reads_it_dequantized():
    q, k8, _, md, ks, _ = _problem(1, num_kv_heads=1, head_dim=24, q_heads=4)
    latent8 = k8[0]  # [num_blocks, tpb, latent_dim]
    expected = ragged_paged_latent_attention_reference(
        q, dequantize_kv(latent8, ks, jnp.float32), *md, sm_scale=0.3, value_dim=16
    )
    got = ragged_paged_latent_attention(scale_queries(q, ks), latent8, *md, sm_scale=0.3, value_dim=16, interpret=True)
    np.testing.assert_allclose(np.asarray(scale_outputs(got, ks))[:6], np.asarray(expected)[:6], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,latent", [(512, False), (64, False), (64, True)])
def test_triton_kernel_with_an_fp8_cache_lowers_for_cuda(num_tokens, latent):
    """bf16 queries over an fp8 cache (Llama-8B heads; DeepSeek-V3's 576-wide latent), the
    MLIR verifier run on the Triton module (a prefill bucket, a decode bucket with splits)."""
    import functools

    from tests.test_kernels import _attention_specs, _lower_for_cuda

    specs = list(_attention_specs(num_tokens, 64, 128, 32, 8, 128, 16, 4096, jnp.bfloat16))
    if latent:
        s = jax.ShapeDtypeStruct
        fn = functools.partial(ragged_paged_latent_attention, sm_scale=0.1, value_dim=512)
        _lower_for_cuda(fn, s((num_tokens, 16, 576), jnp.bfloat16), s((4096, 16, 576), FP8_KV), *specs[3:])
    else:
        specs[1] = specs[2] = jax.ShapeDtypeStruct(specs[1].shape, FP8_KV)
        _lower_for_cuda(functools.partial(ragged_paged_attention, sm_scale=128**-0.5), *specs)


def test_kernel_refuses_a_cache_of_another_float_dtype():
    q, k8, v8, md, _, _ = _problem(2, num_kv_heads=2, head_dim=32, q_heads=4)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ragged_paged_attention(q, k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), *md, sm_scale=1.0, interpret=True)


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_plan_kv_bytes_equal_the_fp8_cache_the_engine_allocates(model):
    engine = tiny_engine(model, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, dtype="fp8"))
    try:
        leaves = jax.tree.leaves(engine.runner.kv_cache)
        assert leaves and all(a.dtype == FP8_KV for a in leaves)
        allocated = sum(a.nbytes for a in leaves)
        plan = plan_memory(engine.model_config, ParallelConfig())
        assert plan.kv_bytes_per_token * engine.kv_cache_manager.num_blocks * 8 == allocated
        float_plan = plan_memory(engine.model_config, ParallelConfig(), kv_dtype="float32")
        assert float_plan.kv_bytes_per_token == 4 * plan.kv_bytes_per_token
    finally:
        engine.close()


def test_plan_cli_kv_cache_dtype_fp8_doubles_the_tokens_of_bf16(capsys):
    from jaxllm.cli.plan import main as plan_main

    args = ["--model", "deepseek-v3", "--tp", "8", "--ep", "8", "--gpu", "h200", "--dtype", "bfloat16"]
    assert plan_main(args) == 0
    bf16 = capsys.readouterr().out
    assert plan_main(args + ["--kv-cache-dtype", "fp8"]) == 0
    fp8 = capsys.readouterr().out
    assert f"{61 * 576 * 2} bytes/token/device (bfloat16)" in bf16
    assert f"{61 * 576} bytes/token/device (float8_e4m3fn)" in fp8

    def tokens(out: str) -> int:
        return int(out.split(" tokens fit")[0].split()[-1].replace(",", ""))

    assert tokens(fp8) in (2 * tokens(bf16), 2 * tokens(bf16) + 1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_fp8kv")
    make_hf_model("qwen3", path, 256)
    return path


def _engine(path, host):
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_batch_size=8,
            max_num_tokens=64,
            max_seq_len=128,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=160, host_cache_size=host, dtype="fp8"),
        )
    )


def test_host_tier_and_prefix_reuse_keep_the_tokens_with_an_fp8_cache(qwen3):
    workload = dict(num_prefixes=6, prefix_len=48, waves=3, vocab=256)
    off = _engine(qwen3, None)
    tokens_off = interleaved_prefixes(off, **workload)
    on = _engine(qwen3, 4 << 20)
    tokens_on = interleaved_prefixes(on, **workload)
    assert tokens_on == tokens_off
    stats = on.iteration_stats[-1]["kvCacheStats"]
    assert stats["onboardedBlocks"] > 20 and stats["reusedBlocks"] > 20
    host = on.kv_cache_manager.host_tier
    leaves = jax.tree.leaves(on.runner.kv_cache)
    # One byte per cached value: a block is 2 (K, V) x layers x heads x 8 tokens x head_dim bytes.
    config = on.model_config
    assert host.bytes_per_block == 2 * config.num_layers * config.num_kv_heads * 8 * config.head_dim
    assert all(a.dtype == FP8_KV for a in leaves)
    on.kv_cache_manager.check_invariants()


def test_bad_kv_cache_dtype_is_one_line_and_the_cli_flag_reaches_the_config():
    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs

    with pytest.raises(ValueError, match=r"kv_cache_config.dtype must be one of .*'fp8'.* got 'int4'"):
        KvCacheConfig(dtype="int4")
    assert KvCacheConfig(dtype="fp8_e4m3").dtype == "fp8" and KvCacheConfig().dtype == "auto"
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_config"].dtype == "fp8"


def test_plan_cli_int4_weights(capsys):
    from jaxllm.cli.plan import main as plan_main

    assert plan_main(["--model", "tiny-dense", "--quantization", "int4", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights int4 (scales per 1x32 block)" in out and "(float8_e4m3fn)" in out


def test_mla_engine_with_an_fp8_latent_cache(tmp_path):
    """DeepSeek-V3 (MLA) in the engine with an FP8 latent cache: in-flight batching (mixed
    prefill and absorbed decode steps, prefix reuse) gives the tokens of one request at a time,
    and the latent pool is the planner's bytes."""
    pytest.importorskip("torch")
    from tests.parallel_workload import small_engine
    from tests.test_deepseek import ENGINE, _engine_outputs, staggered_prompts, write_checkpoint

    write_checkpoint(tmp_path / "ds", ENGINE, seed=3, tokenizer=True)
    engine = small_engine(
        tmp_path / "ds", tmp_path / "ds", kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, dtype="fp8")
    )
    try:
        leaves = jax.tree.leaves(engine.runner.kv_cache)
        assert all(a.dtype == FP8_KV for a in leaves)
        plan = plan_memory(engine.model_config, ParallelConfig())
        assert plan.kv_bytes_per_token * engine.kv_cache_manager.num_blocks * 8 == sum(a.nbytes for a in leaves)
        arrivals = staggered_prompts(ENGINE["vocab_size"])
        batched = _engine_outputs(engine, arrivals, max_tokens=6)
        assert engine.kv_cache_manager.get_kv_cache_stats().reused_blocks > 0
        alone = {}
        for p in [p for step in sorted(arrivals) for p in arrivals[step]]:
            alone.update(_engine_outputs(engine, {0: [p]}, max_tokens=6))
        assert [batched[i] for i in sorted(batched)] == [alone[i] for i in sorted(alone)]
    finally:
        engine.close()
