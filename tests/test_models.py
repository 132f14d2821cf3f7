"""Model parity against Hugging Face transformers, paged decoding, checkpoint loading, presets."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.models import (  # noqa: E402
    ModelConfig,
    RopeScaling,
    init_kv_cache,
    is_preset,
    kv_cache_bytes_per_token,
    load_model_config,
    load_params,
    materialize_preset,
    param_shapes,
)
from jaxllm.models.moe import grouped_expert_ffn, route_topk  # noqa: E402
from jaxllm.models.rope import rope_inv_freq  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402

TOL = 1e-4

ARCHS = {
    "llama3_tied_headdim": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_mqa_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_bias=True,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
    ),
    "qwen3_moe_sparse_step": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_moe_mlp_only": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=3,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        ),
    ),
    "mixtral_window": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
        ),
    ),
}


def randomize_(model, seed: int) -> None:
    """Replace HF's tiny init (near-uniform logits) with weights that give decisive logits."""
    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * (3.0 / p.shape[-1] ** 0.5 if tied else 1.0))
            else:
                gain = 3.0 if "lm_head" in name else 2.0 if name.endswith("gate.weight") else 1.0
                p.copy_(noise * gain / p.shape[-1] ** 0.5)


def build_hf(arch: str, seed: int = 0):
    cfg_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    randomize_(model, seed)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].double().numpy()


class Loaded:
    def __init__(self, arch: str, root: Path) -> None:
        self.hf = build_hf(arch)
        self.dir = root / arch
        self.hf.save_pretrained(self.dir)
        self.config = load_model_config(self.dir)
        self.params = load_params(self.dir, self.config)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, Loaded] = {}

    def get(arch: str) -> Loaded:
        if arch not in cache:
            cache[arch] = Loaded(arch, root)
        return cache[arch]

    return get


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


# ---------------------------------------------------------------------------------------------
# HF parity through the paged path


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_logits_match_hf(loaded, arch):
    m = loaded(arch)
    tokens = prompt(1, 13, m.config.vocab_size)
    runner = PagedModel(m.params, m.config)
    rng = np.random.default_rng(0)
    ours, _ = runner.all_logits([SeqChunk(tokens, 0, random_block_table(rng, runner.num_blocks, 8))])
    ref = hf_logits(m.hf, tokens)
    assert ref.std() > 0.5, "test model has near-uniform logits"
    assert rel_err(ours, ref) < TOL


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_prefill_and_greedy_decode_match_hf(loaded, arch):
    m = loaded(arch)
    runner = PagedModel(m.params, m.config)
    rng = np.random.default_rng(1)
    table = random_block_table(rng, runner.num_blocks, runner.max_blocks_per_seq)
    assert table != sorted(table)
    tokens = prompt(2, 11, m.config.vocab_size)
    _, runner.cache = runner.step([SeqChunk(tokens[:6], 0, table)])
    logits, runner.cache = runner.step([SeqChunk(tokens[6:], 6, table)])
    seq, step_logits = list(tokens), []
    for _ in range(9):
        step_logits.append(logits[0])
        seq.append(int(np.argmax(logits[0])))
        logits, runner.cache = runner.step([SeqChunk(seq[-1:], len(seq) - 1, table)])
    ref = hf_logits(m.hf, seq)
    scale = np.abs(ref).max()
    for j, pos in enumerate(range(len(tokens) - 1, len(seq) - 1)):
        chosen = seq[pos + 1]
        assert ref[pos, chosen] >= ref[pos].max() - TOL * scale, f"step {j}: token {chosen} is not HF's argmax"
        assert rel_err(step_logits[j], ref[pos]) < TOL, f"step {j}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mixed_prefill_and_decode_batch_matches_separate_runs(loaded, arch):
    m = loaded(arch)
    runner = PagedModel(m.params, m.config)
    rng = np.random.default_rng(2)
    table_b = random_block_table(rng, runner.num_blocks, 4)
    table_a = random_block_table(rng, runner.num_blocks, 4, exclude=table_b)
    a, b = prompt(3, 9, m.config.vocab_size), prompt(4, 6, m.config.vocab_size)
    _, cache = runner.step([SeqChunk(b[:-1], 0, table_b)])  # b's prefix is cached, b now decodes
    chunk_a, chunk_b = SeqChunk(a, 0, table_a), SeqChunk(b[-1:], len(b) - 1, table_b)
    both, _ = runner.step([chunk_a, chunk_b], cache)
    alone_a, _ = runner.step([chunk_a], cache)
    alone_b, _ = runner.step([chunk_b], cache)
    assert rel_err(both[0], alone_a[0]) < 1e-5
    assert rel_err(both[1], alone_b[0]) < 1e-5
    assert rel_err(both[1], hf_logits(m.hf, b)[-1]) < TOL


