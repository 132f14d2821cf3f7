"""What the engine section runs (models, backends, concurrencies, engine limits) and a rough
estimate of how long each part takes on an H200, printed before anything runs.

The models are full size with random bf16 weights drawn on the device
(`EngineConfig.load_format="dummy"`): Llama-3-8B (32 layers, 16.1 GB) and Qwen3-30B-A3B
(48 layers, 61.1 GB). DeepSeek-V3 (MLA) is selectable, cut to 2 layers (one dense, one MoE
with 32 of its 256 routed experts): at full size it needs 8 GPUs. Each runs 1024-token
prompts and 128 output tokens at concurrency 1/16/64/256 (one request per slot).

Engine limits chosen so warm-up compiles few programs: token buckets 256 / 512 / 1024 /
2048 (`min_token_bucket` 256, `max_num_tokens` 2048, the engine's default), decode buckets
of 1 / 16 / 64 rows and the 256-token bucket for 256 rows: 7 forwards per build, whatever
the depth (layers run as one `lax.scan`).

The estimate (`estimate_s`) is a roofline with guessed efficiencies, compile times and host
costs (constants below, from the H200 run of docs/gpu.md where there is one); it is there to
choose the commands, not to judge results. The section itself keeps to its deadline case by
case (`engine_run`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxllm.bench.gpu.step_roofline import StepRoofline, step_roofline
from jaxllm.models.model_config import ModelConfig

# Guesses for the estimate (H200, jax 0.11): seconds to compile one full-size forward on one
# compile thread, prefill and decode efficiency against the ceilings, host ms per step
# (2.9 ms at 1 sequence, 57 ms at 256 in the 4-layer run: about 3 + 0.21 per sequence), the
# XLA attention loop's seconds per iteration (tiled_xla: one (tile, KV block) batch per
# iteration), the XLA MoE FFN's share of the matmul rate.
COMPILE_S = 30.0
COMPILE_THREADS = 8
PREFILL_EFFICIENCY = 0.6
DECODE_EFFICIENCY = 0.75
HOST_MS = (3.0, 0.21)
XLA_ATTENTION_ITERATION_S = 30e-6
XLA_MOE_EFFICIENCY = 0.2
PROCESS_START_S = 20.0  # import, device start, the measured ceilings


@dataclass(frozen=True)
class EngineModel:
    key: str  # what --engine-models names
    name: str
    hf_config: dict[str, Any]

    def config(self) -> ModelConfig:
        return ModelConfig.from_hf_config(self.hf_config)


@dataclass(frozen=True)
class EnginePlan:
    models: tuple[EngineModel, ...]
    backends: tuple[str, ...]
    concurrencies: tuple[int, ...]
    input_len: int
    output_len: int
    max_num_tokens: int
    min_token_bucket: int
    decode_batch_sizes: tuple[int, ...]
    tokens_per_block: int

    @property
    def max_batch_size(self) -> int:
        return max(self.concurrencies)

    @property
    def max_seq_len(self) -> int:
        tpb = self.tokens_per_block
        return -(-(self.input_len + self.output_len) // tpb) * tpb

    def num_forwards(self) -> int:
        buckets, bucket = 0, self.min_token_bucket
        while bucket < self.max_num_tokens:
            buckets, bucket = buckets + 1, bucket * 2
        return buckets + 1 + len(self.decode_batch_sizes)


_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA_3_8B = EngineModel(
    "llama-3-8b",
    "Llama-3-8B (32 layers)",
    {
        **_ROPE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "attention_bias": False,
    },
)
QWEN3_30B_A3B = EngineModel(
    "qwen3-30b-a3b",
    "Qwen3-30B-A3B (48 layers)",
    {
        **_ROPE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
    },
)
DEEPSEEK_V3 = EngineModel(
    "deepseek-v3",
    "DeepSeek-V3 (cut to 2 MLA layers: 1 dense + 1 MoE, 32 of 256 experts)",
    {
        **_ROPE,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
)
TINY_MOE = EngineModel(
    "tiny-moe",
    "tiny Qwen3-MoE (1 layer)",
    {
        **_ROPE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 512,
        "attention_bias": False,
    },
)
MODELS = {m.key: m for m in (LLAMA_3_8B, QWEN3_30B_A3B, DEEPSEEK_V3)}
DEFAULT_MODELS = ("llama-3-8b", "qwen3-30b-a3b")
BACKENDS = ("pallas", "xla")  # pallas: what `auto` picks on a GPU (Mosaic GPU on Hopper, else Triton)


def plan(dry_run: bool, models: tuple[str, ...] = (), backends: tuple[str, ...] = ()) -> EnginePlan:
    """The dry run: one tiny MoE model, both backends (Pallas in interpret mode), tiny shapes."""
    chosen_backends = tuple(b for b in BACKENDS if b in backends) if backends else BACKENDS
    if dry_run:
        return EnginePlan((TINY_MOE,), chosen_backends, (1, 4), 8, 4, 16, 16, (1,), 16)
    chosen = tuple(MODELS[k] for k in MODELS if k in (models or DEFAULT_MODELS))
    return EnginePlan(chosen, chosen_backends, (1, 16, 64, 256), 1024, 128, 2048, 256, (1, 16, 64), 32)


def _xla_attention_iterations(config: ModelConfig, p: EnginePlan, sequences: int, kv_len: int, q_len: int) -> float:
    """Loop iterations of the tiled XLA attention over all layers for `sequences` sequences of
    `q_len` new tokens attending `kv_len` cached ones (pallas_kernels' tiled_xla work list)."""
    from pallas_kernels.ragged_paged_attention.tiled_xla import default_block_q, default_items_per_step

    if config.is_mla:
        return 0.0  # the latent path has its own loop; not modelled
    items = default_items_per_step(config.num_kv_heads, p.tokens_per_block, config.head_dim)
    block_q = default_block_q(min(p.max_num_tokens, sequences * q_len), p.max_batch_size)
    tiles = math.ceil(q_len / block_q)
    blocks_seen = (kv_len - q_len / 2) / p.tokens_per_block if q_len > 1 else kv_len / p.tokens_per_block
    return config.num_layers * sequences * tiles * max(1.0, blocks_seen) / items


@dataclass(frozen=True)
class Estimate:
    build_s: float
    run_s: dict[int, float]

    @property
    def total_s(self) -> float:
        return self.build_s + sum(self.run_s.values())


def estimate_s(
    model: EngineModel, backend: str, p: EnginePlan, copy_bytes_per_s: float, matmul_flops_per_s: float
) -> Estimate:
    """Rough seconds of one build (weights drawn, warm-up) and of each concurrency's run."""
    config = model.config()
    roof: StepRoofline = step_roofline(config, "bfloat16")
    weights_s = 3.0 * roof.weight_bytes / copy_bytes_per_s + 5.0  # draw + compile the draws
    build_s = weights_s + COMPILE_S * math.ceil(p.num_forwards() / COMPILE_THREADS) * 1.5  # threads contend
    runs = {}
    for c in p.concurrencies:
        prompt_tokens = c * p.input_len
        prefill_flops = roof.decode_flops(prompt_tokens, c * p.input_len * p.input_len / 2)
        prefill_steps = math.ceil(prompt_tokens / p.max_num_tokens)
        prefill_s = prefill_flops / (PREFILL_EFFICIENCY * matmul_flops_per_s)
        kv = c * (p.input_len + p.output_len / 2)
        decode_step_s = max(
            roof.decode_bytes(c, kv) / copy_bytes_per_s / DECODE_EFFICIENCY,
            roof.decode_flops(c, kv) / matmul_flops_per_s / DECODE_EFFICIENCY,
        )
        if backend == "xla":
            prefill_s += XLA_ATTENTION_ITERATION_S * _xla_attention_iterations(config, p, c, p.input_len, p.input_len)
            decode_step_s += XLA_ATTENTION_ITERATION_S * _xla_attention_iterations(config, p, c, int(kv / c), 1)
            if roof.moe_layers:
                moe_flops = 6.0 * roof.moe_layers * roof.top_k * (roof.expert_params // 3)
                prefill_s += prompt_tokens * moe_flops / (XLA_MOE_EFFICIENCY * matmul_flops_per_s)
        host_s = (HOST_MS[0] + HOST_MS[1] * c) / 1e3
        runs[c] = max(prefill_s, prefill_steps * host_s) + p.output_len * max(decode_step_s, host_s)
    return Estimate(build_s, runs)


def command_estimate_s(p: EnginePlan, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
    """The whole engine command: process start, then every model and backend of the plan."""
    total = PROCESS_START_S
    for model in p.models:
        for backend in p.backends:
            total += estimate_s(model, backend, p, copy_bytes_per_s, matmul_flops_per_s).total_s
    return total
