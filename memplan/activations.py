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
from memplan.spec import MlpKind, ModelSpec, NormKind, PositionKind
from memplan.units import DType, ceil_div
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
    elif spec.mlp is MlpKind.RELU:
        names = ("act",)  # ReLU's backward reads its output, which the next linear saves too
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
    """Last pipeline stage: final norm, log-softmax output of the vocab-parallel loss, targets.
    A chunked loss saves no log-softmax output: each chunk's checkpoint keeps only its input
    (a view of the final norm's output) and recomputes the rest in its backward."""
    logit_bytes = FP32_BYTES if wl.logits_fp32 else dm.e
    loss = [] if wl.loss_chunks > 1 else [
        Term("loss.log_softmax", dm.tokens * _vocab_shard(spec, dm) * logit_bytes)]
    return [*norm_terms("final_norm", spec, wl, dm), *loss, *batch_terms(wl, dm)]


def loss_chunk_tokens(wl: Workload, dm: Dims) -> tuple[int, int]:
    """(tokens in the largest chunk, number of chunks) of the loss, as ``torch.chunk`` splits
    the micro-batch's tokens: chunks of ceil(T / n) tokens, the last one smaller (so fewer
    than n chunks when n does not divide T evenly enough). (T, 1) when unchunked."""
    if wl.loss_chunks == 1:
        return dm.tokens, 1
    size = ceil_div(dm.tokens, wl.loss_chunks)
    return size, ceil_div(dm.tokens, size)


def batch_terms(wl: Workload, dm: Dims) -> list[Term]:
    """The targets (saved by the loss) and the loss with nll_loss's saved total weight (two
    scalars in the logits' dtype): the training loop holds them until the backward ends. A
    chunked loss saves no total weight (its chunks are checkpointed): the loss alone."""
    scalar = FP32_BYTES if wl.logits_fp32 else dm.e
    count = 1 if wl.loss_chunks > 1 else 2
    return [Term("loss.targets", dm.tokens * INDEX_BYTES), Term("loss.scalars", count * scalar)]


def head_forward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Bytes alive at the loss beyond what is saved: the logits the log-softmax reads.

    With fp32 logits the compute-dtype logits are freed once upcast, and the fp32 copy lives
    until the loss returns, next to the log-softmax output. A chunked loss holds the logits
    and the log-softmax output of one chunk, both freed when the chunk returns its sum.
    """
    logit_bytes = FP32_BYTES if wl.logits_fp32 else dm.e
    if wl.loss_chunks > 1:
        return 2 * loss_chunk_tokens(wl, dm)[0] * _vocab_shard(spec, dm) * logit_bytes
    return dm.tokens * _vocab_shard(spec, dm) * logit_bytes


def mask_terms(wl: Workload, dm: Dims) -> list[Term]:
    """Eager attention's causal mask is an input of every checkpointed region, so with any
    recompute it is saved until the backward (once per micro-batch, shared by the layers)."""
    if wl.attention is Attention.EAGER and wl.recompute is not Recompute.NONE:
        return [Term("attn.causal_mask", eager_mask_bytes(wl, dm))]
    return []


def head_linear_backward_bytes(spec: ModelSpec, wl: Workload, dm: Dims,
                               vocab_grad_bytes: int) -> int:
    """At the output projection's backward: the logits' gradient in the compute dtype (after
    the fp32 upcast's backward), the gradient of its input and the head's weight gradient
    (``vocab_grad_bytes``, as produced in the compute dtype), beyond what is saved.

    A chunked loss runs one projection backward per chunk, last chunk first. Autograd sums
    the chunks' weight gradients in the buffer of the weight's gradient node, each into a new
    tensor: from the second chunk run on, three weight-gradient-sized tensors exist at once
    (the buffer, the chunk's gradient, their sum). It keeps the chunks' input gradients
    until the split's backward concatenates them; the last chunk run frees the final norm's
    output (nothing else saves it) once its projection's backward is done. So the worst is
    the last chunk's weight gradient made, with its logits' gradient not yet freed and all
    input gradients beside it, or the three-way sum of the chunk run before it, beside the
    input gradients made so far (traced: tests/test_ground_truth.py, ``loss_chunks``)."""
    chunk, chunks = loss_chunk_tokens(wl, dm)
    grad_logits = chunk * _vocab_shard(spec, dm) * dm.e
    if wl.loss_chunks == 1:
        # with fp32 logits, the upcast's fp32 gradient has replaced the fp32 logits (both
        # freed by now); without, nothing is upcast: the compute-dtype logits gradient
        grad_input = dm.tokens // dm.res_tokens_div * spec.hidden_size * dm.e
        return grad_logits + grad_input + vocab_grad_bytes
    grad_input = _chunk_input_grads(spec, dm)
    summed = vocab_grad_bytes if chunks > 1 else 0  # the earlier chunks' sum, in the buffer
    last_made = grad_input + summed + vocab_grad_bytes + grad_logits
    # the sum before the last chunk run's: the input gradients of all chunks but the first
    before_last = grad_input - grad_input * chunk // dm.tokens if chunks > 2 else 0
    return max(last_made, before_last + 3 * summed)


def eager_mask_bytes(wl: Workload, dm: Dims) -> int:
    """Eager attention's additive causal mask, built once per forward and freed after it."""
    return dm.s * dm.s_kv * dm.e if wl.attention is Attention.EAGER else 0


def head_backward_extra_bytes(spec: ModelSpec, wl: Workload, dm: Dims,
                              vocab_grad_bytes: int) -> int:
    """Bytes alive in the loss's backward beyond what is saved: the incoming gradient of the
    log-softmax output and the gradient it produces, both logits-sized.

    A chunked loss recomputes a chunk's log-softmax output (its fp32 logits are freed right
    after: nothing saves them), then holds it with those two gradients. Its last chunk run is
    the worst: the other chunks' input gradients and their summed weight gradient
    (``vocab_grad_bytes``) wait beside it (``head_linear_backward_bytes``)."""
    chunk, chunks = loss_chunk_tokens(wl, dm)
    if wl.loss_chunks == 1:
        return 2 * head_forward_extra_bytes(spec, wl, dm)
    logits = chunk * _vocab_shard(spec, dm) * (FP32_BYTES if wl.logits_fp32 else dm.e)
    grad_input = _chunk_input_grads(spec, dm)
    others = grad_input - grad_input * chunk // dm.tokens
    return 3 * logits + (others + vocab_grad_bytes if chunks > 1 else 0)


def _chunk_input_grads(spec: ModelSpec, dm: Dims) -> int:
    """The chunks' input gradients of a chunked loss together: each chunk's projection takes
    rows of the final norm's output as the head sees it (all-gathered under DTensor sequence
    parallelism, where the split's backward runs before the gradient is scattered back)."""
    rows = dm.tokens if dm.gathered_linear_input else dm.tokens // dm.res_tokens_div
    return rows * spec.hidden_size * dm.e


def _vocab_shard(spec: ModelSpec, dm: Dims) -> int:
    return ceil_div(spec.vocab_size, dm.vocab_div)


def total(terms: list[Term]) -> int:
    return sum(term.size_bytes for term in terms)
