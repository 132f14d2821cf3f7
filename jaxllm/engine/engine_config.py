"""Engine configuration: everything fixed when an engine is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxllm.llm_args import CacheTransceiverConfig, KvCacheConfig, MoeConfig, SchedulerConfig, check_known_fields
from jaxllm.sampling.guided import GUIDED_DECODING_BACKENDS
from jaxllm.speculative_config import SpeculativeConfig, parse_speculative_config
from sharding.mesh import ParallelConfig

# Sane ranges of the engine limits: (low, high). A limit outside them is a typo or a hostile
# config (the implied allocations are checked against memory by jaxllm.engine.memory_budget).
LIMIT_RANGES = {
    "max_batch_size": (1, 1 << 16),
    "max_num_tokens": (1, 1 << 20),
    "max_seq_len": (2, 1 << 24),
    "max_loras": (1, 1024),
    "max_lora_rank": (1, 4096),
    "min_token_bucket": (1, 1 << 20),
}
ATTENTION_BACKENDS = ("xla", "pallas", "triton", "mosaic")  # pallas: mosaic on Hopper, triton elsewhere
MOE_BACKENDS = ("xla", "pallas", "triton", "mosaic", "tokamax")
PLAN_CHANNELS = ("kv", "collective")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights drawn on the devices


@dataclass
class EngineConfig:
    """Limits and switches of one engine (names follow the TensorRT-LLM LLM API).

    `max_batch_size` fixes the sequence dimension of every compiled step and
    `max_num_tokens` the largest token bucket, so both bound compile count and memory.
    """

    model: str
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_seq_len: Optional[int] = None
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_chunked_prefill: bool = True
    attention_backend: Optional[str] = None  # None: pallas on GPU, xla elsewhere
    moe_backend: Optional[str] = None
    disable_overlap_scheduler: bool = False
    min_token_bucket: int = 16
    seed: int = 0
    tensor_parallel_size: int = 1  # devices the model is split over (heads, MLP columns, vocabulary)
    # Keep compiled steps on disk (JAX's persistent cache; see jaxllm.engine.compile_cache).
    compile_cache: bool = True
    # MoE layers: experts over E of the N devices, each expert's columns over T = N / E
    # (unset: E = 1, T = N, as TensorRT-LLM derives them; see sharding.mesh.ParallelConfig).
    moe_expert_parallel_size: Optional[int] = None
    moe_tensor_parallel_size: Optional[int] = None
    enable_attention_dp: bool = False  # not supported yet: attention is tensor-parallel over all N devices
    moe_config: MoeConfig = field(default_factory=MoeConfig)  # expert placement (EPLB), dispatch mode
    # Multi-host runs: how the leader sends each step's plan to the other processes
    # ("kv": the coordination service's key-value store; "collective": broadcast_one_to_all).
    multihost_plan_channel: str = "kv"
    # Runs of identical layers as one lax.scan over stacked weights (compile time independent
    # of depth); False: the per-layer loop (see ModelConfig.scan_layers).
    scan_layers: bool = True
    # Weights: "fp8" quantizes an unquantized checkpoint to FP8 with 128 x 128 block scales as it
    # loads (checkpoints that are FP8 already load as they are), "int8" / "int4" to weight-only
    # integers with one scale per 32 inputs (GGUF's Q8_0 / Q4_0 blocks); `fp8_activation_scheme`
    # "dynamic" (default, as an FP8 deployment runs) quantizes activations per token-group of
    # 128 before each FP8 matmul, "none" multiplies dequantized weights with float activations.
    quantization: Optional[str] = None
    # Where the weights come from: "auto" the checkpoint in `model`; "dummy" random values drawn
    # on the devices in the same layout and shardings (`jaxllm.models.random_params`), for
    # benchmarks of full-size models without their weights (`model` then needs config.json and
    # a tokenizer only). TensorRT-LLM's `load_format`.
    load_format: str = "auto"
    fp8_activation_scheme: str = "dynamic"
    # An integer-quantized checkpoint (GGUF, AWQ, GPTQ) loads with its weights dequantized to the
    # model's dtype (True) or kept quantized and dequantized inside each step (False); None: on
    # a CPU only, where XLA writes the dequantized weights out every step instead of fusing
    # them into the matmul (`jaxllm.models.quantized_loading.dequantizes_on_load`).
    dequantize_on_load: Optional[bool] = None
    # Compiling on demand (no warm-up): a step whose best-fitting token bucket is not compiled
    # runs padded in a compiled larger one while the best fit compiles on the compile threads
    # (jaxllm.engine.compile_ahead); False: each bucket compiles on the step that first needs it.
    # `compile_workers`: threads compiling at once (default one per CPU core, at most 8).
    compile_ahead: bool = True
    compile_workers: Optional[int] = None
    # LoRA adapters (jaxllm.lora): `max_loras` device slots of rank up to `max_lora_rank`.
    # Off, the compiled step is exactly the base model's.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # Device-side batched logits post-processors by name: jittable
    # fn(logits f32[S, V], request_ids int32[S], mask bool[S]) -> logits, selected per request
    # by SamplingParams.logits_post_processor_name (jaxllm.engine.logits_processing).
    logits_post_processors: Optional[dict[str, Callable[..., Any]]] = None
    # Warm-up also compiles every forward variant returning context logits (per token bucket and
    # extra-output size). Off: one of them (the largest first bucket's full variant) compiles at
    # warm-up and stands in while a step's own compiles in the background.
    warmup_logits_outputs: bool = False
    # A step whose rows all decode greedily with no logprobs, logits outputs or processing takes
    # each row's argmax inside the LM head, chunk by chunk over the vocabulary, and writes no
    # float32 logits [rows, vocab] (jaxllm.models.lm_head_argmax): the same tokens. One device,
    # no attention DP or MTP/EAGLE hidden outputs; elsewhere, or False, the full-logits forward.
    # None: on a GPU only (XLA:CPU runs the chunked head slower than the whole matmul).
    fused_lm_head_argmax: Optional[bool] = None
    # Structured output (SamplingParams.guided_decoding): the library enforcing grammars.
    guided_decoding_backend: str = "llguidance"
    # Small decode buckets (TensorRT-LLM's cuda_graph_config.batch_sizes, vLLM's
    # cudagraph_capture_sizes): a decode-only step of n rows runs in a forward of the smallest
    # of these row counts holding n (k tokens and k rows) instead of a token bucket of
    # `max_batch_size` rows, so one user decoding alone pays for one row. None: powers of two
    # from 1 below the decode token bucket; []: off. One compiled forward each.
    decode_batch_sizes: Optional[list[int]] = None
    # Stall-free steps: while fewer than half this many streams decode, a step takes at most this
    # many tokens, a new prompt joining them in chunks that fit, so it delays those streams by a
    # small bucket's cost, not the largest's (more streams, or none: the whole max_num_tokens). It
    # trades the new prompt's TTFT for the streams' inter-token latency: on a CPU, SmolLM2's 16 / 32
    # / 64-token steps cost 2.6 / 3.7 / 5.2 one-row decode steps. None or 0: off. Needs
    # enable_chunked_prefill. Below min_token_bucket it lowers that to its own power of two (a
    # compiled forward more per bucket).
    max_num_tokens_with_generation: Optional[int] = None
    # Speculative decoding (jaxllm.speculative_config: NGramDecodingConfig, ...; a mapping with
    # `decoding_type` or vLLM's `method` is converted). None: off.
    speculative_config: Optional[SpeculativeConfig] = None
    # Disaggregated serving (jaxllm.engine.kv_transceiver): context-only requests keep their
    # KV blocks for a generation worker, generation-only requests take them over. None: off.
    cache_transceiver_config: Optional[CacheTransceiverConfig] = None

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if isinstance(self.cache_transceiver_config, dict):
            check_known_fields(CacheTransceiverConfig, self.cache_transceiver_config)
            self.cache_transceiver_config = CacheTransceiverConfig(**self.cache_transceiver_config)
        if isinstance(self.kv_cache_config, dict):
            self.kv_cache_config = KvCacheConfig(**self.kv_cache_config)
        if isinstance(self.scheduler_config, dict):
            self.scheduler_config = SchedulerConfig(**self.scheduler_config)
        if isinstance(self.moe_config, dict):
            check_known_fields(MoeConfig, self.moe_config)
            self.moe_config = MoeConfig(**self.moe_config)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in (None, "fp8", "int8", "int4"):
            raise ValueError(f"quantization must be 'fp8', 'int8', 'int4' or None, got {self.quantization!r}")
        if not (self.dequantize_on_load is None or isinstance(self.dequantize_on_load, bool)):
            raise ValueError(
                f"dequantize_on_load must be True, False or None (auto: on a CPU), got {self.dequantize_on_load!r}"
            )
        if self.fp8_activation_scheme not in ("dynamic", "none"):
            raise ValueError(f"fp8_activation_scheme must be 'dynamic' or 'none', got {self.fp8_activation_scheme!r}")
        for name, (low, high) in LIMIT_RANGES.items():
            value = getattr(self, name)
            if value is None and name == "max_seq_len":
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
            setattr(self, name, int(value))
        if self.decode_batch_sizes is not None:
            sizes = self.decode_batch_sizes
            if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
                raise ValueError(f"decode_batch_sizes must be a list of integers, got {sizes!r}")
            sizes = list(sizes)
            bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
            if bad:
                raise ValueError(f"decode_batch_sizes must be positive integers, got {bad[0]!r}")
            if any(s > self.max_batch_size for s in sizes):
                raise ValueError(
                    f"decode_batch_sizes must be at most max_batch_size ({self.max_batch_size}), got {max(sizes)}"
                )
            self.decode_batch_sizes = sorted(set(sizes))
        tokens_with_generation = self.max_num_tokens_with_generation
        if tokens_with_generation is not None and (
            isinstance(tokens_with_generation, bool)
            or not isinstance(tokens_with_generation, int)
            or tokens_with_generation == 1
            or not 0 <= tokens_with_generation <= LIMIT_RANGES["max_num_tokens"][1]
        ):
            raise ValueError(
                f"max_num_tokens_with_generation must be 0 (off) or an integer >= 2, got {tokens_with_generation!r}"
            )
        stall_free = self.tokens_with_generation()
        if stall_free is not None and stall_free < self.min_token_bucket:
            # Its steps need a bucket of their own size: padded to min_token_bucket they would
            # cost as much as that bucket's and stall the streams as long.
            self.min_token_bucket = 1 << (stall_free - 1).bit_length()
        if self.compile_workers is not None and (
            not isinstance(self.compile_workers, int)
            or isinstance(self.compile_workers, bool)
            or self.compile_workers < 1
        ):
            raise ValueError(f"compile_workers must be a positive integer, got {self.compile_workers!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if (
            not isinstance(self.tensor_parallel_size, int)
            or isinstance(self.tensor_parallel_size, bool)
            or self.tensor_parallel_size < 1
        ):
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        self.parallel_config()  # checks E * T == N
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.multihost_plan_channel not in PLAN_CHANNELS:
            raise ValueError(
                f"multihost_plan_channel must be one of {PLAN_CHANNELS}, got {self.multihost_plan_channel!r}"
            )
        if self.guided_decoding_backend not in GUIDED_DECODING_BACKENDS:
            raise ValueError(
                f"guided_decoding_backend must be one of {GUIDED_DECODING_BACKENDS}, "
                f"got {self.guided_decoding_backend!r}"
            )
        if self.moe_backend not in (None, *MOE_BACKENDS):
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {self.moe_backend!r}")

    def tokens_with_generation(self) -> Optional[int]:
        """The stall-free step size (`max_num_tokens_with_generation`); None: off."""
        value = self.max_num_tokens_with_generation
        if not value or not self.enable_chunked_prefill or value >= self.max_num_tokens:
            return None
        return value

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            moe_expert_parallel_size=self.moe_expert_parallel_size,
            moe_tensor_parallel_size=self.moe_tensor_parallel_size,
            enable_attention_dp=self.enable_attention_dp,
        )
