"""Falcon-H1 (memplan.hf.families_more.falcon_h1, memplan.model.falcon_h1): the count of the
held-out config and of the catalog's entries by hand, the reader's refusals, and the layer's
own saved tensors by hand, the gated norm's among them (the Mamba2 mixer's scan is Granite
4.0-H's, tests/unit/test_mamba.py). The traces against transformers 5.3 and 5.23:
tests/traced/test_hf_heldout.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.model.dims import Dims, total
from memplan.model.falcon_h1 import ParallelMamba, mup_buffer_bytes
from memplan.model.layer import kv_cache_bytes, layer_blocks, layer_terms
from memplan.model.mamba import Mamba, mamba_cache_bytes, mamba_terms
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, spec_from_hf_dict
from memplan.workload import MambaKernel, Recompute, Workload

CONFIG = json.loads((Path(__file__).parent.parent / "data" / "hf" / "heldout" /
                     "Falcon-H1-1.5B-Instruct" / "config.json").read_text())


def test_count_by_hand() -> None:
    """The held-out config: h = 1,024, 36 layers, V = 32,784 untied, 8 heads / 2 KV heads of
    64, intermediate 2,048, no biases (FalconH1Config forces attention_bias and mlp_bias
    false; mamba_proj_bias and projectors_bias false); the mixer d = mamba_d_ssm = 1,536 (24
    heads of 64), state 256, 1 group, conv 4 with bias, no gated norm (mamba_rms_norm false):

    embedding and lm_head  2 * 32,784 * 1,024                         =  67,141,632
    attention              1,024 * 512 * 2 + 1,024 * 128 * 2          =   1,310,720
    MLP                    3 * 1,024 * 2,048                          =   6,291,456
    mixer, conv channels 1,536 + 2 * 256 = 2,048:
      conv1d               2,048 * 4 + 2,048                          =      10,240
      in_proj              1,024 * (1,536 + 2,048 + 24)               =   3,694,592
      dt_bias, A_log, D    3 * 24                                     =          72
      out_proj             1,536 * 1,024                              =   1,572,864
    two norms              2 * 1,024                                  =       2,048
    a layer                                                           =  12,881,992
    36 layers                                                         = 463,751,712
    final norm             1,024                                      =       1,024
    total                                                             = 530,894,368

    (transformers 5.3 builds the same on the meta device: tests/traced/test_hf_heldout.py)."""
    spec = spec_from_hf_dict(CONFIG, "config.json", "falcon-h1")
    assert spec.approximate is None and spec.num_params == 530_894_368
    m = spec.mamba
    assert m is not None and m.parallel_attention and not m.gated_norm
    assert (m.inner, m.conv_dim, m.width) == (1536, 2048, 3608)
    assert not any(spec.is_linear_layer(i) for i in range(36))
    # use_cache as the config says: the cache follows the mixer's kernel (5.3 makes none)
    assert spec.use_cache and not spec.qkv_bias and not spec.mlp_bias


def test_catalog_counts_by_hand() -> None:
    """The catalog's entries (their held-out config.json files: Megatron-Bridge's provider
    values, tests/data/hf/heldout/README.md), untied, no biases but conv1d's, C = d + 2 G n
    the conv's channels, the gated norm's weight (d) where mamba_rms_norm:

    falcon-h1-7b: h = 3,072, 44 layers, V = 130,049, 12 heads / 2 KV heads of 128, MLP
    12,288, d = 3,072 (24 heads of 128), n = 256, G = 1 (C = 3,584), gated norm:

    embedding and lm_head  2 * 130,049 * 3,072                        =   799,021,056
    attention              2 * 3,072 * 1,536 + 2 * 3,072 * 256        =    11,010,048
    MLP                    3 * 3,072 * 12,288                         =   113,246,208
    conv1d                 3,584 * 4 + 3,584                          =        17,920
    in_proj                3,072 * (3,072 + 3,584 + 24)               =    20,520,960
    dt_bias, A_log, D      3 * 24                                     =            72
    gated norm             3,072                                      =         3,072
    out_proj               3,072 * 3,072                              =     9,437,184
    two norms              2 * 3,072                                  =         6,144
    a layer                                                           =   154,241,608
    44 layers and the final norm (3,072)                              = 6,786,633,824
    total                                                             = 7,585,654,880

    falcon-h1-0.5b (h 1,024, 36 layers, V 32,784, 8 / 2 heads of 64, MLP 2,048, d 1,536 in
    24 heads, n 128, C 1,792, no gated norm): 67,141,632 + 36 * 12,618,568 + 1,024 =
    521,411,104; falcon-h1-1.5b-deep (h 1,280, 66 layers, V 65,537, 6 / 2 heads of 128, MLP
    3,072, d 1,536, n 256, C 2,048, gated): 167,774,720 + 66 * 21,016,648 + 1,280 =
    1,554,874,768; falcon-h1-34b (h 5,120, 72 layers, V 261,120, 20 / 4 heads of 128, MLP
    21,504, d 4,096 in 32 heads, n 256, G 2, C 5,120, gated): 2,673,868,800 + 72 *
    430,120,032 + 5,120 = 33,642,516,224. (transformers builds the same: test_hf_heldout.py.)"""
    from memplan.spec import load_model

    counts = {"falcon-h1-0.5b": 521_411_104, "falcon-h1-1.5b-deep": 1_554_874_768,
              "falcon-h1-7b": 7_585_654_880, "falcon-h1-34b": 33_642_516_224}
    for name, count in counts.items():
        spec = load_model(name)
        assert spec.num_params == count, name
        assert spec.mamba is not None and spec.mamba.parallel_attention
        assert spec.mamba.gated_norm == (name != "falcon-h1-0.5b")


def test_refusals_in_one_line() -> None:
    for change in ({"mamba_d_head": 48},):
        with pytest.raises(MemplanError) as err:
            spec_from_hf_dict({**CONFIG, **change}, "config.json", "m")
        assert "\n" not in str(err.value) and next(iter(change)) in str(err.value)


def test_gated_norm_by_hand() -> None:
    """The traced ``falcon_h1-rms`` toy (the toy's mixer in 2 groups, mamba_rms_norm true):
    d = 256, G = 2, T = 128. FalconH1RMSNormGated (5.3 and 5.23 alike) saves, in fp32
    whatever the compute dtype (the scan's y is fp32), the gate's silu output, the gated
    product (or, before the gate, the normed product), its rsqrt per group and the normed
    tensor the weight multiplies: (3 d + G) T 4 = 770 * 512 = 394,240 (Granite 4.0-H's on 5.3
    one rsqrt per row: (3 d + 1) T 4); below fp32 the gate's fp32 copy (T d 4 = 131,072), but
    not under autocast, where the gate is a view of in_proj's fp32 ``mup_vector`` product.
    Without the norm the product saves silu's output alone (T d e). The weight (d) sits
    between in_proj and out_proj in named_parameters."""
    spec = _toy()
    rms = spec_from_hf_dict({**CONFIG, **_TOY_FIELDS, "mamba_n_groups": 2,
                             "mamba_rms_norm": True}, "config.json", "toy")
    plain = spec_from_hf_dict({**CONFIG, **_TOY_FIELDS, "mamba_n_groups": 2},
                              "config.json", "toy")
    assert rms.mamba is not None and rms.mamba.gated_norm and not spec.mamba.gated_norm
    assert rms.num_params - plain.num_params == 2 * 256
    for kernel in MambaKernel:
        for precision, norm, copy, without in (("fp32", 394_240, 0, 131_072),
                                               ("bf16-pure", 394_240, 131_072, 65_536),
                                               ("amp-bf16", 394_240, 0, 131_072)):
            _, dm = _dims(rms, precision, kernel)
            terms = {t.name: t.size_bytes for t in mamba_terms(rms, dm, kernel)}
            assert (terms["mamba.norm"], terms["mamba.gate_fp32"]) == (norm, copy), precision
            bare = {t.name: t.size_bytes for t in mamba_terms(plain, dm, kernel)}
            assert (bare["mamba.norm"], bare["mamba.gate_fp32"]) == (without, 0)
            assert total(mamba_terms(rms, dm, kernel)) \
                - total(mamba_terms(plain, dm, kernel)) == norm + copy - without
    block = layer_blocks(rms, False)[1]
    shapes = block.tensor_sizes(rms, 1, 1)
    assert shapes[5:8] == [128 * 644, 256, 256 * 128]  # in_proj, the norm, out_proj


_TOY_FIELDS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
               "num_hidden_layers": 2, "mamba_n_heads": 4, "mamba_d_head": 64,
               "mamba_d_ssm": 256, "mamba_d_state": 32, "mamba_chunk_size": 48}


def _toy() -> ModelSpec:
    """The traced toy (tests/traced/test_hf_heldout.py ``falcon_h1``): h = 128, 2 layers,
    attention 4 heads / 2 KV heads of 32, MLP 256, the mixer 4 heads of 64 (d = 256), state
    32, chunks of 48."""
    return spec_from_hf_dict({**CONFIG, **_TOY_FIELDS}, "config.json", "toy")


def _dims(spec: ModelSpec, precision: str,
          kernel: MambaKernel = MambaKernel.TORCH) -> tuple[Workload, Dims]:
    wl = Workload(micro_batch_size=2, seq_len=64, precision=precision, mamba_kernel=kernel)
    return wl, Dims.of(spec, ParallelConfig(), wl)


def test_layer_saved_bytes_by_hand() -> None:
    """The toy at b = 2, s = 64 (T = 128), in fp32 (e = 4), on transformers 5.3's naive scan
    (``mamba_kernel`` torch): what differs from Granite 4.0-H's mixer of the same widths (d = 256, C = 256 + 64 = 320 channels, in_proj's width W = 256
    + 320 + 4 = 580) and from Llama's attention sub-layer:

    attn_norm.output     in_proj's input, the norm output's ssm_in copy: T h e  =  65,536
    attn.input_copy      q/k/v's input, the attention_in copy: T h e            =  65,536
    mamba.norm           silu(gate), y * silu(gate)'s other input: T d e        = 131,072
                         (Granite's gated norm: (3 d + 1) T 4 = 393,728)
    mamba.gate_fp32      none (no norm upcasts the gate)                        =       0

    The whole layer saves 4,011,346 B (traced: saved activations exact, test_hf_heldout.py).
    In bf16 (e = 2) the copies are 32,768 each and silu's output 65,536 (no fp32 gate copy,
    Granite's T d 4 = 131,072). Under autocast the fp32 mup_vector makes in_proj's scaled
    output fp32 (T W 4 = 296,960), and the gate and dt with it (silu's output T d 4 =
    131,072; dt 3 T H 4 = 6,144), conv1d saves its cast of the channels (T C 2 = 81,920), and
    q, k and v each their own cast of the attention's copy (3 T h 2 = 98,304)."""
    spec = _toy()
    wl, dm = _dims(spec, "fp32")
    blocks = layer_blocks(spec, False)
    assert [b.name for b in blocks] == ["attn_norm", "attn", "mlp_norm", "mlp"]
    assert isinstance(blocks[1], ParallelMamba)
    terms = {t.name: t.size_bytes for t in layer_terms(spec, wl, dm, moe_layer=False,
                                                        recompute=Recompute.NONE)}
    assert (terms["attn_norm.output"], terms["attn.input_copy"]) == (65_536, 65_536)
    assert (terms["mamba.norm"], terms["mamba.gate_fp32"]) == (131_072, 0)
    assert sum(terms.values()) == 4_011_346
    wl, dm = _dims(spec, "bf16-pure")
    terms = {t.name: t.size_bytes for t in layer_terms(spec, wl, dm, moe_layer=False,
                                                        recompute=Recompute.NONE)}
    assert (terms["attn.input_copy"], terms["mamba.norm"], terms["mamba.gate_fp32"]) == (
        32_768, 65_536, 0)
    wl, dm = _dims(spec, "amp-bf16")
    mixer = {t.name: t.size_bytes for t in mamba_terms(spec, dm, MambaKernel.TORCH)}
    assert (mixer["mamba.in_proj_out"], mixer["mamba.conv_in_cast"], mixer["mamba.dt"],
            mixer["mamba.norm"]) == (296_960, 81_920, 6_144, 131_072)
    copy = next(t for t in blocks[1].saved(spec, wl, dm, Recompute.NONE)
                if t.name == "attn.input_copy")
    assert copy.size_bytes == 98_304


def test_einsum_mixer_by_hand() -> None:
    """The toy on transformers 5.23's einsum scan (``mamba_kernel`` torch-einsum, the
    default): Granite 4.0-H's einsum terms (memplan.model.mamba_einsum) with Falcon-H1's
    parts. Tp = 192 padded tokens, H = 4, n = 32, N = 2 chunks, fp32:

    mamba.x_pad          the padded x D multiplies: Tp d 4                  = 196,608
    mamba.x_dt           Y_diag's and the states' copies of x * dt: 2 Tp d 4 = 393,216
    mamba.bc             five B/C tensors: 5 Tp H n 4                       = 491,520
    mamba.states         b (N + 1) d n 4 + b N d n 4 = 196,608 + 131,072    = 327,680
                         (the naive scan: x_chunks 393,216, bc 294,912, states 393,216)
    mamba.norm           silu(gate): T d 4 (no gated norm, no fp32 gate copy) = 131,072
    mamba.in_proj_out    the mup_vector product, in_proj's output's size: T W 4 = 296,960

    A layer saves 4,011,346 + 196,608 + 196,608 - 65,536 = 4,339,026 B: the two layers
    655,360 B more than on 5.3, as traced (9,155,756 against 8,500,396 B). In bf16 no fp32
    gate copy (Granite's T d 4 = 131,072), silu's output T d 2 = 65,536, dt 2 T H 2 + 2 T H 4
    = 6,144. The cache a use_cache forward makes (5.23 only): the conv state b C K 4 = 10,240
    and the final state b d n 4 = 65,536 a layer (fp32); none on the naive kernel (5.3)."""
    spec = _toy()
    wl, dm = _dims(spec, "fp32", MambaKernel.TORCH_EINSUM)
    terms = {t.name: t.size_bytes for t in layer_terms(spec, wl, dm, moe_layer=False,
                                                        recompute=Recompute.NONE)}
    assert (terms["mamba.x_pad"], terms["mamba.x_dt"], terms["mamba.bc"],
            terms["mamba.states"]) == (196_608, 393_216, 491_520, 327_680)
    assert (terms["mamba.norm"], terms["mamba.gate_fp32"], terms["mamba.in_proj_out"]) == (
        131_072, 0, 296_960)
    assert sum(terms.values()) == 4_339_026
    _, dm16 = _dims(spec, "bf16-pure", MambaKernel.TORCH_EINSUM)
    mixer = {t.name: t.size_bytes for t in mamba_terms(spec, dm16, MambaKernel.TORCH_EINSUM)}
    assert (mixer["mamba.gate_fp32"], mixer["mamba.norm"], mixer["mamba.dt"]) == (
        0, 65_536, 6_144)
    cached = wl.model_copy(update={"kv_cache": True})
    assert kv_cache_bytes(spec, cached, dm, Recompute.NONE) == 10_240 + 65_536
    naive = cached.model_copy(update={"mamba_kernel": MambaKernel.TORCH})
    assert kv_cache_bytes(spec, naive, dm, Recompute.NONE) == 0


def test_einsum_mixer_under_autocast_by_hand() -> None:
    """The toy on transformers 5.23's einsum scan under amp-bf16: Granite 4.0-H's autocast
    terms (tests/unit/test_mamba_einsum.py ``test_autocast_terms_by_hand``, the same widths:
    the einsums' copies and products in bf16, L fp32, M's cast, decay_chunk's cast), with
    Falcon-H1's fp32 ``mup_vector`` product in in_proj's output's place (T W 4 = 296,960,
    which the gate saves) and conv1d's casts of its fp32 input and of its weight ((T + K) C 2
    = 84,480); causal_conv1d_fn's ``out.to(hidden_states.dtype)`` copies silu's bf16 output
    to fp32 (T C 4 = 163,840, which x views, not Granite's T d 4 copy). The cache: the conv
    state in the product's dtype, b C K 4 = 10,240, the final state in bf16, b d n 2 =
    32,768. Traced: the two layers' saved activations exact, every phase within 0.06%
    (test_hf_heldout.py ``falcon_h1`` amp-bf16)."""
    spec = _toy()
    wl, dm = _dims(spec, "amp-bf16", MambaKernel.TORCH_EINSUM)
    mixer = {t.name: t.size_bytes for t in mamba_terms(spec, dm, MambaKernel.TORCH_EINSUM)}
    assert (mixer["mamba.in_proj_out"], mixer["mamba.conv_casts"], mixer["mamba.x_fp32"]) == (
        296_960, 84_480, 163_840)
    assert (mixer["mamba.chunk_mats"], mixer["mamba.bc"], mixer["mamba.x_dt"],
            mixer["mamba.states"], mixer["mamba.y_off"]) == (
        294_912, 294_912, 196_608, 163_840, 98_304)
    assert mamba_cache_bytes(spec, wl, dm) == 10_240 + 32_768


def test_einsum_gate_moments_by_hand() -> None:
    """y * silu(gate) on the einsum path (T d = 32,768 elements): in bf16 the forward holds
    the fp32 product (T d 4 = 131,072) beside silu's bf16 output of the conv (T C 2 =
    81,920), its cast (what out_proj saves) not yet made; its backward the product's fp32
    gradient, y's and silu's output's (3 T d 4 = 393,216) and the latter's cast to bf16
    (T d 2 = 65,536). In fp32 the product is out_proj's input itself: 3 T d 4 in backward."""
    spec = _toy()
    block = layer_blocks(spec, False)[1]
    for precision, fwd, bwd in (("bf16-pure", 131_072 + 81_920, 393_216 + 65_536),
                                ("fp32", 0, 393_216)):
        wl, dm = _dims(spec, precision, MambaKernel.TORCH_EINSUM)
        saved = total(mamba_terms(spec, dm, MambaKernel.TORCH_EINSUM))
        x = 128 * 128 * dm.stream_e  # the norm's output, the layer's local
        norm = next(m for m in block.forward_moments(spec, wl, dm, Recompute.NONE)
                    if m.name == "mamba.norm")
        assert norm.own_bytes == saved - (65_536 if precision == "bf16-pure" else 0)
        assert norm.transient_bytes == fwd + x
        back = next(m for m in block.backward_moments(spec, wl, dm, Recompute.NONE)
                    if m.name == "mamba.norm")
        stream = 128 * 128 * dm.e  # the norm-output gradient the attention made
        assert back.transient_bytes == bwd + stream


def test_weight_casts_under_autocast_by_hand() -> None:
    """autocast's cache of the toy's mixer block under amp-bf16 (e = 2): in_proj 128 x 580 =
    74,240 elements, the conv's bias 320, out_proj 256 x 128 = 32,768; the conv's weight
    (320 x 4 = 1,280) on 5.3 only, whose torch_forward calls the ``conv1d`` module (a leaf,
    cached), not on 5.23, whose causal_conv1d_fn casts a view of it, which the cache skips;
    never dt_bias, A_log or D (fp32 ops). The attention's q, k, v, o: 16,384 + 2 x 8,192 +
    16,384 = 49,152. So 5.23: (74,240 + 320 + 32,768 + 49,152) x 2 = 312,960 B, 5.3 2,560
    more (both the traced layer's casts: test_hf_heldout.py, a snapshot of the tensors alive
    at the forward's peak). In a checkpointed layer at the mixer's scan only in_proj's and
    the conv's are made ((74,240 + 320) x 2 = 149,120 on 5.23, 151,680 on 5.3), at the
    attention's moments all but o_proj's (312,960 - 32,768 = 280,192 on 5.23), at the sum
    all; the scan beside the norm output's ``ssm_in_multiplier`` copy on 5.3 only, in fp32
    under autocast (T h 4 = 65,536), which 5.23's forward rebinds before the scan."""
    from memplan.model.layer import cast_cache_bytes

    spec = _toy()
    block = layer_blocks(spec, False)[1]
    for kernel, conv_weight in ((MambaKernel.TORCH_EINSUM, 0), (MambaKernel.TORCH, 2_560)):
        wl, dm = _dims(spec, "amp-bf16", kernel)
        assert cast_cache_bytes(spec, wl, dm, block, Recompute.FULL) == 312_960 + conv_weight
        scans = len(block.working_set(spec, wl, dm)) - 3
        assert block.working_casts(spec, wl, dm) == (
            [149_120 + conv_weight] * scans + [280_192 + conv_weight] * 2
            + [312_960 + conv_weight])
        copy = 65_536 if kernel is MambaKernel.TORCH else 0
        fp32 = _dims(spec, "fp32", kernel)
        assert block.working_casts(spec, *fp32) == [0] * len(block.working_set(spec, *fp32))
        mixer = Mamba().working_set(spec, wl, dm)
        assert [m.transient_bytes for m in block.working_set(spec, wl, dm)[:scans]] == [
            m.transient_bytes + copy for m in mixer]


def test_kernel_and_buffers() -> None:
    """The mixer runs the scan ``mamba_kernel`` says (5.3's naive one, 5.23's einsums);
    the mup_vector buffers are 2 layers x W elements in the weights' dtype (2 x 580 x 4 =
    4,640 B in fp32: the traced buffers less RoPE's 128 B)."""
    spec = _toy()
    wl, dm = _dims(spec, "fp32")
    assert total(layer_terms(spec, wl, dm, moe_layer=False, recompute=Recompute.NONE)) \
        == 4_011_346
    einsum = wl.model_copy(update={"mamba_kernel": MambaKernel.TORCH_EINSUM})
    assert total(layer_terms(spec, einsum, dm, moe_layer=False, recompute=Recompute.NONE)) \
        == 4_339_026
    assert mup_buffer_bytes(spec, wl, 2) == 4_640
    assert mup_buffer_bytes(spec, _dims(spec, "bf16-pure")[0], 2) == 2_320


def test_parameter_tensors_and_groups() -> None:
    """The block's tensors: the mixer's (dt_bias, A_log, D; conv weight and bias; in_proj;
    out_proj: no norm weight) then the attention's; its gradient groups cumulative in
    backward order: o_proj, the attention, out_proj, all."""
    spec = _toy()
    block = layer_blocks(spec, False)[1]
    assert block.tensor_sizes(spec, 1, 1) == [4, 4, 4, 320 * 4, 320, 128 * 580, 256 * 128,
                                              128 * 128, 128 * 64, 128 * 64, 128 * 128]
    attention = 2 * 128 * 128 + 2 * 128 * 64
    mixer = 12 + 320 * 5 + 128 * 580 + 256 * 128
    assert block.grad_groups(spec, 1, 1) == {
        "attn_out": 128 * 128, "attn_qkv": attention, "mamba_out": attention + 256 * 128,
        "attn": attention + mixer}


def test_the_estimate_names_the_path() -> None:
    """An estimate says which code the mixer is read from, and that the CUDA kernels are
    not modelled; a default hf estimate of the published config runs."""
    from memplan.api import estimate

    est = estimate(_toy(), seq_len=64, micro_batch_size=2)
    line = next(a for a in est.assumptions if "Falcon-H1" in a)
    assert "5.23" in line and "mamba2_chunk_scan" in line and "not modelled" in line
    est = estimate(_toy(), seq_len=64, micro_batch_size=2, mamba_kernel="torch")
    line = next(a for a in est.assumptions if "Falcon-H1" in a)
    assert "torch_forward" in line and "5.3" in line and "5.23" not in line
    full = spec_from_hf_dict(CONFIG, "config.json", "falcon-h1")
    assert estimate(full, seq_len=4096, micro_batch_size=1).stages[0].peak_bytes > 0
