"""Convert a llama.cpp GGUF file into a Hugging Face model directory the loader reads.

A GGUF file holds (possibly quantized) tensors under llama.cpp's names plus metadata under
llama.cpp's keys. `convert_gguf` writes what a Hugging Face checkpoint would hold instead:
`config.json`, `generation_config.json`, `model.safetensors` and the tokenizer (built by
transformers' GGUF tokenizer converters, with the chat template from the metadata). The
engine then loads the directory through the ordinary safetensors loader, so GGUF adds no
second loading path.

Linear projections in Q8_0, Q4_0, Q4_1, Q4_K or Q6_K (the type most of them use) stay
quantized: their integer values (one to an int8) and their scales as the file stores them,
one per block of 32 inputs (Q6_K: 16; float16, K-quants' integer sub-block scales plus a
float16 scale per 256), are written as `<module>.weight` / `<module>.weight_scale` (Q4_1 and
Q4_K also `<module>.weight_offset`, the block's minimum; K-quants `.weight_super_scale` /
`.weight_super_offset`) with a `quantization_config` of method "gguf", and the loader keeps
them so on the device (int8, or 4-bit packed two to a byte) for the jitted step to
dequantize before each matmul. Every other tensor (embeddings, norms, the
LM head, linears of other types, and every layer's copy of a linear that some layer stores in
another type, so that layer stacks stay uniform) is dequantized by the `gguf` library.

llama.cpp stores the q/k projections of Llama-family attention with each head's rows
interleaved for its RoPE kernel (`convert_hf_to_gguf.py`'s `permute`); they are put back in
the Hugging Face order here. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm.auto import tqdm

from jaxllm.models.config_fields import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    as_float,
    as_int,
)
from jaxllm.models.gguf_blocks import as_held, held_type, unpack_blocks

logger = logging.getLogger(__name__)

# general.architecture -> Hugging Face architecture; Llama files with experts are Mixtral.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Metadata arrays only the tokenizer needs; every other array is small.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)
# Per-layer tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Expert tensors: stacked [E, out, in] (`ffn_gate_exps`) or, in older files, one per expert (`ffn_gate.3`).
_EXPERT_PROJ = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
# Dequantized weights are written in shards of about this size (the loader reads sharded checkpoints).
SHARD_BYTES = 2 * 1024**3
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensor types no weight of a supported model has.
_REFUSED_TYPES = ("I8", "I16", "I32", "I64", "F64")
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)(?:_exps\.weight|\.(\d+)\.weight)$")
_LINEAR_TENSORS = tuple(
    f"{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)
# Block types whose linear projections load quantized (int8 / packed 4-bit values + block scales).
KEPT_QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata value as a Python value (strings decoded, arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _open(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # declared dependency; only a broken install lands here
        raise ValueError("reading GGUF files needs the `gguf` package: pip install gguf") from exc
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # any parse failure of a hostile file (struct, numpy, enum errors) is one line
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
    for tensor in reader.tensors:
        if (tensor.data_offset - reader.data_offset) % reader.alignment:
            raise ValueError(
                f"{path}: tensor {tensor.name} starts at offset {tensor.data_offset - reader.data_offset}, "
                f"not a multiple of the file's alignment {reader.alignment}"
            )
        if tensor.tensor_type.name in _REFUSED_TYPES:
            raise ValueError(
                f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; "
                "only float (F32, F16, BF16) and quantized weights are supported"
            )
    return reader


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The `config.json` a Hugging Face checkpoint of this file would carry."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "unsupported GGUF with a rope_freqs tensor (Llama-3.1-style RoPE scaling); "
            "load the Hugging Face checkpoint instead"
        )

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ValueError(f"GGUF metadata is missing {arch}.{name}")
        return value

    def size(name: str, low: int, high: int, default: Any = None, required: bool = False) -> Any:
        value = key(name, default, required)
        if isinstance(value, list) and name == "attention.head_count_kv":
            raise ValueError("unsupported GGUF with a per-layer attention.head_count_kv")
        return None if value is None else as_int(value, f"{arch}.{name}", low, high)

    def number(name: str, default: float) -> float:
        return as_float(key(name, default), f"{arch}.{name}", positive=True)

    hidden = size("embedding_length", 1, MAX_HIDDEN, required=True)
    heads = size("attention.head_count", 1, MAX_HEADS, required=True)
    kv_heads = size("attention.head_count_kv", 1, MAX_HEADS, heads)
    experts = size("expert_count", 0, MAX_EXPERTS, 0) or 0
    blocks = size("block_count", 1, MAX_LAYERS, required=True)
    present = {int(m.group(1)) for n in tensor_names if (m := _LAYER_RE.match(n))}
    missing = [i for i in range(blocks) if i not in present]
    if missing:
        raise ValueError(
            f"GGUF metadata declares {arch}.block_count={blocks} but the file has no tensors for "
            f"{len(missing)} of those layers (first: blk.{missing[0]})"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = size("vocab_size", 1, MAX_VOCAB) or (len(tokens) if isinstance(tokens, list) and tokens else None)
    if vocab is None:
        raise ValueError("GGUF metadata names no vocabulary size (no llama.vocab_size, no tokenizer.ggml.tokens)")
    head_dim = size("attention.key_length", 1, MAX_HEAD_DIM) or size("rope.dimension_count", 1, MAX_HEAD_DIM)
    architecture = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and experts:
        architecture = "MixtralForCausalLM"
    model_type = {
        "LlamaForCausalLM": "llama",
        "MixtralForCausalLM": "mixtral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
    }[architecture]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length", 0, MAX_INTERMEDIATE, 0) or 0,
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "max_position_embeddings": size("context_length", 1, MAX_POSITIONS, 2048),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": number("rope.freq_base", 1000000.0 if model_type == "mixtral" else 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "torch_dtype": _checkpoint_dtype(meta),
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported GGUF rope.scaling.type {scaling!r} (only 'linear')")
        config["rope_scaling"] = {"rope_type": "linear", "factor": number("rope.scaling.factor", 1.0)}
    if experts:
        config["num_experts_per_tok"] = size("expert_used_count", 1, experts, required=True)
        if model_type == "mixtral":
            config["num_local_experts"] = experts
        else:
            config["num_experts"] = experts
            config["moe_intermediate_size"] = size("expert_feed_forward_length", 1, MAX_INTERMEDIATE, required=True)
            # llama.cpp's qwen3moe graph always renormalises the top-k weights.
            config["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    for name, meta_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if meta.get(meta_key) is not None:
            config[name] = int(meta[meta_key])
    return config


def _checkpoint_dtype(meta: dict[str, Any]) -> str:
    """The dtype to compute in on GPU: the file's float type, bfloat16 for quantized files."""
    file_type = meta.get("general.file_type")  # llama_ftype: 0 = all F32, 1 = mostly F16, 32 = mostly BF16
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "bfloat16")


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row interleave of a q/k projection (rows are heads * head_dim)."""
    shape = weight.shape
    half = shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def is_linear(name: str) -> bool:
    """Whether a GGUF tensor is a linear projection of a layer (what may stay quantized)."""
    match = _LAYER_RE.match(name)
    return match is not None and (match.group(2) in _LINEAR_TENSORS or _EXPERT_RE.match(match.group(2)) is not None)


def _kind(name: str) -> str:
    """A layer tensor's name without its layer (`blk.3.attn_q.weight` -> `attn_q.weight`)."""
    match = _LAYER_RE.match(name)
    return match.group(2) if match else name


