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
    FULL,
    SLIDING,
    ConfigKeys,
    _layer_types,
    gated_act,
    gated_mlp,
    gpt2,
    llama_fields,
    llama_like,
    sliding_fields,
)
from memplan.hf.fallback import fallback_fields
from memplan.hf.families_hybrid import QWEN3_NEXT_EXPERTS, qwen3_next
from memplan.hf.families_moe import MOE_FAMILIES, moe_family_fields, refuse_not_modelled
from memplan.hf.families_more import MORE_FAMILIES, granite_hybrid_layers, more_family_fields
from memplan.hf.families_conv import CONV_FAMILIES, conv_family_fields
from memplan.hf.families_granite import (
    GRANITE_MOE_FAMILIES,
    granite_family_fields,
    granite_residual,
)

# llama, mistral, mixtral and qwen2 share Llama's field names (memplan.hf.config); gpt2 has
# its own; the others are read here
SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "qwen3", "qwen2_moe", "qwen3_moe",
             "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2", "deepseek_v3", "granite",
             "gemma", "ministral", "smollm3",
             "olmo3", "cohere2", "ministral3", "mistral3", "llama4")
SUPPORTED += MOE_FAMILIES  # memplan.hf.families_moe
SUPPORTED += ("qwen3_next",)  # memplan.hf.families_hybrid
SUPPORTED += MORE_FAMILIES  # memplan.hf.families_more
SUPPORTED += CONV_FAMILIES  # memplan.hf.families_conv
SUPPORTED += GRANITE_MOE_FAMILIES  # memplan.hf.families_granite
# configuration classes' defaults (configuration_<family>.py __init__)
_QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768}
_GEMMA2 = {"vocab_size": 256000, "max_position_embeddings": 8192}
_GEMMA3 = {"vocab_size": 262208, "max_position_embeddings": 131072}


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
    fields.update(qk_norm="head", qk_norm_token_major=True,
                  **_qwen_window(cfg, fields["num_layers"]))
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
        # the top-k weights in the compute dtype (``router_weights_cast``): transformers 5.23's
        # router casts them to the linear's output dtype (5.3's stayed fp32)
        "router_weights_cast": True,
    }
    if qwen2:
        moe.update(num_shared_experts=1, shared_expert_gate=True,
                   shared_expert_ffn_hidden_size=cfg.get_int("shared_expert_intermediate_size",
                                                             5632))
        fields["qkv_bias"] = cfg.get_bool("qkv_bias", True)
        # Qwen2MoeModel.forward builds the sliding-window mask whatever the layers
        fields["window_mask_always"] = True
    else:
        bias = cfg.get_bool("attention_bias", False)
        # Qwen3MoeAttention.forward: the norms before the transpose, as Qwen3's
        fields.update(qkv_bias=bias, attn_out_bias=bias, qk_norm="head",
                      qk_norm_token_major=True)
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
        norm_scale_fp32=True, embeds_scaled_copy=gemma2,
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
        fields["rope_per_layer_type"] = True
    return fields


def gemma1(cfg: ConfigKeys) -> dict[str, Any]:
    """models/gemma/modeling_gemma.py: Llama's layer with two pre-norms (GemmaDecoderLayer:
    input_layernorm, post_attention_layernorm) scaling in fp32 by (1 + weight)
    (GemmaRMSNorm.forward), head_dim its own key (default 256), tied embeddings by default, a
    gated MLP of ACT2FN[hidden_act] (GemmaMLP; GemmaConfig's default gelu_pytorch_tanh; the
    published files' hidden_activation is no attribute transformers 5 reads), attention_bias
    on q, k, v and o. The embedding's scaling by sqrt(hidden) (GemmaModel.forward: a multiply
    by a 0-d tensor) saves nothing of the activations' size."""
    fields = llama_fields(cfg, head_dim_default=256, tie_default=True, defaults=_GEMMA2)
    if cfg.get_bool("use_bidirectional_attention", False):
        raise cfg.error("use_bidirectional_attention", "bidirectional attention (an encoder) "
                                                       "is not modelled")
    kind = gated_act(cfg, "hidden_act", "gelu_pytorch_tanh")
    if kind != "geglu":
        raise cfg.error("hidden_act", f"unsupported activation {cfg.get_str('hidden_act')!r} "
                                      "for Gemma (expected gelu or gelu_pytorch_tanh)")
    fields.update(mlp=kind, norm_scale_fp32=True, embeds_scaled_copy=True)
    return fields


