"""Granite's MoE block as transformers 5.23 writes it, for traces on a transformers that still
runs 5.3's GraniteMoeParallelExperts (``moe_impl`` parallel).

transformers 5.23 (models/granitemoe/modeling_granitemoe.py) rewrote GraniteMoeMoE as a router,
GraniteMoeTopKRouter.forward (``F.linear(x, w).float()``, ``topk`` of the fp32 logits, their
softmax, ``.type_as(x)``; memplan's ``MoESpec.router_logits_fp32``, ``router_topk_softmax``,
``router_weights_cast``), and stacked experts run by the experts interface
(``use_experts_implementation``: grouped_mm by default); GraniteMoeMoE.forward binds
``_, top_k_weights, top_k_index = self.router(hidden_states)`` and hands the rows, indices and
weights to the experts (``memplan.model.moe._grouped_locals``). ``install`` puts this block in
place of 5.3's in the installed module: the router as 5.23 writes it, the experts the
installed ``grouped_mm_experts_forward`` (5.3's gathers by token: memplan's ``moe_impl``
grouped-token, which ``memplan.profile.frameworks._grouped_gather`` picks). The weights have
5.3's shapes: the router (E, h), the experts' gate/up (E, 2f, h) and down (E, h, f), as
MixtralExperts holds them; their names here are this module's own. ``install_hybrid`` puts the
same block in place of Granite 4.0-H's GraniteMoeHybridMoE, whose code is GraniteMoeMoE's
(models/granitemoehybrid/modular_granitemoehybrid.py: ``GraniteMoeHybridMoE(
GraniteMoeSharedMoE)``; transformers 5.3's generated modeling file the same forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GraniteMoeTopKRouter(nn.Module):
    """The top-k of the fp32 logits, softmaxed over the k kept, cast to the input's dtype."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.initializer_range)

    def forward(self, hidden_states: torch.Tensor):
        logits = F.linear(hidden_states, self.weight).float()
        top_k_logits, top_k_index = logits.topk(self.top_k, dim=-1)
        top_k_weights = torch.softmax(top_k_logits, dim=-1).type_as(hidden_states)
        return logits, top_k_weights, top_k_index


class GraniteMoeExperts(nn.Module):
    """Stacked gated experts run by the installed ``grouped_mm_experts_forward`` (integrations/
    moe.py), with its default gate (``act_fn(gate) * up`` of the chunked gate/up output)."""

    def __init__(self, config) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.num_experts = config.num_local_experts
        h, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, h, f))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=config.initializer_range)
        self.act_fn = ACT2FN[config.hidden_act]
        self.has_gate, self.has_bias, self.is_transposed = True, False, False

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import _default_apply_gate

        return _default_apply_gate(self, gate_up)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


class GraniteMoeMoE(nn.Module):
    """GraniteMoeMoE.forward as 5.23 writes it: the router, then the experts over the rows."""

    def __init__(self, config) -> None:
        super().__init__()
        self.router = GraniteMoeTopKRouter(config)
        self.experts = GraniteMoeExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        _, top_k_weights, top_k_index = self.router(hidden_states)
        hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
        return hidden_states.view(batch, seq, hidden)


def runs_parallel_experts() -> bool:
    """Whether the installed transformers runs Granite's MoE through 5.3's
    GraniteMoeParallelExperts (where ``install`` is needed)."""
    from transformers.models.granitemoe import modeling_granitemoe as m

    return hasattr(m, "GraniteMoeParallelExperts")


def install(monkeypatch) -> None:
    """5.23's block in place of the installed 5.3 GraniteMoeMoE, for one test."""
    from transformers.models.granitemoe import modeling_granitemoe as m

    monkeypatch.setattr(m, "GraniteMoeMoE", GraniteMoeMoE)


def runs_hybrid_parallel_experts() -> bool:
    """Whether the installed transformers runs GraniteMoeHybrid's MoE through 5.3's
    GraniteMoeHybridParallelExperts (where ``install_hybrid`` is needed)."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as m

    return hasattr(m, "GraniteMoeHybridParallelExperts")


def install_hybrid(monkeypatch) -> None:
    """5.23's block in place of the installed 5.3 GraniteMoeHybridMoE (Granite 4.0-H's: 5.3's
    GraniteMoeHybridDecoderLayer.forward calls ``self.block_sparse_moe(hidden_states)`` for
    one tensor, then adds ``self.shared_mlp(hidden_states)``), for one test."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as m

    monkeypatch.setattr(m, "GraniteMoeHybridMoE", GraniteMoeMoE)
