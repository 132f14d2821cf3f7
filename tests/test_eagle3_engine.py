"""EAGLE-3 speculative decoding in the engine (`EagleDecodingConfig`), on a tiny random Llama target
and a random head in the published layout.

Greedy output must be token-for-token the engine's without speculation under in-flight batching
with chunked prefill and requests joining; nothing compiles after warm-up; every block goes back.
The first draft the engine proposes at each step (which needs the head's page pool written at
every kept position across steps and chunks, and the target's low/mid/high features) must be the
one of a torch composition of transformers' Llama parts run from scratch over the sequence.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from jaxllm.models import materialize_preset  # noqa: E402
from jaxllm.sampling import SamplingParams  # noqa: E402
from jaxllm.speculative_config import EagleDecodingConfig, parse_speculative_config  # noqa: E402
from tests.spec_helpers import recorded_drafts  # noqa: E402
from tests.test_eagle3 import HEAD, TARGET, TorchEagle3, _randomize  # noqa: E402

from conftest import tiny_engine  # noqa: E402

LIMITS = dict(max_batch_size=4, max_num_tokens=16, compile_ahead=False, decode_batch_sizes=[], max_kv_tokens=1024)
LAYERS = (2, 4, 5)  # default_aux_layers(8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_engine")
    gen = torch.Generator().manual_seed(0)
    target_config = transformers.LlamaConfig(**TARGET)
    target_config._attn_implementation = "eager"
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(target_config).eval()
    _randomize(target, gen)
    target.save_pretrained(root / "target")
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, root / "target" / name)
    head_config = transformers.LlamaConfig(**HEAD)
    head_config._attn_implementation = "eager"
    hot = np.sort(np.random.default_rng(0).choice(HEAD["vocab_size"], HEAD["draft_vocab_size"], replace=False))
    head = TorchEagle3(head_config, HEAD["draft_vocab_size"], hot).eval()
    _randomize(head, gen)
    (root / "head").mkdir()
    (root / "head" / "config.json").write_text(json.dumps(HEAD))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(root / "head" / "model.safetensors"))
    return str(root / "target"), str(root / "head"), target, head, hot


def _workload(engine):
    rng = np.random.default_rng(4)
    specs = [(5, 14), (40, 10), (9, 3), (12, 12), (20, 9)]
    results: dict[int, list[int]] = {}
    pending, steps = list(specs), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            n, max_tokens = pending.pop(0)
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
            results[engine.add_request(rng.integers(3, 96, n).tolist(), params).request_id] = []
        for update in engine.step():
            results[update.request.request_id] += update.new_token_ids
        steps += 1
        assert steps < 500
    return list(results.values())


def _torch_first_draft(target, head, hot, tokens: list[int]) -> np.ndarray:
    """Draft logits (target ids) after `tokens`, from scratch: the target's features over
    tokens[:-1] (inputs of layers 2, 4, 5), the head over the next tokens."""
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True, use_cache=False).hidden_states
        features = torch.cat([states[i] for i in LAYERS], dim=-1)
        _, logits = head(target.model.embed_tokens(torch.tensor([tokens[1:]])), features)
    full = np.full(HEAD["vocab_size"], -np.inf)
    full[hot] = logits[0, -1].numpy()
    return full


def test_eagle3_drafts_keep_the_greedy_output_and_match_torch(checkpoints):
    target_dir, head_dir, target, head, hot = checkpoints
    assert parse_speculative_config(
        {"method": "eagle3", "num_speculative_tokens": 2, "model": head_dir}
    ) == EagleDecodingConfig(max_draft_len=2, speculative_model_dir=head_dir)
    with pytest.raises(ValueError, match="eagle3_one_model=False"):
        tiny_engine(
            target_dir,
            speculative_config=EagleDecodingConfig(speculative_model_dir=head_dir, eagle3_one_model=False),
            **LIMITS,
        )
    base = tiny_engine(target_dir, **LIMITS)
    try:
        expected = _workload(base)
    finally:
        base.close()
    engine = tiny_engine(
        target_dir, speculative_config=EagleDecodingConfig(max_draft_len=2, speculative_model_dir=head_dir), **LIMITS
    )
    try:
        kv = engine.kv_cache_manager
        free_at_start = kv.num_free_blocks
        engine.warmup(all_variants=False)
        spec = engine.speculation
        spec.adaptive = False  # every step drafts: the drafts are compared with torch's
        with recorded_drafts(engine) as (seen, compiles):
            got = _workload(engine)
        assert got == expected
        assert compiles == []
        assert spec.num_draft_tokens > 0 and len(seen) > 20
        for tokens, drafts in seen[::2]:
            logits = _torch_first_draft(target, head, hot, tokens)
            assert logits[drafts[0]] >= logits.max() - 1e-4, (tokens, drafts)
        kv.check_invariants()
        assert kv.num_free_blocks == free_at_start
    finally:
        engine.close()
