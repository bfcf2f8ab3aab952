"""Op-level checkpointing (``memplan.model.sac_ops``) of Granite 4.0-H's Mamba2 layers: the
ops a policy counts in the mixer as transformers 5.3 runs it without mamba_ssm and
causal-conv1d (models/granitemoehybrid/modeling_granitemoehybrid.py
``GraniteMoeHybridMambaLayer.torch_forward``, the naive chunked scan, and
``GraniteMoeHybridRMSNormGated``: the block ``memplan.model.mamba`` models), in execution
order with their families and output widths as the emitted policy's ``_key`` sees them
(``memplan.report.sac_policy``; traced: tests/traced/test_sac_policy.py)::

    projected_states = self.in_proj(input_states)        # mm, W = 2d + 2Gn + H: mamba.in_proj
    conv = self.conv1d(xBC.transpose(1, 2))              # convolution, C: mamba.conv_out
    xBC = self.act(conv[..., :s].transpose(1, 2))        # silu, C: mamba.act
    A = -torch.exp(self.A_log.float())                   # (16-bit weights) copy, H
    x, B, C = x.float(), B.float(), C.float()            # (below fp32) copy P, n, n
    D_residual = D[..., None] * pad(x); x = x * dt[..., None]    # mul P, mul P
    A = A * dt                                                   # mul H
    G = (C[..] * B[..]).sum(-1); M = (G[..., None] * L[..., None]).sum(-1)   # mul n, mul 1
    Y_diag = (M[..., None] * x[:, :, None]).sum(3)                # mul P
    B_decay = B * decay[..., None]; states = (B_decay[..] * x[..]).sum(2)   # mul n, mul n
    states = torch.cat([zeros, states], dim=1)                    # cat, n (along dim 1)
    new_states = (decay_chunk[..] * states[..]).sum(1)            # mul n
    Y_off = (C[..] * states[..]).sum(-1) * decay_out[..., None]  # mul n, mul P
    norm(y, gate): gate.to(float32) (copy d, below fp32), silu (d), y * silu (d),
        variance + eps (shift, 1), rsqrt (1), y * rsqrt (d), weight * y (d)
    out_proj(scan_output.to(dtype))                       # copy d (below fp32): mamba.out;
                                                          # mm, h: mamba.out_proj

(the exps, cumsums, pads, clamps, softplus and sums are no ops a policy counts; the
widths read off a trace of the toy in tests/traced/test_sac_policy.py). Each output a layer can keep
is an item: ``mamba.in_proj`` (in_proj's output, which the gate, x B C and dt view: a local
to the mixer's end), ``mamba.conv_out`` (the conv's padded output, b C (s + K - 1): freed
once silu has read its slice, so kept it adds to the mixer's working set), ``mamba.act``
(silu's output, a local to the end), ``mamba.out`` (out_proj's saved input: the cast below
fp32, the weight's product in fp32) and ``mamba.out_proj`` (out_proj's output, which no
backward reads but whose rerun it skips). The scan's and the gated norm's ops are counted,
never kept: the backward needs their saved tensors, so the rerun rebuilds them whatever is
kept. Under autocast the casts autocast makes (in_proj's and out_proj's inputs and weights,
the conv's weight and bias) are not counted: no item there is a cast (``mamba.out`` is none
there), and the norms are not named (``sac_ops._norms_nameable``). The layer's norms and MLP
are the attention layers' (``sac_ops.layer_ops``); an MoE block's items (Granite 4.0-H Tiny and
Small: GraniteMoeHybridMoE, then the shared MLP) follow the layer's ops as in an attention
layer (``memplan.model.layer.ops_items``: ``sac_moe.moe_items``, counted after them; traced:
tests/traced/test_sac_policy.py).

transformers 5.23 (``mamba_kernel`` torch-einsum: ``memplan.model.mamba_einsum``) runs the
mixer through ``causal_conv1d_fn``'s and ``mamba2_chunk_scan``'s torch fallbacks
(models/granitemoehybrid/modeling_granitemoehybrid.py ``GraniteMoeHybridMambaLayer.forward``)
with the same items between other ops (``mamba_items``; read off traces of 5.23's own
mixers: tests/data/traces/mamba_einsum/sac_keys-5.23.json)::

    projected_states = self.in_proj(input_states)        # mm, W: mamba.in_proj
    A = -torch.exp(self.A_log.float())                   # (16-bit weights) copy, H
    out = F.conv1d(x.to(weight.dtype), ...)[..., :s]     # (autocast: casts) convolution, C:
                                                         # mamba.conv_out
    out = silu(out).to(x.dtype)                          # silu of (b, C, s): act, s wide:
                                                         # mamba.act
    dt = clamp(softplus(dt + dt_bias.to(dt.dtype)))      # (autocast) copy H; clamp, H
    x, B, C = x.float(), B.float(), C.float()            # (below fp32) copy P, n, n
    D_residual = D[..., None] * pad(x)                   # mul, P
    x = x * dt[..., None].float(); A = A * dt.float()    # copy 1, mul P, copy H, mul H
    G = einsum(C, B); M = G * L                          # bmm, c; mul, H
    Y_diag = einsum(M, x)                                # bmm, P
    B_decay = B * decay; states = einsum(B_decay, x)     # mul, n; bmm, n
    states = cat([zeros, states], dim=1)                 # cat, n
    new_states = einsum(decay_chunk, states)             # bmm, P n
    C_times_states = einsum(C, states); Y_off = ... * decay_out   # bmm, P; mul, P
    norm(y, gate): gate.to(float32) (copy d, below fp32), silu d, y * silu d, + eps (shift 1),
        rsqrt 1, * rsqrt d / G (GraniteMoeHybridRMSNormGated's group_size), weight * d
    out_proj(scan_output.to(dtype))                      # copy d (below fp32): mamba.out; mm h

Under autocast each einsum's bmm casts its operands first (``_einsum_scan_ops``). Falcon-H1's
fp32 ``mup_vector`` product under autocast leaves x, B, C and dt in fp32 (no copies), and
silu's bf16 output is cast back to it (copy s).
"""

