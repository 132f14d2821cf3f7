"""Load the engine's compiled programs from disk: no tracing, lowering or compiling at start-up.

JAX's persistent compilation cache (`jaxllm.engine.compile_cache`) skips only the compile:
its key is a hash of the lowered program, so a new process still traces and lowers every
program to find the entry (about a second per model forward). This store keeps the
executables themselves (`jax.experimental.serialize_executable`), keyed by everything a
program depends on that is known *before* tracing, so an engine whose programs are stored
loads each in milliseconds and is called exactly like a fresh one (same argument pytree,
donation and shardings: they are part of the executable).

The key (`ExecutableStore.entry_key`) is a SHA-256 over the text of:
  * the program: its function and every static argument bound to it (model config, attention
    and MoE implementations, mesh, MoE options, sharding specs), its input layout, and the
    shape, dtype and sharding (mesh axes and device ids in order) of every argument;
  * the engine: every field of its `EngineConfig` (model, dtype, limits, parallelism, backends...)
    but the three that only decide when compiles run;
  * the process: jax, jaxlib and plugin versions, backend platform and version, every device's
    kind and id, the process count, the host CPU (`compile_cache.host_id`: CPU executables are
    native code), JAX's configuration values and the JAX_/XLA_/JAXLLM_ environment, and a hash
    of the source of the packages that build the programs (jaxllm, pallas_kernels, sharding),
    and the Python version.
Anything the description cannot render stably (an object whose repr is an address) disables
storing that program: it is never keyed by less than it depends on. The entry repeats the key
text, and a load compares it, so a hash collision is a miss too.

An entry is a checksum and a pickle (the key, the executable's devices, the serialized
executable and its argument and result trees), written to a temporary file and renamed.
A missing, unreadable, corrupt or foreign entry is a miss: logged, the program is traced and
compiled as usual, and the entry rewritten.

Only executables XLA compiled for this very lookup are stored, serialized before their first
run (`compile_here`): XLA:CPU cannot serialize an executable that ran, nor one that was itself
deserialized (functions go missing in the copy). So a program that JAX's persistent cache
already held (say, from an older jaxllm whose programs were the same) or that this process
already compiled for another engine is taken from JAX's cache and not stored; the folder fills
again once the cache directory is cleared. The checksum keeps a damaged file away from the
deserializer, which, like JAX's own cache, must only see trusted files: keep the directory
writable only by you. Entries live in `<compilation cache dir>/executables`, so the same
switches turn both off (`EngineConfig(compile_cache=False)`, `--no-compile-cache`,
`JAXLLM_COMPILE_CACHE=0`). Multi-host runs do not use the store (each process would need the
others' executables): they trace, lower and hit JAX's cache as before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import sys
import threading
import types
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.compile_cache import host_id

logger = logging.getLogger(__name__)

_MAGIC = b"jaxllm-executable v1\n"
_HOST_CALLBACK = "python_cpu_callback"  # the custom call of io_callback / pure_callback on a CPU
_SUFFIX = ".jaxexe"
SOURCE_PACKAGES = ("jaxllm", "pallas_kernels", "sharding")
# Distributions whose version changes what a program compiles to or how it runs.
_DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-rocm7-plugin",
    "jax-rocm7-pjrt",
    "libtpu",
    "tokamax",
    "ml_dtypes",
    "numpy",
)
# Environment variables not part of the key: where caches live and secrets.
_ENV_SKIPPED = ("JAXLLM_CACHE_DIR", "JAXLLM_COMPILE_CACHE", "JAXLLM_API_KEY")
# EngineConfig fields that decide only when and where programs compile, never what they are.
ENGINE_FIELDS_NOT_IN_KEY = ("compile_cache", "compile_ahead", "compile_workers")


class UnstableKey(ValueError):
    """A value whose description would not be the same in another process."""


def describe(value: Any, _depth: int = 0) -> str:
    """A text that is the same in every process for equal values and differs for values a
    program could tell apart; `UnstableKey` where no such text is known."""
    if _depth > 12:
        raise UnstableKey("nested too deeply")
    d = functools.partial(describe, _depth=_depth + 1)
    if value is None or isinstance(value, (bool, int, float, str, bytes, complex)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, np.dtype):
        return f"dtype({value.str})"
    if isinstance(value, type):
        return f"type({value.__module__}.{value.__qualname__})"
    if isinstance(value, np.ndarray):
        return f"array({value.dtype.str}, {value.shape}, {hashlib.sha256(value.tobytes()).hexdigest()})"
    if isinstance(value, jax.Array):  # a constant a closure would fold into the program
        if value.size * value.dtype.itemsize > 1 << 20:
            raise UnstableKey(f"a {value.shape} array is too large to describe by its contents")
        return "jax." + describe(np.asarray(value))
    if isinstance(value, np.generic):
        return f"{value.dtype.str}({value.item()!r})"
    if isinstance(value, jax.sharding.Mesh):
        return (
            f"Mesh({value.axis_names}, {value.devices.shape}, ids={value.device_ids.ravel().tolist()}, "
            f"types={d(tuple(getattr(value, 'axis_types', ())))})"
        )
    if isinstance(value, jax.sharding.Sharding):
        return describe_sharding(value)
    if isinstance(value, jax.sharding.PartitionSpec):
        return repr(value)
    if isinstance(value, functools.partial):
        return f"partial({d(value.func)}, {d(value.args)}, {d(value.keywords)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)) or (
        callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type)
    ):
        return _describe_function(value, d)
    if isinstance(value, types.CodeType):
        body = hashlib.sha256(
            value.co_code + describe((value.co_names, value.co_varnames, value.co_freevars, value.co_cellvars)).encode()
        ).hexdigest()
        return f"code({value.co_filename}:{value.co_firstlineno} {body} consts={d(value.co_consts)})"
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    if dataclasses.is_dataclass(value):
        fields = ", ".join(f"{f.name}={d(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, dict):
        items = sorted((d(k), d(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(d(v) for v in value)
        return f"{type(value).__qualname__}[{inner}]"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__qualname__}{{{', '.join(sorted(d(v) for v in value))}}}"
    if isinstance(value, jax.tree_util.PyTreeDef):
        return f"treedef({value})"
    if isinstance(value, jax.ShapeDtypeStruct):
        return describe_array(value)
    text = repr(value)
    if " at 0x" in text or " object at " in text or "..." in text:
        raise UnstableKey(f"no stable description of a {type(value).__qualname__}")
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def _describe_function(fn: Any, d: Any) -> str:
    """Module and qualified name, with the values a closure or its defaults bind (two closures
    of one function differ only there)."""
    parts = [f"{getattr(fn, '__module__', '?')}.{fn.__qualname__}"]
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):  # two lambdas (or two versions of a function) differ here
        parts.append(d(code))
    if isinstance(fn, types.MethodType):
        parts.append(f"self={d(fn.__self__)}")
    closure = getattr(fn, "__closure__", None)
    if closure:
        parts.append("closure=" + d([cell.cell_contents for cell in closure]))
    if getattr(fn, "__defaults__", None):
        parts.append("defaults=" + d(fn.__defaults__))
    if getattr(fn, "__kwdefaults__", None):
        parts.append("kwdefaults=" + d(fn.__kwdefaults__))
    return f"fn({', '.join(parts)})"


def describe_sharding(sharding: jax.sharding.Sharding) -> str:
    devices = getattr(sharding, "_device_assignment", None)
    ids = [dev.id for dev in devices] if devices is not None else sorted(dev.id for dev in sharding.device_set)
    return f"{sharding!r} devices={ids}"


def describe_array(leaf: Any) -> str:
    sharding = getattr(leaf, "sharding", None)
    return (
        f"{np.dtype(leaf.dtype).str}{tuple(leaf.shape)}{'' if sharding is None else ' ' + describe_sharding(sharding)}"
    )


def describe_arguments(args: Any) -> str:
    """The tree, shapes, dtypes and shardings of a program's (abstract) arguments."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return f"{treedef}\n" + "\n".join(describe_array(leaf) for leaf in leaves)


