"""Random weights drawn on the devices (`load_format="dummy"`): the same parameter pytree as
loading a random checkpoint (paths, shapes, dtypes, shardings, scale), and an engine built on
a directory with no weights at all."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm.models import ModelConfig, load_params
from jaxllm.models.partitioning import rules_for
from jaxllm.models.presets import materialize_preset
from jaxllm.models.random_params import random_params
from sharding import ParallelConfig, make_mesh
from tests.multidevice import run_on_cpu_devices
from tests.test_sharding_tp import write_checkpoint


def _leaves(params) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _compare(loaded, drawn, mesh) -> list[dict]:
    """Per leaf: same shape, dtype and sharding; the drawn values' spread next to the loaded ones'."""
    a, b = _leaves(loaded), _leaves(drawn)
    assert sorted(a) == sorted(b)
    rows = []
    for name, x in a.items():
        y = b[name]
        assert (y.shape, y.dtype) == (x.shape, x.dtype), name
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (name, y.sharding, x.sharding)
        assert y.sharding.mesh == mesh and y.sharding.spec == x.sharding.spec, name
        xs, ys = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.isfinite(ys).all(), name
        rows.append(
            dict(
                name=name,
                size=xs.size,
                mean=(float(xs.mean()), float(ys.mean())),
                std=(float(xs.std()), float(ys.std())),
            )
        )
    return rows


def _check_scales(rows: list[dict]) -> None:
    for row in rows:
        if row["size"] < 256:  # a few values (q_norm, biases): their sample spread says little
            continue
        (mean_x, mean_y), (std_x, std_y) = row["mean"], row["std"]
        assert abs(mean_y - mean_x) < 0.05 + 0.2 * std_x, row
        assert 0.7 * std_x < std_y < 1.4 * std_x, row  # linear layers gain / sqrt(fan_in), norms 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_random_params_have_the_loaded_layout_and_scale(tmp_path, arch, scan_layers):
    directory = write_checkpoint(arch, tmp_path / arch, intermediate_size=256, hidden_size=64)
    config = replace(
        ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text())), scan_layers=scan_layers
    )
    mesh = make_mesh(ParallelConfig())
    loaded = load_params(directory, config, mesh=mesh)
    drawn = random_params(config, mesh, seed=1)
    _check_scales(_compare(loaded, drawn, mesh))
    again = random_params(config, mesh, seed=1)  # seeded: the same values again, another seed others
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(drawn), jax.tree.leaves(again)))
    other = random_params(config, mesh, seed=2)
    assert not np.array_equal(drawn["embed"], other["embed"])


def test_large_parameters_are_drawn_row_by_row(monkeypatch, tmp_path):
    """The row-by-row draw (lax.map over the leading axis) gives the same layout and scale."""
    import jaxllm.models.random_params as module

    monkeypatch.setattr(module, "ROW_DRAW_MIN_ELEMENTS", 1024)
    module._drawer.cache_clear()
    try:
        directory = write_checkpoint("qwen3_moe", tmp_path / "moe", intermediate_size=256, hidden_size=64)
        config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
        mesh = make_mesh(ParallelConfig())
        rows = _compare(load_params(directory, config, mesh=mesh), random_params(config, mesh, seed=0), mesh)
        _check_scales(rows)
    finally:
        module._drawer.cache_clear()


def check_tensor_parallel_layout(workdir: Path) -> None:
    """On 4 CPU devices (tensor parallel, 2 KV heads replicated): the loaded layout, shard by shard."""
    for arch in ("llama", "qwen3_moe"):
        directory = write_checkpoint(arch, workdir / arch, intermediate_size=256, hidden_size=64)
        config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=4))
        loaded = load_params(directory, config, mesh=mesh, rules=rules_for(config, mesh))
        drawn = random_params(config, mesh, seed=0)
        rows = _compare(loaded, drawn, mesh)
        for name, x in _leaves(loaded).items():
            y = _leaves(drawn)[name]
            assert [s.data.shape for s in y.addressable_shards] == [s.data.shape for s in x.addressable_shards]
        print(json.dumps({"arch": arch, "leaves": len(rows)}))


def test_random_params_shard_like_the_loader_under_tensor_parallelism(tmp_path):
    out = run_on_cpu_devices("test_random_params", "check_tensor_parallel_layout", tmp_path, num_devices=4)
    assert [r["arch"] for r in out] == ["llama", "qwen3_moe"] and all(r["leaves"] > 5 for r in out)


def _config_only_dir(tmp_path: Path) -> tuple[Path, Path]:
    """(a checkpoint directory, a copy of it with no weights: config.json and tokenizer only)."""
    source = materialize_preset("tiny-moe")
    full = tmp_path / "full"
    shutil.copytree(source, full)
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in full.iterdir():
        if not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, bare / path.name)
    return full, bare


def test_dummy_engine_builds_from_a_config_and_generates(tmp_path):
    from jaxllm import SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    full, bare = _config_only_dir(tmp_path)
    limits = dict(max_batch_size=2, max_num_tokens=32, max_seq_len=64, compile_cache=False)
    with pytest.raises(ValueError, match="safetensors"):  # no weights: the ordinary load refuses
        LLMEngine(EngineConfig(model=str(bare), **limits))
    dummy = LLMEngine(EngineConfig(model=str(bare), load_format="dummy", **limits))
    loaded = LLMEngine(EngineConfig(model=str(full), **limits))
    try:
        mesh = dummy.runner.mesh
        _compare(loaded.runner.params, dummy.runner.params, mesh)
        request = dummy.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        while dummy.has_unfinished_requests():
            dummy.step()
        assert len(request.output_token_ids) == 6
    finally:
        dummy.close()
        loaded.close()


def test_dummy_weights_refuse_what_they_do_not_cover(tmp_path):
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    _, bare = _config_only_dir(tmp_path)
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(model=str(bare), load_format="random")
    with pytest.raises(ValueError, match="does not support quantization"):
        LLMEngine(EngineConfig(model=str(bare), load_format="dummy", quantization="int8", max_seq_len=64))
