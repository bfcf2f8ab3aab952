"""What a decoder layer saves for backward under torch.compile (Inductor), per block.

torchtitan compiles each decoder layer on its own (torchtitan/distributed/compile.py
``apply_compile``: ``transformer_block.compile(backend=..., fullgraph=True)``), after wrapping
it for activation checkpointing. Inductor's ``partition_fn`` (torch/_inductor/compile_fx.py)
splits each layer's joint graph with ``min_cut_rematerialization_partition``
(torch/_functorch/partitioners.py, torch 2.13), under the defaults of
torch/_functorch/config.py (``activation_memory_budget = 1.0``: no budget pass;
``ban_recompute_not_in_allowlist``, ``ban_recompute_materialized_backward``,
``ban_recompute_reductions``: all True). Its rules, in ``solve_min_cut``:

- ``should_ban_recomputation``: an op outside ``get_default_op_list``'s recomputable list
  (matmuls, SDPA) is never recomputed, so its output is saved when backward reads it: the
  gate and up projections' outputs (SiLU's and the product's backward read them);
- ``is_materialized_backwards``: a tensor a non-fusible backward op reads (a matmul's weight
  gradient, SDPA's backward) is banned from recomputation too, pointwise or not: every
  projection's input (each norm's output, the core's output, SiLU(gate) * up), SDPA's
  inputs (q and k after RoPE, v) and its logsumexp;
- ``ban_if_reduction``: an output 4x smaller than its inputs is saved (the norm's per-row
  statistics, rsqrt of the mean square);
- the rest, pointwise ops of the allowlist (casts, pow, mul, silu, add), is recomputed in
  backward from what is saved: a norm's fp32 copy of its input and its normalised tensor,
  SiLU(gate). A norm's input is a graph input (the layer's input) or the residual sum, which
  the min cut keeps as one saved tensor of its size (one operand, the other being the layer's
  input, saved anyway).

So per block (traced: tests/traced/test_compile_trace.py, transformers' LlamaDecoderLayer):
a norm saves its input, its statistics and its output, as a fused norm kernel does
(``NormImpl.FUSED``'s terms); attention with SDPA what it saves eagerly; a gated MLP its gate
and up outputs and their activated product, not the activation. Under full activation
checkpointing around the layer (torchtitan's order, checkpoint then compile) every node of the
forward is marked to recompute (``must_recompute``): the layer saves its inputs, as eagerly;
its forward holds its transients as Inductor schedules them, a gated MLP's activation fused
into its product, written into the gate output's buffer (``checkpointed_mlp_working_bytes``).
Under torchtitan's per-op SAC (``sac_kept``) the tagged outputs backward reads are saved.

Under autocast with fp32 weights (``Dims.autocast``; accelerate's ``prepare_model`` wraps the
forward in ``torch.autocast`` and compiles the wrapped model) autocast's casts are nodes of the
graph, under the same rules: the weights' low-precision casts are saved (the grad-input
matmuls read them), a norm's output as one cast (``linear.input_copies``), the MLP norm's
input as the output projection's output (``norm_input_e``); the fp32 norm output is fused
away (``norm_output_fused``) and no autocast cache exists (``casts_in_graph``); the MLP's
outputs (``mlp_outputs_bytes``), the checkpointed forward (``autocast_checkpointed_forward_
bytes``) and the backward's end (``autocast_end_bytes``) follow Inductor's buffers. The
backward's kernels are those without autocast plus casts (``swiglu_backward``): the SwiGLU
moments hold the incoming gradient's cast and free the down weight's (``autocast_grads``), and
the MLP's weight gradients run first or at the end, whichever peaks lower at the fused kernel
(``down_grad_deferred``, ``with_deferred_mlp``). Traced: tests/traced/test_compile_trace.py
(amp-bf16, amp-fp16), benchmarks/compiled_backward.py (amp-bf16, 2 x 128 to 2 x 1,024).
torchtitan's block (fused wqkv, its complex RoPE) follows the same rules under full recompute;
inside its per-op SAC the MLP kernel's moment holds the rerun's casts that policy leaves
(``autocast_sac_deferred``).

With norms after the mixers (``NormPlacement.POST``, transformers' Olmo2DecoderLayer) the
same rules give the saved set (each post norm: its input, a matmul's output, and its
statistics; q and k before their full-width norms, matmul outputs); the backward differs
from a pre-norm layer's by Inductor's kernels: a post norm's backward is one kernel writing
its input gradient (``post_norm_backward_bytes``), its weight gradient a reduction fused
with the other post norm's after the MLP's backward (``with_post_norm_schedule``: the MLP
post norm's input held through it), that input gradient a tensor of its own until the
down projection's grad-input matmul (``swiglu_moments``' ``post_grad``); rebuilt inside
the graph, the rerun runs the whole MLP for that norm's backward (``rerun_whole_mlp``), and
the checkpointed forward holds the q/k norms' statistics at RoPE's kernel
(``qk_norm_stats_bytes``). With sandwich norms (Gemma2DecoderLayer) the pre-feedforward
norm's input is recomputed from tensors saved anyway (``norm_input_e``) and the MLP post
norm's weight gradient runs at its own backward; rebuilt inside the graph, its GeGLU's
backward runs in the order of a layer not rebuilt (``swiglu_backward``), the rerun keeps
the pre-feedforward norm's fp32 normalised input (``sandwich_rerun_norm_bytes``) and the
checkpointed forward the post-attention norm's statistics (``sandwich_sum_stats_bytes``).
Traced: tests/traced/test_compile_trace.py (bf16, 2 x 256), benchmarks/compiled_backward.py
(2 x 64, 2 x 256, 2 x 1,024), the rebuilt layer with Inductor's GPU realization rules
(``memplan.profile.compiled_trace._gpu_realization``: on CPU the rerun also keeps GELU's
fp32 ``tanh``, which a GPU's lowering inlines).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from memplan.model import linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import COMPLEX64_PAIR_BYTES, FP32_BYTES, INDEX_BYTES, Dims, Term
from memplan.model.sac import recomputed as sac_recomputed
from memplan.spec import (
    ActivationImpl,
    MlpKind,
    ModelSpec,
    MoESpec,
    NormPlacement,
    PositionKind,
    QkNorm,
)
from memplan.workload import (
    Attention,
    AttentionImpl,
    Float8Recipe,
    MoeImpl,
    NormImpl,
    Recompute,
    RopeCache,
    SelectiveImpl,
    TeFp8Recipe,
    Workload,
)

if TYPE_CHECKING:
    from memplan.model.layer import LayerMoment

# Inductor's buffer reuse in the compiled forward: the residual add after the MLP is the last
# reader of the down projection's output, of the same size and dtype, so it writes its result
# in place (torch/_inductor/scheduler.py ``BaseSchedulerNode.decide_inplace_update``,
# codegen/wrapper.py ``codegen_inplace_reuse``): one residual-sized tensor where eager holds
# two (traced: the layer's forward ends with one buffer beyond its saved set). After
# attention the add cannot: the output projection's output is saved.
MLP_OUTPUTS = 1


def layer_workload(wl: Workload) -> Workload:
    """The workload a compiled decoder layer's blocks read: its norms save what a fused norm
    saves (input, statistics, output; the fp32 copy and the normalised tensor recomputed).
    The final norm and the head run eagerly (torchtitan compiles the layers alone) and read
    ``wl`` itself."""
    if not wl.compile or wl.norm_impl is NormImpl.FUSED:
        return wl
    return wl.model_copy(update={"norm_impl": NormImpl.FUSED})


def norm_input_e(prefix: str, dm: Dims, spec: ModelSpec | None = None) -> int:
    """Bytes per element of what a norm saves as its input (``NormImpl.FUSED``'s term):
    the residual stream's, but compiled the MLP norm's input, the residual sum ``x +
    attn_out``, is an add of the allowlist, recomputed in backward from the layer's input
    (saved anyway, the first norm's) and the output projection's output (a matmul's, never
    recomputed: ``should_ban_recomputation``), which the min cut saves in its place: in the
    compute dtype. Without autocast the same size; under autocast the sum is fp32 (the
    projection's low-precision output promoted by the fp32 stream) and half as large is
    saved (traced: tests/traced/test_compile_trace.py, amp-bf16 and amp-fp16: ``mm_3``,
    T x h in bf16/fp16). With sandwich norms (``NormPlacement.SANDWICH``, transformers'
    Gemma2DecoderLayer: ``residual + post_attention_layernorm(attn_out)``) the sum is
    recomputed from the layer's input and the post-attention norm's saved input (the output
    projection's output) and statistics, all saved anyway: nothing (``spec``: the layer's;
    traced: benchmarks/compiled_backward.py, Gemma 2's layer, bf16: the saved set holds no
    tensor for it). A sandwich layer's post norms read a projection's output (the output
    projection's, the down projection's), saved as it is, in the compute dtype: under
    autocast half the fp32 stream's size (traced: tests/traced/test_compile_trace.py, Gemma
    2's layer, amp-bf16: ``mm_3`` and ``mm_6``, T x h in bf16)."""
    if (dm.compiled and prefix == "mlp_norm" and spec is not None
            and spec.norm_placement is NormPlacement.SANDWICH):
        return 0
    if (dm.compiled and prefix in ("attn_post_norm", "mlp_post_norm") and spec is not None
            and spec.norm_placement is NormPlacement.SANDWICH):
        return dm.e  # a projection's output
    return dm.e if dm.compiled and prefix == "mlp_norm" else dm.stream_e


def norm_output_fused(dm: Dims) -> bool:
    """Compiled under autocast, whether a norm's fp32 output exists: not, its pointwise ops
    (the upcast, the square, the scaling, the weight's multiply) and autocast's cast of the
    output to the compute dtype are fused into one kernel (torch/_inductor/scheduler.py
    ``Scheduler.fuse_nodes``), which writes the cast alone (traced: tests/traced/
    test_compile_trace.py, amp-bf16: the forward's peak holds no fp32 norm output)."""
    return dm.compiled and dm.autocast


def casts_in_graph(dm: Dims) -> bool:
    """Compiled under autocast, autocast's casts are nodes of the traced graph
    (``convert_element_type``, AOTAutograd traces through the autocast dispatch key), freed
    after their last reader or saved by the partitioner, not kept in autocast's runtime cache
    (``cached_cast``, aten/src/ATen/autocast_mode.cpp), which no compiled kernel calls: a
    checkpointed compiled layer holds its input alone after its forward (traced:
    tests/traced/test_compile_trace.py, amp-bf16 inside full checkpointing)."""
    return dm.compiled and dm.autocast


def mlp_outputs_bytes(stream: int, dm: Dims) -> int:
    """Compiled, the MLP's outputs at its residual add (``stream``: rows x h in the compute
    dtype): the add written in place into the down projection's output
    (``MLP_OUTPUTS``); under autocast it cannot be, the add's output being fp32 and the down
    projection's low-precision (``decide_inplace_update`` reuses a buffer of the same size
    and dtype alone): both, the fp32 sum beside the projection's output (traced:
    tests/traced/test_compile_trace.py, amp-bf16: the forward's peak)."""
    if dm.autocast:
        return stream + stream // dm.e * dm.stream_e
    return MLP_OUTPUTS * stream


def autocast_end_bytes(spec: ModelSpec, dm: Dims) -> int | None:
    """Compiled under autocast, what the layer's backward holds at its end beside all of the
    layer's weight gradients (in the parameters' dtype) and the incoming gradient; None
    otherwise. Inductor's ``reorder_for_peak_memory`` (torch/_inductor/memory.py, on by
    default: torch/_inductor/config.py) moves, where the token count is small against the
    MLP's width (``down_grad_deferred``; elsewhere a bound of the end, under the fused
    kernel's moment), the MLP's weight-gradient matmuls and their
    casts to the parameters' fp32 after the attention's backward, at the graph's end (graph
    outputs, alive to its return wherever they are made): the three matmuls, then the three
    casts, each freeing its low-precision source, so at the last cast (the up projection's,
    ``mlp.mlp_linears``' first; more than at the first, which holds two fp32 gradients fewer
    and two low-precision ones more) its low-precision gradient, h x f / t in the compute
    dtype, is alive beside every fp32 gradient and the layer input's gradient (the fp32
    stream). Traced: tests/traced/test_compile_trace.py,
    amp-bf16, one kernel per scheduler node (``memplan.profile.compiled_trace.
    _kernel_per_node``): the backward's peak. Without autocast no cast follows the matmuls;
    the eager moments stand for the backward (over the traced peak by 1.6%, fp32)."""
    if not (dm.compiled and dm.autocast):
        return None
    return (dm.stream(spec.hidden_size)
            + spec.hidden_size * spec.ffn_hidden_size // dm.tp * dm.e)


def autocast_checkpointed_forward_bytes(spec: ModelSpec, dm: Dims) -> int | None:
    """Compiled under autocast with the checkpoint inside the compiled graph (torchtitan's
    order; not ``in_checkpoint``): the forward saves the layer's input alone and frees each
    tensor after its last reader, so its peak, beside the input, is at the MLP's
    activation kernel, which also writes the down projection's weight cast (fused with
    SiLU(gate) * up, the product written into the gate output's buffer:
    ``decide_inplace_update``): the output projection's output (kept for the residual add
    at the layer's end, the residual sum recomputed in that add), the MLP norm's cast (the
    gate and up matmuls' input), the gate and up outputs (T x f / t each) and the down
    weight's cast (h x f / t), all in the compute dtype. Traced: tests/traced/
    test_compile_trace.py, amp-bf16 inside full checkpointing (beside it the CPU generator's
    state the checkpoint saves, 5,056 B, not counted: a CUDA generator's is a seed and an
    offset). A fused gate/up projection (``_fused_gate_up_kernel``: Phi-3's) peaks at its
    matmul, beside the output projection's output and the MLP norm's cast, its weight's cast
    (2 h x f / t) and its output (2 T x f / t), or at the product's kernel (the product a
    buffer of its own), the norm's cast freed by then: the output projection's output and
    three T x f / t (traced: benchmarks/compiled_backward.py, Phi-3's layer, amp-bf16 inside
    full checkpointing, 2 x 256 tokens the matmul's 3,276,800 B, 2 x 1,024 the kernel's
    12,058,624 B, each with the CPU generator's state besides; memplan was 14.1% and
    17.9% under with the separate projections' moment). With sandwich norms (Gemma 2's and
    3's layers) the residual sum at the layer's end is recomputed from the output
    projection's output through the post-attention norm, whose statistics (rows fp32) are
    held beside it (traced: Gemma 2's layer, amp-bf16, 2 x 256 tokens: ``buf23``, written by
    the pre-feedforward norm's kernel, read by the last). None where it does not apply."""
    if not (dm.compiled and dm.autocast):
        return None
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    out = dm.rows * spec.hidden_size * dm.e  # the output projection's, the MLP norm's cast
    cast = spec.hidden_size * spec.ffn_hidden_size // dm.tp * dm.e  # one h x f weight's
    stats = dm.rows * FP32_BYTES if spec.norm_placement is NormPlacement.SANDWICH else 0
    if _fused_gate_up_kernel(spec, dm):
        return stats + max(2 * out + 2 * inner + 2 * cast, out + 3 * inner)
    return 2 * out + 2 * inner + cast + stats


def checkpointed_mlp_working_bytes(spec: ModelSpec, dm: Dims,
                                   linears: Sequence[linear.Linear]) -> int | None:
    """Compiled without autocast, what a gated MLP with its own gate and up projections
    (``linears``: ``mlp.mlp_linears``) holds beside its input (the MLP norm's output) in a
    checkpointed forward, the checkpoint inside the compiled graph (every node recomputed,
    nothing saved): its gate and up outputs, T x f / t each. The activation's pointwise ops
    and the product are one kernel (torch/_inductor/scheduler.py ``Scheduler.fuse_nodes``:
    SiLU(gate) is no buffer of its own) that writes SiLU(gate) * up into the gate output's
    buffer, its last reader of the same size and dtype (``BaseSchedulerNode.
    decide_inplace_update``), and frees up's; at the down projection the product and its
    output (T x h), the norm's output freed by then (its last reader up's matmul), under the
    gate and up outputs beside that norm output. Eager holds three T x f (``_working_bytes``:
    the activation's output beside both). Traced: tests/traced/test_compile_trace.py, fp32
    and bf16 inside full checkpointing (the forward's peak at up's matmul: the layer's input,
    the output projection's output, which the residual sums are recomputed from, the MLP
    norm's output, gate and up), as ``autocast_checkpointed_forward_bytes`` under autocast
    less its down-weight cast. A fused gate/up projection (``_fused_gate_up_kernel``): the
    product's kernel beside the fused output, three T x f / t less the norm's output, freed
    (traced: Phi-3's layer, bf16, 2 x 256 tokens: the o_proj output, the fused output and the
    product, 3,019,712 B with the CPU generator's state, memplan 5,056 B under as for the
    separate projections). None elsewhere: under autocast (that function), an activation
    formula of several ops (gelu_new, xIELU), or adapters (untraced). With torchao's
    ``Float8Linear``s (``float8_gate_held``) the kernel writes
    the product's float8 cast for the down projection (``hp_tensor_to_float8_dynamic`` fused
    in: T x f / t float8 and its scales) and no bf16 product, beside gate and up (traced:
    benchmarks/compiled_backward.py, torchtitan's block, torchao 0.18.0, full recompute at
    2 x 1,024 tokens, tensorwise 8,917,956 B: memplan 5,060 B under, the CPU generator's
    state and a scale; eager's three T x f counted before, +17.6%)."""
    if float8_gate_held(spec, dm, linears) and linear.float8_converts(linears[-1], dm):
        # the product's kernel writes its float8 cast for the down projection alone
        elements = dm.tokens * spec.ffn_hidden_size // dm.tp
        scales = dm.tokens if dm.float8 is Float8Recipe.ROWWISE else 1
        return (2 * elements * dm.e + elements * linear.FLOAT8_BYTES
                + scales * linear.FLOAT8_SCALE_BYTES)
    if any(linear.float8_converts(lin, dm) for lin in linears):
        return None
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    if _fused_gate_up_kernel(spec, dm) and not dm.autocast:
        # one gate/up buffer (2 T x f / t) whose halves the kernel reads: the product gets a
        # buffer of its own (no in-place reuse: not the size of its input), the MLP norm's
        # output freed by then (its last reader the fused matmul): the product's kernel,
        # beside that output's place (``_fused_gate_up_kernel``: traced)
        return max(2 * inner, 3 * inner - dm.rows * spec.hidden_size * dm.e)
    if not _plain_gated(spec, dm):
        return None
    return 2 * inner


def _fused_gate_up_kernel(spec: ModelSpec, dm: Dims) -> bool:
    """A compiled gated MLP with one fused gate/up projection (Phi-3's ``gate_up_proj``,
    ``chunk(2, dim=-1)``), the activation one aten op, plain linears: ``_gated_kernel``'s
    conditions but for the fused projection. Traced: tests/traced/test_compile_trace.py
    ``test_compiled_fused_gate_up_layer``, Phi-3's layer in bf16 at 2 x 256 tokens: without
    recompute the eager order's moments (the down weight's gradient first, the product freed,
    its gradient, then the kernel writing the fused gradient beside the saved gate/up output,
    2 T x f more) are the trace's, exact; rebuilt inside the graph the SwiGLU kernels'
    (``swiglu_moments``: the rerun's gate/up matmul, the product's gradient, the kernel
    writing the product and the fused gradient: six T x f), exact; its checkpointed forward
    peaks at the product's kernel (``checkpointed_mlp_working_bytes``)."""
    return (dm.compiled and spec.mlp.gated and spec.fused_gate_up
            and spec.activation_impl is ActivationImpl.KERNEL and dm.adapters is None
            and dm.te_fp8 is TeFp8Recipe.NONE)


def _plain_gated(spec: ModelSpec, dm: Dims) -> bool:
    """A compiled gated MLP as traced without autocast (``_gated_kernel``)."""
    return _gated_kernel(spec, dm) and not dm.autocast


def _gated_kernel(spec: ModelSpec, dm: Dims) -> bool:
    """A compiled gated MLP as traced: its own gate and up projections, the activation one
    aten op, plain linears (no adapters, no Transformer Engine fp8; float8 is each caller's
    test), with or without autocast."""
    return (dm.compiled and spec.mlp.gated and not spec.fused_gate_up
            and spec.activation_impl is ActivationImpl.KERNEL and dm.adapters is None
            and dm.te_fp8 is TeFp8Recipe.NONE)


def mlp_terms(terms: list[Term], gated: bool) -> list[Term]:
    """A dense MLP's saved terms compiled, from its eager ones (``memplan.model.mlp``): gated,
    the activation's output is recomputed (SiLU/GELU of the saved gate output, fusible, read by
    no matmul of backward); ungated, what the second linear and the activation's backward read
    (the first linear's output and the activation's), transformers' gelu_new formula's
    intermediate factors recomputed."""
    if gated:
        return [t for t in terms if not t.name.endswith(".act")]
    return [t for t in terms if t.name.rpartition(".")[2] in ("fc1", "act")]


def swiglu_backward(spec: ModelSpec, dm: Dims, recompute: Recompute) -> bool:
    """Whether ``swiglu_moments`` gives a dense MLP's backward: a compiled gated MLP as
    traced (``_gated_kernel``, with or without autocast), SwiGLU, no float8, no dropout, and
    the block rebuilt whole or not recomputed (``recompute`` NONE: a layer without
    recompute, a full recompute's rerun, per-op SAC's full recompute). Under autocast the
    backward's kernels are the same (traced: benchmarks/compiled_backward.py, transformers'
    layer, amp-bf16, 2 x 256 and 2 x 1,024 tokens, without recompute and inside full
    checkpointing): the casts autocast put in the forward add a cast of the incoming
    gradient to the compute dtype before the down projection's matmuls and a cast of each
    weight gradient to the parameters' dtype after its matmul (``_to_copy`` kernels of their
    own), nothing inside the activation's fused kernel, whose inputs and outputs are all in
    the compute dtype (``autocast_grads``). GeGLU (a one-op GELU, transformers'
    ``gelu_pytorch_tanh``) not rebuilt: the same kernels (traced: benchmarks/
    compiled_backward.py, Gemma 2's layer, bf16, no recompute:
    ``cpp_fused__unsafe_view_gelu_gelu_backward_mul_view_2`` writing up's gradient into up's
    buffer and the gate's anew); rebuilt with sandwich norms (Gemma 2's layer, full
    recompute: ``rerun_whole_mlp``) the same kernels in the order of a layer not rebuilt
    (``cpp_fused__unsafe_view_gelu_gelu_backward_mul_view_12``). Its CPU rerun keeps GELU's
    fp32 ``tanh`` for that kernel, a CPU heuristic of Inductor's, not a GPU's
    (``sandwich_rerun_norm_bytes``); rebuilt after pre norms (Gemma 1's layer, exact and tanh
    GELU, full recompute, 2 x 256 tokens) the same kernels: gate's and up's rerun matmuls and
    the product's gradient matmul, then ``cpp_fused__unsafe_view_gelu_gelu_backward_mul_view_6``
    writing the product and both input gradients (six T x f beside the rebuilt set), the
    down projection's weight gradient after it: 7,884,800 B traced, memplan exact (the eager
    order's moments were 9.1% under)."""
    return ((_gated_kernel(spec, dm) or _fused_gate_up_kernel(spec, dm) and dm.rerun)
            and spec.mlp in (MlpKind.SWIGLU, MlpKind.GEGLU)
            and spec.dropout == 0
            and dm.float8 is Float8Recipe.NONE and recompute is Recompute.NONE)


def autocast_grads(dm: Dims, stream: int, out_cast: int) -> tuple[int, int]:
    """Compiled under autocast, the two tensors of the MLP's backward that its autocast casts
    make differ (0, 0 without): (the down projection's weight cast, ``out_cast``, saved for
    its grad-input matmul, which frees it: the wrapper's ``del`` after a buffer's last
    reader, torch/_inductor/codegen/wrapper.py ``FreeIfNotReusedLine``, before the
    activation's kernel; the incoming gradient's cast to the compute dtype, ``stream``: rows x
    h in the compute dtype, the down projection's matmuls' operand, the backward of
    autocast's ``_to_copy`` of that matmul's output: alive until the down projection's
    weight gradient, which a rebuilt layer runs after the activation's kernel). The weight
    gradients' bf16 outputs are cast to fp32 each right after its matmul and freed (traced
    with ``swiglu_backward``'s cases: at the activation's kernel the down projection's
    gradient exists in fp32 alone). With a norm after the MLP (``swiglu_moments``'
    ``post_grad``) that norm's backward writes the down projection's output gradient in the
    compute dtype, the matmuls' operand: no cast (``stream`` 0; traced: Gemma 2's and 3's
    layers, amp-bf16, 2 x 256 tokens, without recompute: memplan one rows x h over before)."""
    return (out_cast, stream) if dm.compiled and dm.autocast else (0, 0)


def down_grad_deferred(dm: Dims, inner: int, cast: int, fresh: int) -> bool:
    """Compiled under autocast, the layer not rebuilt: whether Inductor runs the MLP's weight
    gradients after the attention's backward (``autocast_end_bytes``), the down projection's
    among them, rather than first. ``reorder_for_peak_memory`` (torch/_inductor/memory.py)
    keeps the order of the lowest estimated peak among the scheduler's own (``baseline``:
    the down weight's gradient first) and three topological sorts, of which
    ``topological_sort_dfs`` defers it (traced: benchmarks/compiled_backward.py,
    transformers' layer, amp-bf16, 2 x 128, 2 x 192, 2 x 256 tokens, Inductor's own log of
    each method's estimate). Both orders peak at the activation's fused kernel; they differ
    there by what the deferral keeps and frees: first, the down weight's gradient in the
    parameters' dtype is alive (``fresh`` elements) and the product and the incoming
    gradient's cast (``cast``) are freed; deferred, the reverse. The estimates traced
    differ by exactly that (2 x 128: dfs 327,680 B lower; 2 x 192: 32,768 B lower; 2 x 256:
    262,144 B higher), so the lower of the two is Inductor's choice. Without autocast no
    cast and no deferral traced (``swiglu_moments``' order). With a norm after the MLP
    (sandwich norms) dfs defers that norm's weight-gradient reduction too, holding its
    saved input and statistics, its gradient not made (their net bytes are in ``cast``,
    with the down projection's output gradient, a buffer of its own there): traced,
    Gemma 2's layer, h 384, 3 x 160 tokens, dfs 74,112 B above the baseline, exactly
    that difference, and the baseline kept (memplan -5.6% before, deferring)."""
    return (dm.autocast and not dm.rerun
            and fresh * dm.stream_e > inner + cast)


def _mlp_deferral_sizes(spec: ModelSpec, dm: Dims) -> tuple[int, int, int]:
    """(T x f in the compute dtype, the incoming gradient's cast, what a norm after the MLP
    holds through its deferred reduction: its saved input and statistics) of a layer."""
    inner = dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    cast = dm.rows * spec.hidden_size * dm.e
    kept = cast + dm.rows * FP32_BYTES if spec.norm_placement.post_norm else 0
    return inner, cast, kept


def mlp_grads_deferred(spec: ModelSpec, wl: Workload, dm: Dims) -> bool:
    """Whether Inductor defers a compiled SwiGLU layer's MLP weight gradients to the
    backward's end (``down_grad_deferred``, read for the layer's sizes); False: its baseline
    order, the MLP's weight gradients first."""
    inner, cast, kept = _mlp_deferral_sizes(spec, dm)
    fresh = spec.hidden_size * spec.ffn_hidden_size // dm.tp
    return (swiglu_backward(spec, dm, Recompute.NONE) and not in_checkpoint(wl)
            and down_grad_deferred(dm, inner,
                                   cast + (kept and kept - spec.hidden_size * dm.stream_e),
                                   fresh))


def with_deferred_mlp(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                      dm: Dims) -> list[LayerMoment]:
    """``moments`` (a layer's backward, from its last block's) where Inductor defers the
    MLP's weight gradients to the backward's end (``down_grad_deferred``): after the MLP's
    own moments, until the end (``autocast_end_bytes``), none of its fp32 weight gradients
    exists, and what their matmuls read is alive: the product, the gate and up outputs'
    gradients, the incoming gradient's cast and, once the MLP norm's backward has run, its
    saved output (traced: 2 x 128 and 2 x 192 tokens, ``down_grad_deferred``'s cases: the
    wrapper frees each at its last reader, the deferred matmul)."""
    if not mlp_grads_deferred(spec, wl, dm):
        return list(moments)
    inner, cast, kept = _mlp_deferral_sizes(spec, dm)
    out = []
    for m in moments:
        if m.name != "compiled_end" and ("mlp" in m.grads_before
                                         and not m.name.startswith("mlp_")
                                         or m.name == "mlp_norm"):
            held = 3 * inner + cast + (cast if "mlp_norm" in m.grads_before else 0) + kept
            m = m._replace(alive_bytes=m.alive_bytes + held, grads_before=tuple(
                g for g in m.grads_before if g not in ("mlp", "mlp_out")))
        out.append(m)
    return out


def swiglu_moments(wl: Workload, dm: Dims, saved: int, inner: int, grad_inputs: int,
                   fresh: int, out_cast: int = 0, whole: bool = False,
                   post_grad: int = 0, scaled_grad: int = 0) -> list[BackwardMoment]:
    """A compiled SwiGLU MLP's backward as Inductor schedules it (one kernel per scheduler node, as
    a GPU backend launches them; traced on CPU: benchmarks/compiled_backward.py, torchtitan 0.3's
    block and transformers' layer at 2 x 1,024 tokens): the activation's and the product's backward
    one fused kernel reading gate, up and the product's gradient.

    - The product saved (the layer not recomputed, or checkpointed outside the compiled graph:
      ``in_checkpoint``): the down projection's weight gradient first, its input (the saved
      product) freed after it, then the input gradient, then the kernel, which writes one gradient
      into up's buffer (a saved input at its last reader: Inductor's in-place reuse,
      ``decide_inplace_update``) and one new: ``saved`` less the product plus two ``inner``, never
      above the down projection's moment (``mlp``).
    - Fully recomputed inside the compiled graph (torchtitan's order, ``Dims.rerun``): the rerun
      makes gate and up but not their product; the kernel writes the product (for the down weight's
      gradient) and both gradients, three new ``inner`` tensors beside gate, up and the input
      gradient, before any of the MLP's weight gradients: its peak at 2 x 1,024 tokens (torchtitan
      bf16 25,772,032 B traced, the eager order's moments 23,019,520 B). Then the down weight's
      gradient (gate, up and the input gradient freed), then the input projections' as eagerly
      (``mlp_in``).
    ``saved``: the block's saved bytes (the product among them: the rerun holds it by the time the
    kernel has run). Under autocast (``out_cast``: the down projection's saved weight cast) what
    ``autocast_grads`` adds: the weight cast freed from the kernel on, the incoming gradient's cast
    (``grad_inputs`` / 2 is rows x h in the compute dtype) alive until the down weight's gradient;
    not rebuilt, the down projection's moment is its grad-input matmul, the product freed by the
    weight gradient's matmul before it (the order traced: ``mm(grad.T, product)``, ``del`` product,
    ``mm(grad, weight_cast)``; its weight gradient counted in the parameters' dtype, where the
    trace holds the compute dtype's until the cast after: h x f / t x (4 - 2) B over there, never
    the peak traced). ``whole``: the rerun ran the whole MLP (``rerun_whole_mlp``), a layer not
    rebuilt's order. ``post_grad``: with a norm after the MLP (``NormPlacement.POST``), that norm's
    input gradient (the down projection's output gradient, rows x h, a tensor of its own where a
    pre-norm layer's is the residual gradient itself), alive until the down projection's grad-input
    matmul; the down projection's moment is that matmul's, the product freed by the weight
    gradient's matmul before it and its gradient made (traced: OLMo 2's layer, bf16, 2 x 1,024
    tokens, without recompute and rebuilt: the product's gradient in its buffer); deferred, it and
    the norm's input and statistics held (``kept``). ``scaled_grad``: ``scaled_residual_grad``."""
    freed, cast = autocast_grads(dm, 0 if post_grad else grad_inputs // 2, out_cast)
    rebuilt = dm.rerun and not in_checkpoint(wl) and not whole
    kept = 2 * post_grad + dm.rows * FP32_BYTES if post_grad else 0  # ``down_grad_deferred``
    held = kept and kept - post_grad // (dm.rows * dm.e) * dm.stream_e  # (its grad not made)
    # the scaled gradient: not rebuilt as ``post_grad``, rebuilt as the incoming gradient's cast
    post_grad, cast = post_grad + scaled_grad * (not rebuilt), cast + scaled_grad * rebuilt
    last = BackwardMoment("mlp_in", 0, grad_inputs + inner, ("mlp",), fresh)
    if not rebuilt and down_grad_deferred(dm, inner, cast + held, fresh):
        # gate freed by the kernel, its and up's gradients kept for the deferred ones
        return [BackwardMoment(n, saved + kept - f, t, ()) for n, f, t in (
            ("mlp", 0, inner + cast), ("mlp_act", freed, 2 * inner + cast),
            ("mlp_in", freed + inner, cast + inner + grad_inputs))]
    if not rebuilt:
        # at the down projection's grad-input matmul, the product freed before (see above)
        product = inner if dm.autocast or post_grad else 0
        return [BackwardMoment("mlp", saved - product, inner + cast + post_grad, ("mlp_out",),
                               fresh, inner - product),
                BackwardMoment("mlp_act", saved - inner - freed, 2 * inner, ("mlp_out",)),
                last]
    return [BackwardMoment("mlp_act", saved - freed, 3 * inner + cast, ()),
            BackwardMoment("mlp", saved - 2 * inner - freed, 2 * inner + cast, ("mlp_out",),
                           fresh, inner),
            last]


def scaled_residual_grad(spec: ModelSpec, dm: Dims) -> int:
    """With a scaled residual (``ModelSpec.scaled_residual``, Granite's ``residual +
    hidden_states * residual_multiplier``), the compiled MLP's output gradient: the incoming
    gradient times the multiplier, a rows x h tensor of its own made first
    (``cpp_fused_mul_view_0``); 0 elsewhere. ``swiglu_moments`` holds it, not rebuilt, until
    the down projection's grad-input matmul (as ``post_grad``), rebuilt through the kernel
    until the down weight's gradient after it (its buffer then reused for up's input
    gradient). Traced: tests/traced/test_compile_trace.py ``test_compiled_scaled_residual_
    layer``, Granite's layer, bf16, 2 x 256 tokens: rebuilt 7,753,728 B, memplan exact (one
    rows x h under before, -3.4%); not rebuilt exact either way (never the peak). Under
    autocast the multiply is fused into the kernel of autocast's cast of the incoming fp32
    gradient to the compute dtype (``autocast_grads``' ``stream``), which writes the scaled
    cast alone: nothing more (traced: tests/traced/test_compile_trace.py
    ``test_compiled_autocast_hf_layers``, amp-bf16, 2 x 256 tokens, none and full: the Llama
    layer's peaks, memplan one rows x h over before, +0.8% and +2.8%)."""
    return dm.rows * spec.hidden_size * dm.e if spec.scaled_residual and not dm.autocast else 0


def post_norm_backward_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Compiled, a post norm's backward (a norm on a mixer's output before the residual add:
    ``NormPlacement.POST``, transformers' Olmo2DecoderLayer.forward, Olmo2RMSNorm.forward)
    beside its incoming gradient: one Inductor kernel (torch/_inductor/scheduler.py
    ``Scheduler.fuse_nodes``: the upcast, the weighted gradient, the per-row dot product
    and the input gradient's cast) writing its input gradient, rows x h in the compute dtype,
    and the fp32 per-row sums it reads back (rows x 4 B, freed after it). Its weight's
    gradient is another kernel (``with_post_norm_schedule``). Traced: benchmarks/
    compiled_backward.py, transformers' OLMo 2 layer, bf16, 2 x 1,024 tokens: the kernel's
    ``buf2`` (T fp32) and ``buf3`` (T x h bf16) beside the saved set."""
    return dm.rows * spec.hidden_size * dm.e + dm.rows * FP32_BYTES


def rerun_whole_mlp(spec: ModelSpec, dm: Dims) -> bool:
    """A compiled layer rebuilt inside the graph (full AC, ``Dims.rerun``) with a norm after
    its MLP (``NormPlacement.post_norm``): that norm's backward reads its input, the down
    projection's output, so the rerun runs the whole MLP, the product included, where a
    pre-norm layer's rerun stops at gate and up (``swiglu_moments``). Inductor's rerun kernel
    writes the product alone (SiLU(gate) inlined into it and into the backward's fused
    kernel, as a GPU lowers it), and the backward then runs in the order of a layer not
    rebuilt: the down weight's gradient first, the product's buffer reused for its
    gradient, the fused kernel writing up's gradient into up's buffer
    (``decide_inplace_update``) and the gate's anew. Traced with Inductor's GPU realization
    rules (``compiled_layer_step(gpu_realize=True)``): benchmarks/compiled_backward.py,
    transformers' OLMo 2 layer, bf16, full recompute, 2 x 256 tokens
    (``cpp_fused__unsafe_view_mul_silu_7(buf20, buf21, buf22)``: gate and up in, the
    product ``buf22`` out; ``cpp_fused__unsafe_view_mul_silu_silu_backward_view_9``: the
    gate's gradient ``buf31`` new, up's in up's ``buf21``). On CPU the kernel also writes
    SiLU(gate) as a buffer, alive until the backward's kernel writes the gate's gradient
    into it: a reused pointwise value with a heavy op (``sigmoid``) realized on CPU alone
    (torch/_inductor/ir.py ``StorageBox.should_realize_on_reuse``, torch 2.13), not
    modelled (the CPU rules' trace: 2 x 256 tokens T f 2 higher before the MLP's kernel)."""
    return dm.compiled and dm.rerun and spec.norm_placement.post_norm


def qk_norm_stats_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Compiled and checkpointed inside the graph (nothing saved), what a full-width q/k
    norm (``QkNorm.FULL``: transformers' Olmo2Attention.q_norm / k_norm, Olmo2RMSNorm over
    heads x head_dim) adds to RoPE's moment of the forward: each norm's mean square is a
    reduction kernel of its own (``cpp_fused__to_copy__unsafe_view_mean_pow_0``, fp32 per
    row) and its normalisation is fused into RoPE's kernel, so both statistics (rows x 4 B
    each) are alive until the kernel that writes the rotated q and k (traced:
    benchmarks/compiled_backward.py, transformers' OLMo 2 layer, bf16, full recompute:
    2 x 64 tokens 1,024 B and 2 x 1,024 tokens 16,384 B beside the rotation's buffers);
    0 elsewhere."""
    if not (dm.compiled and spec.qk_norm is QkNorm.FULL):
        return 0
    return 2 * dm.rows * FP32_BYTES


def with_post_norm_schedule(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                            dm: Dims, recompute: Recompute) -> list[LayerMoment]:
    """A compiled layer's backward (``moments``, in backward order) with post norms
    (``NormPlacement.POST``) as Inductor schedules it. Each post norm's weight gradient is a
    reduction over the rows of its incoming gradient times its normalised input, a kernel
    apart from its input gradient's (``post_norm_backward_bytes``), and the scheduler fuses
    the MLP post norm's reduction with the attention post norm's (both read the MLP's input
    gradients' sum), after the MLP's backward: the MLP post norm's saved input (the down
    projection's output, rows x h) and statistics (rows fp32) stay alive through the MLP's
    moments, and its weight gradient does not exist there (traced: benchmarks/
    compiled_backward.py, transformers' OLMo 2 layer, bf16, 2 x 1,024 tokens:
    ``cpp_fused__to_copy__unsafe_view_add_mul_sum_view_3`` frees ``mm_6`` and ``rsqrt_3``
    before the attention post norm's input-gradient kernel). Rebuilt inside the graph
    (``rerun_whole_mlp``) no SiLU(gate) buffer (a GPU's lowering inlines it; CPU's alone
    realizes it). With sandwich norms (Gemma 2's layer) not rebuilt the same: the MLP post
    norm's reduction fused with the other norms' after the attention's backward (traced with
    Inductor's GPU realization rules: benchmarks/compiled_backward.py, Gemma 2's layer, bf16,
    no recompute, 2 x 1,024 tokens: ``cpp_fused__to_copy__unsafe_view_add_mul_sum_view_6``
    frees ``mm_6`` and ``rsqrt_3``). On CPU the reduction runs first, its input gradient then
    written into its saved input's buffer (``cpp_fused__to_copy__unsafe_view_mul_sum_view_0``,
    ``decide_inplace_update``): nothing held, 1,056,256 B under the GPU rules' trace there;
    the CPU's read and op-count thresholds (torch/_inductor/ir.py
    ``StorageBox.has_exceeded_max_reads``, ``Loops.has_large_inner_fn``:
    ``config.realize_cpu_acc_reads_threshold`` 12, ``realize_cpu_opcount_threshold`` 50
    against a GPU's 8 and 30, torch 2.13; either set as a GPU's gives the GPU's schedule)
    leave a value inlined that a GPU realizes, and the fusion follows. Rebuilt (full
    recompute inside the graph) that reduction runs at its own backward, before the MLP's
    (``cpp_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_sum_view_11`` after the input
    gradient's kernel, GPU rules): nothing held; the pre-feedforward norm's fp32 normalised
    input is alive from the rerun to its weight gradient, after the MLP's input gradients
    (``sandwich_rerun_norm_bytes``); no activation buffer beside the product (GELU's
    ``tanh`` inlined, as a GPU lowers it)."""
    if not (dm.compiled and spec.norm_placement.post_norm):
        return list(moments)
    post = spec.norm_placement is NormPlacement.POST
    rebuilt = recompute is Recompute.FULL and not in_checkpoint(wl)
    kept = (dm.rows * spec.hidden_size * dm.e + dm.rows * FP32_BYTES
            if post or not (rebuilt or dm.autocast) else 0)
    normed = sandwich_rerun_norm_bytes(spec, dm) if rebuilt else 0
    out, state = [], "before"
    for m in moments:
        state = {"mlp_post_norm": "post", "mlp_act": "kernel",
                 "attn_post_norm": "after"}.get(m.name, state)
        if kept and state in ("post", "kernel") and m.name != "mlp_post_norm":
            m = m._replace(alive_bytes=m.alive_bytes + kept, grads_before=tuple(
                g for g in m.grads_before if g != "mlp_post_norm"))
        held = normed if state != "after" and m.name != "mlp_norm" else 0
        out.append(m._replace(alive_bytes=m.alive_bytes + held))
    return out


def sandwich_rerun_norm_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Compiled with sandwich norms (``NormPlacement.SANDWICH``, transformers'
    Gemma2DecoderLayer) and rebuilt inside the graph (``Dims.rerun``): the pre-feedforward
    norm's normalised input in fp32 (Gemma2RMSNorm._norm of ``x.float()``: x rsqrt(mean(x^2)
    + eps)), rows x h x 4 B, which the rerun's norm kernel
    (``cpp_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_8``) writes beside the bf16
    output the gate and up matmuls read, and the norm's weight-gradient reduction
    (``cpp_fused__to_copy_add_mul_sum_view_13``, after both input projections'
    grad-input matmuls) reads: alive from the rerun to that reduction. Inductor's lowering
    makes a pointwise value read by two users a buffer when it reads more than four
    (torch/_inductor/ir.py ``StorageBox.should_realize_on_reuse``,
    ``config.realize_reads_threshold`` 4), on any device: this one reads five (the output
    projection's output and the layer's input, whose sum is recomputed, the post-attention
    norm's weight and statistics, its own statistics). Without recompute the partitioner
    saves the statistics and the backward recomputes it (no buffer). 0 elsewhere. The GELU's
    fp32 ``tanh`` is one too on CPU alone (a value of a heavy op read twice: ``is_cpu``'s
    branch there), T x f x 4 B alive from the rerun to GELU's backward kernel, not on a GPU:
    not counted. Traced: benchmarks/compiled_backward.py and tests/traced/
    test_compile_trace.py, Gemma 2's layer, bf16, full recompute, 2 x 256 and 2 x 1,024
    tokens, with ``memplan.profile.compiled_trace._gpu_realization``: ``buf20``, (2, 256,
    256) float32 at 2 x 256."""
    if not (dm.compiled and dm.rerun and spec.norm_placement is NormPlacement.SANDWICH):
        return 0
    return dm.rows * spec.hidden_size * FP32_BYTES


def sandwich_sum_stats_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Compiled with sandwich norms, in a forward whose checkpoint is inside the graph
    (nothing saved): the post-attention norm's statistics (rows x 4 B), alive from its
    kernel to the layer's last. The residual sum ``residual + post_attention_layernorm(
    attn_out)`` (transformers' Gemma2DecoderLayer.forward) is read by the pre-feedforward
    norm and the layer's final add, both pointwise kernels, so Inductor inlines it into each
    rather than writing it (it reads four buffers, the output projection's output, the
    layer's input, the post-attention norm's weight and statistics: not more than four,
    ``sandwich_rerun_norm_bytes``' rule):
    the last kernel (``cpp_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_10``)
    recomputes it from the output projection's output (held in the sum's place), the
    layer's input and those statistics. Traced: Gemma 2's layer, bf16, full recompute: at up's
    matmul ``buf19``, (2, 256, 1) float32 at 2 x 256. OLMo 2's post norms write the sum (the
    MLP's matmuls read it): 0 there, and elsewhere."""
    if not (dm.compiled and spec.norm_placement is NormPlacement.SANDWICH):
        return 0
    return dm.rows * FP32_BYTES


def sac_schedule(spec: ModelSpec, dm: Dims) -> bool:
    """Whether a rebuilt layer's attention side follows the traced schedule (``sac_deferred``,
    ``attention_backward_moments``): ``swiglu_backward``'s MLP without autocast (torchtitan's
    block was traced in bf16 alone)."""
    return swiglu_backward(spec, dm, Recompute.NONE) and not dm.autocast


def sac_deferred(moments: Sequence[LayerMoment], rebuilt: Sequence[Term],
                 kept: Sequence[Term]) -> tuple[LayerMoment, ...]:
    """Per-op SAC checkpointed, then compiled (torchtitan's order): the rerun in the compiled
    backward rebuilds the attention side (its norm's output and statistics, q, k, v, SDPA's
    output) where its backward needs it, not before the MLP's, so at the MLP's kernel
    (``swiglu_moments``' ``mlp_act``) only what the policy keeps of it is alive, beside the
    layer's input. ``rebuilt``: the attention norm's and attention's terms a full recompute
    rebuilds; ``kept``: the policy's kept terms. Traced (benchmarks/compiled_backward.py,
    torchtitan's block, bf16, 2 x 1,024 tokens): fused q/k/v 24,715,264 B, the full
    recompute's kernel less the norm's output and statistics (1,056,768 B; the kept qkv
    output stands for q, k and v); separate q/k/v (q and v kept) 24,453,120 B, less k too
    (1,318,912 B)."""
    deferred = (sum(t.size_bytes for t in rebuilt if not t.name.endswith(".input"))
                - sum(t.size_bytes for t in kept if t.name.startswith("sac.attn.")))
    return tuple(m._replace(alive_bytes=m.alive_bytes - max(0, deferred))
                 if m.name == "mlp_act" else m for m in moments)



def autocast_sac_deferred(moments: Sequence[LayerMoment], spec: ModelSpec, dm: Dims,
                          rebuilt: Sequence[Term], kept: Sequence[Term],
                          ) -> tuple[LayerMoment, ...] | None:
    """Per-op SAC compiled under autocast (fp32 weights, the checkpoint inside the graph, q/k/v
    fused or not; None elsewhere): the full recompute's moments with, at the MLP's
    kernel (``swiglu_moments``' ``mlp_act``), the attention side deferred as without
    autocast (``sac_deferred``: only the policy's kept attention outputs alive), and two of
    the rerun's weight casts changed: the gate projection's cast not made yet (its output
    is kept, so the rerun runs no gate matmul; the cast is made for the gate's grad-input
    matmul after the kernel), the output projection's made (its output is not kept: the
    rerun rebuilds it for the residual sum the MLP norm reads, and its cast is held for the
    attention output's gradient). Traced: tests/traced/test_compile_trace.py, torchtitan's
    block, wqkv fused or separate, 2 x 256 and 2 x 1,024 tokens, the backward's peak exact
    (separate at 2 x 256: 7,161,856 B once SDPA's CPU backward counts as its outputs,
    ``memplan.profile.compiled_trace``; its per-thread scratch had put the trace's peak
    there, 1.4% above)."""
    if not (dm.compiled and dm.autocast):
        return None
    gate_cast = spec.hidden_size * spec.ffn_hidden_size // dm.tp * dm.e
    out_cast = spec.hidden_size * spec.num_attention_heads * spec.head_dim // dm.tp * dm.e
    return tuple(m._replace(alive_bytes=m.alive_bytes - gate_cast + out_cast)
                 if m.name == "mlp_act" else m
                 for m in sac_deferred(moments, rebuilt, kept))

def rebuilt_attention_schedule(spec: ModelSpec, wl: Workload, dm: Dims,
                               recompute: Recompute) -> bool:
    """Whether ``attention_backward_moments`` gives the attention side of a compiled layer's
    backward: torchtitan's block as traced (fused q/k/v, RoPE as a complex product with the
    layer's complex64 table, ``RopeCache.LAYER``; SDPA; a plain SwiGLU MLP,
    ``swiglu_backward``), rebuilt inside the compiled graph (full AC: ``recompute`` FULL, not
    ``in_checkpoint``; per-op SAC reads the full recompute's moments) or not recomputed above
    the MLP's weight-gradient threshold (the same kernels after the MLP's; traced held out,
    6 heads of 64, all KV heads, 3 x 160 and 1 x 640 tokens: -13.4% and -12.3% before, now
    one row's statistics under), one rank's whole sequence (no TP, no CP). Elsewhere
    (separate q/k/v, transformers' real RoPE, TP) the schedule was not traced and the eager
    order's moments stand."""
    f, h = spec.ffn_hidden_size, spec.hidden_size  # (``compiled_order.
    # at_mlp_threshold_or_below``, not imported here: compiled_order imports this module)
    return ((recompute is Recompute.FULL and not in_checkpoint(wl)
             or recompute is Recompute.NONE and dm.tokens * (f + h) > f * h)
            and sac_schedule(spec, dm) and (wl.fused_qkv or spec.fused_qkv)
            and wl.rope_cache is RopeCache.LAYER
            and spec.position is PositionKind.ROPE and spec.qk_norm is QkNorm.NONE
            and wl.attention_impl is AttentionImpl.GENERIC and spec.mla is None
            and not (spec.attn_output_gate or spec.attn_sinks or spec.linear_attention)
            and dm.tp == 1 and dm.s == wl.seq_len and dm.rows == dm.tokens)


def attention_sizes(spec: ModelSpec, dm: Dims) -> tuple[int, int, int, int, int]:
    """(T h, T q, T kv, q's fp32 upcast, the complex64 RoPE table of the layer's positions)
    in bytes: the tensors of a compiled attention's backward moments."""
    th = dm.rows * spec.hidden_size * dm.e
    q = dm.tokens * spec.num_attention_heads * spec.head_dim * dm.e
    kv = dm.tokens * spec.num_kv_heads * spec.head_dim * dm.e
    return th, q, kv, q // dm.e * FP32_BYTES, _rope_table_bytes(spec, dm)


def attention_backward_moments(spec: ModelSpec, dm: Dims, kept: Sequence[Term] | None = None,
                               ) -> list[tuple[str, int, int, tuple[str, ...]]]:
    """The attention's backward in a compiled layer rebuilt inside the graph
    (``rebuilt_attention_schedule``), as Inductor orders it (one kernel per scheduler node,
    traced: benchmarks/compiled_backward.py, torchtitan's block, bf16, 2 x 64, 2 x 96 and
    2 x 1,024 tokens, the same order at every size): after the MLP's kernel and all three
    MLP weight gradients (graph outputs, alive to the end), the two MLP input gradients are
    not summed, the MLP norm's backward is one kernel with its residual add, and the norms'
    weight gradients (one fused reduction kernel, torch/_inductor/scheduler.py
    ``Scheduler.fuse_nodes``), the output projection's and the q/k/v projection's weight
    gradients and the attention norm's backward run after the attention's backward, at the
    layer's end. ``reorder_for_peak_memory`` (torch/_inductor/memory.py) keeps that order
    where none of its three heuristic orders estimates a lower peak: the backward's peak is
    the largest of these moments and the MLP's (``swiglu_moments``), the MLP's where T x f
    outweighs the MLP's weights; where lpmf's order runs the MLP's weight gradients last and
    estimates lower (2 x 64 tokens), ``compiled_order.with_lpmf_order`` takes it.

    Alive through the SDPA backward, beside the layer's input and the incoming gradient:
    the output projection's output (the residual sum is recomputed from it at the end),
    both MLP input gradients, the attention output's gradient (the output projection's
    weight gradient reads it), the SDPA output's gradient (kept by Inductor's buffer reuse
    for the q/k/v input gradient, of its size: codegen/wrapper.py ``AllocateLine.plan``),
    the MLP norm's statistics; under full AC the attention norm's output and statistics and
    SDPA's output (the deferred weight gradients read them); under per-op SAC
    (``kept``, the policy's kept terms) the kept SDPA output, the rerun's RoPE'd q (kept by
    buffer reuse for the q/k/v input gradient) and k's fp32 upcast (for dk's), the
    attention norm's output recomputed at the end. Two moments: SDPA's backward's dq, dk,
    dv with q's RoPE backward (dq's fp32 upcast, its complex product with the table and the
    table's conjugate resolved into a copy inside ``aten.mul``, a fallback kernel: complex
    ops are not lowered); then dq's product beside the fused q/k/v gradient (T x (q + 2 kv)).
    Buffer reuse holds a freed buffer to a later allocation of its bytes and dtype only where
    that does not raise Inductor's own peak estimate (``AllocateLine.should_reuse_buffer``):
    under full AC memplan applies that check to the SDPA output's gradient
    (``with_sdpa_grad_reuse``); under per-op SAC all three holds are counted here and
    ``compiled_order.with_sac_order`` keeps those the check keeps.
    Traced before the block kept its complex64 RoPE table (the trace harness cast it to a
    real one): full AC exact at 2 x 96 tokens, at 2 x
    64 one more hold, the MLP's up-projection gradient (T x f) for the q/k/v weight
    gradient, of the same bytes at that size alone (-8.7%); per-op SAC exact at 2 x 64, at
    2 x 96 under by the MLP norm backward's statistics (T fp32), held by reuse there alone."""
    th, q, kv, q32, table = attention_sizes(spec, dm)
    stats = dm.rows * FP32_BYTES
    common = 2 * th + 2 * th + th + q + stats  # input, wo output, MLP input grads, attn grads
    if kept is None:  # full AC: the attention norm's output and statistics, SDPA's output
        alive = common + th + stats + q
    else:
        out = sum(t.size_bytes for t in kept if t.name == "sac.attn.out")
        if not out:
            return []
        alive = common + out + q + kv // dm.e * FP32_BYTES
    # (name, alive, transient, the gradients made before: ``layer.LayerMoment``'s first four)
    # with as many KV heads as query heads Inductor's wrapper holds q's fp32 upcast for k's
    # (its size) while q's product and the fused gradient are made (traced: full AC 3 x 160
    # tokens, -1.96% before, exact; the same without recompute)
    cat = [("attention_cat", alive, th + 2 * (q + 2 * kv) + 2 * q32 + table, ("mlp",))]
    return [("attention_rope", alive, th + q + 2 * kv + 2 * q32 + table, ("mlp",)),
            ("attention_qkv", alive, th + q + 2 * kv + q32 + q + 2 * kv, ("mlp",)),
            *(cat if kv == q and kept is None else [])]


def with_sdpa_grad_reuse(moments: Sequence[LayerMoment], spec: ModelSpec, dm: Dims,
                         groups: Mapping[str, int]) -> list[LayerMoment]:
    """Full AC's ``attention_backward_moments`` in ``moments`` (a layer's, ``groups``: its
    gradient groups' parameters, ``layer.grad_group_params``), less the SDPA output's
    gradient (T x q) where Inductor's wrapper frees it after SDPA's backward instead of
    holding it for the q/k/v input gradient. ``AllocateLine.plan`` (torch/_inductor/codegen/
    wrapper.py, torch 2.13) takes a freed buffer of the same key for a later allocation only
    if ``should_reuse_buffer``: the buffer's bytes plus ``EfficientPeakEstimate``'s largest
    per-node estimate between the free and the allocation (``peak_between``) do not exceed
    the graph's estimated peak (torch/_inductor/memory.py ``estimate_peak_memory``). Against
    memplan's moments (the real bytes): the window is the RoPE backward, whose estimate
    leaves out dq (T x q), a ``MultiOutput`` of SDPA's backward freed after its last reader
    (dq's fp32 upcast, ``compute_memory_timeline``) while its storage lives to dv's reader
    (the output tuple freed then); the graph's peak is the largest other moment (the MLP's
    kernel, traced). The held output (outside the graph) counts at both, and so do the RoPE
    table's fallbacks (complex ops are not lowered): the rerun's ``reshape`` and the
    backward's ``_conj`` are each estimated at twice the table and freed once
    (``compute_size_for_scheduler_buffer``: a ``MultiOutputLayout`` buffer allocates its
    users' bytes, freeing none): two tables at the MLP's kernel (the ``reshape``'s, read
    by the ``_conj`` later), one of each at the RoPE backward (the ``_conj``'s ``clone`` is
    real, in the moment as the table). So: held
    where ``attention_rope`` less dq is no larger than every other moment. Traced
    (benchmarks/compiled_backward.py, torchtitan's block, Inductor's decision logged): 2 x 96
    tokens, estimates 2,250,240 + 98,304 > 2,342,400: freed (memplan's 2,520,576 - 98,304 =
    2,422,272 B against the MLP kernel's 2,416,128: the trace 2,422,272, exact; 4.1% over
    before); with the table cast to a real one (no ``_conj``; the conjugate made inside
    ``aten.mul``, no estimate) 2,213,376 + 98,304 <= 2,317,824: held; 2 x 1,024 held (the
    MLP's kernel far above). At 2 x 64 Inductor runs lpmf's order, which defers the MLP's
    weight gradients to the end (``compiled_order.with_lpmf_order``), and holds it there
    (1,434,624 + 65,536 <= 1,852,416), below that end."""
    rope = next((m for m in moments if m.name == "attention_rope"), None)
    if rope is None:
        return list(moments)

    def size(m: LayerMoment) -> int:
        return m.alive_bytes + m.transient_bytes + dm.stream_e * sum(
            groups[g] for g in m.grads_before)

    q = dm.tokens * spec.num_attention_heads * spec.head_dim * dm.e
    others = [size(m) for m in moments if m.name not in ("attention_rope", "attention_qkv")]
    if size(rope) - q <= max(others, default=0):
        return list(moments)
    return [m._replace(alive_bytes=m.alive_bytes - q)
            if m.name in ("attention_rope", "attention_qkv") else m for m in moments]


def with_attention_backward(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                            dm: Dims, kept: Sequence[Term]) -> tuple[LayerMoment, ...]:
    """Per-op SAC's moments from the full recompute's: its attention-backward moments
    (``attention_backward_moments``) for those of full AC."""
    if not rebuilt_attention_schedule(spec, wl, dm, Recompute.FULL):
        return tuple(moments)
    own = {name: (alive, transient) for name, alive, transient, _ in
           attention_backward_moments(spec, dm, kept)}
    return tuple(m._replace(alive_bytes=own[m.name][0], transient_bytes=own[m.name][1])
                 if m.name in own else m for m in moments
                 if m.name in own or m.name not in ("attention_rope", "attention_qkv",
                                                    "attention_cat"))


def rerun_output_copy_bytes(spec: ModelSpec, wl: Workload, dm: Dims,
                            recompute: Recompute) -> int:
    """A compiled layer rebuilt inside the graph (full AC, not ``in_checkpoint``) with
    transformers' attention (RoPE applied to the head-major q and k with the forward's cos
    and sin tables, ``RopeCache.FORWARD``: modeling_llama.py ``LlamaAttention.forward``
    transposes, then ``apply_rotary_pos_emb``): the token-major copy of SDPA's output its
    rerun makes for the output projection, alive beside SDPA's output from the rerun to the
    output projection's weight gradient; 0 elsewhere. SDPA's output takes q's layout
    (torch/_meta_registrations.py ``meta__scaled_dot_product_flash_attention`` and
    ``_for_cpu``: ``torch.empty_like(query)``), head-major where RoPE's pointwise output is
    laid out in its own (B, heads, S, d) shape, so ``attn_output.transpose(1, 2)
    .contiguous()`` (integrations/sdpa_attention.py) copies it. Without recompute the
    partitioner saves SDPA's output alone and rebuilds the copy in backward (traced); the
    rerun keeps its own. torchtitan rotates q before the transpose: token-major, no copy;
    so does a per-head q norm on the (B, S, H, d) view before the transpose
    (``ModelSpec.qk_norm_token_major``, Qwen3's ``q_norm``), whose reduction kernel also
    writes RoPE's output, token-major (traced: tests/traced/test_compile_trace.py
    ``test_compiled_qk_norm_layer_rebuilt``, Qwen3's layer, bf16, 2 x 256 tokens: o_proj
    reads SDPA's output itself; +3.5% before); not one on the transposed q (Gemma 3's
    layer traced likewise: the copy made).
    Traced: benchmarks/compiled_backward.py, transformers' layer, bf16, 2 x 1,024 tokens
    (at the MLP's kernel, one T x h: -3.5% before)."""
    if not (recompute is Recompute.FULL and not in_checkpoint(wl)
            and not (spec.qk_norm is QkNorm.HEAD and spec.qk_norm_token_major)
            and swiglu_backward(spec, dm, Recompute.NONE) and wl.rope_cache is RopeCache.FORWARD
            and spec.position is PositionKind.ROPE and wl.attention is Attention.FLASH
            and wl.attention_impl is AttentionImpl.GENERIC and spec.mla is None
            and not (spec.attn_output_gate or spec.linear_attention) and dm.tp == 1):
        return 0
    return dm.tokens * spec.num_attention_heads * spec.head_dim * dm.e


def with_output_copy(moments: Sequence[LayerMoment], copy: int) -> list[LayerMoment]:
    """``moments`` (a rebuilt layer's, from its rerun's end) with ``copy``
    (``rerun_output_copy_bytes``) alive until the output projection's weight gradient."""
    out, made = [], False
    for m in moments:
        made = made or any(g in ("attn_out", "attn") for g in m.grads_before)
        out.append(m if made else m._replace(alive_bytes=m.alive_bytes + copy))
    return out


def in_checkpoint(wl: Workload) -> bool:
    """A compiled layer inside its activation checkpoint (``Workload.compile_in_checkpoint``:
    torchtune's ``training.compile_model`` compiles the layer inside the wrapper
    ``set_activation_checkpointing`` put around it; transformers' gradient checkpointing
    calls the compiled layer likewise). The checkpoint sees one autograd node, the compiled
    graph, whose forward is the one compiled without checkpointing: it makes the
    partitioner's whole saved set (the layer's input among it, the first norm's) and returns
    it with the layer's output before the checkpoint's pack hooks drop it. So the layer's
    forward moments are those of the layer not checkpointed; it then keeps its input alone
    (traced: tests/traced/test_compile_lora.py, peft with gradient checkpointing). Off:
    torchtitan's order, the checkpoint inside the compiled graph (every node recomputed)."""
    return wl.compile and wl.compile_in_checkpoint


def sac_kept(terms: list[Term], spec: ModelSpec, dm: Dims, fused_qkv: bool) -> list[Term]:
    """Per-op SAC (torchtitan's ``SelectiveAC``) checkpointed, then compiled: the policy tags
    its save list's outputs ``MUST_SAVE`` and the rest ``PREFER_RECOMPUTE``
    (torch/utils/checkpoint.py ``CheckpointPolicy``), which the partitioner reads as a ban on
    recomputing the tagged nodes (``should_ban_recomputation``: "marked MUST_SAVE") and a
    forced recompute of the others (``must_recompute``). The min cut still saves only what
    backward reads: the down projection's output (``sac.mlp.w2``, an odd matmul the eager
    policy caches for the rerun) feeds the residual add alone, whose backward reads nothing,
    so it is not saved (traced: torchtitan's block, fused and separate q/k/v). Under DTensor
    tensor parallelism the rank's shards, and what ``sac_tp_terms`` adds."""
    return ([t for t in terms if t.name != "sac.mlp.w2"]
            + sac_tp_terms(spec, dm, fused_qkv))


# the matmuls reading each norm's output (memplan.model.sac.matmuls' names)
_NORM_READERS = {"attn": ("attn.qkv", "attn.q_proj", "attn.k_proj", "attn.v_proj"),
                 "mlp": ("mlp.w1", "mlp.w3")}


def sac_tp_terms(spec: ModelSpec, dm: Dims, fused_qkv: bool) -> list[Term]:
    """What per-op SAC, compiled, keeps beyond the matmul outputs under DTensor tensor
    parallelism (traced: tests/traced/test_compile_trace.py, torchtitan's block on a TP mesh
    of the fake process group, fused and separate q/k/v):

    - with sequence parallelism, the output projection's reduce-scattered output (rows / t
      of the residual stream): torchtitan's save list names
      ``_c10d_functional.reduce_scatter_tensor`` (``_get_default_save_ops``, "comm_ops") and
      backward reads it (the MLP norm's input, the residual sum, is recomputed from it and the
      layer's input). The down projection's is tagged too but, as its matmul's output,
      feeds the residual add alone: not saved;
    - without, the down projection's output (its full partial sum), which ``sac_kept``
      drops on one rank: its all-reduce, tagged to recompute, is rerun in backward, where the
      partitioner's dead-code pass keeps collectives (``is_not_collective``,
      torch/_functorch/partitioners.py), so the input it reads is saved;
    - with rowwise float8 (``Float8Linear`` under torchtitan's dtype-agnostic TP): per
      column-parallel converted linear the fp32 power-of-two scales of its weight's backward
      cast (``matmul_with_hp_or_float8_args.backward``: ``weight_hp_t`` scaled along its last
      dim, the output dim the rank holds a shard of, so its amax needs an all-reduce, a
      collective the partitioner never recomputes), ``d_in`` of them; and per norm one fp32
      scale per row of the (gathered) input its linears cast (``hp_tensor_to_float8_dynamic``
      along the last dim) when one of them is a matmul the policy reruns (an even one: k,
      or the MLP's up projection w3; a fused qkv is kept, its input's scales are not).
      Tensorwise saves the amaxes (``aten.max``, in the save list) and fp32 scalars alone:
      tens of bytes, not counted (as without TP:
      ``test_compiled_float8_layer_under_per_op_sac``)."""
    from memplan.model import sac

    if dm.tp == 1:
        return []
    terms = []
    if dm.gathered_linear_input:
        terms.append(Term("sac.attn.o_proj_scattered", dm.rows * spec.hidden_size * dm.e))
    elif dm.res_tokens_div == 1:
        terms.append(Term("sac.mlp.w2", dm.tokens * spec.hidden_size * dm.e))
    if dm.float8 is Float8Recipe.ROWWISE:
        columns = {name: linear.float8_converts(linear.Linear(name, "", d_in, d_out), dm)
                   for name, d_in, d_out, column in sac.matmuls(spec, fused_qkv) if column}
        weights = sum(d_in for name, d_in, _, column in sac.matmuls(spec, fused_qkv)
                      if column and columns[name])
        rerun = {m[0] for m in sac.recomputed(spec, fused_qkv)}
        norms = sum(1 for readers in _NORM_READERS.values()
                    if (mine := [n for n in readers if n in columns])
                    and all(columns[n] for n in mine) and rerun & set(mine))
        terms.append(Term("sac.float8_row_scales",
                          norms * dm.linear_rows * linear.FLOAT8_SCALE_BYTES))
        terms.append(Term("sac.float8_weight_scales", weights * linear.FLOAT8_SCALE_BYTES))
    return terms


# the grouped MoE block's eager terms the compiled block does not save (``moe_terms``), as
# transformers 5.3 wrote its experts (grouped-token) and as 5.23 does (grouped)
_MOE_RECOMPUTED = {
    MoeImpl.GROUPED_TOKEN: ("moe.router_probs", "moe.token_index", "moe.expert.act"),
    MoeImpl.GROUPED: ("moe.router_probs", "moe.expert.act", "moe.routing_weights")}


def moe_terms(terms: list[Term], moe: MoESpec, dm: Dims,
              impl: MoeImpl = MoeImpl.GROUPED) -> list[Term]:
    """A grouped MoE block's saved terms compiled (transformers' ``grouped_mm_experts_forward``,
    integrations/moe.py, bf16: its grouped matmuls are ``aten._grouped_mm``), from its eager
    ones (``memplan.model.moe.moe_terms``), by the partitioner's rules
    (``memplan.model.compiled``'s docstring):

    - the router saves its logits, T x E in the block's dtype (a matmul's output, never
      recomputed), not the fp32 softmax of every expert (pointwise and a reduction of the
      logits, recomputed), and of the renormalised top-k weights the top-k values alone (fp32,
      T x k; their per-token sum, and a cast to the logits' dtype (``router_weights_cast``,
      5.23's Qwen3MoeTopKRouter.forward), recomputed);
    - the top-k indices, the sort and its inverse (``argsort``/``sort``: not in the
      recomputable list), the gathered sorted rows (the gate/up grouped matmul's input), its
      output, the activated product (the down grouped matmul's input) and the down output are
      saved; SiLU(gate) is recomputed, as in a dense MLP (``mlp_terms``);
    - the offsets (``cumsum`` of the ``histc`` counts, E int32) are saved: the grouped
      matmuls' backward reads them;
    - ``impl`` grouped-token (5.3: ``hidden_states[token_idx]``, then
      ``selected_hidden_states[perm]``): the token index (``torch.arange(...).expand``) is
      recomputed; the flattened top-k indices (``top_k_index.reshape(-1)``, a buffer of its
      own in the compiled forward) and the sorted fp32 weights are saved;
    - ``impl`` grouped (5.23: ``torch.sort(expert_ids)``, ``hidden_states[perm //
      num_top_k]``, the inverse by ``inv_perm[perm] = arange``): the gathered rows' token
      index ``perm // num_top_k`` (int64, S; the gather's backward reads it) is saved, the
      flattened indices are not, and the sorted weights (``sample_weights[perm]``) are
      recomputed from the saved top-k values and sort.

    Traced: tests/traced/test_compile_trace.py (torch 2.13; transformers 5.3 grouped-token,
    5.23 grouped: Qwen3-MoE's and Mixtral's layers)."""
    routed = dm.tokens * moe.top_k
    dropped = _MOE_RECOMPUTED[impl]
    kept = [Term(t.name, routed * FP32_BYTES) if t.name == "moe.topk_weights" else t
            for t in terms if t.name not in dropped]
    flattened = ([Term("moe.expert_ids", routed * INDEX_BYTES)]
                 if impl is MoeImpl.GROUPED_TOKEN else [])
    return [Term("moe.router_logits", dm.tokens * moe.num_experts * dm.e), *kept,
            *flattened, Term("moe.offsets", moe.num_experts * OFFSET_BYTES)]


# torchtitan's block's eager terms the compiled forward recomputes (``titan_moe_terms``)
# (a shared expert's SiLU(w1 x) too, recomputed from its saved w1 output as a dense MLP's)
_TITAN_RECOMPUTED = frozenset({"moe.router_probs", "moe.topk_weights", "moe.expert.act",
                               "moe.routing_weights", "moe.expert_out", "moe.shared.act"})


def titan_moe_terms(terms: list[Term], hidden: int, moe: MoESpec, dm: Dims) -> list[Term]:
    """torchtitan's MoE block compiled (``MoeImpl.TITAN``: torchtitan/distributed/compile.py
    ``apply_compile``, each TransformerBlock with fullgraph=True and
    ``capture_scalar_outputs``), from its eager terms (``memplan.model.moe_titan``), in bf16:

    - the gate's fp32 input and weight copies stay saved (the fp32 mm's operands), and so do
      its fp32 logits (a matmul's output), T E x 4 B, not the softmax (recomputed from them),
      nor route_norm's gathered scores and sum, nor the sorted scores (recomputed from the
      logits, the ids and the argsort, which stay saved with the token index);
    - the gathered rows, the gate and up grouped matmuls' outputs and their product stay
      saved (SiLU(gate) recomputed, as in a dense MLP), with the offsets;
    - the experts' bf16 output (the w2 grouped matmul's, R h x 2 B) is saved where the eager
      block saves its fp32 copy (the cast recomputed), and the combine's ``zeros_like(x)``
      (T h e: Inductor keeps the full() the scatter's backward reads as a saved constant);
    - a shared expert (``FeedForward``, run after the combine: ``MoE.forward``) saves what a
      compiled dense SwiGLU saves: its input (the ffn norm's output, counted by the norm),
      w1's and w3's outputs and their product, SiLU(w1 x) recomputed.

    Traced: tests/traced/test_compile_trace.py (torch 2.13, torchtitan 0.3.0's Qwen3 MoE
    block, bf16, with and without a shared expert)."""
    routed = dm.tokens * moe.top_k
    kept = [t for t in terms if t.name not in _TITAN_RECOMPUTED]
    return [Term("moe.router_logits", dm.tokens * moe.num_experts * FP32_BYTES), *kept,
            Term("moe.expert_out", routed * hidden * dm.e),
            Term("moe.combine_zeros", dm.rows * hidden * dm.e)]


# the grouped matmuls' offsets: ``torch.cumsum(..., dtype=torch.int32)``
# (transformers integrations/moe.py ``grouped_mm_experts_forward``)
OFFSET_BYTES = 4


def float8_recomputed(readers: Sequence[linear.Linear], dm: Dims) -> bool:
    """Compiled with torchao's ``Float8Linear``s: whether a tensor that only ``readers`` read
    (a norm's output before its mixer's input projections, the MLP's SiLU(gate) * up before
    its down projection) is recomputed in backward rather than saved: every reader converts,
    so no matmul of backward reads it (the weight gradient's ``_scaled_mm`` reads its float8
    cast, a pointwise op of it), ``is_materialized_backwards`` no longer bans it, and the min
    cut recomputes it from what is saved anyway (the norm's input and statistics; the gate
    and up outputs), the cast from it (traced: tests/traced/test_compile_trace.py,
    torchtitan's block, torchao 0.18.0, tensorwise and rowwise). A tensor a non-fusible op
    also reads (SDPA's output, the output projection's input) stays saved."""
    return (dm.compiled and dm.float8 is not Float8Recipe.NONE and bool(readers)
            and all(linear.float8_converts(lin, dm) for lin in readers))


def float8_input_fused(readers: Sequence[linear.Linear], dm: Dims) -> bool:
    """Compiled with torchao's ``Float8Linear``s on a single rank, the checkpoint inside the
    graph (its forward saves nothing): whether a norm's output that only ``readers`` read is
    no buffer of its own. Each reader casts its input (``hp_tensor_to_float8_dynamic``:
    an amax, then the scaled cast), both pointwise of the norm, which Inductor inlines into
    the amax's reduction and the cast's kernel (torch/_inductor/ir.py ``StorageBox.
    should_realize_on_reuse``: no heavy op, on a GPU's rules) and never writes. Traced:
    benchmarks/compiled_backward.py, torchtitan's block, torchao 0.18.0, tensorwise and
    rowwise, full recompute at 2 x 64 tokens: at up's matmul the output projection's output
    and the input's float8 cast, gate's output, up's weight cast and output, no norm output
    (memplan one T x h over before)."""
    return float8_recomputed(readers, dm) and not dm.float8_tp


def float8_gate_held(spec: ModelSpec, dm: Dims, linears: Sequence[linear.Linear]) -> bool:
    """Compiled with torchao's ``Float8Linear``s on a gated MLP's own gate and up projections
    (``linears``: ``mlp.mlp_linears``): its checkpointed forward peaks at up's matmul beside
    the gate's output (``mlp._float8_forward``'s ``mlp_f8_up``), the very tensor per-op SAC
    keeps (``layer.layer_kind``; traced: torchtitan's block, torchao 0.18.0, 2 x 64 tokens,
    tensorwise and rowwise: one T x f over before)."""
    return (_gated_kernel(spec, dm) and not dm.autocast
            and all(linear.float8_converts(lin, dm) for lin in linears[:-1]))


def float8_swiglu_casts(spec: ModelSpec, wl: Workload, dm: Dims,
                        linears: Sequence[linear.Linear], saved: int) -> list[BackwardMoment]:
    """Compiled with torchao's ``Float8Linear``s on a SwiGLU MLP's own gate and up
    projections (``linears``: ``mlp.mlp_linears``), the moment after the down
    projection's grad-input ``_scaled_mm`` where Inductor's kernels recompute the
    activation's backward from the saved gate and up outputs and the product's gradient
    (T x f, kept) to feed the float8 casts of gate's and up's output gradients
    (``matmul_with_hp_or_float8_args.backward``: ``grad_output_reshaped_maybe_fp8_dim0`` for
    the input's gradient, ``..._dim1`` for the weight's), beside the block's saved set.
    Traced: benchmarks/compiled_backward.py, torchtitan's block, torchao 0.18.0, 2 x 1,024
    tokens (memplan's eager moments were 6.6% and 22.6% under):

    - tensorwise (one scale, from a full reduction): the casts are pointwise of the
      recomputed gradients, which are never written: two kernels write the four T x f float8
      casts (``..._silu_silu_backward_t_view_6`` and ``_8``), the down weight's gradient made
      between them (``_scaled_mm`` of the product's dim-1 cast, freed after it): at the
      second's end the product's gradient, the four casts and that weight gradient
      (20,922,396 B traced, memplan 18 B over: the scalars).
    - rowwise (``axiswise_dim``: a scale per row for dim 0, per column for dim 1, two
      reductions along different axes that no one kernel makes): the first kernel
      (``..._silu_silu_backward_t_view_11``) writes the product's float8 cast for the down
      weight's gradient, up's output gradient (bf16) and gate's (fp32: ``silu_backward``'s
      upcast result, read again by the column amax's kernel and the casts') and the two
      row amaxes, beside the product's gradient and the incoming gradient's row amax:
      4.5 T x f x 2 B, before any weight gradient (25,266,180 B traced with the RoPE table
      cast to a real one, memplan 6,148 B under: the weights' amaxes, hoisted to the
      backward's start). With the complex64 table Inductor keeps ``topological_sort_dfs``'s
      order (its log: baseline 24,739,332 B, dfs 24,478,212, bfs 24,480,260), which also
      holds the output projection's and up's transposed weight casts (65,536 + 196,608)
      there: 25,526,788 B traced, memplan 266,756 B under (-1.05%), not modelled.
    Rebuilt (full recompute, per-op SAC: the checkpoint inside the graph) the same kernels
    beside the rebuilt set, which also holds the backward's casts written in the rebuild
    (``float8_rebuilt_casts``; 2 x 1,024 full: tensorwise 21,512,222 B traced, memplan
    18 B over, 2.7% under before; rowwise 26,248,196 B, 3,076 B under, 3.8% before); under
    per-op SAC, rowwise, the casts its rebuild holds instead (``float8_sac_mlp_casts``;
    2 x 1,024: 4,092 B over, 5.0% under before); per-op SAC, tensorwise, the same two
    kernels: Inductor keeps its baseline order there (torch/_inductor/memory.py
    ``reorder_for_peak_memory``, torch 2.13; its log for torchtitan's block with its
    complex64 RoPE table, 2 x 1,024: baseline 19,144,734 B, lpmf 19,374,128, bfs 24,223,776,
    dfs 20,914,212; 2 x 256: 5,130,270 against 5,261,360, 6,473,760, 5,228,580): traced
    21,504,030 B at 2 x 1,024, memplan 8,210 B over. Not rebuilt, tensorwise, with separate
    q/k/v and the layer's complex RoPE table, Inductor may keep lpmf's order instead
    (``float8_lpmf_grad_in_first``). None unconverted, tensor-parallel (untraced) or another
    MLP."""
    if not (spec.mlp is MlpKind.SWIGLU and not dm.float8_tp
            and float8_gate_held(spec, dm, linears)):
        return []
    elements = dm.tokens * spec.ffn_hidden_size // dm.tp
    if dm.float8 is Float8Recipe.TENSORWISE:
        casts = 4 * (elements * linear.FLOAT8_BYTES + linear.FLOAT8_SCALE_BYTES)
        first = float8_lpmf_grad_in_first(spec, wl, dm, linears)
        down_grad = spec.hidden_size * spec.ffn_hidden_size // dm.tp * dm.stream_e
        baseline = 4 * elements * linear.FLOAT8_BYTES + float8_lpmf_scalars(dm)[1] + down_grad
        if first is not None and first + 2 * _rope_table_bytes(spec, dm) < baseline:
            return [BackwardMoment("mlp_f8_act", saved, elements * dm.e + first, ())]
        return [BackwardMoment("mlp_f8_act", saved, elements * dm.e + casts, ("mlp_out",))]
    amaxes = 3 * dm.tokens * dm.e  # bf16 amaxes per row: the incoming gradient's, gate's, up's
    return [BackwardMoment("mlp_f8_act", saved, 2 * elements * dm.e + elements * FP32_BYTES
                           + elements * linear.FLOAT8_BYTES + amaxes, ())]


def _rope_table_bytes(spec: ModelSpec, dm: Dims) -> int:
    """torchtitan's complex64 RoPE table for the layer's positions (``RopeCache.LAYER``)."""
    return dm.s * (spec.rope_dim // 2) * COMPLEX64_PAIR_BYTES


def float8_lpmf_grad_in_first(spec: ModelSpec, wl: Workload, dm: Dims,
                              linears: Sequence[linear.Linear]) -> int | None:
    """Tensorwise ``Float8Linear``s on every projection of torchtitan's block (separate q/k/v,
    its complex64 RoPE table: ``RopeCache.LAYER``), compiled, not rebuilt: beyond the saved
    set and the product's gradient (T x f), what is alive at the MLP's peak in the order of
    Inductor's ``topological_sort_lpmf`` (torch/_inductor/memory.py, torch 2.13), or None
    elsewhere. ``reorder_for_peak_memory`` keeps the order of the lowest estimated peak among
    the scheduler's (baseline, ``float8_swiglu_casts``' moment) and three sorts, so
    ``float8_swiglu_casts`` compares the two estimates. lpmf runs first every kernel that
    reads graph inputs alone: the transposed weight casts of all projections
    (``matmul_with_hp_or_float8_args.backward``, torchao 0.18.0 ``float8_linear.py``:
    ``weight_hp_t`` cast with the saved amax), the float8 casts of SDPA's output (for the
    output projection's weight gradient, T x q) and of the incoming gradient (both dims,
    T x h each; dim 0 freed after down's grad-input ``_scaled_mm``), the logsumexp's
    transposed copy (SDPA's backward reads it; the saved one freed: no net bytes) and the
    RoPE table's ``_conj`` resolved into a ``clone`` (complex ops fall back, not lowered);
    then down's grad-input, the kernel writing gate's and up's dim-0 output-gradient casts
    (T x f float8 and a scale each), and up's grad-input ``_scaled_mm`` (T x h): the peak,
    no weight gradient made, down's weight cast freed; and the scalars
    (``float8_lpmf_scalars``). Inductor's estimate of it is this plus twice the table: the
    ``reshape`` and ``_conj`` fallbacks are each estimated at two tables and freed as one
    (``compute_size_for_scheduler_buffer``: a ``MultiOutputLayout`` buffer allocates its
    users' bytes, frees none); the baseline's, its moment (both less the held output, outside
    the graph). Traced (benchmarks/compiled_backward.py, torchtitan's block, Inductor's
    log): 2 x 1,024 tokens lpmf 491,498 B below the baseline (19,382,334 against
    19,873,832; memplan's the same): lpmf kept, its peak 20,168,766 B, memplan exact (3.7%
    over before); 2 x 256 lpmf 22 B above (5,263,422; memplan's the same): the baseline; 2 x
    64 the baseline (memplan's lpmf 122,902 B above). With fused wqkv lpmf runs the
    attention's backward before the MLP's grad-input matmuls and its estimate peaks there
    (2 x 1,024: 20,627,492 B against the baseline's 19,873,820): the baseline, None here.
    Rebuilt under full AC (the checkpoint inside the graph) Inductor keeps the baseline
    (traced, separate q/k/v, 2 x 1,024: 21,512,234 B, the fused block's peak; with this
    moment memplan was 3.5% under): None. Under per-op SAC Inductor takes lpmf (its log, 2 x
    1,024: 19,259,454 B against the baseline's 20,193,324; 2 x 256: 5,244,990 against
    5,392,428): this moment is a part of the rebuilt block's in lpmf's order
    (``compiled_order.with_float8_sac_lpmf``)."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size  # ``attention.attention_linears``
    attn = (linear.Linear("q", "attn", h, q), linear.Linear("k", "attn", h, kv),
            linear.Linear("v", "attn", h, kv), linear.Linear("o", "attn_out", q, h))
    if not (dm.float8 is Float8Recipe.TENSORWISE and not (wl.fused_qkv or spec.fused_qkv)
            and wl.recompute is not Recompute.FULL and wl.rope_cache is RopeCache.LAYER
            and spec.position is PositionKind.ROPE and dm.tp == 1 and dm.rows == dm.tokens
            and all(linear.float8_converts(lin, dm) for lin in (*attn, *linears))):
        return None
    elements = dm.tokens * spec.ffn_hidden_size
    weights = sum(lin.d_in * lin.d_out for lin in (*attn, *linears[:-1]))
    casts = (2 * elements + dm.tokens * (q + h)) * linear.FLOAT8_BYTES  # gate, up: dim 0
    return (casts + weights * linear.FLOAT8_BYTES + dm.tokens * h * dm.e
            + _rope_table_bytes(spec, dm) + float8_lpmf_scalars(dm)[0])


def float8_lpmf_scalars(dm: Dims) -> tuple[int, int]:
    """(lpmf's, the baseline's) tensorwise scalars beyond the saved set (each projection's
    weight amax, in the weights' dtype, and inverse scale, fp32: torchao 0.18.0
    ``float8_linear.py``) at the moments ``float8_lpmf_grad_in_first`` and
    ``float8_swiglu_casts`` model in torchtitan's block (separate q/k/v, SwiGLU: seven
    ``Float8Linear``s). Each tensorwise cast reduces an amax (the tensor's dtype) to an fp32
    scale (``tensor_to_scale``). lpmf: the seven weights' amaxes read by their casts and
    down's inverse scale by its matmul, freed; seven scales written (the incoming
    gradient's, SDPA output's, both norm outputs', the product's, gate's and up's output
    gradients'), five amaxes alive (two of the seven written into the buffers of two read
    before: Inductor's reuse). The baseline: down's amax and inverse scale freed, gate's and
    up's gradients' amaxes written, no scale yet (``float8_swiglu_casts`` counts four, 18 B
    over the trace). Traced (the output code at 2 x 1,024): 62 and 40 B beside the saved
    set's 42: +20 and -2."""
    scale = linear.FLOAT8_SCALE_BYTES
    return 7 * scale + 5 * dm.e - 7 * dm.e - scale, 2 * dm.e - dm.e - scale


def float8_tp_weights(prefix: str, linears: Sequence[linear.Linear], dm: Dims,
                      recompute: Recompute) -> list[Term]:
    """Compiled without recompute under torchao's float8 tensor-parallel styles (tensorwise,
    ``Dims.float8_tp``): per converted linear the float8 cast of its weight's shard on this
    rank, 1 B per element, which the partitioner saves for the backward's grad-input matmul.
    Without TP the cast is recomputed from the weight (a graph input) and its saved amax; a
    shard's tensorwise scale needs the amax of the whole weight, an all-reduce over the TP
    group (``float8_utils.tensor_to_amax`` on a DTensor), and the partitioner never
    recomputes a collective (``is_not_collective``, torch/_functorch/partitioners.py), so the
    cast made from it is saved (traced: tests/traced/test_compile_trace.py, torchtitan's
    block on a TP mesh of the fake process group, tp 2 and 4, with and without sequence
    parallelism, torchao 0.18.0). Per-op SAC forces the cast's recompute (``must_recompute``:
    not saved there, ``sac_tp_terms``). Not in a full recompute's rerun (``Dims.rerun``):
    the traced set is what a forward saves, not what a compiled backward rebuilds."""
    if not _float8_tp_forward(dm, recompute):
        return []
    n = sum(linear.weight_elements(lin, dm.tp) for lin in linears
            if linear.float8_converts(lin, dm))
    return [Term(f"{prefix}.float8_weights", n * linear.FLOAT8_BYTES)] if n else []


def float8_tp_gathered_kept(dm: Dims, recompute: Recompute) -> bool:
    """Compiled without recompute under torchao's float8 TP styles with sequence parallelism:
    the all-gathered float8 cast of a norm's output (``PrepareFloat8ModuleInput``: cast on the
    sequence shard, then all-gathered) is saved, not recomputed, as the all-gather is a
    collective (``float8_tp_weights``; traced there). Without SP the cast of the replicated
    output is recomputed from the norm's saved input and statistics."""
    return dm.gathered_linear_input and _float8_tp_forward(dm, recompute)


def _float8_tp_forward(dm: Dims, recompute: Recompute) -> bool:
    """A compiled layer's own forward without recompute under torchao's float8 TP styles
    (not a full recompute's rerun: ``rerun_dims``)."""
    return dm.compiled and dm.float8_tp and recompute is Recompute.NONE and not dm.rerun


def mlp_grad_threshold_tokens(spec: ModelSpec, tp: int = 1) -> int | None:
    """The fewest tokens a micro-batch holds at or above the dense MLP's weight-gradient
    threshold, T (f + h) >= f h with f the rank's share (f / tp): below it the MLP's weight
    gradients (h f each) outweigh its activations (T f each) and Inductor's memory-aware
    sorts reorder the compiled layer's backward (``compiled_order.lpmf_defers_mlp_grads``,
    ``compiled_order.at_mlp_threshold_or_below``). Llama 3.1 8B (h 4,096, f 14,336): 3,186
    tokens. None: no dense MLP (MoE layers)."""
    f, h = spec.ffn_hidden_size // tp, spec.hidden_size
    if spec.moe is not None or f <= 0:
        return None
    return -(-f * h // (f + h))


def float8_rowwise_dfs_bytes(spec: ModelSpec, tp: int, tokens: int) -> int:
    """Rowwise ``Float8Linear``s, compiled, no recompute: what Inductor's ``topological_sort_dfs``
    order (torch/_inductor/memory.py, torch 2.13), where ``reorder_for_peak_memory`` takes it,
    holds at the MLP's activation kernel beyond ``float8_swiglu_casts``' moment: the output
    projection's and a gate/up projection's transposed float8 weight casts for their
    grad-input ``_scaled_mm`` (h x h and f x h, 1 B each, the rank's shares), cast before
    the kernel, and the incoming gradient's float8 cast (T x h x 1 B). Traced (Inductor's
    log and output code, torchtitan's block): dim 512, 1 x 256 tokens, dfs 8,008,704 B
    against the baseline's 8,823,556, the trace 3.64% above memplan's moment; h 256, 2 x
    1,024 with the complex table, 1.05%; h 256, 2 x 64, 3.8% (7.0% with fused q/k/v). At
    dim 512, 1 x 2,048 the baseline is kept (2,048 B apart) and holds the gradient's cast
    alone (2.05%). Each under this bound. Not modelled as a moment (which order Inductor
    keeps needs both orders' estimates): the output states it as a bound."""
    h = spec.hidden_size
    return (h * h + spec.ffn_hidden_size * h) // tp * linear.FLOAT8_BYTES + tokens * h * (
        linear.FLOAT8_BYTES)


def rerun_dims(dm: Dims) -> Dims:
    """``dm`` for the forward a full recompute reruns in a compiled layer's backward
    (``Dims.rerun``): what it rebuilds, not the saved set ``float8_tp_weights`` traces."""
    return dm._replace(rerun=True) if dm.compiled else dm


def float8_rebuilt_casts(prefix: str, linears: Sequence[linear.Linear], spec: ModelSpec,
                         wl: Workload, dm: Dims) -> list[Term]:
    """Compiled with torchao's ``Float8Linear``s on a single rank, a layer rebuilt inside the
    graph (full recompute, per-op SAC's: ``Dims.rerun``): the backward's float8 casts that
    Inductor writes in the rebuild and holds to their ``_scaled_mm``. The backward casts a
    weight again, transposed, for the input's gradient and an input for the weight's
    (``matmul_with_hp_or_float8_args.backward``: ``weight_hp_t`` and
    ``input_hp_reshaped_maybe_fp8_dim1`` through ``hp_tensor_to_float8_dynamic``). Read
    from tensors the rebuild holds (the weight, a saved input) with nothing from the
    backward's gradients, each cast is a node the scheduler fuses horizontally into the
    rebuilt forward's cast of the same tensor (torch/_inductor/scheduler.py ``Scheduler.
    fuse_nodes``, shared reads; torch 2.13): one kernel writes both, so the backward's cast
    is alive from the rebuild on. Per ``linears`` (the block's converted ones):

    - the output projection (``prefix`` "attn", its input SDPA's saved output): its input's
      cast (T x q float8) and its weight's (q x h float8) with their amaxes (tensorwise
      the input's scalar, the weight's saved already: ``float8_scales``; rowwise one per
      column of each, q x e each), alive until its weight gradient (the input's) and its
      input gradient (the weight's), after the MLP's backward;
    - rowwise, the MLP's gate and up projections (``prefix`` "mlp"): their weights' casts
      (f x h float8 each) and amaxes (one per input feature, h x e), alive until their
      input gradients. Tensorwise Inductor fuses their rebuilt casts with the norm's
      statistics instead, and the backward's casts come after the activation's kernels.
    The input casts of the projections after a norm are not written (``float8_input_fused``).
    Traced: benchmarks/compiled_backward.py, torchtitan's block, torchao 0.18.0, full
    recompute at 2 x 1,024 tokens, alive at the backward's peak (the activation's kernels):
    tensorwise 2,048 x 256 + 256 x 256 + 2 = 589,826 B (``..._t_transpose_view_18`` and
    ``_19`` beside the forward's casts), rowwise that less 2 plus 2 x 512 and
    2 x (768 x 256 + 512) (``_16``, ``_20`` and ``_24`` twice). None with tensor
    parallelism (untraced), outside the graph (``in_checkpoint``) or unconverted."""
    if not (dm.compiled and dm.rerun and not dm.float8_tp and not in_checkpoint(wl)
            and dm.float8 is not Float8Recipe.NONE):
        return []
    rowwise = dm.float8 is Float8Recipe.ROWWISE
    held = 0
    if prefix == "attn" and linear.float8_converts(out := linears[-1], dm):
        held += (dm.tokens * out.d_in + out.d_in * out.d_out) * linear.FLOAT8_BYTES
        held += 2 * out.d_in * dm.e if rowwise else dm.e
    if prefix == "mlp" and rowwise and spec.mlp.gated and _per_op_sac(wl):
        held += float8_sac_mlp_casts(linears, spec, wl, dm)
    elif prefix == "mlp" and rowwise and spec.mlp.gated:
        held += sum(lin.d_in * lin.d_out * linear.FLOAT8_BYTES + lin.d_in * dm.e
                    for lin in linears[:-1] if linear.float8_converts(lin, dm))
    return [Term(f"{prefix}.float8_rebuilt_casts", held)] if held else []


def _per_op_sac(wl: Workload) -> bool:
    """torchtitan's per-op SAC (``Recompute.SELECTIVE`` with ``SelectiveImpl.OP``), whose
    layer ``layer.layer_kind`` builds from the full recompute's."""
    return wl.recompute is Recompute.SELECTIVE and wl.selective_impl is SelectiveImpl.OP


def float8_sac_mlp_casts(linears: Sequence[linear.Linear], spec: ModelSpec, wl: Workload,
                         dm: Dims) -> int:
    """Rowwise ``Float8Linear``s on a gated MLP's own projections (``linears``: ``mlp.
    mlp_linears``: up, gate, down) in a layer under torchtitan's per-op SAC, compiled with
    the checkpoint inside the graph: the backward's float8 casts alive at the activation's
    cast kernel (``float8_swiglu_casts``), in place of the full recompute's two weight casts
    (``float8_rebuilt_casts``). torchao 0.18.0 ``float8_linear.py``
    ``matmul_with_hp_or_float8_args.backward`` casts, per linear, its weight transposed for
    the input's gradient (``weight_hp_t``) and, for the weight's gradient, its input and the
    output's gradient along dim 1 (``input_hp_reshaped_maybe_fp8_dim1``,
    ``grad_output_reshaped_maybe_fp8_dim1``: ``float8_scaling_utils.
    hp_tensor_to_float8_dynamic`` with ``axiswise_dim=0``, a scale per column). The
    policy keeps every odd matmul's output (``sac.recomputed``: gate's, ``mlp.w1``, kept;
    up's, ``mlp.w3``, rerun), so Inductor's rebuild (the checkpoint's nodes recomputed:
    ``must_recompute``) reruns the MLP norm and up's matmul alone, and horizontally fuses
    the backward's casts reading the same tensors into the rebuild's kernels (torch/
    _inductor/scheduler.py ``Scheduler.fuse_nodes``, shared reads; torch 2.13): the rerun
    projections' weight casts (f x h float8, an amax per input feature: gate's, not rerun,
    is cast later, at its own matmul) and both the norm output's dim-1 casts (T x h float8
    each, read by gate's and up's weight gradients, the MLP backward's last matmuls), and
    it writes the incoming gradient's dim-1 cast (T x h float8, for down's weight gradient)
    before the activation's kernel. Traced (benchmarks/compiled_backward.py, torchtitan's
    block, torchao 0.18.0, Inductor's output code at the backward's peak): 2 x 1,024 tokens
    ``buf31`` (w3's transposed cast) with ``buf29``, ``buf37`` and ``buf48`` (the norm
    output's), ``buf23`` (the incoming gradient's): 27,616,772 B, memplan 4,092 B over
    (-4.97% before); 2 x 256 2,052 B under (-2.79% before). Counted from the rebuild on
    (the incoming gradient's cast is made just before the kernel, under the moments before
    it). At 2 x 64 tokens Inductor orders the backward otherwise (that cast after the
    kernel; the attention's RoPE'd q, k, v rebuilt before it, the kept qkv output freed):
    memplan 35,068 B over there (+1.74%; +6.66% before). Tensorwise the casts are pointwise
    kernels after the activation's (``float8_swiglu_casts``): not here."""
    rerun = {name for name, *_ in sac_recomputed(spec, wl.fused_qkv or spec.fused_qkv)}
    up, gate, down = linears
    held = sum(lin.d_in * lin.d_out * linear.FLOAT8_BYTES + lin.d_in * dm.e
               for lin, name in ((up, "mlp.w3"), (gate, "mlp.w1"))
               if name in rerun and linear.float8_converts(lin, dm))
    held += sum(dm.tokens * lin.d_in * linear.FLOAT8_BYTES for lin in (up, gate)
                if linear.float8_converts(lin, dm))
    if linear.float8_converts(down, dm):
        held += dm.tokens * down.d_out * linear.FLOAT8_BYTES
    return held


def float8_scales(prefix: str, linears: tuple[linear.Linear, ...], dm: Dims) -> list[Term]:
    """Compiled, tensorwise: per converted linear the amax of its weight (a full reduction of
    a graph input, in the weight's dtype) and the fp32 scale from it, which the partitioner
    saves (``ban_if_reduction``) for the backward's weight cast; rowwise saves none of its
    scales (traced: tests/traced/test_compile_trace.py)."""
    if not dm.compiled or dm.float8 is not Float8Recipe.TENSORWISE:
        return []
    n = sum(1 for lin in linears if linear.float8_converts(lin, dm))
    return [Term(f"{prefix}.float8_scales", n * (dm.e + linear.FLOAT8_SCALE_BYTES))] if n else []


def lora_mlp_forward(linears: Sequence[linear.Linear], dm: Dims, saved: int) -> Moment:
    """A compiled gated MLP with adapters (``linears``: up, gate, down as ``mlp.mlp_linears``
    gives them; ``saved``: what the block saves) at its one pointwise kernel: Inductor fuses
    every pointwise op between the matmuls (each adapter's ``result + lora_B(...) *
    scaling`` for gate and up, their casts, SiLU, the product and its cast for the down
    projection's adapter) into one kernel (torch/_inductor/scheduler.py ``Scheduler.
    fuse_nodes``), which runs after all six matmuls that feed it, so the ``lora_B`` outputs
    of gate and up (rows x ffn in the adapters' dtype; an extern matmul's output, never fused
    into) are alive together. The sums are written into the base outputs' buffers
    (``decide_inplace_update``); beside them the kernel's outputs: the product in the compute
    dtype (the down projection's base input, transient unless an adapter saves it:
    ``linear.keeps_input``) and its cast for the down projection's adapter (saved). The down
    adapter's rank-r ``lora_A`` output does not exist yet. Traced: tests/traced/
    test_compile_lora.py, peft (bf16 base, fp32 adapters) and torchtune's ``LoRALinear``
    (one dtype): the compiled forward's peak."""
    up, gate, down = linears
    ad = dm.adapters
    assert ad is not None
    low = linear.adapter_math_bytes(dm)
    ffn = dm.tokens * linear.local_widths(up, dm.tp)[1]
    lora_b = sum(ffn * low for lin in (up, gate) if ad.adapts(lin))
    product = 0 if linear.keeps_input((down,), dm) else ffn * dm.e
    later = dm.tokens * ad.rank * low if ad.adapts(down) else 0
    return Moment("mlp_lora", saved - later, lora_b + product)


def lora_mlp_backward(linears: Sequence[linear.Linear], dm: Dims,
                      saved: int) -> BackwardMoment:
    """A compiled gated MLP with adapters at its backward's one pointwise kernel (SiLU's
    backward fused with the adapter sums' and the casts': ``lora_mlp_forward``), after the
    down projection's matmuls: the down adapter's saved input (its cast of the product, or
    the product itself where the adapter shares it) and rank-r output are freed by their
    weight gradients' matmuls (the wrapper's ``del`` after a buffer's last reader). Alive
    beyond the rest: the product's gradient from the base's matmul (compute dtype) and from
    the adapter's (adapters' dtype); made by the kernel, the gradients of gate's and up's
    outputs for their base matmuls (compute dtype) and, where adapted, the scaled copies for
    ``lora_B`` (adapters' dtype). None is written into the saved up sum's buffer: with a
    GPU's realization rules (``memplan.profile.inductor_rules``) the values the kernel
    inlines read that sum from more than one node, so ``decide_inplace_update`` does not
    reuse it (traced: peft in fp32, every MLP projection adapted, inside the checkpoint,
    T f x 4 B more than with the CPU's rules, under which one gradient was written in place
    where the adapters compute in the base's dtype: memplan's count before, -4.7% beside
    the GPU rules' trace; tests/traced/test_compile_lora.py). Traced with every projection
    of the MLP adapted: ``memplan.parallel.compile_rule`` refuses part of it inside the
    checkpoint (with the down projection alone the saved up output was reused in place
    under the CPU's rules, and the kernel's other outputs are not yet modelled)."""
    up, gate, down = linears
    ad = dm.adapters
    assert ad is not None
    low = linear.adapter_math_bytes(dm)
    ffn = dm.tokens * linear.local_widths(up, dm.tp)[1]
    freed = 0
    if ad.adapts(down):
        kept = dm.e if linear.shares_input(dm) else low
        freed = dm.tokens * ad.rank * low + ffn * kept
    grads = ffn * dm.e * 3 + (ffn * low if ad.adapts(down) else 0)
    grads += sum(ffn * low for lin in (up, gate) if ad.adapts(lin))
    return BackwardMoment("mlp_lora", saved - freed, grads, ("mlp_out",))
