"""Moving a request's KV blocks between worker processes over TCP (the host-memory path).

The context worker runs a `KvTransferServer`: a generation worker connects, sends one JSON
line `{"ctx_request_id": ..., "opaque_state": ...}`, and gets back a frame header (4-byte
big-endian length, then JSON: the prompt's token ids, tokens per block, each page array's
block shape and dtype, the block count of each chunk) followed by the raw bytes, chunk by
chunk and, within a chunk, page array by page array. A claim that fails gets a header with
`error` and no bytes. The server copies one chunk (at most `max_tokens_in_buffer` tokens of
blocks) to host memory at a time, while the engine serves on: the claim itself is one call
on the engine thread (`export`), which dispatches the device reads and drops the hold.

`fetch_kv` is the generation side: a connection refused, a timeout or a stream cut half way
raises `KvTransferError` naming the endpoint and how far it got; nothing was written into
the generation worker's pool by then. The server also runs `expire` whenever a held
request's claim time has run out, so unclaimed blocks are freed even on an idle worker.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxllm.engine.kv_transceiver import ExportedKv, KvPayload

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 20  # a prompt's token ids and the layout; anything larger is not a header
MAX_CLAIM_BYTES = 4096


class KvTransferError(RuntimeError):
    """The blocks could not be pulled (the endpoint, and what went wrong)."""


def _dtype(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (optionally `tcp://host:port`, IPv6 hosts in brackets) -> (host, port)."""
    text = endpoint.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"disaggregated_params.ctx_info_endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    return host, int(port)


def _send_frame(sock: socket.socket, header: dict) -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exactly(sock: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


class _ClaimHandler(socketserver.BaseRequestHandler):
    server: KvTransferServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout)
        try:
            line = sock.makefile("rb").readline(MAX_CLAIM_BYTES)
            claim = json.loads(line)
            rid, token = int(claim["ctx_request_id"]), str(claim["opaque_state"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._refuse(sock, f"a bad claim: {exc}")
            return
        try:
            exported = self.server.export(rid, token)
        except (KeyError, RuntimeError, TimeoutError) as exc:
            self._refuse(sock, str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))
            return
        try:
            self._send(sock, exported)
        except OSError as exc:
            logger.warning("KV transfer of ctx_request_id %d to %s was cut: %r", rid, self.client_address, exc)

    @staticmethod
    def _refuse(sock: socket.socket, message: str) -> None:
        try:
            _send_frame(sock, {"error": message})
        except OSError:
            pass

    @staticmethod
    def _send(sock: socket.socket, exported: ExportedKv) -> None:
        _send_frame(
            sock,
            {
                "prompt_token_ids": exported.prompt_token_ids,
                "tokens_per_block": exported.tokens_per_block,
                "layout": [[list(shape), dtype] for shape, dtype in exported.layout],
                "chunks": [n for n, _ in exported.chunks],
            },
        )
        for n, arrays in exported.chunks:
            for array in arrays:
                host = np.ascontiguousarray(np.asarray(array)[:n])
                sock.sendall(memoryview(host.view(np.uint8).reshape(-1)))


class KvTransferServer(socketserver.ThreadingTCPServer):
    """Serves held KV blocks to generation workers (one thread per claim), and frees those
    whose claim time ran out. `export(request_id, opaque_state)` runs the claim on the
    engine thread; `expire()` frees expired holds there; `next_deadline()` says when."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        port: int,
        *,
        export: Callable[[int, str], ExportedKv],
        expire: Callable[[], Any],
        next_deadline: Callable[[], Optional[float]],
        advertised_host: Optional[str] = None,
        io_timeout: float = 30.0,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _ClaimHandler)
        self.export, self._expire, self._next_deadline = export, expire, next_deadline
        self.io_timeout = io_timeout
        self.advertised_host = advertised_host or host
        self._thread: Optional[threading.Thread] = None

    @property
    def endpoint(self) -> str:
        """Where generation workers reach this server (`ctx_info_endpoint`)."""
        host = self.advertised_host
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.server_address[1]}"

    def service_actions(self) -> None:
        """Between accepts (every poll interval): free the holds whose claim time ran out."""
        deadline = self._next_deadline()
        if deadline is not None and deadline <= time.monotonic():
            try:
                self._expire()
            except Exception:  # the engine is shutting down: its blocks go with it
                logger.debug("expiring held KV blocks failed", exc_info=True)

    def start(self) -> KvTransferServer:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.1}, name="jaxllm-kv-transfer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5.0)


def fetch_kv(endpoint: str, ctx_request_id: int, opaque_state: str, *, timeout: float = 30.0) -> KvPayload:
    """Pull a held request's blocks from a context worker (KvTransferError on any failure)."""
    host, port = parse_endpoint(endpoint)
    started = time.perf_counter()
    expected = received = 0
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            claim = {"ctx_request_id": int(ctx_request_id), "opaque_state": str(opaque_state)}
            sock.sendall(json.dumps(claim).encode() + b"\n")
            size_bytes = bytearray(_HEADER.size)
            if _recv_exactly(sock, memoryview(size_bytes)) < _HEADER.size:
                raise KvTransferError(f"the KV transfer from {endpoint} ended before its header")
            (size,) = _HEADER.unpack(size_bytes)
            if size > MAX_HEADER_BYTES:
                raise KvTransferError(f"the KV transfer from {endpoint} sent a {size}-byte header")
            raw = bytearray(size)
            if _recv_exactly(sock, memoryview(raw)) < size:
                raise KvTransferError(f"the KV transfer from {endpoint} was cut in its header")
            header = json.loads(raw)
            if "error" in header:
                raise KvTransferError(f"the context worker at {endpoint} refused the claim: {header['error']}")
            layout = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in header["layout"]]
            chunks = [int(n) for n in header["chunks"]]
            total = sum(chunks)
            arrays = [np.empty((total, *shape), _dtype(dtype)) for shape, dtype in layout]
            expected = sum(a.nbytes for a in arrays)
            start = 0
            for n in chunks:
                for array in arrays:
                    view = memoryview(array[start : start + n].view(np.uint8).reshape(-1))
                    got = _recv_exactly(sock, view)
                    received += got
                    if got < len(view):
                        raise KvTransferError(
                            f"the KV transfer from {endpoint} was cut after {received} of {expected} bytes"
                        )
                start += n
    except KvTransferError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        where = f" after {received} of {expected} bytes" if expected else ""
        raise KvTransferError(f"the KV transfer from {endpoint} failed{where}: {type(exc).__name__}: {exc}") from None
    return KvPayload(
        [int(t) for t in header["prompt_token_ids"]],
        int(header["tokens_per_block"]),
        layout,
        arrays,
        transfer_seconds=time.perf_counter() - started,
    )