def ministral(cfg: ConfigKeys) -> dict[str, Any]:
    """models/ministral/modeling_ministral.py: Mistral's layer (no biases on q, k, v, o or the
    MLP: MinistralAttention, MinistralMLP) with a sliding window per layer_types
    (MinistralAttention.sliding_window), which MinistralConfig fills with every layer sliding
    when sliding_window is set (default 4096), else every layer full."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults={"vocab_size": 32000, "max_position_embeddings": 131072})
    window = _window(cfg) if "sliding_window" in cfg.data else 4096
    num_layers = fields["num_layers"]
    default = [SLIDING if window is not None else FULL] * num_layers
    fields.update(mlp_bias=False, **sliding_fields(cfg, _layer_types(cfg, num_layers, default),
                                                    window))
    return fields


def smollm3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/smollm3/modeling_smollm3.py: Llama's layer (attention_bias on q, k, v and o,
    mlp_bias) where layer i rotates q and k only when no_rope_layers[i] is 1
    (SmolLM3Attention.use_rope); SmolLM3Config fills no_rope_layers with every
    no_rope_layer_interval-th layer (default 4) without RoPE (``nope_layer_interval``), and
    slides the window only on layers without RoPE when use_sliding_window. Tied by default."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=True,
                          defaults={"vocab_size": 128256, "max_position_embeddings": 32768})
    num_layers = fields["num_layers"]
    interval = cfg.get_int("no_rope_layer_interval", 4)
    default = [int((i + 1) % interval != 0) for i in range(num_layers)]
    rope = cfg.data.get("no_rope_layers")
    if rope is None:
        rope = default
    if rope != default:
        every = [1] * num_layers
        if rope != every:
            raise cfg.error("no_rope_layers", f"only every layer with RoPE or every "
                                              f"no_rope_layer_interval-th ({interval}) without "
                                              f"it is modelled, got {rope!r}")
        interval = 0
    elif interval > num_layers:
        interval = 0  # every layer rotates
    window = (_window(cfg) if cfg.get_bool("use_sliding_window", False) else None)
    types = [SLIDING if window is not None and not r else FULL for r in rope]
    fields.update(nope_layer_interval=interval,
                  **sliding_fields(cfg, _layer_types(cfg, num_layers, types), window))
    return fields


def ministral3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/ministral3/modeling_ministral3.py: Mistral's layer (no biases), head_dim its own
    key (default 128), every layer sliding when sliding_window is set (Ministral3Model: one
    mask for all layers), and the rotated q multiplied by a per-position scale
    (Ministral3Attention.forward: _get_llama_4_attn_scale(...).to(q.dtype), a (s, 1) tensor
    without grad: the product replaces q, saving only that scale)."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, bias=False,
                          defaults={"vocab_size": 131072, "max_position_embeddings": 262144})
    window = _window(cfg)
    num_layers = fields["num_layers"]
    fields.update(mlp_bias=False, **sliding_fields(cfg, [SLIDING if window else FULL]
                                                   * num_layers, window))
    if window:  # Ministral3Model.forward: the window's mask in place of the causal one
        fields["window_mask_alone"] = True
    return fields


def phi3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/phi3/modeling_phi3.py: Llama's layer with one fused qkv_proj (Phi3Attention) and
    one fused gate_up_proj (Phi3MLP), no biases, RoPE on the first int(head_dim *
    partial_rotary_factor) of each head (apply_rotary_pos_emb: Phi-4-mini's 0.75), the residual dropout resid_pdrop on both
    sub-layers' outputs and embd_pdrop on the embedding (the largest rate stands for all),
    every layer sliding when sliding_window is set (Phi3Attention.forward)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults={"vocab_size": 32064, "max_position_embeddings": 4096})
    dropout = max(cfg.get_float(k, 0.0) for k in ("resid_pdrop", "embd_pdrop",
                                                  "attention_dropout"))
    window = _window(cfg)
    types = _layer_types(cfg, fields["num_layers"], [SLIDING] * fields["num_layers"])
    fields.update(fused_qkv=True, fused_gate_up=True, dropout=dropout,
                  **sliding_fields(cfg, types, window), **_partial_rotary(cfg, fields))
    if window:  # Phi3Model.forward: the window's mask in place of the causal one
        fields["window_mask_alone"] = True
    return fields


def _partial_rotary(cfg: ConfigKeys, fields: dict[str, Any]) -> dict[str, Any]:
    """``rotary_dim`` of a ``partial_rotary_factor`` below 1: int(head_dim * factor)
    (modeling_rope_utils.py _compute_default_rope_parameters, Phi3RotaryEmbedding). The
    factor is read where Phi3Config.convert_rope_params_to_dict finds it: rope_scaling's or
    rope_parameters' own key first, else the top-level one (default 1.0)."""
    factor, key = 1.0, "partial_rotary_factor"
    for where in ("rope_scaling", "rope_parameters"):
        params = cfg.data.get(where)
        if isinstance(params, dict) and params.get(key) is not None:
            factor = ConfigKeys(params, f"{cfg.where}: {where}").get_float(key, 1.0)
            break
    else:
        factor = cfg.get_float(key, 1.0)
    if not 0.0 < factor <= 1.0:
        raise cfg.error(key, f"expected a factor in (0, 1], got {factor}")
    rotary = int(fields["head_dim"] * factor)
    if rotary == fields["head_dim"]:
        return {}
    if rotary == 0 or rotary % 2:
        raise cfg.error(key, f"{factor} of head_dim {fields['head_dim']} rotates {rotary} "
                             "dimensions; an even count above 0 is modelled")
    return {"rotary_dim": rotary}