def _stack_kind(name: str) -> str:
    """What one layer stack holds across layers (`blk.3.attn_v.weight` -> `attn_v.weight`; every
    expert of a layer in one stack: `ffn_down_exps`)."""
    kind = _kind(name)
    expert = _EXPERT_RE.match(kind)
    return f"ffn_{expert.group(1)}_exps" if expert else kind


def held_types(reader) -> dict[str, str]:
    """Each linear tensor kind (`_stack_kind`) -> the block type its layer stack is held in on
    the device (`gguf_blocks.held_type`: its layers' own type, or for a stack mixing K-quants
    the wider layout holding each layer's blocks exactly), or "" when it loads dequantized (a
    float type, a type not kept quantized, or another mix)."""
    types: dict[str, set[str]] = {}
    for tensor in reader.tensors:
        if is_linear(tensor.name):
            types.setdefault(_stack_kind(tensor.name), set()).add(tensor.tensor_type.name)
    held = {kind: held_type(found) for kind, found in types.items()}
    return {kind: t if t in KEPT_QUANTIZED or t == "K_INT8" else "" for kind, t in held.items()}


def kept_quantized_type(reader) -> Optional[str]:
    """The block type most quantized linear projections are held in (the checkpoint's
    `weight_type`; the others are listed in `weight_types`), None when none stays quantized."""
    held = held_types(reader)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = held.get(_stack_kind(tensor.name), "") if is_linear(tensor.name) else ""
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


