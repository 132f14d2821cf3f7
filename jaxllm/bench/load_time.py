"""Weight load time: safetensors (per-shard slice reads) against the converted orbax format.

Writes a random Llama-shaped checkpoint of about 1B parameters (bfloat16 by default) from
the weight declaration, converts it with `jaxllm convert`'s code path, and times loading
both onto a mesh of `--tp` devices (each timing includes blocking until every array is
on its devices). Run: `python -m jaxllm.bench.load_time --workdir DIR`; on CPU,
`XLA_FLAGS=--xla_force_host_platform_device_count=N` gives N devices for `--tp N`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Optional

# About 1.1B parameters: 16 layers of hidden 2048, MLP 8192, 32 query / 8 KV heads, vocab 32000.
ONE_B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def write_random_model(directory: Path, hf: dict, dtype: str, seed: int = 0) -> None:
    from safetensors.numpy import save_file

    from jaxllm.models import ModelConfig
    from jaxllm.models.random_checkpoint import random_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    hf = dict(hf, torch_dtype=dtype)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(random_checkpoint(ModelConfig.from_hf_config(hf), seed, dtype), str(directory / "model.safetensors"))


def _timed_load(directory: Path, config, mesh) -> float:
    import jax

    from jaxllm.models import load_params

    start = time.perf_counter()
    params = load_params(directory, config, mesh=mesh)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    del params
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxllm.bench.load_time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", required=True, help="scratch directory for the two checkpoints")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the mesh loaded onto")
    parser.add_argument("--repeats", type=int, default=2, help="timed loads of each format (best is reported)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args(argv)

    import jax

    from jaxllm.models import load_model_config
    from jaxllm.models.convert import convert_checkpoint
    from jaxllm.models.orbax_io import checkpoint_bytes
    from jaxllm.models.weights import num_params
    from sharding import ParallelConfig, make_mesh

    work = Path(args.workdir)
    source, converted = work / "safetensors", work / "orbax"
    if not (source / "model.safetensors").is_file():
        start = time.perf_counter()
        write_random_model(source, ONE_B, args.dtype)
        print(f"wrote random checkpoint in {time.perf_counter() - start:.1f} s")
    if not converted.exists():
        start = time.perf_counter()
        convert_checkpoint(source, converted)
        print(f"converted in {time.perf_counter() - start:.1f} s")
    config = load_model_config(source)
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=args.tp))
    result = dict(
        params=num_params(config),
        dtype=config.dtype,
        tp=args.tp,
        devices=str(jax.devices()[0].platform),
        safetensors_bytes=checkpoint_bytes(source),
        orbax_bytes=checkpoint_bytes(converted),
    )
    for name, directory in (("safetensors", source), ("orbax", converted)):
        times = [_timed_load(directory, config, mesh) for _ in range(args.repeats)]
        result[f"{name}_load_s"] = round(min(times), 2)
        result[f"{name}_load_all_s"] = [round(t, 2) for t in times]
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
