"""Tokenizer loading: Hugging Face tokenizers from local files only, never remote code."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def quiet_transformers_import() -> None:
    """jaxllm needs only transformers' tokenizers: without torch installed, keep transformers
    from warning on import that its models are unavailable (call before importing it)."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(path: str | Path):
    quiet_transformers_import()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path}: {exc}") from exc
