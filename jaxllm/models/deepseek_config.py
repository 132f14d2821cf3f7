"""DeepSeek-V3's config.json fields (`DeepseekV3ForCausalLM`): multi-head latent attention and
grouped sigmoid routing, with transformers' defaults for the keys a config leaves out.
Read by `jaxllm.models.model_config.load_model_config`; kept apart from the DeepSeek layers so
the config sits below every model module."""

from __future__ import annotations

from typing import Any

# transformers' DeepseekV3Config defaults, for keys a config.json leaves out.
_HF_DEFAULTS = dict(
    n_routed_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    rope_interleave=True,
)


def deepseek_config_fields(hf: dict, arch: str) -> dict[str, Any]:
    """The MLA and routing fields of `ModelConfig` from a DeepseekV3 config.json."""

    def get(key: str) -> Any:
        return hf[key] if key in hf else _HF_DEFAULTS[key]

    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"unsupported scoring_func={scoring!r} for {arch} (only 'sigmoid')")
    topk_method = hf.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ValueError(f"unsupported topk_method={topk_method!r} for {arch} (only 'noaux_tc')")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise ValueError(
            f"unsupported moe_layer_freq={hf['moe_layer_freq']} (every layer after first_k_dense_replace is sparse)"
        )
    num_experts = int(hf.get("n_routed_experts", hf.get("num_local_experts", _HF_DEFAULTS["n_routed_experts"])))
    n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_routed_experts={num_experts} must split into n_group={n_group} groups of at least 2")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    q_lora = get("q_lora_rank")
    first_k = int(get("first_k_dense_replace") or 0)
    num_layers = int(hf["num_hidden_layers"])
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob")),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(range(min(first_k, num_layers))),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        rope_interleave=bool(get("rope_interleave")),
        scoring_func="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_shared_experts=int(get("n_shared_experts") or 0),
        num_nextn_predict_layers=_nextn_layers(hf),
    )


def _nextn_layers(hf: dict) -> int:
    value = hf.get("num_nextn_predict_layers") or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16:
        raise ValueError(f"num_nextn_predict_layers={value!r} must be an integer in [0, 16]")
    return value
