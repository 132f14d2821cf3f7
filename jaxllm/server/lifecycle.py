"""Running the server process: graceful shutdown on SIGTERM, exit on a dead engine.

SIGTERM (or Ctrl-C) first drains: new requests get 503 and /health turns 503, running
requests go on for up to `shutdown_timeout` seconds, then the rest are aborted (a stream
ends with an error event and `[DONE]`, a waiting call gets a 503), and only then does
uvicorn close the connections. A second signal exits at once.

A fatal engine failure has already failed every waiter (the executor does that); the
server then stops and `serve` returns 1, so the process exits non-zero and a supervisor
can restart it - as vLLM does with a dead engine.

Connections are bounded in time: idle keep-alive connections close after
`timeout_keep_alive` (uvicorn), a request head must arrive within `header_timeout` of the
connection opening or of the previous response (uvicorn has no such limit: a client
sending its headers a byte at a time could hold a connection forever), and the app bounds
body uploads and slow readers (`ServerConfig.body_timeout`, `send_timeout`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxllm.server.serving import OpenAIServer
from sharding import multihost

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 1
_FLUSH_SECONDS = 2.0  # after aborting, how long streams get to send their last events


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing connections whose request head is too slow."""

    header_timeout = 10.0
    _head_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            logger.info("closing a connection whose request head took over %gs", self.header_timeout)
            self.transport.close()


def make_config(
    app,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    timeout_keep_alive: int = 5,
    header_timeout: float = 10.0,
    configure_logging: bool = True,
) -> uvicorn.Config:
    """The uvicorn settings `serve` runs with (tests build their servers from it too).

    uvicorn's logging setup is `logging.config.dictConfig`, which closes every handler the
    process already has; an embedding process (tests under output capture) can keep its own
    with `configure_logging=False`."""
    protocol = type("BoundedH11", (BoundedH11Protocol,), {"header_timeout": header_timeout})
    logging_kwargs = {} if configure_logging else {"log_config": None}
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        **logging_kwargs,
        timeout_keep_alive=timeout_keep_alive,
        timeout_graceful_shutdown=max(1, int(shutdown_timeout + _FLUSH_SECONDS + 3)),
    )


class ManagedServer(uvicorn.Server):
    """A uvicorn server that drains on the first signal and stops when the engine dies."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.api = api
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Task] = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        multihost.on_stop_request(self.request_drain)  # a follower's SIGTERM (multi-host runs)
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.api.draining or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal (or one before start-up): stop now
            return
        self.request_drain(f"signal {sig}")

    def request_drain(self, reason: str) -> None:
        """Start draining (once; any thread): new requests get 503, running ones may finish."""
        if self.api.draining or self._loop is None:
            return
        logger.info("%s: draining for up to %gs", reason, self.shutdown_timeout)
        self.api.start_draining()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.api.num_live and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if self.api.num_live:
            count = self.api.abort_live()
            logger.warning("shutdown timeout: aborted %d request(s) still running", count)
            flush_until = loop.time() + _FLUSH_SECONDS
            while self.api.num_live and loop.time() < flush_until:
                await asyncio.sleep(0.05)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        executor = self.api.executor
        if executor.error is not None and not self.should_exit:
            logger.error("the engine failed (%r): stopping the server", executor.error)
            self.exit_code = ENGINE_DEAD_EXIT_CODE
            self.api.start_draining()
            self.should_exit = True
        return await super().on_tick(counter)


def serve(
    app,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    timeout_keep_alive: int = 5,
    header_timeout: float = 10.0,
) -> int:
    """Serve `app` (from `build_app`) until a signal or an engine failure; returns the exit code."""
    config = make_config(
        app,
        host,
        port,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        timeout_keep_alive=timeout_keep_alive,
        header_timeout=header_timeout,
    )
    server = ManagedServer(config, app.state.server, shutdown_timeout)
    server.run()
    return server.exit_code
