"""Saved-activation bytes per micro-batch, as a sum of named saved-tensor terms.

Each term is one tensor (or one group of identical tensors) that autograd keeps from the forward
pass for the backward pass, so every term can be matched to a real trace and fitted by
calibration. Terms are for one micro-batch on one rank. Notation (``reference/formulas.md``):
T = mbs * seq / cp local tokens; h hidden; a, g query and KV heads; d head dim; f FFN width;
V vocab; t TP degree; e bytes per element of the compute dtype. Tensors in the residual stream
are split by t only with sequence parallelism (Megatron-LM keeps the sequence-parallel shard of
the inputs to column-parallel linears and all-gathers it again in backward); tensors inside the
attention and MLP blocks are split by t always.

What each block saves (Llama and GPT blocks in PyTorch; Korthikanti et al. 2022, arXiv
2205.05198, section 4.1 for the GPT terms):

- norm, ``upcast`` (Hugging Face style): the fp32 copy of its input (saved by pow and mul),
  per-token statistics (fp32 rstd; mean and rstd for LayerNorm), the normalised tensor in the
  compute dtype (saved by the weight multiply), and its output (saved by the next linear). ``fused``: its input, the statistics, and its output.
- attention: q after RoPE, k and v at the KV width (GQA/MQA), the attention output (saved by the
  output projection). flash: a fp32 logsumexp per query and head. eager: the softmax output
  (a*s^2 elements per sequence; the s-squared term) and, with dropout, its mask and output.
- MLP: gated (SwiGLU/GeGLU): gate out, activation out, up out and their product; else the first
  linear's output and the activation's output.
- dropout after attention and MLP: a 1-byte mask per residual element.
- MoE (the reference's loop over experts): router probabilities (fp32), top-k indices and
  renormalised weights, each expert's gathered rows and their index, the MLP terms over its
  tokens, its output, the routing weights, and the weighted output the combine keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.parallel import ParallelConfig, TpStyle
from memplan.spec import ModelSpec, NormKind, PositionKind
from memplan.units import DType
from memplan.workload import Attention, NormImpl, Recompute, Workload

FP32_BYTES = DType.FP32.itemsize
INDEX_BYTES = DType.INT64.itemsize  # token ids and targets are int64 (torch.long)
MASK_BYTES = 1  # torch's native_dropout returns a bool mask, one byte per element


@dataclass(frozen=True)
class Term:
    """One saved tensor (or group) for one micro-batch on one rank."""

    name: str
    size_bytes: int


@dataclass(frozen=True)
class Dims:
    """Per-rank sizes of one micro-batch, derived once from spec, layout and workload."""

    b: int  # micro-batch size
    s: int  # local sequence length (seq / cp)
    s_kv: int  # keys each query attends to (the full sequence)
    tokens: int  # b * s
    res_tokens_div: int  # divisor of residual-stream tensors (tp with SP, else 1)
    tp: int
    e: int  # bytes per element of the compute dtype
    vocab_div: int = 1  # divisor of the vocabulary (tp when vocab-parallel)
    gathered_linear_input: bool = False  # SP with DTensor: linears save full-sequence inputs

    @classmethod
    def of(cls, par: ParallelConfig, wl: Workload) -> Dims:
        s = wl.seq_len // par.cp
        return cls(b=wl.micro_batch_size, s=s, s_kv=wl.seq_len, tokens=wl.micro_batch_size * s,
                   res_tokens_div=par.sp_divisor, tp=par.tp, e=wl.compute_dtype.itemsize,
                   vocab_div=par.vocab_divisor,
                   gathered_linear_input=(par.sequence_parallel and par.tp > 1
                                          and par.tp_style is TpStyle.DTENSOR))


def norm_terms(prefix: str, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """A norm in the residual stream, its output included (saved by the following linear)."""
    rows = dm.tokens // dm.res_tokens_div
    h = spec.hidden_size
    stats = rows * FP32_BYTES * (2 if spec.norm is NormKind.LAYERNORM else 1)
    # the output is saved by the next (column-parallel) linear: as its sequence shard, or
    # all-gathered to the full sequence (DTensor sequence parallelism)
    out_rows = dm.tokens if dm.gathered_linear_input else rows
    out = [Term(f"{prefix}.output", out_rows * h * dm.e), Term(f"{prefix}.stats", stats)]
    if wl.norm_impl is NormImpl.FUSED:
        return [Term(f"{prefix}.input", rows * h * dm.e), *out]
    # normalise in fp32, cast back, then weight * normed saves the normed tensor
    return [Term(f"{prefix}.input_fp32", rows * h * FP32_BYTES), *out,
            Term(f"{prefix}.normed", rows * h * dm.e)]


def attention_terms(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
    """Attention block terms, without its input norm."""
    t, e = dm.tp, dm.e
    heads = spec.num_attention_heads // t
    # Eager attention repeats K and V to every query head before its matmuls, which save the
    # repeated copies; SDPA's fused kernels take grouped K and V as they are.
    kv_width = spec.q_size
    if wl.attention is Attention.FLASH or recompute is Recompute.SELECTIVE:
        kv_width = spec.kv_size  # as they enter SDPA / the checkpointed core
    terms = [
        Term("attn.q", dm.tokens * spec.q_size // t * e),
        Term("attn.k", dm.tokens * kv_width // t * e),
        Term("attn.v", dm.tokens * kv_width // t * e),
        Term("attn.out", dm.tokens * spec.q_size // t * e),
    ]
    # Selective recompute reruns the attention core, so nothing it saves internally is kept.
    if recompute is Recompute.NONE:
        if wl.attention is Attention.FLASH:
            terms.append(Term("attn.lse", dm.b * heads * dm.s * FP32_BYTES))
        else:
            scores = dm.b * heads * dm.s * dm.s_kv
            terms.append(Term("attn.softmax", scores * e))
            if spec.dropout > 0:
                terms.append(Term("attn.softmax_dropout_mask", scores * MASK_BYTES))
                terms.append(Term("attn.softmax_dropout_out", scores * e))
    if spec.dropout > 0:
        terms.append(Term("attn.dropout_mask", dm.tokens // dm.res_tokens_div
                          * spec.hidden_size * MASK_BYTES))
    return terms


def mlp_terms(prefix: str, spec: ModelSpec, dm: Dims, ffn: int, tokens: int) -> list[Term]:
    """A dense MLP of width ``ffn`` over ``tokens`` tokens, TP-split."""
    inner = tokens * ffn // dm.tp * dm.e
    if spec.mlp.gated:
        names = ("gate", "act", "up", "prod")
    else:
        names = ("fc1", "act")
    return [Term(f"{prefix}.{n}", inner) for n in names]


def moe_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """An MoE feed-forward, assuming balanced routing: each rank's experts see T*k tokens."""
    moe = spec.moe
    assert moe is not None
    routed = dm.tokens * moe.top_k
    h, e = spec.hidden_size, dm.e
    terms = [
        Term("moe.router_probs", dm.tokens * moe.num_experts * FP32_BYTES),
        Term("moe.topk_indices", routed * INDEX_BYTES),
        # the renormalisation of the top-k weights saves them and their per-token sum (fp32)
        Term("moe.topk_weights", routed * FP32_BYTES + dm.tokens * FP32_BYTES),
        Term("moe.token_index", routed * INDEX_BYTES),  # which rows each expert gathers
        Term("moe.dispatched", routed * h * e),
        *mlp_terms("moe.expert", spec, dm, moe.expert_ffn_hidden_size, routed),
        Term("moe.expert_out", routed * h * e),
        Term("moe.routing_weights", routed * e),
        Term("moe.combine_in", routed * h * e),  # the weighted outputs, saved by index_add
    ]
    if moe.num_shared_experts:
        ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
        terms += mlp_terms("moe.shared", spec, dm, ffn, dm.tokens)
    return terms


