"""Which translator reads a ``config.json`` (``spec_fields``, by its ``model_type``), and those
of the families that are not Llama's field for field: Qwen3, Qwen2-MoE / Qwen3-MoE, Gemma 2 /
3, Phi-3, OLMo 2 and DeepSeek-V3 (Llama's, Mistral's, Mixtral's, Qwen2's and GPT-2's are
``memplan.hf.config``'s).

Each reads a family's keys with the defaults of its transformers 5 configuration class (a key
missing from the file takes the class's default, as ``AutoConfig`` does) and returns the
``ModelSpec`` fields of the model ``AutoModelForCausalLM.from_config`` builds; the module each
reading follows is named beside it (``transformers/models/<family>/``, transformers 5.3).
A setting that would build a model memplan does not describe is refused by name.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import (
    ConfigKeys,
    gated_act,
    gated_mlp,
    gpt2,
    llama_fields,
    llama_like,
)
from memplan.hf.fallback import fallback_fields
from memplan.hf.families_moe import MOE_FAMILIES, moe_family_fields, refuse_not_modelled

# llama, mistral, mixtral and qwen2 share Llama's field names (memplan.hf.config); gpt2 has
# its own; the others are read here
SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "qwen3", "qwen2_moe", "qwen3_moe",
             "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2", "deepseek_v3")
SUPPORTED += MOE_FAMILIES  # memplan.hf.families_moe
FULL, SLIDING = "full_attention", "sliding_attention"
# configuration classes' defaults (configuration_<family>.py __init__)
_QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768}
_GEMMA2 = {"vocab_size": 256000, "max_position_embeddings": 8192}
_GEMMA3 = {"vocab_size": 262208, "max_position_embeddings": 131072}


def _layer_types(cfg: ConfigKeys, num_layers: int, default: list[str]) -> list[str]:
    """``layer_types`` as the file gives it (transformers 5 writes it), else the family's
    rule (``default``)."""
    types = cfg.data.get("layer_types")
    if types is None:
        return default
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (FULL, SLIDING) for t in types)):
        raise cfg.error("layer_types", f"expected {num_layers} entries of {FULL!r} or "
                                       f"{SLIDING!r}, got {types!r}")
    return types


def sliding_fields(cfg: ConfigKeys, types: list[str], window: int | None) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_window_pattern`` of a list of layer types: every layer
    sliding (pattern 0) or every n-th full (pattern n); anything else is refused."""
    if window is None or SLIDING not in types:
        return {}
    if FULL not in types:
        return {"sliding_window": window, "sliding_window_pattern": 0}
    n = types.index(FULL) + 1
    if any((t == FULL) != (i % n == n - 1) for i, t in enumerate(types)):
        raise cfg.error("layer_types", "only every layer sliding or every n-th layer full "
                                       f"attention is modelled, got {types!r}")
    return {"sliding_window": window, "sliding_window_pattern": n}


def _window(cfg: ConfigKeys, key: str = "sliding_window") -> int | None:
    value = cfg.data.get(key)
    return None if value is None else cfg.get_int(key)


def _qwen_window(cfg: ConfigKeys, num_layers: int) -> dict[str, Any]:
    """Qwen's sliding window: layers from ``max_window_layers`` on slide when
    ``use_sliding_window`` (configuration_qwen3.py Qwen3Config.__init__)."""
    window = _window(cfg) if cfg.get_bool("use_sliding_window", False) else None
    first_full = cfg.get_int("max_window_layers", 28)
    default = [SLIDING if window is not None and i >= first_full else FULL
               for i in range(num_layers)]
    return sliding_fields(cfg, _layer_types(cfg, num_layers, default), window)


def qwen3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/qwen3/modeling_qwen3.py: Llama's layer with a per-head RMSNorm on q and k
    (Qwen3Attention.q_norm / k_norm, weights of head_dim) and attention_bias on q, k, v and o.
    Qwen3Config's head_dim defaults to 128."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, defaults=_QWEN)
    fields.update(qk_norm="head", **_qwen_window(cfg, fields["num_layers"]))
    return fields


