"""How the leader sends each step's plan to the other processes of a multi-host run.

A message is the bytes of a small pickled tuple (a `StepPlan` is plain numpy arrays and
scalars). Two transports, both JAX's own (no socket layer of ours):

  * `KVStoreChannel` (default): the coordination service's key-value store. The leader writes
    message k under `<prefix>/<k>` and goes on at once; each follower blocks on the next key.
    It never waits for the followers, so it adds nothing to the leader's step but its own
    write; old keys are deleted `keep` messages later (by then every follower has run them: a
    step's collectives cannot finish without every process).
  * `CollectiveChannel`: `multihost_utils.broadcast_one_to_all` of the message (its length,
    then the bytes padded to a power of two so a few shapes compile), a device collective
    over every process, which returns only once all processes have joined it and, to keep the
    collectives of all processes in one order, only after the previous step's programs ran.

Messages are unpickled with an allow list (numpy and this project's own classes): they come
from process 0 of the same job, but a store reachable on the network should not be able to
name arbitrary callables.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Optional

import numpy as np

_ALLOWED_MODULES = ("jaxllm.", "sharding.", "numpy")
_ALLOWED_BUILTINS = {("builtins", n) for n in ("tuple", "list", "dict", "set", "frozenset", "int", "float", "bool",
                                                "str", "bytes", "slice", "complex")}
_ALLOWED_OTHER = {("copyreg", "_reconstructor"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                  ("pathlib", "Path"), ("collections", "OrderedDict")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED_BUILTINS | _ALLOWED_OTHER:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a multi-host message may not refer to {module}.{name}")


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Any:
    return _RestrictedUnpickler(io.BytesIO(payload)).load()


class KVStoreChannel:
    """Leader -> followers through the coordination service's key-value store."""

    kind = "kv"

    def __init__(self, prefix: str, client: Any = None, keep: int = 64, poll_ms: int = 1000) -> None:
        from sharding.multihost import kv_client

        self.prefix = prefix
        self.client = client if client is not None else kv_client()
        self.keep = keep
        self.poll_ms = poll_ms
        self.seq = 0

    def send(self, payload: bytes) -> None:
        self.client.key_value_set_bytes(f"{self.prefix}/{self.seq}", payload)
        if self.seq >= self.keep:
            self.client.key_value_delete(f"{self.prefix}/{self.seq - self.keep}")
        self.seq += 1

    def recv(self, should_stop: Optional[Callable[[], Optional[str]]] = None) -> bytes:
        """The next message; between polls `should_stop()` may return a reason to give up
        (raised as `ChannelClosed`)."""
        key = f"{self.prefix}/{self.seq}"
        while True:
            try:
                payload = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as exc:  # a timeout is the only expected error
                if "DEADLINE_EXCEEDED" not in str(exc) and "timed out" not in str(exc).lower():
                    raise ChannelClosed(f"the coordination service failed: {str(exc).splitlines()[0]}") from exc
            reason = should_stop() if should_stop is not None else None
            if reason:
                raise ChannelClosed(reason)
        self.seq += 1
        return payload


class CollectiveChannel:
    """Leader -> followers by `broadcast_one_to_all` (a device collective over all processes)."""

    kind = "collective"
    MIN_BUCKET = 1024

    def __init__(self, prefix: str = "") -> None:
        self.seq = 0
        # The device arrays of the work dispatched before (set by the runner side). The broadcast
        # is a program of its own with no data dependency on the steps, and XLA:CPU may run
        # independent programs at once, so their collectives could interleave differently on
        # different processes: the broadcast first waits for that work.
        self.wait_for: Callable[[], list] = list

    def _broadcast(self, payload: Optional[bytes]) -> bytes:
        import jax
        from jax.experimental.multihost_utils import broadcast_one_to_all

        jax.block_until_ready(self.wait_for())

        size = np.array([len(payload) if payload is not None else 0], np.int64)
        size = int(broadcast_one_to_all(size)[0])
        bucket = max(self.MIN_BUCKET, 1 << (size - 1).bit_length())
        buffer = np.zeros(bucket, np.uint8)
        if payload is not None:
            buffer[:size] = np.frombuffer(payload, np.uint8)
        data = np.asarray(broadcast_one_to_all(buffer))
        self.seq += 1
        return data[:size].tobytes()

    def send(self, payload: bytes) -> None:
        self._broadcast(payload)

    def recv(self, should_stop: Optional[Callable[[], Optional[str]]] = None) -> bytes:
        return self._broadcast(None)


class ChannelClosed(RuntimeError):
    """The leader can no longer be heard from."""


CHANNELS = {"kv": KVStoreChannel, "collective": CollectiveChannel}


def make_channel(kind: str, prefix: str):
    if kind not in CHANNELS:
        raise ValueError(f"plan channel must be one of {sorted(CHANNELS)}, got {kind!r}")
    return CHANNELS[kind](prefix)

