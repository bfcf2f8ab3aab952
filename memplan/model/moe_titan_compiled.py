"""torchtitan 0.3.0's MoE block (``memplan.model.moe_titan``) compiled whole, as ``apply_compile``
compiles each TransformerBlock (torchtitan/distributed/compile.py: fullgraph,
``capture_scalar_outputs``): its forward's moments beside the saved set Inductor's
partitioner keeps (``memplan.model.compiled.titan_moe_terms``) and its backward's in the
order Inductor runs them (torch/_inductor/memory.py ``reorder_for_peak_memory``, torch
2.13), replayed from the wrapper code Inductor generates for the block (one kernel per
scheduler node, as a GPU backend launches them: memplan/profile/compiled_trace.py); inside
full AC, the rerun interleaved with the gradients (``full_ac_backward``). Traced in bf16
alone (``memplan.parallel._compile_titan_moe_refusal``).
"""

from __future__ import annotations

from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term
from memplan.model.moe_titan import EXPERT_BYTES, OFFSET_BYTES, _moe, shared_input_freed
from memplan.spec import ModelSpec


def compiled_forward(spec: ModelSpec, dm: Dims, terms: list[Term],
                     stream: int) -> list[Moment]:
    """The compiled block's forward moments (``memplan.model.compiled.titan_moe_terms``'s
    ``terms``; ``stream``: the combine's scatter output, T h e) beside its saved set:

    - the combine (``compiled_combine_bytes``), before a shared expert has run: its saved
      terms (w1's and w3's outputs and their product, ``moe.shared.*``) not yet made;
    - with a shared expert (``FeedForward``, after the routed experts: ``MoE.forward``), its
      w2 matmul (an extern mm, its own T h e output) beside the routed output and the whole
      saved set; the add of the two outputs and the residual is a pointwise kernel that
      reuses a freed input's buffer (torch/_inductor/scheduler.py ``Scheduler.
      can_buffer_be_removed``/in-place reuse; torch 2.13), no third T h tensor.

    Traced (tests/traced/test_compile_trace.py, torchtitan 0.3.0's Qwen3 MoE block with a
    shared expert of width 96, bf16): 2 x 64 tokens 729,104 B above the input, 2 x 256
    2,910,224 B, both the saved set and one T h x 2 B tensor, exact."""
    saved = sum(t.size_bytes for t in terms)
    shared = sum(t.size_bytes for t in terms if t.name.startswith("moe.shared."))
    moments = [Moment("moe_combine", saved - shared, stream + compiled_combine_bytes(spec, dm))]
    if shared:
        moments.append(Moment("moe_shared_out", saved,
                              stream + dm.rows * spec.hidden_size * dm.e))
    return moments


