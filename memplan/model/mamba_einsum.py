"""The Mamba2 mixer of Granite 4.0-H as transformers 5.23 runs it without mamba_ssm and
causal-conv1d (``Workload.mamba_kernel`` torch-einsum): models/granitemoehybrid/
modeling_granitemoehybrid.py ``GraniteMoeHybridMambaLayer.forward``, which falls back from
``mamba2_split_conv1d_scan_combined`` (None without the kernel) to ``causal_conv1d_fn``'s
torch fallback (``F.conv1d``, the slice, silu) and ``mamba2_chunk_scan``, the chunked SSD scan
written as einsums, then ``GraniteMoeHybridRMSNormGated`` and out_proj; Falcon-H1's mixer
(models/falcon_h1/modeling_falcon_h1.py ``FalconH1Mixer.forward``, 5.23) runs the same
functions with in_proj's output times ``mup_vector`` and, with mamba_rms_norm,
``FalconH1RMSNormGated`` (the same sizes as Granite's, an rsqrt per group), without it
``y * silu(gate)`` in the norm's place (``Sizes.gated`` false: silu's output saved, no fp32
gate copy). Every size below is read off that code and checked against autograd's saved
tensors and the allocations of its forward and backward (tests/traced/test_hf_heldout.py,
tests/data/traces/mamba_einsum/transformers-5.23.json), under autocast too (below).

The sizes of ``memplan.model.mamba`` (T tokens, H heads of P, d = H P, state n, G groups, C
conv channels, K taps, chunks of c, N chunks, Tp = b N c padded tokens, M = b N c^2 H) and, in
fp32 (f bytes) unless said: D = Tp d, BC = Tp H n (B or C repeated to the heads, in chunks),
S3 = b (N + 1) d n (the passed states with the first chunk's zeros), S2 = b N d n. Autograd
saves, beside ``memplan.model.mamba``'s in_proj output, padded conv output, dt tensors, A,
masks and norm:

- x in fp32 (a view of silu's output T C in fp32 runs, its fp32 copy T d below fp32), and the
  dt tensors as ``x * dt.float()`` and ``A * dt.float()`` read them (below fp32 two fp32
  copies of the clamped dt, which itself is then saved by nothing);
- the padded x that D multiplies (D);
- each einsum's bmm saves its operands, as contiguous copies where the einsum permutes them:
  G = C B^T saves C's and B's (2 BC), Y_diag = M x saves M itself and x * dt's (D), the chunk
  states B_decay x saves B_decay's and x * dt's (BC + D), the passed states' einsum their
  concatenation (S3), C_times_states C's and the states' (BC + S2); L, G and M (3 M);
- B in chunks (which B * decay saves, BC), the two decays (2 Tp H), the chunks' decay,
  C_times_states (D, which Y_off's product saves) and the padded scan output (D, a view of
  which the gated norm saves).

The forward's locals stay until the scan returns: D's residual, x * dt in chunks, B and C in
chunks, A in chunks and its cumsum, B_decay, the zero first state, the passed states; below
fp32 silu's output and the clamped dt until the layer returns. Its peaks are segment_sum's
three M-sized tensors (before L), and ``(Y_diag + Y_off).contiguous()`` (six D-sized tensors).
In backward each bmm makes its operands' gradients, each broadcasting product both inputs'
gradients at the product's size before the engine sums them (validate_outputs: sum_to), and
segment_sum's cumsum runs as flip, cumsum, flip over M: four M-sized tensors at once.

Under autocast (fp32 weights, bf16 compute: ``einsum_bytes``) the same code runs with these
casts, each read off a trace of 5.23's own mixer (every ``aten._to_copy``):

- ``torch.einsum`` is on CUDA's lower-precision list (aten/src/ATen/autocast_mode.h
  ``AT_FORALL_LOWER_PRECISION_FP``): ``mamba2_chunk_scan`` upcasts x, B and C, and each of
  its five einsums casts its fp32 operands back to bf16 and returns bf16. So every operand
  copy the bmms save above is bf16 (C's and B's for G, x * dt's twice, B_decay's, C's and
  the states' for C_times_states, the passed states' copy), and so are G, Y_diag, the chunk
  states, the zero first state (``zeros_like(states[:, :1])``), the passed states and their
  product, and C_times_states (which Y_off's product saves). L and the decays stay fp32
  (``torch.exp``, an fp32 op); M = G * L is fp32 (type promotion), a local to the scan's
  return, and Y_diag's bmm saves its bf16 cast; the passed states' einsum saves its cast of
  the chunks' decay beside exp's fp32 output. In backward each cast's gradient is cast back
  (M = G L's backward makes G's gradient in fp32, then its bf16 cast).
- ``causal_conv1d_fn`` (same file) calls ``F.conv1d(hidden_states.to(weight.dtype), ...)``,
  an autocast op: it saves its bf16 casts of its input (T C) and of the weight (C K, a view
  of the parameter, so not in autocast's cache; the bias's cast is, to the forward's end, and
  is not counted: C elements). On Granite in_proj's output is bf16: ``.to(weight.dtype)``
  makes an fp32 copy that conv1d casts back, so nothing saves in_proj's output (a local,
  ``projected_states``, to the layer's return). On Falcon-H1 it is the fp32 ``mup_vector``
  product, which the gate saves; ``out.to(hidden_states.dtype)`` copies silu's bf16 output to
  fp32 (T C, which x, B and C view; silu's output then freed).
- dt: softplus is an fp32 op (``AT_FORALL_FP32``): its input's fp32 cast, its output and the
  clamped dt are fp32, the clamped dt saved once for ``x * dt`` and ``A * dt``.
- The training forward's cache (``cache_bytes``) copies the conv state in in_proj's output's
  dtype and the final state in the einsums'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, Dims, Term, total

if TYPE_CHECKING:  # memplan.model.mamba calls this module with its sizes
    from memplan.model.mamba import Sizes

_PREFIX = "mamba"


class Units(NamedTuple):
    """The block's recurring tensor sizes in bytes (the module docstring)."""

    d: int  # D: Tp d fp32
    bc: int  # BC: Tp H n fp32
    m: int  # M fp32
    s3: int  # b (N + 1) d n fp32
    s2: int  # b N d n fp32
    # the same in the einsums' dtype (``einsum_bytes``): what their bmms save and make
    dk: int
    bck: int
    mk: int
    s3k: int
    s2k: int
    s1: int  # b d n in the einsums' dtype: the zero first state (zeros_like(states))
    tph: int  # Tp H fp32
    tdf: int  # T d fp32
    tde: int  # T d in the compute dtype
    # the forward's locals to the layer's return (``kept``: below fp32 silu's output T C, not
    # Falcon-H1's under autocast, which the fp32 copy x views replaces; under autocast
    # Granite's in_proj output, saved by no one) and to the scan's (``low``: with them the
    # clamped dt T H below fp32 but under autocast, where it is fp32 and saved)
    kept: int
    low: int


