"""Start-up shared by the commands that run a model: progress and status lines on stderr,
--model resolution, joining a multi-host run (or following its leader), the engine banner,
compile progress and the executor, ready to serve or generate."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxllm.cli.args import engine_kwargs
from jaxllm.cli.distributed_args import distributed_config

# ----------------------------------------------------------------------------- terminal output
logger = logging.getLogger("jaxllm.cli")
# serve's one log format (its lines, uvicorn's and jaxllm's alike).
SERVE_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# JAX logs its failed probe for a TPU backend ("Unable to initialize backend 'tpu' ... libtpu.so")
# on every start on a machine without one: noise to a user.
BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def status(message: str) -> None:
    """One progress or status line on stderr (stdout is for generated text), through the `jaxllm`
    logger: a plain line for chat and generate (`quiet_logs`), a log line for serve (`serve_logs`)."""
    logger.info(message)


def quiet_logs(level: str = "warning") -> None:
    """jaxllm's own messages as plain lines on stderr; other libraries only from `level` up."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(BACKEND_PROBE_LOGGER).setLevel(logging.ERROR)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    jax_logger = logging.getLogger("jaxllm")
    jax_logger.handlers[:] = [handler]
    jax_logger.setLevel(logging.INFO)
    jax_logger.propagate = False


def serve_logs(level: str = "info") -> logging.Handler:
    """Every log line of `jaxllm serve` in one format on stderr: one root handler, which jaxllm's
    and uvicorn's loggers propagate to (uvicorn must then be started without its own logging
    configuration); JAX's TPU probe silenced. Returns the handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(SERVE_LOG_FORMAT))
    handler.set_name("jaxllm-serve")
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if h.get_name() != handler.get_name()] + [handler]
    root.setLevel(level.upper())
    for name in ("jaxllm", *UVICORN_LOGGERS):
        named = logging.getLogger(name)
        named.handlers[:] = []
        named.propagate = True
        named.setLevel(logging.NOTSET)
    logging.getLogger(BACKEND_PROBE_LOGGER).setLevel(logging.ERROR)
    return handler


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


# ----------------------------------------------------------------------------- model and multi-host
def resolve_model_arg(args: argparse.Namespace) -> str:
    """Materialize --model (download, convert, Hub snapshot) with progress on stderr; returns a directory."""
    from jaxllm.models.resolve import resolve_model

    started = time.perf_counter()
    path = resolve_model(args.model, revision=getattr(args, "revision", None), log=status)
    if str(path) != args.model:
        status(f"model {args.model}: {path} ({time.perf_counter() - started:.1f} s)")
    return str(path)


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

    expected = resolve_model_arg(args) if getattr(args, "model", None) else None
    return run_follower(expected)


# ----------------------------------------------------------------------------- engine
def engine_banner(engine, model: str) -> str:
    """What the engine runs on and what it holds, in a few lines."""
    import jax

    from jaxllm.models import kv_cache_bytes_per_token

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    cfg = engine.model_config
    kv = engine.kv_cache_manager
    tpb = kv.tokens_per_block
    kv_bytes = kv.num_blocks * tpb * kv_cache_bytes_per_token(cfg)
    ec = engine.config
    layout = ec.parallel_config()
    attention = f"dp x{layout.tensor_parallel_size}" if layout.enable_attention_dp else "tp"
    return "\n".join(
        [
            f"jaxllm: {model} ({cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size})",
            f"  device    {devices[0].platform} x{len(devices)} ({', '.join(kinds)}), jax {jax.__version__}",
            f"  parallel  tp={layout.tensor_parallel_size} ep={layout.moe_expert_parallel_size} "
            f"moe_tp={layout.moe_tensor_parallel_size} attention={attention}",
            f"  backends  attention={engine.attention_backend} moe={engine.moe_backend}  dtype={cfg.dtype}",
            f"  weights   {weights_held(cfg, ec.dequantize_on_load, devices[0].platform)}",
            f"  KV cache  {kv.num_blocks * tpb} tokens, {format_bytes(kv_bytes)} ({kv.num_blocks} blocks x {tpb} "
            f"tokens): {kv_cache_sizing(devices[0])}",
            f"  limits    max_batch_size={ec.max_batch_size} max_num_tokens={ec.max_num_tokens} "
            f"max_seq_len={engine.max_seq_len}",
            f"  compiled  {compiled_buckets(engine)}",
        ]
    )


def weights_held(cfg, dequantize_on_load, platform: str) -> str:
    """How the weights are held, and on a CPU the flag that changes an integer checkpoint's."""
    from jaxllm.models.quantized_loading import dequantizes_on_load, describe_weights

    text = describe_weights(cfg)
    if platform == "cpu" and dequantize_on_load is None and cfg.dequantized_from is not None:
        text += " (CPU: --dequantize-on-load off keeps them quantized)"
    elif platform == "cpu" and dequantizes_on_load(cfg, None, platform):  # kept integer weights on a CPU
        text += " (CPU: --dequantize-on-load auto runs them faster in float)"
    return text