def compiled_combine_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The compiled block's combine in forward (``memplan.model.compiled.titan_moe_terms``),
    beside its saved set and the scatter's output (stream-sized, the walk's): the weighted
    rows cast back (Inductor fuses the fp32 product and the cast: R h e) and the sorted
    scores it recomputed (R x 4). Traced: tests/traced/test_compile_trace.py, torchtitan's
    Qwen3 MoE block in bf16 (2 x 64 tokens: 512 B over, not located; with a shared expert
    the shared w2's moment is the peak, ``compiled_forward``)."""
    routed, h = dm.tokens * _moe(spec).top_k, spec.hidden_size
    return routed * h * dm.e + routed * FP32_BYTES


def compiled_backward(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """The compiled block's backward (``memplan.model.compiled.titan_moe_terms``) as
    Inductor orders it (torch/_inductor/memory.py ``reorder_for_peak_memory``, torch 2.13;
    replayed from its wrapper code, torchtitan 0.3.0's Qwen3 MoE block, bf16):

    - first the routing scores' gradient: the gather of the output's gradient fused into its
      reduction over h with the experts' saved output (two R x 4 B outputs), the whole
      saved set alive; the experts' output (R h x 2) freed after it;
    - then a shared expert's MLP backward (``_compiled_shared``) without it;
    - then the routed experts' MLP backward from their gathered, weighted output gradient
      (R h x 2) in Inductor's order (``_compiled_routed``: the router's fp32 input copy
      freed before it, the router's input gradient made before or after it by lpmf's rule,
      ``router_grad_first``, the routed input gradient written into the saved zeros); with
      a shared expert its saved terms and input freed by then, its two input gradients (T h
      x 2 each) waiting.

    Traced (tests/traced/test_compile_trace.py, one kernel per scheduler node as a GPU
    launches them; the peaks located by replaying the wrapper's allocations and frees):
    without a shared expert, 2 x 64 tokens w3's input gradient (``mlp_in``), exact; 2 x
    256 the first moment, exact; 2 x 128 the attention's backward (1,192,960 B), memplan
    the first moment 11,248 B under (-0.94%): there the MoE's input gradients (the routed,
    in the combine's zeros, T h x 2, and the router's fp32, T h x 4: 196,608 B) wait for
    the block's last kernel (the ffn norm's weight gradient fused with the attention
    norm's), and memplan's attention moment is 328,448 B under the traced one (the rest not
    located). The eager order's experts' moments were +9.7% there, +8.0% at 2 x 256 and
    2,064 B under at 2 x 64. With a shared expert of width 96: 2 x 64 w3's input gradient,
    exact; 2 x 256 the first moment, exact; 2 x 128 the attention's backward again
    (1,397,760 B), memplan the first moment 3,056 B under (-0.22%); with a 256-wide shared
    expert at 2 x 128 memplan the first moment, 12,272 B under (-0.74%) (the eager order's
    experts' moments were 2,064 B under, exact, +2.35% and -0.74%). The C++ backend's
    kernel groups instead hold the MoE's input gradients through the attention's backward
    too: no GPU schedule."""
    moe, h = _moe(spec), spec.hidden_size
    routed = dm.tokens * moe.top_k
    first = [BackwardMoment("moe_scores_grad", saved, 2 * routed * FP32_BYTES, ())]
    if not moe.num_shared_experts:
        return first + _compiled_routed(spec, dm, saved, 0)
    shared = _compiled_shared(spec, dm, saved - routed * h * EXPERT_BYTES)
    # its saved w1 and w3 outputs and their product (SiLU recomputed: ``compiled.
    # titan_moe_terms``) and, below fp32, its input, freed by its backward; its two input
    # gradients (T h each, not summed: the ffn norm's backward kernel reads both) wait
    f = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp
    freed = 3 * dm.tokens * f * dm.e + shared_input_freed(spec, dm)
    return first + shared + _compiled_routed(spec, dm, saved - freed,
                                             2 * dm.rows * h * dm.e)


def _compiled_shared(spec: ModelSpec, dm: Dims, alive: int) -> list[BackwardMoment]:
    """A shared expert's backward in the compiled block's order (``compiled_backward``),
    ``alive`` of the block's saved set left after the scores' gradient: its w2 weight
    gradient first (the saved product freed after it), then the router's backward (its
    gate's weight gradient reading the fp32 input copy, T h x 4, which is freed then, with
    the logits and the expert ids), then the SiLU's backward kernel (the product's
    gradient and one new T f gradient; the other written into w3's saved output: Inductor's
    in-place reuse, ``compiled.swiglu_moments``), then w1's and w3's weight gradients (the
    norm's output, their input, freed after them: ``shared_input_freed``; w1's output
    freed) and their input gradients, T h x 2 each, not summed: the ffn norm's backward
    kernel reads them. Traced: the wrapper code of torchtitan's Qwen3 MoE block, bf16."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    f = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp
    inner, stream = dm.tokens * f * e, dm.rows * h * e
    router = (dm.tokens * h * FP32_BYTES if e < FP32_BYTES else 0) + dm.tokens * (
        moe.num_experts * FP32_BYTES + moe.top_k * INDEX_BYTES)
    act = alive - inner - router  # the product and the router's tensors freed
    rest = act - inner - shared_input_freed(spec, dm)  # w1's output and the input freed
    return [BackwardMoment("moe_shared_act", act, 2 * inner, ("moe_shared_out",)),
            BackwardMoment("moe_shared_in", rest, max(inner, stream) + stream,
                           ("moe_shared",))]


def router_grad_first(spec: ModelSpec, dm: Dims) -> bool:
    """Whether, in the compiled block's backward, the router's input gradient (its fp32 mm,
    T h x 4, reading the softmax's gradient, T E x 4, and the gate's fp32 weight copy, E h
    x 4, their last reader) is made before the routed experts' MLP backward. Inductor's
    order is ``topological_sort_lpmf``'s (torch/_inductor/memory.py
    ``reorder_for_peak_memory``: the order of the lowest estimated peak; lpmf's was at 2 x
    64, 2 x 128 and 2 x 256 tokens, its log at INFO): of the ready nodes whose output fits
    under the peak so far it takes the one of least output bytes less bytes freed (both
    fit here: the experts' output, R h x 2, and the router's fp32 input, T h x 4, were freed
    just before), ties to the node first in the graph, the experts' gather. Against the
    router's mm (T h x 4 - T E x 4 - E h x 4) stands the gather of the output's gradient
    into the experts' rows (``LocalTokenDispatcher.combine``'s backward: R h x 2, weighted
    by the recomputed top-k scores, R x 4, which it frees with the sort index, R x 8).
    Traced (torchtitan 0.3.0's Qwen3 MoE block, h 128, E 4, k 2): at T = 128 1,024 B less
    for the router, first; at T = 256 a tie, at T = 512 2,048 B more: after; the same with a
    shared expert (its backward before both) at T = 128 and 256."""
    moe, h = _moe(spec), spec.hidden_size
    routed = dm.tokens * moe.top_k
    return (_router_grad_net(spec, dm)
            < routed * h * EXPERT_BYTES - routed * (INDEX_BYTES + FP32_BYTES))


def _router_grad_net(spec: ModelSpec, dm: Dims) -> int:
    """The router's input gradient's bytes made less those it frees (``router_grad_first``):
    T h x 4 made, the softmax's gradient (T E x 4) and, below fp32, the gate's fp32 weight
    copy (E h x 4) freed."""
    moe, h = _moe(spec), spec.hidden_size
    weight = moe.num_experts * h * FP32_BYTES if dm.e < FP32_BYTES else 0
    return dm.tokens * (h - moe.num_experts) * FP32_BYTES - weight


def _compiled_routed(spec: ModelSpec, dm: Dims, saved: int,
                     waiting: int) -> list[BackwardMoment]:
    """The routed experts' backward in the compiled block (``compiled_backward``), as
    Inductor's wrapper code runs it (one kernel per scheduler node; torchtitan 0.3.0's Qwen3
    MoE block, bf16), ``saved`` the block's saved set (``memplan.model.compiled.
    titan_moe_terms``) less a shared expert's freed terms, ``waiting`` its input gradients
    (beside every moment), R = T k rows, f the experts' width:

    - ``_routed_base``: of the saved set, what is left when they start;
    - ``mlp``: the w2 grouped matmuls from the gathered, weighted output gradient (R h x 2):
      the product's gradient (R f x 2) and w2's weight gradient, the product (saved, R f x
      2) freed after the later; lpmf ran the product's gradient first at 2 x 64 (so both
      beside the product: the moment counted), the weight gradient first at 2 x 128 and
      2 x 256 (the product freed before the product's gradient: R f x 2 under it);
    - ``mlp_act``: the SiLU backward kernel, the gate's output gradient new (R f x 2) beside
      the product's, the up output's gradient written into the saved up output (Inductor's
      in-place reuse of a buffer whose last reader it is: torch/_inductor/scheduler.py
      ``BaseSchedulerNode.decide_inplace_update``), the rows' gradient and the product freed;
    - ``mlp_in_gate``, ``mlp_in``: w1's and w3's weight gradients, then their input
      gradients (R h x 2 each), the gathered rows (R h x 2) freed after the weight
      gradients and the gate's output (R f x 2) after the SiLU kernel; at w1's the gate's
      output gradient (R f x 2) beside it, at w3's w1's input gradient (freed after the
      add); both written by one kernel into the saved ``zeros_like(x)`` (``index_put``
      with accumulate into the combine's zeros, in place: ``decide_inplace_update``), no
      new T h tensor.

    Not counted: Inductor's wrapper keeps a freed buffer for a later one of the same key
    (size, dtype) where that raises no peak of its own estimate (torch/_inductor/codegen/
    wrapper.py ``AllocateLine.should_reuse_buffer``), which can raise a moment under the
    block's peak (at 2 x 128 the gate's output gradient, R f x 2, kept for the attention's
    output gradient: w3's input gradient's moment 65,536 B over ``mlp_in``, 1,170,448 B,
    under the traced peak); the router's small kernels (T E x 4, R x 4 each; the experts'
    output freed by then); at ``mlp`` and ``mlp_act`` the router's weight gradient (E h,
    made before; its group is the block's, ``mlp``). By hand, 2 x 64 tokens (T 128, R 256,
    h 128, f 64, E 4, bf16): ``_routed_base`` 516,112; ``mlp_in``: less the gate's output
    and the product (2 x 32,768) and the rows (65,536), 385,040, beside w1's and w3's input
    gradients (2 x 65,536) and every weight gradient (the router's 1,024, w1, w2 and w3 3 x
    65,536): 713,744, traced 713,744. 2 x 256 (T 512, R 1,024): the router's gradient after
    (2,048 B more), ``mlp_in`` 2,353,168 - 262,144 - 2 x 8,192 - 262,144 - 2 x 131,072 -
    262,144 + 2 x 262,144 + 197,632 = 2,010,128, under the first moment (2,361,360)."""
    moe, h = _moe(spec), spec.hidden_size
    routed = dm.tokens * moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    rows, inner = routed * h * EXPERT_BYTES, routed * f * EXPERT_BYTES
    first = router_grad_first(spec, dm)
    base = _routed_base(spec, dm, saved, first)
    down = moe.num_experts // dm.ep * f * h * EXPERT_BYTES  # w2's weight gradient
    product = 0 if _product_grad_first(inner, down, first) else inner  # freed before
    inputs = base - 2 * inner - rows  # the product, the gate's output and the rows freed
    return [BackwardMoment("mlp", base - product, waiting + rows + inner, ("mlp_out",)),
            BackwardMoment("mlp_act", base - inner, waiting + 2 * inner, ("mlp_out",)),
            BackwardMoment("mlp_in_gate", inputs, waiting + inner + rows, ("mlp",)),
            BackwardMoment("mlp_in", inputs, waiting + 2 * rows, ("mlp",))]


def _routed_base(spec: ModelSpec, dm: Dims, saved: int, router_first: bool) -> int:
    """Of the compiled block's saved set (``saved``), what is alive when the routed experts'
    backward starts (``_compiled_routed``; with a shared expert, of what its backward
    left): freed, the experts'
    bf16 output (R h x 2, after the scores' gradient), the expert ids (R x 8, by the scores'
    scatter backward), the gate's fp32 input copy (T h x 4, by its weight gradient's mm:
    lpmf takes that node first, it frees more than it makes) and the sort index (R x 8, by
    the gather of the output's gradient); the fp32 logits' slot (T E x 4) holds the
    softmax's gradient. Where ``router_first`` (``router_grad_first``) the router's input
    gradient (T h x 4)
    is made before them, the softmax's gradient and the gate's fp32 weight copy (E h x 4)
    freed then (else after the experts' last node, their input gradients' add). By hand, 2
    x 64 tokens (T 128, R 256, h 128, E 4, bf16): 589,840 - 65,536 (output) - 2 x 2,048
    (ids, sort) - 65,536 (fp32 input) = 454,672; the router's gradient first (128 x 124 x 4
    - 2,048 = 61,440 against 65,536 - 256 x 12 = 62,464): + 65,536 - 2,048 - 2,048 =
    516,112."""
    moe, h = _moe(spec), spec.hidden_size
    routed = dm.tokens * moe.top_k
    below = dm.e < FP32_BYTES  # the gate's fp32 copies (``moe_titan.titan_terms``)
    router_in = dm.tokens * h * FP32_BYTES if below else 0
    base = saved - routed * h * EXPERT_BYTES - 2 * routed * INDEX_BYTES - router_in
    return base + (_router_grad_net(spec, dm) if router_first else 0)


def _product_grad_first(inner: int, weight: int, router_first: bool) -> bool:
    """Whether lpmf (``router_grad_first``) runs w2's input gradient (the product's, ``inner``
    bytes, freeing nothing: the rows' gradient has a second reader) before w2's weight
    gradient (``weight`` bytes, freeing the saved product, ``inner``); ties go to the
    weight gradient, first in the graph. Where the router's input gradient ran first it
    took what the freed tensors left under the peak so far, neither fits and lpmf takes
    the smaller output; else both fit and it takes the least output less freed (traced:
    the product's gradient first at 2 x 64 tokens, 32,768 B against 65,536; the weight's
    at 2 x 128 and 2 x 256, 0 and -65,536 B against 65,536 and 131,072)."""
    if router_first:
        return inner < weight
    return inner < weight - inner


def full_ac_backward(spec: ModelSpec, dm: Dims) -> list[BackwardMoment]:
    """The compiled block's backward inside full activation checkpointing (``dm.rerun``;
    torchtitan's ``apply_ac`` wraps the block before ``apply_compile`` compiles it, so the
    checkpoint is inside the graph): Inductor's partitioner recomputes the forward within the
    backward graph (torch/_functorch/partitioners.py ``min_cut_rematerialization_partition``)
    and the scheduler interleaves the rerun with the gradients (torch/_inductor/memory.py
    ``reorder_for_peak_memory``, torch 2.13): the no-recompute saved set
    (``compiled.titan_moe_terms``) is never alive whole; the experts' output is rebuilt
    after their MLP's backward, for the scores' gradient; the combine's output is not
    rebuilt. Beside the attention's rebuilt tensors (the blocks before: their no-recompute
    saved set) the rerun keeps its fused wqkv output whole (T (q + 2 kv) e), of which the
    attention's terms count the q and k norms' inputs: its value third, T kv e, too. R = T k
    rows, f the experts' width, below fp32 (``_compile_titan_moe_refusal``: bf16 alone):

    - ``mlp_act``, the experts' SiLU backward kernel: rebuilt and alive, the gate's fp32
      input copy (T h x 4) and weight copy (E h x 4), the expert ids and the sort index (R x
      8 each), the softmax's scores (T E x 4), the gathered rows (R h x 2), the offsets (E x
      4), gate's and up's outputs (R f x 2 each); made, the gathered, weighted output
      gradient (R h x 2), w2's input gradient, the recomputed product and the gate's and up's
      output gradients (4 R f x 2); a shared expert's weight gradients and its two input
      gradients (T h x 2 each) made before (its backward runs first), its input (the ffn
      norm's output, T h x 2, in the norm's saved set) freed by it
      (``moe_titan.shared_input_freed``);
    - ``mlp_in``, w1's input gradient: alive, the router's input gradient (fp32, in the
      gate's fp32 input's buffer, T h x 4), the combine's zeros (T h x 2, where the two
      input gradients are summed: ``index_put`` with accumulate), up's output gradient (R f
      x 2, its buffer kept for a later reuse), the sort index and the offsets; w3's and w1's
      input gradients (R h x 2 each) beside every weight gradient.

    Traced (tests/traced/test_compile_trace.py, torchtitan 0.3.0's Qwen3 MoE block, h 128,
    E 4, f 64, k 2, bf16, one kernel per scheduler node, the peaks located by replaying the
    wrapper code): 2 x 64 tokens ``mlp_in``, 2 x 128 and 2 x 256 ``mlp_act``, exact, with
    and without a shared expert (96 and 256 wide). By hand, 2 x 128 (T 256, R 512), routed
    alone: ``mlp_act`` 131,072 + 2,048 + 2 x 4,096 + 4,096 + 131,072 + 16 + 2 x 65,536 own,
    131,072 + 4 x 65,536 new: 800,784 beside the attention's 536,576 (its saved set 503,808
    and the value third 32,768): 1,337,360, traced 1,337,360 with the incoming gradient
    (65,536) left out."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    assert e < FP32_BYTES, "traced in bf16 alone (_compile_titan_moe_refusal)"
    routed = dm.tokens * moe.top_k
    f = moe.expert_ffn_hidden_size // dm.experts().tp
    experts = moe.num_experts // dm.ep
    rows, inner = routed * h * EXPERT_BYTES, routed * f * EXPERT_BYTES
    value = dm.tokens * spec.kv_size // dm.tp * e  # the rerun's wqkv output's value third
    offsets = experts * OFFSET_BYTES
    shared: tuple[str, ...] = ()
    waiting = 0
    if moe.num_shared_experts:
        shared, waiting = ("moe_shared",), 2 * dm.rows * h * e
    act_own = (dm.tokens * h * FP32_BYTES + moe.num_experts * h * FP32_BYTES
               + 2 * routed * INDEX_BYTES + dm.tokens * moe.num_experts * FP32_BYTES
               + rows + offsets + 2 * inner)
    in_own = (dm.tokens * h * FP32_BYTES + dm.rows * h * e + inner + routed * INDEX_BYTES
              + offsets)
    # the ffn norm's output, in the norm's saved set for a shared expert, freed by then
    value -= shared_input_freed(spec, dm)
    return [BackwardMoment("mlp_act", value + act_own, waiting + rows + 4 * inner, shared),
            BackwardMoment("mlp_in", value + in_own, waiting + 2 * rows, ("mlp",))]
