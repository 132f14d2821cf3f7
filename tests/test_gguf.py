"""GGUF files load to the weights transformers' own GGUF loader produces, and generate its tokens.

Tiny random Hugging Face checkpoints are written to GGUF the way llama.cpp's converter
writes them (tests/gguf_helpers.py: gguf's tensor-name map, llama.cpp's Llama q/k row
permutation, `gguf.quantize`), then loaded two ways: by jaxllm (dequantized into an HF
directory, then the ordinary loader) and by transformers (`from_pretrained(gguf_file=...)`,
its own GGUF name mapping and dequantization). The transformers model is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

import transformers  # noqa: E402
from gguf_helpers import make_tiny_hf, write_gguf  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jaxllm.models.gguf import convert_gguf  # noqa: E402

from engine_helpers import hf_teacher_forcing_check  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
CASES = [("llama", q) for q in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")] + [
    (a, q) for a in ("qwen2", "qwen3", "qwen3_moe") for q in ("F32", "Q8_0", "Q4_0")
]
# One quantization per architecture for the generation check.
GENERATE = {"llama": "Q4_0", "qwen2": "Q8_0", "qwen3": "F16", "qwen3_moe": "Q4_1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(f"hf-{arch}")
            model, tokenizer = make_tiny_hf(arch, path)
            made[arch] = (path, model, tokenizer)
        return made[arch]

    return get


_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _stacked(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Expert weights as [E, out, in] per projection, whichever layout (and Mixtral spelling) they come in."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in state.items():
        for mixtral, qwen in _MIXTRAL_NAMES.items():
            name = name.replace(mixtral, qwen)
        if ".mlp.experts." not in name:
            out[name] = value
            continue
        prefix, rest = name.split(".mlp.experts.")
        if rest == "gate_up_proj":
            inter = value.shape[1] // 2
            out[f"{prefix}.gate"], out[f"{prefix}.up"] = value[:, :inter], value[:, inter:]
        elif rest == "down_proj":
            out[f"{prefix}.down"] = value
        else:
            expert, proj = rest.split(".")[:2]
            experts.setdefault(f"{prefix}.{proj.removesuffix('_proj')}", {})[int(expert)] = value
    out.update({k: np.stack([v[e] for e in sorted(v)]) for k, v in experts.items()})
    return out


def _dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Linears of the kept type stay quantized (int8 values + `weight_scale`, for Q4_1 / Q4_K
    `weight_offset`, per block of inputs, and for K-quants float16 `weight_super_scale` /
    `weight_super_offset` per 256): folded back to float here, as the step does before each
    matmul."""
    out = {}
    for name, value in tensors.items():
        if name.endswith((".weight_scale", ".weight_offset", ".weight_super_scale", ".weight_super_offset")):
            continue
        scale = tensors.get(name + "_scale")
        if scale is not None:
            assert value.dtype == np.int8

            def per_value(part: str) -> np.ndarray:
                per_block = np.asarray(tensors[name + part], np.float32)
                return np.repeat(per_block, value.shape[-1] // per_block.shape[-1], axis=-1)

            supers = name + "_super_scale" in tensors
            scales = per_value("_scale") * (per_value("_super_scale") if supers else 1)
            value = value.astype(np.float32) * scales
            if name + "_offset" in tensors:
                value = value + per_value("_offset") * (per_value("_super_offset") if supers else 1)
        out[name] = value
    return out


def _oracle(path: Path, gguf_name: str, config):
    # The original config gives the shapes: transformers' GGUF config reader ignores
    # attention.key_length for qwen3 and expert_feed_forward_length for qwen3moe.
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), gguf_file=gguf_name, config=config, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("arch,qtype", CASES)
def test_weights_match_transformers_gguf_loader(tiny, tmp_path, arch, qtype):
    path, model, tokenizer = tiny(arch)
    gguf_path = write_gguf(model, tokenizer, arch, path / f"{qtype}.gguf", qtype)
    ours = _stacked(
        _dequantized(load_file(str(convert_gguf(gguf_path, tmp_path / "hf", progress=False) / "model.safetensors")))
    )
    reference = _oracle(path, gguf_path.name, model.config)
    theirs = _stacked({k: v.float().numpy() for k, v in reference.state_dict().items()})
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name].astype(np.float32), value, err_msg=name)
    # And both are the original weights up to the quantization error (a wrong q/k permutation is not).
    original = _stacked({k: v.float().numpy() for k, v in model.state_dict().items()})
    tol = {"F32": 0.0, "F16": 1e-3, "Q8_0": 5e-3, "Q4_0": 0.05, "Q4_1": 0.05}[qtype]
    for name, value in ours.items():
        assert np.abs(value.astype(np.float32) - original[name]).max() <= tol * max(
            1.0, np.abs(original[name]).max()
        ), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]


