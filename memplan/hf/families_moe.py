"""Translators of the MoE and hybrid families' ``config.json``: GLM-4 (its dense sibling
first), GLM-4.5, GPT-OSS, Llama 4 (text); Qwen3-Next in ``memplan.hf.families_hybrid``.
``NOT_MODELLED`` names the families refused by name (none at present).

Each reads a family's keys with the defaults of its transformers 5 configuration class (a key
missing from the file takes the class's default, as ``AutoConfig`` does) and returns the
``ModelSpec`` fields of the model ``AutoModelForCausalLM.from_config`` builds; the module each
reading follows is named beside it (``transformers/models/<family>/``, transformers 5.3).
A setting that would build a model memplan does not describe is refused by name.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields

MOE_FAMILIES = ("glm4", "glm4_moe", "gpt_oss", "llama4_text")
# families whose blocks memplan does not describe yet: what each lacks, read from its modeling
# code (transformers 5.3), refused by name rather than estimated as something else
NOT_MODELLED: dict[str, str] = {}
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
    each head (apply_rotary_pos_emb; partial_rotary_factor 0.5), its tables repeated pairwise
    in every layer (``rope_interleaved``: cos[..., :d // 2].repeat_interleave(2, dim=-1)).
    head_dim defaults to 128."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, bias=False,
                          defaults=_GLM)
    fields.update(qkv_bias=cfg.get_bool("attention_bias", True), attn_out_bias=False,
                  fused_gate_up=True, norm_placement="sandwich", rope_interleaved=True,
                  **rotary_dim(fields["head_dim"], partial_rotary(cfg, 0.5)))
    return fields


def first_dense(cfg: ConfigKeys, num_layers: int, default: int) -> int:
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
        "first_dense_layers": first_dense(cfg, fields["num_layers"], 1),
        "stacked_experts": True, "router_fp32": True,
    }
    if shared:  # Glm4MoeMoE.forward runs them after the routed experts
        moe.update(num_shared_experts=shared, shared_expert_ffn_hidden_size=moe_ffn,
                   shared_experts_last=True)
    fields.update(qkv_bias=bias, attn_out_bias=False, moe=moe,
                  **rotary_dim(fields["head_dim"], partial_rotary(cfg, 0.5)))
    if cfg.get_bool("use_qk_norm", False):
        # Glm4MoeAttention.forward: the norms before the transpose
        fields.update(qk_norm="head", qk_norm_token_major=True)
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
        rope_half_tables=True,  # GptOssRotaryEmbedding.forward: emb = freqs
        eager_softmax_fp32=False, **_gpt_oss_window(cfg, fields["num_layers"]),
        moe={"num_experts": experts, "top_k": cfg.get_int("num_experts_per_tok", 4),
             "expert_ffn_hidden_size": fields["ffn_hidden_size"], "router_bias": True,
             "stacked_experts": True, "clamped_swiglu": True, "router_topk_softmax": True})
    return fields


# configuration_llama4.py Llama4TextConfig.__init__'s defaults of the keys that shape the model
_LLAMA4 = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
           "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
           "num_key_value_heads": 8, "max_position_embeddings": 131072}


def _llama4_layers(cfg: ConfigKeys, key: str, default: list[int]) -> list[int]:
    """A per-layer list as the file gives it (``[]`` or null: the class's rule, as
    Llama4TextConfig.__init__ reads no_rope_layers), else ``default``."""
    value = cfg.data.get(key)
    if value is None or (value == [] and key == "no_rope_layers"):
        return default
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                          for v in value):
        raise cfg.error(key, f"expected a list of integers, got {value!r}")
    return value


def _llama4_moe(cfg: ConfigKeys, num_layers: int) -> dict[str, Any]:
    """Llama4TextDecoderLayer: Llama4TextMoe on the layers of moe_layers (by default every
    interleave_moe_layer_step-th: range(step - 1, layers, step)), Llama4TextMLP of
    intermediate_size_mlp on the others; only that interleaving is modelled. The MoE: a
    bias-free router (Llama4Router, an nn.Linear h -> E), num_local_experts stacked experts
    of intermediate_size (Llama4TextExperts: gate_up_proj (E, h, 2f), down_proj (E, f, h)),
    one shared expert of intermediate_size (Llama4TextMLP), every token through every expert
    (``every_expert``)."""
    step = cfg.get_int("interleave_moe_layer_step", 1)
    default = list(range(step - 1, num_layers, step))
    layers = _llama4_layers(cfg, "moe_layers", default)
    if layers != default:
        raise cfg.error("moe_layers", f"only every interleave_moe_layer_step-th ({step}) layer "
                                      f"MoE is modelled, got {layers!r}")
    if not layers:
        return {}
    ffn = cfg.get_int("intermediate_size")
    return {"moe": {"num_experts": cfg.get_int("num_local_experts", 16),
                    "top_k": cfg.get_int("num_experts_per_tok", 1),
                    "expert_ffn_hidden_size": ffn, "num_shared_experts": 1,
                    "shared_expert_ffn_hidden_size": ffn, "layer_freq": step,
                    "stacked_experts": True, "every_expert": True}}


def _llama4_attention(cfg: ConfigKeys, num_layers: int) -> dict[str, Any]:
    """Llama4TextAttention: layer i rotates q and k when no_rope_layers[i] (by default every
    no_rope_layer_interval-th layer, 4, is NoPE: ``nope_layer_interval``); layer_types makes
    the RoPE layers chunked_attention over attention_chunk_size (8192) tokens and the NoPE
    layers full_attention (Llama4TextConfig.__init__), read as a chunked window on every
    layer but each n-th; the L2 q/k norm on the RoPE layers when use_qk_norm (default true).
    The NoPE layers' temperature tuning (attn_temperature_tuning: q times an fp32 scale per
    position, cast back) saves only that (b, s) scale: not counted."""
    interval = cfg.get_int("no_rope_layer_interval", 4)
    rope = _llama4_layers(cfg, "no_rope_layers",
                          [int((i + 1) % interval != 0) for i in range(num_layers)])
    # the class keeps the list, not the interval (to_dict has no no_rope_layer_interval)
    interval = rope.index(0) + 1 if 0 in rope else 0
    if len(rope) != num_layers or rope != [int(not interval or (i + 1) % interval != 0)
                                           for i in range(num_layers)]:
        raise cfg.error("no_rope_layers", f"only every layer with RoPE or every n-th layer "
                                          f"without it is modelled, got {rope!r}")
    chunked = ["chunked_attention" if r else "full_attention" for r in rope]
    types = cfg.data.get("layer_types")
    if types is not None and types != chunked:
        raise cfg.error("layer_types", "only chunked attention on the RoPE layers and full "
                                       f"attention on the others is modelled, got {types!r}")
    fields: dict[str, Any] = {"nope_layer_interval": interval}
    if any(rope):
        fields.update(sliding_window=cfg.get_int("attention_chunk_size", 8192),
                      sliding_window_pattern=interval, window_chunked=True)
    if cfg.get_bool("use_qk_norm", True) and any(rope):
        fields["qk_norm"] = "l2"
    return fields


def llama4_text(cfg: ConfigKeys) -> dict[str, Any]:
    """models/llama4/modeling_llama4.py: Llama's pre-norm layer (Llama4TextDecoderLayer,
    Llama4TextRMSNorm: weight * x.type_as) with bias-free q, k, v and o (Llama4TextConfig
    sets attention_bias false whatever the file says), head_dim 128 by default, an untied
    head (Llama4ForCausalLM); its eager attention softmaxes in the scores' dtype
    (eager_attention_forward: "llama4 doesn't cast attn weights to fp32"); RoPE through a
    complex64 table (``rope_complex``: Llama4TextRotaryEmbedding, apply_rotary_emb); the attention
    (``_llama4_attention``) and the feed-forward (``_llama4_moe``) as read there."""
    cfg = ConfigKeys({**_LLAMA4, **{k: v for k, v in cfg.data.items() if v is not None}},
                     cfg.where)
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, bias=False)
    num_layers = fields["num_layers"]
    fields.update(ffn_hidden_size=cfg.get_int("intermediate_size_mlp"),
                  eager_softmax_fp32=False, rope_complex=True,
                  **_llama4_attention(cfg, num_layers),
                  **_llama4_moe(cfg, num_layers))
    return fields


def moe_family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a ``MOE_FAMILIES`` config."""
    if model_type == "llama4_text":
        return llama4_text(cfg)
    if model_type == "glm4":
        return glm4(cfg)
    if model_type == "gpt_oss":
        return gpt_oss(cfg)
    return glm4_moe(cfg)
