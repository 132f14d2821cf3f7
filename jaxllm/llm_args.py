"""User-facing configuration dataclasses (names follow the TensorRT-LLM LLM API)."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Optional


class CapacitySchedulerPolicy(str, enum.Enum):
    """Which requests get KV-cache resources in a step."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(str, enum.Enum):
    """How the token budget is split between context requests when chunking."""

    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


def _coerce_enum(enum_type: type[enum.Enum], value, field_name: str):
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(str(value).upper())
    except ValueError:
        allowed = ", ".join(m.value for m in enum_type)
        raise ValueError(f"{field_name}={value!r} is not one of: {allowed}") from None


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED

    def __post_init__(self) -> None:
        self.capacity_scheduler_policy = _coerce_enum(
            CapacitySchedulerPolicy, self.capacity_scheduler_policy, "capacity_scheduler_policy"
        )
        self.context_chunking_policy = _coerce_enum(
            ContextChunkingPolicy, self.context_chunking_policy, "context_chunking_policy"
        )


# Values of `KvCacheConfig.dtype` / `--kv-cache-dtype` (TensorRT-LLM's and vLLM's names): "auto"
# stores the KV cache in the model's dtype; "fp8" (or vLLM's "fp8_e4m3") as float8_e4m3fn.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


def normalize_kv_cache_dtype(value: Any) -> str:
    """'auto' or 'fp8' from an accepted spelling; anything else is a ValueError naming it."""
    name = value.lower() if isinstance(value, str) else value
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_config.dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {value!r}")
    return KV_CACHE_DTYPES[name]


