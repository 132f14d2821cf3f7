"""An integer-quantized checkpoint written out as the float checkpoint it approximates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxllm.models.awq_gptq import int4_group_tensors
from jaxllm.models.int_checkpoint_view import DequantizedTensors
from jaxllm.models.loader import checkpoint_files
from jaxllm.models.quant_config import parse_quantization_config


def write_float_checkpoint(model_dir: str | Path, out_dir: str | Path) -> Path:
    """`model_dir` (an integer-quantized checkpoint: converted GGUF, AWQ or GPTQ) written to
    `out_dir` as a float32 checkpoint of its dequantized weights, without quantization_config
    (the float model the quantized one approximates, e.g. for `jaxllm bench quant`)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    qc = parse_quantization_config(config.pop("quantization_config", None))
    if qc.method not in ("int8_block", "int4_block", "uint4_block"):
        raise ValueError(f"{model_dir} is not an integer-quantized checkpoint")
    tensors: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="np") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    dtypes = {n: {"int8": "I8", "int32": "I32"}.get(t.dtype.name, "F32") for n, t in tensors.items()}
    groups = int4_group_tensors(shapes, dtypes, qc)
    if groups is not None:
        for name, (shape, dtype, _) in groups.names().items():
            tensors[name] = groups.read(name, (Ellipsis,), tensors.__getitem__)
            shapes[name], dtypes[name] = shape, dtype
        for name in groups.packed_names():
            tensors.pop(name, None)
            shapes.pop(name, None)
    view = DequantizedTensors(shapes, dtypes, qc)
    out = {name: view.read(name, (Ellipsis,), tensors.__getitem__) for name in view.weights}
    out.update({n: t for n, t in tensors.items() if n not in out and n not in view.hidden_names()})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: np.ascontiguousarray(t) for n, t in out.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in model_dir.iterdir():
        if extra.suffix in (".json", ".txt", ".model", ".jinja") and extra.name not in ("config.json",):
            if not extra.name.startswith("model.safetensors"):
                shutil.copy(extra, out_dir / extra.name)
    return out_dir
