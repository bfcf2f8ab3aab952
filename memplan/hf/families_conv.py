"""Readers of hybrids whose layers mix tokens without attention on some layers: LFM2's gated
short convolutions (models/lfm2/).

Each reads the keys with the defaults of its transformers 5 configuration class
(``configuration_<family>.py``; a key the file leaves out takes the class's default) and
returns the ``ModelSpec`` fields of the model ``AutoModelForCausalLM.from_config`` builds
(transformers 5.3 and 5.25: the same parameters in both).
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields

CONV_FAMILIES = ("lfm2",)
_FULL, _CONV = "full_attention", "conv"


def _lfm2_ffn(cfg: ConfigKeys) -> int:
    """Lfm2MLP.__init__'s width: the config's intermediate_size (the published files'
    block_ff_dim wins, Lfm2Config.__init__; default 12288), with block_auto_adjust_ff_dim
    (default true) int(2 f / 3), then with block_ffn_dim_multiplier (default 1.0) int(m f)
    rounded up to block_multiple_of (default 256)."""
    key = "block_ff_dim" if "block_ff_dim" in cfg.data else "intermediate_size"
    ffn = cfg.get_int(key, 12288)
    if cfg.get_bool("block_auto_adjust_ff_dim", True):
        ffn = int(2 * ffn / 3)
        multiplier = cfg.data.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
                raise cfg.error("block_ffn_dim_multiplier", f"expected a number, got "
                                                            f"{multiplier!r}")
            of = cfg.get_int("block_multiple_of", 256)
            ffn = of * ((int(multiplier * ffn) + of - 1) // of)
    return ffn


def _lfm2_attention_layers(cfg: ConfigKeys, num_layers: int) -> tuple[int, ...]:
    """The full-attention layers: layer_types' "full_attention" entries, else
    full_attn_idxs, else every layer (Lfm2Config.__init__)."""
    types = cfg.data.get("layer_types")
    if types is None:
        idxs = cfg.data.get("full_attn_idxs")
        if idxs is None:
            return tuple(range(num_layers))
        if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                             for i in idxs):
            raise cfg.error("full_attn_idxs", f"expected a list of layer indices, got {idxs!r}")
        return tuple(i for i in range(num_layers) if i in idxs)
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (_FULL, _CONV) for t in types)):
        raise cfg.error("layer_types", f"expected {num_layers} entries of {_FULL!r} or "
                                       f"{_CONV!r}, got {types!r}")
    return tuple(i for i, t in enumerate(types) if t == _FULL)


def lfm2(cfg: ConfigKeys) -> dict[str, Any]:
    """models/lfm2/modeling_lfm2.py: Lfm2DecoderLayer, pre-norm (operator_norm, ffn_norm:
    Lfm2RMSNorm, weight * x.to(input_dtype) as Llama's), its mixer Lfm2Attention on
    full-attention layers (bias-free q/k/v/out_proj, per-head q_layernorm and k_layernorm
    before RoPE) and Lfm2ShortConv on the others (``memplan.model.short_conv``); a SwiGLU MLP
    (w1, w3, w2, bias-free) of ``_lfm2_ffn``; the final norm is Lfm2Model.embedding_norm,
    run after the layers. Lfm2Config's defaults: vocab 65536, 128000 positions, conv_L_cache
    3, conv_bias false; the embedding tied (tie_embedding, else tie_word_embeddings: true)."""
    # (llama_fields requires an intermediate_size; the width is _lfm2_ffn's)
    keys = ConfigKeys({**cfg.data, "intermediate_size": 1}, cfg.where)
    fields = llama_fields(keys, head_dim_default=None, tie_default=True, bias=False,
                          defaults={"vocab_size": 65536, "max_position_embeddings": 128000})
    tie = cfg.get_bool("tie_embedding", cfg.get_bool("tie_word_embeddings", True))
    fields.update(ffn_hidden_size=_lfm2_ffn(cfg), tied_embeddings=tie, qk_norm="head",
                  mlp="swiglu", short_conv={
                      "conv_kernel": cfg.get_int("conv_L_cache", 3),
                      "conv_bias": cfg.get_bool("conv_bias", False),
                      "attention_layers": _lfm2_attention_layers(cfg, fields["num_layers"])})
    return fields


def conv_family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a ``CONV_FAMILIES`` config."""
    return {"lfm2": lfm2}[model_type](cfg)