@functools.cache
def source_digest(packages: tuple[str, ...] = SOURCE_PACKAGES) -> str:
    """SHA-256 over the files of the packages that build the programs (paths and contents)."""
    import importlib

    digest = hashlib.sha256()
    for name in packages:
        root = Path(importlib.import_module(name).__file__).resolve().parent
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo") or not path.is_file():
                continue
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _versions() -> list[str]:
    out = []
    for name in _DISTRIBUTIONS:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def environment_description() -> str:
    """What every program of this process depends on beyond its own arguments (see the module
    docstring)."""
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    config = {
        name: value
        for name, value in jax.config.values.items()
        if "compilation_cache" not in name and "persistent_cache" not in name
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("JAX_", "XLA_", "JAXLLM_", "LIBTPU_", "TPU_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_"))
        and k not in _ENV_SKIPPED
        and "CACHE" not in k
    }
    lines = [
        f"python {sys.version}",
        f"jax {jax.__version__} jaxlib {jaxlib.__version__} {' '.join(_versions())}",
        f"backend {backend.platform} {backend.platform_version}",
        f"processes {jax.process_count()} index {jax.process_index()}",
        "devices "
        + "; ".join(
            f"{dev.id}:{dev.platform}:{dev.device_kind}:{getattr(dev, 'process_index', 0)}"
            f":{getattr(dev, 'compute_capability', '')}:{getattr(dev, 'coords', '')}"
            for dev in devices
        ),
        f"host {host_id()}",
        f"source {source_digest()}",
        f"config {describe(config)}",
        f"env {describe(env)}",
    ]
    return "\n".join(lines)


