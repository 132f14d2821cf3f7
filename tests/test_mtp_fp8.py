"""DeepSeek-V3's FP8 checkpoints with a multi-token-prediction layer: its linear projections
load block-scaled FP8 like the decoder's and the layer matches the torch composition over the
weights the checkpoint means."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.mtp import init_mtp_kv_cache, mtp_forward  # noqa: E402
from jaxllm.models.quantization import QuantizedWeight  # noqa: E402
from tests.fp8_checkpoints import load_meant_weights, write_fp8_checkpoint  # noqa: E402
from tests.model_helpers import SeqChunk, random_block_table, rel_err  # noqa: E402
from tests.mtp_helpers import (  # noqa: E402
    MAX_BLOCKS,
    NUM_BLOCKS,
    TOKENS_PER_BLOCK,
    hf_with_mtp,
    jitted,
    saved_with,
    step_batch,
    target_hidden,
)

TOL = 1e-4


def test_fp8_checkpoint_loads_the_mtp_layer_quantized_and_matches_its_weights(tmp_path):
    """DeepSeek's FP8 layout (block-scaled linear projections, the MTP layer's too; eh_proj and
    norms in float): the MTP layer loads quantized and, with float activations, gives the torch
    composition's logits over the dequantized weights."""

    model, mtp = hf_with_mtp()
    with saved_with(model, mtp):
        load_meant_weights(model, write_fp8_checkpoint(tmp_path, model))
    config = load_model_config(tmp_path)
    config = replace(config, quantization=replace(config.quantization, activation_scheme="none"))
    params = load_params(tmp_path, config, load_mtp=True)
    layer = params["mtp"][0]
    assert isinstance(layer["attn"]["q_b"], QuantizedWeight) and isinstance(layer["moe"]["w_gate"], QuantizedWeight)
    assert not isinstance(layer["eh_proj"], QuantizedWeight) and layer["eh_proj"].dtype == jnp.float32
    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(0, config.vocab_size, 10)]
    _, pre_norm = target_hidden(model, tokens[:-1])
    with torch.no_grad():
        _, ref_logits = mtp.predict(model, torch.tensor([tokens[1:]]), pre_norm)
    batch = step_batch([SeqChunk(tokens[1:], 0, random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS))])
    hidden = jnp.zeros((32, config.hidden_size)).at[:9].set(jnp.asarray(pre_norm[0].numpy()))
    cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    logits, _, _ = jitted(mtp_forward, "layer")(params, cache, batch, hidden, config=config)
    assert rel_err(np.asarray(logits[0]), ref_logits[0, -1].double().numpy()) < TOL
