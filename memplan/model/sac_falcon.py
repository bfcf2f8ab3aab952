"""Op-level checkpointing (``memplan.model.sac_ops``) of Falcon-H1's parallel layers: the ops
a policy counts in transformers 5.3's FalconH1DecoderLayer.forward with the mixer's
FalconH1Mixer.torch_forward (``mamba_kernel torch``; the block ``memplan.model.falcon_h1``
models), in execution order with their families and output widths as the emitted policy's
``_key`` sees them (traced on a FalconH1ForCausalLM toy: tests/traced/test_sac_policy.py)::

    x = input_layernorm(residual)                 # the attention layers' norm ops
    x * ssm_in_multiplier                         # scale, h: attn_norm.output (in_proj's input)
    in_proj(...)                                  # mm, W: mamba.in_proj (freed at once)
    projected_states * mup_vector                 # mul, W: mamba.in_proj_out
    conv1d, silu, the chunked scan                # Granite 4.0-H's (memplan.model.sac_mamba)
    y * silu(gate)                                # (mamba_rms_norm false) act d, mul d (fp32)
    norm(y, gate)                                 # (mamba_rms_norm) FalconH1RMSNormGated:
        gate.to(float32) (copy d, bf16 weights), silu d, y * silu d; + eps (shift 1),
        rsqrt 1, * rsqrt d / G, weight * d / G: the norm first with mamba_norm_before_gate
        (``MambaSpec.norm_before_gate``), then the gate's ops and a product d
    out_proj(scan_output.to(dtype))               # copy d (below fp32): mamba.out; mm h
    m = ... * ssm_out_multiplier                  # scale, h
    q_proj(x * attention_in_multiplier)           # scale, h: attn.input_copy; mm
    k_proj(...) * key_multiplier                  # mm; scale, head_dim (before RoPE)
    v_proj, RoPE, SDPA, o_proj                    # the attention layers' ops
    a = ... * attention_out_multiplier            # scale, h
    pre_ff_layernorm                              # the attention layers' norm ops
    up_proj(x) * act(gate_proj(x) * gate_mult)    # mm f (up first), mm f, scale f, act, mul
    down_proj(y) * down_multiplier                # mm h (never rerun), scale h

Every multiplier is a product by a Python number (``aten.mul.Tensor`` of a tensor and a
scalar: the policy's ``scale``), an op of its own whatever its value. Autograd saves none of
their inputs, so a projection whose output a multiplier reads frees it: in_proj's, the gate's,
k's and the output projections' are transients, kept they add to the working set
(``own_extra``); the ``mup_vector`` product (what the conv, the gate and dt view), the
ssm_in and attention_in copies (what in_proj and q/k/v save) and the gate's scaled copy (what
silu saves) are the saved terms, each an item named after its term. Under autocast the two
input copies are fp32 and saved by no one (each linear saves its own cast): no items there.
The mixer's items are block "mamba" (its working-set moments run before the attention's:
``memplan.model.layer._ops_forward``), the group ``mamba`` names them. The gated norm's ops
(``_gate_ops``; y is fp32, so its ``.to(float32)`` and ``.to(input_dtype)`` are no ops; pow
and mean are no ops a policy counts) are counted, never kept, as Granite 4.0-H's
(``memplan.model.sac_mamba``): the backward needs their saved tensors, rebuilt whatever is
kept; in fp32 the last product is out_proj's input, the item ``mamba.out`` (d / G wide after
the norm's weight, d after the gate's product).
"""

from __future__ import annotations

from memplan.model.dims import Dims, Term
from memplan.model.mamba import Sizes, sizes
from memplan.model.sac_mamba import _einsum_conv, _einsum_scan_ops, _scan_ops, conv_act
from memplan.model.sac_ops import (ACTIVATION, COPY, MATMUL, NORM, PRODUCT, RSQRT, SCALE,
                                   SHIFT, Item, _unkept, numbered)
from memplan.spec import ModelSpec
from memplan.units import FP32_BYTES
from memplan.workload import MambaKernel, Workload

BLOCK = "mamba"


