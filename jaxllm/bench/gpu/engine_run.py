"""Section 4: the engine end to end in bf16 on random-weight models of real shapes, cut to a
few layers, with the Pallas backends and the XLA backends in the same run.

For each model and backend one `LLMEngine` is built (weights from a random-weight
directory, `random_models`), warmed up (every token bucket compiled, greedy sampler), and
driven on this thread (`jaxllm.bench.throughput.run_engine`: requests admitted up to the
concurrency, EOS ignored, greedy) at each concurrency with one request per slot. Reported:
output tokens/s, TTFT and inter-token latency (`jaxllm.bench.request_metrics.summarize`), host
ms per step and device idle between steps (`jaxllm.bench.host_overhead.DeviceWatcher`:
time from one step's device work ending to the next forward being enqueued), compiles
during the timed runs, warm-up time with the time each compiled piece became ready
(token buckets compile on the engine's compile threads, so these are completion times,
not per-bucket compile times when several compile at once) and the mean compile seconds
per program; the weight bytes and KV cache bytes the engine allocated next to the
device's peak memory in use (`memory_stats`; a process-wide peak, so it also covers
earlier sections: the bytes in use after the build are given too).

Models on a GPU: Llama-3-8B with 4 layers, Qwen3-30B-A3B with 4 layers, DeepSeek-V3 with
2 layers (both MLA; the first dense, the second MoE with its 256 routed experts cut to
32). The dry run runs one tiny MoE model the same way.
"""

from __future__ import annotations

import functools
import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxllm.bench.dataset import BenchRequest
from jaxllm.bench.gpu.random_models import write_model_dir
from jaxllm.bench.gpu.report import SectionContext, Table
from jaxllm.bench.host_overhead import DeviceWatcher
from jaxllm.bench.request_metrics import counting_compiles, summarize
from jaxllm.bench.throughput import run_engine


@dataclass(frozen=True)
class EngineModel:
    name: str
    hf_config: dict[str, Any]


@dataclass(frozen=True)
class EnginePlan:
    models: tuple[EngineModel, ...]
    backends: tuple[str, ...]
    concurrencies: tuple[int, ...]
    input_len: int
    output_len: int
    max_num_tokens: int
    tokens_per_block: int


_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA_3_8B = EngineModel(
    "Llama-3-8B (4 layers)",
    {
        **_ROPE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "attention_bias": False,
    },
)
QWEN3_30B_A3B = EngineModel(
    "Qwen3-30B-A3B (4 layers)",
    {
        **_ROPE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
    },
)
DEEPSEEK_V3 = EngineModel(
    "DeepSeek-V3 (2 MLA layers: 1 dense + 1 MoE, 32 of 256 experts)",
    {
        **_ROPE,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
)
TINY_MOE = EngineModel(
    "tiny Qwen3-MoE (1 layer)",
    {
        **_ROPE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 512,
        "attention_bias": False,
    },
)


def plan(dry_run: bool) -> EnginePlan:
    if dry_run:
        return EnginePlan((TINY_MOE,), ("pallas", "xla"), (1, 4), 8, 4, 16, 16)
    return EnginePlan((LLAMA_3_8B, QWEN3_30B_A3B, DEEPSEEK_V3), ("pallas", "xla"), (1, 16, 64, 256), 128, 64, 2048, 16)


def _tree_bytes(tree: Any) -> int:
    return int(sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree_util.tree_leaves(tree)))


