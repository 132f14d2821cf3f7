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


def test_flags_every_process_refuses_end_the_run_at_once_without_an_abort(tmp_path):
    """Leader and follower both refuse the run's flags (here `--max-num-tokens` below a KV
    block): the leader says why (status 2), the follower says why (status 1), and both leave
    through JAX's shutdown barrier within seconds. (A follower that left without it made JAX
    abort the leader 30 s later with a C++ stack dump.)"""
    from tests.multihost import ProcessGroup, distributed_flags

    group = ProcessGroup(tmp_path)
    bad = ["--tp-size", "4", "--max-num-tokens", "4", "--tokens-per-block", "8"]
    serve = [sys.executable, "-m", "jaxllm", "serve", "--model", "tiny-moe", "--port", str(free_port()), *bad]
    leader = group.start(serve + distributed_flags(group.port, 2, 0), "serve")
    follower = group.start([sys.executable, "-m", "jaxllm", "worker", *distributed_flags(group.port, 2, 1)], "worker")
    try:
        started = time.monotonic()
        assert group.wait(leader, 60) == 2 and group.wait(follower, 60) == 1, group.all_logs()
        assert time.monotonic() - started < 25, group.all_logs()
        logs = group.all_logs()
        assert "Check failure" not in logs and "Traceback" not in logs, logs
        assert "max_num_tokens (4) must be at least tokens_per_block (8)" in group.log(1), logs
    finally:
        group.close()
