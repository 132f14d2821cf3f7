"""The fixed-shape inputs of one engine step (the seam between host scheduler and device).

All arrays have static shapes chosen from a few buckets, so the jitted step compiles once
per bucket. Shapes: T = token bucket, S = max_batch_size, MB = max_blocks_per_seq.

Packing (TensorRT-LLM order): tokens of context chunks first, then one token per
generation request. Sequence `s` owns tokens `cu_q_lens[s] : cu_q_lens[s+1]`; the query
token `i` of sequence `s` sits at position `kv_lens[s] - q_len(s) + i` and attends
causally to every cached token of its sequence up to itself.

Padding: tokens past `cu_q_lens[num_seqs]` have `slot_mapping == num_kv_slots` (one past
the last slot, so KV writes are dropped) and their outputs are ignored; sequences
`s >= num_seqs` have q_len 0, kv_len 0 and `logits_indices[s] == 0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    token_ids: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T] absolute position of each token in its sequence
    slot_mapping: np.ndarray  # int32[T] block_id * tokens_per_block + offset; padding = num slots
    cu_q_lens: np.ndarray  # int32[S + 1] query start offsets (cumulative q_len)
    kv_lens: np.ndarray  # int32[S] KV length of each sequence after this step's tokens
    block_tables: np.ndarray  # int32[S, MB] physical block ids; unused entries are any valid id
    num_seqs: np.ndarray  # int32[1] live sequences in this step
    logits_indices: np.ndarray  # int32[S] token whose logits are sampled for each sequence
    # int32[T] LoRA slot of each token (-1: no adapter); None when the engine serves no
    # adapters, which leaves the compiled step exactly as without LoRA (see jaxllm.lora).
    lora_slots: Optional[np.ndarray] = None
    # A static bound on the step's (query tile, KV block) pairs for the `xla` attention backend,
    # counted on the host (`jaxllm.engine.kv_work_tiers`); None: the shapes' worst case. Part
    # of the program's layout (a pytree meta field): one program per bound.
    kv_work_items: Optional[int] = field(default=None, metadata=dict(static=True))

    @property
    def num_tokens_padded(self) -> int:
        return int(self.token_ids.shape[0])

    def as_device(self) -> StepBatch:
        return StepBatch(
            **{
                f.name: None if getattr(self, f.name) is None else jax.numpy.asarray(getattr(self, f.name))
                for f in fields(self)
                if not f.metadata.get("static")
            },
            kv_work_items=self.kv_work_items,
        )
