"""The engine's side of disaggregated prefill and decode (TensorRT-LLM's cache transceiver).

On a context worker a `context_only` request runs its prompt and stops after the first
token; when it finishes its prompt blocks are *held* (one more reference in the block pool,
so neither freed nor evicted) under its request id until a generation worker claims them or
`kv_transfer_timeout_ms` passes. A claim (`export`, on the engine thread) dispatches the
device -> host reads of the blocks (`jaxllm.engine.kv_offload`'s gather, in chunks of at most
`max_tokens_in_buffer` tokens) and drops the hold at once: the reads are ordered before any
later step overwrites the blocks, so the bytes travel (`jaxllm.engine.kv_transfer`) while
the worker serves on, and a transfer cut half way leaves nothing behind on this side.

On a generation worker a `generation_only` request arrives with the pulled blocks
(`KvPayload`, host arrays of the full logical block: under tensor parallelism the write is
sharded by the cache's own sharding, so the two sides may differ in TP size). `admit` gives
it a KV sequence, writes the blocks into its pool, and starts it in the generation phase with
the context worker's first token, so nothing is recomputed; the first token is reported as
the request's first update.

A claim is authenticated by `opaque_state`, an HMAC of the request id under a secret made at
start-up, so handles cannot be guessed and do not outlive the worker that issued them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine import kv_device_transfer
from jaxllm.engine.kv_blocks import (
    NO_BLOCK,
    cache_leaves,
    gather_blocks,
    leaf_block_shape,
    padded_block_count,
    scatter_blocks,
)
from jaxllm.engine.step_updates import RequestUpdate
from jaxllm.llm_args import CacheTransceiverConfig, DisaggregatedParams
from jaxllm.llm_request import LlmRequest
from jaxllm.outputs import Logprob

LeafLayout = tuple[tuple[int, ...], str]  # one block's logical shape and dtype name, per page array


@dataclass
class ExportedKv:
    """A claimed request's blocks on their way out: gathered device arrays per chunk."""

    prompt_token_ids: list[int]
    tokens_per_block: int
    layout: list[LeafLayout]
    chunks: list[tuple[int, list[jax.Array]]]  # (blocks in the chunk, one padded array per page array)

    @property
    def num_blocks(self) -> int:
        return sum(n for n, _ in self.chunks)


@dataclass
class KvPayload:
    """Blocks pulled from a context worker: one host array [blocks, *block shape] per page array."""

    prompt_token_ids: list[int]
    tokens_per_block: int
    layout: list[LeafLayout]
    arrays: list[np.ndarray]
    transfer_seconds: float = 0.0
    backend: str = "TCP"  # how the blocks came: "TCP", "SHM" or "TRANSFER"
    # TRANSFER: the blocks as pulled, on this worker's device: (blocks, one array per page
    # array padded to the gather's block count) per chunk; `arrays` is then empty.
    device_chunks: Optional[list[tuple[int, list[jax.Array]]]] = None

    @property
    def num_blocks(self) -> int:
        if self.device_chunks is not None:
            return sum(n for n, _ in self.device_chunks)
        return int(self.arrays[0].shape[0]) if self.arrays else 0

    @property
    def num_bytes(self) -> int:
        if self.device_chunks is not None:
            per_block = sum(int(np.prod(shape)) * _np_dtype(dtype).itemsize for shape, dtype in self.layout)
            return per_block * self.num_blocks
        return sum(a.nbytes for a in self.arrays)


@dataclass
class _Held:
    blocks: list[int]
    prompt_token_ids: list[int]
    deadline: float


@dataclass
class TransceiverStats:
    held_requests: int = 0  # context-only requests whose blocks were held
    claimed_requests: int = 0
    expired_requests: int = 0  # held blocks freed unclaimed after kv_transfer_timeout_ms
    exported_bytes: int = 0
    imported_requests: int = 0
    imported_bytes: int = 0
    import_seconds: float = 0.0  # pulling the blocks (network) plus writing them, generation side


