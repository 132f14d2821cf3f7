"""`jaxllm bench`: the benchmark registry and its dispatcher."""

from __future__ import annotations

import importlib
import importlib.util
import sys

# `jaxllm bench NAME ...` runs jaxllm.bench.<module>.main(argv)
BENCHMARKS = {
    "throughput": "jaxllm.bench.throughput",
    "latency": "jaxllm.bench.latency",
    "serve": "jaxllm.bench.serve_client",
    "engine": "jaxllm.bench.engine_vs_hf",
    "scheduler": "jaxllm.bench.scheduler_overhead",
    "host": "jaxllm.bench.host_overhead",
    "startup": "jaxllm.bench.startup",
    "kernels": "jaxllm.bench.kernels",
    "xla-kernels": "jaxllm.bench.xla_kernels",
    "eplb": "jaxllm.bench.eplb",
    "ep": "jaxllm.bench.ep",
    "eplb-online": "jaxllm.bench.eplb_online",
    "multihost": "jaxllm.bench.multihost",
    "mla": "jaxllm.bench.mla",
    "compile": "jaxllm.bench.compile_time",
    "lora": "jaxllm.bench.lora",
    "beam": "jaxllm.bench.beam",
    "logits": "jaxllm.bench.logits",
    "lm-head": "jaxllm.bench.lm_head",
    "structured": "jaxllm.bench.structured",
    "gpu": "jaxllm.bench.gpu",
    "quant": "jaxllm.bench.quant",
    "kv-tier": "jaxllm.bench.kv_tier",
    "spec": "jaxllm.bench.spec",
    "disagg": "jaxllm.bench.disagg",
    "kv-transfer": "jaxllm.bench.kv_transfer",
    "settings": "jaxllm.bench.new_settings",
}
BENCHMARK_HELP = {
    "spec": "speculative decoding (--method ngram) next to the same engine without it on a workload whose "
    "output repeats its input: tokens/s, speed-up and acceptance length at concurrency 1/8/32",
    "disagg": "disaggregated vs aggregated serving on real worker processes: ITL p50/p99 of decoding requests "
    "while long prompts arrive, side by side; KV transfer time and bytes per request",
    "kv-transfer": "the KV hand-over between two processes over TCP, shared memory and jax.experimental.transfer "
    "side by side: ms per hand-over (median, p90), MiB/s, ratio to TCP",
    "settings": "a greedy stream's worst inter-token gap while requests with new sampling settings arrive, "
    "next to the engine that compiles each sampler variant on the step; compiles on the engine thread",
    "kv-tier": "multi-turn chat on a device KV pool too small for every conversation: the host KV tier off, "
    "on and an unbounded pool side by side (prefill tokens, TTFT p50/p99, tokens/s, bytes moved)",
    "structured": "structured output's cost: tokens/s and host ms per step with no, one and every request "
    "of a batch following a JSON schema; grammar compile time cold and cached",
    "quant": "FP8 weights (weights-only, dynamic FP8 activations), int8/int4 weights and an FP8 KV cache next "
    "to the float model: weight and KV bytes, teacher-forced top-1 agreement, decode tokens/s",
    "gpu": "the GPU acceptance run: environment and roofline, kernel correctness and speed, engine end to end, "
    "numerics against CPU (--dry-run: CPU rehearsal)",
    "lm-head": "a greedy step's LM head with the fused argmax next to full float32 logits: ms per call, "
    "ratio, logits bytes per step, same tokens",
    "logits": "what one request asking for logits outputs or a logits post-processor costs a batch: tokens/s "
    "per kind, compiles after warm-up",
    "beam": "beam search (k beams sharing KV blocks, copy on write) next to n=k sampled sequences: tokens/s, "
    "peak KV blocks with and without sharing, block copies, compiles after warm-up",
    "lora": "LoRA serving cost: tokens/s with LoRA off, on for base-model requests, with resident adapters "
    "and with more adapters than slots (compiles after warm-up counted)",
    "throughput": "offline throughput: a synthetic dataset through the engine, executor or LLM.generate "
    "(output tokens/s, TTFT/ITL)",
    "latency": "TTFT, inter-token latency and tok/s at concurrency 1, 4 and 16 next to HF and to no decode buckets",
    "serve": "load generator for a running `jaxllm serve` (all at once, fixed concurrency or Poisson rate)",
    "engine": "LLM.generate tokens/s next to Hugging Face generate on the same weights (needs torch: the test extra)",
    "scheduler": "host time of one scheduling step (schedulers, KV block manager, step packing), no model",
    "host": "host time and device idle time per engine step with N requests decoding (overlap on and off)",
    "startup": "seconds from `jaxllm serve` to healthy (empty and populated compilation cache); first TTFTs",
    "kernels": "Pallas attention and MoE kernels against their peers and the device's ceilings (GPU; "
    "--smoke runs tiny shapes on CPU)",
    "xla-kernels": "the plain-XLA attention and MoE kernels (the CPU backends) next to their references at a "
    "model's decode and prefill shapes: CPU ms per call, compile s",
    "eplb": "expert placement on a skewed (Zipf) routing workload: imbalance before and after greedy, "
    "hierarchical and balanced EPLB, on held-out iterations (host only)",
    "ep": "expert-parallel model step time per dispatch mode (all_to_all, allgather) and token bucket, next "
    "to one device and TP only (8 CPU devices by default)",
    "eplb-online": "the online expert load balancer on EP MoE layers while the hot experts switch: imbalance "
    "over time (--plot PNG), recovery, placement / update / step time, bytes moved (8 CPU devices)",
    "multihost": "per-step cost of sending the step plan to the other processes of a multi-host run (bytes, "
    "encode and send time) next to the step time, for 1, 2 and 4 local processes and each channel",
    "mla": "DeepSeek-V3-shaped decode tokens/s with absorbed vs expanded latent attention; latent vs full KV "
    "bytes per token",
    "compile": "trace + compile time of the model forward at several depths: layers under lax.scan next to "
    "the unrolled per-layer loop (shapes only, nothing loaded)",
}


def main(argv: list[str]) -> int:
    """`jaxllm bench NAME ...`: list the benchmarks, or run one (its module is imported only then)."""
    lines = [f"  {name:<11} {BENCHMARK_HELP[name]}" for name in BENCHMARKS]
    usage = "usage: jaxllm bench NAME [options]   (jaxllm bench NAME --help for its options)\n\nbenchmarks:\n"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n".join(lines))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"jaxllm bench: unknown benchmark {name!r}\n" + usage + "\n".join(lines), file=sys.stderr)
        return 2
    wants_help = any(a in ("-h", "--help") for a in rest)
    if name == "engine" and not wants_help and "--skip-hf" not in rest and importlib.util.find_spec("torch") is None:
        print(
            "jaxllm bench engine compares against Hugging Face generate, which needs torch: "
            "pip install -e '.[test]' (or pass --skip-hf)",
            file=sys.stderr,
        )
        return 2
    return int(importlib.import_module(BENCHMARKS[name]).main(rest) or 0)
