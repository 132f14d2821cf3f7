"""Tensor parallelism on 8 fake CPU devices: TP 2/4/8 reproduce TP 1.

The device count of XLA:CPU is fixed when jax starts, and the rest of the suite runs in
one process with one device, so the checks run in a subprocess started with
`--xla_force_host_platform_device_count=8`; it prints one JSON line per case.

Each case loads a tiny random checkpoint (written from the weight declaration) sharded
over a TP mesh and runs the same scripted steps as at TP 1: a chunked prefill, a second
sequence that reuses the first one's cached prefix block while the first finishes its
prompt (in-flight batching: prefill and decode in one step), then greedy decoding of
both. Logits must match the xla backend at TP 1 within 1e-5 (float32) and greedy tokens
must be identical.
Correctness at TP 1 against Hugging Face is covered by test_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multidevice import run_on_cpu_devices

# name: (architecture, HF config overrides). Hq = 8 allows TP 8; Hkv = 2 gives KV heads < TP at TP 4 and 8.
ARCHS = {
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(num_key_value_heads=4, head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        dict(num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    ),
}
# Per architecture: (backend, TP sizes), each compared with xla at TP 1 (which must come
# first). Pallas runs in interpret mode (slow): TP 8 only, every rank on its own heads.
PLANS = {
    "llama": [("xla", (1, 4, 8)), ("pallas", (8,))],  # 2 KV heads: replicated at TP 4 and 8
    "qwen3": [("xla", (1, 2, 8))],
    "qwen3_moe": [("xla", (1, 2, 4, 8)), ("pallas", (8,))],
    "mixtral": [("xla", (1, 8))],
}
# Where the TP-1 mesh path is also checked against the plain single-device model.
PLAIN_CHECK = ("llama", "qwen3_moe")


def hf_config(arch: str, archs: dict | None = None) -> dict:
    """The HF config of a tiny `arch` checkpoint; `archs` replaces this module's ARCHS table."""
    architecture, overrides = (archs or ARCHS)[arch]
    base = dict(
        architectures=[architecture],
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    base.update(overrides)
    return base


def write_checkpoint(arch: str, directory: Path, seed: int = 0, archs: dict | None = None, **overrides) -> Path:
    from safetensors.numpy import save_file

    from jaxllm.models import ModelConfig
    from jaxllm.models.random_checkpoint import random_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    hf = dict(hf_config(arch, archs), **overrides)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(random_checkpoint(ModelConfig.from_hf_config(hf), seed), str(directory / "model.safetensors"))
    return directory


def run_script(config, params, mesh, backend: str) -> tuple[list, list]:
    """Scripted steps over a paged cache; returns (per-step logits, greedy tokens)."""
    import functools

    import jax
    import numpy as np

    from jaxllm.models import forward, init_kv_cache
    from jaxllm.models.backends import resolve_backends
    from tests.model_helpers import SeqChunk, build_step_batch

    _, _, attention_fn, moe_fn = resolve_backends(backend, backend)
    tpb, num_blocks = 4, 16
    step = jax.jit(
        functools.partial(forward, config=config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh),
        donate_argnums=(1,),
    )
    cache = init_kv_cache(config, num_blocks, tpb, config.dtype, mesh=mesh)
    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(0, config.vocab_size, 11)]
    b = a[:4] + [int(t) for t in rng.integers(0, config.vocab_size, 3)]  # shares a's first block
    table_a, table_b = [3, 9, 0, 12, 5], [3, 7, 14, 1, 10]

    def run(chunks):
        nonlocal cache
        batch = build_step_batch(
            chunks, tokens_per_block=tpb, num_blocks=num_blocks, token_bucket=16, max_seqs=2, max_blocks_per_seq=5
        )
        logits, cache = step(params, cache, batch)
        return np.asarray(logits)[: len(chunks)]

    all_logits, tokens = [], []
    all_logits.append(run([SeqChunk(a[:6], 0, table_a)]))  # chunked prefill, first chunk
    # a's second chunk and b's prompt after its cached prefix block
    logits = run([SeqChunk(a[6:], 6, table_a), SeqChunk(b[4:], 4, table_b)])
    all_logits.append(logits)
    seq_a, seq_b = list(a), list(b)
    for _ in range(5):
        nxt = [int(x) for x in logits.argmax(-1)]
        tokens.append(nxt)
        seq_a.append(nxt[0])
        seq_b.append(nxt[1])
        logits = run([SeqChunk([nxt[0]], len(seq_a) - 1, table_a), SeqChunk([nxt[1]], len(seq_b) - 1, table_b)])
        all_logits.append(logits)
    return all_logits, tokens


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax
    import numpy as np

    from jaxllm.models import load_model_config, load_params
    from sharding import ParallelConfig, make_mesh

    assert len(jax.devices()) == 8, jax.devices()
    for arch in ARCHS:
        directory = write_checkpoint(arch, root / arch)
        config = load_model_config(directory)
        base_logits = base_tokens = None
        for backend, sizes in PLANS[arch]:
            for tp in sizes:
                mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp))
                params = load_params(directory, config, mesh=mesh)
                q_spec = params["layer_stacks"][0]["attn"]["q"].sharding.spec  # [layers, H, Hq, D]
                logits, tokens = run_script(config, params, mesh, backend)
                if base_logits is None:
                    base_logits, base_tokens = logits, tokens
                    if arch in PLAIN_CHECK:  # the TP-1 mesh path is the plain single-device model
                        plain, _ = run_script(config, load_params(directory, config), None, backend)
                        assert all(np.array_equal(x, y) for x, y in zip(plain, logits)), arch
                err = max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(logits, base_logits))
                print(
                    json.dumps(
                        dict(
                            arch=arch,
                            backend=backend,
                            tp=tp,
                            err=err,
                            same_tokens=tokens == base_tokens,
                            tokens=tokens,
                            q_spec=str(q_spec),
                            std=float(np.std(base_logits[0])),
                        )
                    ),
                    flush=True,
                )


def test_tensor_parallel_matches_single_device(tmp_path):
    results = run_on_cpu_devices("test_sharding_tp", "check_all", tmp_path)
    assert len(results) == sum(len(sizes) for plans in PLANS.values() for _, sizes in plans)
    for r in results:
        case = f"{r['arch']} {r['backend']} TP{r['tp']}"
        assert r["std"] > 0.5, f"{case}: near-uniform logits make the comparison meaningless"
        assert r["err"] < 1e-5, f"{case}: logits differ from TP 1 by {r['err']:.2e}"
        assert r["same_tokens"], f"{case}: greedy tokens differ from TP 1"
        if r["tp"] > 1:
            assert "tensor" in r["q_spec"], f"{case}: q is not split over the tensor axis ({r['q_spec']})"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
