"""`jaxllm convert`: read a Hugging Face checkpoint once and write it in the converted orbax
format (`jaxllm.models.orbax_io`), which restores straight into any sharding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from jaxllm.models.loader import load_params
from jaxllm.models.model_config import load_model_config
from jaxllm.models.orbax_io import checkpoint_bytes, is_converted, write_converted


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, dtype: str | None = None) -> Path:
    """Write `model_dir`'s weights (cast to `dtype`, default the config's) as an orbax checkpoint."""
    model_dir, output_dir = Path(model_dir), Path(output_dir).absolute()
    if is_converted(model_dir):
        raise ValueError(f"{model_dir} is already a converted checkpoint")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise ValueError(f"output directory {output_dir} exists and is not empty")
    # Stored per layer (the format does not depend on scan_layers); restoring stacks them.
    config = replace(load_model_config(model_dir, dtype), scan_layers=False)
    if config.quantization is not None:
        raise ValueError(
            f"{model_dir} holds FP8 weights; converting quantized checkpoints to orbax is not supported yet"
        )
    params = load_params(model_dir, config)
    return write_converted(params, model_dir, output_dir, config.dtype)


def main(argv: list[str] | None = None) -> int:
    """`jaxllm convert --model DIR --output DIR [--dtype D]`."""
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(
        prog="jaxllm convert",
        description="Write a Hugging Face safetensors checkpoint as an orbax checkpoint "
        "that restores straight into any tensor-parallel sharding.",
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory (safetensors)")
    parser.add_argument("--output", required=True, help="new directory for the converted model")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="cast the weights (default: the checkpoint's dtype)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        out = convert_checkpoint(args.model, args.output, args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"jaxllm convert: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"converted {args.model} -> {out} ({checkpoint_bytes(out) / 2**20:.1f} MiB, "
        f"{time.perf_counter() - started:.1f} s)",
        file=sys.stderr,
    )
    return 0
