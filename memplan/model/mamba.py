"""The Mamba2 mixer of Granite 4.0-H's Mamba layers, as transformers runs it without the
mamba_ssm and causal-conv1d kernels (the CPU path, and every install without them):
models/granitemoehybrid/modeling_granitemoehybrid.py GraniteMoeHybridMambaLayer.torch_forward
(transformers 5.3), the naive chunked SSD scan and GraniteMoeHybridRMSNormGated. Every size
below is read off that code and checked against autograd's saved tensors.

Per micro-batch on a rank, T tokens (b sequences of s), H heads of P (d = H P), n the state
size, G groups (B and C repeated to the H heads), the conv's C = d + 2 G n channels and K
taps; chunks of c tokens, the sequence padded to S' = N c (Tp = b S'); M = b N c^2 H the
chunk matrices. Autograd saves, in the compute dtype (e):

- in_proj's output, T (2 d + 2 G n + H): the conv's input and the gate are views of it;
- the conv's output, b C (s + K - 1): silu saves the slice, a view of it;
- dt + dt_bias, softplus's output and the clamped dt, T H each;
- out_proj's input, T d;

and in fp32 (the scan upcasts x, B and C):

- x: a view of silu's output (T C) in fp32 runs, its fp32 copy (T d) below fp32; the gate's
  fp32 copy (T d) below fp32;
- the padded x D multiplies and x * dt in chunks (Tp d each); B, C and B * decay in chunks,
  repeated to the heads (Tp H n each); exp(segsum) L, G = C B^T and M = G L (3 M); the two
  decays (Tp H each); the chunk states and the passed states (b (N + 1) H P n each); the
  chunks' decay (b (N + 1)^2 H); four causal masks (bools);
- C_times_states.sum(-1), the padded scan output y, and the gated norm's saved set
  (silu(gate), y * silu(gate), its rsqrt per row, the normalised tensor: T d, T d, T, T d;
  Falcon-H1's FalconH1RMSNormGated an rsqrt per group, T G, and the same sizes whether it
  gates before or after normalising).

The forward's locals stay until it returns: G's and M's products before their sums (M n and
M elements), C_times_states (Tp d n), Y_diag and Y_off, the unsaved D residual; the product
inside Y_diag's sum (M P elements) is its largest transient. On CUDA with mamba_ssm and
causal-conv1d installed transformers runs ``mamba_split_conv1d_scan_combined`` instead, whose
``MambaSplitConv1dScanCombinedFn`` saves in_proj's output, the scan's output before the norm
(T d) and the norm's rstd (T G fp32) and none of the chunked fp32 tensors: not modelled here
(this block is the torch path's).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from memplan.model import linear, mamba_einsum as es
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, Dims, Term, total
from memplan.model.linear import Linear, Split
from memplan.spec import MambaSpec, ModelSpec
from memplan.workload import MambaKernel, Recompute, Workload

_PREFIX = "mamba"


class Sizes(NamedTuple):
    """The block's element counts on one rank for one micro-batch (module docstring)."""

    b: int
    s: int
    h: int  # heads
    p: int  # head dim
    n: int  # state size
    g: int  # groups
    taps: int
    c: int  # chunk length
    chunks: int
    gated: bool = True  # the gated RMSNorm (MambaSpec.gated_norm); else y * silu(gate)
    # bytes of an element of in_proj's output after Falcon-H1's mup_vector product where
    # that is not the compute dtype: under autocast the fp32 buffer promotes the product
    # (``_scan_terms``); 0 otherwise
    mup_e: int = 0
    # rows the gated norm's rsqrt has per token: 1 for GraniteMoeHybridRMSNormGated (5.3, over
    # all of d), G for Falcon-H1's FalconH1RMSNormGated (``hidden_states.view(b, s, G, d / G)``)
    norm_rows: int = 1

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def gate_copy(self) -> bool:
        """Whether the gated norm makes an fp32 copy of the gate (``gate.to(torch.float32)``)
        where the compute dtype is below fp32: not where the gate is already fp32 (Falcon-H1
        under autocast, ``mup_e``)."""
        return self.gated and not self.mup_e

    @property
    def padded(self) -> int:
        return self.b * self.chunks * self.c

    @property
    def d(self) -> int:
        return self.h * self.p

    @property
    def conv(self) -> int:
        return self.d + 2 * self.g * self.n

    @property
    def width(self) -> int:
        """in_proj's output per token: the gate, the conv's channels, dt."""
        return self.d + self.conv + self.h

    @property
    def mats(self) -> int:
        """M = b N c^2 H: one c x c matrix per chunk and head."""
        return self.b * self.chunks * self.c * self.c * self.h

    @property
    def states(self) -> int:
        """b (N + 1) H P n: the passed states (the first chunk's zeros among them)."""
        return self.b * (self.chunks + 1) * self.d * self.n