def layer_terms(spec: ModelSpec, wl: Workload, dm: Dims, *, moe_layer: bool,
                recompute: Recompute) -> list[Term]:
    """Saved terms of one transformer layer under ``recompute`` (FULL keeps only its input)."""
    if recompute is Recompute.FULL:
        rows = dm.tokens // dm.res_tokens_div
        return [Term("layer.input", rows * spec.hidden_size * dm.e)]
    terms = norm_terms("attn_norm", spec, wl, dm)
    terms += attention_terms(spec, wl, dm, recompute)
    terms += norm_terms("mlp_norm", spec, wl, dm)
    if moe_layer:
        terms += moe_terms(spec, dm)
    else:
        terms += mlp_terms("mlp", spec, dm, spec.ffn_hidden_size, dm.tokens)
    if spec.dropout > 0:
        terms.append(Term("mlp.dropout_mask",
                          dm.tokens // dm.res_tokens_div * spec.hidden_size * MASK_BYTES))
    return terms


def embedding_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """First pipeline stage: token ids (saved by the embedding), position ids for learned
    positions (one row shared by the batch) and the dropout mask."""
    terms = [Term("embedding.ids", dm.tokens * INDEX_BYTES)]
    if spec.position is PositionKind.LEARNED:
        terms.append(Term("embedding.position_ids", dm.s * INDEX_BYTES))
    if spec.dropout > 0:
        terms.append(Term("embedding.dropout_mask",
                          dm.tokens // dm.res_tokens_div * spec.hidden_size * MASK_BYTES))
    return terms


def rope_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """cos and sin tables, computed once per micro-batch per stage and saved by every layer."""
    if spec.position is not PositionKind.ROPE:
        return []
    return [Term("rope.cos_sin", 2 * dm.s * spec.head_dim * dm.e)]


def head_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """Last pipeline stage: final norm, log-softmax output of the vocab-parallel loss, targets."""
    logit_bytes = FP32_BYTES if wl.logits_fp32 else dm.e
    return [
        *norm_terms("final_norm", spec, wl, dm),
        Term("loss.log_softmax", dm.tokens * _vocab_shard(spec, dm) * logit_bytes),
        *batch_terms(dm),
    ]


def batch_terms(dm: Dims) -> list[Term]:
    """The targets (saved by the loss) and the loss with nll_loss's saved total weight (two
    fp32 scalars): the training loop holds them until the step's backward has finished."""
    return [Term("loss.targets", dm.tokens * INDEX_BYTES), Term("loss.scalars", 2 * FP32_BYTES)]


def head_forward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes alive at the loss beyond what is saved: the logits the log-softmax reads.

    With fp32 logits the compute-dtype logits are freed once upcast, and the fp32 copy lives
    until the loss returns, next to the log-softmax output.
    """
    return dm.tokens * _vocab_shard(spec, dm) * (FP32_BYTES if wl.logits_fp32 else dm.e)


def mask_terms(wl: Workload, dm: Dims) -> list[Term]:
    """Eager attention's causal mask is an input of every checkpointed region, so with any
    recompute it is saved until the backward (once per micro-batch, shared by the layers)."""
    if wl.attention is Attention.EAGER and wl.recompute is not Recompute.NONE:
        return [Term("attn.causal_mask", eager_mask_bytes(wl, dm))]
    return []


def head_linear_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """At the output projection's backward: the logits' gradient in the compute dtype (after
    the fp32 upcast's backward) and the gradient of its input, beyond what is saved."""
    grad_logits = dm.tokens * _vocab_shard(spec, dm) * dm.e
    grad_input = dm.tokens // dm.res_tokens_div * spec.hidden_size * dm.e
    upcast_grad = dm.tokens * _vocab_shard(spec, dm) * FP32_BYTES if wl.logits_fp32 else 0
    return grad_logits + grad_input + upcast_grad - head_forward_extra_bytes(spec, wl, dm)


def eager_mask_bytes(wl: Workload, dm: Dims) -> int:
    """Eager attention's additive causal mask, built once per forward and freed after it."""
    return dm.s * dm.s_kv * dm.e if wl.attention is Attention.EAGER else 0


def head_backward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes alive in the loss's backward beyond what is saved: the incoming gradient of the
    log-softmax output and the gradient it produces, both logits-sized."""
    return 2 * head_forward_extra_bytes(spec, wl, dm)


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
      the product is freed (2 intermediates beyond the saved ones); a plain MLP the gradients
      of its activation and first linear while the activation is freed (1).
    - norms: upcast RMSNorm's backward materialises five fp32 hidden-sized tensors (four when
      the compute dtype is fp32 and the casts are no-ops); LayerNorm three (two); a fused
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
    per_inner = 2 if spec.mlp.gated else 1
    if moe_layer and spec.moe is not None:
        # experts run one after another: the largest working set is one expert's, with
        # balanced routing T*k/E tokens
        per_expert = dm.tokens * spec.moe.top_k // spec.moe.num_experts
        mlp = per_inner * per_expert * spec.moe.expert_ffn_hidden_size // t * e
    else:
        mlp = per_inner * dm.tokens * spec.ffn_hidden_size // t * e
    norm = _norm_backward_bytes(spec, wl, dm)
    attn_alive, attn_transient = _attention_backward(spec, wl, dm, recompute, saved["attn"])
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
    return [
        BackwardMoment("mlp", extra + a_norm + saved["attn"] + m_norm + saved["ffn"] - freed_ffn,
                       incoming + dropout_grad + mlp, ("mlp_out",)),
        BackwardMoment("mlp_norm", extra + a_norm + saved["attn"] + saved["mlp_norm_bwd"],
                       incoming + norm, ("mlp",)),
        BackwardMoment("attention", extra + a_norm + attn_alive, incoming + attn_transient,
                       ("mlp", "mlp_norm", "attn_out")),
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
    if upcast and lowp and spec.norm_bias:
        fp32_normed += stream  # weight * normed, before the bias is added
    if recompute is not Recompute.FULL:
        b = _by_block(layer_terms(spec, wl, dm, moe_layer=moe_layer, recompute=recompute))
        core = 0
        if recompute is Recompute.SELECTIVE and wl.attention is Attention.EAGER:
            # inside the checkpointed core: two score-sized tensors (scores and their scaled
            # or masked successor; then the softmax's input and output) with either the
            # contiguous q and k copies of the first matmul, or dropout's mask and output
            scores = dm.b * (spec.num_attention_heads // t) * dm.s * dm.s_kv
            q_bytes = dm.tokens * spec.q_size // t * e
            dropout = scores * (e + MASK_BYTES) if spec.dropout > 0 else 0
            core = 2 * scores * e + max(2 * q_bytes, dropout)
        # the core runs before the attention output and its dropout mask exist
        before_out = b["attn"] - dm.tokens * spec.q_size // t * e - (
            rows * h * MASK_BYTES if spec.dropout > 0 else 0)
        return [
            ForwardMoment("attn_norm", b["attn_norm"], unsaved_input + fp32_normed),
            ForwardMoment("attention", b["attn_norm"] + b["attn"], unsaved_input + stream),
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
        scores = dm.b * (spec.num_attention_heads // t) * dm.s * dm.s_kv
        attn_ws = 4 * q_bytes + 2 * scores * e  # q, K^T copy, V, output; two score tensors
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
    # x is the checkpointed input; the norm output lives while its block runs
    return [
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
    if wl.norm_impl is NormImpl.FUSED or dm.e >= FP32_BYTES:
        return 0
    rows = dm.tokens // dm.res_tokens_div
    bias_temp = dm.e if spec.norm_bias else 0  # weight * normed, before the bias is added
    return rows * spec.hidden_size * (dm.e + FP32_BYTES + bias_temp)


def final_norm_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[int, int]:
    """Saved bytes of the final norm (part of the head's terms): all of them, and those still
    saved when its own backward runs."""
    blocks = _by_block(norm_terms("attn_norm", spec, wl, dm))
    return blocks["attn_norm"], blocks["attn_norm_bwd"]


def norm_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Gradient bytes in flight inside a norm's backward, its incoming gradient excluded."""
    return _norm_backward_bytes(spec, wl, dm)


def _norm_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    rows = dm.tokens // dm.res_tokens_div
    h, e = spec.hidden_size, dm.e
    if wl.norm_impl is NormImpl.FUSED:
        # LayerNorm's aten kernel: its input gradient. The reference fused RMSNorm: the
        # weighted gradient, the normalised input and one product.
        return (3 if spec.norm is NormKind.RMSNORM else 1) * rows * h * e
    casts = 1 if e < FP32_BYTES else 0  # the cast back's backward makes an fp32 gradient copy
    count = (4 if spec.norm is NormKind.RMSNORM else 2) + casts
    return count * rows * h * FP32_BYTES


def _attention_backward(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                        saved_attn: int) -> tuple[int, int]:
    """(attention's saved bytes alive, gradient bytes in flight) at its backward's peak."""
    t, e = dm.tp, dm.e
    q_bytes = dm.tokens * spec.q_size // t * e
    if wl.attention is Attention.FLASH:
        transient = dm.tokens * (2 * spec.q_size + 2 * spec.kv_size) // t * e
        rebuilt = 0
        if recompute is Recompute.SELECTIVE:  # the core reruns: its output and logsumexp
            rebuilt = q_bytes + dm.b * (spec.num_attention_heads // t) * dm.s * FP32_BYTES
        return saved_attn + rebuilt, transient
    scores = dm.b * (spec.num_attention_heads // t) * dm.s * dm.s_kv
    dropout = scores * (MASK_BYTES + e) if spec.dropout > 0 else 0
    grouped = spec.num_kv_heads < spec.num_attention_heads
    if recompute is not Recompute.SELECTIVE:
        # The value matmul's backward has freed V (repeated) and the dropout output.
        freed = q_bytes + (scores * e if spec.dropout > 0 else 0)
        return saved_attn - freed, q_bytes + 2 * scores * e
    # The rerun core saves again what its matmuls and softmax save: the contiguous K^T copy,
    # a contiguous copy of q when no RoPE made it contiguous, the repeated V (GQA; with MHA V
    # is the checkpoint's own input), the softmax output and dropout's mask and output. The
    # value matmul's backward has then freed its repeated V and the dropout output.
    rope = spec.position is PositionKind.ROPE
    rebuilt = (q_bytes + (0 if rope else q_bytes) + (q_bytes if grouped else 0)
               + scores * e + dropout)
    freed = (q_bytes if grouped else 0) + (scores * e if spec.dropout > 0 else 0)
    return saved_attn + rebuilt - freed, q_bytes + 2 * scores * e


def _vocab_shard(spec: ModelSpec, dm: Dims) -> int:
    return -(-spec.vocab_size // dm.vocab_div)


def total(terms: list[Term]) -> int:
    return sum(term.size_bytes for term in terms)
