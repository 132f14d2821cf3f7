"""KV blocks from device to device between worker processes (`backend: TRANSFER`), through
`jax.experimental.transfer`, JAX's process-to-process array transfer (a transfer server per
process; the receiving side pulls arrays it names by a 64-bit id and their shapes).

The claim still travels over the KV transfer server's TCP connection
(`jaxllm.engine.kv_transfer`): the context worker offers the claimed request's gathered
blocks (device arrays, one set per chunk, never copied to host memory by jaxllm) under fresh
random ids and answers with its transfer server's address and the ids; the generation worker
pulls them onto its own device and says `done`. An offer not pulled within its timeout is
dropped by JAX's server, so nothing stays behind when the generation worker dies or never
comes. A pull has no deadline of its own in JAX: `pull_chunks` waits for the arrays at most
`timeout` seconds and then poisons the connection (each pull has its own), which fails the
pull instead of leaving it waiting.

On a CPU backend the transfer runs over sockets between the processes' host memories; on an
accelerator it is JAX's device-to-device path (not run here yet).
"""

from __future__ import annotations

import datetime
import secrets
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.engine.device_reads import blocking_read

_lock = threading.Lock()
_server: Any = None
_server_host: Optional[str] = None


def available() -> bool:
    """Whether this JAX has `jax.experimental.transfer`."""
    try:
        from jax.experimental import transfer  # noqa: F401
    except ImportError:
        return False
    return True


def transfer_server(host: str) -> Any:
    """This process's JAX transfer server, started on first use, listening on `host` (a
    process has one: the first caller's host is kept)."""
    global _server, _server_host
    from jax.experimental import transfer

    with _lock:
        if _server is None:
            client = jax.devices()[0].client
            bind = f"[{host}]:0" if ":" in host else f"{host}:0"
            _server = transfer.start_transfer_server(client, bind, [bind])
            _server_host = host
        return _server


def advertised_address(server: Any, advertised_host: str) -> str:
    """The server's address with the host others reach this machine as."""
    port = str(server.address()).rpartition(":")[2]
    host = f"[{advertised_host}]" if ":" in advertised_host else advertised_host
    return f"{host}:{port}"


def _single_device(array: jax.Array) -> jax.Array:
    """One addressable copy of the whole array (the gather of a TP cache may be sharded)."""
    if len(array.sharding.device_set) == 1:
        return array
    device = min(array.sharding.device_set, key=lambda d: d.id)
    return jax.device_put(array, jax.sharding.SingleDeviceSharding(device))


def offer_chunks(chunks: list[tuple[int, list[jax.Array]]], host: str, timeout: float) -> list[int]:
    """Offer each chunk's arrays for one pull; returns the ids to pull them by. Offers not
    pulled within `timeout` seconds are dropped."""
    server = transfer_server(host)
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    ids = []
    for _, arrays in chunks:
        uuid = secrets.randbits(63)
        server.await_pull(uuid, [_single_device(a) for a in arrays], timeout=deadline)
        ids.append(uuid)
    return ids


class PullError(RuntimeError):
    """A pull failed or did not finish in time."""


def pull_chunks(
    address: str,
    ids: list[int],
    shapes: list[list[tuple[tuple[int, ...], str]]],
    device: jax.Device,
    host: str,
    timeout: float,
) -> list[list[jax.Array]]:
    """Pull the arrays offered under `ids` (their shapes and dtypes per chunk) onto `device`,
    waiting at most `timeout` seconds in all."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    out = []
    try:
        connection = transfer_server(host).connect(address)
        for uuid, chunk in zip(ids, shapes):
            specs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding) for shape, dtype in chunk]
            out.append(connection.pull(uuid, specs))
    except Exception as exc:  # an unreachable address, a refused pull
        raise PullError(f"the device transfer from {address} failed: {exc}") from None
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            jax.block_until_ready(out)
        except Exception as exc:  # the peer closed the connection, or refused the shapes
            failure.append(exc)

    waiter = threading.Thread(target=wait, name="jaxllm-kv-pull", daemon=True)
    waiter.start()
    with blocking_read():  # this thread waits for the device transfer
        waiter.join(timeout)
    if waiter.is_alive():
        poison = getattr(connection, "_poison_connection", None)  # JAX's only way to end a waiting pull
        if poison is not None:
            poison()
            waiter.join(10.0)
        raise PullError(f"the device transfer from {address} did not finish within {timeout:.0f} s")
    if failure:
        raise PullError(f"the device transfer from {address} failed: {failure[0]}")
    return out
