"""Smoke test of the multi-host example as a user runs it: `examples/multihost/two_processes.sh`
(warm-up on, process 0 serving, process 1 following), one completion, then Ctrl-C (SIGINT to
the whole process group, as a terminal sends it): both processes must exit 0, without JAX's
shutdown-barrier abort. Run by .ci/run with the base install's `jaxllm` first on PATH; small
serving flags keep the warm-up to about a minute on two cores. Standard library only (and
smoke_serve.py's helpers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smoke_serve import free_port, post_json, wait_healthy  # .ci/, this script's directory

ROOT = Path(__file__).resolve().parent.parent


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
        ready = wait_healthy(url, run, 600, what="the example", log=log)
        reply = post_json(
            url + "/v1/completions", {"model": "tiny-moe", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
        )
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