def einsum_bytes(dm: Dims) -> int:
    """Bytes of an element the scan's einsums read and make: fp32 (the scan upcasts x, B
    and C), but under autocast, whose ``einsum`` (CUDA's lower-precision list,
    aten/src/ATen/autocast_mode.h ``AT_FORALL_LOWER_PRECISION_FP``) casts its fp32 operands to
    the compute dtype and returns its product in it."""
    return dm.e if dm.autocast else FP32_BYTES


def units(z: Sizes, dm: Dims) -> Units:
    f, e, t, k = FP32_BYTES, dm.e, z.tokens, einsum_bytes(dm)
    state = z.b * z.d * z.n
    silu = t * z.conv * e if e < f and not (dm.autocast and z.mup_e) else 0
    kept = silu + (t * z.width * e if dm.autocast and not z.mup_e else 0)
    return Units(d=z.padded * z.d * f, bc=z.padded * z.h * z.n * f, m=z.mats * f,
                 s3=(z.chunks + 1) * state * f, s2=z.chunks * state * f,
                 dk=z.padded * z.d * k, bck=z.padded * z.h * z.n * k, mk=z.mats * k,
                 s3k=(z.chunks + 1) * state * k, s2k=z.chunks * state * k, s1=state * k,
                 tph=z.padded * z.h * f, tdf=t * z.d * f, tde=t * z.d * e,
                 kept=kept, low=kept + (t * z.h * e if e < f and not dm.autocast else 0))


