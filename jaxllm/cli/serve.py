"""`jaxllm serve`: start the OpenAI-compatible server on one model.

The server (fastapi, uvicorn) is imported only once the flags are parsed, so the other
commands never load it."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from jaxllm.cli.args import (
    DEFAULT_MODEL,
    LOAD_ERRORS,
    ArgumentParser,
    HelpFormatter,
    add_engine_args,
    engine_kwargs,
)
from jaxllm.cli.distributed_args import add_distributed_args
from jaxllm.cli.startup import join_distributed, resolve_model_arg, run_follower_command, serve_logs, start_executor
from jaxllm.server.reasoning import REASONING_PARSERS
from jaxllm.server.tool_parsers import TOOL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="jaxllm serve",
        formatter_class=HelpFormatter,
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics in Prometheus format, "
        "/v1/iteration_stats).",
    )
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_engine_args(parser, DEFAULT_MODEL)
    add_distributed_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAXLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ routes (or set JAXLLM_API_KEY)",
    )
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the --model value)")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (HF PEFT directories) clients select with model NAME or MODEL:NAME (implies --enable-lora)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body accepted")
    parser.add_argument(
        "--num-postprocess-workers",
        type=int,
        default=0,
        help="processes that detokenize off the engine's process (0: a thread)",
    )
    parser.add_argument("--stream-interval", type=int, default=1, help="stream every N tokens")
    parser.add_argument("--disable-block-reuse", action="store_true", help="turn KV prefix reuse off")
    parser.add_argument("--no-warmup", action="store_true", help="skip compiling every token bucket before serving")
    parser.add_argument(
        "--warmup-all",
        action="store_true",
        help="compile every token bucket and sampler variant before reporting healthy (default: "
        "the largest bucket and the greedy sampler; the rest compile while serving, steps "
        "running padded in a compiled bucket meanwhile)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests supply their own chat template (rendering one can take unbounded time)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the model's tool-call format, parsed into message.tool_calls",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> off into message.reasoning_content",
    )
    parser.add_argument(
        "--kv-transfer-port",
        type=int,
        default=0,
        help="disaggregated serving (cache_transceiver_config in --config): the TCP port of the KV transfer "
        "server, on the --host address (0: any free port)",
    )
    parser.add_argument(
        "--kv-transfer-advertise-host",
        default=None,
        metavar="HOST",
        help="disaggregated serving: the name or address generation workers reach this worker's KV transfer "
        "server by (default: --host, or this machine's host name when --host is 0.0.0.0)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may finish before they are aborted",
    )
    return parser


def check_port_free(host: str, port: int) -> None:
    """Bind-test `host:port` the way uvicorn binds it (SO_REUSEADDR), before any model loads, so
    a busy port fails in a moment rather than after loading and compiling (ValueError)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def parse_lora_modules(specs: list[str] | None) -> dict:
    """`--lora-modules name=path ...` (vLLM's form) -> {name: LoRARequest}, ids 1, 2, ... in order."""
    from jaxllm.lora import LoRARequest

    modules: dict = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.model_pos:
        args.model = args.model_pos
    serve_logs(args.log_level)

    from jaxllm.server.app import build_app
    from jaxllm.server.lifecycle import ManagedServer, make_config
    from jaxllm.server.server_config import ServerConfig
    from sharding import multihost

    try:
        if join_distributed(args):  # not process 0: follow the leader's engine, serve nothing
            return run_follower_command(args)
        check_port_free(args.host, args.port)
        lora_modules = parse_lora_modules(args.lora_modules)
        if lora_modules:
            args.enable_lora = True
        kwargs = engine_kwargs(args)
        if args.disable_block_reuse:
            kwargs["kv_cache_config"].enable_block_reuse = False
        executor = start_executor(
            args,
            resolve_model_arg(args),
            warmup=not args.no_warmup,
            kwargs=kwargs,
            background_warmup=not args.warmup_all,
            started=started,
            executor_kwargs=dict(
                num_postprocess_workers=args.num_postprocess_workers, stream_interval=args.stream_interval
            ),
        )
        try:  # every adapter is read and checked now, not at its first request
            for lora_request in lora_modules.values():
                executor.engine.resolve_lora(lora_request)
        except ValueError:
            executor.shutdown()
            raise
    except LOAD_ERRORS as exc:
        print(f"jaxllm serve: error: {exc}", file=sys.stderr)
        return 2
    app = build_app(
        executor,
        ServerConfig(
            served_model_name=args.served_model_name or args.model,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            trust_request_chat_template=args.trust_request_chat_template,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            shutdown_timeout=args.shutdown_timeout,
            lora_modules=lora_modules,
            kv_transfer_host=args.host,
            kv_transfer_port=args.kv_transfer_port,
            kv_transfer_advertised_host=args.kv_transfer_advertise_host,
        ),
        shutdown_executor=True,
    )
    try:
        # uvicorn's loggers keep serve_logs' format: no logging configuration of its own.
        config = make_config(
            app,
            args.host,
            args.port,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            configure_logging=False,
        )
        server = ManagedServer(config, app.state.server, args.shutdown_timeout)
        server.run()
        code = server.exit_code
    finally:
        executor.shutdown()
    if code and multihost.is_multiprocess():
        multihost.exit_now(code)  # a failed run: no final barrier with processes that may be gone
    return code
