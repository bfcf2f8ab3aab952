"""The gated DeltaNet block of Qwen3-Next's linear-attention layers, as transformers runs it
without the fla and causal-conv1d kernels (the CPU path and every install without them):
models/qwen3_next/modeling_qwen3_next.py Qwen3NextGatedDeltaNet.forward with the torch
fallbacks, ``F.silu(self.conv1d(mixed_qkv)[:, :, :seq_len])`` for the causal conv and
``torch_chunk_gated_delta_rule`` for the delta rule (transformers 5.3). Every size below is
read off that code; the numbers are for that path (``Workload.deltanet_kernel`` torch). The
fused kernels' path (fla, causal-conv1d: the default) is ``memplan.model.deltanet_fla``.

Per micro-batch on a rank, with T tokens (b sequences of s), Hk key heads and Hv value heads
of dk and dv (split by t), C = 2 Hk dk + Hv dv conv channels, K taps, chunks of c tokens, the
sequence padded to S' (a multiple of c; N = S' / c chunks per sequence, Tp = b S'):

- the causal conv: its input (the cat of q, k, v: T C in the compute dtype) and, saved by
  ``F.silu`` through the slice, the whole conv output of s + K - 1 positions;
- q and k repeated to the Hv value heads (``repeat_interleave``, when Hv > Hk) saved by
  ``l2norm`` with its rsqrt per row; without repetition q and k are views of the silu output,
  which ``l2norm`` then keeps whole;
- beta = sigmoid(b) (its output) and g = -exp(A_log) * softplus(a + dt_bias) (softplus's fp32
  input and output);
- in the chunked rule, all fp32: the padded value, key, beta; k_beta and v_beta; the decay
  mask's exp and its tril; k_beta @ key^T; the 63 row and sub-block clones of the forward
  substitution loop (``attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)``: the
  product saves both clones, sum over i of i + i^2 elements per chunk and head); the
  solved ``attn``; exp(g), k_beta * exp(g), the scaled query and k_cumdecay; per chunk the
  q_i k_i^T product and its masked decayed copy, v_new, (q_i * exp(g)) (not the first chunk,
  whose state needs no gradient), k_i * exp(g_last - g) and two exps of g for the state
  update (not the last chunk's, which backward never reaches), exp(g), and the state entering
  it (dk x dv per head);
- the gated RMSNorm (Qwen3NextRMSNormGated.forward): its fp32 input, rsqrt per row, the
  normalised tensor cast back, weight * it, the fp32 gate z and silu(z); out_proj's input.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.model import linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, MASK_BYTES, Dims, Term, total
from memplan.model.linear import Linear, Split
from memplan.spec import LinearAttentionSpec, ModelSpec
from memplan.model import deltanet_fla as fla
from memplan.model import deltanet_solve as solve
from memplan.workload import DeltaNetKernel, Recompute, Workload

_PREFIX = "linear_attn"


class Sizes(NamedTuple):
    """The block's element counts on one rank for one micro-batch (see the module
    docstring)."""

    b: int
    s: int
    hk: int
    hv: int
    dk: int
    dv: int
    taps: int
    c: int  # chunk length
    n: int  # chunks per sequence

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def padded(self) -> int:
        """Tp: padded tokens of the micro-batch."""
        return self.b * self.n * self.c

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def chunk_matrices(self) -> int:
        """Elements of one c x c matrix per chunk and head: b Hv N c^2."""
        return self.b * self.hv * self.n * self.c * self.c


def sizes(la: LinearAttentionSpec, dm: Dims) -> Sizes:
    c = la.chunk_size
    return Sizes(b=dm.b, s=dm.s, hk=la.num_key_heads // dm.tp, hv=la.num_value_heads // dm.tp,
                 dk=la.key_head_dim, dv=la.value_head_dim, taps=la.conv_kernel, c=c,
                 n=-(-dm.s // c))


def substitution_elements(c: int) -> int:
    """Elements the forward substitution loop saves per chunk and head: for i in 1..c-1 the
    row clone (i) and the sub-block clone (i^2), sum_i i + i^2 = (c-1)c/2 + (c-1)c(2c-1)/6
    (64: 2,016 + 85,344 = 87,360)."""
    return (c - 1) * c // 2 + (c - 1) * c * (2 * c - 1) // 6


@lru_cache(maxsize=64)
def deltanet_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """in_proj_qkvz (h -> 2 key_dim + 2 value_dim) and in_proj_ba (h -> 2 Hv), column-parallel
    (the ``attn`` group), out_proj (value_dim -> h), row-parallel (``attn_out``)."""
    la, h = spec.linear_attention, spec.hidden_size
    assert la is not None
    return (Linear("in_proj_qkvz", "attn", h, 2 * la.key_dim + 2 * la.value_dim),
            Linear("in_proj_ba", "attn", h, 2 * la.num_value_heads),
            Linear("out_proj", "attn_out", la.value_dim, h, split=Split.ROW))


def _conv_terms(z: Sizes, dm: Dims) -> list[Term]:
    """The conv's input and its output of s + K - 1 positions (the silu's input, a slice of
    it); q and k into l2norm: repeated copies, or the silu output when Hv == Hk."""
    e = dm.e
    qk = (2 * z.tokens * z.hv * z.dk if z.hv > z.hk else z.tokens * z.channels) * e
    return [Term(f"{_PREFIX}.conv_input", z.tokens * z.channels * e),
            Term(f"{_PREFIX}.conv_output", z.b * z.channels * (z.s + z.taps - 1) * e),
            Term(f"{_PREFIX}.qk", qk),
            Term(f"{_PREFIX}.l2norm_rsqrt", 2 * z.tokens * z.hv * e),
            Term(f"{_PREFIX}.beta", z.tokens * z.hv * e),
            Term(f"{_PREFIX}.softplus", 2 * z.tokens * z.hv * FP32_BYTES)]


def _chunk_terms(z: Sizes) -> list[Term]:
    """The chunked rule's fp32 tensors saved once per micro-batch (the module docstring)."""
    f, tp, hv = FP32_BYTES, z.padded, z.hv
    k_like = tp * hv * z.dk * f  # key, k_beta, exp(g) * k_beta, query, k_cumdecay
    v_like = tp * hv * z.dv * f  # value, v_beta
    cumdecay = k_like if z.n > 1 else 0  # the first chunk's state needs no gradient
    # the two causal masks (c x c bools) masked_fill and masked_fill_ save, and the factor
    # -exp(A_log) of g (exp saves its output, the product the negated copy): Hv fp32 each
    masks = 2 * z.c * z.c * MASK_BYTES + 2 * hv * f
    return [Term(f"{_PREFIX}.rule_kv", 4 * k_like + 2 * v_like + cumdecay),
            Term(f"{_PREFIX}.rule_masks", masks),
            Term(f"{_PREFIX}.rule_gates", 2 * tp * hv * f),  # beta, exp(g)
            Term(f"{_PREFIX}.rule_decay", 4 * z.chunk_matrices * f),  # exp, tril, kk^T, attn
            Term(f"{_PREFIX}.rule_substitution",
                 z.b * hv * z.n * substitution_elements(z.c) * f)]


