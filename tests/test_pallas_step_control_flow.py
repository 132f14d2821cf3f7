"""The model forward with the Pallas kernels, as a GPU compiles it, loops and branches on no
device value outside the kernels.

The CPU guard (`tests/test_step_control_flow.py`) sees the programs the engine builds here,
on the XLA backends. The GPU default is the Pallas backends; their forwards are lowered for
CUDA on this CPU (Mosaic GPU and Triton kernels become `custom_call`s, their own loops
inside) and every `while` of the StableHLO must be a counted loop (the layer scan, the
searches over fixed-size tables), with no `if` or `case`. Dense, MoE and DeepSeek-V3's MLA
(a decode-bucket shape, which runs the absorbed form, and a mixed one, the expanded form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxllm.models import forward, init_kv_cache, materialize_preset
from jaxllm.models.attention import mosaic_attention, pallas_attention
from jaxllm.models.backends import mosaic_or_triton_moe
from jaxllm.models.loader import load_params
from jaxllm.models.model_config import load_model_config
from tests.model_helpers import SeqChunk, build_step_batch
from tests.step_programs import uncounted_stablehlo_loops

KERNELS = {"mosaic": mosaic_attention, "triton": pallas_attention}


def _lowered(directory, kernel: str, chunks: list[SeqChunk], max_seqs: int) -> str:
    config = load_model_config(directory, dtype="bfloat16")
    params = load_params(directory, config)
    cache = init_kv_cache(config, 32, 8, jnp.bfloat16)
    tokens = sum(len(c.tokens) for c in chunks)
    bucket = 16 if tokens > max_seqs else max_seqs
    batch = build_step_batch(
        chunks, tokens_per_block=8, num_blocks=32, token_bucket=bucket, max_seqs=max_seqs, max_blocks_per_seq=4
    )
    fn = functools.partial(
        forward,
        config=config,
        attention_fn=KERNELS[kernel](interpret=False),
        moe_fn=mosaic_or_triton_moe(interpret=False),
        mesh=None,
    )
    return jax.jit(fn).trace(params, cache, batch).lower(lowering_platforms=("cuda",)).as_text()


MIXED = [SeqChunk([5, 6, 7, 8, 9], 0, [1, 2]), SeqChunk([9], 4, [3])]
DECODE = [SeqChunk([5], 3, [1]), SeqChunk([9], 4, [3]), SeqChunk([11], 9, [4, 5])]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.deepseek_helpers import TINY_DEEPSEEK_V3, randomize

    directory = tmp_path_factory.mktemp("deepseek_cuda")
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3)).eval()
    randomize(model, torch.Generator().manual_seed(0))
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_pallas_forward_has_only_counted_loops(preset, kernel):
    text = _lowered(materialize_preset(preset), kernel, MIXED, max_seqs=4)
    assert "custom_call @" in text  # the kernels are there, as custom calls
    loops, uncounted, branches = uncounted_stablehlo_loops(text)
    assert loops >= 1 and uncounted == 0 and branches == 0, (loops, uncounted, branches)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("chunks", [DECODE, MIXED], ids=["decode", "mixed"])
def test_pallas_mla_forward_has_only_counted_loops(deepseek, kernel, chunks):
    text = _lowered(deepseek, kernel, chunks, max_seqs=4)
    assert "custom_call @" in text
    loops, uncounted, branches = uncounted_stablehlo_loops(text)
    assert uncounted == 0 and branches == 0, (loops, uncounted, branches)


def test_the_stablehlo_scan_sees_a_device_valued_loop_and_a_branch():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)

    def lowered(f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    dynamic = lowered(lambda n, x: jax.lax.fori_loop(0, n, lambda i, y: y * 1.5 + i, x), n, x)
    counted = lowered(lambda x: jax.lax.fori_loop(0, 7, lambda i, y: y * 1.5 + i, x), x)
    scanned = lowered(lambda x: jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=5)[0], x)
    branch = lowered(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), x)
    assert uncounted_stablehlo_loops(dynamic)[:2] == (1, 1)
    assert uncounted_stablehlo_loops(counted)[1] == 0 and uncounted_stablehlo_loops(scanned)[:2] == (1, 0)
    assert uncounted_stablehlo_loops(branch)[2] == 1
