"""Granite's mixture-of-experts block as transformers runs it (``MoeImpl.PARALLEL``,
``MoESpec.parallel_experts``; models/granitemoe/modeling_granitemoe.py, transformers 5.3, the
same code under granitemoeshared's and granitemoehybrid's prefixes): GraniteMoeTopKGating,
GraniteMoeParallelExperts and GraniteMoeMoE.forward. Routing is taken as balanced: the rank's
experts see T*k rows. Read by ``memplan.model.moe.MoE``.

Why its own mechanism: the reference loop (``loop``) saves the same rows but the router's
(every expert's fp32 probability and the renormalised weights' sum where Granite saves the
fp32 softmax of the k logits and the sort permutation) and runs one expert at a time; the
grouped experts (``grouped``) save the unsort index and fp32 routing weights and make no
per-expert weight slices. Granite's forward concatenates each projection's per-expert
outputs, and its backward sums a weight-sized select_backward per expert (``select_grads``).
"""

from __future__ import annotations

from memplan.model import mlp
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term, total
from memplan.spec import ModelSpec, MoESpec


def _moe(spec: ModelSpec) -> MoESpec:
    assert spec.moe is not None, "an MoE block needs spec.moe"
    return spec.moe


def parallel_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """Granite's MoE as its own code runs it (``MoeImpl.PARALLEL``; models/granitemoe/
    modeling_granitemoe.py): GraniteMoeTopKGating.forward's top-k of the fp32 logits (topk
    saves its indices), their softmax in fp32 (saved by softmax), the gates gathered in
    expert order (the index saves the sort permutation); GraniteMoeMoE.forward's rows
    gathered by token (the index saves batch_index, which index_add saves too), the
    gathered rows (saved by each expert's F.linear over its split of them), the gate/up
    output (silu and the product save views of it), the activation and the product (the
    down projection's input), the experts' output and the gates (their product saves both)
    and the weighted rows (index_add's source); the shared MLP over the T tokens."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    routed = dm.tokens * moe.top_k
    terms = [Term("moe.topk_indices", routed * INDEX_BYTES),
             Term("moe.topk_weights", routed * FP32_BYTES),
             Term("moe.sort_index", routed * INDEX_BYTES),
             Term("moe.token_index", routed * INDEX_BYTES),
             Term("moe.dispatched", routed * h * e),
             *mlp.mlp_terms("moe.expert", spec, dm.experts(), moe.expert_ffn_hidden_size,
                           routed),
             Term("moe.expert_out", routed * h * e),
             Term("moe.routing_weights", routed * e),
             Term("moe.combine_in", routed * h * e)]
    if moe.num_shared_experts:
        ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
        terms += mlp.mlp_terms("moe.shared", spec, dm, ffn, dm.tokens)
    return terms


def select_grads(spec: ModelSpec, dm: Dims) -> tuple[int, int]:
    """What GraniteMoeParallelExperts' weight gradients hold beyond the gradient itself while
    they are made (input_linear's, output_linear's): each expert's F.linear takes its weight
    through ``self.weight[i]``, whose backward (select_backward) makes a zero tensor of the
    whole (E, out, in) weight with that expert's slice filled; the engine sums them into the
    weight's input buffer out of place (the buffer, the new one and their sum alive), so with
    two or more experts on the rank two weight-sized tensors beside the one that becomes the
    gradient (traced: transformers' GraniteMoeMoE, fp32 and bf16). In the weights' compute
    dtype (autocast is refused with MoE layers: memplan.parallel.validate). None for frozen
    experts (adapters on them). Not modelled: a micro-batch accumulating into gradients that
    already exist holds the buffer beside them too, one weight more (traced standalone)."""
    moe, h, ex = _moe(spec), spec.hidden_size, dm.experts()
    local = moe.num_experts // dm.ep
    if local < 2 or dm.adapters is not None:
        return 0, 0
    weight = local * moe.expert_ffn_hidden_size // ex.tp * h * dm.e
    return 2 * 2 * weight, 2 * weight


def forward_moments(spec: ModelSpec, dm: Dims, saved: int) -> list[Moment]:
    """Granite's MoE forward (GraniteMoeMoE.forward) beside its saved terms: at each
    GraniteMoeParallelExperts' torch.cat the experts' outputs with the concatenation (gate/up:
    R 2f, made after the routing and the gathered rows; down: R h, the gate/up output, the
    activation and the product made); at the combine index_add's zeros and its output (T h
    each) beside everything the routed experts saved; with a shared MLP (run after the
    experts) its output and the sum beside the experts' output (T h each)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = dm.tokens * moe.top_k
    inner = rows * moe.expert_ffn_hidden_size // dm.experts().tp * e
    routing = rows * (3 * INDEX_BYTES + FP32_BYTES)
    gate_up = routing + rows * h * e + 2 * inner
    stream = dm.rows * h * e
    shared = saved - total(parallel_terms(spec, dm)) if moe.num_shared_experts else 0
    routed = saved - shared
    return [Moment("moe_gate_up", gate_up, 2 * inner),
            Moment("moe_down", gate_up + 2 * inner + rows * h * e, rows * h * e),
            Moment("moe_combine", routed, 2 * stream),
            Moment("mlp", saved, 3 * stream if moe.num_shared_experts else stream)]


