"""The executable store's keys: every input a program depends on changes the key text, and
values without a stable text are refused rather than keyed by less (no engine built here; the
loading itself is checked across processes in tests/test_compile_cache.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.executable_store import (
    ExecutableStore,
    UnstableKey,
    describe,
    describe_engine_config,
    environment_description,
)


def _scaled(factor: float):
    def scale(x):
        return x * factor

    return scale


def test_descriptions_tell_apart_what_a_program_could():
    assert describe(_scaled(2.0)) == describe(_scaled(2.0)) != describe(_scaled(3.0))  # closures
    assert describe(functools.partial(_scaled, 2.0)) != describe(functools.partial(_scaled, 2))
    assert describe(np.arange(3)) != describe(np.arange(3) + 1)
    assert describe({"b": 1, "a": [1, (2,)]}) == describe({"a": [1, (2,)], "b": 1})
    assert describe([1]) != describe((1,))
    first, second = (lambda x: x), (lambda x: x + 1)
    assert describe(first) != describe(second)  # lambdas: told apart by their line
    with pytest.raises(UnstableKey):
        describe(object())  # its repr is an address: no key rather than a key that says less


def test_engine_keys_change_with_every_program_setting_but_not_the_compile_switches(tmp_path):
    base = EngineConfig(model="tiny-dense", max_num_tokens=32)
    key = describe_engine_config(base)
    for change in (
        dict(max_num_tokens=64),
        dict(dtype="bfloat16"),
        dict(max_batch_size=8),
        dict(tensor_parallel_size=2),
        dict(attention_backend="triton"),
        dict(scan_layers=False),
        dict(kv_cache_config={"tokens_per_block": 16}),
    ):
        assert describe_engine_config(EngineConfig(**{**base.__dict__, **change})) != key, change
    for change in (dict(compile_workers=3), dict(compile_ahead=False), dict(compile_cache=False)):
        assert describe_engine_config(EngineConfig(**{**base.__dict__, **change})) == key, change
    environment = environment_description()
    for part in ("jax ", "backend ", "devices ", "host ", "source ", "config "):
        assert f"\n{part}" in f"\n{environment}", part
    store = ExecutableStore.beside_compile_cache(str(tmp_path), base)
    assert store.directory == tmp_path / "executables" and store.context.startswith(environment)
    assert store.entry_key("forward", _scaled(2.0)) != store.entry_key("forward", _scaled(3.0))
    assert store.entry_key("forward", object()) is None and store.counts.unkeyed == 1
    assert ExecutableStore.beside_compile_cache(None, base) is None


def test_a_program_calling_back_into_python_is_not_handed_to_the_serializer(tmp_path, monkeypatch):
    """jax's serializer crashed the process (a segfault, not an exception) on the Mosaic GPU
    interpreter's kernels under tensor parallelism: a program with a host callback is refused
    before it is called. A plain program still goes to it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback, serialize_executable

    calls = []
    real = serialize_executable.serialize
    monkeypatch.setattr(serialize_executable, "serialize", lambda exe: calls.append(exe) or real(exe))
    store = ExecutableStore(tmp_path, "test")
    callback = (
        jax.jit(lambda a: io_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(a.shape, a.dtype), a))
        .lower(jnp.ones(4))
        .compile()
    )
    assert store.serialize("callback", callback) is None and store.counts.unkeyed == 1 and not calls
    plain = jax.jit(lambda a: a * 2).lower(jnp.ones(4)).compile()
    assert store.serialize("plain", plain) is not None and len(calls) == 1