def scan_terms(z: Sizes, dm: Dims) -> list[Term]:
    """in_proj's output to the scan's output (the module docstring)."""
    e, f, t = dm.e, FP32_BYTES, z.tokens
    u = units(z, dm)
    low = e < f
    n1 = z.chunks + 1
    # Falcon-H1: in_proj's output times mup_vector (``Sizes.mup_e``) in its place; without the
    # gated norm (``Sizes.gated``) silu reads the gate as it is, no fp32 copy, nor with it
    # under autocast, where the gate is already fp32 (``Sizes.gate_copy``)
    pe = z.mup_e or e
    # under autocast F.conv1d saves its casts of the conv's input and weight (the module
    # docstring); Granite's in_proj output is then saved by no one, and Falcon-H1's conv
    # output is cast back to its fp32 input's dtype, x a view of that copy (T C)
    cast = dm.autocast
    proj = 0 if cast and not z.mup_e else t * z.width * pe
    return [Term(f"{_PREFIX}.in_proj_out", proj),
            Term(f"{_PREFIX}.gate_fp32", t * z.d * f if low and z.gate_copy else 0),
            Term(f"{_PREFIX}.conv_casts", (t + z.taps) * z.conv * e if cast else 0),
            Term(f"{_PREFIX}.conv_out", z.b * z.conv * (z.s + z.taps - 1) * e),
            Term(f"{_PREFIX}.x_fp32", t * z.d * f if low and not z.mup_e else t * z.conv * f),
            # dt + dt_bias, softplus's output; the clamped dt in fp32 (two copies below fp32)
            Term(f"{_PREFIX}.dt", 2 * t * z.h * pe + (1 if pe == f else 2) * t * z.h * f),
            Term(f"{_PREFIX}.a", 2 * z.h * f),
            Term(f"{_PREFIX}.x_pad", u.d),
            Term(f"{_PREFIX}.masks", 2 * z.c * z.c + 2 * n1 * n1),
            Term(f"{_PREFIX}.chunk_mats", u.m + 2 * u.mk),  # L, G, M (autocast: its cast)
            # B; G's C and B, B_decay's copy, C's copy
            Term(f"{_PREFIX}.bc", u.bc + 4 * u.bck),
            Term(f"{_PREFIX}.x_dt", 2 * u.dk),  # Y_diag's and the states' copies of x * dt
            Term(f"{_PREFIX}.decays", 2 * u.tph),
            # exp's output; under autocast the passed states' einsum saves its cast
            Term(f"{_PREFIX}.decay_chunk", z.b * n1 * n1 * z.h * (f + (e if cast else 0))),
            Term(f"{_PREFIX}.states", u.s3k + u.s2k),
            Term(f"{_PREFIX}.y_off", u.dk)]


def norm_terms(z: Sizes, dm: Dims) -> list[Term]:
    """The padded scan output (a view of it), GraniteMoeHybridRMSNormGated's saved tensors
    (silu(gate), y * silu(gate), its rsqrt per group, the normalised tensor) and out_proj's
    input."""
    f, t = FP32_BYTES, z.tokens
    # Falcon-H1's ``y * silu(gate)`` (no gated norm): silu's output, in the gate's dtype
    norm = (3 * z.d + z.g) * t * f if z.gated else t * z.d * (z.mup_e or dm.e)
    return [Term(f"{_PREFIX}.y", z.padded * z.d * f),
            Term(f"{_PREFIX}.norm", norm),
            Term(f"{_PREFIX}.out", t * z.d * dm.e)]


