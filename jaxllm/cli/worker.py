"""`jaxllm worker`: a follower process of a multi-host run (process 0 runs serve, generate or chat)."""

from __future__ import annotations

import sys

from jaxllm.cli.args import LOAD_ERRORS, ArgumentParser, HelpFormatter
from jaxllm.cli.distributed_args import add_distributed_args, distributed_config
from jaxllm.cli.startup import quiet_logs, run_follower_command


def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="jaxllm worker",
        formatter_class=HelpFormatter,
        description="A follower of a multi-host run: joins it, builds the engine process 0 opens (each "
        "process loads only its devices' weight shards), runs every step with it, and exits when "
        "process 0 exits. Process 0 runs `jaxllm serve` (or generate, chat, LLM(...)) with the "
        "same multi-host flags; `jaxllm serve` with those flags on a process other than 0 does the "
        "same as this command.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="fetch this model here before following (unset: the leader's model path must exist on this host)",
    )
    parser.add_argument("--revision", default=None, help="Hub revision of --model")
    add_distributed_args(parser)
    args = parser.parse_args(argv)
    quiet_logs()
    from sharding import multihost

    config = distributed_config(args)
    if not multihost.requested(config):
        print(
            "jaxllm worker: error: no multi-host run: give --coordinator-address, --num-processes and "
            "--process-id, or launch under srun / mpirun / JAX_COORDINATOR_ADDRESS",
            file=sys.stderr,
        )
        return 2
    try:
        multihost.initialize(config)
        if multihost.is_leader():
            print(
                "jaxllm worker: error: process 0 is the leader; run `jaxllm serve` (or generate, chat) there",
                file=sys.stderr,
            )
            return 2
        return run_follower_command(args)
    except LOAD_ERRORS as exc:
        print(f"jaxllm worker: error: {exc}", file=sys.stderr)
        return 2