def test_k_quant_weights_match_transformers_gguf_loader(tmp_path):
    """A mixed K-quant Llama file (Q4_K and Q6_K in turn, Q8_0 where rows are not a multiple of
    256) loads to the oracle's weights: `gguf.quantize` has no K-quants, so the blocks are random
    but valid, and both sides dequantize and un-permute q/k from the same bytes."""
    import gguf

    path = tmp_path / "hf-llama-256"
    path.mkdir()
    # 256-wide rows fit K-quant blocks; down_proj's 384-wide rows stay Q8_0.
    model, tokenizer = make_tiny_hf(
        "llama", path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=384
    )
    gguf_path = write_gguf(model, tokenizer, "llama", path / "Q4_K_M.gguf", "Q8_0", k_quants=("Q4_K", "Q6_K"))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert {types["blk.0.attn_q.weight"], types["blk.0.attn_k.weight"]} == {"Q4_K", "Q6_K"}
    assert types["blk.0.ffn_down.weight"] == "Q8_0"
    ours = _dequantized(load_file(str(convert_gguf(gguf_path, tmp_path / "hf", progress=False) / "model.safetensors")))
    theirs = {k: v.float().numpy() for k, v in _oracle(path, gguf_path.name, model.config).state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert np.isfinite(ours[name]).all(), name
        np.testing.assert_array_equal(ours[name].astype(np.float32), value, err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny, tmp_path, monkeypatch, arch):
    from jaxllm import LLM, KvCacheConfig, SamplingParams

    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    path, model, tokenizer = tiny(arch)
    qtype = GENERATE[arch]
    gguf_path = write_gguf(model, tokenizer, arch, path / f"{qtype}.gguf", qtype)
    reference = _oracle(path, gguf_path.name, model.config)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11, 64], [300, 8, 1, 77]]
    llm = LLM(
        str(gguf_path),
        dtype="float32",
        max_batch_size=2,
        max_num_tokens=16,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256),
        warmup="none",  # the greedy requests compile what they run (no sampler)
        dequantize_on_load=False,  # the kept integer weights, dequantized in each step
    )
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs):
        generated = list(out.outputs[0].token_ids)
        assert len(generated) == 8
        hf_teacher_forcing_check(reference, prompt, generated)
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert generated == expected


def test_tokenizer_and_chat_template_come_from_the_metadata(tiny, tmp_path):
    from jaxllm.models.presets import CHAT_TEMPLATE
    from jaxllm.tokenizer import load_tokenizer

    path, model, tokenizer = tiny("qwen2")
    gguf_path = write_gguf(model, tokenizer, "qwen2", path / "tok.gguf", "Q8_0")
    ours = load_tokenizer(convert_gguf(gguf_path, tmp_path / "hf", progress=False))
    original = load_tokenizer(path)  # the tokenizer.json the GGUF metadata was written from
    for text in (
        "Hello, world!",
        "  two spaces and\nnewlines\n\n",
        "numbers 1234 and 2024",
        "<|im_start|>user\nhi<|im_end|>\n",
        "ünïcödé ✓ 日本",
    ):
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.eos_token_id == model.config.eos_token_id


def test_unsupported_or_broken_files_fail_with_one_line(tmp_path):
    import gguf

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(broken, tmp_path / "out")
    other = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(other), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'") as info:
        convert_gguf(other, tmp_path / "out")
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_large_conversions_are_sharded_and_load_identically(tiny, tmp_path, monkeypatch):
    import jax

    import jaxllm.models.gguf as gguf_module
    from jaxllm.models import load_model_config, load_params

    path, model, tokenizer = tiny("llama")
    gguf_path = write_gguf(model, tokenizer, "llama", path / "shards.gguf", "Q8_0")
    single = convert_gguf(gguf_path, tmp_path / "single", progress=False)
    monkeypatch.setattr(gguf_module, "SHARD_BYTES", 64 * 1024)
    sharded = convert_gguf(gguf_path, tmp_path / "sharded", progress=False)
    assert not (sharded / "model.safetensors").exists()
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) == len(
        load_file(str(single / "model.safetensors"))
    )
    config = load_model_config(single)
    for a, b in zip(
        jax.tree_util.tree_leaves(load_params(single, config)), jax.tree_util.tree_leaves(load_params(sharded, config))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mixtral_gguf_is_llama_with_experts(tiny, tmp_path, monkeypatch):
    """transformers cannot load a Mixtral GGUF, so the original checkpoint is the oracle (F32: exact)."""
    from jaxllm import LLM, KvCacheConfig, SamplingParams

    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    path, model, tokenizer = tiny("mixtral")
    gguf_path = write_gguf(model, tokenizer, "mixtral", path / "F32.gguf", "F32")
    converted = convert_gguf(gguf_path, tmp_path / "hf", progress=False)
    assert json.loads((converted / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    ours = _stacked(_dequantized(load_file(str(converted / "model.safetensors"))))
    original = _stacked({k: v.float().numpy() for k, v in model.state_dict().items()})
    assert sorted(ours) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 64]
    llm = LLM(
        str(gguf_path),
        dtype="float32",
        max_batch_size=2,
        max_num_tokens=16,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256),
        warmup="none",  # the greedy requests compile what they run (no sampler)
    )
    try:
        generated = list(
            llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).outputs[0].token_ids
        )
    finally:
        llm.shutdown()
    hf_teacher_forcing_check(model, prompt, generated)
