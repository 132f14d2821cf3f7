"""Multi-process runs for tests: several local processes joined by jax.distributed (gloo
collectives), each with its own fake CPU devices, and every process reliably ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.multidevice import FAST_COMPILE
from tests.server_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


def process_env(num_devices: int = 2) -> dict:
    # The processes compile as this one does (LLVM's optimizations off in a test run, see
    # tests/conftest.py): their tokens are compared with this process's engines.
    fast = FAST_COMPILE if FAST_COMPILE in os.environ.get("XLA_FLAGS", "") else ""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices} {fast}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "EXPERT_STATISTIC_ITER_RANGE"):
        env.pop(name, None)
    return env


def distributed_flags(port: int, num_processes: int, process_id: int, heartbeat_timeout: float = 5.0) -> list[str]:
    return [
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(process_id),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    ]


class ProcessGroup:
    """Processes started together; `close()` kills whatever still runs (each by its own pid)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.port = free_port()

    def start(self, argv: list[str], name: str, num_devices: int = 2) -> subprocess.Popen:
        log = self.logdir / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=process_env(num_devices),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start_function(
        self,
        module: str,
        function: str,
        process_id: int,
        num_processes: int,
        workdir: Path,
        heartbeat_timeout: float = 5.0,
    ) -> subprocess.Popen:
        """`tests.<module>.<function>(workdir)` in process `process_id` of the run."""
        code = (
            "import sys; from pathlib import Path; from sharding import multihost; "
            f"multihost.initialize(multihost.DistributedConfig('127.0.0.1:{self.port}', {num_processes}, "
            f"{process_id}, heartbeat_timeout={heartbeat_timeout})); "
            f"from tests.{module} import {function}; sys.exit({function}(Path({str(workdir)!r})) or 0)"
        )
        return self.start([sys.executable, "-c", code], f"{function}-{process_id}")

    def log(self, index: int) -> str:
        return self.logs[index].read_text(errors="replace")

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process {proc.args[:3]} still runs after {timeout} s; logs:\n" + self.all_logs()
            ) from None

    def all_logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in self.logs)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
