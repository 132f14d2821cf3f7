"""`jaxllm plan`: will this model fit this layout? Per-device weight bytes by kind, the KV cache
tokens that fit beside them, from config.json alone (no weights are read).

    jaxllm plan --model deepseek-ai/DeepSeek-V3 --tp 8 --ep 8 --gpu h200
    jaxllm plan --model ./my-model --tp 2 --quantization fp8 --kv-cache-dtype fp8

Exit status 0 when the layout fits (the weights leave room for at least one sequence of
`--max-seq-len` tokens), 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from jaxllm.cli.args import DEQUANTIZE_ON_LOAD, ArgumentParser, HelpFormatter
from jaxllm.models.known_configs import KNOWN_CONFIGS
from jaxllm.models.kv_quant import kv_storage_dtype, with_kv_cache_dtype
from jaxllm.models.memory_plan import GPU_MEMORY_BYTES, MemoryPlan, plan_memory
from jaxllm.models.model_config import ModelConfig, load_model_config
from jaxllm.models.quantized_loading import describe_weights, with_dequantize_on_load, with_quantization
from sharding.mesh import ParallelConfig

GB = 2**30


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="jaxllm plan", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--model",
        required=True,
        help=f"a model directory, its config.json, a preset, or a known name ({', '.join(KNOWN_CONFIGS)})",
    )
    p.add_argument(
        "--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1, help="devices the model spans"
    )
    p.add_argument(
        "--ep", "--ep-size", "--moe-expert-parallel-size", dest="ep", type=int, default=None, help="expert parallelism"
    )
    p.add_argument("--gpu", choices=sorted(GPU_MEMORY_BYTES), default="h200", help="device memory per GPU")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs in all (a multiple of --tp; default --tp)")
    p.add_argument(
        "--quantization",
        choices=["fp8", "int8", "int4", "none"],
        default=None,
        help="fp8: weights in FP8 with 128x128 block scales; int8 / int4: weight-only with one scale per 32 "
        "inputs (GGUF Q8_0 / Q4_0); none: the checkpoint's float dtype even if it ships quantized (default: as "
        "the checkpoint is)",
    )
    p.add_argument(
        "--dequantize-on-load",
        default="auto",
        choices=list(DEQUANTIZE_ON_LOAD),
        help="GGUF / AWQ / GPTQ integer weights: on: planned in float, as an engine dequantizing them at load "
        "holds them; off / auto (a GPU's default): kept quantized",
    )
    p.add_argument("--dtype", default=None, help="float dtype of unquantized weights and the KV cache")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="auto: the KV cache in the model's dtype; fp8: float8_e4m3fn (one byte per value)",
    )
    p.add_argument("--free-gpu-memory-fraction", type=float, default=0.9, help="share of free memory for KV")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--num-slots", type=int, default=None, help="MoE expert slots per layer (default: one per expert)")
    return p


def load_config(model: str, dtype: Optional[str]) -> ModelConfig:
    """The model's config from a directory, a config.json, a preset or the known-model table."""
    if model in KNOWN_CONFIGS:
        return ModelConfig.from_hf_config(KNOWN_CONFIGS[model], dtype=dtype)
    path = Path(model)
    if path.is_file():
        try:
            return ModelConfig.from_hf_config(json.loads(path.read_text()), dtype=dtype)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not path.is_dir():
        from jaxllm.models.presets import is_preset, materialize_preset

        if not is_preset(model):
            raise ValueError(f"{model}: not a directory, a config.json, a preset or one of {', '.join(KNOWN_CONFIGS)}")
        path = materialize_preset(model)
    return load_model_config(path, dtype=dtype)


def make_plan(args: argparse.Namespace) -> tuple[ModelConfig, MemoryPlan]:
    config = load_config(args.model, args.dtype)
    if args.quantization == "none":
        config = replace(config, quantization=None)
    elif args.quantization == "fp8":
        config = with_quantization(config, "fp8")
    elif args.quantization is not None:  # int8 / int4 blocks instead of what the checkpoint ships
        config = with_quantization(replace(config, quantization=None), args.quantization)
    # The engine's rule for integer checkpoints, on the GPU this plans for.
    config = with_dequantize_on_load(config, DEQUANTIZE_ON_LOAD[args.dequantize_on_load], "gpu")
    config = with_kv_cache_dtype(config, None, args.kv_cache_dtype)
    parallel = ParallelConfig(tensor_parallel_size=args.tp, moe_expert_parallel_size=args.ep)
    num_gpus = args.num_gpus or args.tp
    if num_gpus % args.tp:
        raise ValueError(f"--num-gpus {num_gpus} is not a multiple of --tp {args.tp}")
    if not 0 < args.free_gpu_memory_fraction <= 1:
        raise ValueError(f"--free-gpu-memory-fraction must be in (0, 1], got {args.free_gpu_memory_fraction}")
    plan = plan_memory(
        config,
        parallel,
        device_bytes=GPU_MEMORY_BYTES[args.gpu],
        free_memory_fraction=args.free_gpu_memory_fraction,
        num_slots=args.num_slots,
    )
    return config, plan


def render(args: argparse.Namespace, config: ModelConfig, plan: MemoryPlan, max_seq_len: int) -> str:
    q = config.quantization
    weights = (
        describe_weights(config)
        if q is None
        else f"{q.value_dtype} (scales per {q.weight_block_size[0]}x{q.weight_block_size[1] or 'row'} block)"
    )
    num_gpus = args.num_gpus or args.tp
    unit, unit_name = (GB, "GiB") if plan.weights_per_device >= GB else (2**20, "MiB")
    lines = [
        f"model      {config.architecture}  weights {weights}",
        f"layout     TP {plan.parallel.tensor_parallel_size} x EP {plan.parallel.moe_expert_parallel_size} "
        f"on {args.gpu.upper()} ({plan.device_bytes / GB:.1f} GiB each), "
        f"{num_gpus // args.tp} replica(s) over {num_gpus} GPU(s)",
        "",
        f"{'weights per device':<24}{unit_name:>10}",
    ]
    for kind, nbytes in plan.weight_bytes.items():
        lines.append(f"  {kind:<22}{nbytes / unit:>10.2f}")
    if plan.scale_bytes:
        lines.append(f"  {'(of which scales)':<22}{plan.scale_bytes / unit:>10.2f}")
    lines.append(f"  {'total':<22}{plan.weights_per_device / unit:>10.2f}")
    lines += [
        "",
        f"KV cache   {plan.kv_bytes_per_token} bytes/token/device ({kv_storage_dtype(config).name}); "
        f"{plan.kv_tokens:,} tokens fit in {plan.free_memory_fraction:.0%} of the memory left",
    ]
    fits = plan.kv_tokens >= max_seq_len
    verdict = "FITS" if fits else "DOES NOT FIT"
    why = (
        f"room for {plan.kv_tokens // max_seq_len:,} sequence(s) of {max_seq_len:,} tokens"
        if fits
        else f"weights need {plan.weights_per_device / GB:.1f} GiB of {plan.device_bytes / GB:.1f} GiB, "
        f"{plan.kv_tokens:,} KV tokens < max_seq_len {max_seq_len:,}"
    )
    lines.append(f"verdict    {verdict}: {why}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, plan = make_plan(args)
    except ValueError as exc:
        print(f"jaxllm plan: error: {exc}", file=sys.stderr)
        return 2
    max_seq_len = args.max_seq_len or config.max_position_embeddings
    print(render(args, config, plan, max_seq_len))
    return 0 if plan.kv_tokens >= max_seq_len else 1