class CacheTransceiver:
    """Holds, exports and imports whole requests' KV blocks (engine thread, except the counts)."""

    def __init__(self, config: CacheTransceiverConfig, runner: Any, kv_cache_manager: Any) -> None:
        self.config = config
        self.runner = runner
        self.kv = kv_cache_manager
        self.tokens_per_block = kv_cache_manager.tokens_per_block
        num_blocks = kv_cache_manager.num_blocks
        self.layout: list[LeafLayout] = [
            (leaf_block_shape(pages, axis, num_blocks), np.dtype(pages.dtype).name)
            for pages, axis in cache_leaves(runner.kv_cache)
        ]
        shardings = jax.tree.map(lambda a: a.sharding, runner.kv_cache)
        first = jax.tree.leaves(runner.kv_cache)[0].sharding
        # Blocks to write go to every device of the cache (its write shards them by KV head).
        self._data_sharding = (
            jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
            if isinstance(first, jax.sharding.NamedSharding)
            else first
        )
        self.device = min(first.device_set, key=lambda d: d.id)  # where device transfers land
        self._gather = jax.jit(functools.partial(gather_blocks, num_blocks=num_blocks))
        self._scatter = jax.jit(
            functools.partial(scatter_blocks, num_blocks=num_blocks), donate_argnums=(0,), out_shardings=shardings
        )
        self._secret = secrets.token_bytes(32)
        self._context_only: set[int] = set()  # admitted context-only requests, not finished yet
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()  # guards the reads of `_held` from the transfer thread
        self.stats = TransceiverStats()
        self.handed_over: list[RequestUpdate] = []  # imported requests' first tokens, reported by the next step

    # ------------------------------------------------------------------ any thread
    def opaque_state(self, request_id: int) -> str:
        """The secret a generation worker presents to claim `request_id`'s blocks."""
        return hmac.new(self._secret, str(request_id).encode(), hashlib.sha256).hexdigest()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def next_deadline(self) -> Optional[float]:
        """The earliest time.monotonic() at which a held request expires (None: none held)."""
        with self._lock:
            return min((h.deadline for h in self._held.values()), default=None)

    def drop(self, request_id: int) -> None:
        """Let a held request expire now (its answer ended it after all, e.g. on a stop string
        found after the engine finished it on its length): the next `expire` frees its blocks."""
        with self._lock:
            entry = self._held.get(request_id)
            if entry is not None:
                entry.deadline = 0.0

    def counts(self) -> dict:
        """Counts for the metrics (iteration stats' `kvCacheStats` names)."""
        s = self.stats
        with self._lock:
            held_blocks = sum(len(h.blocks) for h in self._held.values())
        return {
            "heldRequests": len(self._held),
            "heldBlocks": held_blocks,
            "claimedRequests": s.claimed_requests,
            "expiredRequests": s.expired_requests,
            "exportedBytes": s.exported_bytes,
            "importedRequests": s.imported_requests,
            "importedBytes": s.imported_bytes,
            "importTimeMS": s.import_seconds * 1e3,
        }

    # ------------------------------------------------------------------ engine thread
    def admit(self, request: LlmRequest, params: DisaggregatedParams) -> Optional[RequestUpdate]:
        """Check a disaggregated request as it is added. A context-only one is remembered (its
        blocks are held when it finishes); a generation-only one gets its pulled blocks and
        starts decoding. Returns the generation-only request's first update (None otherwise)."""
        sampling = request.sampling_params
        if request.beam_width > 1 or getattr(sampling, "use_beam_search", False):
            raise ValueError("disaggregated_params: beam search is not supported with disaggregated serving")
        if getattr(sampling, "prompt_logprobs", None) is not None:
            raise ValueError("disaggregated_params: prompt_logprobs are not supported with disaggregated serving")
        if params.context_only:
            if request.max_new_tokens != 1:
                raise ValueError("disaggregated_params: a context_only request must have max_tokens=1")
            self._context_only.add(request.request_id)
            return None
        if params.generation_only:
            return self._import(request, params)
        return None

    def before_free(self, request: LlmRequest, reason: str) -> None:
        """`RequestTable.finish` hook: a context-only request that ended on its length keeps
        its prompt blocks held (one reference more) until claimed or expired."""
        rid = request.request_id
        if rid not in self._context_only:
            return
        self._context_only.discard(rid)
        if reason != "length":  # stopped (end id), cancelled, failed: no generation phase follows
            return
        pool = self.kv.block_pool
        blocks = self.kv.get_block_ids(request)[: self.kv.blocks_for_tokens(len(request.prompt_token_ids))]
        for block in blocks:
            pool.acquire(block)
        deadline = time.monotonic() + self.config.kv_transfer_timeout_ms / 1e3
        with self._lock:
            self._held[rid] = _Held(blocks, list(request.prompt_token_ids), deadline)
        self.stats.held_requests += 1

    def expire(self, now: Optional[float] = None) -> int:
        """Free the held blocks whose claim time ran out. Returns how many requests expired."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [rid for rid, h in self._held.items() if h.deadline <= now]
            entries = [self._held.pop(rid) for rid in gone]
        for entry in entries:
            self._release(entry.blocks)
        self.stats.expired_requests += len(entries)
        return len(entries)

    def export(self, request_id: int, opaque_state: str, to_host: bool = True) -> ExportedKv:
        """Claim a held request: dispatch the reads of its blocks (and their copies to host
        memory unless `to_host` is False: a device transfer) and drop the hold (KeyError for
        a handle that is unknown, already claimed or expired)."""
        if not hmac.compare_digest(str(opaque_state), self.opaque_state(request_id)):
            raise KeyError(f"ctx_request_id {request_id}: the opaque_state does not match")
        with self._lock:
            entry = self._held.pop(request_id, None)
        if entry is None:
            raise KeyError(f"ctx_request_id {request_id} is not held here (unknown, already claimed or expired)")
        try:
            chunks = []
            per_chunk = len(entry.blocks)
            if self.config.max_tokens_in_buffer is not None:
                per_chunk = max(1, self.config.max_tokens_in_buffer // self.tokens_per_block)
            for start in range(0, len(entry.blocks), per_chunk):
                part = entry.blocks[start : start + per_chunk]
                src = np.zeros(padded_block_count(len(part)), np.int32)
                src[: len(part)] = part
                arrays = self._gather(self.runner.kv_cache, src)
                for a in arrays if to_host else ():
                    a.copy_to_host_async()
                chunks.append((len(part), arrays))
        finally:
            self._release(entry.blocks)  # the reads are ordered before any later write of these blocks
        exported = ExportedKv(entry.prompt_token_ids, self.tokens_per_block, self.layout, chunks)
        self.stats.claimed_requests += 1
        self.stats.exported_bytes += sum(
            int(np.prod(shape)) * np.dtype(_np_dtype(dtype)).itemsize for shape, dtype in self.layout
        ) * len(entry.blocks)
        return exported

    def warmup(self, max_blocks: int) -> None:
        """Compile the block reads and writes for every padded block count up to `max_blocks`
        (one request's), so a hand-over compiles nothing while serving (reads are discarded,
        every write is dropped)."""
        size = padded_block_count(1)
        while True:
            self._gather(self.runner.kv_cache, np.zeros(size, np.int32))
            data = [np.zeros((size, *shape), _np_dtype(dtype)) for shape, dtype in self.layout]
            self._write(np.full(size, NO_BLOCK, np.int32), data)
            if size >= max_blocks:
                break
            size *= 2

    def _write(self, dst: np.ndarray, data: list[Any]) -> None:
        """Write blocks (host or device arrays, [len(dst), *block shape]) into `dst`."""
        placed = [jax.device_put(a, self._data_sharding) for a in data]
        self.runner.kv_cache = self._scatter(self.runner.kv_cache, dst, placed)

    def _release(self, blocks: list[int]) -> None:
        pool = self.kv.block_pool
        for block in reversed(blocks):
            pool.release(block)

    def _import(self, request: LlmRequest, params: DisaggregatedParams) -> RequestUpdate:
        payload = params.kv_payload
        if not isinstance(payload, KvPayload):
            raise ValueError("disaggregated_params: a generation_only request needs its pulled KV blocks")
        prompt = request.prompt_token_ids
        if payload.prompt_token_ids != prompt:
            raise ValueError(
                f"disaggregated_params: the context worker's prompt ({len(payload.prompt_token_ids)} tokens) "
                f"is not this request's ({len(prompt)} tokens)"
            )
        if payload.tokens_per_block != self.tokens_per_block or payload.layout != self.layout:
            raise ValueError(
                "disaggregated_params: the context worker's KV layout "
                f"(tokens_per_block={payload.tokens_per_block}, blocks {payload.layout}) differs from this "
                f"worker's (tokens_per_block={self.tokens_per_block}, blocks {self.layout})"
            )
        kv = self.kv
        num_blocks = kv.blocks_for_tokens(len(prompt))
        if payload.num_blocks != num_blocks or any(a.shape[0] != num_blocks for a in payload.arrays):
            raise ValueError(f"disaggregated_params: expected {num_blocks} KV blocks for the prompt")
        first = int(params.first_gen_tokens[0])  # type: ignore[index]
        sampling = request.sampling_params
        first_logprobs = self._first_logprobs(params, first, getattr(sampling, "logprobs", None))
        started = time.perf_counter()
        ended = first in request.end_ids and not getattr(sampling, "ignore_eos", False)
        if request.max_new_tokens == 1 or ended:
            request.context_current_position = len(prompt)
            request.add_new_token(first)
            request.finish("stop" if ended else "length")
            stop_ids = getattr(sampling, "stop_token_ids", None) or ()
            request.stop_reason = first if ended and first in stop_ids else None
            return RequestUpdate(request, [first], first_logprobs, finished=True)
        need = kv.get_needed_resource_to_completion(request)
        if need > kv.get_num_available_blocks() - kv.get_num_reserved_blocks():
            raise RuntimeError(
                f"the KV cache cannot take this request now ({need} blocks to completion, "
                f"{kv.get_num_available_blocks() - kv.get_num_reserved_blocks()} unreserved); retry later"
            )
        request.context_chunk_size = len(prompt)
        kv.add_sequence(request, reuse=False)
        try:
            kv.allocate_for_step(request)
            blocks = kv.get_block_ids(request)[:num_blocks]
            if payload.device_chunks is not None:
                start = 0
                for n, arrays in payload.device_chunks:  # padded as the context side gathered them
                    dst = np.full(arrays[0].shape[0], NO_BLOCK, np.int32)
                    dst[:n] = blocks[start : start + n]
                    self._write(dst, arrays)
                    start += n
            else:
                size = padded_block_count(num_blocks)
                dst = np.full(size, NO_BLOCK, np.int32)
                dst[:num_blocks] = blocks
                data = []
                for array in payload.arrays:
                    padded = np.zeros((size,) + array.shape[1:], array.dtype)
                    padded[:num_blocks] = array
                    data.append(padded)
                self._write(dst, data)
        except BaseException:
            request.context_chunk_size = 0
            kv.free_resources(request)
            raise
        request.move_to_next_context_chunk()
        request.add_new_token(first)
        if first_logprobs:
            request.cumulative_logprob += first_logprobs[0][first].logprob
        s = self.stats
        s.imported_requests += 1
        s.imported_bytes += payload.num_bytes
        s.import_seconds += payload.transfer_seconds + time.perf_counter() - started
        return RequestUpdate(request, [first], first_logprobs)

    @staticmethod
    def _first_logprobs(params: DisaggregatedParams, first: int, top: Optional[int]) -> list[dict[int, Logprob]]:
        """The first token's logprobs entry, as the context worker sampled it (the same entry
        this worker's own sampling would have reported); empty when none were asked for."""
        if top is None:
            return []
        given = params.first_gen_log_probs
        if not given or not given[0]:
            raise ValueError("disaggregated_params.first_gen_log_probs is required when logprobs are requested")
        entry = {int(t): Logprob(float(lp), None if rank is None else int(rank)) for t, lp, rank in given[0]}
        if first not in entry or sum(1 for v in entry.values() if v.rank is not None) < top:
            raise ValueError(
                f"disaggregated_params.first_gen_log_probs must hold the first token and the top {top} tokens"
            )
        return [entry]


def _np_dtype(name: str) -> Any:
    return jax.numpy.dtype(name)


def build_transceiver(config: Any, runner: Any, kv_cache_manager: Any) -> Optional[CacheTransceiver]:
    """The transceiver `config.cache_transceiver_config` asks for (None when unset); refuses
    what this engine cannot hand over, naming the field."""
    transceiver_config = config.cache_transceiver_config
    if transceiver_config is None:
        return None
    if config.enable_attention_dp:
        raise ValueError("cache_transceiver_config is not supported with enable_attention_dp yet")
    if jax.process_count() > 1:
        raise ValueError("cache_transceiver_config is not supported on several hosts yet")
    if transceiver_config.backend == "TRANSFER" and not kv_device_transfer.available():
        raise ValueError(
            f"cache_transceiver_config.backend TRANSFER needs jax.experimental.transfer, "
            f"which jax {jax.__version__} does not have"
        )
    return CacheTransceiver(transceiver_config, runner, kv_cache_manager)
