"""LFM2's gated short-convolution block, as transformers runs it without the causal-conv1d
kernels (the CPU path, and every install without them): models/lfm2/modeling_lfm2.py
Lfm2ShortConv.slow_forward (transformers 5.3; 5.25's forward runs the same ops through
``causal_conv1d_forward``):

    BCx = in_proj(x).transpose(-1, -2); B, C, x = BCx.chunk(3, dim=-2)
    conv_out = conv(B * x)[..., :seqlen]        # depthwise, padding K - 1 on both sides
    y = out_proj((C * conv_out).transpose(-1, -2).contiguous())

Per micro-batch on a rank, T tokens (b sequences of s), c = h / t channels, K taps, in the
compute dtype, autograd saves:

- in_proj's output, 3 T c: the two products save their views B, x and C of it, which keep
  the whole tensor;
- B * x, T c: the convolution's input;
- the convolution's output, b c (s + K - 1): the product with C saves the slice, a view of
  the whole padded output;
- out_proj's input, T c (the contiguous copy of C * conv_out, which is freed).

causal-conv1d's kernel path (``cuda_kernels_forward``, on CUDA with causal-conv1d installed)
saves the same but the convolution's output, T c without the K - 1 padded positions
(``causal_conv1d_fn``'s output is the sequence's length): b c (K - 1) elements fewer, which
this model counts (the torch path) as an upper bound.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.model import linear
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import Dims, Term, total
from memplan.model.linear import Linear, Split
from memplan.spec import ModelSpec, ShortConvSpec
from memplan.workload import Recompute, Workload

_PREFIX = "short_conv"


@lru_cache(maxsize=64)
def short_conv_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """in_proj (h -> 3 h), column-parallel (the ``attn`` group), out_proj (h -> h),
    row-parallel (``attn_out``); with conv_bias both have biases."""
    sc, h = spec.short_conv, spec.hidden_size
    assert sc is not None
    return (Linear("in_proj", "attn", h, 3 * h, sc.conv_bias),
            Linear("out_proj", "attn_out", h, h, sc.conv_bias, split=Split.ROW))


def _sizes(spec: ModelSpec, dm: Dims) -> tuple[ShortConvSpec, int, int]:
    """(the spec, T c elements, b c (s + K - 1) elements: the padded convolution output)."""
    sc = spec.short_conv
    assert sc is not None
    c = spec.hidden_size // dm.tp
    return sc, dm.tokens * c, dm.b * c * (dm.s + sc.conv_kernel - 1)


def short_conv_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """The block's saved terms (the module docstring), its input norm apart."""
    sc, tc, padded = _sizes(spec, dm)
    e = dm.e
    # under autocast conv1d runs in the low dtype (CUDA's lower-precision op list) and saves
    # the cast of its weight, c x K
    conv_cast = tc // dm.tokens * sc.conv_kernel * e if dm.autocast else 0
    return [Term(f"{_PREFIX}.bcx", 3 * tc * e), Term(f"{_PREFIX}.bx", tc * e),
            Term(f"{_PREFIX}.conv_out", padded * e), Term(f"{_PREFIX}.out", tc * e),
            *linear.saved_terms(_PREFIX, short_conv_linears(spec), dm),
            *([Term(f"{_PREFIX}.conv.weight_casts", conv_cast)] if conv_cast else [])]


