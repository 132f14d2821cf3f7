"""Hostile and broken checkpoints and limits: each is refused before anything large is allocated,
with a one-line ValueError naming the file and the problem (exit 2 and one line on the CLI)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.cli import build_parser
from jaxllm.cli.args import engine_kwargs
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.memory_budget import GIB, check_engine_allocations
from jaxllm.models import load_model_config, load_params
from jaxllm.models.gguf import convert_gguf
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.random_checkpoint import random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def write_model(path: Path, tensors: dict | None = None, **overrides) -> Path:
    """A tiny Qwen3 directory: config.json (with `overrides`) and model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = random_checkpoint(ModelConfig.from_hf_config(TINY), seed=0)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny") / "model")


def _tensors(tiny: Path) -> dict[str, np.ndarray]:
    return load_file(str(tiny / "model.safetensors"))


def cli_generate(model: str | Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxllm", "generate", "--model", str(model), "--max-tokens", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def assert_one_line_exit_2(done: subprocess.CompletedProcess, match: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and match in errors[0], done.stderr[-2000:]


# ----------------------------------------------------------------------------- 1. unbounded sizes
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers=1000000 is out of range"),
        ({"max_position_embeddings": 10**9}, "max_position_embeddings=1000000000 is out of range"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
        ({"hidden_size": 10**8}, "hidden_size"),
        ({"num_attention_heads": 10**6}, "num_attention_heads"),
        ({"vocab_size": 10**10}, "vocab_size"),
        ({"head_dim": 10**6}, "head_dim"),
        ({"intermediate_size": 10**9}, "intermediate_size"),
    ],
)
def test_config_sizes_are_bounded(tmp_path, overrides, match):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **overrides}))
    with pytest.raises(ValueError, match=match) as info:
        load_model_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_expert_count_is_bounded(tmp_path):
    moe = {
        **TINY,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 10**6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ValueError, match="num_experts=1000000 is out of range"):
        load_model_config(tmp_path)


def test_declared_layers_must_exist_in_the_checkpoint(tmp_path, tiny):
    model = write_model(tmp_path / "m", tensors=_tensors(tiny), num_hidden_layers=900)
    config = load_model_config(model)
    with pytest.raises(ValueError, match="declares num_hidden_layers=900 but the checkpoint has no tensors"):
        load_params(model, config)


def test_cli_unbounded_config_is_one_line(tmp_path, tiny):
    model = write_model(tmp_path / "m", tensors=_tensors(tiny), max_position_embeddings=10**9)
    assert_one_line_exit_2(cli_generate(model), "max_position_embeddings=1000000000 is out of range")


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_batch_size", 100_000_000),
        ("max_num_tokens", 10**8),
        ("max_num_tokens", 1e8),
        ("max_loras", 10**8),
        ("max_lora_rank", 10**8),
        ("max_seq_len", 10**12),
        ("max_batch_size", "8"),
        ("max_batch_size", [1]),
        ("max_batch_size", True),
        ("max_loras", 2.5),
    ],
)
def test_engine_limits_are_ints_in_range(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="tiny-dense", **{field: value})


@pytest.mark.parametrize("text", ["max_batch_size: 100000000\n", "max_num_tokens: 1e8\n", 'max_batch_size: "8"\n'])
def test_yaml_config_limits_are_checked(tmp_path, text):
    path = tmp_path / "llm.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["generate", "--config", str(path)])
    with pytest.raises(ValueError, match="max_"):
        EngineConfig(model="tiny-dense", **engine_kwargs(args))


def test_kv_cache_config_types_are_checked():
    with pytest.raises(ValueError, match="tokens_per_block must be an integer"):
        EngineConfig(model="tiny-dense", kv_cache_config={"tokens_per_block": "32"})
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        EngineConfig(model="tiny-dense", kv_cache_config={"max_tokens": [1]})


def test_implied_allocations_are_checked_against_memory():
    model_config = ModelConfig.from_hf_config(TINY)
    config = EngineConfig(model="tiny-dense", max_batch_size=64)
    with pytest.raises(ValueError, match=r"sampling tensors .* need 10\.00 GiB .* lower --max-batch-size"):
        check_engine_allocations(config, model_config, 1 << 24, 64, available=2 * GIB)
    check_engine_allocations(config, model_config, 2048, 64, available=2 * GIB)
    lora = EngineConfig(model="tiny-dense", enable_lora=True, max_loras=1024, max_lora_rank=4096)
    with pytest.raises(ValueError, match="LoRA slots .* lower --max-loras or --max-lora-rank"):
        check_engine_allocations(lora, model_config, 2048, 64, available=2 * GIB)


# ----------------------------------------------------------------------------- 2. corrupt files
def _raw_safetensors(header: object, data: bytes = b"") -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def _corrupt(tiny: Path, how: str) -> bytes:
    raw = (tiny / "model.safetensors").read_bytes()
    if how == "truncated":
        return raw[: len(raw) // 2]
    if how == "garbage":
        return np.random.default_rng(0).bytes(4096)
    if how == "oversized header":
        return struct.pack("<Q", 1 << 62) + raw[8:]
    if how == "shape/offset mismatch":
        return _raw_safetensors(
            {"model.embed_tokens.weight": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8]}}, bytes(8)
        )
    if how == "header list":
        return _raw_safetensors([1, 2, 3])
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "garbage", "oversized header", "shape/offset mismatch", "header list"])
def test_corrupt_safetensors_is_one_value_error(tmp_path, tiny, how):
    model = write_model(tmp_path / "m", tensors={})
    (model / "model.safetensors").write_bytes(_corrupt(tiny, how))
    with pytest.raises(ValueError, match="model.safetensors") as info:
        load_params(model, load_model_config(model))
    assert "\n" not in str(info.value)


