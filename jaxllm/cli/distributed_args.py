"""The multi-host flags of `serve`, `chat`, `generate` and `worker` (jax.distributed): every process
of a run gets the same command with its own --process-id; unset flags are left to the environment."""

from __future__ import annotations

import argparse


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Multi-host flags: every process of the run gets the same command with its own --process-id."""
    g = parser.add_argument_group(
        "multi-host (jax.distributed)",
        "Run one model over the devices of several processes or hosts: start the same command on every host "
        "with its own --process-id; process 0 serves, the others follow. Unset flags are read from "
        "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM (srun) or Open MPI (mpirun); "
        "without any of them the run is a single process.",
    )
    g.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordination service, reachable from every host",
    )
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's rank (0: the leader)")
    g.add_argument(
        "--local-device-ids",
        default=None,
        metavar="IDS",
        help="comma-separated devices of this host the process uses (unset: all)",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat after which a process counts as dead or hung (the leader "
        "then fails its requests and exits; followers exit)",
    )
    g.add_argument(
        "--initialization-timeout",
        type=int,
        default=300,
        help="seconds every process has to join the run; past it a process that is still waiting for "
        "the others says so in one line and exits with status 2",
    )
    g.add_argument(
        "--plan-channel",
        dest="multihost_plan_channel",
        choices=["kv", "collective"],
        default="kv",
        help="how the leader sends each step's plan: the coordination service's key-value store, "
        "or a broadcast_one_to_all device collective",
    )


def distributed_config(args: argparse.Namespace):
    """DistributedConfig from the multi-host flags (unset ones: the environment decides)."""
    from sharding.multihost import DistributedConfig

    ids = getattr(args, "local_device_ids", None)
    return DistributedConfig(
        coordinator_address=getattr(args, "coordinator_address", None),
        num_processes=getattr(args, "num_processes", None),
        process_id=getattr(args, "process_id", None),
        local_device_ids=tuple(int(i) for i in ids.split(",")) if ids else None,
        heartbeat_timeout=getattr(args, "heartbeat_timeout", 10.0),
        initialization_timeout=getattr(args, "initialization_timeout", 300),
    )
