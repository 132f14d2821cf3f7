"""How the leader sends each step's plan to the other processes of a multi-host run.

A message is a small tuple of plain values, numpy arrays, and this project's dataclasses and
enums (a `StepPlan` is plain numpy arrays and scalars). `encode` writes it as a JSON header
(the structure, with each array named by its index) followed by the arrays' raw bytes, each
at a 64-byte aligned offset; `decode` rebuilds it. No pickle: a store reachable on the network
can name only dataclasses, enums and named tuples of the `jaxllm` and `sharding` packages, and
decoding runs none of their code (fields are set as unpickling would set them).

Two transports, both JAX's own (no socket layer of ours):

  * `KVStoreChannel` (default): the coordination service's key-value store. The leader writes
    message k under `<prefix>/<k>` and goes on at once; each follower blocks on the next key.
    It never waits for the followers, so it adds nothing to the leader's step but its own
    write; old keys are deleted `keep` messages later (by then every follower has run them: a
    step's collectives cannot finish without every process).
  * `CollectiveChannel`: `multihost_utils.broadcast_one_to_all` of the message (its length,
    then the bytes padded to a power of two so a few shapes compile), a device collective
    over every process, which returns only once all processes have joined it and, to keep the
    collectives of all processes in one order, only after the previous step's programs ran.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
import pathlib
import struct
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

MAGIC = b"JXPLAN1\n"
_HEADER_LENGTH = struct.Struct("<Q")
_ALIGN = 64
_ALLOWED_PACKAGES = ("jaxllm", "sharding")
_ARRAY_KINDS = "biufcSU"  # numpy's own number, boolean and string dtypes (their bytes are the data)


class MessageError(ValueError):
    """A multi-host message that cannot be encoded, or bytes that are not one."""


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.lru_cache(maxsize=256)
def _project_class(name: str) -> type:
    """The class `module:qualname` names, if it is a dataclass, enum or named tuple of this project."""
    module, _, qualname = str(name).partition(":")
    if module.split(".")[0] not in _ALLOWED_PACKAGES or not qualname or "<" in qualname:
        raise MessageError(f"a multi-host message may not refer to {name!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise MessageError(f"a multi-host message refers to {name!r}, which does not exist here") from None
    if not isinstance(obj, type) or not (
        dataclasses.is_dataclass(obj)
        or issubclass(obj, enum.Enum)
        or (issubclass(obj, tuple) and hasattr(obj, "_fields"))
    ):
        raise MessageError(f"a multi-host message may not refer to {name!r} (not a dataclass, enum or named tuple)")
    return obj


class _Writer:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def _array(self, a: np.ndarray) -> int:
        _check_dtype(a.dtype)
        self.arrays.append(a)
        return len(self.arrays) - 1

    def node(self, x: Any) -> Any:
        t = type(x)
        if t is np.ndarray:
            return {"array": self._array(x)}
        if x is None or t in (bool, int, float, str):
            return x
        if isinstance(x, enum.Enum):
            _check_project(t)
            return {"enum": _class_name(t), "value": self.node(x.value)}
        if isinstance(x, np.ndarray):
            return {"array": self._array(np.asarray(x))}
        if isinstance(x, np.generic):
            return {"scalar": self._array(np.asarray(x))}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            _check_project(t)
            state = vars(x) if hasattr(x, "__dict__") else {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
            return {"dataclass": _class_name(t), "fields": {k: self.node(v) for k, v in state.items()}}
        if t is list:
            return [self.node(v) for v in x]
        if t is tuple:
            return {"tuple": [self.node(v) for v in x]}
        if isinstance(x, tuple) and hasattr(t, "_fields"):
            _check_project(t)
            return {"namedtuple": _class_name(t), "items": [self.node(v) for v in x]}
        if t is dict:
            return {"dict": [[self.node(k), self.node(v)] for k, v in x.items()]}
        if t in (set, frozenset):
            return {t.__name__: [self.node(v) for v in x]}
        if t is bytes:
            return {"bytes": self._array(np.frombuffer(x, np.uint8))}
        if isinstance(x, pathlib.PurePath):
            return {"path": str(x)}
        raise MessageError(f"a multi-host message cannot hold a {t.__module__}.{t.__qualname__}")


def _check_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.kind not in _ARRAY_KINDS:
        raise MessageError(f"a multi-host message cannot hold a {dtype} array (numbers, booleans and strings only)")
    return dtype


def _check_project(cls: type) -> None:
    if cls.__module__.split(".")[0] not in _ALLOWED_PACKAGES:
        raise MessageError(f"a multi-host message may hold only this project's classes, not {_class_name(cls)}")


def encode(message: Any) -> bytes:
    """`message` as bytes: magic, header length, JSON header, then the arrays' bytes (aligned)."""
    writer = _Writer()
    tree = writer.node(message)
    placement, offset = [], 0
    for a in writer.arrays:
        offset = _aligned(offset)
        placement.append([a.dtype.str, list(a.shape), offset])
        offset += a.nbytes
    header = json.dumps({"tree": tree, "arrays": placement}, separators=(",", ":")).encode()
    lead = len(MAGIC) + _HEADER_LENGTH.size + len(header)
    parts: list[Any] = [MAGIC, _HEADER_LENGTH.pack(len(header)), header, bytes(_aligned(lead) - lead)]
    end = 0
    for a, (_, _, at) in zip(writer.arrays, placement):
        parts.append(bytes(at - end))
        parts.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))  # its buffer: the raw bytes
        end = at + a.nbytes
    return b"".join(parts)