def olmo2(cfg: ConfigKeys) -> dict[str, Any]:
    """models/olmo2/modeling_olmo2.py: norms after the mixers, before the residual add, none
    before them (Olmo2DecoderLayer.forward), q and k normalised over the whole projection
    (Olmo2Attention.q_norm of heads * head_dim, k_norm of kv_heads * head_dim), the weight
    multiplying the fp32 normalised tensor (Olmo2RMSNorm.forward), RoPE casting q and k back
    to their dtype (apply_rotary_pos_emb), attention_bias on q, k, v and o. Its rotary
    embedding returns cos and sin in fp32 (Olmo2RotaryEmbedding.forward: no cast to x's dtype,
    where Llama's casts them): ``rope_tables_fp32``."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 50304, "max_position_embeddings": 2048})
    fields.update(qk_norm="full", norm_placement="post", norm_scale_fp32=True,
                  rope_keeps_dtype=True, rope_tables_fp32=True)
    return fields


def granite(cfg: ConfigKeys) -> dict[str, Any]:
    """models/granite/modeling_granite.py: Llama's parameters (GraniteConfig's defaults are
    LlamaConfig's: vocab_size 32000, max_position_embeddings 2048, untied) and four scalar
    multipliers, none a parameter: embedding_multiplier (GraniteModel.forward: inputs_embeds *
    m), attention_multiplier (GraniteAttention.scaling, the softmax scale SDPA takes),
    residual_multiplier (GraniteDecoderLayer.forward: residual + out * m) and logits_scaling
    (GraniteForCausalLM.forward: logits / s). Multiplying by a Python scalar saves nothing for
    the backward (autograd's mul/div by a scalar keep only the scalar)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 32000, "max_position_embeddings": 2048})
    return {**fields, **granite_residual(cfg)}


def olmo3(cfg: ConfigKeys) -> dict[str, Any]:
    """models/olmo3/modeling_olmo3.py: OLMo 2's layer (``olmo2``: Olmo3DecoderLayer's norms
    after the mixers, Olmo3Attention's q/k norms over the whole projection, Olmo3RMSNorm's
    fp32 scaling, apply_rotary_pos_emb's cast back) with a sliding window per layer_types
    (Olmo3Attention.sliding_window), which Olmo3Config fills with every fourth layer full and
    the others sliding (sliding_window default 4096). One rotary embedding for all layers
    (Olmo3Model.rotary_emb), whose tables are cast to the hidden states' dtype
    (Olmo3RotaryEmbedding.forward: cos.to(dtype=x.dtype)), unlike OLMo 2's."""
    fields = olmo2(cfg)
    fields["rope_tables_fp32"] = False
    num_layers = fields["num_layers"]
    window = _window(cfg) if "sliding_window" in cfg.data else 4096
    default = [SLIDING if (i + 1) % 4 else FULL for i in range(num_layers)]
    fields.update(sliding_fields(cfg, _layer_types(cfg, num_layers, default), window))
    return fields


def cohere2(cfg: ConfigKeys) -> dict[str, Any]:
    """models/cohere2/modeling_cohere2.py: a parallel layer (Cohere2DecoderLayer.forward:
    residual + self_attn(x) + mlp(x) of one input_layernorm x), a LayerNorm without bias that
    normalises an fp32 copy and multiplies by the fp32 weight before the cast back
    (Cohere2LayerNorm.forward: saves x - mean and the normalised tensor in fp32, as
    ``norm_scale_fp32`` does), RoPE on q and k in fp32 cast back to their dtype
    (apply_rotary_pos_emb) on the sliding-window layers only, every sliding_window_pattern-th
    (4) layer full and without positions (Cohere2Attention.forward), attention_bias on q, k,
    v and o, a bias-free gated MLP, tied embeddings by default; the logits multiplied by
    logit_scale (Cohere2ForCausalLM.forward: a scalar, nothing saved)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=True,
                          defaults={"vocab_size": 256000, "max_position_embeddings": 8192})
    num_layers = fields["num_layers"]
    period = cfg.get_int("sliding_window_pattern", 4)
    window = _window(cfg) if "sliding_window" in cfg.data else 4096
    types = _layer_types(cfg, num_layers,
                         [SLIDING if (i + 1) % period else FULL for i in range(num_layers)])
    sliding = sliding_fields(cfg, types, window)
    if window is None or SLIDING not in types:
        raise cfg.error("layer_types", "Cohere2 rotates q and k on its sliding-window layers "
                                       "only: without them no layer has positions, which is "
                                       "not modelled")
    fields.update(norm="layernorm", mlp_bias=False, parallel_block=True, norm_scale_fp32=True,
                  norm_centres_twice=True,
                  rope_keeps_dtype=True,
                  nope_layer_interval=sliding.get("sliding_window_pattern", 0), **sliding)
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
    if shared:  # DeepseekV3MoE.forward runs them after the routed experts
        moe.update(num_shared_experts=cfg.get_int("n_shared_experts", 1),
                   shared_expert_ffn_hidden_size=moe_ffn, shared_experts_last=True)
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
    cfg = outer = ConfigKeys(data, where)
    model_type = cfg.get_str("model_type")
    refuse_not_modelled(cfg, model_type)
    if model_type not in SUPPORTED or (model_type == "granitemoehybrid"
                                       and not granite_hybrid_layers(cfg)):
        # transformers' exact count and tensors, an approximate estimate (Granite 4.0-H's
        # layer kinds other than Mamba and attention)
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
    elif model_type == "llama4":
        # Llama4ForConditionalGeneration: its language model is text_config's Llama4TextModel
        # under Llama4ForCausalLM (models/llama4/modeling_llama4.py)
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise cfg.error("text_config", "a llama4 config describes its language model in "
                                           "text_config (a JSON object)")
        cfg, model_type = ConfigKeys(text, f"{where}: text_config"), "llama4_text"
        source += ": its language model (text_config); the vision tower is not counted"
    elif model_type == "mistral3":
        # Mistral3ForConditionalGeneration (Ministral 3, Mistral Small 3.1): its language model
        # is text_config's, of text_config's model_type (Mistral3Config: default mistral)
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise cfg.error("text_config", "a mistral3 config describes its language model in "
                                           "text_config (a JSON object)")
        cfg = ConfigKeys(text, f"{where}: text_config")
        model_type = cfg.get_str("model_type", "mistral")
        if model_type not in ("mistral", "ministral", "ministral3"):
            raise cfg.error("model_type", f"a mistral3 language model of {model_type!r} is not "
                                          "modelled (mistral, ministral, ministral3 are)")
        source += ": its language model (text_config); the vision tower is not counted"
    fields = _family_fields(cfg, model_type)
    if outer.get_str("model_type") == "mistral3":
        # the multimodal model ties its head by the outer config's tie_word_embeddings
        # (Mistral3Config: default true; Mistral3ForConditionalGeneration._tied_weights_keys)
        fields["tied_embeddings"] = outer.get_bool("tie_word_embeddings", True)
    # every configuration class defaults use_cache to true (configuration_<family>.py); a
    # family whose forward makes no cache unless given one says so itself (Falcon-H1)
    fields["use_cache"] = cfg.get_bool("use_cache", True) and fields.get("use_cache", True)
    fields["name"] = name
    fields["source"] = source
    return fields


def _family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    if model_type in MOE_FAMILIES:
        return moe_family_fields(cfg, model_type)
    if model_type in MORE_FAMILIES:
        return more_family_fields(cfg, model_type)
    if model_type in CONV_FAMILIES:
        return conv_family_fields(cfg, model_type)
    if model_type in GRANITE_MOE_FAMILIES:
        return granite_family_fields(cfg, model_type)
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
    if model_type == "gemma":
        return gemma1(cfg)
    if model_type == "ministral":
        return ministral(cfg)
    if model_type == "smollm3":
        return smollm3(cfg)
    if model_type == "olmo3":
        return olmo3(cfg)
    if model_type == "cohere2":
        return cohere2(cfg)
    if model_type == "ministral3":
        return ministral3(cfg)
    if model_type == "granite":
        return granite(cfg)
    if model_type == "qwen3_next":
        # Qwen2-MoE's rules for the sparse layers and the expert count (its readers here)
        layers = cfg.get_int("num_hidden_layers")
        return qwen3_next(cfg, _sparse_layers(cfg, layers),
                          _num_experts(cfg, ("num_experts",), QWEN3_NEXT_EXPERTS))
    return llama_like(cfg, model_type)
