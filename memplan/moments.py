"""Local peaks inside a layer's forward and backward, measured on the reference block.

The saved-activation terms (``memplan.activations``) say what a finished forward holds. Phase
peaks also need what is alive *while* a block runs: the residual stream when no norm saves it,
an upcast norm's fp32 intermediates, gradients in flight in the backward, a checkpointed layer's
working set. Each moment here was read off traces of the reference model with the exact tracker
(``memplan trace``; ``docs/ground_truth.md``) and is written as bytes of named tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan import eager
from memplan.activations import (
    FP32_BYTES,
    MASK_BYTES,
    Dims,
    Term,
    layer_terms,
    norm_terms,
    total,
)
from memplan.spec import MlpKind, ModelSpec, NormKind, PositionKind
from memplan.workload import Attention, NormImpl, Recompute, Workload


@dataclass(frozen=True)
class BackwardMoment:
    """One moment inside a layer's backward where its bytes peak locally.

    ``alive_bytes``: this layer's saved (or recomputed) tensors still alive; ``transient_bytes``:
    gradients in flight, the residual-stream gradient included; ``grads_before``: parameter
    groups of this layer whose gradients already exist (see ``memory._grad_group_params``).
    """

    name: str
    alive_bytes: int
    transient_bytes: int
    grads_before: tuple[str, ...]
    fresh_params: int = 0  # of those groups: a weight whose gradient was just made, still in
    #                        the compute dtype (an fp32 main gradient is made from it after)


def _by_block(terms: list[Term]) -> dict[str, int]:
    """Saved bytes per block; ``*_norm_bwd`` is what of a norm is still saved when its own
    backward runs (its output and weighted input were freed by the later ops' backward)."""
    blocks = {"attn_norm": 0, "attn": 0, "mlp_norm": 0, "ffn": 0,
              "attn_norm_bwd": 0, "mlp_norm_bwd": 0}
    for term in terms:
        head, _, kind = term.name.partition(".")
        blocks["ffn" if head in ("mlp", "moe") else head] += term.size_bytes
        if head.endswith("_norm") and kind not in ("output", "normed"):
            blocks[f"{head}_bwd"] += term.size_bytes
    return blocks


def layer_backward_moments(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                           recompute: Recompute) -> list[BackwardMoment]:
    """The local peaks of one layer's backward, in backward order (MLP, its norm, attention,
    its norm), as measured on the reference block with the exact tracker:

    - MLP: a gated MLP holds the gradients of its product, activation and up projection while
      the product is freed (2 intermediates beyond the saved ones); GELU the gradients of its
      activation and first linear while the activation is freed (1); ReLU both gradients
      beside its saved output, which its own backward reads (2).
    - norms: upcast RMSNorm's backward materialises five fp32 hidden-sized tensors (four when
      the compute dtype is fp32 and the casts are no-ops); LayerNorm two; a fused
      kernel its input gradient and one more.
    - attention: flash holds the output gradient and the q, k, v gradients; eager, after the
      value matmul's backward freed V, the value gradient and two score-sized gradients.
    Full recompute first rebuilds the whole layer (its checkpointed input stays alive);
    selective recompute rebuilds the attention core at the attention moment.
    """
    t, e, h = dm.tp, dm.e, spec.hidden_size
    rows = dm.tokens // dm.res_tokens_div
    incoming = rows * h * e  # the residual-stream gradient, alive through the layer
    full = _by_block(layer_terms(spec, wl, dm, moe_layer=moe_layer, recompute=Recompute.NONE))
    if recompute is Recompute.SELECTIVE:
        saved = _by_block(layer_terms(spec, wl, dm, moe_layer=moe_layer,
                                      recompute=Recompute.SELECTIVE))
    else:
        saved = full
    # The checkpointed input stays while the layer is rebuilt, unless the rebuilt norm saves
    # that very tensor (a fused norm's input; an fp32 run, where the upcast is a no-op).
    input_is_saved = wl.norm_impl is NormImpl.FUSED or e >= FP32_BYTES
    extra = total(layer_terms(spec, wl, dm, moe_layer=moe_layer, recompute=Recompute.FULL)) \
        if recompute is Recompute.FULL and not input_is_saved else 0
    # gated: product, activation and up gradients while the product is freed; ReLU: its saved
    # output stays for its own backward beside both gradients; GELU: its output is freed
    per_inner = 2 if spec.mlp.gated or spec.mlp is MlpKind.RELU else 1
    if moe_layer and spec.moe is not None:
        # experts run one after another: the largest working set is one expert's, with
        # balanced routing T*k/E tokens
        per_expert = dm.tokens * spec.moe.top_k // spec.moe.num_experts
        mlp = per_inner * per_expert * spec.moe.expert_ffn_hidden_size // t * e
    else:
        mlp = per_inner * dm.tokens * spec.ffn_hidden_size // t * e
    norm = norm_backward_bytes(spec, wl, dm)
    attention = _attention_backward(spec, wl, dm, recompute, saved["attn"])
    freed_ffn = 0
    # With dropout on the block outputs, the block's backward starts from dropout's gradient
    # (a new residual-sized tensor) while the incoming one stays for the skip path, and the
    # MLP's dropout mask is already freed when its MLP runs backward.
    dropout_grad = rows * h * e if spec.dropout > 0 else 0
    if spec.dropout > 0:
        freed_ffn += rows * h * MASK_BYTES
    if moe_layer and spec.moe is not None:
        # the combine's backward ran first: its weighted outputs are freed, and so is the
        # output of the expert whose MLP backward is running (one expert's T*k/E rows)
        routed = dm.tokens * spec.moe.top_k * h * e
        freed_ffn += routed + routed // spec.moe.num_experts
    a_norm, m_norm = saved["attn_norm"], saved["mlp_norm"]
    # The input projections' backward: the last weight gradient is made while the others
    # exist, from its output's gradient, beside the gradients of the projections' (shared)
    # input still to be summed. A plain MLP has one input projection: nothing to sum.
    grad_inputs = 2 * rows * h * e
    mlp_grad_inputs = grad_inputs if spec.mlp.gated or moe_layer else rows * h * e
    if moe_layer and spec.moe is not None:
        proj_out = dm.tokens * spec.moe.top_k // spec.moe.num_experts \
            * spec.moe.expert_ffn_hidden_size // t * e
    else:
        proj_out = dm.tokens * spec.ffn_hidden_size // t * e
    rebuild = []
    if recompute is Recompute.FULL:
        # The rerun stops once the last saved tensor is packed: after the MLP's output
        # dropout (its mask), or its second linear, whose output is alive then (and
        # dropout's), with everything the layer saves and the post-attention residual when
        # no norm saves it.
        out = rows * h * e * (2 if spec.dropout > 0 else 1) + (0 if input_is_saved else incoming)
        rebuild.append(BackwardMoment("rebuild_out", extra + total(layer_terms(
            spec, wl, dm, moe_layer=moe_layer, recompute=Recompute.NONE)), incoming + out, ()))
    if recompute is Recompute.FULL and wl.attention is Attention.EAGER:
        # The layer reruns with autograd recording: its attention core peaks as in a forward
        # without recompute, beside the incoming gradient (the output's dropout mask and the
        # attention output do not exist yet).
        c = eager.core(spec, dm)
        before_out = saved["attn"] - c.q - (rows * h * MASK_BYTES if spec.dropout > 0 else 0)
        rebuild.append(BackwardMoment("rebuild", extra + a_norm + before_out,
                                      incoming + eager.forward_saving(c), ()))
    return [
        *rebuild,
        # the second linear's backward, from dropout's gradient (one intermediate gradient);
        # then the activation's, dropout's gradient freed
        BackwardMoment("mlp", extra + a_norm + saved["attn"] + m_norm + saved["ffn"] - freed_ffn,
                       incoming + dropout_grad + mlp // per_inner, ("mlp_out",),
                       0 if moe_layer else h * spec.ffn_hidden_size // t),
        BackwardMoment("mlp_act", extra + a_norm + saved["attn"] + m_norm + saved["ffn"]
                       - freed_ffn, incoming + mlp, ("mlp_out",)),
        BackwardMoment("mlp_in", extra + a_norm + saved["attn"] + m_norm,
                       incoming + mlp_grad_inputs + proj_out, ("mlp",),
                       0 if moe_layer else h * spec.ffn_hidden_size // t),
        BackwardMoment("mlp_norm", extra + a_norm + saved["attn"] + saved["mlp_norm_bwd"],
                       incoming + norm, ("mlp",)),
        *(BackwardMoment(f"attention.{i}", extra + a_norm + alive, incoming + transient,
                         ("mlp", "mlp_norm", "attn_out"))
          for i, (alive, transient) in enumerate(attention)),
        BackwardMoment("attn_in", extra + a_norm,
                       incoming + grad_inputs + dm.tokens * spec.q_size // t * e,
                       ("mlp", "mlp_norm", "attn"), h * spec.q_size // t),
        BackwardMoment("attn_norm", extra + saved["attn_norm_bwd"], incoming + norm,
                       ("mlp", "mlp_norm", "attn")),
    ]


@dataclass(frozen=True)
class ForwardMoment:
    """A local peak inside a layer's forward: this layer's tensors alive (saved so far, or the
    working set of a checkpointed layer) and transients such as the residual stream."""

    name: str
    alive_bytes: int
    transient_bytes: int


def layer_forward_moments(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                          recompute: Recompute) -> list[ForwardMoment]:
    """Local peaks of one layer's forward, measured on the reference block with the tracker.

    Without recompute the layer's saved tensors accumulate; beside them live the residual
    stream (the layer input, then the post-attention sum) when no norm saves it, an upcast
    norm's fp32 normalised tensor before its cast back, and each block's output before its
    residual add. A fully recomputed (checkpointed) layer saves only its input; its forward
    holds a working set instead: the residual, the norm output, and the block's intermediates
    until the block returns.
    """
    e, h, t = dm.e, spec.hidden_size, dm.tp
    rows = dm.tokens // dm.res_tokens_div
    stream = rows * h * e
    upcast = wl.norm_impl is NormImpl.UPCAST
    lowp = e < FP32_BYTES
    unsaved_input = stream if upcast and lowp else 0  # fp32 runs save the input itself
    fp32_normed = rows * h * FP32_BYTES if upcast and lowp else 0
    if upcast and spec.norm_bias:
        fp32_normed += stream  # weight * normed, before the bias is added
    if recompute is not Recompute.FULL:
        b = _by_block(layer_terms(spec, wl, dm, moe_layer=moe_layer, recompute=recompute))
        # the core runs before the attention output and its dropout mask exist
        before_out = b["attn"] - dm.tokens * spec.q_size // t * e - (
            rows * h * MASK_BYTES if spec.dropout > 0 else 0)
        core, after_core = 0, 0
        if wl.attention is Attention.EAGER:
            c = eager.core(spec, dm)
            saving = recompute is Recompute.NONE
            core = eager.forward_saving(c) if saving else eager.forward_checkpointed(c)
            after_core = eager.output_projection(c, saving)
        relu = []
        if spec.mlp is MlpKind.RELU and not (moe_layer and spec.moe is not None):
            # ReLU saves its output, not its input: the first linear's output lives beside it
            # until the activation returns, before the block's output dropout mask (traced)
            mask = rows * h * MASK_BYTES if spec.dropout > 0 else 0
            relu = [ForwardMoment(
                "mlp_act", b["attn_norm"] + b["attn"] + b["mlp_norm"] + b["ffn"] - mask,
                unsaved_input + dm.tokens * spec.ffn_hidden_size // t * e)]
        return relu + [
            ForwardMoment("attn_norm", b["attn_norm"], unsaved_input + fp32_normed),
            ForwardMoment("attention", b["attn_norm"] + b["attn"],
                          unsaved_input + stream + after_core),
            ForwardMoment("attention_core", b["attn_norm"] + before_out, unsaved_input + core),
            ForwardMoment("mlp_norm", b["attn_norm"] + b["attn"] + b["mlp_norm"],
                          unsaved_input + fp32_normed),
            ForwardMoment("mlp", b["attn_norm"] + b["attn"] + b["mlp_norm"] + b["ffn"],
                          unsaved_input + stream),
        ]
    norm_ws = _norm_working_set(spec, wl, dm)
    q_bytes = dm.tokens * spec.q_size // t * e
    kv_bytes = 2 * dm.tokens * spec.kv_size // t * e
    if wl.attention is Attention.FLASH:
        attn_ws = q_bytes + kv_bytes + q_bytes + dm.b * (spec.num_attention_heads // t) * dm.s * 4
    else:
        # the layer's q, k, v, then the core's working set, or its output, the copy of it
        # and the output projection's output (the stream counted below)
        c = eager.core(spec, dm)
        attn_ws = q_bytes + kv_bytes + max(eager.forward_checkpointed(c) - stream, 2 * c.q)
    if moe_layer and spec.moe is not None:
        # experts run one after another over their T*k/E rows (balanced routing), while the
        # router's probabilities and the combined output accumulate for all tokens
        moe = spec.moe
        rows_e = dm.tokens * moe.top_k // moe.num_experts
        inner = rows_e * moe.expert_ffn_hidden_size // t * e
        expert = rows_e * h * e + max(rows_e * h * e + inner,
                                      (3 if spec.mlp.gated else 2) * inner)
        mlp_ws = dm.tokens * moe.num_experts * FP32_BYTES + stream + expert
    else:
        inner = dm.tokens * spec.ffn_hidden_size // t * e
        # gated: activation, up and product together; plain: first linear and activation
        mlp_ws = max(stream + inner, (3 if spec.mlp.gated else 2) * inner)
    rope = []
    if spec.position is PositionKind.ROPE:
        # q, k and v stay alive while RoPE makes the rotated copies (the call rebinds both
        # only when k's is done); at k's, q's rotated copy and three k-sized tensors (k * cos,
        # the rotated half, its product with sin); at q's, three q-sized ones (traced)
        k_bytes = dm.tokens * spec.kv_size // t * e
        rope_ws = max(4 * q_bytes + kv_bytes, 2 * q_bytes + 4 * k_bytes + kv_bytes - k_bytes)
        rope = [ForwardMoment("rope", 2 * stream + rope_ws, 0)]
    # x is the checkpointed input; the norm output lives while its block runs
    return rope + [
        ForwardMoment("attn_norm", stream + norm_ws, 0),
        ForwardMoment("attention", 3 * stream + attn_ws, 0),
        ForwardMoment("mlp_norm", 2 * stream + norm_ws, 0),
        ForwardMoment("mlp", 3 * stream + mlp_ws, 0),
    ]


def _norm_working_set(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes a norm's forward holds beyond its input: fp32 copies, the cast, its output."""
    rows = dm.tokens // dm.res_tokens_div
    h, e = spec.hidden_size, dm.e
    stats = rows * FP32_BYTES * (2 if spec.norm is NormKind.LAYERNORM else 1)
    if wl.norm_impl is NormImpl.FUSED:
        return rows * h * e + stats
    lowp = e < FP32_BYTES
    fp32_copies = (2 if lowp else 1) * rows * h * FP32_BYTES  # upcast input, normalised
    return fp32_copies + (2 if lowp else 1) * rows * h * e + stats


def head_forward_moment(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The final norm's transients (the unsaved residual input and the fp32 normalised
    tensor before its cast back), on top of everything saved up to and including it."""
    if wl.norm_impl is NormImpl.FUSED:
        return 0
    rows = dm.tokens // dm.res_tokens_div
    bias_temp = dm.e if spec.norm_bias else 0  # weight * normed, before the bias is added
    if dm.e >= FP32_BYTES:  # the casts are no-ops: the input and normed tensor are saved
        return rows * spec.hidden_size * bias_temp
    return rows * spec.hidden_size * (dm.e + FP32_BYTES + bias_temp)


def final_norm_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[int, int]:
    """Saved bytes of the final norm (part of the head's terms): all of them, and those still
    saved when its own backward runs."""
    blocks = _by_block(norm_terms("attn_norm", spec, wl, dm))
    return blocks["attn_norm"], blocks["attn_norm_bwd"]


def final_norm_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Gradient bytes in flight inside the final norm's backward (``norm_backward_bytes``).
    The reference fused RMSNorm is an autograd Function whose backward holds its incoming
    gradient to the end, with its per-row statistics: the rstd cast to the compute dtype, the
    fp32 row dot products and the fp32 weight gradient before its cast (traced; in a layer
    the layer's moments count that gradient)."""
    inside = norm_backward_bytes(spec, wl, dm)
    if wl.norm_impl is not NormImpl.FUSED or spec.norm is not NormKind.RMSNORM:
        return inside
    rows = dm.tokens // dm.res_tokens_div
    h, e = spec.hidden_size, dm.e
    rstd_cast = rows * e if e < FP32_BYTES else 0
    return inside + rows * h * e + rstd_cast + rows * FP32_BYTES + h * FP32_BYTES


def norm_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Gradient bytes in flight inside a norm's backward, its incoming gradient excluded."""
    rows = dm.tokens // dm.res_tokens_div
    h, e = spec.hidden_size, dm.e
    if wl.norm_impl is NormImpl.FUSED:
        # LayerNorm's aten kernel: its input gradient. The reference fused RMSNorm: the
        # weighted gradient, the normalised input and one product.
        return (3 if spec.norm is NormKind.RMSNORM else 1) * rows * h * e
    if spec.norm is NormKind.LAYERNORM:
        # the gradient entering the aten kernel (the weighted one; in low precision its fp32
        # copy, the weighted one freed by then) and the input gradient it returns
        return 2 * rows * h * FP32_BYTES
    # Five fp32 hidden-sized tensors at the peak (traced): in low precision the cast back's
    # fp32 gradient copy and four from the RMSNorm math; in fp32, where the casts are no-ops,
    # the weighted gradient itself and the same four
    return 5 * rows * h * FP32_BYTES


def _attention_backward(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                        saved_attn: int) -> list[tuple[int, int]]:
    """(attention's saved bytes alive, gradient bytes in flight) at its backward's peaks."""
    t, e = dm.tp, dm.e
    q_bytes = dm.tokens * spec.q_size // t * e
    resid_mask = dm.tokens // dm.res_tokens_div * spec.hidden_size * MASK_BYTES \
        if spec.dropout > 0 else 0
    if wl.attention is Attention.EAGER:
        # the output projection's backward has freed its input, the core's output copy
        c = eager.core(spec, dm)
        saved_attn -= resid_mask  # the block's output dropout ran its backward first
        return [(saved_attn - c.q + alive, transient) for alive, transient
                in eager.backward(c, rebuild=recompute is Recompute.SELECTIVE)]
    transient = dm.tokens * (2 * spec.q_size + 2 * spec.kv_size) // t * e
    rebuilt = 0
    if recompute is Recompute.SELECTIVE:  # the core reruns: its output and logsumexp
        rebuilt = q_bytes + dm.b * (spec.num_attention_heads // t) * dm.s * FP32_BYTES
    return [(saved_attn + rebuilt, transient)]