def sizes(m: MambaSpec, dm: Dims) -> Sizes:
    t = dm.tp
    groups = m.num_groups // t if m.num_groups % t == 0 else m.num_groups
    return Sizes(b=dm.b, s=dm.s, h=m.num_heads // t, p=m.head_dim, n=m.state_size, g=groups,
                 taps=m.conv_kernel, c=m.chunk_size, chunks=-(-dm.s // m.chunk_size),
                 gated=m.gated_norm,
                 mup_e=dm.stream_e if m.parallel_attention and dm.stream_e != dm.e else 0,
                 norm_rows=groups if m.parallel_attention else 1)


def kernel(spec: ModelSpec, wl: Workload) -> MambaKernel:
    """The scan ``wl`` runs: its ``mamba_kernel`` (Granite 4.0-H's and Falcon-H1's mixers
    alike: transformers 5.3's naive torch_forward, 5.23's einsums)."""
    assert spec.mamba is not None
    return wl.mamba_kernel


@lru_cache(maxsize=64)
def mamba_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """in_proj (h -> 2 d + 2 G n + H), column-parallel (the ``attn`` group), out_proj (d ->
    h), row-parallel (``attn_out``); in_proj's bias with proj_bias, out_proj's with
    ``MambaSpec.out_bias``."""
    m, h = spec.mamba, spec.hidden_size
    assert m is not None
    return (Linear("in_proj", "attn", h, m.width, m.proj_bias),
            Linear("out_proj", "attn_out", m.inner, h, m.out_bias, split=Split.ROW))


def _scan_terms(z: Sizes, dm: Dims) -> list[Term]:
    """in_proj's output to the chunked scan's output (the module docstring)."""
    e, f, t, tp = dm.e, FP32_BYTES, z.tokens, z.padded
    low = e < f
    x = t * z.d * f if low else t * z.conv * f  # the fp32 copy, or silu's output it views
    n1 = z.chunks + 1
    # Falcon-H1 under autocast: in_proj's output times the fp32 mup_vector is fp32, so are
    # the gate and dt (its views); autocast's conv1d saves its own cast of the conv's channels
    pe = z.mup_e or e
    return [Term(f"{_PREFIX}.in_proj_out", t * z.width * pe),
            Term(f"{_PREFIX}.gate_fp32", t * z.d * f if low and z.gate_copy else 0),
            Term(f"{_PREFIX}.conv_in_cast", t * z.conv * e if z.mup_e else 0),
            Term(f"{_PREFIX}.conv_out", z.b * z.conv * (z.s + z.taps - 1) * e),
            Term(f"{_PREFIX}.x_fp32", x),
            Term(f"{_PREFIX}.dt", 3 * t * z.h * pe),
            Term(f"{_PREFIX}.a", 2 * z.h * f),
            Term(f"{_PREFIX}.x_chunks", 2 * tp * z.d * f),  # padded x (D), x * dt in chunks
            Term(f"{_PREFIX}.bc", 3 * tp * z.h * z.n * f),  # B, C, B * decay
            Term(f"{_PREFIX}.chunk_mats", 3 * z.mats * f),  # L, G, M
            Term(f"{_PREFIX}.decays", 2 * tp * z.h * f),
            Term(f"{_PREFIX}.states", 2 * z.states * f),
            Term(f"{_PREFIX}.decay_chunk", z.b * n1 * n1 * z.h * f),
            Term(f"{_PREFIX}.masks", 2 * z.c * z.c + 2 * n1 * n1),
            Term(f"{_PREFIX}.y_off", tp * z.d * f)]


def _norm_terms(z: Sizes, dm: Dims) -> list[Term]:
    """GraniteMoeHybridRMSNormGated on the padded y (a view of it) and out_proj's input.
    Without the norm (Falcon-H1's ``y * silu(gate)``, ``Sizes.gated`` false) the product
    saves the padded y (its view) and silu's output (T d, the compute dtype; silu saves the
    gate, a view of in_proj's scaled output); out_proj saves the product's cast to the
    compute dtype (in fp32 the product itself)."""
    f, t = FP32_BYTES, z.tokens
    gate = (3 * z.d + z.norm_rows) * t * f if z.gated else t * z.d * (z.mup_e or dm.e)
    return [Term(f"{_PREFIX}.y", z.padded * z.d * f),
            Term(f"{_PREFIX}.norm", gate),
            Term(f"{_PREFIX}.out", t * z.d * dm.e)]


def mamba_terms(spec: ModelSpec, dm: Dims, kernel: MambaKernel) -> list[Term]:
    """The block's saved terms, its input norm apart, as ``kernel`` runs it (transformers
    5.3's naive scan; 5.23's einsums: ``memplan.model.mamba_einsum``)."""
    assert spec.mamba is not None
    z = sizes(spec.mamba, dm)
    if kernel is MambaKernel.TORCH_EINSUM:
        scan = es.scan_terms(z, dm) + es.norm_terms(z, dm)
    else:
        scan = _scan_terms(z, dm) + _norm_terms(z, dm)
    return scan + linear.saved_terms(_PREFIX, mamba_linears(spec), dm)


def _einsum_saved(spec: ModelSpec, dm: Dims) -> int:
    """The block's saved bytes as transformers 5.23's einsum scan keeps them (``mamba_terms``)."""
    return total(mamba_terms(spec, dm, MambaKernel.TORCH_EINSUM))


def _casts(spec: ModelSpec, dm: Dims) -> tuple[int, int]:
    """What in_proj and out_proj save of their own (``linear.saved_terms``: under autocast
    their weights' casts), each on its own."""
    in_proj, out_proj = mamba_linears(spec)
    return (total(linear.saved_terms(_PREFIX, [in_proj], dm)),
            total(linear.saved_terms(_PREFIX, [out_proj], dm)))


def mamba_cache_bytes(spec: ModelSpec, wl: Workload, dm: Dims) -> int:
    """What a training forward's cache keeps of a Mamba layer (``Workload.kv_cache``):
    nothing on transformers 5.3, whose GraniteMoeHybridModel.forward makes no cache when none
    is passed; 5.23's (``memplan.model.mamba_einsum.cache_bytes``)."""
    assert spec.mamba is not None
    if kernel(spec, wl) is not MambaKernel.TORCH_EINSUM:
        return 0
    return es.cache_bytes(sizes(spec.mamba, dm), dm)


def _locals(z: Sizes, dm: Dims) -> int:
    """Unsaved locals of torch_forward from the chunks on, until it returns: D's residual
    (Tp d), A * dt in chunks and its cumsum (Tp H each), G's and M's products before their
    sums (M n, M); below fp32 silu's output (T C, which the fp32 copies replace)."""
    f = FP32_BYTES
    silu = z.tokens * z.conv * dm.e if dm.e < f else 0
    return (z.padded * z.d + 2 * z.padded * z.h + z.mats * (z.n + 1)) * f + silu


def _unnamed(z: Sizes, dm: Dims) -> int:
    """Of the saved terms before the scan's chunks, those no local of torch_forward holds (a
    checkpointed layer frees them once used): the conv's whole output, the padded x D
    multiplies, dt + dt_bias and softplus's output; below fp32 the fp32 copy of x (rebound
    by x * dt) and the gate's (made inside the norm, freed there)."""
    f, t = FP32_BYTES, z.tokens
    copies = (2 if z.gate_copy else 1) * t * z.d * f if dm.e < f else 0
    return (z.b * z.conv * (z.s + z.taps - 1) * dm.e + z.padded * z.d * f
            + 2 * t * z.h * dm.e + copies)


class Mamba:
    """GraniteMoeHybridMambaLayer on transformers' torch path (the module docstring)."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return mamba_terms(spec, dm, kernel(spec, wl))

    def _moments(self, spec: ModelSpec, dm: Dims) -> list[Moment]:
        assert spec.mamba is not None
        z = sizes(spec.mamba, dm)
        f = FP32_BYTES
        terms = mamba_terms(spec, dm, MambaKernel.TORCH)
        saved = total(terms)
        late = total(_norm_terms(z, dm)) + total(terms[len(_scan_terms(z, dm)) + 3:])
        y_off = z.padded * z.d * f
        after_m = total([t for t in terms if t.name.endswith(
            (".decays", ".states", ".decay_chunk", ".masks", ".y_off"))])
        base = _locals(z, dm)
        stream = dm.rows * spec.hidden_size * dm.e
        scan_out = z.tokens * z.d * f if dm.e < f else 0  # the norm's fp32 output
        return [Moment("ssd_diag", saved - late - after_m, base + z.mats * z.p * f),
                Moment("ssd_states", saved - late - y_off,
                       base + y_off + z.padded * z.d * z.n * f),
                Moment("mamba", saved, base + 3 * y_off + z.padded * z.d * z.n * f
                       - y_off + stream + scan_out)]

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """Y_diag's product (everything up to M saved), C_times_states beside Y_diag, and
        out_proj's output, with torch_forward's locals (``_locals``) all along; the einsum
        scan's (``memplan.model.mamba_einsum.forward_moments``)."""
        if kernel(spec, wl) is MambaKernel.TORCH_EINSUM:
            return self._einsum_moments(spec, dm, wl.kv_cache and recompute is Recompute.NONE)
        return self._moments(spec, dm)

    def _einsum_moments(self, spec: ModelSpec, dm: Dims, cached: bool) -> list[Moment]:
        return es.forward_moments(sizes(spec.mamba, dm), dm, _einsum_saved(spec, dm),
                                  dm.rows * spec.hidden_size * dm.e, cached, _casts(spec, dm))

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer the forward's locals hold the same tensors but those no
        local holds (``_unnamed``), and at its end C_times_states.sum(-1) and the norm's own
        (freed when it returns)."""
        assert spec.mamba is not None
        z = sizes(spec.mamba, dm)
        if kernel(spec, wl) is MambaKernel.TORCH_EINSUM:
            return es.working_set(z, dm)
        freed = _unnamed(z, dm)
        norm = total(_norm_terms(z, dm)[:2])  # the padded y and the norm's (or silu's)
        diag, states, end = self._moments(spec, dm)
        return [Moment(diag.name, 0, diag.own_bytes - freed + diag.transient_bytes),
                Moment(states.name, 0, states.own_bytes - freed + states.transient_bytes),
                Moment(end.name, 0, end.own_bytes - freed - norm + end.transient_bytes)]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """out_proj's, the gated norm's (five fp32 T d tensors), C_times_states' product's
        beside y's gradient, Y_diag's product's and G's beside the gradients accumulated by
        then, in_proj's (its output's gradient and its input's). A broadcasting product's
        backward makes both inputs' gradients at the product's full size before the engine
        sums each to its input's shape (validate_outputs: sum_to): two full-size tensors at
        once (2 Tp d n, 2 M P, 2 M n)."""
        assert spec.mamba is not None
        z = sizes(spec.mamba, dm)
        grad_in = dm.rows * spec.hidden_size * dm.e
        in_proj = linear.weight_elements(mamba_linears(spec)[0], dm.tp)
        if kernel(spec, wl) is MambaKernel.TORCH_EINSUM:
            return es.backward_moments(z, dm, _einsum_saved(spec, dm), grad_in, in_proj,
                                       _casts(spec, dm))
        f, e, tp = FP32_BYTES, dm.e, z.padded
        terms = {t.name.partition(".")[2]: t.size_bytes
                 for t in mamba_terms(spec, dm, MambaKernel.TORCH)}
        saved = sum(terms.values())
        out = terms["out"]
        norm = terms["norm"] + terms["y"]
        grad_y = tp * z.d * f
        # after the norm's backward: silu's fp32 copy of the gate freed (below fp32), the
        # gate's gradient waiting for in_proj's output's (the split's backward, last)
        off = saved - out - norm - terms["y_off"] - terms["gate_fp32"]
        if z.mup_e:
            # Falcon-H1 under autocast: the conv saves its cast, so once silu's backward has
            # run nothing holds in_proj's fp32 scaled output (the gate is its last view)
            off -= terms["in_proj_out"]
        grad_gate = z.tokens * z.d * e
        diag = off - terms["decays"] - terms["states"] - terms["decay_chunk"] - \
            tp * z.h * z.n * f
        gates = diag - z.mats * 2 * f - tp * z.d * f
        accumulated = (grad_y + 2 * tp * z.h * z.n * f + tp * z.d * f + tp * z.h * f
                       + grad_gate)
        attn_out = ("attn_out",)
        # the gated norm's backward: five fp32 T d tensors; y * silu(gate)'s (Falcon-H1):
        # the product's fp32 gradient (the cast's backward), y's and silu's output's in fp32,
        # the latter's cast to silu's dtype
        gate_bw = 5 * z.tokens * z.d * f if z.gated else z.tokens * z.d * (3 * f + e)
        return [BackwardMoment("mamba.out", saved, z.tokens * z.d * e, attn_out),
                BackwardMoment("mamba.norm", saved - out, gate_bw, attn_out),
                # y's gradient made whole by the slice's backward, Y_off's, C_times_states.
                # sum's (times the decay) and the decay's full-size one before its sum_to
                BackwardMoment("mamba.state_out", off,
                               4 * grad_y + 2 * tp * z.d * z.n * f + grad_gate, attn_out),
                BackwardMoment("mamba.diag", diag, accumulated + z.mats * (2 * z.p + 1) * f,
                               attn_out),
                BackwardMoment("mamba.gates", gates,
                               accumulated + z.mats * (2 * z.n + 2) * f, attn_out),
                BackwardMoment("mamba_in", 0, z.tokens * z.width * e + grad_in, ("attn",),
                               in_proj)]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Rerun with autograd recording in a fully recomputed layer's backward: as the
        forward's (no cache: gradient checkpointing turns use_cache off)."""
        if kernel(spec, wl) is MambaKernel.TORCH_EINSUM:
            return self._einsum_moments(spec, dm, False)
        return self._moments(spec, dm)

    def _small(self, spec: ModelSpec, t: int) -> tuple[list[tuple[int, ...]],
                                                       list[tuple[int, ...]]]:
        """(the module's own dt_bias, A_log and D, then the conv's weight and bias; the
        norm's weight) shapes on one rank: named_parameters lists a module's own parameters
        before its children's."""
        m = spec.mamba
        assert m is not None
        heads, d = m.num_heads // t, m.inner // t
        groups = m.num_groups // t if m.num_groups % t == 0 else m.num_groups
        conv = d + 2 * groups * m.state_size
        before: list[tuple[int, ...]] = [(heads,)] * 3 + [(conv, 1, m.conv_kernel)] + (
            [(conv,)] if m.conv_bias else [])
        return before, [(d,)] if m.gated_norm else []

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        """dt_bias, A_log, D, conv1d, in_proj, norm, out_proj (named_parameters' order)."""
        before, after = self._small(spec, t)
        inp, out = (linear.all_tensor_shapes([lin], t) for lin in mamba_linears(spec))
        return before + inp + after + out

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        return [math.prod(shape) for shape in self.tensor_shapes(spec, t, ep)]

    def cast_sizes(self, spec: ModelSpec, wl: Workload, t: int) -> list[int]:
        """Elements of the parameters autocast casts and keeps in its cache, in the order the
        forward casts them: in_proj's, the conv's, out_proj's. The cache takes a leaf only
        (``cached_cast``, aten/src/ATen/autocast_mode.cpp): 5.3's torch_forward calls the
        ``self.conv1d`` module (its weight and bias cached), 5.23's ``causal_conv1d_fn`` gets
        ``self.conv1d.weight.squeeze(1)``, a view cast anew and saved by conv1d alone (the
        ``conv_casts`` term), and the bias itself (cached). dt_bias, A_log, D and the gated
        norm's weight meet fp32 ops and products only (exp, softplus's add, ``*``): no cast.
        Traced: tests/traced/test_hf_heldout.py (Falcon-H1 under autocast, full recompute)."""
        conv_weight, *conv_bias = self._small(spec, t)[0][3:]
        conv = ([] if kernel(spec, wl) is MambaKernel.TORCH_EINSUM
                else [math.prod(conv_weight)]) + [math.prod(b) for b in conv_bias]
        inp, out = ([math.prod(s) for s in linear.all_tensor_shapes([lin], t)]
                    for lin in mamba_linears(spec))
        return inp + conv + out

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``attn_out``: out_proj and the norm's weight; ``attn``: all."""
        before, after = self._small(spec, t)
        return linear.grad_groups(mamba_linears(spec), t, ("attn_out", "attn"),
                                  {"attn_out": sum(math.prod(s) for s in after),
                                   "attn": sum(math.prod(s) for s in before)})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """2 per projection weight, 2 per conv tap and channel, and the scan's
        (``core_flops_per_token``)."""
        m = spec.mamba
        assert m is not None
        return (linear.flops_per_token(mamba_linears(spec)) + 2.0 * m.conv_dim * m.conv_kernel
                + self.core_flops_per_token(spec, seq_len))

    def core_flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """The SSD scan's multiply-adds per token (2 FLOPs each), chunk c: within the chunk
        C B^T (c H n), M's masking (c H) and M x (c H P); the chunk's state B x (H P n) and
        the state's output C S (H P n)."""
        m = spec.mamba
        assert m is not None
        c, h, p, n = m.chunk_size, m.num_heads, m.head_dim, m.state_size
        return 2.0 * (c * h * (n + 1 + p) + 2 * h * p * n)
