"""Translators of the MoE and hybrid families' ``config.json``: GLM-4 (its dense sibling
first), GLM-4.5, GPT-OSS; Llama 4 text and Qwen3-Next refused by name (``NOT_MODELLED``).

Each reads a family's keys with the defaults of its transformers 5 configuration class (a key
missing from the file takes the class's default, as ``AutoConfig`` does) and returns the
``ModelSpec`` fields of the model ``AutoModelForCausalLM.from_config`` builds; the module each
reading follows is named beside it (``transformers/models/<family>/``, transformers 5.3).
A setting that would build a model memplan does not describe is refused by name.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields

MOE_FAMILIES = ("glm4", "glm4_moe", "gpt_oss")
# families whose blocks memplan does not describe yet: what each lacks, read from its modeling
# code (transformers 5.3), refused by name rather than estimated as something else
NOT_MODELLED = {
    "llama4_text": "Llama 4's chunked local attention interleaved with NoPE global layers "
                   "(modeling_llama4.py Llama4TextAttention: attention_chunk_size, "
                   "no_rope_layers, attn_temperature_tuning), its weightless L2 q/k norm "
                   "(Llama4TextL2Norm) and its MoE that runs every token through every expert "
                   "(Llama4TextMoe.forward: hidden_states.repeat(num_experts, 1) scaled by "
                   "sigmoid scores, zero off the top-k) are not modelled",
}
# configuration_glm4.py Glm4Config.__init__ / configuration_glm4_moe.py Glm4MoeConfig.__init__
_GLM = {"vocab_size": 151552, "max_position_embeddings": 131072}


def partial_rotary(cfg: ConfigKeys, default: float) -> float:
    """``partial_rotary_factor``: transformers 5 keeps it in ``rope_parameters`` (its
    standardisation copies a top-level key there); the class's default otherwise
    (Glm4Config.__init__: kwargs.setdefault("partial_rotary_factor", 0.5))."""
    rope = cfg.data.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        value = rope["partial_rotary_factor"]
        key = "rope_parameters.partial_rotary_factor"
    else:
        value = cfg.data.get("partial_rotary_factor", default)
        key = "partial_rotary_factor"
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise cfg.error(key, f"expected a number in (0, 1], got {value!r}")
    return float(value)


def rotary_dim(head_dim: int, factor: float) -> dict[str, Any]:
    """``ModelSpec.rotary_dim`` of a partial rotary ``factor``: int(head_dim * factor)
    (modeling_rope_utils.py _compute_default_rope_parameters), none when it is the whole
    head."""
    rotary = int(head_dim * factor)
    return {} if rotary == head_dim else {"rotary_dim": rotary}


def glm4(cfg: ConfigKeys) -> dict[str, Any]:
    """models/glm4/modeling_glm4.py: four norms per layer (Glm4DecoderLayer.forward:
    input_layernorm, post_self_attn_layernorm on the attention's output, post_attention_
    layernorm before the MLP, post_mlp_layernorm on its output), Llama's RMSNorm (Glm4RMSNorm:
    weight * x.to(input_dtype)), q/k/v biases from attention_bias (default true) and none on
    o_proj (Glm4Attention.__init__), one gate_up_proj (Glm4MLP), RoPE on the first half of
    each head (apply_rotary_pos_emb; partial_rotary_factor 0.5). head_dim defaults to 128."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, bias=False,
                          defaults=_GLM)
    fields.update(qkv_bias=cfg.get_bool("attention_bias", True), attn_out_bias=False,
                  fused_gate_up=True, norm_placement="sandwich",
                  **rotary_dim(fields["head_dim"], partial_rotary(cfg, 0.5)))
    return fields


