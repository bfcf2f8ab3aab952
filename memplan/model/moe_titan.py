"""torchtitan's own mixture-of-experts block (``MoeImpl.TITAN``; torchtitan 0.3.0,
models/common/moe.py and models/common/token_dispatcher.py), with expert parallelism off (the
local token dispatcher). Routing is taken as balanced: the rank's experts see R = T*k rows.
Read by ``memplan.model.moe.MoE``.

What runs (``MoE.forward``): ``TokenChoiceTopKRouter.forward``, its gate under
``torch.autocast(dtype=torch.float32)`` (on CUDA: the linear on fp32 copies of its input and
weight, fp32 logits), the softmax (or sigmoid) in fp32, the top-k of the scores (plus the
load-balancing ``expert_bias_E``, no gradient), ``scores.gather`` of the chosen experts,
with ``route_norm`` divided by their sum (+1e-20) and scaled by ``route_scale``; a bool routing
map (``zeros_like(...).scatter_``) summed to the per-expert counts; ``RoutedExperts.forward``
-> ``LocalTokenDispatcher.dispatch`` (``_local_reorder``: a stable argsort of the expert ids,
the scores gathered in that order, the token indices ``// top_k``, ``x_TD[idx]``) ->
``GroupedExperts.forward`` (``torch._grouped_mm`` over bf16 casts for w1 and w3, silu times
the product, w2, ``.type_as(x)``; the int32 offsets saved by each grouped matmul) ->
``LocalTokenDispatcher.combine`` (an fp32 copy of the experts' output times the sorted
scores, cast back, ``deterministic_scatter_add`` into ``zeros_like(x)``, which saves the
expanded token index); shared experts (``FeedForward``: w2(silu(w1(x)) * w3(x))) after the
routed ones, their output added.

What it saves, per MoE layer (traced: tests/traced/test_frameworks.py, the qwen3 MoE toy):
the gate's fp32 input and weight copies (below fp32), the fp32 scores (softmax's or sigmoid's
output), the chosen experts' ids (gather's index), with ``route_norm`` the gathered scores and
their sum (the division's operands; the renormalised weights are ``route_norm``'s whatever
``route_scale``), the argsort (the sorted scores' index) and the token index (``x_TD[idx]``'s
and the scatter's), the gathered rows, the experts' gate, activation, up and product (all
bf16: the grouped matmuls and silu), the offsets, the experts' output in fp32 and the sorted
scores (their product's operands); the shared experts' MLP terms. The ffn norm's output is
saved by no one when the router reads an fp32 copy and no shared expert reads it
(``memplan.model.norm.moe_output_unread``).

Under torchtitan's per-op SAC (``sac_terms``) the block keeps the router's topk outputs and
every odd counted matmul's (the attention's and a shared expert's); the gate and the grouped
matmuls rerun with the rest (traced: the same toys under SelectiveAC, saved activations and
forward peaks exact).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.errors import LayoutError
from memplan.model import mlp, sac
from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term
from memplan.presets import titan_moe_refusal
from memplan.spec import ModelSpec, MoESpec
from memplan.units import DType
from memplan.workload import MoeImpl, Workload

# GroupedExperts.forward casts its input and weights with ``.bfloat16()`` whatever the model's
# dtype: the grouped matmuls, silu and the product run in bf16
EXPERT_BYTES = DType.BF16.itemsize
# the grouped matmuls' ``offs``: torch.cumsum(..., dtype=torch.int32), one per local expert
OFFSET_BYTES = 4


def _moe(spec: ModelSpec) -> MoESpec:
    assert spec.moe is not None, "an MoE block needs spec.moe"
    return spec.moe


def check(spec: ModelSpec) -> None:
    """Refuse, with a ``LayoutError`` naming the field, what torchtitan's MoE block cannot run
    of the spec's (``memplan.presets.titan_moe_refusal``, which the preset and the layout
    checks read without this module)."""
    why = titan_moe_refusal(spec)
    if why is not None:
        raise LayoutError("moe_impl titan runs torchtitan's MoE block", why)


@lru_cache(maxsize=256)
def titan_spec(spec: ModelSpec) -> ModelSpec:
    """The spec as torchtitan's block runs it (``MoE.forward``): an fp32 gate (its autocast
    region), stacked experts, shared experts after the routed ones, the top-k weights left
    in fp32 (no cast, no top-k softmax, the logits held by no one)."""
    moe = _moe(spec).model_copy(update={
        "router_fp32": True, "router_weight_fp32": False, "router_weights_cast": False,
        "router_topk_softmax": False, "router_logits_fp32": False,
        "router_logits_held": False, "router_norm_clamped": False, "stacked_experts": True,
        "shared_experts_last": bool(_moe(spec).num_shared_experts)})
    return spec.model_copy(update={"moe": moe})


def _route_norm(spec: ModelSpec) -> bool:
    """Whether the router renormalises its top-k scores (``route_norm``; memplan's MoESpec has
    no such field): on, as torchtitan 0.3.0's qwen3 MoE, gpt_oss, deepseek_v3 671B and
    kimi_k2 flavors set it (models/*/__init__.py); deepseek_v3's 16B and smaller leave it off,
    which saves T (k + 1) x 4 B less per layer than counted here."""
    return True


def _casts(dm: Dims) -> int:
    """How many bf16 copies of the gathered rows the grouped matmuls save: one where the
    rows are bf16 already (``x_RD.bfloat16()`` returns the tensor itself), two where they are
    not (fp32 weights, with or without autocast: w1's and w3's ``x_RD.bfloat16()`` are two
    calls, two copies)."""
    return 2 if dm.e >= FP32_BYTES or dm.autocast else 1


def _weight_casts(spec: ModelSpec, dm: Dims) -> int:
    """The bf16 copies of w1, w3 and w2 the grouped matmuls save where the weights are not
    bf16 (fp32 weights: ``w1_EFD.bfloat16()``, a new tensor each): 3 x (E / ep) f h x 2 B
    over the rank's experts, f split by the experts' TP; 0 with bf16 weights (FSDP2's
    MixedPrecisionPolicy gathers them in bf16: the casts return them)."""
    moe = _moe(spec)
    if _casts(dm) == 1:
        return 0
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    return 3 * moe.num_experts // dm.ep * f * spec.hidden_size * EXPERT_BYTES


def unit_tensor_sizes(spec: ModelSpec, t: int, ep: int, etp: int) -> list[int]:
    """Elements of the block's parameter tensors on one rank, in the order ``MoE.__init__``
    registers them (and FSDP2 unshards them): the routed experts' ``w1_EFD``, ``w2_EDF``,
    ``w3_EFD`` (``GroupedExperts.__init__``: E / ``ep`` experts, f split by the experts'
    TP ``etp``), the router's gate (E x h), the shared experts' w1, w2, w3 (``FeedForward``,
    f split by ``t``). memplan's own order (``memplan.model.moe.moe_linears``) puts the
    router first."""
    moe, h = _moe(spec), spec.hidden_size
    routed = moe.num_experts // ep * (moe.expert_ffn_hidden_size // etp) * h
    shared = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // t * h
    return [routed] * 3 + [moe.num_experts * h] + ([shared] * 3 if shared else [])


def weight_grad_cast_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Where the experts' weights are not bf16 (``_weight_casts``), a grouped matmul's weight
    gradient is made in bf16 (the gradient of ``w1_EFD.bfloat16()``, E / ep x f x h x 2 B)
    and ``ToCopyBackward`` makes its copy in the weight's dtype beside it: one of them alive
    at each weight gradient's moment beside the gradients in the weights' dtype. 0 with bf16
    weights (the cast returns the weight itself)."""
    return _weight_casts(spec, dm) // 3


def titan_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """torchtitan's MoE block's saved terms for one micro-batch on one rank (module
    docstring), R = T k routed rows, experts in bf16 (``EXPERT_BYTES``)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    routed = dm.tokens * moe.top_k
    ex = dm.experts()._replace(e=EXPERT_BYTES)
    terms = []
    if e < FP32_BYTES:  # F.linear on CUDA autocast's fp32 casts of the input and the weight
        terms += [Term("moe.router_input_fp32", dm.tokens * h * FP32_BYTES),
                  Term("moe.router_weight_fp32", moe.num_experts * h * FP32_BYTES)]
    norm = routed * FP32_BYTES + dm.tokens * FP32_BYTES if _route_norm(spec) else 0
    terms += [Term("moe.router_probs", dm.tokens * moe.num_experts * FP32_BYTES),
              Term("moe.topk_indices", routed * INDEX_BYTES),
              Term("moe.topk_weights", norm),
              Term("moe.sort_index", routed * INDEX_BYTES),
              Term("moe.token_index", routed * INDEX_BYTES),
              Term("moe.dispatched", routed * h * EXPERT_BYTES * _casts(dm)),
              Term("moe.expert_weights_bf16", _weight_casts(spec, dm)),
              *mlp.mlp_terms("moe.expert", spec, ex, moe.expert_ffn_hidden_size, routed),
              Term("moe.offsets", moe.num_experts // dm.ep * OFFSET_BYTES),
              Term("moe.expert_out", routed * h * FP32_BYTES),
              Term("moe.routing_weights", routed * FP32_BYTES)]
    if moe.num_shared_experts:
        ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
        terms += mlp.mlp_terms("moe.shared", spec, dm, ffn, dm.tokens)
    return terms



def sac_matmuls(spec: ModelSpec, fused_qkv: bool, tp: int = 1) -> list[sac.MatMul]:
    """The matmuls torchtitan's per-op SAC counts in a block with this MoE (``SelectiveAC.
    _wrap_block``'s ``mm_count_key``), in execution order: the attention's
    (``sac.matmuls``), then the shared experts' w1, w3 and w2 (``FeedForward``, after the
    routed experts). Not counted: the router's gate (``force_recompute_mm_shapes_by_fqns``
    defaults to ``moe.router.gate``: its (h, E) mm always reruns), and so any mm of that
    shape (the policy matches shapes: a projection whose rank-local weight, at ``tp``, is
    (h, E) reruns uncounted too), and the routed experts' ``torch._grouped_mm`` (not an mm
    op, not in ``_get_default_save_ops``: rerun)."""
    moe, h = _moe(spec), spec.hidden_size
    attn = [m for m in sac.matmuls(spec, fused_qkv) if m[0].startswith("attn.")]
    ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
    shared = [("moe.shared.w1", h, ffn, True), ("moe.shared.w3", h, ffn, True),
              ("moe.shared.w2", ffn, h, False)] if ffn else []
    gate = (h, moe.num_experts)
    return [m for m in attn + shared
            if ((m[1], m[2] // tp) if m[3] else (m[1] // tp, m[2])) != gate]


def sac_terms(spec: ModelSpec, dm: Dims, fused_qkv: bool) -> list[Term]:
    """What a block with this MoE keeps under torchtitan's per-op SAC beyond its input: the
    odd counted matmuls' outputs and the attention kernel's (``sac.sac_terms`` over
    ``sac_matmuls``), and the router's ``topk`` outputs (``aten.topk`` is in the save list:
    T k fp32 scores and T k int64 expert ids, whatever the model's dtype: the scores are
    the router's fp32 softmax). Everything else of the block reruns in backward."""
    routed = dm.tokens * _moe(spec).top_k
    return [*sac.sac_terms(spec, dm, fused_qkv, sac_matmuls(spec, fused_qkv, dm.tp)),
            Term("sac.moe.topk_scores", routed * FP32_BYTES),
            Term("sac.moe.topk_indices", routed * INDEX_BYTES)]


def _bound_bytes(spec: ModelSpec, dm: Dims) -> int:
    """What ``MoE.forward`` binds to its end beside the saved terms: the norm's output where
    no one saves it (``memplan.model.norm.moe_output_unread``; the block's argument), the
    bool routing map (T E x 1 B) and the per-expert counts (E int64), the scaled top-k scores
    (``topk_scores_BLK * route_scale``, T k fp32, a new tensor the dispatch reads)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    unread = dm.rows * h * e if e < FP32_BYTES and not moe.num_shared_experts else 0
    return (unread + dm.tokens * moe.num_experts + moe.num_experts * INDEX_BYTES
            + dm.tokens * moe.top_k * FP32_BYTES)


def combine_extra(spec: ModelSpec, dm: Dims) -> int:
    """Beside the saved terms at ``LocalTokenDispatcher.combine``'s largest moment (but the
    shared experts', which run after it: ``MoE.forward``; counted there, the fp32 toy's
    forward was 196,608 B over, their four T f x 4 B terms): the bound
    tensors (``_bound_bytes``), the experts' output (``.type_as(x)``, R h e, bound in
    ``RoutedExperts.forward``; in fp32 it is the saved fp32 copy itself), the gathered rows
    where they are not bf16 (``routed_input_RD``, R h e, bound there too; their bf16 casts are
    what is saved), ``zeros_like(x)`` (T h e, combine's first tensor) and the larger of: the
    fp32 product with the scores and its cast back (R h x 4, and R h e below fp32), or the
    cast (in fp32 the product itself) and the scatter's output (R h e + T h e). Traced:
    torchtitan's Qwen3
    MoE toy, bf16 and fp32 (the scatter the fp32 forward's peak)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    routed = dm.tokens * moe.top_k
    out = routed * h * e if e < FP32_BYTES else 0
    rows = routed * h * e if _casts(dm) == 2 else 0
    cast = routed * h * e
    zeros = dm.rows * h * e  # combine's first statement: out_TD = torch.zeros_like(x_TD)
    return _bound_bytes(spec, dm) + out + rows + zeros + max(
        routed * h * FP32_BYTES + (cast if e < FP32_BYTES else 0), cast + dm.rows * h * e)


def combine_backward(spec: ModelSpec, dm: Dims) -> list[tuple[str, int, int]]:
    """The combine's backward, the block's first (traced), as (moment, bytes beside the saved
    terms, of those terms what a recomputed block has freed by then): the scatter's
    (``torch.gather`` of the output's gradient, R h e), the cast's (its fp32 copy, R h x 4,
    the gather freed), the product's (both factors' gradients, R h x 4 each), then the
    scores' gradient summed over h (R x 4): the engine's ``at::sum_to`` to their (R, 1)
    shape (torch/csrc/autograd/engine.cpp ``validate_outputs``) after ``MulBackward0::
    apply`` has returned. With the block recomputed (full AC, per-op SAC) the product's
    fp32 operand (R h x 4) is held by that function's locals alone and freed before the sum
    (torch/utils/checkpoint.py ``_checkpoint_hook.unpack_hook`` hands each recomputed tensor
    over once, keeping none; ``BackwardMoment.rerun_freed``), so there the product's second
    gradient is the peak (traced: torchtitan's Qwen3 MoE toy with a shared expert under full
    AC and per-op SAC, bf16 and fp32: 1,024 B over before)."""
    routed, h = dm.tokens * _moe(spec).top_k, spec.hidden_size
    product = 3 * routed * h * FP32_BYTES
    return [("moe_unsort", product, 0),
            ("moe_unsort_sum", product + routed * FP32_BYTES, routed * h * FP32_BYTES)]


def shared_input_freed(spec: ModelSpec, dm: Dims) -> int:
    """The block's input (the ffn norm's output, T h e) freed with the shared experts' saved
    terms when their backward, the block's first (they ran last), is done: below fp32 their
    w1 and w3 were its last holders (the router's gate saves its own fp32 copy, the routed
    experts ``x_TD[idx]``'s index alone); in fp32 the gate saves the input itself, kept.
    Traced: torchtitan's Qwen3 MoE toy with a shared expert, bf16, freed at w3's input
    gradient before the combine's backward (32,768 B); 0 without shared experts."""
    if not _moe(spec).num_shared_experts or dm.e >= FP32_BYTES:
        return 0
    return dm.linear_rows * spec.hidden_size * dm.e


def buffer_bytes(spec: ModelSpec, wl: Workload, layers: list[int]) -> int:
    """The buffers torchtitan's block registers (``MoE.__init__``), device memory in every
    phase: ``tokens_per_expert_E`` (E fp32, non-persistent) and, with its default
    ``load_balance_coeff`` (1e-3), ``expert_bias_E`` (E fp32), on each of the stage's MoE
    ``layers``, every expert's whatever ep (their counts are global)."""
    if spec.moe is None or wl.moe_impl is not MoeImpl.TITAN:
        return 0
    moe_layers = sum(1 for i in layers if spec.is_moe_layer(i))
    return moe_layers * 2 * spec.moe.num_experts * FP32_BYTES


def working_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The block in a checkpointed forward (nothing saved), at its largest moment beyond the
    layer's own tensors: the routing's tensors (the fp32 scores, the expert ids, the scaled
    top-k scores, the sorted scores and the token index, the routing map, counts and
    offsets), the gathered rows (R h e, in the block's dtype) and the
    experts' output (R h e), with the larger of: the grouped matmuls' (at w3's: a bf16 cast
    of the rows where they are not bf16, the activation and the up projection's output, R f
    x 2 B each), the combine's zeros (T h e) with its fp32 copy of the output and their product with the
    scores (R h x 4 each; in fp32 the product alone) or with the scatter's (the cast back,
    R h e, and the output, T h e). Traced: torchtitan's Qwen3 MoE toy under full
    recompute, bf16 and fp32 (the scatter the forward's peak)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    routed, f = dm.tokens * moe.top_k, moe.expert_ffn_hidden_size // dm.experts().tp
    routing = (dm.tokens * moe.num_experts * (FP32_BYTES + 1)
               + dm.tokens * moe.top_k * (INDEX_BYTES + FP32_BYTES)
               + routed * (FP32_BYTES + INDEX_BYTES)
               + moe.num_experts * INDEX_BYTES + moe.num_experts // dm.ep * OFFSET_BYTES)
    rows = routed * h * e
    cast = routed * h * EXPERT_BYTES if _casts(dm) == 2 else 0
    # where the weights are not bf16, the grouped matmul's weight cast (E / ep x f x h x 2 B,
    # saved by no one here: freed after its matmul)
    experts = cast + 2 * routed * f * EXPERT_BYTES + weight_grad_cast_bytes(spec, dm)
    product = routed * h * FP32_BYTES * (2 if e < FP32_BYTES else 1)
    scatter = routed * h * e + dm.rows * h * e
    zeros = dm.rows * h * e  # combine's first statement: out_TD = torch.zeros_like(x_TD)
    # the offsets, a local of GroupedExperts.forward that no checkpointed matmul keeps, are
    # gone by the combine
    offsets = moe.num_experts // dm.ep * OFFSET_BYTES
    return routing + rows + max(experts, rows + zeros + max(product, scatter) - offsets)