def cache_bytes(z: Sizes, dm: Dims) -> int:
    """What the cache a training forward with use_cache makes keeps of a Mamba layer until the
    forward's output is dropped (5.23's GraniteMoeHybridModel.forward makes a DynamicCache;
    cache_utils.py LinearAttentionLayer.lazy_initialization and update_conv_state /
    update_recurrent_state copy into zeros of the dtype they are given): the conv state,
    the conv input's last K positions (b C K, in_proj's output's dtype: Falcon-H1's fp32
    ``mup_vector`` product under autocast), and the scan's final state (b H P n, the
    einsums' dtype)."""
    return z.b * z.conv * z.taps * (z.mup_e or dm.e) + z.b * z.d * z.n * einsum_bytes(dm)


def forward_moments(z: Sizes, dm: Dims, saved: int, stream: int, cached: bool,
                    casts: tuple[int, int] = (0, 0)) -> list[Moment]:
    """segment_sum of A (its three M-sized tensors), the passed states' einsum, the scan's
    output (``(Y_diag + Y_off).contiguous()``), the gated norm's variance and out_proj's
    output (``stream``), beside the locals (the module docstring); ``saved``: the block's
    saved bytes (``memplan.model.mamba.mamba_terms``), ``casts`` what in_proj and out_proj
    save of their own among them (under autocast their weights' casts, in_proj's made
    first, out_proj's last). ``cached``: with a cache the scan returns its final state, a
    view of the passed states, which ``forward`` holds in a local (``final_state``) until
    it returns. Under autocast M = G L is fp32 (G's bf16 times L's fp32) and a local to the
    scan's return, beside its cast which Y_diag's bmm saves."""
    u = units(z, dm)
    f, t = FP32_BYTES, z.tokens
    terms = {t.name.partition(".")[2]: t.size_bytes for t in scan_terms(z, dm)}
    cast_in, cast_out = casts
    # saved up to the first masks: in_proj's output (and weight's cast) to x_pad, but the
    # gate's fp32 copy
    first = sum(terms[k] for k in ("in_proj_out", "conv_casts", "conv_out", "x_fp32", "dt",
                                   "a", "x_pad")) + 2 * z.c * z.c + cast_in
    # the norm's, made after the scan, and out_proj's weight cast
    late = total(norm_terms(z, dm)) + terms["gate_fp32"] + cast_out
    scan = saved - late
    states = scan - u.dk - u.s2k - u.bck - u.tph  # before C_times_states
    rows = t * z.g * f
    final = u.s3k if cached else 0
    m = u.m if dm.autocast else 0  # M in fp32 beside its cast
    if z.gated:
        norm = Moment("mamba.norm", saved - u.tde - u.tdf - rows - cast_out,
                      u.tdf + rows + final + u.kept)
    else:
        # Falcon-H1's y * silu(gate): the fp32 product, then its cast (which out_proj saves;
        # in fp32 the product itself)
        low = dm.e < f
        norm = Moment("mamba.norm", saved - (u.tde if low else 0) - cast_out,
                      (u.tdf if low else 0) + final + u.kept)
    return [Moment("mamba.segsum", first,
                   3 * u.m + 2 * u.d + 2 * u.bc + 2 * u.tph + z.c * z.c + u.low),
            Moment("mamba.states", states,
                   2 * u.d + u.dk + 2 * u.bc + 2 * u.s3k + u.s1 + 2 * u.tph + u.low + m),
            Moment("mamba.scan_out", scan,
                   5 * u.d + u.dk + 2 * u.bc + u.s3k + u.s1 + 2 * u.tph + u.low + m),
            norm,
            Moment("mamba", saved, stream + final + u.kept + (u.tdf if dm.e < f else 0))]