def _per_chunk_terms(z: Sizes) -> list[Term]:
    """Saved by each chunk's step: q k^T and its decayed copy, v_new, q_i * exp(g) (but in
    the first chunk, whose state needs no gradient) and exp(g); the state update's k_i *
    exp(g_last - g) and its two exps but in the last chunk, whose new state no loss reads
    (the cache's final state, or None: its nodes and what they saved are freed with the
    forward's output, before backward; traced), and the state entering each chunk."""
    f, hv, rows = FP32_BYTES, z.hv, z.b * z.hv * z.c
    updates = z.n - 1  # the state updates backward reaches
    return [Term(f"{_PREFIX}.chunk_scores", 2 * z.chunk_matrices * f),
            Term(f"{_PREFIX}.chunk_rows", (z.padded * hv * z.dv + 2 * updates * rows * z.dk)
                 * f),
            Term(f"{_PREFIX}.chunk_gates", (z.n * rows + updates * (rows + z.b * hv)) * f),
            Term(f"{_PREFIX}.chunk_states", z.n * z.b * hv * z.dk * z.dv * f)]


def _norm_out_terms(z: Sizes, dm: Dims) -> list[Term]:
    """Qwen3NextRMSNormGated.forward and out_proj: the fp32 input, rsqrt per row, the
    normalised tensor in the input's dtype, weight * it, the fp32 gate and silu(gate); the
    output projection's input (the product cast back)."""
    e, f, rows = dm.e, FP32_BYTES, z.tokens * z.hv * z.dv
    # z in fp32, which silu saves: a copy of z below fp32; in fp32 z itself, a copy made by
    # ``z.reshape(-1, dv)`` when the value heads are grouped (Hv > Hk), else a view of the
    # qkvz projection's output, which it keeps whole (traced)
    gate = z.tokens * (2 * z.hk * z.dk + 2 * z.hv * z.dv) * e if (
        e >= f and z.hv == z.hk) else rows * f
    return [Term(f"{_PREFIX}.norm_input_fp32", rows * f),
            Term(f"{_PREFIX}.norm_rsqrt", z.tokens * z.hv * f),
            Term(f"{_PREFIX}.norm_normed", 2 * rows * e),  # normalised, weight * normalised
            Term(f"{_PREFIX}.norm_gate", gate + rows * f),  # z in fp32, silu(z)
            Term(f"{_PREFIX}.out", rows * e)]