def hf_tensors(
    reader, config: dict[str, Any], progress: bool = True, keep: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array in HF layout) for every tensor of the file: dequantized, except
    (with `keep`) linear projections whose layer stack is held quantized (`held_types`), which
    come as int8 values under their name and their per-block numbers in the file's precision
    under `<module>.weight_scale` (`.weight_offset`, `.weight_super_scale`,
    `.weight_super_offset`; `gguf_blocks.unpack_blocks`, in the stack's layout `as_held`)."""
    from gguf import GGMLQuantizationType, dequantize

    permute = config["model_type"] in ("llama", "mixtral")
    mixtral = config["model_type"] == "mixtral"
    unknown: list[str] = []
    held = held_types(reader) if keep else {}
    for tensor in tqdm(reader.tensors, desc="Reading GGUF", unit="tensor", disable=not progress):
        name = tensor.name
        qtype = GGMLQuantizationType(tensor.tensor_type)
        layout = held.get(_stack_kind(name), "") if is_linear(name) else ""
        if layout:
            parts = as_held(unpack_blocks(np.asarray(tensor.data), qtype.name), qtype.name, layout)
            for suffix, array in parts.items():
                for hf_name, renamed in _renamed(name, array, config, permute, mixtral, unknown):
                    yield hf_name.removesuffix("weight") + suffix, renamed
            continue
        array = np.asarray(dequantize(tensor.data, qtype))
        array = array.astype(np.float16 if qtype == GGMLQuantizationType.F16 else np.float32, copy=False)
        yield from _renamed(name, array, config, permute, mixtral, unknown)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
        raise ValueError(f"GGUF tensors this converter does not know: {shown}")


def _renamed(
    name: str, array: np.ndarray, config: dict[str, Any], permute: bool, mixtral: bool, unknown: list[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """One GGUF tensor under its Hugging Face name(s), q/k rows un-permuted, experts split."""
    if name in _GLOBAL_TENSORS:
        yield _GLOBAL_TENSORS[name], array
        return
    match = _LAYER_RE.match(name)
    if match is None:
        unknown.append(name)
        return
    layer, rest = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_TENSORS:
        if permute and rest.startswith(("attn_q.", "attn_k.")):
            heads = config["num_attention_heads"] if rest.startswith("attn_q") else config["num_key_value_heads"]
            array = _unpermute(array, heads)
        yield prefix + _LAYER_TENSORS[rest], array
    elif rest == "ffn_gate_inp.weight":
        yield prefix + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight"), array
    elif (expert := _EXPERT_RE.match(rest)) is not None:
        qwen_name, mixtral_name = _EXPERT_PROJ[expert.group(1)]
        block = "block_sparse_moe" if mixtral else "mlp"
        proj = mixtral_name if mixtral else qwen_name
        if expert.group(2) is not None:
            yield f"{prefix}{block}.experts.{int(expert.group(2))}.{proj}.weight", array
        else:
            for e in range(array.shape[0]):
                yield f"{prefix}{block}.experts.{e}.{proj}.weight", np.ascontiguousarray(array[e])
    else:
        unknown.append(name)


def _module_types(reader, config: dict[str, Any]) -> dict[str, str]:
    """Hugging Face module name of every linear projection -> the block type it is held in
    (`held_types`; "" for those loaded as float)."""
    held = held_types(reader)
    out: dict[str, str] = {}
    for tensor in reader.tensors:
        if is_linear(tensor.name):
            data = np.zeros((tensor.data.shape[0],) + (1,) * (tensor.data.ndim - 1), np.float32)  # names only
            for n, _ in _renamed(tensor.name, data, config, False, config["model_type"] == "mixtral", []):
                out[n.removesuffix(".weight")] = held[_stack_kind(tensor.name)]
    return out


def _tokenizer_dict(meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata transformers' GGUF tokenizer converters read, under their names."""
    keys = {
        "model": "tokenizer_type",
        "pre": "pre_tokenizer_type",
        "tokens": "tokens",
        "scores": "scores",
        "token_type": "token_type",
        "merges": "merges",
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "unknown_token_id": "unk_token_id",
        "padding_token_id": "pad_token_id",
        "add_space_prefix": "add_prefix_space",
    }
    return {ours: meta[f"tokenizer.ggml.{gguf}"] for gguf, ours in keys.items() if f"tokenizer.ggml.{gguf}" in meta}


def _convert_tokenizer(architecture: str, tokenizer_dict: dict[str, Any]):
    try:  # transformers >= 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


def write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the file's chat template) from the metadata."""
    from jaxllm.tokenizer import quiet_transformers_import

    quiet_transformers_import()
    from tokenizers import pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    info = _tokenizer_dict(meta)
    if "tokens" not in info:
        raise ValueError("GGUF file carries no tokenizer (no tokenizer.ggml.tokens); pass --tokenizer DIR")
    try:
        backend = _convert_tokenizer(meta.get("general.architecture", ""), info)
    except (ValueError, KeyError, ImportError) as exc:
        raise ValueError(
            f"could not build a tokenizer from the GGUF metadata "
            f"(tokenizer.ggml.model={info.get('tokenizer_type')!r}): {exc}"
        ) from exc
    if info.get("pre_tokenizer_type") == "smollm":
        # llama.cpp's 'smollm' pre-tokenizer: single digits, then GPT-2's split (SmolLM's tokenizer.json).
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens = info["tokens"]

    def token(id_key: str) -> Optional[str]:
        index = info.get(id_key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", info.get("tokenizer_type") == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, info["bos_token_id"])]
        )
    kwargs: dict[str, Any] = dict(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unk_token_id"),
        pad_token=token("pad_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    tokenizer = PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
    tokenizer.save_pretrained(str(out_dir))


def _write_shards(
    tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, skip: set[str], shard_bytes: Optional[int] = None
) -> None:
    """`model.safetensors`, or shards of about `shard_bytes` (default SHARD_BYTES) plus their index,
    so that only one shard of dequantized weights is in memory at a time."""
    from safetensors.numpy import save_file

    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes

    shards: list[dict[str, np.ndarray]] = [{}]
    size, files = 0, []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out_dir / name), metadata={"format": "pt"})
        files.append((name, list(shards[-1])))

    for name, array in tensors:
        if name in skip:
            continue
        if size and size + array.nbytes > shard_bytes:
            flush()
            shards[-1], size = {}, 0
        shards[-1][name] = array
        size += array.nbytes
    if not files:  # one file
        save_file(shards[-1], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    flush()
    weight_map = {tensor: name for name, names in files for tensor in names}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, progress: bool = True, keep_quantized: bool = True
) -> Path:
    """Write the Hugging Face model directory equivalent to `gguf_path` into `out_dir`
    (`keep_quantized=False`: every tensor dequantized, a float checkpoint)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = _open(gguf_path)
    try:
        meta = read_metadata(reader)
        names = {t.name for t in reader.tensors}
        config = hf_config_from_gguf(meta, names)
    except ValueError as exc:
        raise ValueError(f"{gguf_path}: {exc}") from None
    except (TypeError, KeyError, IndexError, OverflowError) as exc:
        raise ValueError(f"{gguf_path}: malformed metadata ({type(exc).__name__}: {exc})") from None
    keep = kept_quantized_type(reader) if keep_quantized else None
    if keep is not None:  # its linear projections stay quantized (jaxllm.models.quant_config._parse_gguf)
        types = _module_types(reader, config)
        config["quantization_config"] = {
            "quant_method": "gguf",
            "weight_type": keep,
            "weight_types": {m: t for m, t in types.items() if t and t != keep},
            "modules_to_not_convert": [m for m, t in types.items() if not t],
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _write_shards(
            hf_tensors(reader, config, progress=progress, keep=keep is not None),
            out_dir,
            skip={"lm_head.weight"} if config["tie_word_embeddings"] else set(),
        )
    except ValueError as exc:
        raise ValueError(f"{gguf_path}: {exc}") from None
    except (TypeError, KeyError, IndexError, OverflowError, NotImplementedError) as exc:
        raise ValueError(f"{gguf_path}: unreadable tensor data ({type(exc).__name__}: {exc})") from None
    write_tokenizer(meta, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir
