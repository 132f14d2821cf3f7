"""The host KV tier's copies, as the engine drives them: which blocks go to the host and come
back, and when (`jaxllm.kv_cache.host_tier` keeps the host slots and their LRU).

Copies are batched and off the step's critical path: one gather program reads every offload
of a step before its launch, then the bytes go to host memory asynchronously (through JAX's
`pinned_host` memory kind where the backend has it); onboards start their host -> device
transfer before a launch and are written into the cache (one scatter program) before a
later scheduling once arrived. Neither direction makes the engine thread wait for a device.

The buffer and the device programs are a `HostBlockCopier` (`jaxllm.engine.kv_host_copies`):
in a multi-host run each process has its own, holding its devices' shards, and the leader's
calls on it are made by every process in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from jaxllm.engine.kv_blocks import NO_BLOCK, block_bytes, padded_block_count
from jaxllm.engine.kv_host_copies import HostBlockCopier
from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.host_tier import HostTier
from jaxllm.kv_cache.spec import MlaLayerCache
from jaxllm.llm_args import KvCacheConfig, physical_memory_bytes


@dataclass
class TransferCounts:
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    offloaded_bytes: int = 0
    onboarded_bytes: int = 0
    copy_seconds: float = 0.0  # engine-thread time spent starting copies and landing them


class KvOffloader:
    """Makes the host tiers' queued copies on the runner's cache, off the step's critical path.

    * Before a launch (`flush`): the step's offloads are read from the device (one gather
      program ordered before the step) and copied to host memory asynchronously; they land in
      the buffer at a later `poll`, once ready. Onboards whose host bytes are in the buffer
      start their host -> device transfer (one batch); the others start once their own
      offload landed.
    * Before scheduling (`poll`): transfers that arrived are written into the cache (one
      scatter program, ordered before the next step) and their requests may run; a request
      whose blocks are still arriving waits, the others are scheduled.

    `tiers`: one host tier per attention-DP rank (one without attention DP); rank r's host
    slot s is row r * slots + s of the buffer. `copier`: the buffer and the copy programs
    (built from `runner` unless given; a multi-host leader passes its mirrored one)."""

    def __init__(
        self,
        runner: Any,
        tiers: list[HostTier],
        num_blocks: int,
        *,
        attention_dp: bool = False,
        copier: Optional[Any] = None,
        max_batch: int = 64,
    ) -> None:
        self.tiers, self.num_blocks = tiers, num_blocks
        # Copies go in batches of at most this many blocks (a power of two), so the programs of
        # every batch size compile at warm-up (`warmup`) and never while serving.
        self.max_batch = padded_block_count(max_batch)
        self.num_slots = tiers[0].num_slots
        self.copier = copier or HostBlockCopier(runner, len(tiers) * self.num_slots, num_blocks, attention_dp)
        self.counts = TransferCounts()
        self._onboards: list[tuple[int, int, int, int]] = []  # (tier, slot, block, ticket) not started
        self._writes: list[list[tuple[int, int, int]]] = []  # started batches: (tier, block, ticket)

    def use_copier(self, copier: Any) -> None:
        """Make the copies through `copier` (a multi-host leader's mirrored copier, wrapping
        this one's)."""
        self.copier = copier

    @property
    def memory_kind(self) -> Optional[str]:
        """The host memory kind the copies go through (`kv_host_copies.host_memory_kind`)."""
        return self.copier.memory_kind

    @property
    def num_in_flight(self) -> int:
        """Offloaded blocks whose bytes are still on their way to the host buffer."""
        return self.copier.reads_in_flight

    @property
    def num_waiting(self) -> int:
        """Requests waiting for onboarded blocks."""
        return sum(len(t.waiting_ids) for t in self.tiers)

    @property
    def num_arriving(self) -> int:
        """Onboarded blocks not yet written into the device cache (queued or in transit)."""
        return len(self._onboards) + sum(len(blocks) for blocks in self._writes)

    def flush(self) -> None:
        """Right before a launch: read this step's offloads (ordered before the step, which may
        overwrite the evicted blocks) and start the onboards' transfers."""
        started = time.perf_counter()
        offloads = []
        for rank, tier in enumerate(self.tiers):
            taken, onboards = tier.take_transfers()
            offloads += [(rank, block, slot) for block, slot in taken]
            self._onboards += [(rank, slot, block, ticket) for slot, block, ticket in onboards]
        for chunk in _chunks(offloads, self.max_batch):
            self._read(chunk)
        self.copier.land(wait=False)
        self._start_onboards()
        self.counts.copy_seconds += time.perf_counter() - started

    def poll(self, wait: bool = False) -> None:
        """Before scheduling: land finished reads, start onboards whose bytes landed, and write
        arrived onboards into the cache, releasing their requests. `wait`: finish everything
        in flight (nothing else can run)."""
        if wait:
            self.flush()  # onboards queued since the last launch
        if not (self.copier.reads_in_flight or self._onboards or self._writes):
            return
        started = time.perf_counter()
        self.copier.land(wait)
        self._start_onboards()  # with `wait`, every read landed: all of them
        self._write_arrived(wait)
        self.counts.copy_seconds += time.perf_counter() - started

    def _read(self, offloads: list[tuple[int, int, int]]) -> None:
        n = len(offloads)
        src, ranks = np.zeros(padded_block_count(n), np.int32), np.zeros(padded_block_count(n), np.int32)
        src[:n] = [block for _, block, _ in offloads]
        ranks[:n] = [rank for rank, _, _ in offloads]
        self.copier.read(src, ranks, [rank * self.num_slots + slot for rank, _, slot in offloads])
        self.counts.offloaded_blocks += n
        self.counts.offloaded_bytes += n * self.tiers[0].bytes_per_block

    def _start_onboards(self) -> None:
        """Start the host -> device transfer of every onboard whose host bytes are in the buffer."""
        ready, later = [], []
        for onboard in self._onboards:
            rank, slot, _, _ = onboard
            (later if self.copier.reading(rank * self.num_slots + slot) else ready).append(onboard)
        self._onboards = later
        for chunk in _chunks(ready, self.max_batch):
            self._start_batch(chunk)

    def _start_batch(self, ready: list[tuple[int, int, int, int]]) -> None:
        n = len(ready)
        self.copier.start([rank * self.num_slots + slot for rank, slot, _, _ in ready], padded_block_count(n))
        for rank, tier in enumerate(self.tiers):
            tier.release_slots([slot for r, slot, _, _ in ready if r == rank])
        self._writes.append([(rank, block, ticket) for rank, _, block, ticket in ready])
        self.counts.onboarded_blocks += n
        self.counts.onboarded_bytes += n * self.tiers[0].bytes_per_block

    def _write_arrived(self, wait: bool) -> None:
        """Scatter the transfers that arrived into the cache, oldest first (one program each)."""
        while self._writes and (wait or self.copier.oldest_write_ready()):
            blocks = self._writes.pop(0)
            size = padded_block_count(len(blocks))
            dst, ranks = np.full(size, NO_BLOCK, np.int32), np.zeros(size, np.int32)
            for i, (rank, block, ticket) in enumerate(blocks):
                if self.tiers[rank].is_current(block, ticket):  # else evicted meanwhile: dropped
                    dst[i], ranks[i] = block, rank
            self.copier.write(dst, ranks)
            for rank, tier in enumerate(self.tiers):
                tier.arrived([(block, ticket) for r, block, ticket in blocks if r == rank])

    def warmup(self) -> None:
        """Compile the copy programs of every batch size (up to `max_batch` blocks)."""
        self.copier.warmup(self.max_batch)

    def stats(self) -> dict:
        """Host-tier fields added to the iteration statistics' `kvCacheStats` (summed over ranks)."""
        tiers, c = self.tiers, self.counts
        return {
            "hostMaxNumBlocks": sum(t.num_slots for t in tiers),
            "hostFreeNumBlocks": sum(t.num_free for t in tiers),
            "hostCachedBlocks": sum(t.num_cached for t in tiers),
            "hostReusedBlocks": sum(t.onboarded_blocks for t in tiers),
            "offloadedBlocks": c.offloaded_blocks,
            "onboardedBlocks": c.onboarded_blocks,
            "offloadedBytes": c.offloaded_bytes,
            "onboardedBytes": c.onboarded_bytes,
            "copyTimeMS": c.copy_seconds * 1e3,
            "onboardingRequests": self.num_waiting,
        }


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_host_tier(
    kv_cfg: KvCacheConfig,
    kv_cache: Any,
    num_blocks: int,
    *,
    attention_dp: bool,
    events: KvEventRecorder | None,
) -> HostTier | None:
    """The host tier `kv_cfg.host_cache_size` asks for (None when unset or 0); refuses
    what this engine cannot do with the field named."""
    size = kv_cfg.host_cache_size
    if not size:
        return None
    if not kv_cfg.enable_block_reuse:
        raise ValueError("kv_cache_config.host_cache_size needs enable_block_reuse=True (it keeps reusable blocks)")
    if attention_dp and isinstance(kv_cache[0], MlaLayerCache):
        raise ValueError(
            "kv_cache_config.host_cache_size is not supported with enable_attention_dp for multi-head "
            "latent attention models yet"
        )
    ranks = kv_cache[0].k.shape[0] if attention_dp else 1  # each attention-DP rank has its own tier
    per_block = block_bytes(kv_cache, num_blocks, ranks)
    ram = physical_memory_bytes()
    if ranks > 1 and ram is not None and size * ranks > ram:
        raise ValueError(
            f"kv_cache_config.host_cache_size={size} bytes per attention-DP rank, {ranks} ranks: "
            f"more than this machine's memory ({ram} bytes)"
        )
    if size < per_block:
        raise ValueError(
            f"kv_cache_config.host_cache_size={size} bytes is smaller than one KV block ({per_block} bytes)"
        )
    return HostTier(size // per_block, per_block, min_priority=kv_cfg.secondary_offload_min_priority, events=events)