def deltanet_terms(spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
    """The block's saved terms (the module docstring; on fla's kernels ``memplan.model.
    deltanet_fla``), its input norm apart."""
    assert spec.linear_attention is not None
    z = sizes(spec.linear_attention, dm)
    casts = linear.saved_terms(_PREFIX, deltanet_linears(spec), dm)
    return rule_terms(z, wl, dm) + norm_out_terms(z, wl, dm) + casts


def _fused(wl: Workload) -> bool:
    return wl.deltanet_kernel is DeltaNetKernel.FLA


def _solved(wl: Workload) -> bool:
    return wl.deltanet_kernel is DeltaNetKernel.TORCH_SOLVE


def rule_terms(z: Sizes, wl: Workload, dm: Dims) -> list[Term]:
    """What the conv, the gates and the chunked rule save."""
    if _fused(wl):
        return fla.fla_rule_terms(z, dm)
    if _solved(wl):
        return solve.solve_rule_terms(z, dm)
    return _conv_terms(z, dm) + _chunk_terms(z) + _per_chunk_terms(z)


def norm_out_terms(z: Sizes, wl: Workload, dm: Dims) -> list[Term]:
    """What the gated norm and the output projection save of the rule's output."""
    return fla.fla_norm_terms(z, dm) if _fused(wl) else _norm_out_terms(z, dm)


def _small_sizes(spec: ModelSpec, t: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """dt_bias and A_log (Hv each), the depthwise conv1d weight (C, 1, K), registered before
    the projections; the gated norm's weight (dv), between in_proj_ba and out_proj."""
    la = spec.linear_attention
    assert la is not None
    hv, conv = la.num_value_heads // t, la.conv_dim // t
    return ([hv, hv, conv * la.conv_kernel, la.value_head_dim],
            [(hv,), (hv,), (conv, 1, la.conv_kernel), (la.value_head_dim,)])


def _rule_alive(z: Sizes, dm: Dims) -> int:
    """Beside the saved tensors at the chunk loop's end: the qkvz projection's output (z is a
    view of it until the norm copies it), the solved values attn @ v_beta, the output
    core_attn_out being filled (both Tp Hv dv fp32), the cumulated g and the last state."""
    la_out = z.tokens * (2 * z.hk * z.dk + 2 * z.hv * z.dv) * dm.e
    f = FP32_BYTES
    return (la_out + 2 * z.padded * z.hv * z.dv * f + z.padded * z.hv * f
            + z.b * z.hv * z.dk * z.dv * f + last_update_bytes(z))


def last_update_bytes(z: Sizes) -> int:
    """What the last chunk's state update saved, which no loss reads: k_i * exp(g_last - g),
    that exp and exp(g_last), alive while its output is (the final state)."""
    return z.b * z.hv * (z.c * z.dk + z.c + 1) * FP32_BYTES


def _rule_grads(z: Sizes) -> int:
    """In flight during the chunk loop's backward: the output's gradient (Tp Hv dv fp32), the
    gradients accumulating over the chunks' slices of the scaled query, the key, k_cumdecay
    and the solved values, of the decay mask, and the state's, with one slice's gradient made
    whole (a full-size zeros tensor, SliceBackward) before it is added."""
    f, tp, hv = FP32_BYTES, z.padded, z.hv
    out = tp * hv * z.dv * f
    accumulated = tp * hv * (3 * z.dk + z.dv) * f + z.chunk_matrices * f
    return out + accumulated + 2 * z.b * hv * z.dk * z.dv * f + tp * hv * max(z.dk, z.dv) * f


def caller_locals(z: Sizes, dm: Dims) -> int:
    """What Qwen3NextGatedDeltaNet.forward's locals hold while its chunked rule runs, nothing
    saved (a checkpointed layer): the projections' outputs (projected_states_qkvz and _ba),
    the silu output of the conv that q, k and v view, beta (the compute dtype) and g (fp32);
    with grouped value heads (Hv > Hk) also the copies ``fix_query_key_value_ordering``'s
    reshapes make of z, b and a and the repeated q and k (``repeat_interleave``); with Hv ==
    Hk those are views."""
    e, f, t, hv = dm.e, FP32_BYTES, z.tokens, z.hv
    projections = t * (2 * z.hk * z.dk + 2 * hv * z.dv + 2 * hv) * e
    grouped = t * hv * (z.dv + 2 + 2 * z.dk) * e if hv > z.hk else 0
    return projections + grouped + t * z.channels * e + t * hv * e + t * hv * f


def checkpointed_rule(z: Sizes) -> int:
    """The most bytes ``torch_chunk_gated_delta_rule``'s own tensors reach without autograd
    saving any (fp32; Tp padded tokens, M = b Hv N c^2 the chunk matrices, m = b Hv c^2 one
    chunk's, r = b Hv c dv and rk = b Hv c dk one chunk's rows, S = b Hv dk dv the state):

    - building attn: the scaled query, padded key and value, beta and cumulated g, k_beta,
      v_beta (Tp Hv (3 dk + 2 dv + 2)), the decay mask, k_beta @ key^T and its product
      (3 M);
    - the forward substitution's last row (i = c - 1): attn, the decay mask, the row and the
      sub-block clones, their product and its sum (2 M + b Hv N (2 (c-1)^2 + 2 (c-1)));
    - the loop's start: the query, key, solved value, beta, g, v_beta, k_beta, k_cumdecay
      and core_attn_out (Tp Hv (4 dk + 3 dv + 2)), the decay mask, the solved attn, the last
      row and sub-block clones (locals until the function returns), the state; then in the
      first chunk q_i k_i^T and its product (2 m) before ``attn`` is rebound (the solved one
      freed); in a later chunk the previous chunk's attn, v_prime, v_new and attn_inter
      beside the new product (3 m + 3 r), the state update (m + 3 r + max(2 S + rk, 3 S)),
      the output's sum (m + 5 r) and attn_inter's product (m + 4 r + rk, one r fewer in the
      first chunk)."""
    f, hv, b, c, n = FP32_BYTES, z.hv, z.b, z.c, z.n
    big = z.chunk_matrices * f  # M
    m, r, rk = b * hv * c * c * f, b * hv * c * z.dv * f, b * hv * c * z.dk * f
    state = b * hv * z.dk * z.dv * f
    left = b * hv * n * ((c - 1) ** 2 + (c - 1)) * f  # the loop's last row and sub-block
    before = z.padded * hv * (3 * z.dk + 2 * z.dv + 2) * f
    build = before + 3 * big
    substitution = before + 2 * big + b * hv * n * (2 * (c - 1) ** 2 + 2 * (c - 1)) * f
    start = z.padded * hv * (4 * z.dk + 3 * z.dv + 2) * f + 2 * big + left + state
    first = start + 2 * m
    after = start - big  # the solved attn freed by the first chunk's rebinding
    later = after + max(3 * m + 3 * r if n > 1 else 0,
                        m + 3 * r + max(2 * state + rk, 3 * state), m + 5 * r,
                        m + (4 if n > 1 else 3) * r + rk)
    return max(build, substitution, first, later) + 2 * c * c * MASK_BYTES


def checkpointed_norm(z: Sizes, dm: Dims) -> int:
    """The gated RMSNorm on the rule's output without saving (Qwen3NextRMSNormGated.forward):
    the output (Tv = T Hv dv in the compute dtype), weight * normalised, the fp32 gate (a copy
    below fp32), its silu and their product; with Hv == Hk, ``z.reshape(-1, dv)`` copies the
    non-contiguous z."""
    e, f, rows = dm.e, FP32_BYTES, z.tokens * z.hv * z.dv
    gate = rows * f if e < f else 0
    z_copy = rows * e if z.hv == z.hk else 0
    return rows * (2 * e + 2 * f) + gate + z_copy


def last_update_locals(z: Sizes, dm: Dims) -> int:
    """Beyond ``_rule_alive`` at the last chunk's state update in a forward that saves: the
    chunk's v_prime and attn_inter (b Hv c dv each, which nothing saves), the decayed state
    and k_i^T v_new (b Hv dk dv each: the add's inputs; its output is the last state, and the
    state entering the chunk is saved), and the caller's
    locals nothing saves: projected_states_ba and, with grouped value heads, the silu output
    v views (the repeated q and k replace its q and k), the z copy and the b and a copies."""
    e, f, t, hv = dm.e, FP32_BYTES, z.tokens, z.hv
    loop = 2 * z.b * hv * z.c * z.dv * f + 2 * z.b * hv * z.dk * z.dv * f
    grouped = t * (z.channels + hv * z.dv + 2 * hv) * e if hv > z.hk else 0
    return loop + t * 2 * hv * e + grouped


def rerun_norm_working(z: Sizes, dm: Dims, solved: bool) -> int:
    """Beside everything the rule and the gated norm saved, at the norm's last op
    (``hidden_states.to(input_dtype)``) in a rerun that saves: Qwen3NextGatedDeltaNet.forward's
    locals (``caller_locals``) but those the rule saved (beta; ``l2norm``'s q and k: the
    repeated copies on the loop's path, the silu output they view with Hv == Hk) and those the
    norm saved (in fp32 its gate is z itself: the qkvz projection's output z views with
    Hv == Hk, else the copy ``fix_query_key_value_ordering`` made); the rule's output in the
    compute dtype (below fp32: in fp32 it is the norm's saved input); the norm's ``variance``
    (a local to its return) and, below fp32, the fp32 product the cast reads (in fp32 the
    cast returns it: the saved ``out``). Traced: Qwen3-Next on transformers 5.23 (torch-solve),
    bf16, one layer of each kind cut to 2 x 192 tokens with the published head widths, full
    recompute: at op 1430 of step 1's backward every byte the layer's rerun made is this
    moment's (10,472,016 B beside the input norm's)."""
    e, f, t, hv = dm.e, FP32_BYTES, z.tokens, z.hv
    rows = t * hv * z.dv
    held = caller_locals(z, dm) - t * hv * e  # beta: the rule saves it
    if solved:
        held += solve.solve_caller_locals(z, dm)  # the rule repeats q and k itself
        if e >= f and hv == z.hk:  # l2norm saves the silu output q and k view
            held -= t * z.channels * e
    elif hv > z.hk:  # the repeated q and k: l2norm saves them
        held -= 2 * t * hv * z.dk * e
    else:  # q and k view the silu output, which l2norm saves
        held -= t * z.channels * e
    if e >= f:  # the norm's fp32 gate is z: the projection's output, or z's copy
        held -= t * (2 * z.hk * z.dk + 2 * hv * z.dv) * e if hv == z.hk else rows * e
    return held + (rows * e + rows * f if e < f else 0) + t * hv * f


class DeltaNet:
    """Qwen3NextGatedDeltaNet on transformers' torch path (the module docstring)."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return deltanet_terms(spec, wl, dm, recompute)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The chunk loop's end (what it saved, beside ``_rule_alive``) and out_proj's output
        before the residual add."""
        assert spec.linear_attention is not None
        z = sizes(spec.linear_attention, dm)
        terms = deltanet_terms(spec, wl, dm, recompute)
        rule = total(rule_terms(z, wl, dm))
        stream = dm.rows * spec.hidden_size * dm.e
        # fla's rule makes the final state a cache asks for (use_cache, no checkpointing)
        alive = (fla.fla_rule_alive(z, dm, wl.kv_cache and recompute is Recompute.NONE)
                 if _fused(wl) else solve.solve_rule_alive(z, dm) if _solved(wl)
                 else _rule_alive(z, dm))
        return [Moment("delta_rule", rule, alive),
                Moment("linear_attention", total(terms), stream)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer nothing is saved: the forward's locals at the chunked
        rule's peaks (``checkpointed_rule``) and in the gated norm after it
        (``checkpointed_norm``), beside the caller's (``caller_locals``)."""
        assert spec.linear_attention is not None
        z = sizes(spec.linear_attention, dm)
        if _fused(wl):
            return [Moment("delta_rule", 0, fla.fla_checkpointed(z, dm)),
                    Moment("gated_norm", 0, fla.fla_norm_working(z, dm))]
        caller = caller_locals(z, dm)
        rule = checkpointed_rule(z)
        if _solved(wl):
            caller += solve.solve_caller_locals(z, dm)
            rule = solve.solve_checkpointed_rule(z, dm)
        return [Moment("delta_rule", 0, caller + rule),
                Moment("gated_norm", 0, caller + checkpointed_norm(z, dm))]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """out_proj's backward (the norm's input gradient beside what the block saved), the
        chunk loop's backward (the norm's terms freed; ``_rule_grads``), then the input
        projections' (their weight gradients, the input's two gradients)."""
        assert spec.linear_attention is not None
        z = sizes(spec.linear_attention, dm)
        terms = deltanet_terms(spec, wl, dm, recompute)
        rule = total(rule_terms(z, wl, dm))
        out_grad = z.tokens * z.hv * z.dv * dm.e
        grad_inputs = 2 * dm.rows * spec.hidden_size * dm.e
        qkvz = linear.weight_elements(deltanet_linears(spec)[0], dm.tp)
        return [BackwardMoment("linear_attention.out", total(terms), out_grad, ("attn_out",)),
                BackwardMoment("delta_rule", rule, fla.fla_rule_grads(z, dm) if _fused(wl)
                               else _rule_grads(z), ("attn_out",)),
                BackwardMoment("linear_attn_in", 0, grad_inputs, ("attn",), qkvz)]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Rerun with autograd recording in a fully recomputed layer's backward (beside the
        layer's incoming gradient): the last chunk's state update (``last_update_locals``),
        everything the rule saves made by then."""
        assert spec.linear_attention is not None
        z = sizes(spec.linear_attention, dm)
        rule = total(rule_terms(z, wl, dm))
        if _fused(wl):  # the fused rule's forward, as in a forward that saves
            return [Moment("delta_rule", rule, fla.fla_rule_alive(z, dm, False))]
        # then the gated norm on the rule's output, everything the block saves made by its
        # last op (``rerun_norm_working``)
        norm = Moment("gated_norm", rule + total(norm_out_terms(z, wl, dm)),
                      rerun_norm_working(z, dm, _solved(wl)))
        if _solved(wl):
            return [Moment("delta_rule", rule, solve.solve_rule_alive(z, dm)
                           + solve.solve_update_locals(z, dm)), norm]
        return [Moment("delta_rule", rule, _rule_alive(z, dm) + last_update_locals(z, dm)),
                norm]

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """dt_bias, A_log, conv1d, in_proj_qkvz, in_proj_ba, the norm, out_proj (the module's
        registration order)."""
        small, _ = _small_sizes(spec, t)
        qkvz, ba, out = (linear.all_tensor_sizes([lin], t) for lin in deltanet_linears(spec))
        return small[:3] + qkvz + ba + small[3:] + out

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        _, small = _small_sizes(spec, t)
        qkvz, ba, out = (linear.all_tensor_shapes([lin], t) for lin in deltanet_linears(spec))
        return small[:3] + qkvz + ba + small[3:] + out

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``attn_out``: out_proj and the gated norm's weight (its backward runs first);
        ``attn``: all."""
        small, _ = _small_sizes(spec, t)
        return linear.grad_groups(deltanet_linears(spec), t, ("attn_out", "attn"),
                                  {"attn_out": small[3], "attn": sum(small[:3])})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """2 per projection weight (``memplan.model.linear``), 2 per conv tap and channel,
        and the chunked rule's matmuls (``core_flops_per_token``)."""
        la = spec.linear_attention
        assert la is not None
        return (linear.flops_per_token(deltanet_linears(spec)) + 2.0 * la.conv_dim * la.conv_kernel
                + self.core_flops_per_token(spec, seq_len))

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """torch_chunk_gated_delta_rule's matmuls per token and value head (2 FLOPs per
        multiply-add), chunk c: within its chunk k_beta k^T (2 c dk), attn @ v_beta (2 c dv),
        attn @ k_beta exp(g) (2 c dk), q k^T (2 c dk) and attn @ v_new (2 c dv); against the
        state k_cumdecay @ S (2 dk dv), q exp(g) @ S (2 dk dv) and k^T v_new into S (2 dk
        dv); the forward substitution's row updates, sum_i i^2 / c per token (~2 c^2 / 3
        multiply-adds)."""
        la = spec.linear_attention
        assert la is not None
        c, dk, dv = la.chunk_size, la.key_head_dim, la.value_head_dim
        per_head = (2 * c * (3 * dk + 2 * dv) + 6 * dk * dv
                    + 2 * (c - 1) * c * (2 * c - 1) / (6 * c))
        return per_head * la.num_value_heads


def cache_states_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """What the cache a training forward with use_cache fills keeps of a linear-attention
    layer until the forward's output is dropped (Qwen3NextGatedDeltaNet.forward with
    cache_params): the conv state, F.pad of the conv input to its last K positions (b C K,
    the compute dtype), the chunked rule's final state (output_final_state: b Hv dk dv,
    fp32) and with it the graph that made it (``last_update_bytes``)."""
    assert spec.linear_attention is not None
    z = sizes(spec.linear_attention, dm)
    if _fused(wl):
        return fla.fla_cache_bytes(z, dm)
    return (z.b * z.channels * z.taps * dm.e
            + z.b * z.hv * z.dk * z.dv * FP32_BYTES + last_update_bytes(z))