def working_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Granite's MoE in a checkpointed forward (nothing saved), its locals alive to its
    return (GraniteMoeMoE.forward: expert_inputs, chunked_hidden_states, hidden_states): the
    token index and the gates, the gathered rows (R h) with, at the gate/up concatenation,
    the experts' outputs and the concatenation (R 2f each); at the down concatenation the
    gate/up output, the product, the experts' outputs and their concatenation (R h each); at
    the combine, the weighted rows, zeros and the output (T h each). A shared MLP after it:
    its gate/up output, activation and product beside the experts' output, then the sum."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = dm.tokens * moe.top_k
    f = rows * moe.expert_ffn_hidden_size // dm.experts().tp
    stream = dm.rows * h * e
    routed = rows * (INDEX_BYTES + e) + rows * h * e + max(
        4 * f * e, 3 * f * e + 2 * rows * h * e, 3 * f * e + rows * h * e + 2 * stream)
    if not moe.num_shared_experts:
        return routed
    fs = dm.tokens * moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp * e
    return max(routed, stream + 4 * fs, stream + 3 * fs + stream, 3 * stream)


def backward_moments(spec: ModelSpec, dm: Dims, saved: int,
                     shared: int = 0) -> list[BackwardMoment]:
    """Granite's MoE backward (``MoeImpl.PARALLEL``): index_add's backward gathers the rows'
    gradient and frees the weighted rows, the weighting's frees the experts' output and the
    gates; then one MLP backward over all routed rows (each expert's F.linear backward in
    turn, their input gradients concatenated by the split's backward), its down and input
    projections' moments with their weights' select_backward sums (``select_grads``). A
    shared MLP ran last, so its backward ran first (``memplan.model.moe.
    _shared_last_backward``): its saved terms (``shared``) are freed and its input's gradient
    (T h) waits to be summed with the experts' (traced: granitemoeshared, 2 x 256 tokens
    under full recompute: the shared MLP's product backward the step's peak)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    routed = dm.tokens * moe.top_k * h * e
    # the weighted rows, the experts' output and the gates (R h, R h, R e)
    combined = 2 * routed + dm.tokens * moe.top_k * e
    moments = mlp.backward_moments(
        spec, dm.experts(), saved=saved,
        freed=mlp.dropout_mask_bytes(spec, dm) + combined + shared,
        run_tokens=dm.tokens * moe.top_k, ffn=moe.expert_ffn_hidden_size,
        grad_inputs=(3 if moe.num_shared_experts else 2) * dm.rows * h * e, fresh=0,
        out_grad=routed, fused_in=True,
        in_saved=routed)
    extra = dict(zip(("mlp_in", "mlp"), select_grads(spec, dm)))
    return [m._replace(transient_bytes=m.transient_bytes + extra.get(m.name, 0))
            for m in moments]
