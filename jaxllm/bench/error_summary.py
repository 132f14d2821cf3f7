"""One-line descriptions of a benchmark case's exception, for tables and logs.

A GPU run's log is often all that comes back from a machine, and an `AssertionError`
from deep inside a compiler says nothing by its message alone: the line names where it
was raised, and the last frame of this project's own code on the way there."""

from __future__ import annotations

import os
import traceback

_OURS = ("jaxllm", "pallas_kernels", "sharding")


def _short(frame: traceback.FrameSummary) -> str:
    parts = frame.filename.replace(os.sep, "/").split("/")
    return f"{'/'.join(parts[-2:])}:{frame.lineno}"


def describe_error(e: BaseException, width: int = 200) -> str:
    """`Type: first line of the message [at file:line; ours file:line]`."""
    message = str(e).splitlines()[0][:width] if str(e) else ""
    frames = traceback.extract_tb(e.__traceback__)
    where = []
    if frames:
        where.append(f"at {_short(frames[-1])}")
        ours = [f for f in frames if any(f"/{p}/" in f.filename.replace(os.sep, "/") for p in _OURS)]
        if ours and ours[-1] is not frames[-1]:
            where.append(f"ours {_short(ours[-1])}")
    suffix = f" [{'; '.join(where)}]" if where else ""
    return f"{type(e).__name__}: {message}{suffix}"
