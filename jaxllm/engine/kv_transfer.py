"""Moving a request's KV blocks between worker processes through host memory (TCP, or shared memory).

The context worker runs a `KvTransferServer`: a generation worker connects, sends one JSON
line `{"ctx_request_id": ..., "opaque_state": ...}`, and gets back a frame header (4-byte
big-endian length, then JSON: the prompt's token ids, tokens per block, each page array's
block shape and dtype, the block count of each chunk) followed by the raw bytes, chunk by
chunk and, within a chunk, page array by page array. A claim that fails gets a header with
`error` and no bytes. The server copies one chunk (at most `max_tokens_in_buffer` tokens of
blocks) to host memory at a time, while the engine serves on: the claim itself is one call
on the engine thread (`export`), which dispatches the device reads and drops the hold.

Shared memory (a claim with `"shared_memory": true`, from a generation worker on the same
host): the server writes the blocks, in the same order, into a `multiprocessing.shared_memory`
segment and sends the header with the segment's name instead of the bytes; once the client
answers `done` the segment is kept for a later claim (`SegmentPool`), and it is removed if the
connection ends without that.

Device to device (a claim with `"transport": "TRANSFER"`): the server offers the gathered
blocks to `jax.experimental.transfer` (`jaxllm.engine.kv_device_transfer`) and sends, in the
header, its transfer server's address, one id per chunk and each chunk's padded block count;
the client pulls them onto its device and answers `done`.

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
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine import kv_device_transfer
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
            reader = sock.makefile("rb")
            claim = json.loads(reader.readline(MAX_CLAIM_BYTES))
            rid, token = int(claim["ctx_request_id"]), str(claim["opaque_state"])
            transport = str(claim.get("transport", "SHM" if claim.get("shared_memory") else "TCP"))
            if transport not in TRANSPORTS:
                raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._refuse(sock, f"a bad claim: {exc}")
            return
        try:
            exported = self.server.export(rid, token, transport != "TRANSFER")
        except (KeyError, RuntimeError, TimeoutError) as exc:
            self._refuse(sock, str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))
            return
        try:
            if transport == "SHM":
                self._send_shared(sock, reader, exported)
            elif transport == "TRANSFER":
                self._offer_device(sock, reader, exported)
            else:
                self._send(sock, exported)
        except (OSError, RuntimeError) as exc:
            logger.warning("KV transfer of ctx_request_id %d to %s was cut: %r", rid, self.client_address, exc)

    @staticmethod
    def _refuse(sock: socket.socket, message: str) -> None:
        try:
            _send_frame(sock, {"error": message})
        except OSError:
            pass

    @staticmethod
    def _header(exported: ExportedKv, **extra: Any) -> dict:
        return {
            "prompt_token_ids": exported.prompt_token_ids,
            "tokens_per_block": exported.tokens_per_block,
            "layout": [[list(shape), dtype] for shape, dtype in exported.layout],
            "chunks": [n for n, _ in exported.chunks],
            **extra,
        }

    @staticmethod
    def _host_pieces(exported: ExportedKv):
        """The blocks as host bytes, chunk by chunk (one chunk's copy at a time)."""
        for n, arrays in exported.chunks:
            for array in arrays:
                yield np.ascontiguousarray(np.asarray(array)[:n]).view(np.uint8).reshape(-1)

    def _send(self, sock: socket.socket, exported: ExportedKv) -> None:
        _send_frame(sock, self._header(exported))
        for piece in self._host_pieces(exported):
            sock.sendall(memoryview(piece))

    def _send_shared(self, sock: socket.socket, reader: Any, exported: ExportedKv) -> None:
        """Write the blocks into a shared-memory segment and send its name; keep it for reuse
        once the generation worker says it copied them, remove it if the connection ends."""
        size = sum(int(np.prod(shape)) * _dtype(dtype).itemsize for shape, dtype in exported.layout)
        size *= exported.num_blocks
        segments = self.server.segments
        segment = segments.take(size)
        done = False
        try:
            offset = 0
            for piece in self._host_pieces(exported):
                np.ndarray(piece.size, np.uint8, buffer=segment.buf, offset=offset)[:] = piece
                offset += piece.size
            _send_frame(sock, self._header(exported, shared_memory=segment.name))
            done = reader.readline(16).strip() == b"done"  # the generation worker copied them
        finally:
            if done:
                segments.give(segment)
            else:  # it may still be reading: never reuse this one
                _remove(segment)

    def _offer_device(self, sock: socket.socket, reader: Any, exported: ExportedKv) -> None:
        """Offer the gathered blocks to JAX's transfer server and send where to pull them;
        the offers end when pulled, or after the I/O timeout."""
        server = self.server
        host = server.server_address[0]
        ids = kv_device_transfer.offer_chunks(exported.chunks, host, server.io_timeout)
        address = kv_device_transfer.advertised_address(
            kv_device_transfer.transfer_server(host), server.advertised_host
        )
        padded = [int(arrays[0].shape[0]) if arrays else n for n, arrays in exported.chunks]
        _send_frame(sock, self._header(exported, transfer_address=address, transfer_ids=ids, padded=padded))
        reader.readline(16)  # the generation worker's "done" (or the end of the connection)


TRANSPORTS = ("TCP", "SHM", "TRANSFER")


def _remove(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    segment.unlink()


class SegmentPool:
    """Shared-memory segments kept for the next hand-over. A fresh segment's pages are faulted
    in (and zeroed) as it is first written, which costs more than the copy itself (45 MiB:
    110-250 ms against 25-50 ms to copy it out, on a loaded 2-core machine), so a segment whose
    reader said `done` is kept for reuse: at most `keep` of them, all removed at `close`."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> shared_memory.SharedMemory:
        """The smallest kept segment of at least `size` bytes, else a new one."""
        with self._lock:
            fits = [s for s in self._free if s.size >= size]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._free.remove(segment)
                return segment
        return shared_memory.SharedMemory(create=True, size=max(size, 1))

    def give(self, segment: shared_memory.SharedMemory) -> None:
        """Keep a segment nobody reads any more (the smallest go beyond `keep`)."""
        with self._lock:
            self._free.append(segment)
            self._free.sort(key=lambda s: s.size)
            drop, self._free = self._free[: -self.keep], self._free[-self.keep :]
        for old in drop:
            _remove(old)

    def close(self) -> None:
        with self._lock:
            kept, self._free = self._free, []
        for segment in kept:
            _remove(segment)


class KvTransferServer(socketserver.ThreadingTCPServer):
    """Serves held KV blocks to generation workers (one thread per claim), and frees those
    whose claim time ran out. `export(request_id, opaque_state, to_host)` runs the claim on
    the engine thread; `expire()` frees expired holds there; `next_deadline()` says when."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        port: int,
        *,
        export: Callable[[int, str, bool], ExportedKv],
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
        self.segments = SegmentPool()

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
        self.segments.close()


def is_local(host: str) -> bool:
    """Whether `host` names this machine (loopback, or its own host name): shared memory works."""
    return host in ("localhost", "::1", socket.gethostname(), socket.getfqdn()) or host.startswith("127.")


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open another process's segment without this process's resource tracker taking it over
    (it would remove the segment, or warn of a leak, when this process exits)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # Python >= 3.13
    except TypeError:
        segment = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister("/" + name.lstrip("/"), "shared_memory")
        return segment


def fetch_kv(
    endpoint: str,
    ctx_request_id: int,
    opaque_state: str,
    *,
    timeout: float = 30.0,
    transport: str = "TCP",
    device: Optional[jax.Device] = None,
    transfer_host: str = "127.0.0.1",
) -> KvPayload:
    """Pull a held request's blocks from a context worker (KvTransferError on any failure).
    `transport`: "TCP" (the bytes on this connection), "SHM" (shared memory: the context
    worker is on this host) or "TRANSFER" (device to device onto `device`, through this
    process's JAX transfer server on `transfer_host`)."""
    host, port = parse_endpoint(endpoint)
    started = time.perf_counter()
    expected = received = 0
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            claim = {"ctx_request_id": int(ctx_request_id), "opaque_state": str(opaque_state), "transport": transport}
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
            if "transfer_ids" in header:
                return _pull_device(endpoint, header, layout, chunks, device, transfer_host, timeout, started, sock)
            total = sum(chunks)
            arrays = [np.empty((total, *shape), _dtype(dtype)) for shape, dtype in layout]
            expected = sum(a.nbytes for a in arrays)
            if header.get("shared_memory"):
                _copy_shared(str(header["shared_memory"]), arrays, chunks)
                received = expected
                sock.sendall(b"done\n")
                chunks = []
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
    logger.debug("pulled %d bytes from %s in %.1f ms", received, endpoint, (time.perf_counter() - started) * 1e3)
    return KvPayload(
        [int(t) for t in header["prompt_token_ids"]],
        int(header["tokens_per_block"]),
        layout,
        arrays,
        transfer_seconds=time.perf_counter() - started,
        backend="SHM" if header.get("shared_memory") else "TCP",
    )


def _pull_device(
    endpoint: str,
    header: dict,
    layout: list[tuple[tuple[int, ...], str]],
    chunks: list[int],
    device: Optional[jax.Device],
    host: str,
    timeout: float,
    started: float,
    sock: socket.socket,
) -> KvPayload:
    """The TRANSFER answer: pull the offered chunks onto `device`, then say `done`."""
    if device is None:
        raise KvTransferError("a device transfer needs the generation worker's device")
    padded = [int(p) for p in header["padded"]]
    shapes = [[((p, *shape), dtype) for shape, dtype in layout] for p in padded]
    try:
        pulled = kv_device_transfer.pull_chunks(
            str(header["transfer_address"]), [int(i) for i in header["transfer_ids"]], shapes, device, host, timeout
        )
    except kv_device_transfer.PullError as exc:
        raise KvTransferError(str(exc)) from None
    sock.sendall(b"done\n")
    return KvPayload(
        [int(t) for t in header["prompt_token_ids"]],
        int(header["tokens_per_block"]),
        layout,
        [],
        transfer_seconds=time.perf_counter() - started,
        backend="TRANSFER",
        device_chunks=list(zip(chunks, pulled)),
    )


def _copy_shared(name: str, arrays: list[np.ndarray], chunks: list[int]) -> None:
    """Copy the blocks out of the context worker's segment (same layout as the TCP stream)."""
    segment = _attach(name)
    try:
        offset, start = 0, 0
        for n in chunks:
            for array in arrays:
                view = array[start : start + n].view(np.uint8).reshape(-1)
                if offset + view.size > segment.size:
                    raise KvTransferError(f"the shared-memory segment {name} is smaller than its header says")
                view[:] = np.frombuffer(segment.buf, np.uint8, count=view.size, offset=offset)
                offset += view.size
            start += n
    finally:
        segment.close()