from __future__ import annotations

from memplan.model.dims import Dims, Term
from memplan.model.mamba import Mamba, Sizes, sizes
from memplan.model.sac_mla import CAT
from memplan.model.sac_ops import (ACTIVATION, BMM, CLAMP, CONV, COPY, MATMUL, PRODUCT, RSQRT,
                                   SHIFT, Item, _fp32_ops, _norm_ops, _norms_nameable, _unkept,
                                   numbered)
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES
from memplan.workload import MambaKernel, Workload

# the block that runs the items (``memplan.model.mamba.Mamba.name``)
_BLOCK = "attn"


def _scan_ops(p: int, n: int, h: int, low: bool, a_cast: bool) -> list[Item]:
    """The chunked scan's ops a policy counts (module docstring), head dim ``p``, state size
    ``n``, ``h`` heads on this rank; ``low``: x, B and C below fp32, upcast (``a_cast``: and
    A_log, a 16-bit parameter; under autocast an fp32 one)."""
    casts = ([_unkept(COPY, h, _BLOCK)] if a_cast else []) + (
        [_unkept(COPY, w, _BLOCK) for w in (p, n, n)] if low else [])
    return casts + [_unkept(PRODUCT, w, _BLOCK) for w in (p, p, h, n, 1, p, n, n)] + [
        _unkept(CAT, n, _BLOCK), _unkept(PRODUCT, n, _BLOCK), _unkept(PRODUCT, n, _BLOCK),
        _unkept(PRODUCT, p, _BLOCK)]


