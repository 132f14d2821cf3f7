"""A multi-host follower runs each mirrored call as soon as that call's own program is ready:
it never waits for the whole queue of compiles the leader announced. (The leader is already
inside the program's first collective, and gloo gives up after 30 s: a follower that first
compiled every warm-up program timed out the leader's warm-up under CPU pressure.)"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from jaxllm.engine.followers import follow
from jaxllm.engine.plan_channel import encode


class _Channel:
    def __init__(self, messages: list) -> None:
        self.payloads = [encode(m) for m in messages]

    def recv(self, stop_reason) -> bytes:
        return self.payloads.pop(0)


class _Runner:
    """Compiles never finish unless released; `forward` records that it ran."""

    def __init__(self) -> None:
        self.queued: list[Future] = []
        self.forwards = 0

    def compile_forward(self, batch, feed_index, context_index=None, *, wait: bool = True):
        future: Future = Future()
        self.queued.append(future)
        if wait:
            future.result()  # a follower that waits here never reaches the call below
        return future

    def forward(self, batch, feed_index, prev_tokens):
        self.forwards += 1
        return np.zeros((2, 4), np.float32)


def test_a_mirrored_call_does_not_wait_for_unrelated_compiles():
    batch, feed = np.zeros(4, np.int32), np.full(4, -1, np.int32)
    messages = [("compile", "compile_forward", (batch, feed)) for _ in range(3)]
    messages += [("call", "forward", (batch, feed, None)), ("stop",)]
    runner = _Runner()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(calls=follow(runner, _Channel(messages))), daemon=True)
    thread.start()
    thread.join(timeout=10)
    for future in runner.queued:  # let a follower stuck on the queue go
        if not future.done():
            future.set_result(None)
    assert not thread.is_alive() and result == {"calls": 1}, "the forward waited for compiles it does not run"
    assert runner.forwards == 1 and len(runner.queued) == 3


def test_a_worker_started_with_another_model_is_refused(tmp_path):
    import json

    import pytest

    from jaxllm.engine.followers import check_same_model
    from jaxllm.models import materialize_preset

    moe, dense = str(materialize_preset("tiny-moe")), str(materialize_preset("tiny-dense"))
    check_same_model(moe, moe)
    check_same_model(moe, "tiny-moe")  # the leader named the preset, the worker its directory
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(json.loads(open(f"{moe}/config.json").read())))
    check_same_model(str(copy), moe)  # another directory with the same model
    with pytest.raises(ValueError, match="leader serves .*same model"):
        check_same_model(dense, moe)


def test_a_follower_whose_leader_stops_answering_exits_within_the_heartbeat_timeout(monkeypatch):
    """A stopped leader (SIGSTOP) leaves the coordination service's calls hanging instead of
    failing: the follower's watchdog reports it once no heartbeat round completes in time."""
    import time

    from sharding import multihost

    release = threading.Event()

    class _HangingClient:
        def key_value_set(self, *args, **kwargs):
            release.wait(30)

        def key_value_try_get(self, key):
            return "1"

    reported: list[str] = []
    monkeypatch.setattr(multihost, "kv_client", lambda: _HangingClient())
    monkeypatch.setattr(multihost, "report_failure", lambda message, grace=None: reported.append(message))
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 1)
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    monitor = multihost.Heartbeats(multihost.DistributedConfig(heartbeat_interval=0.05, heartbeat_timeout=0.5))
    started = time.monotonic()
    monitor.start()
    try:
        while not reported and time.monotonic() - started < 10:
            time.sleep(0.05)
    finally:
        monitor.stop()
        release.set()
    assert reported and "has not answered" in reported[0] and "leader hung or died" in reported[0]
    assert time.monotonic() - started < 3
