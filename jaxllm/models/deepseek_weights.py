"""DeepSeek-V3's weights: the multi-head latent attention and MoE extras of the one weight
declaration (`jaxllm.models.weights`), and the multi-token-prediction (MTP) layers of its
checkpoints: their own tensors (`declare_mtp_extras`; the decoder layer inside each is
declared like any other), which the loader reads with `load_mtp=True` and skips otherwise."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.weight_layout import Layout, Source

logger = logging.getLogger(__name__)


def _single(name: str, shape: tuple[int, ...], layout: Layout) -> list[list[Source]]:
    return [[Source(name, shape, layout)]]


def _transposed(out_features: int, in_features: int, offset: tuple[int, int] = ()) -> Layout:
    return Layout((out_features, in_features), (1, 0), offset)


def declare_mla_attention(add: Callable, config: ModelConfig, layer: int) -> None:
    """q_a [H, Rq], q_a_norm [Rq], q_b [Rq, Hq, Dn + Dr] (or q [H, Hq, Dn + Dr]); kv_a [H, R] and
    k_rope [H, Dr] (the two parts of kv_a_proj_with_mqa), kv_a_norm [R]; k_b [R, Hq, Dn] and
    v_b [R, Hq, Dv] (the two parts of each head's rows of kv_b_proj); o [Hq, Dv, H]."""
    c = config
    h, hq, r, dr, dn, dv = (
        c.hidden_size,
        c.num_heads,
        c.kv_lora_rank,
        c.qk_rope_head_dim,
        c.qk_nope_head_dim,
        c.v_head_dim,
    )
    dqk = dn + dr
    pre, at = f"model.layers.{layer}.self_attn", ("layers", layer, "attn")
    if c.q_lora_rank is not None:
        rq = c.q_lora_rank
        add(
            at + ("q_a",),
            (h, rq),
            ("embed", None),
            _single(f"{pre}.q_a_proj.weight", (rq, h), _transposed(rq, h)),
            "linear",
        )
        add(
            at + ("q_a_norm",),
            (rq,),
            (None,),
            _single(f"{pre}.q_a_layernorm.weight", (rq,), Layout((rq,), (0,))),
            "norm",
        )
        add(
            at + ("q_b",),
            (rq, hq, dqk),
            (None, "heads", "head_dim"),
            _single(f"{pre}.q_b_proj.weight", (hq * dqk, rq), Layout((hq, dqk, rq), (2, 0, 1))),
            "linear",
        )
    else:
        add(
            at + ("q",),
            (h, hq, dqk),
            ("embed", "heads", "head_dim"),
            _single(f"{pre}.q_proj.weight", (hq * dqk, h), Layout((hq, dqk, h), (2, 0, 1))),
            "linear",
        )
    kv_a = f"{pre}.kv_a_proj_with_mqa.weight"
    add(at + ("kv_a",), (h, r), ("embed", None), _single(kv_a, (r + dr, h), _transposed(r + dr, h, (0, 0))), "linear")
    add(
        at + ("k_rope",), (h, dr), ("embed", None), _single(kv_a, (r + dr, h), _transposed(r + dr, h, (r, 0))), "linear"
    )
    add(at + ("kv_a_norm",), (r,), (None,), _single(f"{pre}.kv_a_layernorm.weight", (r,), Layout((r,), (0,))), "norm")
    kv_b = f"{pre}.kv_b_proj.weight"
    for ours, width, start in (("k_b", dn, 0), ("v_b", dv, dn)):
        add(
            at + (ours,),
            (r, hq, width),
            (None, "heads", "head_dim"),
            _single(kv_b, (hq * (dn + dv), r), Layout((hq, dn + dv, r), (2, 0, 1), offset=(0, start, 0))),
            "linear",
        )
    add(
        at + ("o",),
        (hq, dv, h),
        ("heads", "head_dim", "embed"),
        _single(f"{pre}.o_proj.weight", (h, hq * dv), Layout((h, hq, dv), (1, 2, 0))),
        "linear",
    )


def declare_moe_extras(add: Callable, config: ModelConfig, layer: int) -> None:
    """The router's correction bias [E] (float32 in every model dtype, as transformers keeps it:
    it decides near ties between experts) and the shared experts (gate/up [H, Is], down [Is, H],
    replicated on every rank)."""
    h, e = config.hidden_size, config.num_experts
    pre = f"model.layers.{layer}.mlp"
    add(
        ("layers", layer, "moe", "router_bias"),
        (e,),
        (None,),
        _single(f"{pre}.gate.e_score_correction_bias", (e,), Layout((e,), (0,))),
        "bias",
        dtype="float32",
    )
    if config.n_shared_experts:
        inter, shared = config.moe_intermediate_size * config.n_shared_experts, ("layers", layer, "shared")
        for ours in ("gate", "up"):
            add(
                shared + (ours,),
                (h, inter),
                ("embed", None),
                _single(f"{pre}.shared_experts.{ours}_proj.weight", (inter, h), _transposed(inter, h)),
                "linear",
            )
        add(
            shared + ("down",),
            (inter, h),
            (None, "embed"),
            _single(f"{pre}.shared_experts.down_proj.weight", (h, inter), _transposed(h, inter)),
            "linear",
        )


def declare_mtp_extras(add: Callable, config: ModelConfig, layer: int) -> None:
    """The multi-token-prediction layer `model.layers.{layer}`'s own weights, beside its decoder
    layer: enorm and hnorm [H] (the RMSNorms of the next token's embedding and of the previous
    hidden state), eh_proj [2H, H] (over [enorm(embed); hnorm(hidden)]) and shared_head.norm [H]
    (`head_norm`). Its `embed_tokens` and `shared_head.head` are copies of the main model's
    embedding and LM head; the main model's are used (`mtp_shared_copies`)."""
    h, pre = config.hidden_size, f"model.layers.{layer}"
    for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm")):
        add(
            ("layers", layer, ours),
            (h,),
            ("embed",),
            _single(f"{pre}.{theirs}.weight", (h,), Layout((h,), (0,))),
            "norm",
        )
    add(
        ("layers", layer, "eh_proj"),
        (2 * h, h),
        (None, "embed"),
        _single(f"{pre}.eh_proj.weight", (h, 2 * h), _transposed(h, 2 * h)),
        "linear",
    )
    add(
        ("layers", layer, "head_norm"),
        (h,),
        ("embed",),
        _single(f"{pre}.shared_head.norm.weight", (h,), Layout((h,), (0,))),
        "norm",
    )


def mtp_shared_copies(layer: int) -> tuple[str, str]:
    """The MTP layer's copies of the main embedding and LM head, which the loader does not read."""
    return f"model.layers.{layer}.embed_tokens.weight", f"model.layers.{layer}.shared_head.head.weight"


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def mtp_tensor_names(config: ModelConfig, names: list[str]) -> list[str]:
    """Checkpoint tensors of the multi-token-prediction layers (`model.layers.{i}` for i >=
    num_hidden_layers), which the decoder does not run."""
    out = []
    for name in names:
        m = _LAYER_NAME.match(name)
        if m and int(m.group(1)) >= config.num_layers:
            out.append(name)
    return out


def log_skipped_mtp(names: list[str]) -> None:
    layers = sorted({int(_LAYER_NAME.match(n).group(1)) for n in names})
    logger.info(
        "skipping %d multi-token-prediction tensors (layers %s); load_params(load_mtp=True) loads them",
        len(names),
        ", ".join(map(str, layers)),
    )
