"""Forward FLOPs of one token through each layer, read from its blocks: the one source the
step-time model (``memplan.planning.timing``) computes with.

A layer's FLOPs are its blocks' ``flops_per_token`` (2 per parameter the token passes, the
top-k of the routed experts, or all of them where the code runs every expert, and the
attention core's), split into the attention core's
score matmuls (QK^T and PV: their kernel runs at its own rate, and selective recompute reruns
them) and the rest. A sliding-window layer's core attends over its window
(``memplan.model.attention.WindowAttention``). The head's projection: ``head_flops_per_token``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.model import linear
from memplan.model.attention import Attention
from memplan.model.deltanet import DeltaNet
from memplan.model.falcon_h1 import ParallelMamba
from memplan.model.mamba import Mamba
from memplan.model.head import head_linear
from memplan.model.layer import layer_blocks
from memplan.model.mla import Mla
from memplan.model.moe import MoE
from memplan.spec import ModelSpec


class LayerFlops(NamedTuple):
    """Forward FLOPs of one token through one layer."""

    matmul: float  # projections, norms, router: 2 per parameter it passes
    attention: float  # the attention core's two batched matmuls

    @property
    def total(self) -> float:
        return self.matmul + self.attention


@lru_cache(maxsize=256)
def layer_flops(spec: ModelSpec, seq_len: int, every_expert: bool = False
                ) -> tuple[LayerFlops, ...]:
    """``LayerFlops`` of each layer of the model at ``seq_len`` tokens per sequence; layers of
    one kind (MoE or dense, sliding-window or full) computed once. ``every_expert``: the MoE
    layers run every token through every expert (``MoeImpl.EVERY``, ``MoE.flops_per_token``)."""
    kinds: dict[tuple[bool, str], LayerFlops] = {}
    out = []
    for i in range(spec.num_layers):
        variant = ("linear" if spec.is_linear_layer(i)
                   else "window" if spec.is_sliding_layer(i) else "")
        key = (spec.is_moe_layer(i), variant)
        if key not in kinds:
            blocks = layer_blocks(spec, *key)
            total = sum(block.flops_per_token(spec, seq_len, every_expert)
                        if isinstance(block, MoE) else block.flops_per_token(spec, seq_len)
                        for block in blocks)
            core = sum(block.core_flops_per_token(spec, seq_len) for block in blocks
                       if isinstance(block, (Attention, Mla, DeltaNet, Mamba, ParallelMamba)))
            kinds[key] = LayerFlops(total - core, core)
        out.append(kinds[key])
    return tuple(out)


def head_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs of one token through the output projection: 2 per weight of the whole
    vocabulary, tied or not (``HeadBlock.flops_per_token``'s projection term; the final
    norm's 2*h is left out, as the step-time model has always counted the head)."""
    return linear.flops_per_token([head_linear(spec, 1)])