def kv_cache_sizing(device) -> str:
    """What sizes the KV cache, by the flags that change it."""
    try:
        has_stats = bool(device.memory_stats())
    except Exception:  # a backend without memory statistics raises or returns None
        has_stats = False
    budget = "--kv-cache-free-gpu-memory-fraction of free memory" if has_stats else "4 GiB on a CPU"
    return f"the least of --kv-cache-max-tokens, --max-batch-size x --max-seq-len and {budget}"


def compiled_buckets(engine) -> str:
    """The compiled model forwards: one per token bucket and per small decode bucket."""
    plan = engine.program_warmup
    buckets, rows = plan.planner.token_buckets(), plan.decode_sizes()
    text = f"{plan.num_forwards()} forwards: token buckets {','.join(map(str, buckets))}"
    if rows:
        text += f" + decode buckets of {','.join(map(str, rows))} rows (--decode-batch-sizes)"
    return text


def warm_up(engine, all_variants: bool = True, background: bool = False) -> None:
    """Compile every step shape with a progress bar ("compiling N token buckets..."); with
    `background`, only the one-row decode bucket, the decode token bucket, a prompt bucket and the samplers before
    returning (see `LLMEngine.warmup`). The bar's length is known before anything compiles
    and the bar ends full."""
    from tqdm.auto import tqdm

    plan = engine.program_warmup
    forwards = plan.num_forwards()
    first = len(plan.first_buckets()) + len(plan.first_decode_sizes())
    desc = (
        f"compiling {first} of {forwards} forwards + sampler, {forwards - first} more when idle"
        if plan.in_background(background) and forwards > first
        else f"compiling {forwards} forwards + sampler"
    )
    total = plan.num_pieces(all_variants, background)
    with tqdm(total=total, desc=desc, unit="graph", file=sys.stderr, leave=True) as bar:

        def progress(done: int, total: int) -> None:
            bar.update(min(done, bar.total) - bar.n)

        engine.warmup(all_variants=all_variants, progress=progress, background=background)
        bar.update(bar.total - bar.n)


def start_executor(
    args: argparse.Namespace,
    model_dir: str,
    *,
    warmup: bool = True,
    all_variants: bool = True,
    background_warmup: bool = False,
    executor_kwargs: dict | None = None,
    started: float | None = None,
    kwargs: dict | None = None,
):
    """Build the executor on `model_dir`, print the banner, compile, print "ready in X s".

    `kwargs`: EngineConfig arguments (default: `engine_kwargs(args)`)."""
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor

    started = time.perf_counter() if started is None else started
    kwargs = engine_kwargs(args) if kwargs is None else kwargs
    executor = GenerationExecutor(EngineConfig(model=model_dir, **kwargs), ExecutorConfig(**(executor_kwargs or {})))
    try:
        status(executor.call_on_engine(lambda engine: engine_banner(engine, args.model), timeout=None))
        if warmup:
            executor.call_on_engine(lambda engine: warm_up(engine, all_variants, background_warmup), timeout=None)
    except BaseException:
        executor.shutdown()
        raise
    status(f"ready in {time.perf_counter() - started:.1f} s")
    return executor
