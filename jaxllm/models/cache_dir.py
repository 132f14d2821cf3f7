"""Where jaxllm keeps what it builds or downloads (presets, converted GGUF models, wheels,
compiled programs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$JAXLLM_CACHE_DIR, else ~/.cache/jaxllm."""
    root = os.environ.get("JAXLLM_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "jaxllm"
