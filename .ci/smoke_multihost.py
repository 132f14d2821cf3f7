"""Smoke test of the multi-host example as a user runs it: `examples/multihost/two_processes.sh`
(warm-up on, process 0 serving, process 1 following), one completion, then Ctrl-C (SIGINT to
the whole process group, as a terminal sends it): both processes must exit 0, without JAX's
shutdown-barrier abort. Run by .ci/run with the base install's `jaxllm` first on PATH; small
serving flags keep the warm-up to about a minute on two cores. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--max-batch-size", "4", "--max-num-tokens", "64", "--max-seq-len", "128"]
    flags += ["--kv-cache-max-tokens", "512"]
    env = dict(os.environ, COORDINATOR_PORT=str(free_port()))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = Path(tempfile.mkdtemp()) / "two_processes.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [str(ROOT / "examples/multihost/two_processes.sh"), "tiny-moe", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, as in a terminal
        )
    try:
        started = time.monotonic()
        while True:
            if run.poll() is not None:
                raise SystemExit(f"the example exited with {run.returncode} before it was ready:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - started > 600:
                raise SystemExit(f"not ready within 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        ready = time.monotonic() - started
        body = json.dumps({"model": "tiny-moe", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.loads(response.read())
        assert reply["usage"]["completion_tokens"] == 5, reply
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        stopped = time.monotonic()
        code = run.wait(90)
        text = log.read_text()
        if code != 0 or "Check failure" in text or "Traceback" in text:
            raise SystemExit(f"Ctrl-C ended the example with status {code}:\n{text[-4000:]}")
        print(
            f"smoke: multi-host example ready in {ready:.0f} s (warm-up on), answered, stopped in "
            f"{time.monotonic() - stopped:.0f} s after Ctrl-C"
        )
        return 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