@pytest.mark.parametrize("arch", ["qwen3_moe_mlp_only"])
def test_forward_returns_logits_at_logits_indices(loaded, arch):
    m = loaded(arch)
    runner = PagedModel(m.params, m.config)
    a, b = prompt(6, 7, m.config.vocab_size), prompt(7, 4, m.config.vocab_size)
    chunks = [SeqChunk(a, 0, [4, 1]), SeqChunk(b, 0, [0, 9])]
    logits, cache = runner.forward(chunks)
    gathered, cache_all = runner.step(chunks)
    assert logits.dtype == np.float32 and logits.shape == (2, m.config.vocab_size)
    np.testing.assert_allclose(logits, gathered, rtol=1e-6, atol=1e-6)
    assert _trees_equal(cache, cache_all)
    assert rel_err(logits[0], hf_logits(m.hf, a)[-1]) < TOL


def test_bfloat16_runs_close_to_float32(loaded):
    m = loaded("qwen3_moe_sparse_step")
    params16 = load_params(m.dir, m.config, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params16))
    config16 = replace(m.config, dtype="bfloat16")
    tokens = prompt(5, 12, m.config.vocab_size)
    chunk = [SeqChunk(tokens, 0, [5, 2, 7, 1])]
    ours16, _ = PagedModel(params16, config16).all_logits(chunk)
    ours32, _ = PagedModel(m.params, m.config).all_logits(chunk)
    assert ours16.dtype == np.float32
    assert rel_err(ours16, ours32) < 0.1
    assert np.mean(ours16.argmax(-1) == ours32.argmax(-1)) >= 0.75


# ---------------------------------------------------------------------------------------------
# Pieces


def test_llama3_rope_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**ARCHS["llama3_tied_headdim"][2])
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    config = ModelConfig.from_hf_config(json.loads(hf_config.to_json_string()))
    ours = rope_inv_freq(config)
    plain = rope_inv_freq(replace(config, rope_scaling=None))
    assert np.array_equal(ours, ref.numpy())
    assert (ours < plain).any() and (ours == plain).any()  # both scaled and untouched bands exist


def test_moe_routing_and_grouped_ffn_match_dense_loop():
    rng = np.random.default_rng(0)
    t, h, i, e, k = 7, 8, 6, 5, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, i, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    weights, ids = route_topk(logits, k, norm_topk_prob=True)
    top = np.sort(np.asarray(logits), -1)[:, ::-1][:, :k]
    np.testing.assert_allclose(weights, np.exp(top) / np.exp(top).sum(-1, keepdims=True), rtol=1e-6)  # Mixtral
    valid = jnp.arange(t) < 5
    from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference

    out = grouped_expert_ffn(x, ids, weights, wg, wu, wd, moe_fn=moe_grouped_ffn_reference, valid=valid)
    xn, wgn, wun, wdn = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    expected = np.zeros((t, h))
    for tok in range(5):  # padding tokens (valid == False) come out as zeros
        for j in range(k):
            ex = ids[tok, j]
            gate = xn[tok] @ wgn[ex]
            hidden = gate / (1 + np.exp(-gate)) * (xn[tok] @ wun[ex])
            expected[tok] += weights[tok, j] * (hidden @ wdn[ex])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_kv_cache_layout_and_size(loaded):
    config = loaded("qwen3").config
    pool = init_kv_cache(config, 6, 4, jnp.bfloat16)  # scan_layers: one page pool, 6 pages per layer
    assert pool.k.shape == (config.num_kv_heads, config.num_layers * 6, 4, config.head_dim)
    assert pool.v.dtype == jnp.bfloat16
    cache = init_kv_cache(replace(config, scan_layers=False), 6, 4, jnp.bfloat16)
    assert len(cache) == config.num_layers
    assert cache[0].k.shape == (config.num_kv_heads, 6, 4, config.head_dim) and cache[0].v.dtype == jnp.bfloat16
    assert kv_cache_bytes_per_token(config, "bfloat16") == 2 * config.num_layers * config.num_kv_heads * 16 * 2


# ---------------------------------------------------------------------------------------------
# Loader


