"""Tokenizer loading: Hugging Face tokenizers from local files only, never remote code."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path


def quiet_transformers_import() -> None:
    """jaxllm needs only transformers' tokenizers: without torch installed, keep transformers
    from warning on import that its models are unavailable (call before importing it)."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


# Classes that wrap a `tokenizer.json` alone, whatever the model: loaded directly, they are the
# tokenizer AutoTokenizer would build.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _declared_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str | Path):
    """The tokenizer of a local directory. One whose config names a generic `tokenizer.json`
    class is loaded through that class: AutoTokenizer would build the same object, but its
    module imports transformers' model configuration code and with it torch, seconds of every
    engine start."""
    quiet_transformers_import()
    import transformers

    directory = Path(path)
    declared = _declared_class(directory) if directory.is_dir() else None
    try:
        if (
            declared in GENERIC_TOKENIZER_CLASSES
            and (directory / "tokenizer.json").is_file()
            and hasattr(transformers, declared)
        ):
            return getattr(transformers, declared).from_pretrained(
                str(path), trust_remote_code=False, local_files_only=True
            )
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path}: {exc}") from exc
