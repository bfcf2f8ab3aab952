"""Readers of the Llama-style families whose layers memplan's blocks describe as they are, each
with its own keys and defaults: EXAONE 4, Seed-OSS, Hunyuan (dense and MoE), ERNIE 4.5 (dense)
and dots.llm1.

Each reads the keys with the defaults of its transformers 5 configuration class
(``transformers/models/<family>/configuration_<family>.py``; a key the file leaves out takes
the class's default) and returns the ``ModelSpec`` fields of the model
``AutoModelForCausalLM.from_config`` builds (``modeling_<family>.py``, transformers 5.3 and
5.25: the same parameters in both).
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import FULL, SLIDING, ConfigKeys, llama_fields, sliding_fields
from memplan.hf.config import _KERNEL_GELU
from memplan.hf.config import _layer_types as _types
from memplan.hf.families_granite import granite_moe, granite_residual
from memplan.hf.families_moe import first_dense
MORE_FAMILIES = ("exaone4", "seed_oss", "hunyuan_v1_dense", "hunyuan_v1_moe", "ernie4_5", "dots1",
                 "ernie4_5_moe", "apertus", "granitemoehybrid", "falcon_h1")


def _window(cfg: ConfigKeys, default: int) -> int | None:
    """``sliding_window``: the file's (null: none), else the class's default."""
    if "sliding_window" not in cfg.data:
        return default
    return None if cfg.data["sliding_window"] is None else cfg.get_int("sliding_window")


def exaone4(cfg: ConfigKeys) -> dict[str, Any]:
    """models/exaone4/modeling_exaone4.py: norms after the mixers, before the residual add,
    none before them (Exaone4DecoderLayer: post_attention_layernorm, post_feedforward_
    layernorm), Llama's RMSNorm (Exaone4RMSNorm: weight * x.to(input_dtype)), per-head q/k
    RMSNorms before RoPE (Exaone4Attention.q_norm / k_norm of head_dim), no biases, and with a
    sliding window the full layers attend without RoPE (``if self.sliding_window is None or
    self.is_sliding``: the global NoPE of the hybrid attention). Exaone4Config fills
    layer_types with every sliding_window_pattern-th layer full (default 4, sliding_window
    4096); without a window every layer is full and rotates."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults={"vocab_size": 102400, "max_position_embeddings": 2048})
    num_layers = fields["num_layers"]
    window = _window(cfg, 4096)
    pattern = cfg.data.get("sliding_window_pattern", 4)
    every = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else 4
    default = ([SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
               if window is not None else [FULL] * num_layers)
    types = _types(cfg, num_layers, default)
    fields.update(qk_norm="head", norm_placement="post", **sliding_fields(cfg, types, window))
    if window is not None and SLIDING in types:
        # the full layers attend without RoPE: the every-n-th layers of sliding_fields' pattern
        fields["nope_layer_interval"] = fields.get("sliding_window_pattern", 0)
    return fields


def seed_oss(cfg: ConfigKeys) -> dict[str, Any]:
    """models/seed_oss/modeling_seed_oss.py: Llama's layer with q/k/v biases from
    attention_bias (default true), o_proj's from attention_out_bias (default false), MLP biases
    from mlp_bias, head_dim its own key (default 128), untied; dropout on the attention
    probabilities (attention_dropout, 0.1) and on both mixers' outputs (residual_dropout, 0.1:
    SeedOssAttention.forward, SeedOssMLP.forward), the larger rate standing for both."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=False, bias=False,
                          defaults={"vocab_size": 155136, "max_position_embeddings": 524288})
    dropout = max(cfg.get_float("attention_dropout", 0.1), cfg.get_float("residual_dropout", 0.1))
    fields.update(qkv_bias=cfg.get_bool("attention_bias", True),
                  attn_out_bias=cfg.get_bool("attention_out_bias", False), dropout=dropout)
    return fields


def hunyuan_v1_dense(cfg: ConfigKeys) -> dict[str, Any]:
    """models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py: Llama's layer (attention_bias on
    q, k, v and o; no MLP biases) with per-head RMSNorms on q and k (HunYuanDenseV1Attention.
    query_layernorm / key_layernorm of head_dim, built whatever use_qk_norm says). They run
    after RoPE, not before it as Qwen3's do: memplan counts Qwen3's order, the same tensors'
    sizes (the rotated q and k saved by the norms in place of the projections' outputs)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 290943, "max_position_embeddings": 2048})
    fields.update(qk_norm="head", mlp_bias=False)
    return fields


def hunyuan_v1_moe(cfg: ConfigKeys) -> dict[str, Any]:
    """models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py: Hunyuan's dense layer
    (``hunyuan_v1_dense``) with HunYuanMoEV1Moe on every layer: num_experts stacked experts of
    intermediate_size (HunYuanMoEV1Experts: gate_up_proj, down_proj), a bias-free router
    (HunYuanMoEV1Gate.wg; its softmax in fp32, the top moe_topk renormalised) and one shared
    MLP of intermediate_size without a gate (shared_mlp). A per-layer list of expert counts
    or top-k is refused. The router's weight is built in fp32 whatever the model's dtype
    (``nn.Linear(..., dtype=torch.float32)``) and its input cast to fp32 for it
    (HunYuanMoEV1Gate.forward): read as ``router_fp32``, whose saved fp32 input is this one;
    the weight's storage is counted in the model's dtype (E x h per layer: 0.01% of the
    A13B's parameters' bytes)."""
    fields = hunyuan_v1_dense(cfg)
    for key in ("num_experts", "moe_topk"):
        if isinstance(cfg.data.get(key), list):
            raise cfg.error(key, "a per-layer list is not modelled (one value for every layer)")
    ffn = fields["ffn_hidden_size"]
    fields["moe"] = {"num_experts": cfg.get_int("num_experts", 1),
                     "top_k": cfg.get_int("moe_topk", 1), "expert_ffn_hidden_size": ffn,
                     "stacked_experts": True, "num_shared_experts": 1, "router_fp32": True,
                     "shared_expert_ffn_hidden_size": ffn}
    return fields


def ernie4_5(cfg: ConfigKeys) -> dict[str, Any]:
    """models/ernie4_5/modeling_ernie4_5.py: Llama's layer with use_bias (default false) on
    q, k, v, o and the MLP's three projections (Ernie4_5Attention, Ernie4_5MLP), head_dim its
    own key (default 128), tied by default. Its RoPE rotates interleaved pairs (its own
    apply_rotary_pos_emb): the same tensors' sizes as Llama's; Ernie4_5RotaryEmbedding.
    forward returns its tables in fp32 (``rope_tables_fp32``), apply_rotary_pos_emb repeats
    them pairwise in every layer (``rope_interleaved``), rotates q.float() and casts the
    result back to q's dtype (``rope_keeps_dtype``: q_embed.to(original_dtype))."""
    fields = llama_fields(cfg, head_dim_default=128, tie_default=True, bias=False,
                          defaults={"vocab_size": 103424, "max_position_embeddings": 131072})
    bias = cfg.get_bool("use_bias", False)
    fields.update(qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias, rope_tables_fp32=True,
                  rope_interleaved=True, rope_keeps_dtype=True)
    return fields


def dots1(cfg: ConfigKeys) -> dict[str, Any]:
    """models/dots1/modeling_dots1.py: Qwen3's attention (Dots1Attention: per-head q/k norms,
    attention_bias on q, k, v and o, default false) and DeepSeek-V3's MoE without its
    attention: dense MLPs of intermediate_size in the first first_k_dense_replace layers
    (default 0), then Dots1MoE: n_routed_experts stacked (Dots1Experts: gate_up_proj,
    down_proj), a bias-free router whose fp32 weight runs on fp32 copies (Dots1TopkRouter;
    e_score_correction_bias a buffer) and the n_shared_experts as one MLP of
    moe_intermediate_size * n_shared_experts. Dots1Config slides the window on layers from
    max_window_layers on (default 62) when sliding_window is set (default 4096)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 152064, "max_position_embeddings": 2048})
    num_layers = fields["num_layers"]
    key = "n_routed_experts" if cfg.data.get("n_routed_experts") is not None \
        else "num_local_experts"
    experts = cfg.get_int(key)
    groups = cfg.get_int("n_group", 1)
    if groups <= 0 or experts % groups:
        raise cfg.error("n_group", f"{groups} groups do not divide {experts} routed experts")
    moe_ffn = cfg.get_int("moe_intermediate_size", 1408)
    moe: dict[str, Any] = {
        "num_experts": experts, "top_k": cfg.get_int("num_experts_per_tok"),
        "expert_ffn_hidden_size": moe_ffn,
        "first_dense_layers": first_dense(cfg, num_layers, 0),
        "stacked_experts": True, "router_fp32": True,
    }
    shared = cfg.data.get("n_shared_experts")
    if shared:
        shared = cfg.get_int("n_shared_experts")
        # Dots1MoE.forward runs them after the routed experts
        moe.update(num_shared_experts=shared, shared_expert_ffn_hidden_size=moe_ffn,
                   shared_experts_last=True)
    window = _window(cfg, 4096)
    first = cfg.get_int("max_window_layers", 62)
    default = [SLIDING if window is not None and i >= first else FULL
               for i in range(num_layers)]
    fields.update(qk_norm="head", moe=moe,
                  **sliding_fields(cfg, _types(cfg, num_layers, default), window))
    return fields


def ernie4_5_moe(cfg: ConfigKeys) -> dict[str, Any]:
    """models/ernie4_5_moe/modeling_ernie4_5_moe.py: ERNIE 4.5's dense layer (``ernie4_5``)
    whose MLP is Ernie4_5_MoeSparseMoeBlock on the layers Ernie4_5_MoeDecoderLayer picks:
    (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index
    (defaults 1, 1 and the last layer: Ernie4_5_MoeConfig.__post_init__). The block: moe_k of
    moe_num_experts stacked experts of moe_intermediate_size (Ernie4_5_MoeExperts:
    gate_up_proj, down_proj), a bias-free fp32 router (Ernie4_5_MoeTopKRouter: its weight
    built in fp32, F.linear on hidden_states.float()) and the moe_num_shared_experts as one
    MLP of moe_intermediate_size * moe_num_shared_experts (shared_experts). The router's
    Ernie4_5_MoeStatics keeps e_score_correction_bias, an fp32 (1, E) nn.Parameter with
    requires_grad=False: counted as the router's bias (E elements a layer, as transformers
    counts them), whose gradient and optimizer states memplan then counts too (E floats a
    layer: 64 x 27 for the 21B). Only a run of MoE layers from the start index to the last
    layer is modelled; another interval or end is refused by name."""
    fields = ernie4_5(cfg)
    num_layers = fields["num_layers"]
    interval = cfg.get_int("moe_layer_interval", 1)
    if interval != 1:
        raise cfg.error("moe_layer_interval", f"{interval}: MoE on every layer from "
                        "moe_layer_start_index on is modelled (interval 1)")
    start = cfg.get_int("moe_layer_start_index", 1)
    end = cfg.data.get("moe_layer_end_index", -1)
    if end not in (-1, num_layers - 1):
        raise cfg.error("moe_layer_end_index", f"{end}: MoE layers up to the last layer "
                        f"({num_layers - 1} or -1) are modelled")
    if not 0 <= start < num_layers:
        raise cfg.error("moe_layer_start_index", f"{start}: must be a layer index below "
                        f"num_hidden_layers ({num_layers})")
    moe_ffn = cfg.get_int("moe_intermediate_size", 1536)
    moe: dict[str, Any] = {
        "num_experts": cfg.get_int("moe_num_experts", 64), "top_k": cfg.get_int("moe_k", 6),
        "expert_ffn_hidden_size": moe_ffn, "first_dense_layers": start,
        "stacked_experts": True, "router_fp32": True, "router_bias": True,
        # Ernie4_5_MoeTopKRouter.forward: routing_weights.to(hidden_states.dtype); its weight
        # built in fp32, its renormalisation's sum clamped; the block binds the fp32 logits
        "router_weights_cast": True, "router_weight_fp32": True, "router_norm_clamped": True,
        "router_logits_held": True,
    }
    shared = cfg.get_int("moe_num_shared_experts", 2)
    if shared:
        moe.update(num_shared_experts=shared, shared_expert_ffn_hidden_size=moe_ffn)
    fields.update(moe=moe)
    return fields


def apertus(cfg: ConfigKeys) -> dict[str, Any]:
    """models/apertus/modeling_apertus.py: Llama's attention (attention_bias on q, k, v and o)
    with per-head RMSNorms on q and k before RoPE (ApertusAttention.q_norm / k_norm of
    head_dim, built whatever the config says), pre-norms (ApertusDecoderLayer.
    attention_layernorm, feedforward_layernorm), and a plain MLP, down(act(up(x))) without
    biases (ApertusMLP: nn.Linear(..., bias=False), mlp_bias not read), whose activation is
    xIELU by default (ACT2CLS["xielu"]: two learned one-element parameters per layer,
    made in config.dtype) or one of ACT2FN's GELU kernels. ApertusConfig's defaults: vocab
    131072, 65536 positions, untied."""
    act = cfg.get_str("hidden_act", "xielu").lower()
    if act == "xielu":
        mlp, impl = "gelu", "xielu"
    elif act in _KERNEL_GELU:
        mlp, impl = "gelu", "kernel"
    elif act == "relu":
        mlp, impl = "relu", "kernel"
    else:
        raise cfg.error("hidden_act", f"unsupported activation {act!r} for Apertus's plain MLP: "
                        f"modelled are xielu, {', '.join(_KERNEL_GELU)} and relu")
    # llama_fields reads hidden_act as a gated MLP's: read it as SiLU's there, then set it
    plain = ConfigKeys({**cfg.data, "hidden_act": "silu"}, cfg.where)
    fields = llama_fields(plain, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 131072, "max_position_embeddings": 65536})
    fields.update(qk_norm="head", mlp=mlp, activation_impl=impl, mlp_bias=False)
    return fields


# layer_types as the file writes them ("attention", "mamba") and as transformers 5.25's
# configuration class writes them in its to_dict() ("full_attention", "linear_attention")
_GRANITE_ATTENTION, _GRANITE_MAMBA = ("attention", "full_attention"), ("mamba", "linear_attention")


def granite_hybrid_layers(cfg: ConfigKeys) -> bool:
    """Whether a granitemoehybrid config's layer_types (default: every layer Mamba,
    GraniteMoeHybridConfig.layers_block_type) are attention or Mamba layers, the kinds
    memplan reads (with or without experts: GraniteMoeHybridDecoderLayer builds
    GraniteMoeHybridMoE when num_local_experts > 0, ``granite_moe``)."""
    types = cfg.data.get("layer_types")
    known = _GRANITE_ATTENTION + _GRANITE_MAMBA
    return types is None or (isinstance(types, list) and bool(types)
                             and all(t in known for t in types))


def _granite_mamba(cfg: ConfigKeys, hidden: int, num_layers: int) -> dict[str, Any] | None:
    """GraniteMoeHybridMambaLayer's widths (GraniteMoeHybridConfig.__init__ defaults: 128
    heads, mamba_d_head "auto" = mamba_expand (2) * h / heads, 1 group, state 256, conv 4,
    chunks of 256, conv bias, no projection bias), or None without Mamba layers."""
    types = cfg.data.get("layer_types") or ["mamba"] * num_layers
    if len(types) != num_layers:
        raise cfg.error("layer_types", f"expected {num_layers} entries, got {len(types)}")
    attention = tuple(i for i, t in enumerate(types) if t in _GRANITE_ATTENTION)
    if len(attention) == num_layers:
        return None
    heads = cfg.get_int("mamba_n_heads", 128)
    inner = cfg.get_int("mamba_expand", 2) * hidden
    head = cfg.data.get("mamba_d_head", "auto")
    head_dim = inner // heads if head == "auto" else cfg.get_int("mamba_d_head")
    if heads * head_dim != inner:
        raise cfg.error("mamba_d_head", f"mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) "
                                        f"must be mamba_expand * hidden_size ({inner})")
    return {"num_heads": heads, "head_dim": head_dim,
            "state_size": cfg.get_int("mamba_d_state", 256),
            "num_groups": cfg.get_int("mamba_n_groups", 1),
            "conv_kernel": cfg.get_int("mamba_d_conv", 4),
            "chunk_size": cfg.get_int("mamba_chunk_size", 256),
            "conv_bias": cfg.get_bool("mamba_conv_bias", True),
            "proj_bias": cfg.get_bool("mamba_proj_bias", False), "attention_layers": attention}


def granitemoehybrid(cfg: ConfigKeys) -> dict[str, Any]:
    """models/granitemoehybrid/modeling_granitemoehybrid.py, its attention and Mamba layers
    (``granite_hybrid_layers``; Granite 4.0 micro: attention only, no experts): Granite's layer
    (GraniteMoeHybridDecoderLayer.forward: residual + out * residual_multiplier, the embedding
    times embedding_multiplier, logits / logits_scaling, attention_multiplier as the softmax
    scale: scalars, no parameter, nothing saved) whose MLP is GraniteMoeHybridMLP, one
    input_linear of 2 x shared_intermediate_size chunked into gate and up, act(gate) * up,
    then output_linear, no biases (memplan's fused_gate_up, as Phi-3's); q/k/v/o biases from
    attention_bias; RoPE only where position_embedding_type is "rope"
    (GraniteMoeHybridModel.rotary_emb, else None: no position encoding).
    GraniteMoeHybridConfig's defaults: vocab 32000, 2048 positions, untied,
    shared_intermediate_size 1024, position_embedding_type None. Its Mamba layers (Granite
    4.0-H) are ``_granite_mamba``'s (memplan.model.mamba); with num_local_experts > 0 (the
    class's default 8; Granite 4.0-H Tiny and Small) every layer's MLP is GraniteMoeHybridMoE
    with the shared MLP after it (``granite_moe``: GraniteMoeHybridDecoderLayer.forward)."""
    if not granite_hybrid_layers(cfg):
        raise cfg.error("layer_types", "only attention and mamba layers are modelled")
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False,
                          defaults={"vocab_size": 32000, "max_position_embeddings": 2048})
    rope = cfg.data.get("position_embedding_type") == "rope"
    fields.update(ffn_hidden_size=cfg.get_int("shared_intermediate_size", 1024),
                  fused_gate_up=True, mlp_bias=False, position="rope" if rope else "none")
    if cfg.data.get("num_local_experts", 8) != 0:
        # GraniteMoeHybridMoE beside the shared MLP (memplan.hf.families_granite)
        fields["moe"] = granite_moe(cfg, 1024)
    mamba = _granite_mamba(cfg, fields["hidden_size"], fields["num_layers"])
    if mamba is not None:
        fields["mamba"] = mamba
    fields.update(granite_residual(cfg))
    return fields


def falcon_h1(cfg: ConfigKeys) -> dict[str, Any]:
    """models/falcon_h1/modeling_falcon_h1.py (memplan.model.falcon_h1): every layer
    (FalconH1DecoderLayer) a Mamba2 mixer and Llama's attention side by side on
    input_layernorm's output, then pre_ff_layernorm and a gated MLP. FalconH1Config.__init__
    sets attention_bias and mlp_bias false whatever the file says; its defaults: vocab
    128000, 8192 positions, untied. The mixer (FalconH1Mixer): d = mamba_d_ssm (default
    1024; null: mamba_expand (2) * h) over mamba_n_heads (128) of mamba_d_head ("auto":
    d / heads), 1 group, state 256, conv 4 with bias, chunks of 256; in_proj's bias
    mamba_proj_bias (false), out_proj's projectors_bias (false); the gated FalconH1RMSNormGated
    over mamba_n_groups groups with mamba_rms_norm (default false; ``MambaSpec.gated_norm``,
    memplan.model.mamba: before or after the gate, mamba_norm_before_gate (default true,
    ``MambaSpec.norm_before_gate``), the same sizes; false: y * silu(gate)). The muP
    multipliers are scalars but mup_vector, a buffer (``MambaSpec.parallel_attention``).
    Its cache follows the mixer's kernel (``memplan.model.layer.kv_cache_bytes``): 5.3's
    FalconH1Model.forward makes none unless given one, 5.23's a DynamicCache with use_cache."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, bias=False,
                          defaults={"vocab_size": 128000, "max_position_embeddings": 8192})
    hidden, num_layers = fields["hidden_size"], fields["num_layers"]
    ssm = cfg.data.get("mamba_d_ssm", 1024)
    inner = cfg.get_int("mamba_expand", 2) * hidden if ssm is None else cfg.get_int("mamba_d_ssm")
    heads = cfg.get_int("mamba_n_heads", 128)
    head = cfg.data.get("mamba_d_head", "auto")
    head_dim = inner // heads if head == "auto" else cfg.get_int("mamba_d_head")
    if heads * head_dim != inner:
        raise cfg.error("mamba_d_head", f"mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) "
                                        f"must be the mixer's width ({inner})")
    fields.update(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                  mamba={"num_heads": heads, "head_dim": head_dim,
                         "state_size": cfg.get_int("mamba_d_state", 256),
                         "num_groups": cfg.get_int("mamba_n_groups", 1),
                         "conv_kernel": cfg.get_int("mamba_d_conv", 4),
                         "chunk_size": cfg.get_int("mamba_chunk_size", 256),
                         "conv_bias": cfg.get_bool("mamba_conv_bias", True),
                         "proj_bias": cfg.get_bool("mamba_proj_bias", False),
                         "out_proj_bias": cfg.get_bool("projectors_bias", False),
                         "gated_norm": cfg.get_bool("mamba_rms_norm", False),
                         "norm_before_gate": cfg.get_bool("mamba_norm_before_gate", True),
                         "parallel_attention": True,
                         "attention_layers": tuple(range(num_layers))})
    return fields


def more_family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a ``MORE_FAMILIES`` config."""
    readers = {"exaone4": exaone4, "seed_oss": seed_oss, "hunyuan_v1_dense": hunyuan_v1_dense,
               "hunyuan_v1_moe": hunyuan_v1_moe, "ernie4_5": ernie4_5, "dots1": dots1,
               "ernie4_5_moe": ernie4_5_moe, "apertus": apertus,
               "granitemoehybrid": granitemoehybrid, "falcon_h1": falcon_h1}
    return readers[model_type](cfg)
