"""Offline expert-load statistics: recording per-step counts and reading them back.

File format (TensorRT-LLM's): a directory `EXPERT_STATISTIC_PATH` holding
`rank{r}.safetensors`, each a map `"{iteration}_{layer}"` -> int32 token counts, and
`meta_info.json` with `num_experts` and `num_experts_per_token`. Readers sum the rank
files key by key. jaxllm counts over the global batch in one process, so it writes one
file (`rank0.safetensors`) and records the EP size in `meta_info.json` (`ep_size`);
without that field the EP size is the number of rank files, as in the reference.
Counts are per expert (the router's choices); when a placement with redundant slots is
active they may be per slot instead (as the reference does): the row is then num_slots long
and `num_experts` in `meta_info.json` is that width, so the report splits it over the ranks.

Iterations a <= it < b are recorded when `EXPERT_STATISTIC_ITER_RANGE="a-b"` is set; the
files are written once the step loop reaches iteration b (or on `close()`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from safetensors.numpy import load_file, save_file

ITER_RANGE_ENV = "EXPERT_STATISTIC_ITER_RANGE"
PATH_ENV = "EXPERT_STATISTIC_PATH"
META_FILE = "meta_info.json"


def parse_iter_range(span: str) -> tuple[int, int]:
    """'a-b' -> (a, b), the half-open iteration range [a, b)."""
    parts = str(span).strip().split("-")
    try:
        if len(parts) != 2:
            raise ValueError
        start, stop = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"{ITER_RANGE_ENV} must look like 'a-b' with integers a <= b, got {span!r}") from None
    if start < 0 or stop < start:
        raise ValueError(f"{ITER_RANGE_ENV}: need 0 <= a <= b, got {span!r}")
    return start, stop


class ExpertStatisticsWriter:
    """Collects per-step expert token counts on the host and saves them in the reference format.

    Call `record(iteration, counts)` once per engine step with the global counts of that
    step, an integer array [num_layers, num_experts] (or [num_layers, num_slots]). Steps
    outside [iter_start, iter_stop) are ignored; the files are written when a step at or
    past iter_stop is recorded, or by `close()`.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        iter_start: int,
        iter_stop: int,
        *,
        num_experts_per_token: int,
        ep_size: int = 1,
        layer_ids: Optional[Sequence[int]] = None,
        rank: int = 0,
    ) -> None:
        if not 0 <= iter_start <= iter_stop:
            raise ValueError(f"need 0 <= iter_start <= iter_stop, got {iter_start}, {iter_stop}")
        if num_experts_per_token <= 0 or ep_size <= 0:
            raise ValueError("num_experts_per_token and ep_size must be positive")
        self.path = os.fspath(path)
        self.iter_start, self.iter_stop = int(iter_start), int(iter_stop)
        self.num_experts_per_token = int(num_experts_per_token)
        self.ep_size = int(ep_size)
        self.layer_ids = None if layer_ids is None else [int(i) for i in layer_ids]
        self.rank = rank
        self._records: dict[str, np.ndarray] = {}
        self._num_experts: Optional[int] = None
        self.saved = False

    @classmethod
    def from_env(
        cls,
        *,
        num_experts_per_token: int,
        ep_size: int = 1,
        layer_ids: Optional[Sequence[int]] = None,
        iter_range: Optional[str] = None,
        path: Optional[str] = None,
    ) -> Optional[ExpertStatisticsWriter]:
        """A writer configured from EXPERT_STATISTIC_ITER_RANGE / EXPERT_STATISTIC_PATH (explicit
        arguments win), or None when no iteration range is set (collection off)."""
        span = iter_range if iter_range is not None else os.environ.get(ITER_RANGE_ENV)
        if span is None or not str(span).strip():
            return None
        start, stop = parse_iter_range(span)
        out = path if path is not None else os.environ.get(PATH_ENV)
        if not out:
            raise ValueError(f"{ITER_RANGE_ENV} is set but {PATH_ENV} (where to write the statistics) is not")
        return cls(out, start, stop, num_experts_per_token=num_experts_per_token, ep_size=ep_size, layer_ids=layer_ids)

    def wants(self, iteration: int) -> bool:
        """Whether this step's counts are needed (lets the caller skip a device->host copy)."""
        return not self.saved and self.iter_start <= iteration < self.iter_stop

    def record(self, iteration: int, counts: np.ndarray) -> None:
        if self.saved:
            return
        if iteration >= self.iter_stop:
            self.save()
            return
        if iteration < self.iter_start:
            return
        counts = np.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"counts must be [num_layers, num_experts], got shape {counts.shape}")
        layer_ids = self.layer_ids if self.layer_ids is not None else list(range(counts.shape[0]))
        if len(layer_ids) != counts.shape[0]:
            raise ValueError(f"counts has {counts.shape[0]} layers, layer_ids names {len(layer_ids)}")
        if self._num_experts is None:
            self._num_experts = int(counts.shape[1])
        elif counts.shape[1] != self._num_experts:
            raise ValueError(f"counts has {counts.shape[1]} experts, earlier steps had {self._num_experts}")
        for layer, row in zip(layer_ids, counts):
            key = f"{iteration}_{layer}"
            row = row.astype(np.int32)
            # A step may be recorded in several parts (micro-batches): counts add up.
            self._records[key] = self._records[key] + row if key in self._records else row.copy()

    def save(self) -> None:
        """Write rank{r}.safetensors and meta_info.json (once)."""
        if self.saved:
            return
        self.saved = True
        if not self._records:
            return
        os.makedirs(self.path, exist_ok=True)
        meta = {
            "num_experts": self._num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "ep_size": self.ep_size,
        }
        if self.rank == 0:
            with open(os.path.join(self.path, META_FILE), "w", encoding="utf-8") as f:
                json.dump(meta, f)
        save_file(self._records, os.path.join(self.path, f"rank{self.rank}.safetensors"))

    close = save


