"""`jaxllm serve`: start the OpenAI-compatible server on one model."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

from jaxllm.cli import _add_engine_args, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm serve", description="OpenAI-compatible server.")
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    _add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/ routes (or set JAXLLM_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--num-postprocess-workers", type=int, default=0,
                        help="processes that detokenize off the engine's process (0: a thread)")
    parser.add_argument("--stream-interval", type=int, default=1, help="stream every N tokens")
    parser.add_argument("--disable-block-reuse", action="store_true", help="turn KV prefix reuse off")
    parser.add_argument("--no-warmup", action="store_true", help="skip compiling every token bucket before serving")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_pos:
        args.model = args.model_pos
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from jaxllm.engine.config import EngineConfig
    from jaxllm.executor.executor import ExecutorConfig, GenerationExecutor
    from jaxllm.server.app import ServerConfig, build_app

    kwargs = engine_kwargs(args)
    kwargs["kv_cache_config"].enable_block_reuse = not args.disable_block_reuse
    executor = GenerationExecutor(
        EngineConfig(model=args.model, **kwargs),
        ExecutorConfig(num_postprocess_workers=args.num_postprocess_workers, stream_interval=args.stream_interval))
    if not args.no_warmup and hasattr(executor.engine, "warmup"):
        logging.getLogger("jaxllm.server").info("compiling the step for every token bucket ...")
        executor.call_on_engine(lambda engine: engine.warmup(), timeout=None)
    app = build_app(executor, ServerConfig(served_model_name=args.served_model_name or args.model,
                                           api_key=args.api_key, max_body_bytes=args.max_body_bytes),
                    shutdown_executor=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    finally:
        executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
