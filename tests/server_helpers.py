"""A live server for tests: the production uvicorn setup (`ManagedServer`) on 127.0.0.1 in a
thread, plus the leak checks the server tests share."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from jaxllm.server.lifecycle import ManagedServer, make_config


def live_threads() -> set[threading.Thread]:
    """Threads that must be gone once a server or executor is shut down."""
    return {t for t in threading.enumerate() if t.name != "tqdm_monitor" and not isinstance(t, threading._DummyThread)}


def assert_no_thread_left(before: set[threading.Thread], timeout: float = 10.0) -> None:
    """Threads started since `before` must end within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while live_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (live_threads() - before), f"leaked threads: {live_threads() - before}"


def wait_idle(executor, timeout: float = 20.0) -> None:
    """Every request finished and every KV block free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = executor.get_kv_cache_stats()
        if executor.num_unfinished == 0 and stats.free_num_blocks == stats.max_num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {executor.num_unfinished} unfinished, {stats}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app served as `jaxllm serve` serves it; stop() ends it and joins its thread."""

    def __init__(
        self, app, *, shutdown_timeout: float = 5.0, header_timeout: float = 10.0, exit_when_engine_dies: bool = True
    ) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = make_config(
            app,
            "127.0.0.1",
            self.port,
            shutdown_timeout=shutdown_timeout,
            log_level="warning",
            timeout_keep_alive=5,
            header_timeout=header_timeout,
            configure_logging=False,
        )
        # uvicorn's dictConfig would close handlers made earlier in the run, absl's among them, and
        # absl's closes its stream: pytest's capture buffer when it was made under capture.
        # Without the managed server's exit on a dead engine, the app's own answers to it stay observable.
        self.server = (
            ManagedServer(config, app.state.server, shutdown_timeout)
            if exit_when_engine_dies
            else uvicorn.Server(config)
        )
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