def _sparse_layers(cfg: ConfigKeys, num_layers: int) -> tuple[int, int]:
    """(layer_freq, first dense layers) of ``decoder_sparse_step`` and ``mlp_only_layers``:
    Qwen2MoeDecoderLayer makes layer i sparse unless i is in mlp_only_layers, when
    (i + 1) % decoder_sparse_step == 0. Only a leading run of dense layers is modelled."""
    step = cfg.get_int("decoder_sparse_step", 1)
    only = cfg.data.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         for i in only):
        raise cfg.error("mlp_only_layers", f"expected a list of layer indices, got {only!r}")
    dense = sorted(set(only))
    if dense != list(range(len(dense))) or len(dense) >= num_layers:
        raise cfg.error("mlp_only_layers", f"only the first k layers dense is modelled, "
                                           f"got {only!r}")
    return step, len(dense)


def _num_experts(cfg: ConfigKeys, keys: tuple[str, str], default: int) -> int:
    """The routed experts, under the file's key or its ``attribute_map`` alias (Qwen3MoeConfig
    keeps ``num_experts`` as ``num_local_experts``; DeepseekV3Config the reverse)."""
    key = next((k for k in keys if cfg.data.get(k) is not None), keys[0])
    value = cfg.data.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        raise cfg.error(key, "0 experts builds a dense model; give it as a dense family")
    return cfg.get_int(key, default)


def qwen_moe(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """models/qwen2_moe/modeling_qwen2_moe.py and models/qwen3_moe/modeling_qwen3_moe.py:
    routed experts as stacked 3-D tensors (Qwen2MoeExperts), a softmax router without bias
    (Qwen2MoeTopKRouter); Qwen2-MoE adds one shared expert of shared_expert_intermediate_size
    behind a sigmoid gate (Qwen2MoeSparseMoeBlock) and has q/k/v biases (qkv_bias, default
    true; o_proj none); Qwen3-MoE has Qwen3's q/k norms and head_dim (default
    hidden / heads), no shared expert."""
    qwen2 = model_type == "qwen2_moe"
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults=_QWEN)
    num_layers = fields["num_layers"]
    freq, first_dense = _sparse_layers(cfg, num_layers)
    moe: dict[str, Any] = {
        "num_experts": _num_experts(cfg, ("num_experts", "num_local_experts"),
                                    60 if qwen2 else 128),
        "top_k": cfg.get_int("num_experts_per_tok", 4 if qwen2 else 8),
        "expert_ffn_hidden_size": cfg.get_int("moe_intermediate_size", 1408 if qwen2 else 768),
        "layer_freq": freq, "first_dense_layers": first_dense, "stacked_experts": True,
    }
    if qwen2:
        moe.update(num_shared_experts=1, shared_expert_gate=True,
                   shared_expert_ffn_hidden_size=cfg.get_int("shared_expert_intermediate_size",
                                                             5632))
        fields["qkv_bias"] = cfg.get_bool("qkv_bias", True)
    else:
        bias = cfg.get_bool("attention_bias", False)
        fields.update(qkv_bias=bias, attn_out_bias=bias, qk_norm="head")
    fields["moe"] = moe
    fields.update(_qwen_window(cfg, num_layers))
    return fields


def _gemma_mlp(cfg: ConfigKeys) -> str:
    """Gemma's MLP activation: ``hidden_activation`` (``hidden_act`` in older files), a gated
    GELU (Gemma2MLP: act(gate) * up), gelu_pytorch_tanh by default (one kernel)."""
    key = "hidden_activation" if cfg.data.get("hidden_activation") is not None else "hidden_act"
    kind = gated_act(cfg, key, "gelu_pytorch_tanh")
    if kind != "geglu":
        raise cfg.error(key, f"unsupported activation {cfg.get_str(key)!r} for Gemma "
                             "(expected gelu or gelu_pytorch_tanh)")
    return kind


