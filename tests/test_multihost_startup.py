"""A multi-host run that does not assemble (a process that never arrives) ends each waiting
process with one line and exit status 2 within --initialization-timeout, not JAX's C++ check
failure and stack dump."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from server_helpers import free_port


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "--process-id", "1"],  # its leader never starts
        ["serve", "--model", "tiny-moe", "--process-id", "0"],  # its follower never starts
    ],
)
def test_a_process_that_never_arrives_is_one_line(command):
    port = free_port()
    argv = [sys.executable, "-m", "jaxllm", *command, "--coordinator-address", f"127.0.0.1:{port}"]
    argv += ["--num-processes", "2", "--initialization-timeout", "3"]
    if command[0] == "serve":
        argv += ["--port", str(free_port())]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did not assemble within 3 s" in lines[-1] and "--num-processes" in lines[-1], proc.stderr[-2000:]
    assert "Check failure" not in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60
