"""Op-level checkpointing of an MoE layer's feed-forward (``memplan.model.sac_ops``): the
items of transformers' grouped experts (``moe_items``) and the ops of the block a policy
counts without keeping them (``moe_policy_ops``). ``sac_ops.moe_refusal`` says which MoE
blocks are modelled.
"""

from __future__ import annotations

from memplan.model.dims import Dims
from memplan.model.sac_ops import (ACTIVATION, COPY, GROUPED_MM, INDEX, MATMUL, PRODUCT,
                                   SOFTMAX, Item)
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES


def moe_items(spec: ModelSpec, dm: Dims, terms: dict[str, int],
              seen: dict[tuple[str, int], int]) -> tuple[Item, ...]:
    """An MoE feed-forward's items as transformers runs it (``sac_ops.moe_refusal``: Mixtral's
    ``MixtralTopKRouter.forward`` and integrations/moe.py ``grouped_mm_experts_forward``), in
    execution order, each op's index counted after ``seen`` (``sac_ops.counts`` of the
    layer's ops before it) and after the block's own ops a policy also counts
    (``moe_policy_ops``): the router's projection
    (saved by no one: kept, it skips its rerun), its fp32 softmax (``moe.router_probs``),
    the routed rows sorted by expert (the second gather of width h, ``moe.dispatched``), the
    experts' grouped gate/up projection (``moe.expert.gate``, ``.up``: one tensor), their
    SiLU and product, and their grouped down projection (``moe.expert_out``, which the
    routing weights' product saves: the rerun reaches it, unlike a dense MLP's). FLOPs per
    token of the layer: each token's k routed rows."""
    seen = dict(seen)
    out: list[Item] = []
    for name, op, width, covers, size, flops, own in _moe_ops(spec, dm, terms):
        nth = seen.get((op, width), 0)
        seen[(op, width)] = nth + 1
        if name:
            out.append(Item(name, covers, size, flops, op, width, nth, "mlp", own))
    return tuple(out)


def _moe_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]
             ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The grouped MoE block's ops a policy counts, in execution order, as (item name or ""
    for an op no item keeps, family, width, terms, bytes, FLOPs per token, own_extra)."""
    moe = spec.moe
    assert moe is not None
    h, e, E, k = spec.hidden_size, dm.e, moe.num_experts, moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    rows = dm.tokens * k
    low = e < FP32_BYTES

    def term(*names: str) -> int:
        return sum(terms[n] for n in names)

    ops = [("moe.router", MATMUL, E, (), dm.tokens * E * e, 2.0 * h * E, True)]
    if low:  # router_logits.float()
        ops.append(("", COPY, E, (), 0, 0.0, False))
    ops += [("moe.router_probs", SOFTMAX, E, ("moe.router_probs",), term("moe.router_probs"),
             float(E), False),
            ("", INDEX, h, (), 0, 0.0, False),  # hidden_states[token_idx]
            ("", INDEX, rows, (), 0, 0.0, False), ("", INDEX, rows, (), 0, 0.0, False),
            ("moe.dispatched", INDEX, h, ("moe.dispatched",), term("moe.dispatched"), 0.0,
             False),
            ("", COPY, rows, (), 0, 0.0, False),  # expert_ids_g.float() (.int() on CUDA)
            ("moe.expert.gate_up", GROUPED_MM, 2 * f, ("moe.expert.gate", "moe.expert.up"),
             term("moe.expert.gate", "moe.expert.up"), k * 4.0 * h * f, True),
            ("moe.expert.act", ACTIVATION, f, ("moe.expert.act",), term("moe.expert.act"),
             float(k * f), True),
            ("moe.expert.prod", PRODUCT, f, ("moe.expert.prod",), term("moe.expert.prod"),
             float(k * f), False),
            ("moe.expert.down", GROUPED_MM, h, ("moe.expert_out",), term("moe.expert_out"),
             k * 2.0 * h * f, False),
            ("", PRODUCT, h, (), 0, 0.0, False),  # down_proj_out * sample_weights_g
            ("", INDEX, h, (), 0, 0.0, False)]  # weighted_out[inv_perm]
    if low:  # final_hidden_states.to(hidden_states.dtype) (fp32 by type promotion)
        ops.append(("", COPY, h, (), 0, 0.0, False))
    return ops


def moe_policy_ops(spec: ModelSpec, dm: Dims) -> list[tuple[str, int]]:
    """The (family, width) of the MoE block's ops no item keeps that a policy counts
    (``_moe_ops``)."""
    return [(op, width) for name, op, width, *_ in _moe_ops(spec, dm, _ZERO) if not name]


class _Zero(dict):
    def __missing__(self, key: str) -> int:
        return 0


_ZERO = _Zero()
