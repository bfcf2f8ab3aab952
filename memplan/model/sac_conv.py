"""Op-level checkpointing (``memplan.model.sac_ops``) of LFM2's short-convolution layers: the
ops a policy can keep in the gated short convolution, as transformers runs it without the
causal-conv1d kernels (models/lfm2/modeling_lfm2.py ``Lfm2ShortConv.slow_forward``, the
block ``memplan.model.short_conv`` models):

    BCx = in_proj(x).transpose(-1, -2); B, C, x = BCx.chunk(3, dim=-2)
    Bx = B * x                                     # short_conv.bx
    conv_out = self.conv(Bx)[..., :seqlen]         # short_conv.conv_out (padded, K - 1 more)
    y = C * conv_out                               # short_conv.out
    y = y.transpose(-1, -2).contiguous(); y = self.out_proj(y)

Each saved term of the block is an item named after it: ``short_conv.bcx`` (in_proj's output,
an ``mm`` 3 c wide), ``short_conv.bx`` (the first gating product), ``short_conv.conv_out``
(the depthwise conv1d's padded output, ``aten.convolution``, named by its c channels) and
``short_conv.out`` (the second gating product, whose contiguous copy is out_proj's saved
input: kept, the copy reruns from it); ``short_conv.out_proj`` is out_proj's output, which no
backward reads but whose rerun it skips (the MLP norm's saved tensors need the residual sum).
The two products run on (b, c, s) views: a policy sees them as ``mul`` of width s, the
sequence. The layer's norms (Lfm2DecoderLayer.operator_norm, ffn_norm: Lfm2RMSNorm, Llama's
upcast RMSNorm) and its MLP (Lfm2MLP, a SwiGLU) are the attention layers'
(``memplan.model.sac_ops.layer_ops``).
"""

from __future__ import annotations

from memplan.model.dims import Dims, Term
from memplan.model.sac_ops import (CONV, MATMUL, PRODUCT, Item, _fp32_ops, _norm_ops,
                                   _norms_nameable, numbered)
from memplan.spec import ModelSpec
from memplan.workload import Workload

# the block that runs the items (``memplan.model.short_conv.ShortConv.name``)
_BLOCK = "attn"


def conv_items(spec: ModelSpec, dm: Dims, terms: dict[str, int]) -> list[Item]:
    """The short convolution's items in execution order, on one rank (c = h / t channels,
    T tokens, K taps, e the compute dtype's bytes): in_proj's output T x 3c x e (2 x h x 3c
    FLOPs a token), B * x T x c x e (c), the convolution's b x c x (s + K - 1) x e (2 K c: a
    multiply-add per tap), C * conv_out T x c x e (c), out_proj's T x h x e (2 c h; a
    row-parallel output is the full partial sum on each rank)."""
    sc = spec.short_conv
    assert sc is not None
    h, c = spec.hidden_size, spec.hidden_size // dm.tp
    tc = dm.tokens * c * dm.e
    return [Item("short_conv.bcx", ("short_conv.bcx",), terms["short_conv.bcx"],
                 2.0 * h * 3 * c, MATMUL, 3 * c, 0, _BLOCK, False),
            Item("short_conv.bx", ("short_conv.bx",), terms["short_conv.bx"], float(c),
                 PRODUCT, dm.s, 0, _BLOCK, False),
            Item("short_conv.conv_out", ("short_conv.conv_out",), terms["short_conv.conv_out"],
                 2.0 * sc.conv_kernel * c, CONV, c, 0, _BLOCK, False),
            # a local freed at the contiguous copy: kept, it stays beside out_proj's output
            Item("short_conv.out", ("short_conv.out",), tc, float(c), PRODUCT, dm.s, 0,
                 _BLOCK, True),
            Item("short_conv.out_proj", (), dm.tokens * h * dm.e, 2.0 * c * h, MATMUL, h, 0,
                 _BLOCK, False)]


def conv_layer_ops(spec: ModelSpec, wl: Workload, dm: Dims, saved: tuple[Term, ...],
                   attention_ops: tuple[Item, ...]) -> tuple[Item, ...]:
    """A short-convolution layer's ops a policy counts, in execution order (``sac_ops.
    layer_ops``' for an attention layer): the operator norm's, the convolution's
    (``conv_items``), the MLP norm's, then the MLP's, the attention layers' own
    (``attention_ops``: an attention layer's ``layer_ops``, whose MLP sub-layer is the same
    module, Lfm2MLP). ``saved``: what the layer saves without recompute."""
    terms = {t.name: t.size_bytes for t in saved}
    h = spec.hidden_size
    named = _norms_nameable(spec, wl, dm, terms, qk_norms=False)
    fp32 = _fp32_ops(spec, wl, dm)
    out = _norm_ops("attn_norm", terms, h, h, named, fp32_ops=fp32)
    out += conv_items(spec, dm, terms)
    out += _norm_ops("mlp_norm", terms, h, h, named, fp32_ops=fp32)
    out += [i for i in attention_ops if i.block == "mlp"]
    return numbered(out)
