"""Op-level checkpointing of an MoE layer's feed-forward (``memplan.model.sac_ops``): the
items of transformers' grouped experts and of memplan's reference loop (``moe_items``;
``_loop_ops``: each expert's ops once per expert, ``Item.repeat``, then its shared MLP's
once) and the ops of the block a policy counts without keeping them (``moe_policy_ops``).
``sac_ops.moe_refusal`` says which MoE blocks are modelled.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.model.dims import Dims
from memplan.model.sac_ops import (ACTIVATION, CLAMP, COPY, GROUPED_MM, INDEX, MATMUL,
                                   PRODUCT, SCALE, SHIFT, SOFTMAX, Item)
from memplan.model.moe import weights_width
from memplan.spec import ModelSpec, MoESpec
from memplan.units import FP32_BYTES
from memplan.workload import MoeImpl


def moe_items(spec: ModelSpec, dm: Dims, terms: dict[str, int],
              seen: dict[tuple[str, int], int],
              impl: MoeImpl = MoeImpl.GROUPED) -> tuple[Item, ...]:
    """An MoE feed-forward's items as transformers runs it (``sac_ops.moe_refusal``: Mixtral's
    ``MixtralTopKRouter.forward`` and integrations/moe.py ``grouped_mm_experts_forward``), in
    execution order, each op's index counted after ``seen`` (``sac_ops.counts`` of the
    layer's ops before it) and after the block's own ops a policy also counts
    (``moe_policy_ops``): the router's projection
    (saved by no one: kept, it skips its rerun), its fp32 softmax (``moe.router_probs``; a
    top-k softmax router's softmax of the k kept, ``moe.topk_weights``: ``_router_ops``),
    the routed rows sorted by expert (``moe.dispatched``: the block's first gather of width h
    as transformers 5.23 writes it, its second as 5.3 did, ``_dispatch_ops``), the
    experts' grouped gate/up projection (``moe.expert.gate``, ``.up``: one tensor), their
    SiLU and product, and their grouped down projection (``moe.expert_out``, which the
    routing weights' product saves: the rerun reaches it, unlike a dense MLP's). FLOPs per
    token of the layer: each token's k routed rows. ``impl`` loop: memplan's reference loop
    (``_loop_items``)."""
    if impl is MoeImpl.LOOP:
        return _loop_items(spec, dm, terms, seen)
    seen = dict(seen)
    out: list[Item] = []
    for name, op, width, covers, size, flops, own in _moe_ops(spec, dm, terms, impl):
        nth = seen.get((op, width), 0)
        seen[(op, width)] = nth + 1
        if name:
            out.append(Item(name, covers, size, flops, op, width, nth, "mlp", own))
    return tuple(out)


def _moe_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int],
             impl: MoeImpl = MoeImpl.GROUPED
             ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The grouped MoE block's ops a policy counts, in execution order, as (item name or ""
    for an op no item keeps, family, width, terms, bytes, FLOPs per token, own_extra); the
    gathers as ``impl`` (grouped or grouped-token) writes them (``_dispatch_ops``)."""
    moe = spec.moe
    assert moe is not None
    h, e, k = spec.hidden_size, dm.e, moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    rows = dm.tokens * k

    def term(*names: str) -> int:
        return sum(terms[n] for n in names)

    ops = (_router_ops(spec, dm, term) + _dispatch_ops(spec, dm, term, impl)
           + [("", COPY, rows, (), 0, 0.0, False)]  # expert_ids_g.float() (.int() on CUDA)
           + (_clamped_ops(spec, dm, term) if moe.clamped_swiglu else [
               ("moe.expert.gate_up", GROUPED_MM, 2 * f, ("moe.expert.gate", "moe.expert.up"),
                term("moe.expert.gate", "moe.expert.up"), k * 4.0 * h * f, True),
               ("moe.expert.act", ACTIVATION, f, ("moe.expert.act",), term("moe.expert.act"),
                float(k * f), True),
               ("moe.expert.prod", PRODUCT, f, ("moe.expert.prod",), term("moe.expert.prod"),
                float(k * f), False),
               ("moe.expert.down", GROUPED_MM, h, ("moe.expert_out",), term("moe.expert_out"),
                k * 2.0 * h * f, False)])
           + [("", PRODUCT, h, (), 0, 0.0, False),  # down_proj_out * sample_weights_g
              ("", INDEX, h, (), 0, 0.0, False)])  # weighted_out[inv_perm]
    if weights_width(moe, dm) > e:
        # final_hidden_states.to(hidden_states.dtype): the weighted rows fp32 by type
        # promotion; none where the router cast its weights to the block's dtype
        ops.append(("", COPY, h, (), 0, 0.0, False))
    if not moe.num_shared_experts:
        return ops
    shared = _shared_ops(spec, dm, term)
    return ops + shared if moe.shared_experts_last else shared + ops + _gate_ops(spec, dm, term)


def _clamped_ops(spec: ModelSpec, dm: Dims, term: Callable[..., int]
                 ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """GPT-OSS's experts (``MoESpec.clamped_swiglu``, biased where ``ModelSpec.mlp_bias``)
    as integrations/moe.py ``grouped_mm_experts_forward`` runs them (transformers 5.3 and
    5.23 alike), from the gate/up projection to the down projection (``_moe_ops``' tuples):
    ``self.gate_up_proj_bias[expert_ids_g]`` (``aten.index`` of the (E, 2f) bias: width 2f),
    the grouped gate/up projection (``moe.expert.gate_up``; ``_grouped_linear``: ``out +
    bias`` after it, an add no policy counts, whose output is the ``moe.expert.gate_up``
    term: with biases the projection's own output is saved by no one), then GptOssExperts.
    _apply_gate: ``gate.clamp(max=limit)`` (``aten.clamp``, f wide: ``moe.expert.
    gate_clamped``), ``up.clamp(-limit, limit)`` (saved by no one: ``up + 1`` saves
    nothing), ``gate * alpha`` (a number's product, the policy's ``scale``; sigmoid saves
    its own output), ``torch.sigmoid`` (``moe.expert.sigmoid``), ``gate * sigmoid``
    (``moe.expert.glu``), ``up + 1`` (a number's sum, ``shift``: ``moe.expert.
    up_plus_one``), ``(up + 1) * glu`` (``moe.expert.prod``, the down projection's input);
    ``self.down_proj_bias[expert_ids_g]`` (width h) and the grouped down projection
    (``moe.expert.down``; its biased sum is ``moe.expert_out``, which the routing weights'
    product saves). The slices ``gate_up[..., ::2]``, ``[..., 1::2]`` are views. FLOPs per
    token: each token's k rows, 2 a weight of a projection (the bias add reruns with it),
    one an element of the rest (traced: transformers' GPT-OSS, tests/traced/
    test_sac_policy.py)."""
    moe = spec.moe
    assert moe is not None
    h, k, e = spec.hidden_size, moe.top_k, dm.e
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    rows, bias = dm.tokens * k, spec.mlp_bias
    up = ("moe.expert.gate_up", GROUPED_MM, 2 * f, () if bias else ("moe.expert.gate_up",),
          rows * 2 * f * e, k * 4.0 * h * f, True)
    down = ("moe.expert.down", GROUPED_MM, h, () if bias else ("moe.expert_out",),
            rows * h * e, k * 2.0 * h * f, bias)

    def item(name: str, op: str, own: bool = False) -> tuple:
        full = f"moe.expert.{name}"
        return (full, op, f, (full,), term(full), float(k * f), own)

    return ([("", INDEX, 2 * f, (), 0, 0.0, False)] * bias + [
        up, item("gate_clamped", CLAMP), ("", CLAMP, f, (), 0, 0.0, False),
        ("", SCALE, f, (), 0, 0.0, False), item("sigmoid", ACTIVATION, own=True),
        item("glu", PRODUCT), item("up_plus_one", SHIFT), item("prod", PRODUCT)]
        + [("", INDEX, h, (), 0, 0.0, False)] * bias + [down])


def _dispatch_ops(spec: ModelSpec, dm: Dims, term: Callable[..., int], impl: MoeImpl
                  ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The gathers (``aten.index``) that sort the routed rows by expert, before the experts'
    histc copy (``_moe_ops``' tuples; integrations/moe.py ``grouped_mm_experts_forward``).
    As transformers 5.23 writes it (``impl`` grouped): ``torch.sort(expert_ids)`` (no gather:
    it returns the sorted ids), the rows gathered once in that order (``hidden_states[perm //
    num_top_k]``, width h: ``moe.dispatched``) and the routing weights (``sample_weights[
    perm]``, width R). As 5.3 wrote it (grouped-token): the rows gathered by token
    (``hidden_states[token_idx]``, width h), the sorted expert ids and weights (``expert_ids[
    perm]``, ``sample_weights[perm]``, width R each), then the rows' sorted copy
    (``selected_hidden_states[perm]``, the second gather of width h: ``moe.dispatched``). The
    unsort (``weighted_out[inv_perm]``, width h) is in both, after the down projection; the
    sort and its inverse (``argsort``, ``index_put_``) are ops no policy counts. Traced:
    Mixtral's and GLM-4.5's blocks on transformers 5.3 and 5.23, every op the emitted policy
    sees."""
    moe = spec.moe
    assert moe is not None
    h, rows = spec.hidden_size, dm.tokens * moe.top_k
    dispatched = ("moe.dispatched", INDEX, h, ("moe.dispatched",), term("moe.dispatched"),
                  0.0, False)
    if impl is MoeImpl.GROUPED_TOKEN:
        return [("", INDEX, h, (), 0, 0.0, False), ("", INDEX, rows, (), 0, 0.0, False),
                ("", INDEX, rows, (), 0, 0.0, False), dispatched]
    return [dispatched, ("", INDEX, rows, (), 0, 0.0, False)]


def _router_ops(spec: ModelSpec, dm: Dims, term: Callable[..., int]
                ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The router's ops (``_moe_ops``' tuples). Mixtral's (MixtralTopKRouter.forward, Qwen2-
    and Qwen3-MoE's alike): its projection (saved by no one: kept, it skips its rerun),
    ``.float()`` of its logits and their softmax (``moe.router_probs``), and where it casts
    its top-k weights to the logits' dtype (``router_weights_cast``: transformers 5.23's
    Qwen2-/Qwen3-MoE ``TopKRouter.forward``) that copy, of width k. DeepSeek-V3's
    (``sigmoid_router``: DeepseekV3TopkRouter.forward, Glm4MoeTopkRouter.forward, then
    ``route_tokens_to_experts``): ``F.linear`` on fp32 copies of the input and the weight
    (``moe.router_input_fp32``, ``moe.router_weight_fp32``, saved by it; casts of width h,
    no ops in fp32), its fp32 logits (``moe.router``) and their sigmoid
    (``moe.router_probs``); the group-limited top-k after it runs no op a policy counts.
    Granite's, softmaxing its top-k logits alone: ``_topk_softmax_ops``."""
    moe = spec.moe
    assert moe is not None
    h, e, E = spec.hidden_size, dm.e, moe.num_experts
    low = e < FP32_BYTES
    if moe.router_topk_softmax:
        return _topk_softmax_ops(moe, h, dm, term)
    if not sigmoid_router(moe):
        return ([("moe.router", MATMUL, E, (), dm.tokens * E * e, 2.0 * h * E, True)]
                + [("", COPY, E, (), 0, 0.0, False)] * low  # router_logits.float()
                + [("moe.router_probs", SOFTMAX, E, ("moe.router_probs",),
                    term("moe.router_probs"), float(E), False)]
                # router_top_value.to(router_logits.dtype) (``router_weights_cast``)
                + [("", COPY, moe.top_k, (), 0, 0.0, False)] * (low and moe.router_weights_cast))
    casts = [("moe.router_input_fp32", COPY, h, ("moe.router_input_fp32",),
              term("moe.router_input_fp32"), float(h), True),
             ("moe.router_weight_fp32", COPY, h, ("moe.router_weight_fp32",),
              term("moe.router_weight_fp32"), float(E * h) / dm.tokens, True)] if low else []
    return casts + [
        ("moe.router", MATMUL, E, (), dm.tokens * E * FP32_BYTES, 2.0 * h * E, True),
        ("moe.router_probs", ACTIVATION, E, ("moe.router_probs",), term("moe.router_probs"),
         float(E), False)]


def _topk_softmax_ops(moe: MoESpec, h: int, dm: Dims, term: Callable[..., int]
                      ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """A router that softmaxes its top-k logits alone (``MoESpec.router_topk_softmax``),
    as transformers 5.23 writes Granite's (models/granitemoe/modeling_granitemoe.py
    GraniteMoeTopKRouter.forward: ``F.linear(x, w).float()``, ``topk``, ``softmax`` of the
    k kept, ``.type_as(x)``; ``router_logits_fp32``, ``router_weights_cast``), in execution
    order (``_moe_ops``' tuples): its projection (``aten.mm``, E wide in the compute dtype,
    saved by no one: kept, it skips its rerun), below fp32 the logits' cast to fp32 (width
    E; the fp32 logits GraniteMoeMoE.forward holds to its end, saved by no one), ``topk``
    (no op a policy counts; its indices, ``moe.topk_indices``, are saved by its backward),
    the softmax of the k kept (``aten._softmax``, width k: ``moe.topk_weights``, saved by
    itself, fp32 after the cast), and below fp32 its cast to the block's dtype (width k,
    the weights the experts read). One FLOP a softmax element. Kept below fp32, the
    softmax's output adds to the checkpointed block's working set, where ``.type_as`` made
    it a temporary (``memplan.model.moe.grouped_kept_moments``)."""
    E, k, low = moe.num_experts, moe.top_k, dm.e < FP32_BYTES
    # GPT-OSS's GptOssTopKRouter.forward: F.linear(x, weight, bias), one addmm (``matmul``)
    flops = 2.0 * h * E + (2.0 * E if moe.router_bias else 0.0)
    return ([("moe.router", MATMUL, E, (), dm.tokens * E * dm.e, flops, True)]
            + [("", COPY, E, (), 0, 0.0, False)] * (low and moe.router_logits_fp32)
            + [("moe.topk_weights", SOFTMAX, k, ("moe.topk_weights",),
                term("moe.topk_weights"), float(k), False)]
            + [("", COPY, k, (), 0, 0.0, False)] * (low and moe.router_weights_cast))


def sigmoid_router(moe: MoESpec) -> bool:
    """DeepSeek-V3's router: an fp32 linear whose logits' sigmoid chooses the experts by
    group (DeepseekV3TopkRouter, Glm4MoeTopkRouter, Dots1TopkRouter with their blocks'
    ``route_tokens_to_experts``), in transformers the families whose shared experts run last
    (``MoESpec.shared_experts_last``)."""
    return moe.router_fp32 and moe.shared_experts_last


def _shared_ops(spec: ModelSpec, dm: Dims, term: Callable[..., int]
                ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The shared experts' MLP (``_moe_ops``' tuples), as a dense gated MLP runs
    (Qwen2MoeMLP.forward, DeepseekV3MLP.forward: ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))``) over every token, TP-split: its gate, SiLU, up and product
    (``moe.shared.*``), kept beside the routed experts' working set when they ran first;
    its down projection's output is saved by the shared gate's product (``moe.shared_out``:
    the rerun reaches it, an item), else by no one and, running last, never rerun (early
    stop, as a dense MLP's)."""
    moe = spec.moe
    assert moe is not None
    h = spec.hidden_size
    f = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp
    act = ("moe.shared.act", ACTIVATION, f, ("moe.shared.act",), term("moe.shared.act"),
           float(f), True)
    prod = ("moe.shared.prod", PRODUCT, f, ("moe.shared.prod",), term("moe.shared.prod"),
            float(f), True)
    if spec.fused_gate_up:
        # GraniteMoeHybridMLP.forward: input_linear (h -> 2 f), chunk (views), activation
        # of the first half times the second, output_linear
        ops = [("moe.shared.gate_up", MATMUL, 2 * f, ("moe.shared.gate", "moe.shared.up"),
                term("moe.shared.gate", "moe.shared.up"), 4.0 * h * f, True), act, prod]
    else:
        ops = [("moe.shared.gate", MATMUL, f, ("moe.shared.gate",), term("moe.shared.gate"),
                2.0 * h * f, True), act,
               ("moe.shared.up", MATMUL, f, ("moe.shared.up",), term("moe.shared.up"),
                2.0 * h * f, True), prod]
    if moe.shared_expert_gate:
        return ops + [("moe.shared.down", MATMUL, h, ("moe.shared_out",),
                       term("moe.shared_out"), 2.0 * h * f, False)]
    return ops + [("", MATMUL, h, (), 0, 0.0, False)]


def _gate_ops(spec: ModelSpec, dm: Dims, term: Callable[..., int]
              ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The shared experts' gate after the routed experts (Qwen2MoeSparseMoeBlock.forward:
    ``F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output``): its h -> 1
    projection (saved by no one: kept, it skips its rerun), its sigmoid (``moe.shared_gate``)
    and the product, which no item keeps."""
    if not spec.moe or not spec.moe.shared_expert_gate:
        return []
    h = spec.hidden_size
    return [("moe.shared_gate_proj", MATMUL, 1, (), dm.tokens * dm.e, 2.0 * h, False),
            ("moe.shared_gate", ACTIVATION, 1, ("moe.shared_gate",), term("moe.shared_gate"),
             1.0, False),
            ("", PRODUCT, h, (), 0, 0.0, False)]


def moe_policy_ops(spec: ModelSpec, dm: Dims,
                   impl: MoeImpl = MoeImpl.GROUPED) -> list[tuple[str, int]]:
    """The (family, width) of the MoE block's ops no item keeps that a policy counts
    (``_moe_ops``, as ``impl`` writes them; the loop's, each expert's once per expert:
    ``_loop_ops``)."""
    if impl is MoeImpl.LOOP:
        router, expert, shared = _loop_ops(spec, dm, _ZERO)
        return ([(op, width) for name, op, width, *_ in router if not name]
                + [(op, width) for name, op, width, *_ in expert if not name]
                * loop_experts(spec, dm)
                + [(op, width) for name, op, width, *_ in shared if not name])
    return [(op, width) for name, op, width, *_ in _moe_ops(spec, dm, _ZERO, impl)
            if not name]


def loop_experts(spec: ModelSpec, dm: Dims) -> int:
    """How many experts the loop runs on this rank (``MoESpec.num_experts`` over ep)."""
    assert spec.moe is not None
    return spec.moe.num_experts // dm.ep


def _loop_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]
              ) -> tuple[list[tuple[str, str, int, tuple[str, ...], int, float, bool]],
                         list[tuple[str, str, int, tuple[str, ...], int, float, bool]],
                         list[tuple[str, str, int, tuple[str, ...], int, float, bool]]]:
    """memplan's reference loop (``MoeImpl.LOOP``: memplan/profile/reference.py
    ``MoE.forward``) as (the router's ops, one expert's ops, the shared MLP's ops:
    ``_loop_shared_ops``), ``_moe_ops``' tuples. The
    router (``MoE._route``): ``self.router(flat)`` (``aten.mm``, E wide; ``addmm`` with
    ``router_bias``: saved by no one, kept it skips its rerun; an fp32 router's casts
    before it, ``_loop_fp32_casts``), below fp32 ``F.softmax(..., dtype=float32)``'s
    cast of the logits (width E) and the softmax (``moe.router_probs``), ``topk`` and the
    renormalising sum and division (no op a policy counts), below fp32 ``.to(x.dtype)`` of
    the weights (width k), ERNIE's clamp of the sum between them (``router_norm_clamped``:
    ``aten.clamp``, width 1, saved by the division, ``moe.topk_weights``' sums); with
    ``router_topk_softmax`` (GPT-OSS's, Granite's) ``topk`` of
    the logits, below fp32 their ``.float()`` first where ``router_logits_fp32`` (width E),
    the softmax of the k (width k: ``moe.topk_weights``) and, where it ran in fp32, its
    cast back (width k); ``torch.zeros_like``. Then each expert in turn over its rows
    (``torch.where(chosen == e)``: ``nonzero``, no op a policy counts): ``flat[rows]``
    (``aten.index``, width h: ``moe.dispatched``), its MLP (MLP.forward: the gate
    projection, SiLU, the up projection, their product, the down projection:
    ``moe.expert_out``, saved by the weighting; GPT-OSS's clamped expert's:
    ``_loop_clamped_ops``), ``weights[rows, slot, None]`` (``aten.
    index`` of the unsqueezed (T, k, 1) weights: width 1, ``moe.routing_weights``), the
    weighting (``aten.mul``, width h: ``moe.combine_in``, which ``index_add`` saves) and
    ``out.index_add(0, rows, y)`` (none counted). Traced on CPU, bf16 and fp32 (tests/traced/
    test_sac_policy.py). Sizes: each term over all routed rows (T k), the experts' shares
    together (``Item.repeat``); FLOPs per token: each token's k rows."""
    moe = spec.moe
    assert moe is not None
    h, k = spec.hidden_size, moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp

    def item(name: str, op: str, width: int, flops: float, own: bool = False,
             covers: str = "") -> tuple:
        covers = covers or name
        return (name, op, width, (covers,), terms[covers], flops, own)

    router = _loop_router_ops(spec, dm, terms)
    mlp = (_loop_clamped_ops(spec, dm, terms) if moe.clamped_swiglu else [
        item("moe.expert.gate", MATMUL, f, k * 2.0 * h * f, own=True),
        item("moe.expert.act", ACTIVATION, f, float(k * f)),
        item("moe.expert.up", MATMUL, f, k * 2.0 * h * f),
        item("moe.expert.prod", PRODUCT, f, float(k * f)),
        item("moe.expert.down", MATMUL, h, k * 2.0 * h * f, covers="moe.expert_out")])
    expert = [item("moe.dispatched", INDEX, h, 0.0), *mlp,
              item("moe.routing_weights", INDEX, 1, 0.0),
              item("moe.combine_in", PRODUCT, h, float(k * h))]
    return router, expert, _loop_shared_ops(spec, dm, terms)


def _loop_clamped_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]
                      ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """GPT-OSS's clamped expert as the reference loop runs it (``MoESpec.clamped_swiglu``:
    memplan/profile/reference.py ``ClampedExpert.forward``, GptOssExperts.forward's
    per-expert branch and ``_apply_gate``), from its gate/up projection to its down
    projection (``_loop_ops``' expert, ``_moe_ops``' tuples), the items named as the grouped
    path's (``_clamped_ops``): the gate/up projection (``aten.mm``, 2f wide; ``addmm`` with
    ``ModelSpec.mlp_bias``, its output the biased ``moe.expert.gate_up``, which the clamps'
    saved views pin), ``gate.clamp(max=limit)`` (``aten.clamp``, f wide: ``moe.expert.
    gate_clamped``), ``up.clamp(-limit, limit)`` (saved by no one), ``gate * alpha`` (a
    number's product, ``scale``), ``torch.sigmoid`` (``moe.expert.sigmoid``), ``gate *
    sigmoid`` (``moe.expert.glu``), ``up + 1`` (a number's sum, ``shift``: ``moe.expert.
    up_plus_one``), ``(up + 1) * glu`` (``moe.expert.prod``, the down projection's input) and
    the down projection (``addmm`` with a bias: ``moe.expert_out``, which the weighting
    saves). The halves ``gate_up[..., ::2]``, ``[..., 1::2]`` are views. FLOPs per token:
    each token's k rows, 2 a weight or bias of a projection, one an element of the rest
    (traced: tests/traced/test_sac_policy.py)."""
    moe = spec.moe
    assert moe is not None
    h, k = spec.hidden_size, moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    bias = 1.0 if spec.mlp_bias else 0.0

    def item(name: str, op: str, own: bool = False) -> tuple:
        full = f"moe.expert.{name}"
        return (full, op, f, (full,), terms[full], float(k * f), own)

    return [("moe.expert.gate_up", MATMUL, 2 * f, ("moe.expert.gate_up",),
             terms["moe.expert.gate_up"], k * (4.0 * h * f + 4.0 * f * bias), True),
            item("gate_clamped", CLAMP), ("", CLAMP, f, (), 0, 0.0, False),
            ("", SCALE, f, (), 0, 0.0, False), item("sigmoid", ACTIVATION, own=True),
            item("glu", PRODUCT), item("up_plus_one", SHIFT), item("prod", PRODUCT),
            ("moe.expert.down", MATMUL, h, ("moe.expert_out",), terms["moe.expert_out"],
             k * (2.0 * h * f + 2.0 * h * bias), False)]


def _loop_router_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]
                     ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The reference loop's router ops (``_loop_ops``' router, as its docstring lists them:
    memplan/profile/reference.py ``MoE._route``)."""
    moe = spec.moe
    assert moe is not None
    h, e, E, k = spec.hidden_size, dm.e, moe.num_experts, moe.top_k
    low, topk = e < FP32_BYTES, moe.router_topk_softmax
    fp32_logits = moe.router_fp32 or moe.router_logits_fp32

    def item(name: str, width: int) -> tuple:
        return (name, SOFTMAX, width, (name,), terms[name], float(width), False)

    return (_loop_fp32_casts(spec, dm, terms)
            + [("moe.router", MATMUL, E, (),
                dm.tokens * E * (FP32_BYTES if moe.router_fp32 else e),
                2.0 * h * E + (2.0 * E if moe.router_bias else 0.0), True)]
            # the logits' cast to fp32: the softmax's ``dtype`` or ``.float()``
            + [("", COPY, E, (), 0, 0.0, False)] * (
                low and not moe.router_fp32 and (moe.router_logits_fp32 or not topk))
            + [item("moe.topk_weights", k) if topk else item("moe.router_probs", E)]
            # ERNIE's ``torch.clamp`` of the weights' sum (``router_norm_clamped``)
            + [("", CLAMP, 1, (), 0, 0.0, False)] * (moe.router_norm_clamped and not topk)
            # the weights' cast to the block's dtype (a top-k softmax's own dtype: none)
            + [("", COPY, k, (), 0, 0.0, False)] * (low and (fp32_logits or not topk)))


def _loop_fp32_casts(spec: ModelSpec, dm: Dims, terms: dict[str, int]
                     ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """An fp32 router's casts in the reference loop (``MoESpec.router_fp32``: memplan/
    profile/reference.py ``Fp32Linear.forward``, DeepseekV3TopkRouter.forward's ``F.linear(
    hidden_states.type(torch.float32), self.weight.type(torch.float32))``), below fp32: the
    input's (``aten._to_copy``, width h: ``moe.router_input_fp32``), the weight's (width h,
    the (E, h) weight's last dimension: ``moe.router_weight_fp32``; E*h FLOPs over the T
    tokens), both saved by the linear (kept, each adds to the block's working set beyond
    the linear, which frees them), then with a bias its cast (width E, no item). The linear
    then runs in fp32 (its logits T E x 4 B), and the softmax's ``dtype=torch.float32``
    casts nothing. None otherwise (in fp32 the casts return their input)."""
    moe = spec.moe
    assert moe is not None
    h, E = spec.hidden_size, moe.num_experts
    if not moe.router_fp32 or dm.e >= FP32_BYTES:
        return []
    return [("moe.router_input_fp32", COPY, h, ("moe.router_input_fp32",),
             terms["moe.router_input_fp32"], float(h), True),
            ("moe.router_weight_fp32", COPY, h, ("moe.router_weight_fp32",),
             terms["moe.router_weight_fp32"], float(E * h) / dm.tokens, True)] + [
        ("", COPY, E, (), 0, 0.0, False)] * moe.router_bias


def _loop_shared_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int]
                     ) -> list[tuple[str, str, int, tuple[str, ...], int, float, bool]]:
    """The reference loop's shared experts (``_moe_ops``' tuples): one MLP of the experts'
    kind, the shared experts' widths together (memplan/profile/reference.py ``MoE.__init__``:
    ``MLP(spec, num_shared_experts * shared_expert_ffn_hidden_size)``), run after the expert
    loop on all T tokens (``out = out + self.shared(flat)``), TP-split; ``MLP.forward``:
    ``self.down(self._act(self.gate(x)) * self.up(x))``, so its gate projection, SiLU, up
    projection and product (``moe.shared.gate``, ``.act``, ``.up``, ``.prod``, the names
    transformers' shared experts' items have: ``_shared_ops``), then its down projection,
    whose output the sum saves for no one: no item, and running last in the layer never
    rerun (early stop, as a dense MLP's). With a shared-expert gate (``MoESpec.
    shared_expert_gate``: the reference's ``torch.sigmoid(self.shared_gate(flat)) * shared``,
    Qwen2MoeSparseMoeBlock.forward's) the down projection's output is saved by the gate's
    product (``moe.shared.down``: ``moe.shared_out``), then the gate's h -> 1 projection, its
    sigmoid (``moe.shared_gate``) and the product (width h, no item: ``_gate_ops``). Empty
    without shared experts."""
    moe = spec.moe
    assert moe is not None
    if not moe.num_shared_experts:
        return []
    h = spec.hidden_size
    f = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp

    def item(name: str, op: str, width: int, flops: float, own: bool = False) -> tuple:
        return (name, op, width, (name,), terms[name], flops, own)

    ops = [item("moe.shared.gate", MATMUL, f, 2.0 * h * f, own=True),
           item("moe.shared.act", ACTIVATION, f, float(f)),
           item("moe.shared.up", MATMUL, f, 2.0 * h * f),
           item("moe.shared.prod", PRODUCT, f, float(f))]
    if not moe.shared_expert_gate:
        return ops + [("", MATMUL, h, (), 0, 0.0, False)]
    return ops + [("moe.shared.down", MATMUL, h, ("moe.shared_out",), terms["moe.shared_out"],
                   2.0 * h * f, False)] + _gate_ops(
        spec, dm, lambda *names: sum(terms[n] for n in names))


def _loop_items(spec: ModelSpec, dm: Dims, terms: dict[str, int],
                seen: dict[tuple[str, int], int]) -> tuple[Item, ...]:
    """The loop's items (``_loop_ops``), counted after ``seen``: the router's once, each
    expert op's once per expert (``loop_experts``), its first index after ``seen`` and the
    next ``stride`` on, ``stride`` how many ops of its family and width one expert runs;
    the shared MLP's once, after every expert's ops."""
    router, expert, shared = _loop_ops(spec, dm, terms)
    n = loop_experts(spec, dm)
    seen = dict(seen)
    stride: dict[tuple[str, int], int] = {}
    for _, op, width, *_ in expert:
        stride[(op, width)] = stride.get((op, width), 0) + 1
    out: list[Item] = []
    for ops, repeat in ((router, 1), (expert, n), (shared, 1)):
        for name, op, width, covers, size, flops, own in ops:
            nth = seen.get((op, width), 0)
            seen[(op, width)] = nth + 1
            if name:
                out.append(Item(name, covers, size, flops, op, width, nth, "mlp", own,
                                repeat, stride[(op, width)] if repeat > 1 else 0))
        if repeat > 1:  # the other experts' runs of each family and width
            for key, count in stride.items():
                seen[key] += count * (repeat - 1)
    return tuple(out)


class _Zero(dict):
    def __missing__(self, key: str) -> int:
        return 0


_ZERO = _Zero()
