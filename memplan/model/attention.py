"""The attention block: q/k/v projections, RoPE, the core (flash or eager), the output
projection and its dropout. Its input norm is a block of its own (``memplan.model.norm``).

What it saves: q after RoPE, k and v at the KV width (GQA/MQA), the attention output (saved by
the output projection). flash: an fp32 logsumexp per query and head. eager: the softmax output
(a*s^2 elements per sequence; the s-squared term) and, with dropout, its mask and output; its
op-by-op peaks are ``memplan.model.eager``. Selective recompute (Korthikanti et al. 2022,
section 5) reruns the core, so nothing the core saves internally is kept.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from memplan.model import compiled, eager, linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import (COMPLEX64_PAIR_BYTES, FP32_BYTES, INDEX_BYTES, Dims, Term,
                                residual_dropout_mask, total)
from memplan.model.linear import Linear, Split
from memplan.model.norm import norm_terms
from memplan.spec import ModelSpec, PositionKind, QkNorm, qk_norm_params
from memplan.workload import Attention as Kernel
from memplan.workload import AttentionImpl, Recompute, RopeCache, TeFp8Recipe, Workload

if TYPE_CHECKING:
    from memplan.parallel import ParallelConfig


def attention_terms(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
    """Attention block terms, without its input norm, with its output's dropout mask."""
    t, e = dm.tp, dm.e
    heads = spec.num_attention_heads // t
    # Eager attention repeats K and V to every query head before its matmuls, which save the
    # repeated copies; SDPA's fused kernels take grouped K and V as they are.
    kv_width = spec.q_size
    litgpt = wl.attention_impl is AttentionImpl.LITGPT
    grouped = spec.kv_size < spec.q_size
    if (wl.attention is Kernel.FLASH or recompute is Recompute.SELECTIVE) and not (
            litgpt and grouped):
        kv_width = spec.kv_size  # as they enter SDPA / the checkpointed core
    # Under autocast RoPE multiplies the low-precision projections by the fp32 tables: q and k
    # come out fp32. The core's matmuls save low-precision casts of them; a checkpointed core
    # keeps its inputs, the fp32 tensors themselves.
    rotated = dm.autocast and spec.rope_fp32_under_autocast
    qk_e = dm.stream_e if rotated and recompute is Recompute.SELECTIVE else e
    terms = [
        Term("attn.q", dm.tokens * spec.q_size // t * qk_e),
        Term("attn.k", dm.tokens * kv_width // t * qk_e),
        Term("attn.v", dm.tokens * kv_width // t * e),
        _core_output(spec, wl, dm, recompute),
        *_float8_tp_out_input(spec, dm),
    ]
    if litgpt:
        terms += _litgpt_terms(spec, dm, grouped)
    elif (wl.kv_cache and (spec.fused_qkv or wl.fused_qkv)
          and recompute is Recompute.NONE and spec.position is not PositionKind.ROPE):
        # a key/value cache filled by the training forward (transformers' DynamicLayer.update:
        # torch.cat) hands SDPA copies of k and v, while q is still a view of the fused
        # projection's output: SDPA's saved q keeps all of it alive, its k and v parts too
        # (with RoPE, q is RoPE's new tensor); under autocast too, the fused output and the
        # copies in the low dtype (traced: tests/traced/test_frameworks.py gpt2-toy-cache)
        terms.append(Term("attn.qkv_pinned", dm.tokens * 2 * spec.kv_size // t * e))
    elif qkv_pinned_by_v(spec, wl, recompute):
        # no cache: SDPA saves v, a view of the fused projection's output, which keeps it
        # alive whole (its q and k parts here; q and k are RoPE's new tensors)
        terms.append(Term("attn.qkv_pinned", dm.tokens * (spec.q_size + spec.kv_size) // t * e))
    if head_major_core(spec, wl, recompute) and not (wl.compile and dm.rerun):
        # compiled and rebuilt inside the graph, the copy is remade for the output
        # projection's weight gradient, after the MLP's backward (traced: Phi-4-mini's
        # layer under full AC, tests/traced/test_compile_trace.py
        # ``test_compiled_fused_gate_up_layer``: not alive at the MLP's kernel, the peak)
        terms.append(Term("attn.core_out", dm.tokens * spec.q_size // t * e))
    if recompute is Recompute.NONE:
        if wl.attention is Kernel.FLASH:
            terms.append(Term("attn.lse", dm.b * heads * dm.s * FP32_BYTES))
        else:
            terms += _eager_score_terms(spec, wl, dm, heads)
    casts = linear.saved_terms("attn", attention_linears(spec), dm)
    terms += rope_layer_terms(spec, wl, dm)
    return (terms + qk_norm_terms(spec, wl, dm) + casts + residual_dropout_mask("attn", spec, dm)
            + output_gate_terms(spec, dm))


def output_gate_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """The output gate (``ModelSpec.attn_output_gate``; Qwen3NextAttention.forward:
    ``attn_output * torch.sigmoid(gate)``): the sigmoid's output and the attention output the
    product saves, o_proj saving the product instead. In fp32 the q norm's ``x.float()`` is
    q itself, a view of q_proj's output, which its saved input keeps whole: the gate's half
    too (in a lower dtype the norm saves an fp32 copy)."""
    if not spec.attn_output_gate:
        return []
    q = dm.tokens * spec.q_size // dm.tp * dm.e
    pinned = q if dm.e >= FP32_BYTES and spec.qk_norm is not QkNorm.NONE else 0
    return [Term("attn.gate", 2 * q), Term("attn.q_gate_pinned", pinned)]


def _core_output(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> Term:
    """The attention output, saved by the output projection (its input) and, as one tensor,
    by a fused core that saves its output (SDPA's flash kernel: its backward reads ``out``),
    which saves it when the projection's weight is frozen too. Under Transformer Engine fp8
    the projection saves its own fp8 copy (``linear.te_fp8_input_bytes``): the output stays
    only where the fused core saves it."""
    out = attention_linears(spec)[-1]
    if dm.te_fp8 is not TeFp8Recipe.NONE:
        kept = wl.attention is Kernel.FLASH and recompute is Recompute.NONE
        return Term("attn.out", dm.tokens * out.d_in // dm.tp * dm.e if kept else 0)
    if (dm.adapters is not None and wl.attention is Kernel.FLASH
            and recompute is Recompute.NONE):
        return Term("attn.out", dm.tokens * out.d_in // dm.tp * dm.e)
    if dm.float8_tp:  # the projection saves its float8 cast (_float8_tp_out_input)
        kept = wl.attention is Kernel.FLASH and recompute is Recompute.NONE
        return Term("attn.out", dm.tokens * out.d_in // dm.tp * dm.e if kept else 0)
    return linear.saved_input("attn.out", out, dm.tokens, dm)


def _float8_tp_out_input(spec: ModelSpec, dm: Dims) -> list[Term]:
    """Under torchao's float8 tensor-parallel styles, the float8 cast of the output
    projection's input that it saves (``Float8RowwiseParallel``: ``linear.
    float8_tp_input_bytes``), beside the attention output a fused core saves."""
    if not dm.float8_tp:
        return []
    out = attention_linears(spec)[-1]
    return [Term("attn.out_float8", linear.float8_tp_input_bytes(dm.tokens, out.d_in // dm.tp))]


def _eager_score_terms(spec: ModelSpec, wl: Workload, dm: Dims, heads: int) -> list[Term]:
    """Eager attention's saved score-sized tensors: under autocast the scores are fp32 (the
    bf16 product plus the fp32 mask), so is the softmax; the second matmul saves a cast of its
    input; transformers' eager softmax runs in fp32 and casts back (softmax_fp32)."""
    e = dm.e
    terms = []
    scores = dm.b * heads * dm.s * dm.s_kv
    fp32_softmax = dm.autocast or (wl.softmax_fp32 and e < FP32_BYTES)
    if spec.attn_logit_softcap is not None:
        # Gemma 2's eager_attention_forward: scores / cap, tanh (which saves its output),
        # * cap, before the mask and the softmax
        terms.append(Term("attn.softcap_tanh", scores * e))
    terms.append(Term("attn.softmax", scores * (FP32_BYTES if fp32_softmax else e)))
    if spec.attn_sinks:
        # GPT-OSS's eager_attention_forward: the sink column joins the scores (the softmax
        # saves s_kv + 1 columns) after subtracting the row max, whose backward saves its
        # int64 index
        rows = dm.b * heads * dm.s
        terms.append(Term("attn.sinks", rows * ((FP32_BYTES if fp32_softmax else e)
                                                + INDEX_BYTES)))
    if spec.dropout > 0:
        terms.append(Term("attn.softmax_dropout_mask", scores))
        terms.append(Term("attn.softmax_dropout_out", scores * e))
    elif fp32_softmax:
        terms.append(Term("attn.softmax_cast", scores * e))
    return terms


def qk_norm_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """The q and k norms (``QkNorm``) on the projections' outputs, each as a layer norm of
    its width (``memplan.model.norm``) on its own input's dtype, the compute dtype (the
    projection's output): its fp32 copy, per-row statistics and the normalised tensor; its
    output goes to RoPE, which saves nothing of it. ``head``: rows of head_dim per token and
    head; ``full``: one row of the rank's projection width per token; ``l2``: a head's rows
    without the weighted product (Llama4TextL2Norm._norm: x * rsqrt(...) saves the fp32 x and
    the statistics, the cast back is the output SDPA saves)."""
    if spec.qk_norm is QkNorm.NONE:
        return []
    low = dm._replace(res_tokens_div=1, gathered_linear_input=False, stream_e=dm.e,
                      autocast=False)
    out = []
    for name, heads in (("q_norm", spec.num_attention_heads), ("k_norm", spec.num_kv_heads)):
        local = heads // dm.tp
        if spec.qk_norm is QkNorm.FULL:
            width, rows = local * spec.head_dim, dm.tokens
        else:
            width, rows = spec.head_dim, dm.tokens * local
        narrow = spec.model_copy(update={"hidden_size": width, "norm_bias": False})
        dropped = (".output", ".normed") if spec.qk_norm is QkNorm.L2 else (".output",)
        out += [t for t in norm_terms(f"attn.{name}", narrow, wl, low._replace(tokens=rows))
                if not t.name.endswith(dropped)]
    return out


def qk_norm_sizes(spec: ModelSpec, t: int) -> list[int]:
    """The q and k norms' weights on one TP rank: per-head ones replicated, full-width ones
    split with the heads."""
    if spec.qk_norm is QkNorm.HEAD:
        return [spec.head_dim, spec.head_dim]
    if spec.qk_norm is QkNorm.FULL:
        return [spec.q_size // t, spec.kv_size // t]
    return []


def _small_sizes(spec: ModelSpec, t: int) -> list[int]:
    """The q and k norms' weights, then the per-head sinks (GPT-OSS: GptOssAttention.sinks,
    one logit per query head, held whole)."""
    return qk_norm_sizes(spec, t) + ([spec.num_attention_heads] if spec.attn_sinks else [])


def qkv_pinned_by_v(spec: ModelSpec, wl: Workload, recompute: Recompute) -> bool:
    """Whether SDPA's saved v is a view of a model's one fused q/k/v projection without a
    cache between them: transformers' Phi3Attention.forward slices ``value_states`` out of
    ``qkv_proj``'s output, and integrations/sdpa_attention.py ``sdpa_attention_forward``
    passes it on unrepeated (``enable_gqa`` without a mask; with one head per K/V head
    ``repeat_kv`` returns it as it is), while RoPE makes q and k new tensors. A training
    forward's cache (``Workload.kv_cache`` under no recompute) hands SDPA its own copies
    instead; gradient checkpointing turns the cache off (``memplan.model.layer.
    rerun_workload``), so a checkpointed layer's rebuilt v pins the fused output. Traced:
    Phi-3 and Phi-4-mini narrowed, 2 x 1,024 tokens: full recompute's backward was T x (q +
    kv) elements under (-3.3% in bf16). A windowed layer given its mask repeats v to every
    query head (a copy: ``WindowAttention.saved`` drops the term). torchtitan's fused wqkv
    (models/common/attention.py FusedQKVLinear.forward: each of q, k, v ``.contiguous()``
    after the split; its RoPE cached per layer, ``RopeCache.LAYER``) hands SDPA copies: no
    pin (traced: tests/traced/test_frameworks.py torchtitan llama3-toy)."""
    return (spec.fused_qkv and spec.position is PositionKind.ROPE
            and wl.rope_cache is RopeCache.FORWARD
            and recompute is Recompute.NONE and not wl.kv_cache
            and wl.attention is Kernel.FLASH and wl.attention_impl is AttentionImpl.GENERIC)


def head_major_core(spec: ModelSpec, wl: Workload, recompute: Recompute) -> bool:
    """Whether the fused core's output is head-major, so that the reshape for the output
    projection copies it and both are saved: transformers' rotate-half RoPE
    (``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``) on a q sliced out of one
    fused projection (Phi-3's qkv_proj: a view that is not dense) returns a contiguous
    head-major q, and SDPA's output takes q's layout (flash's ``empty_like`` of it); a q of its
    own projection is a dense token-major view, whose layout elementwise ops keep (traced:
    tests/traced/test_frameworks.py phi3). torchtitan's complex RoPE (``RopeCache.LAYER``)
    reshapes its result token-major again; eager attention copies its output anyway
    (``memplan.model.eager``). Partial rotary embeddings concatenate the rotated channels
    with the others (GLM-4's ``apply_rotary_pos_emb``: ``torch.cat([q_embed, q_pass],
    dim=-1)``), a new contiguous head-major q whatever q's own layout (traced:
    tests/traced/test_hf_moe_families.py glm4, glm4_moe). Compiled, Inductor lays out the
    rotate-half's pointwise output itself, token-major: SDPA's output is too, the reshape a
    view, one tensor (traced: tests/traced/test_compile_trace.py
    ``test_compiled_fused_gate_up_layer``, Phi-3's layer, bf16, no recompute: SDPA's output
    saved, no copy); a ``torch.cat`` keeps its head-major output, so partial rotary
    embeddings still save both (Phi-4-mini's layer, the same test: SDPA's output and the
    copy)."""
    return ((spec.fused_qkv and not wl.compile or spec.rotary_dim is not None)
            and spec.position is PositionKind.ROPE
            and wl.attention is Kernel.FLASH and wl.rope_cache is RopeCache.FORWARD
            and wl.attention_impl is AttentionImpl.GENERIC and recompute is Recompute.NONE)


def _litgpt_terms(spec: ModelSpec, dm: Dims, grouped: bool) -> list[Term]:
    """litgpt's ``CausalSelfAttention.forward`` (``AttentionImpl.LITGPT``), beyond the generic
    terms: without grouped K/V the v SDPA saves is a view of the one qkv output, which it keeps
    alive whole (its q and k parts here); the core's output is head-major like q (made by
    RoPE's ``torch.cat``), so ``y.reshape`` copies it for the output projection and both are
    saved."""
    t, e = dm.tp, dm.e
    terms = [Term("attn.core_out", dm.tokens * spec.q_size // t * e)]
    if not grouped:
        terms.append(Term("attn.qkv_pinned", dm.tokens * (spec.q_size + spec.kv_size) // t * e))
    return terms


@lru_cache(maxsize=256)
def attention_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The block's projections in registration order: q, k and v (one qkv with
    ``fused_qkv``), column-parallel, which the ``attn`` gradient group ends with; the output
    projection, row-parallel, the ``attn_out`` group (its backward runs first)."""
    h, q, kv, bias = spec.hidden_size, spec.q_size, spec.kv_size, spec.qkv_bias
    out = Linear("o", "attn_out", q, h, spec.attn_out_bias, Split.ROW)
    if spec.fused_qkv:  # one q/k/v parameter (and one bias)
        return Linear("qkv", "attn", h, q + 2 * kv, bias), out
    q_out = 2 * q if spec.attn_output_gate else q  # ModelSpec.attn_output_gate: the gate's half
    return (Linear("q", "attn", h, q_out, bias), Linear("k", "attn", h, kv, bias),
            Linear("v", "attn", h, kv, bias), out)


def _core(spec: ModelSpec, wl: Workload, dm: Dims) -> eager.Core:
    """The eager core's sizes; transformers' fp32 softmax matters only below fp32."""
    return eager.core(spec, dm, wl.softmax_fp32 and dm.e < FP32_BYTES)


def _fp32_rotated(spec: ModelSpec, dm: Dims) -> int:
    """Under autocast with RoPE: the caller's q and k rotated by the fp32 tables, in fp32."""
    if not dm.autocast or not spec.rope_fp32_under_autocast:
        return 0
    return dm.tokens * (spec.q_size + spec.kv_size) // dm.tp * dm.stream_e


def _q_bytes(spec: ModelSpec, dm: Dims) -> int:
    return dm.tokens * spec.q_size // dm.tp * dm.e


def _before_output(spec: ModelSpec, dm: Dims, saved: int) -> int:
    """Of the block's saved bytes, those that exist while the core runs: not the attention
    output (saved by the output projection) nor its dropout mask, nor under autocast the
    output projection's weight cast."""
    return (saved - _q_bytes(spec, dm) - total(residual_dropout_mask("attn", spec, dm))
            - _out_cast(spec, dm))


def _out_cast(spec: ModelSpec, dm: Dims) -> int:
    """The output projection's saved weight cast (autocast): made after the core, freed by
    its backward before the core's."""
    return linear.saved_bytes(attention_linears(spec)[-1:], dm)


def _flash_backward(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                    saved: int) -> list[tuple[int, int]]:
    """(saved bytes alive, gradients in flight) at flash attention's backward: the output
    gradient and the q, k, v gradients; selective recompute reran the core (its output and
    logsumexp)."""
    t, e = dm.tp, dm.e
    transient = dm.tokens * (2 * spec.q_size + 2 * spec.kv_size) // t * e
    rebuilt = 0
    if recompute is Recompute.SELECTIVE:
        rebuilt = _q_bytes(spec, dm) + dm.b * (spec.num_attention_heads // t) * dm.s * FP32_BYTES
    return [(saved + rebuilt - _out_cast(spec, dm), transient)]


def _eager_backward(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                    saved: int) -> list[tuple[int, int]]:
    """The eager core's two backward peaks (``eager.backward``): the output projection's
    backward has freed its input (the core's output copy) and the block's output dropout ran
    its backward first (its mask freed)."""
    c = _core(spec, wl, dm)
    saved -= total(residual_dropout_mask("attn", spec, dm)) + _out_cast(spec, dm)
    return [(saved - c.q + alive, transient) for alive, transient
            in eager.backward(c, rebuild=recompute is Recompute.SELECTIVE)]


def _eager_rerun(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute,
                 saved: int) -> list[BackwardMoment]:
    """A checkpointed eager core's rerun (selective recompute) at its early stop
    (``eager.rerun``), what the block saved and the core saves again alive, as at the value
    matmul's backward (``eager.backward``'s first moment)."""
    if wl.attention is not Kernel.EAGER or recompute is not Recompute.SELECTIVE:
        return []
    c = _core(spec, wl, dm)
    saved -= total(residual_dropout_mask("attn", spec, dm)) + _out_cast(spec, dm)
    return [BackwardMoment("attention.rerun", saved - c.q + c.rebuilt, eager.rerun(c),
                           ("attn_out",))]


def _outputs(spec: ModelSpec, dm: Dims) -> list[int]:
    """Bytes of each input projection's output (q, k, v or the fused qkv), in order."""
    return [dm.tokens * linear.local_widths(lin, dm.tp)[1] * dm.e
            for lin in attention_linears(spec)[:-1]]


def _float8_forward(spec: ModelSpec, dm: Dims) -> list[Moment]:
    """As ``Float8Linear``s (``linear.float8_forward_peak``), each input projection's cast
    working set, beside the outputs of those run before it (q, then k, then v; or the fused
    qkv). None unconverted."""
    linears = attention_linears(spec)[:-1]
    if not any(linear.float8_converts(lin, dm) for lin in linears):
        return []
    outs = _outputs(spec, dm)
    return [Moment(f"attn_f8_{lin.name}", 0,
                   sum(outs[:i]) + linear.float8_forward_peak(lin, dm, outs[i]))
            for i, lin in enumerate(linears)]


def _float8_out_backward(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """As a ``Float8Linear``, the output projection's backward (``linear.
    float8_backward_peak``) before the core's, every saved tensor of the block alive, the
    core output's gradient its input gradient. None unconverted."""
    out = attention_linears(spec)[-1]
    if not linear.float8_converts(out, dm):
        return []
    return [BackwardMoment("attn_f8_o", saved, linear.float8_backward_peak(
        out, dm, _q_bytes(spec, dm)), ())]


def _float8_in_backward(spec: ModelSpec, dm: Dims) -> list[BackwardMoment]:
    """As ``Float8Linear``s, the input projections' backward, the last made first (v, k,
    q): each beside the gradients of the outputs not yet consumed, its own included, and the
    input gradients made before it. None unconverted."""
    linears = attention_linears(spec)[:-1]
    if not any(linear.float8_converts(lin, dm) for lin in linears):
        return []
    outs = _outputs(spec, dm)
    # the input's gradient as the matmul makes it: all tokens under DTensor sequence
    # parallelism (reduce-scattered after, by the input's redistribute)
    grad_in = dm.linear_rows * spec.hidden_size * dm.e
    n = len(linears)
    return [BackwardMoment(f"attn_f8_{linears[i].name}_in", 0,
                           sum(outs[:i + 1]) + (n - 1 - i) * grad_in
                           + linear.float8_backward_peak(linears[i], dm, grad_in),
                           ("attn_out",))
            for i in reversed(range(n))]


class Attention:
    """Multi-head attention with grouped K/V (MHA, GQA, MQA), RoPE or learned positions."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return (attention_terms(spec, wl, dm, recompute)
                + compiled.float8_scales("attn", attention_linears(spec), dm)
                + compiled.float8_tp_weights("attn", attention_linears(spec), dm, recompute)
                + compiled.float8_rebuilt_casts("attn", attention_linears(spec), spec, wl, dm))

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The core's peak (before the attention output exists) and the output projection's
        (its output before the residual add, beside what the core leaves)."""
        saved = total(attention_terms(spec, wl, dm, recompute))
        # under autocast with RoPE the caller's rotated q and k are fp32 and never saved
        # (SDPA saves casts of them): alive until the block returns
        core = after_core = _fp32_rotated(spec, dm)
        if wl.attention is Kernel.EAGER:
            c = _core(spec, wl, dm)
            saving = recompute is Recompute.NONE
            core = eager.forward_saving(c) if saving else eager.forward_checkpointed(c)
            after_core = eager.output_projection(c, saving)
        stream = dm.rows * spec.hidden_size * dm.e
        # as a Float8Linear, the output projection's casts' working set before its output
        out = linear.float8_forward_peak(attention_linears(spec)[-1], dm, stream)
        return [Moment("attention", saved, out + after_core),
                Moment("attention_core", _before_output(spec, dm, saved), core),
                *_float8_forward(spec, dm)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer: q, k and v with the core's working set and the output
        projection's output; with RoPE, the rotated copies while they are made."""
        t, e = dm.tp, dm.e
        stream = dm.rows * spec.hidden_size * e
        q_bytes = _q_bytes(spec, dm)
        kv_bytes = 2 * dm.tokens * spec.kv_size // t * e
        q_in, kv_in = q_bytes, kv_bytes  # the projections' outputs, before RoPE
        if _fp32_rotated(spec, dm):  # the caller's q and k are fp32 after RoPE
            q_bytes, kv_bytes = 2 * q_bytes, 3 * kv_bytes // 2
        if wl.attention is Kernel.FLASH:
            core = q_bytes + dm.b * (spec.num_attention_heads // t) * dm.s * FP32_BYTES
        else:
            # the core's working set, or its output, the copy of it and the output
            # projection's output (that output is the stream counted here)
            c = _core(spec, wl, dm)
            core = max(eager.forward_checkpointed(c) - stream, 2 * c.q)
        moments = [Moment("attention", 0, stream + q_bytes + kv_bytes + core),
                   *_float8_forward(spec, dm)]
        if linear.float8_converts(attention_linears(spec)[-1], dm):
            # the output projection's casts beside its input (the core's output) alone
            moments.append(Moment("attn_f8_o", 0, _q_bytes(spec, dm) + linear.
                                  float8_forward_peak(attention_linears(spec)[-1], dm, stream)))
        if spec.position is PositionKind.ROPE:
            # q, k and v stay alive while RoPE makes the rotated copies (the call rebinds both
            # only when k's is done); at k's, q's rotated copy and three k-sized tensors (k *
            # cos, the rotated half, its product with sin); at q's, three q-sized ones (traced)
            k_bytes = dm.tokens * spec.kv_size // t * e
            # by the fp32 tables under autocast (``_fp32_rotated``) the products and the
            # rotated copy are fp32 (r = 2 in bf16), q, k and v still the projections' own:
            # at q's, q, k, v and three fp32 q-sized tensors (traced: Gemma 2 narrowed,
            # amp-bf16, full recompute at 2 x 1,024 tokens: counted with q and k in fp32,
            # 2,359,296 B over)
            r = FP32_BYTES // e if _fp32_rotated(spec, dm) else 1
            rope = max(q_in + kv_in + 3 * r * q_in,
                       q_in + r * q_in + kv_in + 3 * r * k_bytes)
            moments.append(Moment("rope", 0, rope + compiled.qk_norm_stats_bytes(spec, dm)))
        return moments

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The core's backward peaks, then the input projections': the last weight gradient
        is made while the others exist, from its output's gradient, beside the gradients of
        the projections' (shared) input still to be summed."""
        saved = total(attention_terms(spec, wl, dm, recompute))
        core = (_eager_backward if wl.attention is Kernel.EAGER else _flash_backward)(
            spec, wl, dm, recompute, saved)
        grad_inputs = 2 * dm.rows * spec.hidden_size * dm.e
        return [
            *_float8_out_backward(spec, dm, saved),
            *_eager_rerun(spec, wl, dm, recompute, saved),
            *(BackwardMoment(f"attention.{i}", alive, transient, ("attn_out",))
              for i, (alive, transient) in enumerate(core)),
            *_float8_in_backward(spec, dm),
            BackwardMoment("attn_in", 0, grad_inputs + _q_bytes(spec, dm), ("attn",),
                           spec.hidden_size * spec.q_size // dm.tp),
        ]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Rerun with autograd recording in a fully recomputed layer's backward, an eager core
        peaks as in a forward without recompute (the output's dropout mask and the attention
        output do not exist yet)."""
        if wl.attention is not Kernel.EAGER:
            return []
        saved = total(attention_terms(spec, wl, dm, Recompute.NONE))
        c = _core(spec, wl, dm)
        before = _before_output(spec, dm, saved)
        return [Moment("rebuild", before, eager.forward_saving(c)),
                *[Moment("rebuild_sinks", before - unmade, held)
                  for unmade, held in eager.saving_sink_moments(c)]]

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """The projections (``attention_linears``), then the q and k norms and the sinks."""
        return linear.all_tensor_sizes(attention_linears(spec), t) + _small_sizes(spec, t)

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        return (linear.all_tensor_shapes(attention_linears(spec), t)
                + [(n,) for n in _small_sizes(spec, t)])

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``attn_out``: the output projection (its backward runs first); ``attn``: all."""
        return linear.grad_groups(attention_linears(spec), t, ("attn_out", "attn"),
                                  {"attn": sum(_small_sizes(spec, t))})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """2 FLOPs per projection weight (``memplan.model.linear``) and per q/k norm weight,
        and the core's (``core_flops_per_token``)."""
        return (linear.flops_per_token(attention_linears(spec)) + 2.0 * qk_norm_params(spec)
                + self.core_flops_per_token(spec, seq_len))

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """QK^T and PV over the causal average context s/2: 2 * 2 * (s/2) * a * d
        (Narayanan et al. 2021, arXiv 2104.04473, section 5.1)."""
        return 2.0 * seq_len * spec.q_size


def windowed(spec: ModelSpec, wl: Workload) -> bool:
    """Whether a sliding-window layer's SDPA gets an explicit mask (``Workload.window_mask``):
    transformers' ``_ignore_causal_mask_sdpa`` (masking_utils.py) skips the mask only when the
    keys are fewer than the window (``kv_length < local_attention_size``). Its layers are then
    a kind of their own (``memplan.model.stage_parts.layer_keys``)."""
    return (wl.window_mask and wl.attention is Kernel.FLASH and spec.sliding_window is not None
            and wl.seq_len >= spec.sliding_window)


class WindowAttention(Attention):
    """The attention block of a sliding-window layer. Where its SDPA call gets an explicit
    mask (``windowed``), SDPA converts the boolean mask to the query's dtype and saves that
    copy (``convert_boolean_attn_mask`` in aten/src/ATen/native/transformers/attention.cpp;
    CUDA's memory-efficient kernel saves it as its attn_bias), one per layer, and transformers
    repeats K and V to every query head first (integrations/sdpa_attention.py: no
    ``enable_gqa`` with a mask), so the core saves them at the query width: the block is the
    generic one with a key/value head per query head, plus the mask (traced:
    tests/traced/test_frameworks.py gemma2-window). Otherwise it is the generic block."""

    def _as_run(self, spec: ModelSpec, wl: Workload, dm: Dims) -> ModelSpec:
        if not windowed(spec, wl) or spec.num_kv_heads == spec.num_attention_heads:
            return spec
        return spec.model_copy(update={"num_kv_heads": spec.num_attention_heads})

    def _mask(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
        """The saved mask, and the q/k norms' terms at the model's K width (they run before
        the repetition) in place of the repeated spec's."""
        if not windowed(spec, wl):
            return []
        run = self._as_run(spec, wl, dm)
        qk = qk_norm_terms(spec, wl, dm)
        return [Term("attn.window_mask", dm.b * dm.s * dm.s_kv * dm.e),
                Term("attn.qk_norm_width", total(qk) - total(qk_norm_terms(run, wl, dm)))]

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        run = self._as_run(spec, wl, dm)
        if run is spec:
            return attention_terms(spec, wl, dm, recompute) + self._mask(spec, wl, dm)
        # (v repeated to every query head is a copy: it pins no fused q/k/v output)
        qk = {t.name for t in qk_norm_terms(run, wl, dm)} | {"attn.qkv_pinned"}
        return ([t for t in attention_terms(run, wl, dm, recompute) if t.name not in qk]
                + qk_norm_terms(spec, wl, dm) + self._mask(spec, wl, dm)[:1])

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        mask = total(self._mask(spec, wl, dm))
        return [m._replace(own_bytes=m.own_bytes + mask)
                for m in super().forward_moments(self._as_run(spec, wl, dm), wl, dm, recompute)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """The generic block's with K and V repeated, and at the kernel what a checkpointed
        layer holds beside them: the mask converted to the query's dtype (b x s x s_kv x e,
        ``convert_boolean_attn_mask``) and the caller's unrepeated K and V, which
        integrations/sdpa_attention.py ``sdpa_attention_forward``'s ``repeat_kv`` copies
        (``key = repeat_kv(key, ...)`` rebinds its own name; the attention's forward keeps
        ``key_states``). The generic moment's output projection output (a stream) does not
        exist yet at the kernel; the mask is freed when the kernel returns. Traced: Gemma 3
        narrowed (h 256, 4 heads / 2 KV heads of 96, window 512) at 2 x 1,024 tokens, full
        recompute: before, the forward 549,634 B under the trace, its peak at the kernel."""
        moments = super().working_set(self._as_run(spec, wl, dm), wl, dm)
        if not windowed(spec, wl):
            return moments
        beside = dm.b * dm.s * dm.s_kv * dm.e - dm.rows * spec.hidden_size * dm.e
        if spec.num_kv_heads < spec.num_attention_heads:
            beside += 2 * dm.tokens * spec.kv_size // dm.tp * dm.e
        return [m._replace(transient_bytes=m.transient_bytes + max(beside, 0))
                if m.name == "attention" else m for m in moments]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        mask = total(self._mask(spec, wl, dm))
        run = self._as_run(spec, wl, dm)
        out = super().backward_moments(run, wl, dm, recompute)
        # the core's moments hold the mask
        return [m._replace(own_bytes=m.own_bytes + mask) if m.name.startswith("attention")
                else m for m in out]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return super().rebuild_moments(self._as_run(spec, wl, dm), wl, dm)

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """QK^T and PV over the keys a query attends to: at most the window's w. Averaged
        over the sequence as the full layer's s/2 is (each query x attending to min(x, w)
        keys, integrated): s/2 while s <= w, else w - w^2 / (2s); 2 * 2 * context * a * d."""
        w = spec.sliding_window
        if w is None or seq_len <= w:
            return super().core_flops_per_token(spec, seq_len)
        if spec.window_chunked:
            return chunked_core_flops_per_token(spec, seq_len)
        return 4.0 * (w - w * w / (2 * seq_len)) * spec.q_size


def chunked_core_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """QK^T and PV of a chunked layer (``ModelSpec.window_chunked``): the query at offset x of
    its chunk attends to x + 1 keys, so a whole chunk of c attends to c(c + 1)/2 and the last,
    partial one of r = s mod c to r(r + 1)/2; averaged over s, 2 * 2 * context * a * d (the
    full layer's 4 * (s/2) * a * d in the same units, its context s/2 taken for (s + 1)/2)."""
    c = spec.sliding_window
    assert c is not None
    whole, rest = divmod(seq_len, c)
    pairs = whole * c * (c + 1) / 2 + rest * (rest + 1) / 2
    return 4.0 * (pairs / seq_len - 0.5) * spec.q_size


class NopeAttention(Attention):
    """The attention block of a layer without RoPE in a model whose q/k norm runs on the RoPE
    layers only (``QkNorm.L2``: Llama4TextAttention.__init__ builds its qk_norm when
    use_qk_norm and use_rope): the generic block without the q/k norm."""

    @staticmethod
    def _plain(spec: ModelSpec) -> ModelSpec:
        return spec.model_copy(update={"qk_norm": QkNorm.NONE})

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return super().saved(self._plain(spec), wl, dm, recompute)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        return super().forward_moments(self._plain(spec), wl, dm, recompute)

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return super().working_set(self._plain(spec), wl, dm)

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        return super().backward_moments(self._plain(spec), wl, dm, recompute)

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        return super().rebuild_moments(self._plain(spec), wl, dm)


def _built_window_mask(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The sliding-window mask transformers' model forward builds once per forward
    (``Workload.window_mask``), whichever layers read it, alive until the forward returns.

    SDPA: masking_utils.py ``_ignore_causal_mask_sdpa`` skips it while the keys are fewer than
    the window (never with no window: Qwen2-MoE's 0 with ``use_sliding_window`` off);
    ``sdpa_mask`` evaluates the mask function on (b, 1, 1, 1), (1, 1, s, 1) and (1, 1, 1, s_kv)
    indices (_non_vmap_expansion_sdpa) and expands the result to (b, 1, s, s_kv): a window's
    function reads the positions alone (sliding_window_causal_mask_function), so one byte per
    (query, key) pair; a chunked one indexes left_padding by batch (chunked_overlay), so b of
    them. Eager: ``eager_mask`` never skips it (allow_is_causal_skip off) and makes it additive,
    the size of ``eager_mask_bytes`` (traced: GPT-OSS eager,
    tests/traced/test_hf_moe_families.py)."""
    if not wl.window_mask:
        return 0
    if wl.attention is Kernel.EAGER:
        return eager_mask_bytes(wl, dm)
    if spec.sliding_window is not None and wl.seq_len < spec.sliding_window:
        return 0
    return (dm.b if spec.window_chunked else 1) * dm.s * dm.s_kv


def _slides(spec: ModelSpec) -> bool:
    """Whether any layer attends through a sliding window."""
    return spec.sliding_window is not None and any(spec.is_sliding_layer(i)
                                                   for i in range(spec.num_layers))


def window_mask_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The sliding-window mask built for the windowed layers (``_built_window_mask``)."""
    return _built_window_mask(spec, wl, dm) if _slides(spec) else 0


def unused_window_mask_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The sliding-window mask a model's forward builds where no layer slides
    (``ModelSpec.window_mask_always``; ``_built_window_mask``): no layer reads it, so no
    checkpoint saves it; it lives in the forward's ``causal_mask_mapping`` until the model's
    forward returns. Traced: tests/traced/test_hf_moe_families.py, Qwen2-MoE at 2 x 256
    tokens: 65,536 B."""
    return (_built_window_mask(spec, wl, dm) if spec.window_mask_always and not _slides(spec)
            else 0)


def window_mask_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """The windowed layers' boolean mask (``window_mask_bytes``) is an input of every
    checkpointed layer, so under full recompute it is saved until the backward, not freed
    with the forward (traced: tests/traced/test_hf_moe_families.py llama4 recompute); so
    under op-level checkpointing, whose layers are checkpointed too (traced: tests/traced/
    test_sac_policy.py, Mistral narrowed at 2 x 1,024 tokens, window 256: before, saved
    activations 1,048,576 B, the mask, under the trace)."""
    if wl.recompute not in (Recompute.FULL, Recompute.OPS):
        return []
    mask = window_mask_bytes(spec, wl, dm)
    return [Term("attn.window_mask_input", mask)] if mask else []


def positions_terms(wl: Workload, dm: Dims) -> list[Term]:
    """The positions the model's forward hands every layer (``Workload.positions_held``):
    one int64 row of the s positions, shared by the batch, which a checkpointed layer keeps
    to its backward, so under full recompute it is saved, and under op-level checkpointing,
    whose layers are checkpointed too (traced: transformers 5.3 and 5.23, Falcon-H1 and
    GPT-OSS under full recompute, tests/traced/test_hf_heldout.py and test_hf_moe_families.
    py: the saved activations 512 B under at s = 64 without it; Llama narrowed at 2 x 1,024
    tokens, tests/traced/test_sac_policy.py: 8,192 B under, full recompute's and the op-level
    policy's alike)."""
    if not (wl.positions_held and wl.recompute in (Recompute.FULL, Recompute.OPS)):
        return []
    return [Term("positions.checkpointed", dm.s * INDEX_BYTES)]


def rope_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """cos and sin tables, computed once per micro-batch per stage and saved by every layer,
    in the activations' dtype (fp32 under autocast, as Hugging Face casts them to the hidden
    states' dtype). Tables kept as registered buffers are sliced, not saved
    (``rope_buffer_bytes``)."""
    if spec.position is not PositionKind.ROPE or wl.rope_cache is not RopeCache.FORWARD:
        return []
    if spec.rope_complex:  # one complex64 table of rope_dim/2 pairs per position, any dtype
        return [Term("rope.freqs_cis", dm.s * (spec.rope_dim // 2) * COMPLEX64_PAIR_BYTES)]
    if spec.rope_interleaved and wl.recompute is Recompute.NONE:
        return []  # each layer saves its own repeated copy (``rope_layer_terms``)
    return [Term("rope.cos_sin", rope_tables(spec) * rope_table_bytes(spec, dm))]


def rope_table_bytes(spec: ModelSpec, dm: Dims) -> int:
    """One pair of cos and sin tables over the sequence, (1, s, rope_dim) each, or (1, s,
    rope_dim / 2) where the model keeps one column per frequency (``ModelSpec.
    rope_half_tables``: GptOssRotaryEmbedding.forward): in the activations' dtype (fp32 under
    autocast), or in fp32 where the model keeps them so (``ModelSpec.rope_tables_fp32``:
    Ernie4_5_MoeRotaryEmbedding.forward)."""
    width = FP32_BYTES if spec.rope_tables_fp32 else dm.stream_e
    columns = spec.rope_dim // 2 if spec.rope_half_tables else spec.rope_dim
    return 2 * dm.s * columns * width


def rope_layer_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """Interleaved RoPE (``ModelSpec.rope_interleaved``): the layer's repeated copies of cos
    and sin (ERNIE 4.5's apply_rotary_pos_emb: ``cos[..., :d // 2].repeat_interleave(2,
    dim=-1)``), saved by the rotation's products for q and k alike, in the tables' dtype
    (traced: transformers' ERNIE 4.5 MoE, bf16, 2 x 256 tokens: two (1, 1, 256, 32) fp32
    clones a layer, 65,536 B)."""
    if (not spec.rope_interleaved or spec.position is not PositionKind.ROPE
            or wl.rope_cache is not RopeCache.FORWARD):
        return []
    return [Term("attn.rope_tables", rope_table_bytes(spec, dm))]


def rope_local_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """The model's RoPE tables where no layer saves them (interleaved RoPE without
    checkpointing: ``rope_layer_terms``): a local of the model's forward (transformers'
    position_embeddings), alive through it as its masks are and freed when it returns."""
    if (not spec.rope_interleaved or spec.position is not PositionKind.ROPE
            or wl.rope_cache is not RopeCache.FORWARD or wl.recompute is not Recompute.NONE
            or spec.rope_complex):
        return 0
    return rope_tables(spec) * rope_table_bytes(spec, dm)


def rope_tables(spec: ModelSpec) -> int:
    """Pairs of cos and sin tables a forward keeps: one per layer type where each type has its
    own (``ModelSpec.rope_per_layer_type``: Gemma3TextModel.forward computes them for every
    entry of config.layer_types into a dict by type, the last of each type kept), else one."""
    n = spec.sliding_window_pattern  # every n-th layer full, the others sliding
    both = spec.sliding_window is not None and 2 <= n <= spec.num_layers
    return 2 if spec.rope_per_layer_type and both else 1


def rope_buffer_bytes(spec: ModelSpec, wl: Workload, num_layers: int) -> int:
    """RoPE tables held as registered buffers by one pipeline stage with ``num_layers``
    decoder layers, for the training sequence's positions (``Workload.rope_cache``): litgpt's
    model-wide cos and sin in the weights' dtype (Fabric converts floating buffers with the
    module), torchtitan's complex cache in every attention layer, or (before 0.3) one on the
    model; torchtune's (up to 0.1) fp32 cache in every layer, for the model's positions
    (``max_positions_rope_bytes``). Not sharded by TP or CP: each rank keeps every
    position."""
    if spec.position is not PositionKind.ROPE or wl.rope_cache is RopeCache.FORWARD:
        return 0
    if wl.rope_cache is RopeCache.MODEL:
        return 2 * wl.seq_len * spec.rope_dim * wl.precision.policy.params.itemsize
    if wl.rope_cache is RopeCache.LAYER_MAX:
        return num_layers * max_positions_rope_bytes(spec)
    if wl.rope_cache is RopeCache.LAYER_COSSIN:  # fp32 cos and sin over 2 x rope_dim / 2
        return num_layers * wl.seq_len * 2 * spec.rope_dim * FP32_BYTES
    table = wl.seq_len * (spec.rope_dim // 2) * COMPLEX64_PAIR_BYTES
    return table if wl.rope_cache is RopeCache.MODEL_COMPLEX else num_layers * table


def global_buffer_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                        num_layers: int) -> int:
    """Megatron-LM's global memory buffer as one pipeline stage's rank keeps it
    (``Workload.attention_global_buffer``: --transformer-impl local), in bytes. megatron-core's
    ``GlobalMemoryBuffer.get_tensor`` (utils.py, 0.16.1) keeps one tensor per (name, dtype),
    remade larger when a request outgrows it and never freed. Under the name "mpu" in the
    compute dtype it serves:

    - the core attention's baddbmm input (transformer/dot_product_attention.py
      ``DotProductAttention.forward``: shape (b * np, sq, sk), np the rank's query heads; the
      scores themselves are baddbmm's own output, beta 0), at every attention layer;
    - with sequence parallelism, the all-gathered input of Megatron's own tensor-parallel
      linears (tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``,
      forward and the weight gradient's re-gather: [s, b, h]), the local spec's
      column-parallel projections and the output layer.

    So it holds the larger of the two, from the first attention on. Megatron's core attention
    runs without context parallelism (its ``__init__`` asserts ``context_parallel_size == 1``).
    Traced: megatron-core's local-spec GPTModel (tests/traced/test_megatron_model.py),
    1,048,576 B at b 2, 8 heads, s 128, fp32."""
    if not wl.attention_global_buffer or num_layers <= 0:
        return 0
    b, s = wl.micro_batch_size, wl.seq_len
    scores = b * (spec.num_attention_heads // par.tp) * s * s
    gathered = s * b * spec.hidden_size if par.sequence_parallel and par.tp > 1 else 0
    return max(scores, gathered) * wl.compute_dtype.itemsize


def max_positions_rope_bytes(spec: ModelSpec) -> int:
    """One layer's RoPE buffers in torchtune up to 0.1 (``RopeCache.LAYER_MAX``):
    ``RotaryPositionalEmbeddings._rope_init`` registers ``theta``, head_dim / 2 frequencies
    made ``.float()``, and ``build_rope_cache`` a ``cache`` of ``torch.stack([cos, sin],
    dim=-1)`` over ``max_seq_len`` positions, shape (max_seq_len, head_dim / 2, 2), fp32
    whatever the default dtype (``idx_theta`` is ``.float()``) (modules/position_embeddings.py
    at 0914d5cf, ff594c23 and fef3ed10). ``lora_llama2_self_attention`` and ``llama2`` build
    one per layer module, which ``TransformerDecoder`` deep-copies per layer (``_get_clones``).
    Traced (torchtune 0.1.1, 4 layers, head_dim 64, max_seq_len 128): 131,584 B of buffers."""
    pairs = spec.rope_dim // 2
    return (spec.max_seq_len * pairs * 2 + pairs) * FP32_BYTES


def eager_mask_bytes(wl: Workload, dm: Dims) -> int:
    """Eager attention's additive causal mask, built once per forward and freed after it (in
    the weights' dtype: fp32 under autocast): one (s, s_kv) table, or one per sequence
    (``Workload.mask_per_sequence``: transformers' ``eager_mask`` is ``torch.where`` over the
    boolean mask expanded to (b, 1, s, s_kv); traced: tests/traced/test_frameworks.py,
    Llama eager under full recompute, 2 x 128 x 128 x 4 = 131,072 B saved)."""
    if wl.attention is not Kernel.EAGER:
        return 0
    return (dm.b if wl.mask_per_sequence else 1) * dm.s * dm.s_kv * dm.stream_e


def held_weights_bytes(spec: ModelSpec, wl: Workload, dm: Dims, block: object) -> int:
    """What a decoder layer keeps of its attention ``block``'s return beside the output
    (``Workload.attn_weights_held``): eager attention returns its probabilities
    (transformers' ``eager_attention_forward`` returns ``attn_output, attn_weights``, the
    value matmul's input after dropout, in the compute dtype; GPT-OSS's a view of the
    probabilities with the sink column), bound to ``_`` until the layer returns
    (``LlamaDecoderLayer.forward``); SDPA returns None. Without recompute the value matmul
    saves the same tensor; in a checkpointed forward, which saves nothing, they outlive the
    attention through the rest of the layer (traced: tests/traced/test_frameworks.py, Llama
    eager under full recompute, 2 x 8 x 128 x 128 x 4 = 1,048,576 B beside the MLP)."""
    if not (wl.attn_weights_held and wl.attention is Kernel.EAGER
            and isinstance(block, Attention)):
        return 0
    scores = _core(spec, wl, dm).scores  # b x heads x s x s_kv in the compute dtype
    return scores + (scores // dm.s_kv if spec.attn_sinks else 0)  # the sink column


def causal_mask_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """Eager attention's causal mask (``eager_mask_bytes``), none where the model's forward
    builds the sliding window's mask in its place (``ModelSpec.window_mask_alone``: the
    window's, ``window_mask_bytes``, is then every layer's)."""
    if spec.window_mask_alone and window_mask_bytes(spec, wl, dm):
        return 0
    return eager_mask_bytes(wl, dm)


def mask_terms(spec: ModelSpec, wl: Workload, dm: Dims) -> list[Term]:
    """Eager attention's causal mask (``causal_mask_bytes``) is an input of every
    checkpointed region, so with any recompute it is saved until the backward (once per
    micro-batch, shared by the layers)."""
    mask = causal_mask_bytes(spec, wl, dm)
    if wl.attention is Kernel.EAGER and wl.recompute is not Recompute.NONE and mask:
        return [Term("attn.causal_mask", mask)]
    return []


def eager_kept_moments(spec: ModelSpec, wl: Workload, dm: Dims
                       ) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
    """A checkpointed eager core's moments as changes of the attention's working-set moment
    (``Attention.working_set``: its core term, the largest of them), each with what a kept
    op output adds there (``eager.checkpointed_moments``; at the output projection
    ``eager.output_moment_adds``): for op-level checkpointing (``memplan.model.sac_ops.
    core_peak``)."""
    c = _core(spec, wl, dm)
    stream = dm.rows * spec.hidden_size * dm.e
    core = max(eager.forward_checkpointed(c) - stream, 2 * c.q)
    out = [(value - stream - core, tuple(adds.items()))
           for value, adds in eager.checkpointed_moments(c)]
    return out + [(2 * c.q - core, tuple(eager.output_moment_adds(c, dm.autocast).items()))]


def eager_held_item(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[str, int]:
    """The kept op output the decoder layer's later moments hold anyway (``eager.returned``:
    the probabilities the core returns, ``held_weights_bytes`` of them), and those bytes."""
    held = held_weights_bytes(spec, wl, dm, Attention())
    name = eager.returned(_core(spec, wl, dm), dm.autocast) if held else ""
    return name, held if name else 0


def eager_rerun_softmax(spec: ModelSpec, wl: Workload, dm: Dims) -> tuple[int, int]:
    """A rerun eager core's softmax of a 16-bit input (``softmax(dtype=float32)`` without
    autocast: the input copied to fp32 first), against its rebuild moment at the value matmul
    (``Attention.rebuild_moments``): the fp32 copy alive where the probabilities' cast is not
    yet, and the value matmul's output not yet made; (0, 0) where the softmax upcasts no
    copy."""
    c = _core(spec, wl, dm)
    if dm.autocast or c.masked >= c.sm:
        return 0, 0
    return c.sm - c.value_input, c.q
