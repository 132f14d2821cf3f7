"""EAGLE-3 draft heads: the checkpoint layout against the reference implementations' parameter
names, loading a random head in that layout, the target's low/mid/high hidden states against
transformers', and the head's forward and chained drafts against a torch composition of
transformers' Llama attention, MLP and RMSNorm wired as EAGLE-3 publishes them."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

from jaxllm.models import load_model_config, load_params  # noqa: E402
from jaxllm.models.eagle3 import (  # noqa: E402
    aux_layers_for,
    default_aux_layers,
    eagle3_draft,
    eagle3_forward,
    init_eagle3_kv_cache,
)
from jaxllm.models.eagle3_weights import (  # noqa: E402
    eagle3_checkpoint_names,
    load_eagle3_config,
    load_eagle3_params,
)
from jaxllm.models.hidden_states import forward_with_hidden_states  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, build_step_batch, random_block_table, rel_err  # noqa: E402

TOL = 1e-4
# The tensors of a published EAGLE-3 head, as the reference implementations name them:
# SafeAILab/EAGLE eagle/traineagle3/cnets.py (`Model`: midlayer = LlamaDecoderLayeremb with
# hidden_norm, input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj (q/k/v over
# hidden_size * 2), mlp.{gate,up,down}_proj; fc = Linear(hidden_size * 3, hidden_size); norm;
# lm_head over draft_vocab_size; buffers d2t [draft_vocab_size] and t2d [vocab_size]), and
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (`LlamaForCausalLMEagle3.load_weights`:
# d2t, t2d, midlayer.*, fc, norm, lm_head; embed_tokens optional, else the target's).
REFERENCE_NAMES = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
REFERENCE_OPTIONAL = {"embed_tokens.weight"}

TARGET = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
HEAD = dict(
    architectures=["LlamaForCausalLMEagle3"],
    model_type="llama",
    vocab_size=96,
    draft_vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)
TOKENS_PER_BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 32, 8


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(
                1.0 + 0.1 * noise
                if "norm" in name
                else noise * (3.0 if "lm_head" in name else 1.0) / p.shape[-1] ** 0.5
            )


class TorchEagle3(torch.nn.Module):
    """EAGLE-3's head from transformers' Llama parts: q/k/v of the attention take 2H (the
    concatenated normed embedding and hidden state), fc fuses three target layers."""

    def __init__(self, config, draft_vocab: int, hot_ids: np.ndarray) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.midlayer = torch.nn.Module()
        attn = hf_llama.LlamaAttention(config, layer_idx=0)
        for proj in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, proj)
            setattr(attn, proj, torch.nn.Linear(2 * h, old.out_features, bias=False))
        self.midlayer.self_attn = attn
        self.midlayer.mlp = hf_llama.LlamaMLP(config)
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self.midlayer, norm, hf_llama.LlamaRMSNorm(h, eps=config.rms_norm_eps))
        self.norm = hf_llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, draft_vocab, bias=False)
        self.rotary = hf_llama.LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.tensor(hot_ids - np.arange(draft_vocab), dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.tensor(hot_ids)] = True
        self.register_buffer("t2d", t2d)

    def forward(self, embeds, hidden):
        """Hidden states [1, n, H] and draft logits [1, n, Vd] over a whole causal sequence."""
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        m = self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = m.self_attn(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)
        out = hidden + a
        out = out + m.mlp(m.post_attention_layernorm(out))
        return out, self.lm_head(self.norm(out))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    gen = torch.Generator().manual_seed(0)
    target_config = transformers.LlamaConfig(**TARGET)
    target_config._attn_implementation = "eager"
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(target_config).eval()
    _randomize(target, gen)
    target.save_pretrained(root / "target")
    head_config = transformers.LlamaConfig(**HEAD)
    head_config._attn_implementation = "eager"
    hot = np.sort(np.random.default_rng(0).choice(HEAD["vocab_size"], HEAD["draft_vocab_size"], replace=False))
    head = TorchEagle3(head_config, HEAD["draft_vocab_size"], hot).eval()
    _randomize(head, gen)
    (root / "head").mkdir()
    (root / "head" / "config.json").write_text(json.dumps(HEAD))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(root / "head" / "model.safetensors"))
    config = load_model_config(root / "target")
    head_cfg = load_eagle3_config(root / "head")
    return dict(
        root=root,
        target=target,
        head=head,
        hot=hot,
        config=config,
        params=load_params(root / "target", config),
        head_config=head_cfg,
        head_params=load_eagle3_params(root / "head", head_cfg),
    )


@functools.cache
def _jitted(fn, *static):
    return jax.jit(fn, static_argnames=("config",) + static)


def _batch(chunks):
    return build_step_batch(
        chunks,
        tokens_per_block=TOKENS_PER_BLOCK,
        num_blocks=NUM_BLOCKS,
        token_bucket=32,
        max_seqs=2,
        max_blocks_per_seq=MAX_BLOCKS,
    )


def test_layout_has_the_reference_implementations_names(setup):
    ours = eagle3_checkpoint_names(setup["head_config"])
    assert set(ours) == REFERENCE_NAMES
    assert set(eagle3_checkpoint_names(setup["head_config"], embed=True)) == REFERENCE_NAMES | REFERENCE_OPTIONAL
    h, d = HEAD["hidden_size"], HEAD["hidden_size"] // HEAD["num_attention_heads"]
    assert ours["fc.weight"] == (h, 3 * h) and ours["midlayer.self_attn.q_proj.weight"] == (4 * d, 2 * h)
    assert ours["midlayer.self_attn.k_proj.weight"] == (2 * d, 2 * h) and ours["lm_head.weight"] == (40, h)
    assert ours["d2t"] == (40,) and ours["t2d"] == (96,)
    state = setup["head"].state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == ours  # the torch composition is that layout


def test_loading_checks_names_and_vocabulary_maps(setup, tmp_path):
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_np

    p = setup["head_params"]
    np.testing.assert_array_equal(np.arange(40) + np.asarray(p["d2t"]), setup["hot"])
    assert int(np.asarray(p["t2d"]).sum()) == 40 and "embed" not in p
    tensors = load_file(str(setup["root"] / "head" / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(HEAD))

    def refused(changed: dict, match: str) -> None:
        save_np(changed, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            load_eagle3_params(tmp_path, setup["head_config"])

    refused({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, "missing.*hidden_norm")
    refused({**tensors, "midlayer.extra.weight": np.ones(2, np.float32)}, "unexpected.*midlayer.extra")
    refused({**tensors, "fc.weight": np.ones((32, 64), np.float32)}, "fc.weight has shape")
    refused({**tensors, "d2t": tensors["d2t"] + (np.arange(40) == 39) * 1000}, "d2t maps draft ids outside")
    refused({**tensors, "d2t": np.zeros(40, np.int64)}, "d2t and t2d disagree")
    with_embed = {**tensors, "embed_tokens.weight": np.ones((96, 32), np.float32)}
    save_np(with_embed, str(tmp_path / "model.safetensors"))
    assert load_eagle3_params(tmp_path, setup["head_config"])["embed"].shape == (96, 32)
    with pytest.raises(ValueError, match="target of at least 5 layers"):
        default_aux_layers(4)


def _features(setup, tokens):
    """The target's fused low/mid/high features [n, 3H], ours and transformers'."""
    config, params = setup["config"], setup["params"]
    layers = aux_layers_for(setup["head_config"], config.num_layers)
    batch = _batch([SeqChunk(tokens, 0, random_block_table(np.random.default_rng(9), NUM_BLOCKS, MAX_BLOCKS))])
    cache = PagedModel(params, config, TOKENS_PER_BLOCK, NUM_BLOCKS).empty_cache()
    rows = jnp.arange(len(tokens), dtype=jnp.int32)
    aux = _jitted(forward_with_hidden_states, "aux_layers")(
        params, cache, batch, rows, config=config, aux_layers=layers
    ).aux_hidden
    with torch.no_grad():
        hf = setup["target"](torch.tensor([tokens]), output_hidden_states=True, use_cache=False).hidden_states
    ref = torch.cat([hf[i] for i in layers], dim=-1)[0]
    return np.asarray(aux).reshape(len(tokens), -1), ref


def test_target_returns_the_low_mid_high_hidden_states_of_transformers(setup):
    assert aux_layers_for(setup["head_config"], 8) == (2, 4, 5)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 96, 10)]
    ours, ref = _features(setup, tokens)
    assert rel_err(ours, ref.double().numpy()) < TOL


def test_head_forward_and_chained_drafts_match_the_torch_composition(setup):
    """The first step over two prompts at once, then two one-token steps per sequence reading
    the head's pages; drafts mapped through d2t and fed back as target ids."""
    head, target = setup["head"], setup["target"]
    embed = target.model.embed_tokens
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 96, n)] for n in (11, 6)]
    table_a = random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS)
    tables = [table_a, random_block_table(rng, NUM_BLOCKS, MAX_BLOCKS, exclude=table_a)]
    chunks, packed, expected, expected_logits = [], [], [], []
    for prompt, table in zip(prompts, tables):
        ours, ref = _features(setup, prompt[:-1])
        chunks.append(SeqChunk(prompt[1:], 0, table))
        packed.append(ours)
        with torch.no_grad():
            h = head.fc(ref[None])  # the fused features in the head's width; later steps append outputs
        seq, drafts, logits_rows = list(prompt[1:]), [], []
        for _ in range(3):  # the torch chain recomputes the whole sequence each step
            with torch.no_grad():
                out, logits = head(embed(torch.tensor([seq])), h)
            drafts.append(int(setup["hot"][int(logits[0, -1].argmax())]))
            logits_rows.append(logits[0, -1].double().numpy())
            seq, h = seq + [drafts[-1]], torch.cat([h, out[:, -1:]], dim=1)
        expected.append(drafts)
        expected_logits.append(logits_rows)
    features = np.concatenate(packed)
    hidden = jnp.zeros((32, features.shape[1])).at[: len(features)].set(jnp.asarray(features))
    batch = _batch(chunks)
    cfg, params = setup["head_config"], setup["head_params"]
    cache = init_eagle3_kv_cache(cfg, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32")
    logits, _, _ = _jitted(eagle3_forward)(params, setup["params"]["embed"], cache, batch, hidden, config=cfg)
    for s in range(2):
        assert rel_err(np.asarray(logits[s]), expected_logits[s][0]) < TOL
    drafts, _, chain_logits = _jitted(eagle3_draft, "num_draft_tokens", "return_logits")(
        params, setup["params"]["embed"], cache, batch, hidden, num_draft_tokens=3, config=cfg, return_logits=True
    )
    assert np.asarray(drafts).tolist() == expected
    assert len({d for row in expected for d in row}) > 1, "the drafts are one repeated token"
    for s in range(2):
        for j in range(3):
            assert rel_err(np.asarray(chain_logits[s, j]), expected_logits[s][j]) < TOL, (s, j)