@dataclass
class ExpertStatistics:
    """Recorded counts as one array: counts[i, l, e] = tokens of iteration iters[i], layer layers[l], expert e."""

    counts: np.ndarray
    iters: list[int]
    layers: list[int]
    num_experts_per_token: int
    ep_size: int
    meta: dict

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[-1])

    def layer_counts(self, layer: int) -> np.ndarray:
        """[num_iters, num_experts] counts of one layer (by its layer id)."""
        return self.counts[:, self.layers.index(layer)]


def load_expert_statistics(
    path: Union[str, os.PathLike], iter_start: Optional[int] = None, iter_stop: Optional[int] = None
) -> ExpertStatistics:
    """Read a statistics directory (rank files summed), keeping iterations in [iter_start, iter_stop)."""
    path = os.fspath(path)
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} holds no expert statistics ({META_FILE} is missing)")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "rank*.safetensors")))
    if not files:
        raise ValueError(f"{path!r} holds no rank*.safetensors statistics files")
    summed: dict[tuple[int, int], np.ndarray] = {}
    for name in files:
        for key, data in load_file(name).items():
            try:
                it, layer = (int(x) for x in key.split("_"))
            except ValueError:
                raise ValueError(f"{name}: key {key!r} is not 'iteration_layer'") from None
            summed[(it, layer)] = summed[(it, layer)] + data if (it, layer) in summed else data.astype(np.int64)
    iters = sorted({it for it, _ in summed})
    layers = sorted({layer for _, layer in summed})
    lo = iters[0] if iter_start is None else iter_start
    hi = iters[-1] + 1 if iter_stop is None else iter_stop
    iters = [it for it in iters if lo <= it < hi]
    if not iters:
        raise ValueError(f"{path!r} has no iterations in [{lo}, {hi})")
    missing = [(it, layer) for it in iters for layer in layers if (it, layer) not in summed]
    if missing:
        raise ValueError(f"{path!r}: iteration/layer {missing[0]} is missing ({len(missing)} in all)")
    counts = np.stack([np.stack([summed[(it, layer)] for layer in layers]) for it in iters])
    ep_size = int(meta.get("ep_size") or len(files))
    meta = dict(meta, ep_size=ep_size, iter_start=iters[0], iter_stop=iters[-1] + 1, layers=layers)
    return ExpertStatistics(
        counts=counts,
        iters=iters,
        layers=layers,
        num_experts_per_token=int(meta.get("num_experts_per_token", 0)),
        ep_size=ep_size,
        meta=meta,
    )


def write_expert_statistics(
    path: Union[str, os.PathLike],
    counts: np.ndarray,
    *,
    iter_start: int = 0,
    num_experts_per_token: int,
    ep_size: int,
    layer_ids: Optional[Sequence[int]] = None,
) -> None:
    """Write counts [num_iters, num_layers, num_experts] as a statistics directory (synthetic workloads, tests)."""
    counts = np.asarray(counts)
    writer = ExpertStatisticsWriter(
        path,
        iter_start,
        iter_start + counts.shape[0],
        num_experts_per_token=num_experts_per_token,
        ep_size=ep_size,
        layer_ids=layer_ids,
    )
    for i, step in enumerate(counts):
        writer.record(iter_start + i, step)
    writer.save()