def _norm_and_out(d: int, low: bool, pure: bool, out_bytes: int, rsqrt_width: int | None = None,
                  casts: int = 1) -> list[Item]:
    """GraniteMoeHybridRMSNormGated's ops on the fp32 scan output (module docstring), its
    ``* rsqrt`` ``rsqrt_width`` wide (5.3: d; 5.23: d / G, its group_size), then out_proj's
    input: below fp32 the weight's product, then ``.to(dtype)``, the item ``mamba.out``
    (``pure``: 16-bit weights; under autocast the stream's dtype, and ``casts`` of autocast's
    own, counted, no item: 5.3's of the input, 5.23's out_proj's of its input and weight);
    in fp32 the weight's product is out_proj's input, the item."""
    ops = [_unkept(COPY, d, _BLOCK)] * low + [
        _unkept(ACTIVATION, d, _BLOCK), _unkept(PRODUCT, d, _BLOCK), _unkept(SHIFT, 1, _BLOCK),
        _unkept(RSQRT, 1, _BLOCK), _unkept(PRODUCT, rsqrt_width or d, _BLOCK)]
    out = Item("mamba.out", ("mamba.out",), out_bytes, float(d), COPY if low else PRODUCT, d,
               0, _BLOCK, False)
    if not low:
        return ops + [out]
    return ops + [_unkept(PRODUCT, d, _BLOCK)] + (
        [out] if pure else [_unkept(COPY, d, _BLOCK)] * casts)


def _einsum_scan_ops(z: Sizes, low: bool, cast: bool, block: str = _BLOCK) -> list[Item]:
    """5.23's ``mamba2_chunk_scan``'s ops a policy counts (module docstring), on one rank;
    ``low``: x, B, C and dt below fp32 (16-bit weights, or in_proj's output under autocast),
    upcast; ``cast``: under autocast, where each einsum's bmm casts its two operands (the
    chunks' decay alone for the passed states', C alone for C_times_states'), and where dt
    is below fp32 dt_bias is cast to its dtype."""
    def ops(op: str, *widths: int) -> list[Item]:
        return [_unkept(op, w, block) for w in widths]

    def bmm(width: int, *casts: int) -> list[Item]:
        return ops(COPY, *casts) * cast + ops(BMM, width)

    p, n, h = z.p, z.n, z.h
    return (ops(COPY, h) * (low and cast) + ops(CLAMP, h) + ops(COPY, p, n, n) * low
            + ops(PRODUCT, p) + ops(COPY, 1) * low + ops(PRODUCT, p) + ops(COPY, h) * low
            + ops(PRODUCT, h) + bmm(z.c, z.c, n) + ops(PRODUCT, h) + bmm(p, p, z.c)
            + ops(PRODUCT, n) + bmm(n, n, z.c) + ops(CAT, n) + bmm(p * n, z.chunks + 1)
            + bmm(p, n) + ops(PRODUCT, p))


def conv_act(z: Sizes, terms: dict[str, int], e: int, act_width: int, block: str = _BLOCK,
             act_freed: bool = False) -> list[Item]:
    """The conv's and silu's items: the conv's padded output b x C x (s + K - 1) x e
    (``mamba.conv_out``, 2 K C FLOPs a token; freed once silu has read its slice, so kept it
    adds to the mixer's working set) and silu's T x C x e (``mamba.act``, C), its key
    ``act_width`` wide (5.3: C, of (b, s, C); 5.23's ``causal_conv1d_fn``: s, of (b, C, s));
    ``act_freed``: silu's output freed once cast (5.23 under autocast where x is fp32, Falcon-H1's
    ``mup_vector`` product: ``.to(x.dtype)``), so kept it adds to the mixer's working set (traced:
    Falcon-H1's toy on 5.23, amp-bf16, 2 x 256 tokens keeping it alone: one T C bf16 under the
    forward's peak before)."""
    return [Item("mamba.conv_out", ("mamba.conv_out",), terms["mamba.conv_out"],
                 2.0 * z.taps * z.conv, CONV, z.conv, 0, block, True),
            Item("mamba.act", (), z.tokens * z.conv * e, float(z.conv), ACTIVATION, act_width,
                 0, block, act_freed)]


def _einsum_conv(z: Sizes, terms: dict[str, int], e: int, pure: bool, cast: bool,
                 upcast: bool, block: str = _BLOCK) -> list[Item]:
    """5.23's ops from A's cast to silu's (module docstring): A_log's fp32 copy (16-bit
    weights); under autocast ``x.to(weight.dtype)`` where x is below fp32 (``upcast``) and
    autocast's casts of the conv's bias, weight and input; the conv (``mamba.conv_out``);
    silu of (b, C, s) (``mamba.act``, s wide); under autocast where x is fp32 (Falcon-H1's
    ``mup_vector`` product) silu's output cast back to it."""
    conv = [_unkept(COPY, w, block) for w in (z.s,) * upcast + (z.conv, z.taps, z.s)] * cast
    return ([_unkept(COPY, z.h, block)] * pure + conv
            + conv_act(z, terms, e, z.s, block, act_freed=cast and not upcast)
            + [_unkept(COPY, z.s, block)] * (cast and not upcast))


