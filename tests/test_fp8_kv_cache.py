"""FP8 KV cache (`KvCacheConfig(dtype="fp8")`) against Hugging Face transformers.

The oracle is a torch simulation of the same cache on the HF model: a `DynamicCache` whose
`update` rounds every key and value it stores to float8_e4m3fn with the layer's scale
(`fp8(x / s) * s`, saturated at 448) before attention reads them, as the engine's cache
does. For MLA (DeepSeek-V3 in transformers caches the latent `kv_nope` and the RoPE'd key)
both halves are rounded with the layer's one latent scale.

- Llama (GQA) with per-layer `self_attn.k_scale` / `v_scale` tensors in the checkpoint
  (amax / 448 of that layer's keys and values): the scales are read, the cache is
  float8_e4m3fn, teacher-forced top-1 agreement with the unquantized HF model is at least
  the simulation's (within 2 positions), and the logits follow the simulation's;
- DeepSeek-V3 (MLA latent cache) without scale tensors: scales 1.0, the same checks;
- a checkpoint with scales for some layers only is a ValueError naming the missing tensor.

Kernels, the planner and the engine with an FP8 cache: `tests.test_fp8_kv_engine`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from jaxllm.models import init_kv_cache, load_model_config, load_params  # noqa: E402
from jaxllm.models.kv_quant import FP8_KV, with_kv_cache_dtype  # noqa: E402
from jaxllm.models.quant_config import KvCacheQuant  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402

LLAMA = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(0, 256, 48)] for seed in (11, 12, 13, 14)]


def _round_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def _rounding_cache(k_scales, v_scales):
    """A DynamicCache storing what an FP8 cache with these per-layer scales holds."""

    class Fp8RoundedCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            key_states = _round_fp8(key_states, k_scales[layer_idx])
            value_states = _round_fp8(value_states, v_scales[layer_idx])
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return Fp8RoundedCache()


class _Recording(transformers.DynamicCache):
    """Records each layer's largest |key| and |value| (for the checkpoint's scales)."""

    amax: dict[int, tuple[float, float]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.amax.get(layer_idx, (0.0, 0.0))
        self.amax[layer_idx] = (max(k, float(key_states.abs().max())), max(v, float(value_states.abs().max())))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _hf_logits(model, tokens, cache=None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)]), past_key_values=cache, use_cache=cache is not None)
        return out.logits[0].double().numpy()


def _randomize(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * (3.0 if "lm_head" in name else 1.0) / p.shape[-1] ** 0.5)
    return model.eval()


def _ours(directory: Path, kv_cache_dtype: str, **overrides) -> tuple[np.ndarray, object]:
    config = with_kv_cache_dtype(load_model_config(directory), directory, kv_cache_dtype)
    config = replace(config, **overrides)
    params = load_params(directory, config)
    logits = []
    for seed, tokens in enumerate(PROMPTS):
        cache = init_kv_cache(config, 64, 4, None)  # the config's KV dtype
        model = PagedModel(params, config, num_blocks=64, max_blocks_per_seq=16, token_bucket=64, cache=cache)
        table = random_block_table(np.random.default_rng(seed), 64, 16)
        out, new_cache = model.all_logits([SeqChunk(tokens, 0, table)])
        if kv_cache_dtype == "fp8":
            assert all(leaf.dtype == FP8_KV for leaf in jax.tree.leaves(new_cache))
        logits.append(out)
    return np.concatenate(logits), config


def _top1(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits).argmax(-1)


def _check_against_simulation(ours: np.ndarray, sim: np.ndarray, ref: np.ndarray, label: str) -> None:
    agree_ours = float(np.mean(_top1(ours) == _top1(ref)))
    agree_sim = float(np.mean(_top1(sim) == _top1(ref)))
    print(
        f"{label}: teacher-forced top-1 agreement with the unquantized model: ours {agree_ours:.3f}, "
        f"torch simulation {agree_sim:.3f} ({len(ref)} positions)"
    )
    assert rel_err(sim, ref) > 1e-4, "rounding the cache to fp8 changed nothing"
    assert agree_ours >= agree_sim - 2 / len(ref)
    # Same cache contents up to float32 rounding before the fp8 cast (a value an ulp from an e4m3
    # midpoint may round the other way), so the logits follow the simulation's closely.
    assert rel_err(ours, sim) < 0.2 * rel_err(sim, ref) + 1e-4
    assert np.mean(_top1(ours) == _top1(sim)) >= 0.97


@pytest.fixture(scope="module")
def llama_with_scales(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path_factory.mktemp("fp8kv") / "llama"
    torch.manual_seed(0)
    model = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    model.save_pretrained(directory)
    _Recording.amax = {}
    for tokens in PROMPTS:
        _hf_logits(model, tokens, _Recording())
    tensors = load_file(directory / "model.safetensors")
    k_scales, v_scales = [], []
    for layer, (k, v) in sorted(_Recording.amax.items()):
        k_scales.append(float(np.float32(k / 448.0)))
        v_scales.append(float(np.float32(v / 448.0)))
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = np.asarray(k_scales[-1], np.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = np.asarray([v_scales[-1]], np.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, model, k_scales, v_scales


def test_llama_fp8_kv_cache_with_checkpoint_scales_matches_a_torch_simulation(llama_with_scales):
    directory, hf, k_scales, v_scales = llama_with_scales
    ours, config = _ours(directory, "fp8")
    assert config.kv_cache_quant.source == "checkpoint"
    assert config.kv_cache_quant.k_scales == tuple(k_scales) and config.kv_cache_quant.v_scales == tuple(v_scales)
    assert all(s != 1.0 for s in k_scales + v_scales)
    ref = np.concatenate([_hf_logits(hf, t) for t in PROMPTS])
    unquantized, _ = _ours(directory, "auto")
    assert rel_err(unquantized, ref) < 1e-4  # the float cache is HF's model
    sim = np.concatenate([_hf_logits(hf, t, _rounding_cache(k_scales, v_scales)) for t in PROMPTS])
    _check_against_simulation(ours, sim, ref, "llama (checkpoint scales)")
    # Layers unrolled over per-layer caches (static layer index) read the same scales as the scan.
    unrolled, _ = _ours(directory, "fp8", scan_layers=False)
    assert rel_err(unrolled, ours) < 1e-5


@pytest.mark.parametrize("scale", [None, 0.02])
def test_deepseek_mla_fp8_latent_cache_matches_a_torch_simulation(tmp_path, scale):
    """None: the checkpoint has no scales, so 1.0; 0.02: a set scale (as if from a checkpoint)."""
    from tests.test_deepseek import BASE, write_checkpoint

    directory = tmp_path / "ds"
    hf = write_checkpoint(directory, dict(BASE, vocab_size=256))
    layers = BASE["num_hidden_layers"]
    overrides = {} if scale is None else dict(kv_cache_quant=KvCacheQuant((scale,) * layers, (scale,) * layers))
    ours, config = _ours(directory, "fp8", **overrides)
    if scale is None:
        assert config.kv_cache_quant.source == "unit" and set(config.kv_cache_quant.k_scales) == {1.0}
    ref = np.concatenate([_hf_logits(hf, t) for t in PROMPTS])
    scales = list(config.kv_cache_quant.k_scales)
    sim = np.concatenate([_hf_logits(hf, t, _rounding_cache(scales, scales)) for t in PROMPTS])
    _check_against_simulation(ours, sim, ref, f"deepseek-v3 MLA (scale {scales[0]})")
    # The prompts ran expanded (latent pages dequantized, then K/V); the absorbed form (decode's:
    # the scale folded into the query and the output) reads the same cache. The two round their
    # float32 sums differently, so now and then a later layer's latent lands on the other e4m3
    # neighbour: close, not equal.
    absorbed, _ = _ours(directory, "fp8", mla_attention="absorbed", **overrides)
    assert rel_err(absorbed, ours) < 5e-3 and np.mean(_top1(absorbed) == _top1(ours)) >= 0.99


def test_scales_for_some_layers_only_name_the_missing_tensor(llama_with_scales, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "partial"
    shutil.copytree(llama_with_scales[0], directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        with_kv_cache_dtype(load_model_config(directory), directory, "fp8")