def decode(payload: bytes) -> Any:
    """The message `encode` wrote. Arrays are writable copies (one copy of the payload)."""
    data = bytearray(payload)
    fixed = len(MAGIC) + _HEADER_LENGTH.size
    if len(data) < fixed or data[: len(MAGIC)] != MAGIC:
        raise MessageError("not a multi-host message (bad magic bytes)")
    (length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
    if fixed + length > len(data):
        raise MessageError("a truncated multi-host message")
    try:
        header = json.loads(bytes(data[fixed : fixed + length]))
        start = _aligned(fixed + length)
        arrays = []
        for dtype, shape, offset in header["arrays"]:
            dt = _check_dtype(np.dtype(dtype))
            count = math.prod(shape)
            if start + offset + count * dt.itemsize > len(data):
                raise MessageError("a truncated multi-host message")
            arrays.append(np.frombuffer(data, dt, count, start + offset).reshape(shape))
        return _Reader(arrays).node(header["tree"])
    except MessageError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise MessageError(f"a malformed multi-host message: {type(exc).__name__}: {exc}") from None


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class _Reader:
    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def node(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self.node(v) for v in x]
        if not isinstance(x, dict):
            return x  # None, bool, int, float, str
        (tag, value), *rest = x.items()
        if tag == "tuple":
            return tuple(self.node(v) for v in value)
        if tag == "array":
            return self.arrays[value]
        if tag == "scalar":
            return self.arrays[value][()]
        if tag == "dataclass":
            cls = _project_class(value)
            if not dataclasses.is_dataclass(cls):
                raise MessageError(f"{value!r} is not a dataclass")
            obj = object.__new__(cls)
            for name, field_value in dict(rest)["fields"].items():
                object.__setattr__(obj, name, self.node(field_value))
            return obj
        if tag == "enum":
            cls = _project_class(value)
            if not issubclass(cls, enum.Enum):
                raise MessageError(f"{value!r} is not an enum")
            return cls(self.node(dict(rest)["value"]))
        if tag == "namedtuple":
            cls = _project_class(value)
            if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise MessageError(f"{value!r} is not a named tuple")
            return cls(*(self.node(v) for v in dict(rest)["items"]))
        if tag == "dict":
            return {self.node(k): self.node(v) for k, v in value}
        if tag == "set":
            return {self.node(v) for v in value}
        if tag == "frozenset":
            return frozenset(self.node(v) for v in value)
        if tag == "bytes":
            return self.arrays[value].tobytes()
        if tag == "path":
            return pathlib.Path(value)
        raise MessageError(f"a multi-host message holds an unknown entry {tag!r}")


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
        from jax.experimental.multihost_utils import broadcast_one_to_all

        from jaxllm.engine.device_reads import blocking_read, wait_ready

        wait_ready(self.wait_for())

        size = np.array([len(payload) if payload is not None else 0], np.int64)
        with blocking_read():  # a collective, read back
            size = int(broadcast_one_to_all(size)[0])
        bucket = max(self.MIN_BUCKET, 1 << (size - 1).bit_length())
        buffer = np.zeros(bucket, np.uint8)
        if payload is not None:
            buffer[:size] = np.frombuffer(payload, np.uint8)
        with blocking_read():
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
