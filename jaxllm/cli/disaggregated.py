"""`jaxllm disaggregated -c disagg.yaml`: the router in front of context and generation workers
(`jaxllm serve` processes started with `cache_transceiver_config` in their `--config`), as
`trtllm-serve disaggregated`. See docs/disaggregated-serving.md."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxllm.cli.args import ArgumentParser, HelpFormatter
from jaxllm.cli.startup import serve_logs


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="jaxllm disaggregated",
        formatter_class=HelpFormatter,
        description="OpenAI front end that runs each request's prefill on a context worker and its decode on a "
        "generation worker (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
    )
    parser.add_argument(
        "-c",
        "--config",
        required=True,
        metavar="YAML",
        help="hostname, port, context_servers: {num_instances, urls}, generation_servers: {num_instances, urls}",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAXLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ routes (or set JAXLLM_API_KEY; the YAML's api_key wins)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="router log level",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serve_logs(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per proxied request
    import uvicorn

    from jaxllm.server.disagg_config import DisaggConfig
    from jaxllm.server.disagg_router import build_router_app, describe

    try:
        config = DisaggConfig.from_yaml(args.config)
    except ValueError as exc:
        print(f"jaxllm disaggregated: error: {exc}", file=sys.stderr)
        return 2
    if config.api_key is None:
        config.api_key = args.api_key
    print(f"jaxllm disaggregated: http://{config.hostname}:{config.port} over {describe(config)}", flush=True)
    uvicorn.run(
        build_router_app(config), host=config.hostname, port=config.port, log_level=args.log_level, log_config=None
    )
    return 0