def test_integer_tensor_is_refused(tmp_path, tiny):
    tensors = _tensors(tiny)
    tensors["model.norm.weight"] = np.ones(32, np.int64)
    model = write_model(tmp_path / "m", tensors=tensors)
    with pytest.raises(ValueError, match="model.norm.weight in model.safetensors has dtype I64"):
        load_params(model, load_model_config(model))


@pytest.mark.parametrize(
    "text, match",
    [("[1, 2, 3]", "must hold a JSON object, got list"), ("[" * 100_000 + "]" * 100_000, "nested too deeply")],
    ids=["list", "nested 100k deep"],
)
def test_config_json_shape_is_checked(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_model_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_cli_corrupt_checkpoint_is_one_line(tmp_path, tiny):
    model = write_model(tmp_path / "m", tensors={})
    (model / "model.safetensors").write_bytes(_corrupt(tiny, "truncated"))
    assert_one_line_exit_2(cli_generate(model), "model.safetensors")


def test_cli_yaml_string_limit_is_one_line(tmp_path, tiny):
    path = tmp_path / "llm.yaml"
    path.write_text('max_batch_size: "8"\n')
    assert_one_line_exit_2(cli_generate(tiny, "--config", str(path)), "max_batch_size must be an integer")


# ----------------------------------------------------------------------------- GGUF
def _write_gguf(path: Path, meta: dict, tensors: dict[str, np.ndarray]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_GGUF_META = {
    "llama.embedding_length": 32,
    "llama.attention.head_count": 2,
    "llama.block_count": 1,
    "llama.vocab_size": 64,
    "llama.feed_forward_length": 64,
}
_GGUF_TENSORS = {
    "token_embd.weight": np.ones((64, 32), np.float32),
    "blk.0.attn_norm.weight": np.ones(32, np.float32),
}


@pytest.mark.parametrize(
    "meta, tensors, match",
    [
        ({"llama.block_count": 10**6}, {}, "block_count=1000000 is out of range"),
        ({"llama.block_count": 3}, {}, "block_count=3 but the file has no tensors"),
        ({"llama.embedding_length": [32, 32]}, {}, "embedding_length must be an integer"),
        ({"llama.attention.head_count": 0}, {}, "head_count=0 is out of range"),
        ({}, {"blk.0.ffn_norm.weight": np.ones(32, np.int32)}, "has type I32"),
        ({}, {"blk.0.ffn_norm.weight": np.ones(32, np.float64)}, "has type F64"),
    ],
)
def test_hostile_gguf_is_one_value_error(tmp_path, meta, tensors, match):
    path = _write_gguf(tmp_path / "m.gguf", {**_GGUF_META, **meta}, {**_GGUF_TENSORS, **tensors})
    with pytest.raises(ValueError, match=match) as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert str(path) in str(info.value)


def test_unaligned_gguf_tensor_is_refused(tmp_path):
    from gguf import GGUFReader

    path = _write_gguf(tmp_path / "m.gguf", _GGUF_META, _GGUF_TENSORS)
    first = GGUFReader(str(path)).tensors[0].field  # token_embd: another tensor's data follows it
    at = first.offset + sum(int(p.nbytes) for p in first.parts[:-1])  # the tensor's data offset (uint64)
    raw = bytearray(path.read_bytes())
    (offset,) = struct.unpack_from("<Q", raw, at)
    struct.pack_into("<Q", raw, at, offset + 4)
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not a multiple of the file's alignment"):
        convert_gguf(path, tmp_path / "out", progress=False)


# ----------------------------------------------------------------------------- 3. silently wrong values
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_theta": float("nan")}, "rope_theta must be finite"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0"),
        ({"vocab_size": "453"}, "vocab_size must be an integer"),
        ({"vocab_size": 453.7}, "vocab_size must be an integer"),
        ({"architectures": []}, "exactly one architecture"),
    ],
)
def test_silently_wrong_config_fields_are_refused(tmp_path, overrides, match):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **overrides}))
    with pytest.raises(ValueError, match=match) as info:
        load_model_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused(tmp_path, tiny, bad):
    tensors = _tensors(tiny)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    model = write_model(tmp_path / "m", tensors=tensors)
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight in .*model.safetensors holds NaN"):
        load_params(model, load_model_config(model))


def test_cli_nan_rope_theta_is_one_line(tmp_path, tiny):
    model = write_model(tmp_path / "m", tensors=_tensors(tiny), rope_theta=float("nan"))
    assert_one_line_exit_2(cli_generate(model), "rope_theta must be finite")


def test_llm_api_refuses_nan_weights_before_compiling(tmp_path, tiny):
    import jaxllm

    tensors = _tensors(tiny)
    tensors["model.norm.weight"][0] = np.nan
    model = write_model(tmp_path / "m", tensors=tensors)
    with pytest.raises(ValueError, match="model.norm.weight in .* holds NaN"):
        jaxllm.LLM(str(model))


def test_engine_refuses_missing_layers(tmp_path, tiny):
    from jaxllm.engine.llm_engine import LLMEngine

    model = write_model(tmp_path / "m", tensors=_tensors(tiny), num_hidden_layers=5)
    with pytest.raises(ValueError, match="declares num_hidden_layers=5"):
        LLMEngine(EngineConfig(model=str(model)))


def test_cli_serve_huge_context_is_one_line(tmp_path, tiny):
    model = write_model(tmp_path / "m", tensors=_tensors(tiny), max_position_embeddings=10**12)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", str(model), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert_one_line_exit_2(done, "max_position_embeddings=1000000000000 is out of range")
