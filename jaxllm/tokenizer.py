"""Tokenizer loading: Hugging Face tokenizers from local files only, never remote code."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path}: {exc}") from exc