def _conv_sizes(spec: ModelSpec, t: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """The depthwise conv1d's weight (c, 1, K) and, with conv_bias, its bias (c)."""
    sc = spec.short_conv
    assert sc is not None
    c = spec.hidden_size // t
    shapes: list[tuple[int, ...]] = [(c, 1, sc.conv_kernel)] + ([(c,)] if sc.conv_bias else [])
    return [c * sc.conv_kernel] + ([c] if sc.conv_bias else []), shapes


class ShortConv:
    """Lfm2ShortConv on transformers' torch path (the module docstring)."""

    name = "attn"

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        return short_conv_terms(spec, dm)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        """The contiguous copy of C * conv_out beside the product (everything saved by then),
        and out_proj's output before the residual add."""
        _, tc, _ = _sizes(spec, dm)
        saved = total(short_conv_terms(spec, dm))
        stream = dm.rows * spec.hidden_size * dm.e
        return [Moment("short_conv_copy", saved, tc * dm.e),
                Moment("short_conv", saved, stream)]

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """In a checkpointed layer nothing is saved; the forward's locals (BCx, Bx, the
        padded convolution output) stay until it returns: at the contiguous copy beside the
        product, then beside out_proj's output."""
        _, tc, padded = _sizes(spec, dm)
        e = dm.e
        held = (4 * tc + padded) * e
        stream = dm.rows * spec.hidden_size * e
        return [Moment("short_conv", 0, held + 2 * tc * e),
                Moment("short_conv_out", 0, held + tc * e + stream)]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """In backward order: out_proj's (its input's gradient beside everything saved); the
        product with C's (out_proj's input freed; the gradients of C and of the slice); the
        slice's (its gradient made whole, b c (s + K - 1), the product's saved tensors freed);
        the convolution's (Bx's gradient); the product B * x's (B's and x's gradients, the
        convolution's tensors freed); the chunk's (the three gradients concatenated into
        in_proj's output's, 3 T c, in_proj's output freed); in_proj's (its input's gradient
        beside its output's)."""
        _, tc, padded = _sizes(spec, dm)
        e = dm.e
        bcx, bx, conv = 3 * tc * e, tc * e, padded * e
        saved = total(short_conv_terms(spec, dm))
        casts = saved - bcx - bx - conv - tc * e  # autocast's weight casts
        grad_in = dm.rows * spec.hidden_size * e
        in_proj = linear.weight_elements(short_conv_linears(spec)[0], dm.tp)
        out = ("attn_out",)
        return [BackwardMoment("short_conv.out", saved, tc * e, out),
                BackwardMoment("short_conv.gate", saved - tc * e, 3 * tc * e, out),
                BackwardMoment("short_conv.slice", casts + bcx + bx, 2 * tc * e + conv, out),
                BackwardMoment("short_conv.conv", casts + bcx + bx, 2 * tc * e + conv, out),
                BackwardMoment("short_conv.input_gate", casts + bcx, 4 * tc * e, out),
                BackwardMoment("short_conv.chunk", casts, 6 * tc * e, out),
                BackwardMoment("short_conv_in", 0, 3 * tc * e + grad_in, ("attn",), in_proj)]

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Rerun with autograd recording in a fully recomputed layer's backward: the
        contiguous copy beside the product, everything saved by then."""
        _, tc, _ = _sizes(spec, dm)
        return [Moment("short_conv_copy", total(short_conv_terms(spec, dm)), tc * dm.e)]

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int) -> list[int]:
        """conv, in_proj, out_proj (the module's registration order)."""
        conv, _ = _conv_sizes(spec, t)
        return conv + linear.all_tensor_sizes(short_conv_linears(spec), t)

    def tensor_shapes(self, spec: ModelSpec, t: int, ep: int) -> list[tuple[int, ...]]:
        _, conv = _conv_sizes(spec, t)
        return conv + linear.all_tensor_shapes(short_conv_linears(spec), t)

    def grad_groups(self, spec: ModelSpec, t: int, ep: int) -> dict[str, int]:
        """``attn_out``: out_proj (its backward runs first); ``attn``: all, the convolution's
        weight among them."""
        conv, _ = _conv_sizes(spec, t)
        return linear.grad_groups(short_conv_linears(spec), t, ("attn_out", "attn"),
                                  {"attn": sum(conv)})

    def flops_per_token(self, spec: ModelSpec, seq_len: int) -> float:
        """2 per projection weight (``memplan.model.linear``) and 2 per convolution tap and
        channel (a multiply-add)."""
        sc = spec.short_conv
        assert sc is not None
        return (linear.flops_per_token(short_conv_linears(spec))
                + 2.0 * spec.hidden_size * sc.conv_kernel)


def conv_cache_bytes(spec: ModelSpec, dm: Dims) -> int:
    """What the cache a training forward with use_cache makes keeps per layer until the
    forward's output is dropped (Lfm2HybridConvCache.__init__: a zero conv state of b x h x
    conv_L_cache in the model's dtype for every layer, the attention layers' too; their keys
    and values are the tensors attention saves)."""
    sc = spec.short_conv
    assert sc is not None
    return dm.b * (spec.hidden_size // dm.tp) * sc.conv_kernel * dm.stream_e