def _trees_equal(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_param_pytree_layout(loaded):
    m = loaded("qwen3_moe_sparse_step")
    shapes = jax.tree_util.tree_map(lambda s: s.shape, param_shapes(m.config))
    assert jax.tree_util.tree_map(lambda x: x.shape, m.params) == shapes
    # scan_layers: layers 0, 1, 2 alternate dense / MoE, so each is a stack of one; layers[i] are empty
    assert m.config.num_layers == 3 and m.params["layers"] == [{}, {}, {}]
    stacks = m.params["layer_stacks"]
    assert "mlp" in stacks[0] and "moe" in stacks[1] and "mlp" in stacks[2]
    assert stacks[1]["moe"]["w_gate"].shape == (1, 8, 32, 16)
    assert stacks[1]["moe"]["w_down"].shape == (1, 8, 16, 32)
    per_layer = load_params(m.dir, replace(m.config, scan_layers=False))
    assert "layer_stacks" not in per_layer
    assert "moe" in per_layer["layers"][1] and "mlp" in per_layer["layers"][0] and "mlp" in per_layer["layers"][2]
    assert per_layer["layers"][1]["moe"]["w_gate"].shape == (8, 32, 16)
    np.testing.assert_array_equal(per_layer["layers"][1]["moe"]["w_down"], stacks[1]["moe"]["w_down"][0])
    assert "lm_head" not in loaded("llama3_tied_headdim").params


def test_sharded_checkpoint_loads_identically(loaded, tmp_path):
    m = loaded("llama_mqa_bias")
    m.hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert _trees_equal(load_params(tmp_path, load_model_config(tmp_path)), m.params)


@pytest.mark.parametrize("arch", ["qwen3_moe_mlp_only", "mixtral_window"])
def test_fused_expert_tensors_load_identically(loaded, tmp_path, arch):
    from safetensors.torch import save_file

    m = loaded(arch)
    state = {k: v.contiguous() for k, v in m.hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers no longer fuses experts"
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(m.dir / "config.json", tmp_path / "config.json")
    assert _trees_equal(load_params(tmp_path, m.config), m.params)


def _copy_without(src: Path, dst: Path, drop: str = "", add: dict | None = None, reshape: str = "") -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src / "model.safetensors"), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    tensors.update(add or {})
    dst.mkdir(exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


def test_loader_names_missing_unexpected_and_misshaped_tensors(loaded, tmp_path):
    m = loaded("qwen3_moe_sparse_step")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight"):
        _copy_without(m.dir, tmp_path / "missing", drop=name)
        with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
            load_params(tmp_path / "missing", m.config)
    _copy_without(m.dir, tmp_path / "extra", add={"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_params(tmp_path / "extra", m.config)
    _copy_without(m.dir, tmp_path / "shape", reshape="model.layers.2.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.down_proj\.weight.*shape"):
        load_params(tmp_path / "shape", m.config)


def test_loader_refuses_pickle_checkpoints(loaded, tmp_path):
    m = loaded("qwen2")
    torch.save(m.hf.state_dict(), tmp_path / "pytorch_model.bin")
    shutil.copy(m.dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin"):
        load_params(tmp_path, m.config)


def _llama_hf_config(**overrides) -> dict:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return base


def test_config_accepts_both_rope_spellings():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hub = _llama_hf_config(
        rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling}, torch_dtype="bfloat16", eos_token_id=[1, 2]
    )
    v5 = _llama_hf_config(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
        dtype="bfloat16",
        eos_token_id=[1, 2],
    )
    a, b = ModelConfig.from_hf_config(hub), ModelConfig.from_hf_config(v5)
    assert a == b and hash(a) == hash(b)
    assert a.rope_theta == 500000.0 and a.dtype == "bfloat16" and a.eos_token_ids == (1, 2)
    assert a.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    plain = ModelConfig.from_hf_config(_llama_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling is None and plain.rope_theta == 1e4 and plain.dtype == "float32"
    assert ModelConfig.from_hf_config(v5, dtype="float32").dtype == "float32"


def test_config_moe_spellings_and_layers():
    base = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=True,
    )
    a = ModelConfig.from_hf_config({**base, "num_experts": 8})
    b = ModelConfig.from_hf_config({**base, "num_local_experts": 8})
    assert a == b and a.num_experts == 8 and a.qk_norm
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (dict(architectures=["DeepseekV3ForCausalLM"]), "DeepseekV3ForCausalLM"),
        (dict(hidden_act="gelu"), "hidden_act.*gelu"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ],
)
def test_config_rejects_unsupported_options(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_llama_hf_config(**overrides))


def test_config_rejects_mixed_sliding_window_layers():
    hf = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
    )
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf_config(hf)
    assert ModelConfig.from_hf_config({**hf, "max_window_layers": 0}).sliding_window == 16
    assert ModelConfig.from_hf_config({**hf, "use_sliding_window": False}).sliding_window is None


# ---------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_preset_loads_here_and_in_transformers(tmp_path, name):
    assert is_preset(name) and not is_preset("tiny-nope")
    path = materialize_preset(name, cache_dir=tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert materialize_preset(name, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    config = load_model_config(path)
    assert config.architecture == ("Qwen3MoeForCausalLM" if name == "tiny-moe" else "Qwen3ForCausalLM")
    params = load_params(path, config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size <= 4096
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in config.eos_token_ids
    text = "Hello, wörld! 你好 🙂\n\tcode: x = [1, 2]  "
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = tokenizer.encode("The quick brown fox jumps over")[:12]
    ours, _ = PagedModel(params, config).all_logits([SeqChunk(tokens, 0, [3, 0, 2, 1])])
    ref = hf_logits(hf, tokens)
    assert ref.std() > 0.5
    assert rel_err(ours, ref) < TOL


def test_unknown_preset_raises(tmp_path):
    with pytest.raises(ValueError, match="tiny-nope"):
        materialize_preset("tiny-nope", cache_dir=tmp_path)