def working_set(z: Sizes, dm: Dims) -> list[Moment]:
    """In a checkpointed layer (nothing saved): the passed states' einsum and the scan's
    output, with what the locals hold then: in_proj's output (``projected_states``), silu's
    (x, B and C are its views; Falcon-H1's fp32 copy of it under autocast), L, G and M, the
    clamped dt, the decays and A, beside the tensors of ``forward_moments`` (the module
    docstring). Under autocast G, Y_diag, the zero first state, the passed states (their
    concatenation, its copy and the einsum's product), C_times_states are in the compute
    dtype, M beside them in fp32 (its cast freed with Y_diag's einsum), the clamped dt in
    fp32, and the passed states' einsum holds its cast of the chunks' decay."""
    u = units(z, dm)
    f, e, t = FP32_BYTES, dm.e, z.tokens
    cast = dm.autocast
    n1 = z.b * (z.chunks + 1) ** 2 * z.h
    conv = t * z.conv * (f if cast and z.mup_e else e)
    held = (t * z.width * (z.mup_e or e) + 2 * u.m + u.mk + conv + 3 * u.bc + u.s1
            + t * z.h * (f if cast else e) + n1 * f + z.h * f)
    return [Moment("mamba.states", 0,
                   held + 2 * u.d + u.dk + 3 * u.s3k + 3 * u.tph + (n1 * e if cast else 0)),
            Moment("mamba.scan_out", 0, held + 5 * u.d + 2 * u.dk + u.s3k + 4 * u.tph)]


def _gate_backward(z: Sizes, dm: Dims, saved: int, gate: int) -> list[BackwardMoment]:
    """The gated norm's backward (its weight's product, then five fp32 T d tensors), or
    Falcon-H1's y * silu(gate)'s: the product's fp32 gradient (below fp32 the cast's
    backward's), y's and silu's output's in fp32, the latter's cast to silu's dtype
    (``gate`` bytes). ``saved``: the block's saved bytes but out_proj's input."""
    u = units(z, dm)
    out = ("attn_out",)
    if not z.gated:
        return [BackwardMoment("mamba.norm", saved,
                               3 * u.tdf + (gate if dm.e < FP32_BYTES else 0), out)]
    rows = z.tokens * z.g * FP32_BYTES
    return [BackwardMoment("mamba.norm_weight", saved, 3 * u.tdf, out),
            BackwardMoment("mamba.norm", saved - u.tdf - rows, 5 * u.tdf, out)]


def _held(z: Sizes, dm: Dims, scan: int, terms: dict[str, int]) -> list[int]:
    """What the block still saves at each of the scan's backward moments, from ``scan`` (its
    saved bytes once the norm's and out_proj's backward have run), as each node frees what
    it saved (under autocast the einsums' bf16 copies, ``units``' ``*k`` sizes)."""
    u = units(z, dm)
    f, th = FP32_BYTES, z.tokens * z.h
    cts = scan - u.dk  # Y_off's product ran: C_times_states freed
    passed = cts - u.s2k - u.bck - u.tph  # C_times_states' bmm and the state decay freed
    chunk = passed - u.s3k - (terms["decay_chunk"] + 2 * (z.chunks + 1) ** 2)
    b_decay = chunk - u.bck - u.dk  # the chunk states' bmm ran
    diag = b_decay - u.bc - u.tph  # B * decay ran: B in chunks and the decay freed
    gates = diag - u.mk - u.dk  # Y_diag's bmm ran: M (its cast) and its x * dt freed
    g_bmm = gates - u.mk  # M = G L ran: G freed (L stays for exp's backward)
    segsum = g_bmm - 2 * u.bck - u.m - z.c * z.c  # G's bmm and exp ran; one mask freed
    # the second fp32 copy of the clamped dt below fp32 (under autocast one fp32 dt, shared)
    low = dm.e < f and not dm.autocast
    pads = segsum - z.c * z.c - z.h * f - (th * f if low else 0)
    residual = pads - terms["x_fp32"] - th * f  # x * dt's product ran
    return [scan, cts, passed, chunk, b_decay, diag, gates, g_bmm, segsum, pads, residual]


