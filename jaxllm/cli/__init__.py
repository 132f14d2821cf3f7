"""Command line: `jaxllm chat | generate | serve | worker | bench | eplb | plan | convert`.

Model-loading problems (unknown model, missing file, offline Hub miss, unsupported
checkpoint) print one line on stderr and exit with status 2, never a traceback.
Progress and the start-up banner go to stderr; generated text goes to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import time

from jaxllm.cli.args import LOAD_ERRORS, ArgumentParser, HelpFormatter
from jaxllm.cli.chat import add_chat_parser, run_chat
from jaxllm.cli.generate import add_generate_parser, run_generate
from jaxllm.cli.startup import join_distributed, quiet_logs, run_follower_command

# Commands with a parser of their own: `jaxllm NAME ...` runs <module>.main(argv), the module imported
# only then (the server's fastapi, the converter's jax, the balancer's numpy stay out of the others).
SUBCOMMAND_MODULES = {
    "bench": "jaxllm.cli.bench",
    "eplb": "sharding.eplb.cli",
    "convert": "jaxllm.models.convert",
    "serve": "jaxllm.cli.serve",
    "worker": "jaxllm.cli.worker",
    "plan": "jaxllm.cli.plan",
    "disaggregated": "jaxllm.cli.disaggregated",
}


def package_version() -> str:
    """The installed distribution's version (pyproject's), or the package's own when run from a tree
    that is not installed."""
    try:
        return importlib.metadata.version("jaxllm")
    except importlib.metadata.PackageNotFoundError:
        from jaxllm import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="jaxllm", description="LLM inference in JAX and Pallas.", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"jaxllm {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_chat_parser(sub)
    add_generate_parser(sub)
    sub.add_parser("serve", help="OpenAI-compatible server (jaxllm serve --help)", add_help=False)
    sub.add_parser("worker", help="a follower process of a multi-host run (jaxllm worker --help)", add_help=False)
    sub.add_parser("bench", help="benchmarks (jaxllm bench --help lists them)", add_help=False)
    sub.add_parser(
        "eplb",
        help="expert load balancing: load report and placement YAML from recorded statistics (jaxllm eplb --help)",
        add_help=False,
    )
    sub.add_parser(
        "plan",
        help="per-device weight bytes and KV tokens of a layout, from config.json (jaxllm plan --help)",
        add_help=False,
    )
    sub.add_parser(
        "disaggregated",
        help="router of disaggregated prefill and decode workers (jaxllm disaggregated --help)",
        add_help=False,
    )
    sub.add_parser(
        "convert", help="write a checkpoint in the fast-restoring orbax format (jaxllm convert --help)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if argv and argv[0] in SUBCOMMAND_MODULES:
        return int(importlib.import_module(SUBCOMMAND_MODULES[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    quiet_logs()
    try:
        if join_distributed(args):
            return run_follower_command(args)
        if args.command == "generate":
            return run_generate(args, started)
        if args.command == "chat":
            return run_chat(args, started)
    except LOAD_ERRORS as exc:
        print(f"jaxllm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
