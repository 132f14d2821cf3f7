"""Section 5: greedy tokens of a seeded tiny float32 model on this device against the tokens
recorded on CPU (`gpu_numerics_tokens.json`, package data next to this module).

The model is a 2-layer Qwen3-MoE of hidden size 64 with `weights.random_checkpoint`
weights (seed in the fixture); prompts are fixed token ids; each backend (`xla`, and
`pallas`: the Triton kernels, in interpret mode on CPU) decodes greedily with EOS ignored.
The fixture holds the tokens each backend gave on CPU; `tests/test_bench_gpu.py`
regenerates them on CPU and checks they still equal the fixture, so it cannot go stale.
Matmuls run at "highest" precision (no TF32) while the section runs, so a GPU computes
the same float32 products the CPU did; a mismatch fails the section (and names the
prompt and the first differing position).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import jax

from jaxllm.bench.gpu.random_models import write_model_dir
from jaxllm.bench.gpu.report import ChecksFailed, SectionContext

FIXTURE = Path(__file__).with_name("gpu_numerics_tokens.json")
BACKENDS = ("xla", "pallas")
SEED = 20261126
MAX_TOKENS = 8
PROMPTS = ((5, 17, 300, 42, 7, 99, 512, 3), (1000, 2, 64), (11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121, 132, 143))
HF_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def greedy_tokens(model_dir: Path, backend: str) -> list[list[int]]:
    """Each prompt's greedy continuation of MAX_TOKENS tokens, float32, on `backend`."""
    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # global: the compile threads see it too
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=16,
            max_seq_len=32,
            attention_backend=backend,
            moe_backend=backend,
            compile_cache=False,
            seed=0,
            kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4 * 32),
        )
    )
    try:
        ids = {}
        for i, prompt in enumerate(PROMPTS):
            request = engine.add_request(
                list(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
            )
            ids[request.request_id] = i
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        while engine.has_unfinished_requests():
            for update in engine.step():
                i = ids.get(update.request.request_id)
                if i is not None and update.new_token_ids:
                    tokens[i].extend(int(t) for t in update.new_token_ids)
        return tokens
    finally:
        engine.close()
        jax.config.update("jax_default_matmul_precision", previous)


def generate_fixture() -> dict[str, Any]:
    """What the fixture holds, computed here (run on CPU to regenerate it)."""
    with tempfile.TemporaryDirectory(prefix="jaxllm-numerics-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", HF_CONFIG, SEED)
        tokens = {backend: greedy_tokens(model_dir, backend) for backend in BACKENDS}
    return {
        "platform": jax.default_backend(),
        "seed": SEED,
        "max_tokens": MAX_TOKENS,
        "prompts": [list(p) for p in PROMPTS],
        "hf_config": HF_CONFIG,
        "tokens": tokens,
    }


def load_fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(ctx: SectionContext) -> None:
    fixture = load_fixture()
    if (
        fixture["hf_config"] != HF_CONFIG
        or fixture["prompts"] != [list(p) for p in PROMPTS]
        or fixture["seed"] != SEED
        or fixture["max_tokens"] != MAX_TOKENS
    ):
        raise ChecksFailed(f"{FIXTURE.name} was recorded for another model or prompts; regenerate it on CPU")
    table = ctx.table(
        "Greedy tokens (float32) against the CPU recording",
        ("backend", "prompt", "tokens_here", "tokens_cpu", "match", "first_difference"),
    )
    failures = []
    with tempfile.TemporaryDirectory(prefix="jaxllm-numerics-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", HF_CONFIG, SEED)
        for backend in BACKENDS:
            ctx.check_time(f"the {backend} backend")
            here = greedy_tokens(model_dir, backend)
            ctx.data.setdefault("tokens", {})[backend] = here
            for i, (got, want) in enumerate(zip(here, fixture["tokens"][backend])):
                match = got == want
                diff = None if match else _first_difference(got, want)
                table.add(
                    backend=backend,
                    prompt=i,
                    tokens_here=" ".join(map(str, got)),
                    tokens_cpu=" ".join(map(str, want)),
                    match=match,
                    first_difference=diff,
                )
                if not match:
                    failures.append(f"{backend} prompt {i} differs from position {diff}")
    ctx.data["fixture_platform"] = fixture["platform"]
    ctx.data["failures"] = failures
    if failures:
        raise ChecksFailed("greedy tokens differ from the CPU recording: " + "; ".join(failures))


def write_fixture() -> Path:
    """Regenerate the fixture (on CPU): PYTHONPATH=. python -c
    "from jaxllm.bench.gpu.numerics import write_fixture; write_fixture()"."""
    FIXTURE.write_text(json.dumps(generate_fixture(), indent=1) + "\n", encoding="utf-8")
    return FIXTURE