def backward_moments(z: Sizes, dm: Dims, saved: int, grad_in: int, in_proj: int,
                     casts: tuple[int, int] = (0, 0)) -> list[BackwardMoment]:
    """In backward order: out_proj's, the gated norm's (its weight's product, then five fp32
    T d tensors), Y_off's product, C_times_states' bmm, the passed states' einsum, the chunk
    states' bmm, B * decay's product, Y_diag's bmm, M = G L's product, G's bmm, segment_sum's
    flipped cumsum over M, the pads and x * dt's product, D's residual, silu's and the
    conv's, in_proj's output gradient and in_proj (its input's gradient ``grad_in``, its
    weight's ``in_proj`` elements fresh); the gate's gradient waits from the norm to the
    split's backward (the module docstring). ``casts``: what in_proj and out_proj save of
    their own (under autocast their weights' casts), freed as each one's backward runs.
    Under autocast what the einsums saved is in the compute dtype (``units``' ``*k``
    sizes), and M = G L's backward casts G's fp32 gradient to G's dtype beside it."""
    u = units(z, dm)
    f, e, t = FP32_BYTES, dm.e, z.tokens
    terms = {term.name.partition(".")[2]: term.size_bytes
             for term in scan_terms(z, dm) + norm_terms(z, dm)}
    th = t * z.h
    cast_in, cast_out = casts
    gate = t * z.d * (z.mup_e or e)  # the gate's gradient (in its dtype), from the norm on
    scan, cts, passed, chunk, b_decay, diag, gates, g_bmm, segsum, pads, residual = _held(
        z, dm, saved - terms["y"] - terms["norm"] - terms["out"] - terms["gate_fp32"]
        - cast_out, terms)
    conv = (terms["in_proj_out"] + terms["conv_casts"] + terms["conv_out"] + z.h * f
            + cast_in)
    conv_in = t * z.conv * e
    g_cast = u.mk if dm.autocast else 0  # G's gradient cast to bf16
    out = ("attn_out",)
    return [BackwardMoment("mamba.out", saved, u.tde, out),
            *_gate_backward(z, dm, saved - terms["out"] - cast_out, gate),
            BackwardMoment("mamba.y_off", scan, 3 * u.d + gate + u.tph, out),
            BackwardMoment("mamba.c_states", cts, 2 * u.d + gate + u.bc + u.s2 + u.tph, out),
            BackwardMoment("mamba.passed", passed,
                           u.d + gate + u.bc + 2 * u.s3 + u.tph
                           + z.b * (z.chunks + 1) ** 2 * z.h * f, out),
            BackwardMoment("mamba.chunk_states", chunk,
                           2 * u.d + gate + 2 * u.bc + u.s2 + u.tph, out),
            BackwardMoment("mamba.b_decay", b_decay, 2 * u.d + gate + 4 * u.bc + 2 * u.tph,
                           out),
            BackwardMoment("mamba.diag", diag, u.m + 4 * u.d + gate + 2 * u.bc + u.tph, out),
            BackwardMoment("mamba.gates", gates,
                           3 * u.m + g_cast + 2 * u.d + gate + 2 * u.bc + u.tph, out),
            BackwardMoment("mamba.g_bmm", g_bmm, 2 * u.m + 2 * u.d + gate + 4 * u.bc + u.tph,
                           out),
            BackwardMoment("mamba.segsum", segsum,
                           4 * u.m + 2 * u.d + gate + 2 * u.bc + u.tph, out),
            BackwardMoment("mamba.pads", pads,
                           u.d + 3 * u.tdf + gate + 2 * th * z.n * f + th * (f + e), out),
            BackwardMoment("mamba.residual", residual,
                           3 * u.d + u.tdf + gate + 2 * th * z.n * f + th * e, out),
            BackwardMoment("mamba.conv_act", conv, 2 * conv_in + gate + th * e, out),
            BackwardMoment("mamba.conv", conv - terms["conv_out"],
                           terms["conv_out"] + conv_in + gate + th * e, out),
            BackwardMoment("mamba.proj_grad", z.h * f + cast_in,
                           t * z.width * (z.mup_e or e) + conv_in + gate + th * e, out),
            BackwardMoment("mamba_in", 0, t * z.width * e + grad_in, ("attn",), in_proj)]
