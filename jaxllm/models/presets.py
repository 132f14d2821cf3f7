"""Built-in tiny models ('tiny-moe', 'tiny-dense') that need no download.

A preset is materialised once as an ordinary Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json), so the engine loads it through the same path as any real
checkpoint and transformers can load it as the reference. Weights are fixed-seed
random numbers from the weight declaration (`weights.random_checkpoint`); the tokenizer
is a byte-level BPE trained offline on a small built-in English text, so any UTF-8 text round-trips.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from jaxllm.models.cache_dir import cache_root
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.random_checkpoint import random_checkpoint

# Bump when anything a preset writes changes, so stale cached copies are rebuilt.
_PRESET_VERSION = 2
_MARKER = "jaxllm_preset.json"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKENIZER_VOCAB = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small language model is still a language model:
it reads a prompt, one token at a time, and predicts the next token from everything it has seen.
The engine keeps the keys and values of earlier tokens in a paged cache, so a long conversation
does not need to be read again at every step. Requests arrive at different times and finish at
different times; the scheduler decides, before each step, which requests run and how many of
their prompt tokens fit into the budget of the step.

Once upon a time there was a village by the sea. Every morning the fishermen went out in their
boats, and every evening they came back with stories about the weather, the water and the birds.
The children listened, asked questions, and wrote down the best answers in a large blue book.
When the winter came, the book was read aloud by the fire, and nobody remembered who had first
told which story.

How do you make a cup of tea? Boil fresh water, warm the pot, add one spoon of leaves for each
person and one for the pot, pour the water and wait for three to five minutes. Some people add
milk, some add lemon, and some prefer it with nothing at all. What matters most is the company.

Mixture of experts layers send each token to a few experts chosen by a router. The router scores
every expert, keeps the best ones, and the outputs of the chosen experts are added together with
their weights. Because only a few experts work on each token, the model can be large while each
step stays cheap. Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text as well, and so do
questions, answers, lists, code and punctuation: commas, colons; quotes "like this" and (brackets).

def greet(name):
    return "Hello, " + name + "!"

print(greet("world"))
"""


@dataclass(frozen=True)
class _Preset:
    architecture: str
    model_type: str
    seed: int
    hf_config: dict[str, Any] = field(hash=False)


_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "use_cache": True,
    "torch_dtype": "float32",
}

PRESETS: dict[str, _Preset] = {
    "tiny-moe": _Preset(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        seed=1234,
        hf_config={
            **_COMMON,
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        },
    ),
    "tiny-dense": _Preset(
        "Qwen3ForCausalLM",
        "qwen3",
        seed=4321,
        hf_config={**_COMMON, "tie_word_embeddings": True, "max_window_layers": 4},
    ),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def default_cache_dir() -> Path:
    return cache_root() / "presets"


def materialize_preset(name: str, cache_dir: Optional[Path] = None) -> Path:
    """Return `<cache_dir>/<name>`, an HF model directory, building it first if missing or stale.

    `cache_dir` defaults to ~/.cache/jaxllm/presets (or $JAXLLM_CACHE_DIR/presets).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if _is_current(target, name):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _build(PRESETS[name], staging)
        (staging / _MARKER).write_text(json.dumps({"name": name, "version": _PRESET_VERSION}))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_current(target, name):  # another process may have won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_current(path: Path, name: str) -> bool:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"name": name, "version": _PRESET_VERSION}


def build_tokenizer():
    """Byte-level BPE: 256 byte tokens, merges learned from the built-in text, ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer=trainer)
    return tokenizer


def _write_tokenizer(directory: Path, max_length: int) -> dict[str, int]:
    tokenizer = build_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_length,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return {"vocab_size": tokenizer.get_vocab_size(), **ids}


def _build(preset: _Preset, directory: Path) -> None:
    from safetensors.numpy import save_file

    hf = dict(preset.hf_config)
    tok = _write_tokenizer(directory, hf["max_position_embeddings"])
    hf.update(
        architectures=[preset.architecture],
        model_type=preset.model_type,
        vocab_size=tok["vocab_size"],
        bos_token_id=tok["<|endoftext|>"],
        eos_token_id=tok["<|im_end|>"],
        pad_token_id=tok["<|endoftext|>"],
    )
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": tok["<|endoftext|>"],
                "eos_token_id": [tok["<|im_end|>"], tok["<|endoftext|>"]],
                "pad_token_id": tok["<|endoftext|>"],
            },
            indent=2,
        )
    )
    weights = random_checkpoint(ModelConfig.from_hf_config(hf), preset.seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
