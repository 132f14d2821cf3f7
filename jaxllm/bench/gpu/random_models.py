"""Random-weight model directories for the engine and numerics sections (no download).

A directory is an ordinary Hugging Face model directory (config.json, model.safetensors,
the tiny presets' tokenizer), so the engine loads it through its usual path. Small models
take `weights.random_checkpoint` (a seeded normal draw: the numerics fixture depends on
it being exactly reproducible); large ones (real widths, billions of parameters) take
windows of one seeded noise block of prime length, scaled the same way, which writes
gigabytes in seconds instead of minutes and still gives distinct rows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.presets import materialize_preset
from jaxllm.models.random_checkpoint import random_checkpoint
from jaxllm.models.weights import declare_weights

EXACT_RANDOM_MAX_PARAMS = 64_000_000  # up to this many parameters: `random_checkpoint`
_NOISE_LEN = 1_000_003  # prime: rows of any width are shifted windows, never repeats


def count_params(config: ModelConfig) -> int:
    return sum(int(np.prod(src.shape)) for decl in declare_weights(config) for src in decl.alternatives[0])


def tiled_checkpoint(config: ModelConfig, seed: int, dtype: Any = np.float16) -> dict[str, np.ndarray]:
    """`random_checkpoint`'s scaling on windows of one noise block (see the module docstring)."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(_NOISE_LEN, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {}
    for decl in declare_weights(config):
        for src in decl.alternatives[0]:
            size = int(np.prod(src.shape))
            start = int(rng.integers(_NOISE_LEN))
            flat = np.resize(np.roll(noise, -start), size).reshape(src.shape)
            if decl.init == "norm":
                value = 1.0 + 0.1 * flat
            elif decl.init == "bias":
                value = 0.1 * flat
            elif decl.init == "embed":
                value = flat * (3.0 / np.sqrt(config.hidden_size) if config.tie_word_embeddings else 1.0)
            else:
                value = flat * (decl.gain / np.sqrt(src.shape[-1]))
            tensors[src.name] = value.astype(dtype)
    return tensors


def write_model_dir(directory: Path, hf_config: dict[str, Any], seed: int) -> Path:
    """Writes config.json, model.safetensors (float32 when exact-random, float16 when tiled)
    and the tiny presets' tokenizer into `directory`; returns it."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = materialize_preset("tiny-dense")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=1, sort_keys=True))
    config = ModelConfig.from_hf_config(hf_config)
    if count_params(config) <= EXACT_RANDOM_MAX_PARAMS:
        weights = random_checkpoint(config, seed)
    else:
        weights = tiled_checkpoint(config, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
