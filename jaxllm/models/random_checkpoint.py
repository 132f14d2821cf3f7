"""Fixed-seed random checkpoints in Hugging Face layout, from the weight declaration: the tiny
presets and every test and benchmark model that needs no download."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.weights import declare_weights


def random_checkpoint(
    config: ModelConfig, seed: int, dtype: Any = np.float32, *, mtp: bool = False
) -> dict[str, np.ndarray]:
    """Fixed-seed weights in Hugging Face layout (each parameter's canonical spelling), scaled
    so activations and logits are not degenerate: norms near 1, linear layers
    gain / sqrt(fan_in), a tied embedding shrunk so the shared table gives useful logits.
    `mtp`: with DeepSeek-V3's multi-token-prediction layers too."""
    rng = np.random.default_rng(seed)
    out_dtype = numpy_dtype(dtype)
    tensors: dict[str, np.ndarray] = {}
    for decl in declare_weights(config, mtp=mtp):
        for src in decl.alternatives[0]:
            noise = rng.standard_normal(src.shape, dtype=np.float32)
            if decl.init == "norm":
                value = 1.0 + 0.1 * noise
            elif decl.init == "bias":
                value = 0.1 * noise
            elif decl.init == "embed":
                value = noise * (3.0 / np.sqrt(config.hidden_size) if config.tie_word_embeddings else 1.0)
            else:
                value = noise * (decl.gain / np.sqrt(src.shape[-1]))
            tensors[src.name] = value.astype(out_dtype, copy=False)
    return tensors