def _memory() -> dict[str, Any]:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may report nothing
        stats = {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def _requests(count: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(
            task_id=i, output_tokens=output_len, input_ids=rng.integers(3, min(vocab, 1000), input_len).tolist()
        )
        for i in range(count)
    ]


def build_engine(model_dir: Path, backend: str, p: EnginePlan) -> tuple[Any, dict[str, Any]]:
    """(the warmed-up engine, build facts: seconds, compile times, bytes)."""
    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    max_batch = max(p.concurrencies)
    max_seq_len = -(-(p.input_len + p.output_len) // p.tokens_per_block) * p.tokens_per_block
    config = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        max_batch_size=max_batch,
        max_num_tokens=p.max_num_tokens,
        max_seq_len=max_seq_len,
        attention_backend=backend,
        moe_backend=backend,
        compile_cache=False,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=p.tokens_per_block, max_tokens=max_batch * max_seq_len, enable_block_reuse=False
        ),
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - start
    ready: list[float] = []
    warm_start = time.perf_counter()
    engine.warmup(all_variants=False, progress=lambda done, total: ready.append(time.perf_counter() - warm_start))
    runner = engine.runner
    facts = dict(
        load_s=load_s,
        warmup_s=time.perf_counter() - warm_start,
        token_buckets=engine.token_buckets(),
        ready_at_s=[round(t, 2) for t in ready],
        programs=runner.num_compiled_variants,
        mean_compile_s=runner.compile_seconds / max(1, runner.num_compiled_variants),
        weight_bytes=_tree_bytes(runner.params),
        kv_cache_bytes=_tree_bytes(runner.kv_cache),
        attention_backend=engine.attention_backend,
        moe_backend=engine.moe_backend,
        memory_after_build=_memory(),
    )
    return engine, facts


def measure(engine: Any, concurrency: int, p: EnginePlan, seed: int) -> dict[str, Any]:
    requests = _requests(concurrency, p.input_len, p.output_len, engine.model_config.vocab_size, seed)
    engine.reset_timing()
    watcher = DeviceWatcher()
    engine.on_dispatch = watcher
    with counting_compiles() as compiles:
        start = time.perf_counter()
        records = run_engine(engine, requests, concurrency=concurrency, detokenize=False, progress=False)
        wall = time.perf_counter() - start
    engine.on_dispatch = None
    watcher.close()
    gaps = watcher.idle_gaps()
    summary = summarize(records, wall_time=wall)
    t = engine.timing
    return dict(
        concurrency=concurrency,
        requests=len(records),
        failed=summary["num_failed"],
        seconds=wall,
        output_tok_s=summary["output_token_throughput"],
        ttft_ms_p50=summary["ttft_ms"]["p50"],
        ttft_ms_p90=summary["ttft_ms"]["p90"],
        itl_ms_p50=summary["itl_ms"]["p50"],
        itl_ms_p90=summary["itl_ms"]["p90"],
        steps=t.steps,
        host_ms_per_step=1e3 * t.host_seconds / max(1, t.steps),
        idle_ms_per_step=1e3 * sum(gaps) / max(1, len(gaps)),
        idle_share=sum(gaps) / wall if wall else None,
        compiles_during_run=len(compiles),
        memory=_memory(),
    )


BUILD_COLUMNS = (
    "load_s",
    "warmup_s",
    "buckets",
    "programs",
    "mean_compile_s",
    "ready_at_s",
    "weights_gb",
    "kv_cache_gb",
    "in_use_after_build_gb",
)
RUN_COLUMNS = (
    "concurrency",
    "output_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "itl_ms_p50",
    "itl_ms_p90",
    "host_ms_per_step",
    "idle_ms_per_step",
    "compiles",
    "peak_gb",
    "weights_plus_kv_gb",
)


def _gb(n: Any) -> Any:
    return None if n is None else n / 1e9


def run_model(ctx: SectionContext, model: EngineModel, p: EnginePlan, work: Path) -> None:
    start = time.perf_counter()
    model_dir = write_model_dir(work / model.name.split()[0], model.hf_config, seed=0)
    write_s = time.perf_counter() - start
    for backend in p.backends:
        ctx.check_time(f"{model.name} with {backend}")
        ctx.run_case(
            f"{model.name} with {backend}", functools.partial(run_backend, ctx, model, backend, p, model_dir, write_s)
        )


def run_backend(
    ctx: SectionContext, model: EngineModel, backend: str, p: EnginePlan, model_dir: Path, write_s: float
) -> None:
    engine, facts = build_engine(model_dir, backend, p)
    try:
        ctx.data.setdefault("builds", []).append(dict(model=model.name, backend=backend, write_s=write_s, **facts))
        label = f"{model.name}, {backend} backends (attention {facts['attention_backend']}, MoE {facts['moe_backend']})"
        ctx.table(f"{label}: build", BUILD_COLUMNS).add(
            load_s=facts["load_s"],
            warmup_s=facts["warmup_s"],
            buckets=" ".join(map(str, facts["token_buckets"])),
            programs=facts["programs"],
            mean_compile_s=facts["mean_compile_s"],
            ready_at_s=" ".join(map(str, facts["ready_at_s"])),
            weights_gb=_gb(facts["weight_bytes"]),
            kv_cache_gb=_gb(facts["kv_cache_bytes"]),
            in_use_after_build_gb=_gb(facts["memory_after_build"]["bytes_in_use"]),
        )
        runs: Table = ctx.table(f"{label}: runs ({p.input_len} in / {p.output_len} out tokens, greedy)", RUN_COLUMNS)
        for concurrency in p.concurrencies:
            ctx.check_time(f"{model.name} {backend} concurrency {concurrency}")
            row = measure(engine, concurrency, p, seed=concurrency)
            ctx.data.setdefault("runs", []).append(dict(model=model.name, backend=backend, **row))
            runs.add(
                concurrency=concurrency,
                output_tok_s=row["output_tok_s"],
                ttft_ms_p50=row["ttft_ms_p50"],
                ttft_ms_p90=row["ttft_ms_p90"],
                itl_ms_p50=row["itl_ms_p50"],
                itl_ms_p90=row["itl_ms_p90"],
                host_ms_per_step=row["host_ms_per_step"],
                idle_ms_per_step=row["idle_ms_per_step"],
                compiles=row["compiles_during_run"],
                peak_gb=_gb(row["memory"]["peak_bytes_in_use"]),
                weights_plus_kv_gb=_gb(facts["weight_bytes"] + facts["kv_cache_bytes"]),
            )
    finally:
        engine.close()
        del engine
        gc.collect()  # the next engine's KV budget counts on this one's buffers being freed


def run(ctx: SectionContext) -> None:
    p = plan(ctx.options.dry_run)
    ctx.data.update(
        input_len=p.input_len,
        output_len=p.output_len,
        max_num_tokens=p.max_num_tokens,
        tokens_per_block=p.tokens_per_block,
        concurrencies=list(p.concurrencies),
        models={m.name: m.hf_config for m in p.models},
    )
    with tempfile.TemporaryDirectory(prefix="jaxllm-bench-gpu-") as tmp:
        for model in p.models:
            ctx.check_time(model.name)
            run_model(ctx, model, p, Path(tmp))