def _gate_ops(z: Sizes, before: bool, low: bool, pure: bool, out: Item) -> list[Item]:
    """The gate's ops and out_proj's input (module docstring): ``y * silu(gate)``, or
    FalconH1RMSNormGated's (``before``: normalising first, norm_before_gate), whose norm
    views y in G groups of d / G (``Sizes.norm_rows`` on this rank): ``+ eps`` and rsqrt 1
    wide, ``* rsqrt`` and the weight's product d / G; its ``gate.to(float32)`` a copy d where
    the gate is 16-bit (bf16 weights; under autocast the fp32 ``mup_vector`` product). Below
    fp32 the last product, then the item ``mamba.out`` (``.to(dtype)``; under autocast
    autocast's cast, counted, no item); in fp32 the last product is the item."""
    d, w = z.d, z.d // z.norm_rows
    gate = [_unkept(COPY, d, BLOCK)] if pure and z.gated else []
    gate.append(_unkept(ACTIVATION, d, BLOCK))
    norm = [_unkept(SHIFT, 1, BLOCK), _unkept(RSQRT, 1, BLOCK), _unkept(PRODUCT, w, BLOCK)]
    if not z.gated:
        ops, last = gate, d
    elif before:
        ops, last = norm + [_unkept(PRODUCT, w, BLOCK)] + gate, d
    else:
        ops, last = gate + [_unkept(PRODUCT, d, BLOCK)] + norm, w
    if not low:
        return ops + [out._replace(width=last)]
    return ops + [_unkept(PRODUCT, last, BLOCK), out if pure else _unkept(COPY, d, BLOCK)]


def _mixer_ops(spec: ModelSpec, dm: Dims, terms: dict[str, int], einsum: bool) -> list[Item]:
    """torch_forward's ops after the ssm_in copy (module docstring), on one rank: in_proj's
    output T x W x e (2 h W FLOPs a token), its ``mup_vector`` product (the ``in_proj_out``
    term; W), the conv's and silu's (``sac_mamba.mamba_items``), the scan's, the gate's
    (``_gate_ops``), out_proj's input T x d x e (below fp32 the cast, else the product;
    under autocast autocast's cast, no item; d) and output T x h x e (2 d h). ``einsum``:
    transformers 5.23's forward (``mamba_kernel`` torch-einsum), whose conv, silu and scan
    run other ops between the same items (``sac_mamba._einsum_conv``, ``_einsum_scan_ops``)."""
    assert spec.mamba is not None
    z = sizes(spec.mamba, dm)
    h, t, e = spec.hidden_size, dm.tokens, dm.e
    low = e < FP32_BYTES
    pure = low and not dm.autocast
    out = Item("mamba.out", ("mamba.out",), terms["mamba.out"], float(z.d),
               COPY if low else PRODUCT, z.d, 0, BLOCK, False)
    projected = [Item("mamba.in_proj", (), t * z.width * e, 2.0 * h * z.width, MATMUL,
                      z.width, 0, BLOCK, True),
                 Item("mamba.mup", ("mamba.in_proj_out",), terms["mamba.in_proj_out"],
                      float(z.width), PRODUCT, z.width, 0, BLOCK, False)]
    if einsum:  # transformers 5.23 (``sac_mamba.mamba_items``): x below fp32 unless the
        # mup_vector product made it fp32 (under autocast)
        scan = (_einsum_conv(z, terms, e, pure, dm.autocast, low and not z.mup_e, BLOCK)
                + _einsum_scan_ops(z, low and not z.mup_e, dm.autocast, BLOCK))
    else:
        scan = conv_act(z, terms, e, z.conv, BLOCK) + _scan_ops(z.p, z.n, z.h, low, pure)
    return projected + scan + _gate_ops(z, spec.mamba.norm_before_gate, low, pure, out) + [
        Item("mamba.out_proj", (), t * h * e, 2.0 * z.d * h, MATMUL, h, 0, BLOCK, False)]


def _copy(name: str, term: str, block: str, terms: dict[str, int], h: int, dm: Dims) -> Item:
    """A multiplier's copy of the norm's output that a linear saves (its term), an item; under
    autocast an fp32 local no one saves (the linears save their casts): counted, no item."""
    if dm.autocast:
        return _unkept(SCALE, h, block)
    return Item(name, (term,), terms[term], float(h), SCALE, h, 0, block, False)


