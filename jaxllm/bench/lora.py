"""What serving LoRA adapters costs (`jaxllm bench lora`).

One workload (random prompts, greedy, EOS ignored) through `LLM.generate` in four runs,
each on a fresh, warmed-up engine, timed `--repeat` times (the fastest pass is reported):

* `off`: LoRA disabled (the base model's compiled step; the reference);
* `on, base`: LoRA enabled, every request on the base model (what enabling LoRA costs the
  requests without an adapter: the masked low-rank update of every projection);
* `on, N adapters`: requests spread round-robin over N random adapters (and the base model),
  N <= max_loras, so every adapter stays resident;
* `on, swapping`: more adapters than slots, so slots are evicted and rewritten mid-run.

Adapters are random, in the Hugging Face PEFT layout (written here with safetensors), of
rank `--rank` on every supported projection. Compilations after warm-up are counted (JAX's
backend-compile events): they should be 0 in every run.

    jaxllm bench lora --model tiny-dense --requests 32 --adapters 4 --max-loras 4 --rank 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxllm.bench.request_metrics import counting_compiles

_MODULES = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}


@dataclass
class LoraRun:
    name: str
    requests: int
    output_tokens: int
    seconds: float
    compiles_after_warmup: int
    slot_loads: int
    slot_evictions: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def write_random_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A random PEFT adapter of `rank` on every projection `config`'s layers let LoRA adapt."""
    from safetensors.numpy import save_file

    from jaxllm.lora.adapter import layer_targets, target_dims

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in layer_targets(config, layer):
            block, module = _MODULES[target]
            d_in, d_out = target_dims(config, target)
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, d_in**-0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (d_out, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    modules = sorted({_MODULES[t][1] for layer in range(config.num_layers) for t in layer_targets(config, layer)})
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules})
    )
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _run(name: str, args, prompts, adapters, enable_lora: bool) -> LoraRun:
    from jaxllm import LLM, KvCacheConfig, SamplingParams

    llm = LLM(
        args.model,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.input_len + args.output_len + 8,
        enable_lora=enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.rank,
        kv_cache_config=KvCacheConfig(tokens_per_block=16),
    )
    try:
        llm.executor.call_on_engine(lambda e: e.warmup(all_variants=False), timeout=3600)
        with counting_compiles() as compiles:
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
            seconds = float("inf")
            for _ in range(args.repeat):  # the best of `repeat` passes (the machine may be shared)
                started = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters if enable_lora else None)
                seconds = min(seconds, time.perf_counter() - started)
        loads, evictions = llm.executor.call_on_engine(
            lambda e: (e.lora_slots.loads, e.lora_slots.evictions) if e.lora_slots is not None else (0, 0)
        )
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return LoraRun(name, len(prompts), tokens, seconds, len(compiles), loads, evictions)
    finally:
        llm.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxllm bench lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-dense", help="a dense model (preset, directory or Hub id)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-num-tokens", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=4, help="adapters of the resident run (<= --max-loras)")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (also max_lora_rank)")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["off", "base", "resident", "swapping"],
        choices=["off", "base", "resident", "swapping"],
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per run; the fastest is reported")
    parser.add_argument("--report-json", default=None)
    args = parser.parse_args(argv)
    if args.adapters > args.max_loras:
        parser.error("--adapters must be <= --max-loras (the swapping run uses 2 x --max-loras adapters)")

    from jaxllm import LoRARequest
    from jaxllm.models import load_model_config
    from jaxllm.models.resolve import resolve_model

    config = load_model_config(resolve_model(args.model))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, args.input_len).tolist() for _ in range(args.requests)]
    runs: list[LoraRun] = []
    with tempfile.TemporaryDirectory(prefix="jaxllm-bench-lora-") as tmp:
        pool = []
        for i in range(2 * args.max_loras):
            write_random_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)
            pool.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        # round-robin over the adapters and the base model (None)
        resident = [([*pool[: args.adapters], None])[i % (args.adapters + 1)] for i in range(args.requests)]
        swapping = [pool[i % len(pool)] for i in range(args.requests)]
        plan = {
            "off": ("off", [None] * args.requests, False),
            "base": ("on, base", [None] * args.requests, True),
            "resident": (f"on, {args.adapters} adapters + base", resident, True),
            "swapping": (f"on, {len(pool)} adapters / {args.max_loras} slots", swapping, True),
        }
        for key in args.runs:
            name, adapters, enable = plan[key]
            runs.append(_run(name, args, prompts, adapters, enable))
            print(f"  {name}: {runs[-1].tokens_per_second:.1f} tok/s", flush=True)
    reference = runs[0].tokens_per_second
    print(
        f"\nLoRA cost: {args.model}, {args.requests} requests x ({args.input_len} in, {args.output_len} out), "
        f"rank {args.rank}, max_loras {args.max_loras}, max_batch_size {args.max_batch_size}"
    )
    print(f"{'run':<32} {'out tok/s':>10} {'vs first':>9} {'seconds':>8} {'compiles':>9} {'loads':>6} {'evictions':>9}")
    # compiles: after warm-up, over every pass; loads / evictions: adapter slot writes, over every pass
    for r in runs:
        print(
            f"{r.name:<32} {r.tokens_per_second:>10.1f} {r.tokens_per_second / reference:>8.2f}x {r.seconds:>8.2f} "
            f"{r.compiles_after_warmup:>9} {r.slot_loads:>6} {r.slot_evictions:>9}"
        )
    if args.report_json:
        Path(args.report_json).write_text(
            json.dumps([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in runs], indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