def describe_engine_config(config: Any) -> str:
    """Every field of an `EngineConfig` that may change a program (all but the compile switches)."""
    fields = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ENGINE_FIELDS_NOT_IN_KEY
    }
    return f"{type(config).__module__}.{type(config).__qualname__}{describe(fields)}"


_thread = threading.local()
_listening = threading.Lock()
_listeners_registered = False
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_compile(event: str, duration: float, **kwargs: Any) -> None:
    if event == _COMPILE_EVENT:
        _thread.compiles = getattr(_thread, "compiles", 0) + 1


def _on_cache_hit(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _thread.cache_hits = getattr(_thread, "cache_hits", 0) + 1


def _compile_events() -> tuple[int, int]:
    """(backend compiles, persistent-cache hits) JAX reported on this thread so far (it reports
    both on the thread that compiles, a hit as a compile too)."""
    global _listeners_registered
    if not _listeners_registered:
        with _listening:
            if not _listeners_registered:
                jax.monitoring.register_event_duration_secs_listener(_on_compile)
                jax.monitoring.register_event_listener(_on_cache_hit)
                _listeners_registered = True
    return getattr(_thread, "compiles", 0), getattr(_thread, "cache_hits", 0)


def compile_here(lowered: Any) -> tuple[jax.stages.Compiled, bool]:
    """`lowered.compile()`, and whether XLA compiled it on this call. Otherwise it came from one
    of JAX's caches: the persistent one (a deserialized executable) or the in-memory one (an
    executable that may have run already). XLA:CPU cannot serialize either (functions go
    missing in the copy), so only an executable compiled here may be stored, and only before
    it first runs."""
    compiles, hits = _compile_events()
    exe = lowered.compile()
    after_compiles, after_hits = _compile_events()
    return exe, after_compiles > compiles and after_hits == hits


@dataclasses.dataclass
class StoreCounts:
    loaded: int = 0  # programs loaded from an entry
    saved: int = 0  # entries written
    missing: int = 0  # lookups with no entry
    rejected: int = 0  # entries that could not be loaded (corrupt, foreign, incompatible)
    unkeyed: int = 0  # programs not stored: no stable key, or not serializable
    from_jax_cache: int = 0  # programs not stored: from one of JAX's caches, not compiled here (`compile_here`)


class ExecutableStore:
    """Serialized executables in one directory, keyed by `entry_key` (see the module docstring)."""

    def __init__(self, directory: str | Path, context: str) -> None:
        """`context`: what every program of this store depends on beyond its own description
        (the process's `environment_description` and the engine's configuration)."""
        self.directory = Path(directory)
        self.context = context
        self.counts = StoreCounts()
        self._lock = threading.Lock()

    @classmethod
    def beside_compile_cache(cls, compile_cache_dir: Optional[str], engine_config: Any) -> Optional[ExecutableStore]:
        """The store of an engine whose compilation cache is `compile_cache_dir`: its
        `executables` subdirectory; None where it cannot be used (no local cache directory,
        several processes)."""
        if not compile_cache_dir or "://" in str(compile_cache_dir) or jax.process_count() > 1:
            return None
        try:
            context = environment_description() + "\nengine " + describe_engine_config(engine_config)
        except UnstableKey as exc:
            logger.info("compiled programs are not stored: %s", exc)
            return None
        except Exception as exc:  # the store only saves time: never a reason for an engine not to start
            logger.warning("compiled programs are not stored: %r", exc)
            return None
        return cls(Path(compile_cache_dir) / "executables", context)

    def entry_key(self, *program: Any) -> Optional[str]:
        """The full key text of a program described by `program` (strings are taken as they
        are); None when part of it has no stable description."""
        try:
            parts = [p if isinstance(p, str) else describe(p) for p in program]
        except UnstableKey as exc:
            logger.debug("program not stored: %s", exc)
            self._count("unkeyed")
            return None
        return self.context + "\n" + "\n".join(parts)

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:40] + _SUFFIX)

    def count_from_jax_cache(self) -> None:
        """A program came from one of JAX's caches, so it is not stored (`compile_here`)."""
        self._count("from_jax_cache")

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.counts, name, getattr(self.counts, name) + 1)

    def load(self, key: str) -> Optional[jax.stages.Compiled]:
        """The stored executable of `key`, loaded onto its devices; None on a miss (a bad entry
        is logged and left to be overwritten)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._count("missing")
            return None
        except OSError as exc:
            return self._reject(path, f"unreadable ({exc})")
        try:
            if not data.startswith(_MAGIC):
                return self._reject(path, "not an entry of this format")
            checksum, payload = data[len(_MAGIC) : len(_MAGIC) + 32], data[len(_MAGIC) + 32 :]
            if hashlib.sha256(payload).digest() != checksum:
                return self._reject(path, "checksum mismatch (damaged or partly written)")
            entry = pickle.loads(payload)
            if entry.get("key") != key:
                return self._reject(path, "written for another program")
            by_id = {dev.id: dev for dev in jax.devices()}
            if not all(i in by_id for i in entry["devices"]):
                return self._reject(path, "compiled for devices this process does not have")
            devices = [by_id[i] for i in entry["devices"]]
            exe = deserialize_and_load(
                entry["executable"],
                entry["in_tree"],
                entry["out_tree"],
                backend=devices[0].client,
                execution_devices=devices,
            )
        except Exception as exc:  # any failure to read an entry is a miss, never a crash
            return self._reject(path, f"could not be loaded ({type(exc).__name__}: {exc})")
        self._count("loaded")
        return exe

    def _reject(self, path: Path, why: str) -> None:
        logger.warning("stored program %s %s: compiling it again", path.name, why)
        self._count("rejected")
        return None

    def serialize(self, key: str, exe: jax.stages.Compiled) -> Optional[bytes]:
        """The entry of `exe` under `key`, or None where it cannot be serialized (logged). Call it
        before the executable first runs: XLA:CPU cannot serialize an executable that ran."""
        from jax.experimental.serialize_executable import serialize

        try:
            # A host callback (the Pallas and Mosaic GPU interpreters' kernels) cannot be
            # serialized; jax's serializer may crash the process on one rather than raise.
            if _HOST_CALLBACK in exe.as_text():
                raise ValueError("the program calls back into Python")
            devices = [dev.id for dev in exe._executable._unloaded_executable.device_list]
            blob, in_tree, out_tree = serialize(exe)
            payload = pickle.dumps(
                dict(key=key, devices=devices, executable=blob, in_tree=in_tree, out_tree=out_tree),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as exc:  # e.g. host callbacks or constants the serializer does not take
            logger.debug("program not stored: cannot serialize it (%s: %s)", type(exc).__name__, exc)
            self._count("unkeyed")
            return None
        return _MAGIC + hashlib.sha256(payload).digest() + payload

    def write(self, key: str, entry: bytes) -> bool:
        """Write an entry from `serialize` atomically (a temporary file renamed over the old
        entry); False where it cannot be written (logged; the program still runs)."""
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(entry)
            os.replace(tmp, path)
        except Exception as exc:
            logger.warning("could not store a compiled program in %s: %s", self.directory, exc)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        self._count("saved")
        return True

    def save(self, key: str, exe: jax.stages.Compiled) -> bool:
        """`serialize` then `write` (an executable that has not run yet)."""
        entry = self.serialize(key, exe)
        return entry is not None and self.write(key, entry)