def mamba_items(spec: ModelSpec, wl: Workload, dm: Dims, terms: dict[str, int]) -> list[Item]:
    """The mixer's ops in execution order, on one rank (W = 2 d + 2 G n + H in_proj's
    output, C = d + 2 G n the conv's channels, K taps, T tokens, e the compute dtype's
    bytes): in_proj's output T x W x e (2 h W FLOPs a token), the conv's b x C x (s + K - 1)
    x e (2 K C), silu's T x C x e (C), the scan's and the gated norm's ops (unkept),
    out_proj's input T x d x e (d) and output T x h x e (2 d h; a row-parallel output is the
    full partial sum on each rank). On transformers 5.23's einsum scan (module docstring)
    other ops run between the same items, the gated norm's ``* rsqrt`` is d / G wide, and
    under autocast no one saves in_proj's output (``mamba_einsum.scan_terms``: kept, its own
    bytes) and out_proj casts its input and weight."""
    assert spec.mamba is not None
    z = sizes(spec.mamba, dm)
    h, t, e = spec.hidden_size, dm.tokens, dm.e
    low = e < FP32_BYTES
    pure = low and not dm.autocast
    if wl.mamba_kernel is MambaKernel.TORCH_EINSUM:
        proj = () if dm.autocast else ("mamba.in_proj_out",)
        size = t * z.width * e
        mixer = (_einsum_conv(z, terms, e, pure, dm.autocast, low)
                 + _einsum_scan_ops(z, low, dm.autocast)
                 + _norm_and_out(z.d, low, pure, terms["mamba.out"], z.d // z.g, 2))
    else:
        proj, size = ("mamba.in_proj_out",), terms["mamba.in_proj_out"]
        mixer = (conv_act(z, terms, e, z.conv) + _scan_ops(z.p, z.n, z.h, low, pure)
                 + _norm_and_out(z.d, low, pure, terms["mamba.out"]))
    return ([Item("mamba.in_proj", proj, size, 2.0 * h * z.width, MATMUL, z.width, 0, _BLOCK,
                  False)] + mixer
            + [Item("mamba.out_proj", (), t * h * e, 2.0 * z.d * h, MATMUL, h, 0, _BLOCK,
                    False)])


def mamba_layer_ops(spec: ModelSpec, wl: Workload, dm: Dims, saved: tuple[Term, ...],
                    attention_ops: tuple[Item, ...]) -> tuple[Item, ...]:
    """A Mamba2 layer's ops a policy counts, in execution order (``sac_ops.layer_ops``' for
    an attention layer): the input norm's, the mixer's (``mamba_items``), the MLP norm's,
    then the MLP's, the attention layers' own (``attention_ops``: GraniteMoeHybridDecoderLayer
    runs the same shared MLP after either mixer; in an MoE layer none: the block's items
    follow, ``memplan.model.layer.ops_items``). ``saved``: what the layer saves without
    recompute."""
    terms = {t.name: t.size_bytes for t in saved}
    h = spec.hidden_size
    named = _norms_nameable(spec, wl, dm, terms, qk_norms=False)
    fp32 = _fp32_ops(spec, wl, dm)
    out = _norm_ops("attn_norm", terms, h, h, named, fp32_ops=fp32)
    out += mamba_items(spec, wl, dm, terms)
    out += _norm_ops("mlp_norm", terms, h, h, named, fp32_ops=fp32)
    out += [i for i in attention_ops if i.block == "mlp"]
    return numbered(out)


def scan_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """The forward FLOPs of one token through the chunked scan, which the rerun spends
    whatever a list keeps (no item keeps the scan: its saved tensors are the backward's):
    ``memplan.model.mamba.Mamba.core_flops_per_token``."""
    return Mamba().core_flops_per_token(spec, seq_len)
