"""Blocking device reads: every point where the engine thread waits for a device value.

The overlap scheduler hides host work behind the device only while the engine thread never
waits on the device except once per step, for the previous step's tokens. A wait anywhere
else (a second array read back, a `block_until_ready`, a future of device work) is device
time charged to the host unless it is counted, so every such wait on the engine's path goes
through this module: `to_host` (one array), `all_to_host` (several arrays, their copies
started together: one wait), `wait_ready` (a `block_until_ready`) or, for any other
blocking call, `blocking_read()`. Each call counts one read and adds its wall time to the
calling thread's `ReadTally`; the engine takes the tally's growth over a step
(`EngineTiming.blocking_reads` / `blocking_read_seconds`).

The tally is per thread, so reads on other threads (the logits processors' worker, a
benchmark's watcher) are not charged to the engine's steps, and several engines stepped on
one thread each see only their own step's reads (a step does not interleave with another).
A value that is already on the host (a numpy array, None) is returned as is and not
counted: nothing waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

_local = threading.local()


@dataclass
class ReadTally:
    """Running totals of one thread's blocking device reads (they only grow; take differences)."""

    count: int = 0
    seconds: float = 0.0


def thread_tally() -> ReadTally:
    """The calling thread's tally (made on first use)."""
    tally = getattr(_local, "tally", None)
    if tally is None:
        tally = _local.tally = ReadTally()
    return tally


@contextmanager
def blocking_read() -> Iterator[None]:
    """Count the block as one blocking read and time it (for waits that are not an array read:
    a future whose result is device work, a collective)."""
    tally = thread_tally()
    started = time.perf_counter()
    try:
        yield
    finally:
        tally.seconds += time.perf_counter() - started
        tally.count += 1


def to_host(value: Any) -> Any:
    """`np.asarray(value)` of a device array, counted as one read; a host value as it is."""
    if not isinstance(value, jax.Array):
        return value if value is None else np.asarray(value)
    tally = thread_tally()
    started = time.perf_counter()
    host = np.asarray(value)
    tally.seconds += time.perf_counter() - started
    tally.count += 1
    return host


def all_to_host(*values: Any) -> tuple[Any, ...]:
    """`to_host` of each value as ONE read: every device array's copy to the host starts
    before the thread waits for the first (`jax.device_get`), so they cost one round trip.
    None stays None; no read is counted when every value is already on the host."""
    if not any(isinstance(v, jax.Array) for v in values):
        return tuple(v if v is None else np.asarray(v) for v in values)
    with blocking_read():
        return tuple(jax.device_get(values))


def wait_ready(tree: T) -> T:
    """`jax.block_until_ready(tree)`, counted as one read."""
    with blocking_read():
        return jax.block_until_ready(tree)