def _first_dense(cfg: ConfigKeys, num_layers: int, default: int) -> int:
    value = cfg.data.get("first_k_dense_replace", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_layers:
        raise cfg.error("first_k_dense_replace", f"expected 0 to {num_layers - 1}, "
                                                 f"got {value!r}")
    return value


def glm4_moe(cfg: ConfigKeys) -> dict[str, Any]:
    """models/glm4_moe/modeling_glm4_moe.py: Llama's pre-norm layer (Glm4MoeDecoderLayer) with
    grouped-query attention, q/k/v biases from attention_bias (default false), none on o_proj,
    per-head q/k RMSNorms when use_qk_norm (Glm4MoeAttention), RoPE on the first
    partial_rotary_factor (0.5) of each head; dense MLPs of intermediate_size in the first
    first_k_dense_replace layers, then Glm4MoeMoE: n_routed_experts stacked
    (Glm4MoeNaiveMoe: gate_up_proj, down_proj), a bias-free router whose linear runs on fp32
    copies (Glm4MoeTopkRouter.forward; e_score_correction_bias a buffer; the n_group /
    topk_group selection works on the scores, no parameters) and the n_shared_experts as one
    MLP of moe_intermediate_size * n_shared_experts (Glm4MoeMoE.__init__). head_dim is read
    when given (Glm4MoeAttention: getattr(config, "head_dim", hidden // heads)). transformers
    builds no multi-token-prediction layer (num_nextn_predict_layers)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults=_GLM)
    bias = cfg.get_bool("attention_bias", False)
    shared = cfg.get_int("n_shared_experts", 1)
    moe_ffn = cfg.get_int("moe_intermediate_size", 1408)
    experts = cfg.get_int("n_routed_experts", 128)
    groups = cfg.get_int("n_group", 1)
    if groups <= 0 or experts % groups:
        raise cfg.error("n_group", f"{groups} groups do not divide {experts} routed experts")
    moe: dict[str, Any] = {
        "num_experts": experts, "top_k": cfg.get_int("num_experts_per_tok", 8),
        "expert_ffn_hidden_size": moe_ffn,
        "first_dense_layers": _first_dense(cfg, fields["num_layers"], 1),
        "stacked_experts": True, "router_fp32": True,
    }
    if shared:
        moe.update(num_shared_experts=shared, shared_expert_ffn_hidden_size=moe_ffn)
    fields.update(qkv_bias=bias, attn_out_bias=False, moe=moe,
                  **rotary_dim(fields["head_dim"], partial_rotary(cfg, 0.5)))
    if cfg.get_bool("use_qk_norm", False):
        fields["qk_norm"] = "head"
    return fields


def refuse_not_modelled(cfg: ConfigKeys, model_type: str) -> None:
    """One line naming what a ``NOT_MODELLED`` family lacks."""
    if model_type in NOT_MODELLED:
        raise cfg.error("model_type", f"{model_type!r} is recognised but not supported: "
                                      f"{NOT_MODELLED[model_type]}")


def _gpt_oss_window(cfg: ConfigKeys, num_layers: int) -> dict[str, Any]:
    """GptOssConfig's layer_types: sliding on even layers, full on odd ones unless given; only
    that alternation (memplan's sliding_window_pattern 2) or every layer full is modelled."""
    window = cfg.get_int("sliding_window", 128) if cfg.data.get("sliding_window", 128) else None
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention"
               for i in range(num_layers)]
    types = cfg.data.get("layer_types") or default
    if types == ["full_attention"] * num_layers or window is None:
        return {}
    if types != default:
        raise cfg.error("layer_types", "only sliding and full layers alternating (sliding "
                                       f"first) is modelled, got {types!r}")
    return {"sliding_window": window, "sliding_window_pattern": 2}


def gpt_oss(cfg: ConfigKeys) -> dict[str, Any]:
    """models/gpt_oss/modeling_gpt_oss.py: Llama's pre-norm layer (GptOssDecoderLayer) with
    biases on q, k, v and o (GptOssConfig sets attention_bias true whatever the file says),
    a learned sink logit per head (GptOssAttention.sinks) in its eager attention, which
    softmaxes in the scores' dtype (eager_attention_forward: F.softmax(..., dtype=
    combined_logits.dtype)); sliding (sliding_window, 128) and full layers alternating;
    every layer's MLP is GptOssMLP: a router with a bias (GptOssTopKRouter) over
    num_local_experts stacked experts with biases (GptOssExperts: gate_up_proj (E, h, 2f),
    gate_up_proj_bias (E, 2f), down_proj (E, f, h), down_proj_bias (E, h)) of
    intermediate_size, their SwiGLU clamped (GptOssExperts._apply_gate). head_dim defaults
    to 64. The published MXFP4 checkpoint (quantization_config) stores the experts' weights
    in 4 bits (their scales beside them) and the rest in bf16; MXFP4 does not train
    (quantizers/quantizer_mxfp4.py Mxfp4HfQuantizer.is_trainable: "consider dequantizing the
    model first by passing quantization_config=Mxfp4Config(dequantize=True)"), which
    dequantizes the experts to bf16: the model read here is that dequantized one, every
    weight trained in the recipe's dtype (bf16 weights, fp32 master weights and moments under
    mixed precision)."""
    fields = llama_fields(cfg, head_dim_default=64, tie_default=False, bias=False,
                          defaults={"vocab_size": 201088, "max_position_embeddings": 131072})
    experts = cfg.get_int("num_local_experts", 128)
    fields.update(
        qkv_bias=True, attn_out_bias=True, attn_sinks=True, mlp_bias=True,
        norm_scale_fp32=True,  # GptOssRMSNorm.forward: (weight * x).to(input_dtype)
        eager_softmax_fp32=False, **_gpt_oss_window(cfg, fields["num_layers"]),
        moe={"num_experts": experts, "top_k": cfg.get_int("num_experts_per_tok", 4),
             "expert_ffn_hidden_size": fields["ffn_hidden_size"], "router_bias": True,
             "stacked_experts": True, "clamped_swiglu": True, "router_topk_softmax": True})
    return fields


def moe_family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a ``MOE_FAMILIES`` config."""
    if model_type == "glm4":
        return glm4(cfg)
    if model_type == "gpt_oss":
        return gpt_oss(cfg)
    return glm4_moe(cfg)
