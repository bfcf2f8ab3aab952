"""Which of Inductor's kernel orders a compiled layer's backward runs, from memplan's moments.

Inductor's scheduler keeps, of its own order (the baseline) and three heuristic sorts, the one
of the lowest estimated peak (torch/_inductor/memory.py ``reorder_for_peak_memory``, torch
2.13: ``min`` over the list, baseline first, so a tie keeps the baseline); its wrapper then
holds a freed buffer for a later allocation of its key only where that does not raise the
chosen order's estimated peak (codegen/wrapper.py ``AllocateLine.should_reuse_buffer``). Both
read ``estimate_peak_memory``: the buffers the graph allocates, by their sizes, from their
first writer to their last reader, graph outputs to the end, graph inputs the graph cannot
free (the checkpointed input, the incoming gradient, the weights) not counted. Here the two
decisions are taken for torchtitan's block rebuilt inside the compiled graph
(``compiled.rebuilt_attention_schedule``: fused q/k/v, its complex64 RoPE table), with the
estimates computed from memplan's moments, as ``compiled.float8_lpmf_grad_in_first`` does.

Each estimate below is a moment's bytes less what Inductor's estimate leaves out or adds; a
constant common to all of them (the input and the incoming gradient, not counted, less two
tables of the RoPE fallbacks' buffers, counted and not freed: ``compute_size_for_scheduler_
buffer`` gives a ``MultiOutputLayout`` fallback its users' bytes and frees those once) is
left out of every one, so the comparisons hold. Traced: benchmarks/compiled_backward.py,
Inductor's log (``reorder_for_peak_memory``'s estimates) and its output code, 2 x 64, 2 x 96
and 2 x 1,024 tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from memplan.model import compiled, linear
from memplan.model.dims import FP32_BYTES, Dims, Term
from memplan.spec import ModelSpec, QkNorm
from memplan.workload import Attention, Float8Recipe, Recompute, RopeCache, Workload

if TYPE_CHECKING:
    from memplan.model.layer import LayerMoment

# the moments of Inductor's order of the rebuilt layer's backward (``compiled``), the others
# being the eager order's
_KERNEL, _ROPE, _QKV = "mlp_act", "attention_rope", "attention_qkv"
RERUN_ROPE, MLP_GRADS_LAST = "attention_rerun_rope", "mlp_grads_last"
_ALL_GROUPS = ("mlp", "mlp_norm", "attn", "attn_norm")


def lpmf_defers_mlp_grads(spec: ModelSpec, dm: Dims) -> bool:
    """Whether ``topological_sort_lpmf`` (torch/_inductor/memory.py) runs the MLP's three weight
    gradients after everything else. After the MLP's fused kernel lpmf picks, among the ready
    nodes that fit under its running peak, the one of the least bytes written less bytes
    freed, then the lowest index. The down projection's weight gradient writes h f and frees
    the product (T f, its last reader); the up projection's grad-input matmul writes T h and
    frees nothing yet (its weight gradient still reads the same input): the weight gradient
    goes later where f (h - T) > T h, and so do gate's and up's, which write h f and free at
    most their T f input; the attention's nodes all write less than that net. A tie goes to
    the weight gradient (the lower index, the baseline's order): at 2 x 96 tokens with h 256
    and f 768, 768 x 64 = 192 x 256, the baseline's order follows. Traced: 2 x 64 deferred
    (lpmf's estimate 1,852,416 B, its peak at the last weight gradient), 2 x 96 and 2 x
    1,024 not (lpmf's order runs them after the MLP's kernel)."""
    f, h, t = spec.ffn_hidden_size, spec.hidden_size, dm.tokens
    return t * (f + h) < f * h


def at_mlp_threshold_or_below(spec: ModelSpec, dm: Dims) -> bool:
    """T (f + h) <= f h: the MLP's weight gradients (h f each) at least what their inputs and
    the grad-input matmul's output hold, where Inductor's lpmf or dfs order defers them past
    the attention's backward (at the threshold itself dfs did: torchtitan's block, 2 x 96
    tokens, h 256, f 768, its log dfs 2,354,688 B against the baseline's 2,416,128;
    ``lpmf_defers_mlp_grads`` is lpmf's own, strictly below)."""
    f, h = spec.ffn_hidden_size, spec.hidden_size
    return dm.tokens * (f + h) <= f * h


def sac_rerun_rope(spec: ModelSpec, dm: Dims, kept: Sequence[Term],
                   ) -> tuple[str, int, int, tuple[str, ...]]:
    """Per-op SAC: the rerun's RoPE of q, after the MLP's backward and its weight gradients
    (``compiled.sac_deferred``: the attention side rebuilt where its backward needs it).
    Alive: the input, the output projection's output (rebuilt from the kept SDPA output for
    the MLP norm's backward), both MLP input gradients, the attention output's gradient and
    its product with the output projection's weight (SDPA's output gradient, T q), the
    policy's kept attention outputs (q/k/v, SDPA's output, its logsumexp) and the MLP norm's
    statistics; in flight the incoming gradient, q's fp32 upcast and its complex product,
    and the table's conjugate (a clone, made before). Traced (Inductor's output code, 2 x 96
    tokens): the backward's peak, 2,427,648 B with the held output for the input and the
    incoming gradient."""
    th, q, _, q32, table = compiled.attention_sizes(spec, dm)
    attn = sum(t.size_bytes for t in kept if t.name.startswith("sac.attn."))
    alive = 5 * th + q + attn + dm.rows * FP32_BYTES
    return (RERUN_ROPE, alive, th + 2 * q32 + table, ("mlp",))


def _size(m: LayerMoment, dm: Dims, groups: Mapping[str, int]) -> int:
    return m.alive_bytes + m.transient_bytes + dm.stream_e * sum(
        groups[g] for g in m.grads_before)


def with_sac_order(moments: Sequence[LayerMoment], spec: ModelSpec, dm: Dims,
                   groups: Mapping[str, int], kept: Sequence[Term]) -> list[LayerMoment]:
    """Per-op SAC's moments (``compiled.with_attention_backward``'s, their buffer-reuse holds
    all counted) with the rerun's RoPE moment (``sac_rerun_rope``), the holds Inductor's
    wrapper keeps, and lpmf's order where Inductor takes it (``with_lpmf_order``).

    The estimates (see the module's docstring): the kept q/k/v output is a freeable graph
    input sized by its last reader's dependency (``get_freeable_input_buf`` overwrites the
    size per reader: v's slice, T kv), so the MLP's kernel and the rerun's RoPE count T (q +
    kv) less; the RoPE fallbacks run after the MLP's kernel (two tables less there) and, at
    the rerun's RoPE, the table's reshape is still read (three tables: one more). At q's RoPE
    backward the estimate leaves out dq (``with_sdpa_grad_reuse``) and the three holds: k's
    fp32 upcast (for dk's) and two T q buffers (SDPA's output gradient and the rerun's RoPE'd
    q, for the q/k/v input gradient and the norms' backward). The wrapper plans k's first (its
    allocation comes first), each accepted hold raising the window for the next. Traced: 2 x
    96 tokens, estimates 2,095,872 B (the MLP's kernel), 2,243,328 (the rerun's RoPE: the
    peak), 2,151,168 (q's RoPE backward): k's upcast held (+49,152 <= 2,243,328), neither T q
    buffer (+98,304 > it): the trace's 2,427,648 B at the rerun's RoPE, memplan exact (+5.8%
    before); 2 x 1,024 all three held (the MLP's kernel far above); 2 x 64 in lpmf's order."""
    _, q, kv, _, table = compiled.attention_sizes(spec, dm)
    qkv = sum(t.size_bytes for t in kept if t.name == "sac.attn.qkv")
    k32 = kv // dm.e * FP32_BYTES
    rerun = sac_rerun_rope(spec, dm, kept)
    out = list(moments)
    if not any(m.name == _ROPE for m in out) or not qkv:
        return out
    out.append(type(out[0])(*rerun))
    kernel = next(m for m in out if m.name == _KERNEL)
    rope = next(m for m in out if m.name == _ROPE)
    under = qkv - kv  # the kept q/k/v output, sized as v's slice
    peak = max(_size(kernel, dm, groups) - under - 2 * table,
               _size(out[-1], dm, groups) - under + table,
               _size(rope, dm, groups) - 3 * q - k32)
    window = _size(rope, dm, groups) - 3 * q - k32
    dropped = 0 if window + k32 <= peak else k32
    window += k32 - dropped
    for _ in range(2):
        if window + q <= peak:
            window += q
        else:
            dropped += q
    out = [m._replace(alive_bytes=m.alive_bytes - dropped) if m.name in (_ROPE, _QKV) else m
           for m in out]
    lpmf_kernel = _size(kernel, dm, groups) + table
    return with_lpmf_order(out, spec, dm, groups, peak,
                           [sac_lpmf_rope(spec, dm, groups, lpmf_kernel, type(out[0]))])


def sac_lpmf_rope(spec: ModelSpec, dm: Dims, groups: Mapping[str, int], kernel: int,
                  moment: type) -> tuple[LayerMoment, int]:
    """Per-op SAC in lpmf's order (``with_lpmf_order``): q's RoPE backward and Inductor's
    estimate of it, given ``kernel``, the estimate at lpmf's MLP kernel. Alive beside the
    input: the output projection's output, the MLP norm's output and statistics, the three
    T f inputs of the deferred MLP weight gradients, both MLP input gradients, the attention
    output's gradient, and the output projection's weight gradient, made before; in flight
    the incoming gradient, the fused q/k/v gradient (one buffer, its dk and dv parts
    written), q's fp32 upcast and its product, the table's conjugate. The estimate counts
    the q/k/v gradient's written parts alone (T q less) and none of the wrapper's holds:
    the SDPA output's gradient and the rerun's RoPE'd q (T q each, for the q/k/v and norm
    input gradients) and the MLP norm backward's statistics, each held where the window's
    estimate plus it stays within lpmf's peak. k's fp32 upcast, made before the kernel, is
    held (or not) for dk's upcast alone: lpmf runs dk's RoPE backward before dq's, so it is
    freed by then. Traced (Inductor's output code, h 256, f 768): 2 x 88 tokens, estimate
    1,832,640 B (less the common offset) against lpmf's peak 2,067,648 at the kernel: the
    three held, 2,171,264 B with the held output, the backward's peak (memplan -1.7%
    without the moment); 2 x 80 the same holds, below lpmf's end."""
    th, q, kv, q32, table = compiled.attention_sizes(spec, dm)
    tf = dm.tokens * spec.ffn_hidden_size * dm.e
    stats = dm.rows * FP32_BYTES
    wo = spec.hidden_size * spec.num_attention_heads * spec.head_dim * dm.stream_e
    transient = th + q + 2 * kv + 2 * q32 + table
    estimate = 6 * th + 3 * tf + stats + transient + wo - q
    peak = max(kernel, _size(moment(*mlp_grads_last(spec, dm)), dm, groups), estimate)
    held = 0
    for hold in (q, stats, q):
        held += hold if estimate + held + hold <= peak else 0
    alive = 6 * th + 3 * tf + stats + held
    return moment(_ROPE, alive, transient, ("attn_out",)), estimate


def with_sac_schedule(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                      dm: Dims, rebuilt: Sequence[Term], kept: Sequence[Term],
                      groups: Mapping[str, int]) -> tuple[LayerMoment, ...]:
    """Per-op SAC's moments from the full recompute's (``moments``), compiled with the
    checkpoint inside the graph (``compiled.sac_schedule``): the attention side deferred
    (``compiled.sac_deferred``), and where the attention's backward was traced
    (``compiled.rebuilt_attention_schedule``) its moments (``compiled.
    with_attention_backward``) in Inductor's order (``with_sac_order``)."""
    moments = compiled.with_attention_backward(compiled.sac_deferred(moments, rebuilt, kept),
                                               spec, wl, dm, kept)
    if not compiled.rebuilt_attention_schedule(spec, wl, dm, Recompute.FULL):
        return moments
    return tuple(with_sac_order(moments, spec, compiled.rerun_dims(dm), groups, kept))


def with_full_ac_order(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                       dm: Dims, groups: Mapping[str, int]) -> list[LayerMoment]:
    """Full AC's moments (the SDPA output gradient's hold decided:
    ``compiled.with_sdpa_grad_reuse``) in lpmf's order where Inductor takes it
    (``with_lpmf_order``), for the layer ``compiled.rebuilt_attention_schedule`` traces.
    The baseline's estimated peak: the MLP's kernel as its moment (the reshape's fallback
    counted at two tables, the common offset) or q's RoPE backward less dq and the SDPA
    output's gradient (``compiled.attention_backward_moments``' moment with its hold;
    ``with_sdpa_grad_reuse``). Traced: 2 x 64, the baseline's estimate 1,893,376 B at q's
    RoPE backward (memplan's 2,139,136 - 2 x 65,536 less the common 114,688), lpmf's
    1,852,416 at its end: lpmf; 2 x 96 the baseline's 2,342,400 at the MLP's kernel (lpmf
    does not defer there)."""
    if not compiled.rebuilt_attention_schedule(spec, wl, dm, Recompute.FULL):
        return list(moments)
    dm = compiled.rerun_dims(dm)
    kernel = next((m for m in moments if m.name == _KERNEL), None)
    raw = next((m for m in compiled.attention_backward_moments(spec, dm) if m[0] == _ROPE),
               None)
    if kernel is None or raw is None:
        return list(moments)
    q = compiled.attention_sizes(spec, dm)[1]
    rope = raw[1] + raw[2] + dm.stream_e * sum(groups[g] for g in raw[3]) - 2 * q
    return with_lpmf_order(moments, spec, dm, groups, max(_size(kernel, dm, groups), rope))


def mlp_grads_last(spec: ModelSpec, dm: Dims) -> tuple[str, int, int, tuple[str, ...]]:
    """lpmf's order's last kernel, the gate projection's weight gradient: every weight gradient
    of the layer made, beside the input, the layer's input gradient (a graph output), the MLP
    norm's output and gate's output gradient (T f), both read by it; in flight the incoming
    gradient. By hand at 2 x 64 tokens (h 256, f 768): 3 x 65,536 + 196,608 alive, 65,536 in
    flight, 1,508,352 B of weight gradients: 1,967,104 B, the trace's 1,901,568 with the held
    output for the input and the incoming gradient, full AC and per-op SAC alike."""
    th = dm.rows * spec.hidden_size * dm.e
    tf = dm.tokens * spec.ffn_hidden_size * dm.e
    return (MLP_GRADS_LAST, 3 * th + tf, th, _ALL_GROUPS)


def in_step(end: LayerMoment, spec: ModelSpec, dm: Dims) -> LayerMoment:
    """``mlp_grads_last``'s moment in a step: the layer's input and the incoming gradient
    freed. Inductor's backward takes the saved input and the incoming gradient as graph
    inputs and frees each after its last reader (the attention norm's backward and the
    output projection's and down projection's gradients), both before lpmf's last kernel;
    nothing else holds them in a step (the decoder loop rebinds the hidden state, the
    autograd engine hands the gradient on). A test that holds them itself (a layer alone,
    ``benchmarks/compiled_backward.py``) adds them back. Traced: transformers' Llama and
    Qwen3 steps at h 512, 1 x 256 (three layers, vocabulary 1,024, tests/traced/
    test_frameworks.py): +591,616 B (+1.30%) in backward with them, +67,328 (+0.15%)
    without; OLMo 2 inside its checkpoint +659,200 B, then +134,912; one Gemma 2 / OLMo 2
    layer inside its checkpoint at 2 x 64 +3.4% / +4.0%, then +0.23% / +0.48%. torchtitan's
    fused-q/k/v block in bf16 (``with_lpmf_order``) ends the same way, by the same
    mechanism; no whole step of it below the threshold is traced (the held-out torchtitan
    steps there have separate q/k/v or float8 linears)."""
    th = dm.rows * spec.hidden_size * dm.e
    return end._replace(alive_bytes=end.alive_bytes - th,
                        transient_bytes=end.transient_bytes - th)


def held_by_lone_layer(m: LayerMoment, stream: int) -> int:
    """What a test of one layer that holds the layer's input and the incoming gradient itself
    (``stream`` bytes each) has alive at ``m`` beyond the step's moment: both at lpmf's end
    (``in_step``), nothing elsewhere."""
    return 2 * stream if m.name == MLP_GRADS_LAST else 0


# the gradient groups of the layers ``with_mlp_grads_last`` was traced on (pre-norm, post-norm
# and sandwich layers: ``layer.grad_group_params``)
_TRACED_GROUPS = frozenset({"attn_norm", "attn_input", "attn_out", "attn", "attn_post_norm",
                            "mlp_norm", "mlp_input", "mlp_out", "mlp", "mlp_post_norm"})


# ``with_mlp_grads_last``, traced (benchmarks/compiled_backward.py, the GPU realization rules)
# where it applies, in bf16: transformers' Llama at 2 x 64 and 2 x 80, full AC at 2 x 64;
# torchtitan's block (separate q/k/v) at 2 x 64 and at dim 512, 1 x 256, both also under full
# AC and under per-op SAC (the kept outputs freed by its end); Mistral's and Qwen3's layers at
# h 512, 1 x 256, none and full; OLMo 2's and Gemma 2's at 2 x 64, none and full: exact (+1.6%
# to +9.1% before, in the baseline's order where an earlier rule asked the end to exceed every
# moment by 2 T f, and per-op SAC's not at all). At 2 x 96, Llama's, Inductor's
# estimates (``reorder_for_peak_memory``'s) put lpmf's at the baseline's, 2,727,424 B (its peak
# at the fused kernel beside the down projection's gradient), and take dfs's order, 2,612,736:
# memplan's lpmf order is over that trace by 1.56% (the baseline's by 4.91%). Whole steps
# (tests/traced/test_frameworks.py): Gemma 3 inside its checkpoint at 1 x 256 and one Llama
# layer at 2 x 80 within 0.04% (+1.45% and +1.48% before).


def with_mlp_grads_last(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                        dm: Dims, groups: Mapping[str, int]) -> list[LayerMoment]:
    """A dense layer's compiled backward in lpmf's order below the MLP's weight-gradient
    threshold (``lpmf_defers_mlp_grads``), where that order's estimated peak is below the
    baseline's (Inductor keeps the order of the least estimated peak,
    ``reorder_for_peak_memory``): ``moments`` (the baseline's order) up to the MLP's gate and
    up weight gradients, then ``mlp_grads_last`` (every weight gradient made, the saved set
    freed; in a step without the input and the incoming gradient, ``in_step``).

    lpmf (torch/_inductor/memory.py ``topological_sort_lpmf``) runs the down projection's
    weight gradient first, before the MLP's fused kernel, as the baseline does (its order
    for transformers' Llama layer at 2 x 64 and 2 x 96 tokens: the logsumexp's copy, then
    the down projection's two matmuls, then the fused kernel), so the moments up to the kernel
    are the baseline's; it defers the gate and up weight gradients past the attention's
    backward, which then holds their inputs instead (gate's and up's output gradients, T f
    each, and the MLP norm's output, T h; counted with one T f more, the product's, for the
    order's estimate): each moment after the MLP's kernel is the baseline's less those
    gradients plus the inputs, and the order ends at gate's weight gradient. Its estimate is
    the largest of those and its end.

    Only for the layers traced (the comment above): attention (no MLA) and a gated MLP, each
    with its norms (``_TRACED_GROUPS``), not a parallel block. Not taken under
    autocast (its end moment is not the peak: -8.7%), with float8 linears, a fused q/k/v
    projection (torchtitan's, whose lpmf order ``with_lpmf_order`` follows), adapters, tp or
    cp > 1, or fp32."""
    # (cp 1: the rank's sequence is the whole one its queries attend to)
    if not (wl.compile and not dm.autocast and dm.e == 2 and dm.tp == 1 and dm.s == dm.s_kv
            and dm.float8 is Float8Recipe.NONE and dm.te_fp8.value == "none"
            and not (spec.fused_qkv or wl.fused_qkv) and dm.adapters is None
            and spec.mla is None and not spec.parallel_block
            and spec.mlp.value in ("swiglu", "geglu") and set(groups) <= _TRACED_GROUPS
            and {"attn", "mlp", "mlp_out"} <= set(groups)
            and lpmf_defers_mlp_grads(spec, dm)):
        return list(moments)
    th = dm.rows * spec.hidden_size * dm.e
    tf = dm.tokens * spec.ffn_hidden_size * dm.e
    e = dm.stream_e
    kept: list[LayerMoment] = []  # the baseline's moments before gate's and up's gradients
    estimate = 0  # lpmf's estimated peak before its end
    for m in moments:
        size = _size(m, dm, groups)
        if "mlp" in m.grads_before:  # deferred: their inputs held instead
            estimate = max(estimate, size - e * groups["mlp"] + 3 * tf + th)
        else:
            kept.append(m)
            estimate = max(estimate, size)
    # every block's gradients (a block's group, not the output projections' sub-groups)
    every = tuple(g for g in groups if not (g.endswith("_out") and g[:-4] in groups))
    end = type(moments[0])(*mlp_grads_last(spec, dm)[:3], every)
    baseline = max(_size(m, dm, groups) for m in moments)
    if max(estimate, _size(end, dm, groups)) >= baseline:
        return list(moments)
    return kept + [in_step(end, spec, dm)]


def with_lpmf_order(moments: Sequence[LayerMoment], spec: ModelSpec, dm: Dims,
                    groups: Mapping[str, int], baseline: int,
                    extra: Sequence[tuple[LayerMoment, int]] = ()) -> list[LayerMoment]:
    """``moments`` (the baseline's order, ``baseline`` its estimated peak) in lpmf's order
    where ``reorder_for_peak_memory`` takes it: where lpmf defers the MLP's weight gradients
    (``lpmf_defers_mlp_grads``) and its estimated peak is below the baseline's. lpmf runs
    the RoPE table's fallbacks (no inputs but graph inputs) first, so at its MLP kernel the
    table's conjugate is made: memplan's moment there is the baseline's plus one table, and
    so is Inductor's estimate (full AC, traced: 1,569,792 B against 1,561,600 at 2 x 64,
    2,354,688 against 2,342,400 at 2 x 96). Under per-op SAC lpmf also runs before it the
    kernels that free graph inputs: the kept q/k/v output and logsumexp become the RoPE'd q
    and k, v and the logsumexp's copy for SDPA's backward, the same bytes, now counted whole
    (1,503,744 B at 2 x 64: the moment less the common offset). Its end is
    ``mlp_grads_last``, whose estimate is its moment. Its attention's backward holds the
    three T f inputs of the MLP's weight gradients and the MLP norm's output instead of
    those gradients, 3 f (h - T) - T h elements less than the baseline's, far below its end
    at 2 x 64 but lpmf's peak nearer the threshold: ``extra``, its moments with their
    estimates (per-op SAC: ``sac_lpmf_rope``; under full AC not modelled: at 2 x 80 and
    2 x 88 the kernel's above it, traced). The eager order's moments after the kernel are
    dropped. Traced (Inductor's log): 2 x 64 full AC, lpmf 1,852,416 B against the
    baseline's 1,893,376; per-op SAC 1,852,416 against 1,888,768 (the rerun's RoPE): lpmf
    both, the trace 1,901,568 B, memplan exact (+5.6% and +10.7% before); 2 x 80 and 2 x 88
    lpmf under both, exact. ``dfs`` (the third sort) ties lpmf at 2 x 64 and ``bfs`` is
    above both; neither is modelled."""
    if not lpmf_defers_mlp_grads(spec, dm):
        return list(moments)
    end = type(moments[0])(*mlp_grads_last(spec, dm))
    table = compiled.attention_sizes(spec, dm)[4]
    first = [m for m in moments if not m.grads_before and m.name != RERUN_ROPE]
    lpmf = [m._replace(transient_bytes=m.transient_bytes + table) if m.name == _KERNEL else m
            for m in first] + [end]
    estimates = [_size(m, dm, groups) for m in lpmf if m.name in (_KERNEL, MLP_GRADS_LAST)]
    if max(estimates + [e for _, e in extra]) >= baseline:
        return list(moments)
    return lpmf[:-1] + [in_step(end, spec, dm)] + [m for m, _ in extra]


def with_float8_sac_lpmf(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                         dm: Dims, linears: Sequence[linear.Linear], kept: Sequence[Term],
                         saved: int) -> list[LayerMoment]:
    """Per-op SAC with tensorwise ``Float8Linear``s on every projection of torchtitan's block
    (separate q/k/v, its complex64 RoPE table: ``compiled.float8_lpmf_grad_in_first``'s
    conditions), compiled with the checkpoint inside the graph: the MLP's float8 moment
    (``mlp_f8_act``) in the order of Inductor's ``topological_sort_lpmf``, which
    ``reorder_for_peak_memory`` keeps there (torch/_inductor/memory.py, torch 2.13; its log:
    2 x 128 tokens lpmf 2,909,246 B against the baseline's 2,925,612, 2 x 256 5,244,990
    against 5,392,428, 2 x 1,024 19,259,454 against 20,193,324). ``moments``: the full
    recompute's (the whole layer rebuilt, ``float8_swiglu_casts`` on the rerun's saved set);
    ``saved``: the input and the policy's kept outputs (``kept``).

    lpmf runs first the kernels that read graph inputs alone, as without recompute
    (``float8_lpmf_grad_in_first``: the projections' transposed weight casts, the incoming
    gradient's and SDPA output's casts, the logsumexp's copy, the table's clone; the kept
    q output becomes the RoPE'd q, the same bytes), and the rebuild's weight casts with
    them: of those the rerun's k projection's (k's output is not kept; k is rebuilt after
    the MLP's backward) is alive at the peak, the output projection's and up's freed after
    their matmuls. The peak is up's grad-input ``_scaled_mm``, as without recompute, beside
    the saved set, the MLP norm's statistics and two rebuilt outputs (the output
    projection's, T x h, read by the residual sum the MLP norm's backward reads; up's,
    T x f), the product's gradient (T x f) and the incoming gradient; no weight gradient
    made. The scalars: nine fp32 scales and four amaxes made in the backward, four saved
    scales and one saved amax. Traced (benchmarks/compiled_backward.py, Inductor's output
    code ``buf24``'s ``_scaled_mm`` at 2 x 256; torchao 0.18.0): 2 x 128, 2 x 256 and 2 x
    1,024 tokens exact (2,991,166 B, 5,408,830 B and 19,914,814 B with the held output for
    the input and the incoming gradient; +3.3%, +5.8% and +4.2% before, the rerun's whole
    saved set counted). At 2 x 64 tokens, below the MLP's weight-gradient threshold
    (``lpmf_defers_mlp_grads``), Inductor keeps ``topological_sort_dfs``'s order (its
    estimate 1,721,352 B, lpmf's 1,741,374, the baseline's 1,958,932): 1,770,504 B traced,
    this moment 0.7% over it, and the full recompute's later moments (every MLP weight
    gradient made beside the rebuilt set) 7.6% over, not modelled."""
    first = compiled.float8_lpmf_grad_in_first(spec, wl, dm, linears)
    if first is None or wl.recompute is not Recompute.SELECTIVE:
        return list(moments)
    h = spec.hidden_size
    th, tf = dm.rows * h * dm.e, dm.tokens * spec.ffn_hidden_size * dm.e
    names = {t.name for t in kept}
    k_cast = 0 if "sac.attn.k_proj" in names else spec.kv_size * h * linear.FLOAT8_BYTES
    scalars = ((9 + 4) * linear.FLOAT8_SCALE_BYTES + (4 + 1) * dm.e
               - compiled.float8_lpmf_scalars(dm)[0])
    alive = saved + dm.rows * FP32_BYTES + th + tf
    transient = tf + first + scalars + th + k_cast
    return [m._replace(alive_bytes=alive, transient_bytes=transient, grads_before=())
            if m.name == "mlp_f8_act" else m for m in moments]


def with_parallel_attention_first(moments: Sequence[LayerMoment], spec: ModelSpec, dm: Dims,
                                  recompute: Recompute) -> list[LayerMoment]:
    """Compiled under autocast without recompute, a parallel layer (``ModelSpec.
    parallel_block``, Cohere's: both mixers read one norm's output, their outputs summed
    into the stream): after the down and output projections' matmuls, which read the same
    cast of the incoming gradient (freed after them), Inductor runs the attention's SDPA
    backward before the MLP's fused kernel. At that kernel the attention's saved q, k, v,
    SDPA output and logsumexp and the output projection's weight cast are freed, and SDPA's
    input gradients (dq, dk, dv) and the output projection's weight gradient, in the
    compute dtype until its cast, are alive. Traced: benchmarks/compiled_backward.py,
    Command R's layer, amp-bf16, 2 x 256 tokens (``cpp_fused__unsafe_view_mul_silu_silu_
    backward_view_3`` after ``_scaled_dot_product_flash_attention_for_cpu_backward``):
    7,016,448 B with the held output, memplan 7.7% over with the attention's saved set
    counted there."""
    if not (dm.compiled and dm.autocast and spec.parallel_block
            and recompute is Recompute.NONE):
        return list(moments)
    _, q, kv, _, _ = compiled.attention_sizes(spec, dm)
    o_cast = spec.hidden_size * spec.q_size * dm.e  # as its weight gradient, before the cast
    lse = dm.b * spec.num_attention_heads * dm.s * FP32_BYTES  # SDPA's (``attn.lse``)
    freed = 2 * q + 2 * kv + lse + o_cast
    made = q + 2 * kv + o_cast
    return [m._replace(alive_bytes=m.alive_bytes - freed, transient_bytes=m.transient_bytes + made)
            if m.name == "mlp_act" else m for m in moments]


def _norm_reductions_last(spec: ModelSpec, wl: Workload, dm: Dims,
                          recompute: Recompute) -> bool:
    """Where ``with_norm_reductions_last`` applies: a compiled pre-norm layer not
    recomputed, or rebuilt inside the graph in bf16, above the MLP's weight-gradient
    threshold, on one rank, without float8."""
    rebuilt = (recompute is Recompute.FULL and not compiled.in_checkpoint(wl)
               and not dm.autocast)  # (rebuilt under autocast: not traced to the kernel)
    return not (not dm.compiled or not (recompute is Recompute.NONE or rebuilt)
                or spec.parallel_block or not spec.norm_placement.pre_norm
                or at_mlp_threshold_or_below(spec, dm) or dm.tp > 1
                or dm.float8 is not Float8Recipe.NONE)  # (traced on one rank, bf16)


def with_norm_reductions_last(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                              dm: Dims, recompute: Recompute) -> list[LayerMoment]:
    """A compiled dense layer's backward, not recomputed or rebuilt inside the graph (full
    recompute, the checkpoint inside it), its norms' weight gradients as Inductor schedules
    them: every norm's weight-gradient reduction but the attention pre-norm's is fused with
    that one, in one kernel after the attention's input-gradient matmuls, and until then
    each deferred norm holds what it reads: its saved input and statistics, and the MLP's
    grad-input outputs into the norm before it (their sum inlined), one per input
    projection. The residual gradient is a buffer of its own beside the incoming gradient,
    which the compiled function's caller holds to its return whatever the graph frees; with
    sandwich norms it is fp32, and the output projection's output gradient and the
    post-attention norm's row sums (fp32) are buffers of their own, held for reuse. Under
    autocast the MLP post norm's reduction runs first (``with_post_norm_schedule``).
    Traced (GPU realization rules, benchmarks/compiled_backward.py, h 384, 3 x 160 tokens,
    held out), the reduction's kernel reading: Gemma 2's layer, bf16, ``tangents_1``,
    ``mm_6``, ``rsqrt_3``, ``buf8``, ``buf11``, ``mm_3``, ``rsqrt_1``, ``rsqrt_2``, the fp32
    ``buf15``, the peak at SDPA's backward; amp-bf16, ``buf8``, ``buf12``, ``mm_3``,
    ``rsqrt_1``, ``rsqrt_2``, ``buf16``; Llama's (all KV heads, ffn 512), ``buf4``, ``buf7``,
    ``mm_3``, ``rsqrt_1`` (``tangents_1`` deleted before, still alive), rebuilt ``buf27``,
    ``buf30``, ``buf17``, ``buf18``. At or below the MLP's weight-gradient threshold
    (``at_mlp_threshold_or_below``) Inductor takes lpmf's or dfs's order, deferring the MLP's
    weight gradients, and the baseline's moments there are over: nothing added."""
    if not _norm_reductions_last(spec, wl, dm, recompute):
        return list(moments)
    from memplan.model.norm import consumers, norm_terms, saved_at_backward

    sandwich = spec.norm_placement.post_norm
    deferred = ["mlp_norm"] + (["attn_post_norm"] if sandwich else [])
    if sandwich and not dm.autocast:
        deferred.append("mlp_post_norm")
    th = dm.rows * spec.hidden_size * dm.e
    held = (consumers("mlp_norm", spec, wl) * th  # the MLP's input projections' gradients
            + sum(saved_at_backward(norm_terms(n, spec, wl, dm)) for n in deferred))
    held += th // dm.e * (FP32_BYTES if sandwich or dm.autocast else dm.e)
    if sandwich:
        held += th + dm.rows * FP32_BYTES
    out, after = [], False
    for m in moments:
        if m.name == "attn_norm":
            after = False
        if after:
            m = m._replace(alive_bytes=m.alive_bytes + held,
                           grads_before=tuple(g for g in m.grads_before if g not in deferred))
        out.append(m)
        after = after or m.name == "mlp_norm"
    return out


def with_qk_norm_input_grads(moments: Sequence[LayerMoment], spec: ModelSpec, wl: Workload,
                             dm: Dims, recompute: Recompute) -> list[LayerMoment]:
    """A compiled layer with per-head q/k norms before RoPE (``QkNorm.HEAD``, token-major:
    transformers' Qwen3Attention), not recomputed, in Inductor's baseline order (the MLP's
    weight gradients first: ``compiled.mlp_grads_deferred`` false, and
    ``with_norm_reductions_last``'s conditions): every weight gradient of the attention, its
    q/k norms' and the norms' reductions run after the attention's input-gradient matmuls,
    so the last of those, q's, peaks holding what they read. ``attention_qk_norm`` after
    ``attention.0``: SDPA's saved q, k, v and logsumexp freed, and under autocast the k and
    v weights' casts; alive, beside ``attention.0``'s other saved tensors and
    ``with_norm_reductions_last``'s holds: dv (for v's weight gradient), RoPE's backward
    outputs for q and k (their norms' weight reductions read them; fp32 under autocast,
    where the norm's fp32 weight times its bf16 output is fp32 and RoPE runs on it), the
    norms' input gradients (the projections' weight gradients read them), the three input
    gradients (summed by the attention norm's kernel at the end), the MLP norm's row sums
    (fp32, held by the wrapper for the attention norm's) and under autocast the output
    projection's output gradient, the residual gradient's bf16 cast its deferred weight
    gradient reads; the output projection's weight gradient not made. Traced (GPU
    realization rules, benchmarks/compiled_backward.py; Qwen3's layer, h 512, 8 heads of
    64, ffn 1,376, amp-bf16, 1 x 768 tokens, Inductor's log: baseline, lpmf and bfs
    25,458,688, kept): the peak at ``mm_20`` (``buf39``), 26,338,304 B with 8 KV heads,
    23,370,752 B with 2, exact (-3.90% and -4.04% before). In bf16 the same order peaks
    below the MLP's moments (RoPE's outputs bf16: 1 x 768, not the peak traced); under
    autocast at 2 x 256 Inductor takes lpmf's order (the MLP deferred), left out."""
    from memplan.model.attention import attention_linears, attention_terms

    at = next((i for i, m in enumerate(moments) if m.name == "attention.0"), None)
    if (at is None or recompute is not Recompute.NONE
            or not _norm_reductions_last(spec, wl, dm, recompute)
            or spec.qk_norm is not QkNorm.HEAD or not spec.qk_norm_token_major
            or spec.norm_placement.post_norm or wl.attention is not Attention.FLASH
            or len(attention_linears(spec)) != 4 or compiled.mlp_grads_deferred(spec, wl, dm)):
        return list(moments)
    e, rows = dm.e, dm.rows
    th = rows * spec.hidden_size * e
    q, kv = dm.tokens * spec.q_size * e, dm.tokens * spec.kv_size * e
    rotated = (q + kv) // e * (FP32_BYTES if dm.autocast else e)
    casts = 2 * spec.hidden_size * spec.kv_size * e if dm.autocast else 0
    lse = sum(t.size_bytes for t in attention_terms(spec, wl, dm, recompute)
              if t.name == "attn.lse")
    branch = th if dm.autocast else 0
    m = moments[at]  # its transient: the incoming gradient, dO, dq, dk and dv
    held = m._replace(
        name="attention_qk_norm",
        alive_bytes=m.alive_bytes - (q + 2 * kv) - lse - casts,
        # dO, dq and dk freed (dv kept); RoPE's outputs, the norms' input gradients
        # (q + kv), the three input gradients, the bf16 cast and the row sums made
        transient_bytes=(m.transient_bytes - (2 * q + kv) + rotated + q + kv + 3 * th
                         + branch + rows * FP32_BYTES),
        grads_before=tuple(g for g in m.grads_before if g != "attn_out"))
    return [*moments[:at + 1], held, *moments[at + 1:]]


def rebuilt_rope_bytes(spec: ModelSpec, wl: Workload, dm: Dims,
                       recompute: Recompute) -> int | None:
    """A pre-norm layer with transformers' RoPE (``rotate_half``, every head dimension rotated,
    no q/k norms), compiled and checkpointed inside the graph (nothing saved): RoPE's kernel's
    working set in the forward, None elsewhere. The norm's output is freed after its last
    readers, the q, k and v projections (Inductor's wrapper reuses its buffer for q's rotated
    half), so RoPE's kernel, one for q and k, holds q, k and v, each rotated half and the two
    rotated outputs it writes: 3 T q + 4 T kv in the compute dtype (under autocast too), where
    eagerly q's and k's rotations are apart. Traced (GPU realization rules, benchmarks/
    compiled_backward.py, Llama's layer with all KV heads, h 384, ffn 512, 1 x 640 and 3 x 160
    tokens, full recompute): ``cpp_fused__to_copy__unsafe_view_add_mul_transpose_
    unsqueeze_view_4`` writes ``buf14`` and ``buf15`` beside ``buf3``, ``buf5``, ``buf7``,
    ``buf10`` (the norm output's buffer) and ``buf13``: 7 rows x h in bf16 and amp-bf16 alike,
    the forward's peak (memplan +14.3% and -18% to -22% before). torchtitan's complex RoPE:
    ``_titan_rope_bytes``."""
    from memplan.spec import PositionKind

    if not (dm.compiled and recompute is Recompute.FULL and not compiled.in_checkpoint(wl)
            and spec.position is PositionKind.ROPE
            and spec.rotary_dim is None and spec.qk_norm is QkNorm.NONE and not dm.float8_tp
            and spec.norm_placement.pre_norm and spec.mla is None):
        return None
    q = dm.tokens * spec.q_size // dm.tp * dm.e
    k = dm.tokens * spec.kv_size // dm.tp * dm.e
    if (wl.rope_cache in (RopeCache.LAYER, RopeCache.MODEL_COMPLEX) and not dm.autocast
            and wl.recompute is Recompute.FULL):  # (per-op SAC: ``layer._op_sac_kind``)
        return _titan_rope_bytes(spec, wl, dm, q, k)
    return 3 * q + 4 * k


def _titan_rope_bytes(spec: ModelSpec, wl: Workload, dm: Dims, q: int, k: int) -> int:
    """torchtitan's complex RoPE in its block rebuilt inside the compiled graph (full
    recompute, bf16): q's and k's fp32 upcasts (viewed as complex) and q's complex64 product,
    an ``aten.mul`` fallback whose output is allocated before the upcast it reads is freed.
    The attention norm's fp32 statistics, which nothing reads, stay allocated: the wrapper
    holds their buffer for the MLP norm's (``buf27 = buf0; del buf0  # reuse``).

    With fused q/k/v the order is Inductor's choice (the module docstring). Its baseline (the
    graph's) upcasts q and k, then multiplies, and copies v out of wqkv's output for SDPA
    last, so wqkv's output is alive at q's product: q + 2 kv, both upcasts and the product.
    Inductor's estimate of that moment (the RoPE table's reshape, a fallback, counted at its
    bytes) is compared with its estimate of the MLP's act kernel, the checkpointed forward's
    other high point: the output projection's output and gate's, up's and the product's
    outputs (T f each: the estimate writes the product to a buffer of its own, the wrapper
    in place into gate's). Where the MLP's is not lower the sorts tie and the baseline stays
    (``reorder_for_peak_memory``: ``min``, baseline first). Where it is lower, lpmf copies v
    first (it writes least) and wqkv's output is freed after k's upcast, its last reader:
    the peak is there, q + 3 kv with both upcasts. In the baseline the wrapper holds the
    norm's output, freed after wqkv's matmul, for q's bf16 cast, the next buffer of its size
    and dtype, where its estimate over the nodes between, plus that buffer, stays at or below
    the order's estimated peak (codegen/wrapper.py ``AllocateLine.should_reuse_buffer``), so
    it is alive at q's product too. Without fused q/k/v the peak is at q's product beside k,
    v and the three fp32 tensors. With torchao's float8 linears the norm is fused into the
    input's float8 cast (no bf16 output to hold, no statistics buffer) and the baseline ran
    at every width traced, dim 384 included (the MLP's estimate then counts its casts too):
    9 S at dims 256 (both recipes), 320 (tensorwise) and 384 (rowwise).

    Traced (benchmarks/compiled_backward.py, GPU realization rules; Inductor's log and output
    code): torchtitan 0.3.0's debugmodel block (dim 256, 16 heads of 16, all KV heads, ffn
    768; 1 x 512, 2 x 256, 4 x 256, 1 x 2,048 tokens): baseline kept (estimates 9 S + the
    table against 10 S), 9 S + the statistics, memplan -11.2% before; dim 320, 5 heads of 64,
    ffn 1,024, 2 x 256: baseline kept and the norm's output held (9 S + the table + S below
    the MLP's 10.6 S), 10 S + the statistics (-10.0% without the hold); dim 384, 6 heads of 64,
    ffn 1,024, 3 x 160 and 1 x 640 tokens: baseline 3,358,720 B, lpmf 3,322,816 B (the MLP's
    estimate), lpmf's order, 8 S + the statistics (-8.4%, then the statistics under; exact)."""
    q32, k32 = q // dm.e * FP32_BYTES, k // dm.e * FP32_BYTES
    float8 = dm.float8 is not Float8Recipe.NONE  # the norm fused into the input's cast
    stats = 0 if float8 else dm.rows * FP32_BYTES
    if not (wl.fused_qkv or spec.fused_qkv):
        return 2 * k + 2 * q32 + k32 + stats
    baseline = q + 2 * k + q32 + k32 + q32
    if float8:
        return baseline
    th, table = compiled.attention_sizes(spec, dm)[::4]
    mlp = th + 3 * dm.tokens * spec.ffn_hidden_size // dm.tp * dm.e
    if baseline + table > mlp:
        return q + 3 * k + q32 + k32 + stats
    # the norm's output, freed after wqkv's matmul, held for q's bf16 cast (its key) where
    # that keeps the estimate at or below the chosen order's peak, the MLP's
    held = th if q == th and baseline + table + th <= mlp else 0
    return baseline + held + stats
