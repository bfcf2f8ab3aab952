"""Readers of IBM Granite's MoE families: Granite 3.x MoE (``granitemoe``), its variant with a
shared MLP (``granitemoeshared``) and the routed experts of Granite 4.0-H (``granitemoehybrid``
with num_local_experts > 0; without them ``memplan.hf.families_more.granitemoehybrid``).

Each reads the keys with the defaults of its transformers 5 configuration class
(``transformers/models/<family>/configuration_<family>.py``) and returns the ``ModelSpec``
fields of the model ``AutoModelForCausalLM.from_config`` builds (``modeling_<family>.py``).
The three share one MoE block, GraniteMoeMoE (the same code under each family's prefix). As
transformers 5.23 writes it: a bias-free router, GraniteMoeTopKRouter (``weight`` (E, h):
the top-k of its fp32 logits softmaxed in fp32 and cast to the input's dtype:
``MoESpec.router_logits_fp32``, ``router_topk_softmax``, ``router_weights_cast``), and
GraniteMoeExperts (``gate_up_proj`` (E, 2f, h), ``down_proj`` (E, h, f)) run by the experts
interface (the hf preset's moe_impl grouped). As transformers 5.3 wrote it: the router
GraniteMoeTopKGating (``layer``: h -> E) and two GraniteMoeParallelExperts, ``input_linear``
(E, 2f, h) and ``output_linear`` (E, h, f), each run as one F.linear per expert over its split
of the sorted rows (``MoESpec.parallel_experts``, moe_impl parallel). The same tensors, the
same counts. Granite's four multipliers are scalars (``memplan.hf.families.granite``):
nothing saved, no parameter.
"""

from __future__ import annotations

from typing import Any

from memplan.hf.config import ConfigKeys, llama_fields

GRANITE_MOE_FAMILIES = ("granitemoe", "granitemoeshared")
# GraniteMoeConfig / GraniteMoeSharedConfig / GraniteMoeHybridConfig.__init__: vocab 32000,
# 2048 positions, untied
_DEFAULTS = {"vocab_size": 32000, "max_position_embeddings": 2048}


def granite_moe(cfg: ConfigKeys, shared_default: int | None) -> dict[str, Any]:
    """The ``moe`` fields of GraniteMoeMoE on every layer: num_local_experts (default 8) of
    intermediate_size, num_experts_per_tok (default 2) routed a token, and the shared MLP
    (GraniteMoeSharedMLP / GraniteMoeHybridMLP: input_linear h -> 2 x shared_intermediate_size
    chunked into gate and up, output_linear back; no biases) when shared_intermediate_size
    is not 0 (``shared_default``: the class's default; None: the family has none), run after
    the experts and added to their output (``shared_experts_last``:
    GraniteMoeSharedDecoderLayer.forward: moe_hidden_states + self.shared_mlp(hidden_states)).
    The router's logits feed the load-balancing loss only with output_router_logits (default
    false, as the published files set it): not read."""
    moe: dict[str, Any] = {
        "num_experts": cfg.get_int("num_local_experts", 8),
        "top_k": cfg.get_int("num_experts_per_tok", 2),
        "expert_ffn_hidden_size": cfg.get_int("intermediate_size", 11008),
        "stacked_experts": True, "parallel_experts": True,
        # GraniteMoeTopKRouter.forward (transformers 5.23): the top-k of the fp32 logits,
        # softmaxed in fp32, cast to the input's dtype
        "router_topk_softmax": True, "router_logits_fp32": True, "router_weights_cast": True,
    }
    value = cfg.data.get("shared_intermediate_size", shared_default)
    if shared_default is not None and value:
        shared = cfg.get_int("shared_intermediate_size", shared_default)
        moe.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared,
                   shared_experts_last=True)
    return moe


def granite_residual(cfg: ConfigKeys) -> dict[str, Any]:
    """``ModelSpec.scaled_residual`` where the config's residual_multiplier is not 1 (the
    Granite configs' default is 1.0)."""
    return {"scaled_residual": True} if cfg.get_float("residual_multiplier", 1.0) != 1.0 else {}


def granitemoe(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """models/granitemoe/modeling_granitemoe.py (GraniteMoeDecoderLayer) and
    models/granitemoeshared/modeling_granitemoeshared.py: Granite's attention (q/k/v/o biases
    from attention_bias, RoPE) and pre-norm layer with GraniteMoeMoE (``granite_moe``) in
    place of the MLP; granitemoeshared adds the shared MLP (shared_intermediate_size, default
    0: none). The expert width is intermediate_size (default 11008)."""
    fields = llama_fields(cfg, head_dim_default=None, tie_default=False, defaults=_DEFAULTS)
    shared = 0 if model_type == "granitemoeshared" else None
    fields.update(fused_gate_up=True, mlp_bias=False, moe=granite_moe(cfg, shared),
                  **granite_residual(cfg))
    return fields


def granite_family_fields(cfg: ConfigKeys, model_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a ``GRANITE_MOE_FAMILIES`` config."""
    return granitemoe(cfg, model_type)