def _mlp_ops(spec: ModelSpec, terms: dict[str, int], generic: list[Item]) -> list[Item]:
    """FalconH1MLP.forward's ops: ``up_proj(x)`` first, then ``gate_proj(x)`` (a transient:
    its scaled copy is what silu saves, ``mlp.gate``), the scale, silu, the product, the down
    projection (never rerun) and its scale."""
    mm = {i.name: i for i in generic}
    f, h = mm["mlp.gate"].width, spec.hidden_size
    gate = mm["mlp.gate"]._replace(name="mlp.gate_proj", terms=(), own_extra=True)
    scaled = Item("mlp.gate_scaled", ("mlp.gate",), terms["mlp.gate"], float(f), SCALE, f, 0,
                  "mlp", False)
    down = [i for i in generic if i.block == "mlp" and not i.name]
    return ([mm["mlp.up"], gate, scaled, mm["mlp.act"], mm["mlp.prod"]] + down
            + [_unkept(SCALE, h, "mlp")])


def _attention_ops(spec: ModelSpec, generic: list[Item]) -> list[Item]:
    """The attention's ops with k_proj's ``* key_multiplier`` before RoPE (FalconH1Attention.
    forward), which frees k's projection output, and ``* attention_out_multiplier`` after
    o_proj, which frees its."""
    out = []
    for i in generic:
        if i.name == "attn.k":
            i = i._replace(own_extra=True)
        out.append(i)
        if i.name == "attn.k":
            out.append(_unkept(SCALE, spec.head_dim, "attn"))
    return out + [_unkept(SCALE, spec.hidden_size, "attn")]


def _norm_product(i: Item) -> Item:
    """The input norm's ``weight * normed`` (a named norm's ``output`` item elsewhere): a
    local here, read by the two multipliers alone; counted, no item."""
    return _unkept(i.op, i.width, i.block) if i.name == "attn_norm.output" else i


def falcon_layer_ops(spec: ModelSpec, wl: Workload, dm: Dims, saved: tuple[Term, ...],
                     generic: tuple[Item, ...]) -> tuple[Item, ...]:
    """A Falcon-H1 layer's ops a policy counts, in execution order (the module docstring),
    composed from ``generic`` (``sac_ops.layer_ops``' for the same spec: its norms', its
    attention's and its MLP's). ``saved``: what the layer saves without recompute."""
    terms = {t.name: t.size_bytes for t in saved}
    h = spec.hidden_size
    out = [i for i in generic if i.block == "attn_norm"]
    if not dm.autocast:  # the ssm_in copy is the norm's output term (its item: ``_copy``)
        out = [_norm_product(i) for i in out if i.name != "attn_norm.output" or i.op != NORM]
    ssm_in = _copy("attn_norm.output", "attn_norm.output", "attn_norm", terms, h, dm)
    einsum = wl.mamba_kernel is MambaKernel.TORCH_EINSUM
    if einsum and ssm_in.name:
        # 5.23's FalconH1Mixer.forward rebinds ``hidden_states`` (the ssm_in copy) at the
        # split: freed before the scan, so kept it adds to the mixer's working set, whose op
        # it is (5.3's torch_forward holds ``input_states`` to its end; traced on 5.23, bf16,
        # 2 x 256 tokens keeping it alone: one T h bf16 under the forward's peak before)
        ssm_in = ssm_in._replace(block=BLOCK, own_extra=True)
    out += [ssm_in]
    out += _mixer_ops(spec, dm, terms, einsum)
    out += [_unkept(SCALE, h, BLOCK)]
    out += [_copy("attn.input_copy", "attn.input_copy", "attn", terms, h, dm)]
    out += _attention_ops(spec, [i for i in generic if i.block == "attn"])
    out += [i for i in generic if i.block == "mlp_norm"]
    out += _mlp_ops(spec, terms, [i for i in generic if i.block == "mlp"])
    return numbered(out)
