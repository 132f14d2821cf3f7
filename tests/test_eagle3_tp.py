"""An EAGLE-3 head under tensor parallelism (2 fake CPU devices, in a subprocess): fed the
target's low/mid/high hidden states computed on the same mesh, it drafts the same tokens with
the same logits as on one device."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multidevice import run_on_cpu_devices

NUM_DRAFTS = 2


def _drafts_eagle3(root: Path, mesh) -> tuple[list, np.ndarray]:
    import jax.numpy as jnp

    from jaxllm.models import init_kv_cache, load_model_config, load_params
    from jaxllm.models.eagle3 import aux_layers_for, eagle3_draft, init_eagle3_kv_cache
    from jaxllm.models.eagle3_weights import load_eagle3_config, load_eagle3_params
    from jaxllm.models.hidden_states import forward_with_hidden_states
    from tests.mtp_helpers import NUM_BLOCKS, TOKENS_PER_BLOCK, draft_inputs, jitted

    config = load_model_config(root / "target")
    params = load_params(root / "target", config, mesh=mesh)
    head_config = load_eagle3_config(root / "head")
    head = load_eagle3_params(root / "head", head_config, mesh=mesh)
    target, draft, n = draft_inputs(config.vocab_size, 6)
    cache = init_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32", mesh)
    rows = jnp.arange(target.token_ids.shape[0], dtype=jnp.int32)
    layers = aux_layers_for(head_config, config.num_layers)
    aux = jitted(forward_with_hidden_states, "aux_layers", "mesh")(
        params, cache, target, rows, config=config, aux_layers=layers, mesh=mesh
    ).aux_hidden
    features = aux.reshape(aux.shape[0], -1)
    head_cache = init_eagle3_kv_cache(head_config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32", mesh)
    drafts, _, logits = jitted(eagle3_draft, "num_draft_tokens", "return_logits", "mesh")(
        head, params["embed"], head_cache, draft, features, num_draft_tokens=NUM_DRAFTS, config=head_config,
        mesh=mesh, return_logits=True,
    )  # fmt: skip
    return np.asarray(drafts)[0].tolist(), np.asarray(logits)[0]


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    import jax

    from sharding.mesh import ParallelConfig, make_mesh

    assert len(jax.devices()) == 2
    one_tokens, one_logits = _drafts_eagle3(root / "llama", None)
    tp_tokens, tp_logits = _drafts_eagle3(root / "llama", make_mesh(ParallelConfig(tensor_parallel_size=2)))
    err = float(np.abs(tp_logits - one_logits).max() / np.abs(one_logits).max())
    print(json.dumps(dict(one=one_tokens, tp=tp_tokens, err=err)), flush=True)


def test_eagle3_drafts_under_tensor_parallelism_match_one_device(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from tests.deepseek_helpers import randomize
    from tests.test_eagle3 import HEAD, TARGET, TorchEagle3

    gen = torch.Generator().manual_seed(1)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TARGET)).eval()
    randomize(target, gen)
    target.save_pretrained(tmp_path / "llama" / "target")
    hot = np.sort(np.random.default_rng(1).choice(HEAD["vocab_size"], HEAD["draft_vocab_size"], replace=False))
    head = TorchEagle3(transformers.LlamaConfig(**HEAD), HEAD["draft_vocab_size"], hot)
    randomize(head, gen)
    (tmp_path / "llama" / "head").mkdir()
    (tmp_path / "llama" / "head" / "config.json").write_text(json.dumps(HEAD))
    tensors = {k: v.contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(tmp_path / "llama" / "head" / "model.safetensors"))
    (result,) = run_on_cpu_devices("test_eagle3_tp", "check_all", tmp_path, num_devices=2)
    assert result["tp"] == result["one"] and len(result["one"]) == NUM_DRAFTS, result
    assert result["err"] < 1e-4, result
