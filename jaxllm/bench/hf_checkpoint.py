"""The checkpoint an HF transformers peer loads: the model itself, or, for an integer-quantized
one (a converted GGUF file such as SmolLM2's Q4_1, AWQ, GPTQ), the float checkpoint of its
dequantized weights, written once into the cache. transformers cannot run the engine's integer
layout, and the float weights are the same numbers the engine's dequantization computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

INTEGER_METHODS = ("gguf", "awq", "gptq")


def float_checkpoint(model: str | Path) -> tuple[Path, Optional[str]]:
    """(a directory transformers can load with the model's weights, the integer format it was
    dequantized from or None)."""
    from jaxllm.models.cache_dir import cache_root
    from jaxllm.models.resolve import resolve_model

    directory = Path(resolve_model(str(model)))
    qc = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") not in INTEGER_METHODS:
        return directory, None
    float_dir = cache_root() / "bench" / "float" / directory.name
    if not (float_dir / "config.json").is_file():
        from jaxllm.models.float_checkpoint import write_float_checkpoint

        write_float_checkpoint(directory, float_dir)
    return float_dir, qc.get("weight_type") or qc["quant_method"]