def gemma(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """models/gemma2/modeling_gemma2.py, models/gemma3/modeling_gemma3.py: head_dim its own key
    (default 256), four norms per layer (Gemma2DecoderLayer: input, post-attention,
    pre-feed-forward, post-feed-forward) that scale in fp32 by (1 + weight)
    (Gemma2RMSNorm.forward), tied embeddings by default, a gated GELU; Gemma 2
    soft-caps the attention scores (eager attention only: sdpa_attention_forward takes no
    softcap) and the final logits (Gemma2ForCausalLM.forward), every second layer sliding;
    Gemma 3 adds per-head q/k norms (Gemma3Attention), no soft-capping by default and every
    sliding_window_pattern-th (6) layer full. The embedding's scaling by sqrt(hidden)
    (Gemma2Model.forward: a multiply by a constant) saves nothing."""
    gemma2 = model_type == "gemma2"
    fields = llama_fields(cfg, head_dim_default=256, tie_default=True, bias=False,
                          defaults=_GEMMA2 if gemma2 else _GEMMA3)
    bias = cfg.get_bool("attention_bias", False)
    num_layers = fields["num_layers"]
    period = 2 if gemma2 else cfg.get_int("sliding_window_pattern", 6)
    default = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    fields.update(
        mlp=_gemma_mlp(cfg), qkv_bias=bias, attn_out_bias=bias, norm_placement="sandwich",
        norm_scale_fp32=True,
        **sliding_fields(cfg, _layer_types(cfg, num_layers, default), _window(cfg) or 4096),
    )
    default_cap = (30.0, 50.0) if gemma2 else (None, None)
    for field, key, cap in (("final_logit_softcap", "final_logit_softcapping", default_cap[0]),
                            ("attn_logit_softcap", "attn_logit_softcapping", default_cap[1])):
        value = cfg.data.get(key, cap)
        if value is not None:
            fields[field] = cfg.get_float(key, cap)
    if not gemma2:
        fields["qk_norm"] = "head"
    return fields


def phi3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/phi3/modeling_phi3.py: Llama's layer with one fused qkv_proj (Phi3Attention) and
    one fused gate_up_proj (Phi3MLP), no biases, the residual dropout resid_pdrop on both
    sub-layers' outputs and embd_pdrop on the embedding (the largest rate stands for all),
    every layer sliding when sliding_window is set (Phi3Attention.forward)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults={"vocab_size": 32064, "max_position_embeddings": 4096})
    if cfg.get_float("partial_rotary_factor", 1.0) != 1.0:
        raise cfg.error("partial_rotary_factor", "partial rotary embeddings are not modelled")
    dropout = max(cfg.get_float(k, 0.0) for k in ("resid_pdrop", "embd_pdrop",
                                                  "attention_dropout"))
    window = _window(cfg)
    types = _layer_types(cfg, fields["num_layers"], [SLIDING] * fields["num_layers"])
    fields.update(fused_qkv=True, fused_gate_up=True, dropout=dropout,
                  **sliding_fields(cfg, types, window))
    return fields


