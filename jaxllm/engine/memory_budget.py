"""What an engine's limits will allocate, checked against the machine before anything is allocated.

The KV pool sizes itself to the memory it finds (`builder.plan_num_kv_blocks`), but other
buffers follow the limits directly: the sampling tensors hold every row's token history
([max_batch_size, max_seq_len] ids and flags, on the host and on the device), and LoRA keeps
`max_loras` zeroed slots of rank `max_lora_rank` for every adapted projection. A limit that
makes these larger than the memory available is refused with the figure and the flag to change.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.lora.adapter import layer_targets, target_dims
from jaxllm.models import ModelConfig
from jaxllm.models.model_config import numpy_dtype

# Token history of one row and position: int32 id + bool "is output", on the host and the device.
_HISTORY_BYTES_PER_POSITION = 2 * (4 + 1)
GIB = 1024**3


def sampling_history_bytes(num_rows: int, max_seq_len: int) -> int:
    """Bytes of the sampling tensors' token histories ([rows, max_seq_len], host and device)."""
    return num_rows * max_seq_len * _HISTORY_BYTES_PER_POSITION


def lora_slot_bytes(model_config: ModelConfig, max_loras: int, max_lora_rank: int) -> int:
    """Bytes of the zeroed LoRA slots: A [in, rank] and B [rank, out] per slot, layer and target."""
    itemsize = numpy_dtype(model_config.dtype).itemsize
    per_rank = sum(
        sum(target_dims(model_config, t))
        for layer in range(model_config.num_layers)
        for t in layer_targets(model_config, layer)
    )
    return max_loras * max_lora_rank * per_rank * itemsize


def available_bytes(devices: Optional[list] = None) -> Optional[int]:
    """Free memory of the tightest device when devices report it, else the host's available memory."""
    devices = devices if devices is not None else jax.local_devices()
    stats = [d.memory_stats() or {} for d in devices]
    if stats and all("bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_engine_allocations(
    config: EngineConfig,
    model_config: ModelConfig,
    max_seq_len: int,
    num_rows: int,
    available: Optional[int] = None,
) -> None:
    """ValueError naming the figure and the flag when the limits' fixed buffers do not fit.

    `num_rows`: sampler rows (max_batch_size per attention-DP rank); `available`: free bytes
    (default: `available_bytes()`; unknown: nothing is checked).
    """
    available = available_bytes() if available is None else available
    if available is None:
        return
    needs = [
        (
            sampling_history_bytes(num_rows, max_seq_len),
            f"the sampling tensors of max_batch_size={config.max_batch_size} rows x max_seq_len={max_seq_len}",
            "lower --max-batch-size or --max-seq-len",
        )
    ]
    if config.enable_lora:
        needs.append(
            (
                lora_slot_bytes(model_config, config.max_loras, config.max_lora_rank),
                f"the LoRA slots of max_loras={config.max_loras} x max_lora_rank={config.max_lora_rank}",
                "lower --max-loras or --max-lora-rank",
            )
        )
    total = sum(n for n, _, _ in needs)
    if total <= available * 0.9:
        return
    size, what, fix = max(needs)
    together = f" ({total / GIB:.2f} GiB in all)" if total != size else ""
    raise ValueError(
        f"{what} need {size / GIB:.2f} GiB{together} but only {available / GIB:.2f} GiB is available; {fix}"
    )
