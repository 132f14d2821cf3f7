"""Engine step timing that cannot hide a device wait: blocking device reads counted and timed
(`jaxllm.engine.device_reads`), waits inside the program calls excluded from host time."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.bench.host_overhead import DeviceWatcher
from jaxllm.engine import device_reads
from jaxllm.engine.step_output import EngineTiming

from conftest import tiny_engine

PROMPTS = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(4)]


def _run(engine, params: SamplingParams) -> list[int]:
    """Run PROMPTS to the end; the blocking reads of each step."""
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    reads = []
    while engine.has_unfinished_requests():
        before = engine.timing.blocking_reads
        engine.step()
        reads.append(engine.timing.blocking_reads - before)
    return reads


@pytest.fixture(scope="module")
def overlapped():
    return tiny_engine("tiny-dense")


@pytest.fixture(scope="module")
def serial():
    return tiny_engine("tiny-dense", disable_overlap_scheduler=True)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_each_dispatched_step_is_read_back_once_overlapped(overlapped):
    engine = overlapped
    engine.reset_timing()
    first_iteration = engine.iteration
    reads = _run(engine, GREEDY)
    dispatched = engine.iteration - first_iteration
    # Step N reads step N-1's tokens: nothing in the first step (the prompts' step is in
    # flight), one read in every later one, the last step reading back the final tokens only.
    assert reads == [0] + [1] * dispatched
    assert engine.timing.blocking_reads == dispatched >= GREEDY.max_tokens
    assert engine.timing.steps == len(reads)


def test_each_step_reads_its_own_tokens_without_overlap(serial):
    engine = serial
    engine.reset_timing()
    first_iteration = engine.iteration
    reads = _run(engine, GREEDY)
    dispatched = engine.iteration - first_iteration
    assert dispatched >= GREEDY.max_tokens  # the prompts take two steps (16-token budget)
    assert reads == [1] * dispatched


def test_logprobs_come_back_in_the_same_read(overlapped):
    engine = overlapped
    engine.reset_timing()
    first_iteration = engine.iteration
    reads = _run(engine, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    assert reads == [0] + [1] * (engine.iteration - first_iteration)


def test_a_wait_inside_dispatch_is_not_host_time(overlapped, monkeypatch):
    """A program call that blocks without using the CPU (as XLA on a GPU does while it reads
    a `while` loop's device-valued predicate back) shows as dispatch wait, not host wall time."""
    engine = overlapped
    pause = 0.05
    execute = engine.step_runner.execute

    def blocking_execute(*args, **kwargs):
        time.sleep(pause)  # the thread is off the CPU, like one waiting on the device
        return execute(*args, **kwargs)

    _run(engine, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))  # every program compiled
    monkeypatch.setattr(engine.step_runner, "execute", blocking_execute)
    engine.reset_timing()
    first_iteration = engine.iteration
    _run(engine, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    t = engine.timing
    dispatched = engine.iteration - first_iteration
    assert dispatched >= 3
    # Wall minus thread CPU time of a sleep of `pause` is at least `pause` (minus clock ticks).
    assert t.dispatch_wait_seconds >= dispatched * pause * 0.98
    assert t.host_wall_seconds == pytest.approx(t.step_seconds - t.blocking_read_seconds - t.dispatch_wait_seconds)
    assert t.host_wall_seconds <= t.host_seconds - dispatched * pause * 0.98
    assert 0 < t.host_cpu_seconds <= t.step_seconds
    assert t.dispatch_wait_seconds <= t.dispatch_seconds


def test_timing_totals_as_dict():
    t = EngineTiming(steps=4, step_seconds=0.008, blocking_reads=4, blocking_read_seconds=0.004)
    d = t.as_dict()
    assert d["blocking_reads_per_step"] == 1.0
    assert d["step_ms_per_step"] == pytest.approx(2.0)
    assert t.device_wait_seconds == t.blocking_read_seconds  # the old name


def test_reads_are_counted_per_thread_and_host_values_are_free():
    tally = device_reads.thread_tally()
    before = tally.count
    array = jnp.arange(6) * 2
    assert device_reads.to_host(array).tolist() == [0, 2, 4, 6, 8, 10]
    assert tally.count == before + 1
    host = np.arange(3)
    assert device_reads.to_host(host) is host and device_reads.to_host(None) is None
    assert device_reads.all_to_host(host, None)[1] is None
    assert tally.count == before + 1  # nothing waited for a host value
    tokens, logprobs, missing = device_reads.all_to_host(array, array * 0.5, None)
    assert isinstance(tokens, np.ndarray) and logprobs.tolist()[1] == 1.0 and missing is None
    assert tally.count == before + 2  # several arrays, one read
    other = []
    thread = threading.Thread(target=lambda: other.append(device_reads.to_host(array + 1)))
    thread.start()
    thread.join()
    assert other[0][0] == 1 and tally.count == before + 2  # another thread's read is its own
    assert tally.seconds >= 0


def test_device_watcher_splits_busy_and_idle():
    watcher = DeviceWatcher()
    watcher.close()
    # Step 1 enqueued while step 0 ran (no idle); step 2 enqueued 2 s after step 1 ended.
    watcher.enqueued = [0.0, 1.0, 6.0]
    watcher.finished = [3.0, 4.0, 9.0]
    assert watcher.busy_times() == [1.0, 3.0]
    assert watcher.idle_gaps() == [0.0, 2.0]