@dataclass
class KvCacheConfig:
    """Paged KV cache sizing. The smaller of `max_tokens` and the memory fraction wins."""

    tokens_per_block: int = 32
    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    event_buffer_max_size: int = 0
    # Host (secondary) tier: bytes of host memory that keep reusable blocks evicted from the
    # device (`jaxllm.kv_cache.host_tier`); 0 turns it off. Units such as "8GiB" are accepted.
    host_cache_size: Optional[int] = None
    # Blocks below this retention priority are dropped on eviction, not offloaded.
    secondary_offload_min_priority: Optional[int] = None
    # "auto" (the model's dtype) or "fp8": K/V stored as float8_e4m3fn with per-layer scales
    # (the checkpoint's k_scale / v_scale, else 1.0), half the bytes of bfloat16 per token.
    dtype: str = "auto"
    # With dtype "fp8" and no scales in the checkpoint: per-layer scales amax / 448 from a
    # calibration prefill at start-up (`jaxllm.models.kv_calibration`) instead of 1.0.
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        self.dtype = normalize_kv_cache_dtype(self.dtype)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and self.dtype != "fp8":
            raise ValueError(f"calculate_kv_scales needs dtype='fp8' (the KV cache dtype is {self.dtype!r})")
        if self.host_cache_size is not None:
            self.host_cache_size = parse_byte_size("host_cache_size", self.host_cache_size)
            ram = physical_memory_bytes()
            if ram is not None and self.host_cache_size > ram:
                raise ValueError(
                    f"host_cache_size={self.host_cache_size} bytes is more than this machine's memory ({ram} bytes)"
                )
        if self.secondary_offload_min_priority is not None:
            value = self.secondary_offload_min_priority
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
                raise ValueError(f"secondary_offload_min_priority must be an int in [0, 100], got {value!r}")
        for name in ("tokens_per_block", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not hasattr(type(value), "__index__")):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(self.free_gpu_memory_fraction, bool) or not isinstance(
            self.free_gpu_memory_fraction, (int, float)
        ):
            raise ValueError(f"free_gpu_memory_fraction must be a number, got {self.free_gpu_memory_fraction!r}")
        if not 1 <= self.tokens_per_block <= 1 << 16 or self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(
                f"tokens_per_block must be a positive power of two up to 65536, got {self.tokens_per_block}"
            )
        if self.max_tokens is not None and self.max_tokens < self.tokens_per_block:
            raise ValueError(f"max_tokens must be at least tokens_per_block, got {self.max_tokens}")
        if not 0.0 < self.free_gpu_memory_fraction <= 1.0:
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")
        if (
            isinstance(self.event_buffer_max_size, bool)
            or not isinstance(self.event_buffer_max_size, int)
            or self.event_buffer_max_size < 0
        ):
            raise ValueError(
                f"event_buffer_max_size must be an int >= 0 (0: no KV cache events), got {self.event_buffer_max_size!r}"
            )


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}
_BYTE_UNITS.update({"g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40})


def parse_byte_size(name: str, value: Any) -> int:
    """A byte count: a non-negative int, or a string such as "8GiB", "512MB", "1.5g"."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise ValueError(f"{name} must be a byte count such as 8GiB or 512MB, got {value!r}")
        return int(float(match.group(1)) * _BYTE_UNITS[unit])
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
    return value


def physical_memory_bytes() -> Optional[int]:
    """This machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


MOE_DISPATCH_MODES = ("auto", "all_to_all", "allgather", "ragged_all_to_all")  # the last: not on XLA:CPU


@dataclass
class MoeConfig:
    """How MoE layers run under expert parallelism.

    `load_balancer` is the expert placement loaded at start: a `MoeLoadBalancerConfig`
    (`sharding.eplb.eplb_config`), its fields as a dict, or the path of the YAML that
    `jaxllm eplb generate-config` writes; with `layer_updates_per_iter > 0` the online
    balancer keeps rebalancing it while serving (`jaxllm.engine.load_balancer`). `dispatch` picks
    how tokens reach the ranks that hold their experts ("auto": by the step's token bucket); `capacity_factor` opts into
    a capacity-limited all_to_all that drops (and counts) overflow rows.
    """

    load_balancer: Optional[Any] = None
    dispatch: str = "auto"
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.load_balancer is not None:
            from sharding.eplb.eplb_config import load_eplb_config

            self.load_balancer = load_eplb_config(self.load_balancer)
        if self.dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe dispatch must be one of {MOE_DISPATCH_MODES}, got {self.dispatch!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor!r}")


def check_known_fields(cls, kwargs: dict) -> None:
    """Raise ValueError naming any keyword that `cls` does not define."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) for {cls.__name__}: {', '.join(unknown)}")


CACHE_TRANSCEIVER_BACKENDS = ("DEFAULT", "TCP", "SHM", "TRANSFER")  # accepted names; DEFAULT: the best available here


@dataclass
class CacheTransceiverConfig:
    """A worker that hands KV blocks over to another (disaggregated prefill and decode), as
    TensorRT-LLM's `cache_transceiver_config`. `backend`: how a generation worker pulls the
    blocks: "TCP", a host-memory stream that works between processes and hosts; "SHM", a
    shared-memory segment when the context worker is on the same host, TCP otherwise;
    "TRANSFER", device to device through `jax.experimental.transfer` (no host copy on either
    side; the claim itself still goes over TCP); "DEFAULT" picks SHM (on CPU processes
    TRANSFER is no faster than the host paths, `jaxllm bench kv-transfer`; on a GPU/TPU it
    has not run yet).
    `max_tokens_in_buffer`: the most tokens' worth of blocks staged in host memory at once
    per transfer (None: a whole request). `kv_transfer_timeout_ms`: how long a context-only
    request's blocks stay held for a generation worker to claim them."""

    backend: str = "DEFAULT"
    max_tokens_in_buffer: Optional[int] = None
    kv_transfer_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        backend = str(self.backend).upper()
        if backend not in CACHE_TRANSCEIVER_BACKENDS:
            raise ValueError(
                f"cache_transceiver_config.backend must be one of {', '.join(CACHE_TRANSCEIVER_BACKENDS)}, "
                f"got {self.backend!r}"
            )
        self.backend = "SHM" if backend == "DEFAULT" else backend
        tokens = self.max_tokens_in_buffer
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(
                f"cache_transceiver_config.max_tokens_in_buffer must be a positive integer, got {tokens!r}"
            )
        timeout = self.kv_transfer_timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            raise ValueError(
                f"cache_transceiver_config.kv_transfer_timeout_ms must be a positive integer, got {timeout!r}"
            )


REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")


@dataclass
class DisaggregatedParams:
    """Per-request fields of disaggregated serving (TensorRT-LLM's `DisaggregatedParams`).

    A `context_only` request prefills, returns its first token and keeps its KV blocks for a
    generation worker; the answer carries `ctx_request_id`, `opaque_state` (the claim's
    secret) and `ctx_info_endpoint` (where the blocks are served). A `generation_only`
    request carries those back with `first_gen_tokens`; the worker pulls the blocks and
    decodes from there. `kv_payload` is set by the generation worker once it pulled them."""

    request_type: str = "context_and_generation"
    first_gen_tokens: Optional[list[int]] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[str] = None
    ctx_info_endpoint: Optional[str] = None
    draft_tokens: Optional[list[int]] = None
    # The first token's logprobs as the context worker sampled it, when logprobs were asked
    # for: per first token, [token id, logprob, rank (None: the chosen token outside the top)].
    first_gen_log_probs: Optional[list[list[tuple[int, float, Optional[int]]]]] = None
    kv_payload: Any = None

    def __post_init__(self) -> None:
        if self.request_type not in REQUEST_TYPES:
            raise ValueError(
                f"disaggregated_params.request_type must be one of {', '.join(REQUEST_TYPES)}, "
                f"got {self.request_type!r}"
            )
        if self.draft_tokens:
            raise ValueError("disaggregated_params.draft_tokens is not supported")
        if self.request_type == "generation_only":
            missing = [
                name
                for name in ("first_gen_tokens", "ctx_request_id", "opaque_state", "ctx_info_endpoint")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"disaggregated_params: a generation_only request needs {', '.join(missing)}")
            if len(self.first_gen_tokens or ()) != 1:
                raise ValueError("disaggregated_params.first_gen_tokens must hold exactly one token id")

    @property
    def context_only(self) -> bool:
        return self.request_type == "context_only"

    @property
    def generation_only(self) -> bool:
        return self.request_type == "generation_only"