def olmo2(cfg: ConfigKeys) -> dict[str, Any]:
    """models/olmo2/modeling_olmo2.py: norms after the mixers, before the residual add, none
    before them (Olmo2DecoderLayer.forward), q and k normalised over the whole projection
    (Olmo2Attention.q_norm of heads * head_dim, k_norm of kv_heads * head_dim), the weight
    multiplying the fp32 normalised tensor (Olmo2RMSNorm.forward), RoPE casting q and k back
    to their dtype (apply_rotary_pos_emb), attention_bias on q, k, v and o."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 50304, "max_position_embeddings": 2048})
    fields.update(qk_norm="full", norm_placement="post", norm_scale_fp32=True,
                  rope_keeps_dtype=True)
    return fields


def deepseek_v3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/deepseek_v3/modeling_deepseek_v3.py: MLA (DeepseekV3Attention: q_a_proj /
    q_a_layernorm / q_b_proj, or one q_proj without q_lora_rank; kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj; o_proj; attention_bias on q_a, kv_a and o), dense MLPs of
    intermediate_size in the first first_k_dense_replace layers (DeepseekV3DecoderLayer), then
    DeepseekV3MoE: n_routed_experts stacked (DeepseekV3NaiveMoe), a sigmoid router without
    bias (DeepseekV3TopkRouter; its e_score_correction_bias is a buffer) and n_shared_experts
    as one MLP of moe_intermediate_size * n_shared_experts; the router's linear on fp32 copies
    of its input and weight (DeepseekV3TopkRouter.forward). transformers builds no
    multi-token-prediction layers (num_nextn_predict_layers: DeepseekV3ForCausalLM's
    _keys_to_ignore_on_load_unexpected drops model.layers.61)."""
    hidden = cfg.get_int("hidden_size")
    heads = cfg.get_int("num_attention_heads")
    kv_heads = cfg.get_int("num_key_value_heads", heads)
    if kv_heads != heads:
        raise cfg.error("num_key_value_heads", f"MLA has one key/value head per query head "
                                               f"({heads}), got {kv_heads}")
    nope, rope = cfg.get_int("qk_nope_head_dim", 128), cfg.get_int("qk_rope_head_dim", 64)
    q_lora = cfg.data.get("q_lora_rank", 1536)
    num_layers = cfg.get_int("num_hidden_layers")
    first_dense = cfg.data.get("first_k_dense_replace", 3)
    if (isinstance(first_dense, bool) or not isinstance(first_dense, int)
            or not 0 <= first_dense < num_layers):
        raise cfg.error("first_k_dense_replace", f"expected 0 to {num_layers - 1}, "
                                                 f"got {first_dense!r}")
    bias = cfg.get_bool("attention_bias", False)
    shared = cfg.data.get("n_shared_experts", 1) or 0
    moe_ffn = cfg.get_int("moe_intermediate_size", 2048)
    moe: dict[str, Any] = {
        "num_experts": _num_experts(cfg, ("n_routed_experts", "num_local_experts"), 256),
        "top_k": cfg.get_int("num_experts_per_tok", 8),
        "expert_ffn_hidden_size": moe_ffn, "first_dense_layers": first_dense,
        "stacked_experts": True, "router_fp32": True,
    }
    if shared:
        moe.update(num_shared_experts=cfg.get_int("n_shared_experts", 1),
                   shared_expert_ffn_hidden_size=moe_ffn)
    return {
        "num_layers": num_layers, "hidden_size": hidden,
        "ffn_hidden_size": cfg.get_int("intermediate_size", 18432),
        "num_attention_heads": heads, "num_kv_heads": heads, "head_dim": nope + rope,
        "vocab_size": cfg.get_int("vocab_size", 129280),
        "max_seq_len": cfg.get_int("max_position_embeddings", 4096),
        "norm": "rmsnorm", "mlp": gated_mlp(cfg), "position": "rope",
        "tied_embeddings": cfg.get_bool("tie_word_embeddings", False),
        "qkv_bias": bias, "attn_out_bias": bias,
        "mla": {"q_lora_rank": 0 if q_lora is None else cfg.get_int("q_lora_rank"),
                "kv_lora_rank": cfg.get_int("kv_lora_rank", 512), "qk_nope_head_dim": nope,
                "qk_rope_head_dim": rope, "v_head_dim": cfg.get_int("v_head_dim", 128)},
        "moe": moe,
    }


def spec_fields(data: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a config (``config.json`` or ``PretrainedConfig.to_dict()``);
    ``where`` names it in errors."""
    cfg = ConfigKeys(data, where)
    model_type = cfg.get_str("model_type")
    refuse_not_modelled(cfg, model_type)
    if model_type not in SUPPORTED:  # transformers' exact count, an approximate estimate
        return fallback_fields(cfg, model_type, SUPPORTED, name, where)
    source = f"Hugging Face config.json ({model_type}) at {where}"
    if model_type == "gemma3":
        # Gemma3ForConditionalGeneration: its language model is text_config's Gemma3TextModel
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise cfg.error("text_config", "a gemma3 config describes its language model in "
                                           "text_config (a JSON object)")
        cfg, model_type = ConfigKeys(text, f"{where}: text_config"), "gemma3_text"
        source += ": its language model (text_config); the vision tower is not counted"
    fields = _family_fields(cfg, model_type)
    # every configuration class defaults use_cache to true (configuration_<family>.py)
    fields["use_cache"] = cfg.get_bool("use_cache", True)
    fields["name"] = name
    fields["source"] = source
    return fields


def _family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    if model_type in MOE_FAMILIES:
        return moe_family_fields(cfg, model_type)
    if model_type == "gpt2":
        return gpt2(cfg)
    if model_type == "qwen3":
        return qwen3(cfg)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return qwen_moe(cfg, model_type)
    if model_type in ("gemma2", "gemma3_text"):
        return gemma(cfg, model_type)
    if model_type == "phi3":
        return phi3(cfg)
    if model_type == "olmo2":
        return olmo2(cfg)
    if model_type == "deepseek_v3":
        return deepseek_v3(cfg)
    return llama_like(cfg, model_type)
