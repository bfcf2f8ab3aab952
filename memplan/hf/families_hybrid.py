"""Translator of Qwen3-Next's ``config.json`` (models/qwen3_next/, transformers 5.3): gated
DeltaNet linear-attention layers with a gated full-attention layer every
``full_attention_interval``-th, each followed by an MoE with a gated shared expert.

It reads the keys with the defaults of Qwen3NextConfig.__init__ (configuration_qwen3_next.py)
and returns the ``ModelSpec`` fields of the model ``AutoModelForCausalLM.from_config`` builds.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields
from memplan.hf.families_moe import partial_rotary, rotary_dim

LINEAR, FULL = "linear_attention", "full_attention"
# configuration_qwen3_next.py Qwen3NextConfig.__init__ defaults
_QWEN3_NEXT = {"vocab_size": 151936, "max_position_embeddings": 32768}
QWEN3_NEXT_EXPERTS = 512


def _interval(cfg: ConfigKeys, num_layers: int) -> int:
    """``full_attention_interval`` (default 4): Qwen3NextConfig's layer_types, when not given,
    is linear but on every n-th layer ((i + 1) % n == 0: full). A ``layer_types`` given must
    be that pattern for some n; any other order is refused."""
    interval = cfg.get_int("full_attention_interval", 4)
    types = cfg.data.get("layer_types")
    if types is None:
        return interval
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (LINEAR, FULL) for t in types)):
        raise cfg.error("layer_types", f"expected {num_layers} entries of {LINEAR!r} or "
                                       f"{FULL!r}, got {types!r}")
    full = [i for i, t in enumerate(types) if t == FULL]
    interval = full[0] + 1 if full else num_layers + 1
    if types != [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]:
        raise cfg.error("layer_types", "only a full-attention layer every n-th (the others "
                                       f"linear) is modelled, got {types!r}")
    return interval


def _linear_attention(cfg: ConfigKeys, num_layers: int) -> dict[str, int]:
    """Qwen3NextGatedDeltaNet's widths (Qwen3NextConfig.__init__ defaults: conv 4, key and
    value head dims 128, 16 key heads, 32 value heads)."""
    return {
        "num_key_heads": cfg.get_int("linear_num_key_heads", 16),
        "num_value_heads": cfg.get_int("linear_num_value_heads", 32),
        "key_head_dim": cfg.get_int("linear_key_head_dim", 128),
        "value_head_dim": cfg.get_int("linear_value_head_dim", 128),
        "conv_kernel": cfg.get_int("linear_conv_kernel_dim", 4),
        "full_attention_interval": _interval(cfg, num_layers),
    }


def qwen3_next(cfg: ConfigKeys, sparse: tuple[int, int], experts: int) -> dict[str, Any]:
    """models/qwen3_next/modeling_qwen3_next.py: Qwen3NextDecoderLayer, pre-norm, its mixer
    Qwen3NextGatedDeltaNet on linear_attention layers and Qwen3NextAttention on the others:
    q_proj of 2 * heads * head_dim (the output gate), per-head q/k norms, RoPE on the first
    partial_rotary_factor (0.25) of each head, attention_bias on q, k, v and o (default
    false). Its norms are Qwen3NextRMSNorm, zero-centred: the weight is stored as an offset
    from 1 and scales the fp32 normalised tensor, (x * (1 + w.float())).type_as(x), as
    Gemma's. The feed-forward is Qwen3NextSparseMoeBlock on every layer but mlp_only_layers
    and those off decoder_sparse_step: stacked experts (Qwen3NextExperts) of
    moe_intermediate_size, a bias-free router (Qwen3NextTopKRouter), one shared expert of
    shared_expert_intermediate_size behind a sigmoid gate (shared_expert_gate: h -> 1).
    Defaults (Qwen3NextConfig.__init__): head_dim 256, 512 experts, top-10, 512 wide.
    ``sparse``: (layer_freq, first dense layers) of decoder_sparse_step and mlp_only_layers,
    and ``experts`` num_experts, read as Qwen2-MoE's (``memplan.hf.families``)."""
    fields = llama_fields(cfg, head_dim_default=256, tie_default=False, bias=True,
                          defaults=_QWEN3_NEXT)
    num_layers = fields["num_layers"]
    freq, first_dense = sparse
    moe = {
        "num_experts": experts,
        "top_k": cfg.get_int("num_experts_per_tok", 10),
        "expert_ffn_hidden_size": cfg.get_int("moe_intermediate_size", 512),
        "layer_freq": freq, "first_dense_layers": first_dense, "stacked_experts": True,
        "num_shared_experts": 1, "shared_expert_gate": True,
        "shared_expert_ffn_hidden_size": cfg.get_int("shared_expert_intermediate_size", 512),
        "router_weights_cast": True,  # as Qwen2-MoE's router in transformers 5.23
    }
    fields.update(qk_norm="head", norm_scale_fp32=True, attn_output_gate=True, moe=moe,
                  linear_attention=_linear_attention(cfg, num_layers),
                  **rotary_dim(fields["head_dim"], partial_rotary(cfg, 0.25)))
    return fields
