"""Op-level checkpointing of Falcon-H1's parallel layers (``memplan.model.sac_falcon``): the
items' bytes, FLOPs and policy keys derived by hand, the emitted policy's counts, what is
still refused and the plan's search.

falcon-h1-0.5b (the catalog entry, FalconH1Config with mamba_rms_norm false): 36 layers of
h = 1,024; attention 8 / 2 heads of 64 (q 512, k and v 128 wide); the mixer's H = 24 heads of
P = 64 (d = 1,536), state n = 128, G = 1 group, K = 4 taps; the MLP's f = 2,048. At seq 1,024
and micro-batch 2 in bf16 (mamba_kernel torch: FalconH1Mixer.torch_forward) a layer's tokens
are T = 2,048:

- the norm's ``ssm_in_multiplier`` copy, what in_proj saves (``attn_norm.output``): T x h x 2
  = 4,194,304 B, the layer's first ``scale`` 1,024 wide; h = 1,024 FLOPs a token;
- in_proj's output: W = 2 d + 2 G n + H = 3,072 + 256 + 24 = 3,352 wide, T x W x 2 =
  13,729,792 B, an ``mm`` 3,352 wide, freed by the ``mup_vector`` product (kept, it adds to
  the working set); 2 x h x W = 6,864,896 FLOPs;
- the ``mup_vector`` product (the conv, gate and dt view it: ``mamba.in_proj_out``): the same
  13,729,792 B, a tensor ``mul`` 3,352 wide; W = 3,352 FLOPs;
- the conv's output over C = d + 2 G n = 1,792 channels, padded by K - 1 = 3: b x C x (s + 3)
  x 2 = 2 x 1,792 x 1,027 x 2 = 7,361,536 B; 2 x K x C = 14,336 FLOPs; silu's: T x C x 2 =
  7,340,032 B, an ``act`` 1,792 wide;
- out_proj's input ``scan_output.to(dtype)`` (``y * silu(gate)`` in fp32, cast): T x d x 2 =
  6,291,456 B, the only ``copy`` 1,536 wide; out_proj's output T x h x 2 = 4,194,304 B, the
  first ``mm`` 1,024 wide (o_proj the second, the MLP's down projection the third);
  2 x d x h = 3,145,728 FLOPs;
- the ``attention_in_multiplier`` copy q, k and v save (``attn.input_copy``): 4,194,304 B, the
  third ``scale`` 1,024 wide (after ssm_in's and ssm_out's; attention_out's and
  down_multiplier's follow: five a layer);
- FalconH1MLP runs ``up_proj`` first (the first ``mm`` 2,048 wide), then ``gate_proj`` (the
  second, a transient) and ``* gate_multiplier`` (``mlp.gate``, what silu saves: T x f x 2 =
  8,388,608 B, a ``scale`` 2,048 wide; f = 2,048 FLOPs).

In fp32 out_proj's input is the product ``y * silu(gate)`` itself (T x d x 4 = 12,582,912 B,
a ``mul`` 1,536 wide); under autocast the two copies are fp32 locals no one saves (each linear
saves its own cast) and out_proj's input autocast's cast: none of the three is an item.
The gated FalconH1RMSNormGated (falcon-h1-1.5b-deep): ``test_gated_norm_items_by_hand``.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate, make_workload, plan
from memplan.errors import LayoutError, MemplanError
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.parallel import ParallelConfig
from memplan.planning.timing import ops_rerun_flops
from memplan.report.sac_policy import emit_for
from memplan.spec import load_model

FALCON = load_model("falcon-h1-0.5b")
KW = dict(seq_len=1024, micro_batch_size=2, precision="bf16-pure", framework="hf",
          mamba_kernel="torch")


def _items(precision: str = "bf16-pure") -> dict:
    wl = make_workload(FALCON, **{**KW, "precision": precision}, recompute="ops")
    dm = Dims.of(FALCON, ParallelConfig(), wl)
    return {i.name: i for i in ops_items(FALCON, wl, dm)}


def test_falcon_items_by_hand() -> None:
    items = _items()
    got = {n: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.block, i.own_extra)
           for n, i in items.items()
           if n.startswith("mamba.") or n in ("attn_norm.output", "attn.input_copy",
                                              "attn.o_proj", "mlp.up", "mlp.gate_proj",
                                              "mlp.gate_scaled")}
    assert got == {
        "attn_norm.output": (4_194_304, 1024.0, "scale", 1024, 0, "attn_norm", False),
        "mamba.in_proj": (13_729_792, 6_864_896.0, "matmul", 3352, 0, "mamba", True),
        "mamba.mup": (13_729_792, 3352.0, "mul", 3352, 0, "mamba", False),
        "mamba.conv_out": (7_361_536, 14_336.0, "conv", 1792, 0, "mamba", True),
        "mamba.act": (7_340_032, 1792.0, "act", 1792, 0, "mamba", False),
        "mamba.out": (6_291_456, 1536.0, "copy", 1536, 0, "mamba", False),
        "mamba.out_proj": (4_194_304, 3_145_728.0, "matmul", 1024, 0, "mamba", False),
        "attn.input_copy": (4_194_304, 1024.0, "scale", 1024, 2, "attn", False),
        "attn.o_proj": (4_194_304, 1_048_576.0, "matmul", 1024, 1, "attn", False),
        "mlp.up": (8_388_608, 4_194_304.0, "matmul", 2048, 0, "mlp", False),
        "mlp.gate_proj": (8_388_608, 4_194_304.0, "matmul", 2048, 1, "mlp", True),
        "mlp.gate_scaled": (8_388_608, 2048.0, "scale", 2048, 0, "mlp", False)}
    assert items["mamba.mup"].terms == ("mamba.in_proj_out",)
    assert items["mlp.gate_scaled"].terms == ("mlp.gate",) and not items["mlp.gate_proj"].terms


def test_fp32_and_autocast_items() -> None:
    """fp32: out_proj's input the product (12,582,912 B, a ``mul`` 1,536 wide); the copies
    twice the bytes (8,388,608). Under autocast: no copy items, no ``mamba.out``; the
    ``mup_vector`` product fp32 (T W 4 = 27,459,584 B), in_proj's output bf16 (13,729,792)."""
    fp32 = _items("fp32")
    assert (fp32["mamba.out"].size_bytes, fp32["mamba.out"].op) == (12_582_912, "mul")
    assert fp32["attn_norm.output"].size_bytes == fp32["attn.input_copy"].size_bytes == 8_388_608
    amp = _items("amp-bf16")
    assert "mamba.out" not in amp and "attn.input_copy" not in amp
    assert amp["attn_norm.output"].op == "norm"  # autocast's cast: no op a policy names
    assert (amp["mamba.mup"].size_bytes, amp["mamba.in_proj"].size_bytes) == (
        27_459_584, 13_729_792)


def test_emitted_policy_counts() -> None:
    """The mixer's items (``mamba``) and the gate's copy kept: their keys; per layer five
    ``scale`` ops 1,024 wide, three ``mm`` 1,024 wide, four ``copy`` 1,024 wide (two per norm).
    torchtitan and Megatron-LM have no Falcon-H1 mixer: refused by name."""
    est = estimate(FALCON, **KW, recompute="ops", recompute_save="mamba,mlp.gate")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("matmul", 3352, 0), ("mul", 3352, 0), ("conv", 1792, 0),
                             ("act", 1792, 0), ("copy", 1536, 0), ("matmul", 1024, 0),
                             ("scale", 2048, 0)}
    counts = space["PER_LAYER"]
    assert (counts[("scale", 1024)], counts[("matmul", 1024)], counts[("copy", 1024)]) == (
        5, 3, 4)
    assert ("scale", 64) not in counts  # the key multiplier: no item of its family and width
    for target in ("torchtitan", "megatron"):
        with pytest.raises(MemplanError, match="FalconH1Mixer"):
            emit_for(target, est)


def test_saved_bytes_add_the_kept_items() -> None:
    """Keeping the mixer's six items adds their bytes (13,729,792 x 2 + 7,361,536 +
    7,340,032 + 6,291,456 + 4,194,304 = 52,646,912 B a layer) to what the layers save
    keeping nothing but their input, times 36 layers."""
    def activations(save: str) -> int:
        return estimate(FALCON, **KW, recompute="ops", recompute_save=save).stages[0] \
            .activations_bytes

    assert activations("mamba") - activations("") == 36 * 52_646_912


def test_the_scan_reruns_whatever_is_kept() -> None:
    """Every item kept, the rerun spends the scan alone (``ops_rerun_flops``; the scan's FLOPs
    ``memplan.model.mamba.Mamba.core_flops_per_token``): positive, and the same whatever the
    list keeps beyond."""
    wl = make_workload(FALCON, **KW, recompute="ops",
                       recompute_save="attention,mlp,mamba,norms")
    assert ops_rerun_flops(FALCON, wl) > 0
    with_norms = ops_rerun_flops(FALCON, wl)
    wl = make_workload(FALCON, **KW, recompute="ops", recompute_save="attention,mlp,mamba")
    assert ops_rerun_flops(FALCON, wl) > with_norms


DEEP = load_model("falcon-h1-1.5b-deep")


def _deep(precision: str, before: bool = False, groups: int = 1) -> dict:
    """falcon-h1-1.5b-deep's items (``norm_before_gate`` and ``num_groups`` set)."""
    assert DEEP.mamba is not None
    spec = DEEP.model_copy(update={"mamba": DEEP.mamba.model_copy(
        update={"norm_before_gate": before, "num_groups": groups})})
    wl = make_workload(spec, **{**KW, "precision": precision}, recompute="ops")
    return {i.name: i for i in ops_items(spec, wl, Dims.of(spec, ParallelConfig(), wl))}


def test_gated_norm_items_by_hand() -> None:
    """falcon-h1-1.5b-deep (mamba_rms_norm, mamba_norm_before_gate false as published): 66
    layers of h = 1,280; the mixer's 24 heads of 64 (d = 1,536), state 256, 1 group; T =
    2,048 tokens in bf16. in_proj's output W = 2 d + 2 n + H = 3,072 + 512 + 24 = 3,608
    wide: T W 2 = 14,778,368 B (its product the same); the conv's C = d + 2 n = 2,048
    channels: 2 x 2,048 x 1,027 x 2 = 8,413,184 B, silu's T C 2 = 8,388,608; out_proj's input
    T d 2 = 6,291,456 B, the second ``copy`` 1,536 wide (FalconH1RMSNormGated's
    ``gate.to(float32)`` the first); its output T h 2 = 5,242,880 B. In fp32 out_proj's
    input is the norm's weight product T d 4 = 12,582,912 B: after ``y * silu(gate)`` and
    ``* rsqrt`` the third ``mul`` 1,536 wide; normalising first (norm_before_gate) the
    product by silu(gate) comes last, again the third. ``* rsqrt`` and the weight's product
    are d / G wide: over 2 groups 768, the item then the second ``mul`` 768 wide gating
    last, the first ``mul`` 1,536 wide (silu(gate)'s product) normalising first."""
    items = _deep("bf16-pure")
    assert {n: (i.size_bytes, i.op, i.width, i.nth) for n, i in items.items()
            if n.startswith("mamba.")} == {
        "mamba.in_proj": (14_778_368, "matmul", 3608, 0),
        "mamba.mup": (14_778_368, "mul", 3608, 0),
        "mamba.conv_out": (8_413_184, "conv", 2048, 0),
        "mamba.act": (8_388_608, "act", 2048, 0),
        "mamba.out": (6_291_456, "copy", 1536, 1),
        "mamba.out_proj": (5_242_880, "matmul", 1280, 0)}
    first = _deep("bf16-pure", before=True)["mamba.out"]
    assert (first.size_bytes, first.op, first.width, first.nth) == (6_291_456, "copy", 1536, 1)
    out = {(before, g): _deep("fp32", before, g)["mamba.out"] for before in (False, True)
           for g in (1, 2)}
    assert {k: (i.size_bytes, i.op, i.width, i.nth) for k, i in out.items()} == {
        (False, 1): (12_582_912, "mul", 1536, 2), (True, 1): (12_582_912, "mul", 1536, 2),
        (False, 2): (12_582_912, "mul", 768, 1), (True, 2): (12_582_912, "mul", 1536, 0)}


def test_gated_norm_saved_bytes_and_counts() -> None:
    """Keeping the mixer adds 14,778,368 x 2 + 8,413,184 + 8,388,608 + 6,291,456 + 5,242,880
    = 57,892,864 B a layer, times 66; the emitted policy counts a layer's two ``copy`` ops
    1,536 wide (the gate's cast, out_proj's input), its norm's ``+ eps`` and rsqrt (one row a
    token, 1 wide) among them."""
    kw = {**KW, "recompute": "ops"}

    def activations(save: str) -> int:
        return estimate(DEEP, **kw, recompute_save=save).stages[0].activations_bytes

    assert activations("mamba") - activations("") == 66 * 57_892_864
    space: dict = {}
    exec(compile(emit_for("torch", estimate(DEEP, **kw, recompute_save="mamba")),  # noqa: S102
                 "<policy>", "exec"), space)
    assert ("copy", 1536, 1) in space["SAVE"] and space["PER_LAYER"][("copy", 1536)] == 2


def test_norm_before_gate_read_and_refused_outside_falcon() -> None:
    """The reader takes mamba_norm_before_gate with FalconH1Config's default (true); the
    published configs say false (the catalog). Granite 4.0-H's layers set to normalise first
    are refused by name (GraniteMoeHybridRMSNormGated gates first)."""
    from test_sac_mamba import GRANITE_H  # noqa: PLC0415 (tests/unit)

    from memplan.hf.config import ConfigKeys
    from memplan.hf.families_more import falcon_h1

    assert DEEP.mamba is not None and not DEEP.mamba.norm_before_gate
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 128, "mamba_d_ssm": 128, "mamba_n_heads": 2}
    for extra, want in (({}, True), ({"mamba_norm_before_gate": False}, False)):
        fields = falcon_h1(ConfigKeys({**base, **extra}, "config.json"))
        assert fields["mamba"]["norm_before_gate"] is want
    assert GRANITE_H.mamba is not None
    granite = GRANITE_H.model_copy(update={"mamba": GRANITE_H.mamba.model_copy(
        update={"norm_before_gate": True})})
    with pytest.raises(LayoutError, match="norm_before_gate"):
        estimate(granite, **KW, recompute="ops")


def test_plan_searches_save_lists() -> None:
    """``plan --recompute auto`` on falcon-h1-0.5b over 8 GPUs raises nothing but
    MemplanError."""
    try:
        plan(FALCON, gpus=8, recompute="auto", mamba_kernel="torch")
    except MemplanError:
        pass


def test_plan_auto_searches_save_lists_on_the_einsum_scan() -> None:
    """On the einsum scan (falcon-h1's default ``mamba_kernel``, transformers 5.23's forward,
    modelled op by op: ``sac_mamba.mamba_items``) ``plan --recompute auto`` searches save
    lists, and no recompute (``api._auto_none``: the least recompute of all, the scan's
    tensors kept too). On 80 GB the fastest fit without recompute: the candidates of the plan
    with no recompute fixed. On 24 GiB no layout fits without it: auto's candidates keep save
    lists (every one naming the mixer's items), no note of levels searched instead, its best
    faster than the best whole level (full on some layers)."""
    auto = plan(FALCON, gpus=8, recompute="auto", top=3)
    levels = plan(FALCON, gpus=8, top=3)
    assert auto.notes == [] and [c.recompute for c in auto.candidates] == ["none"] * 3
    assert [(c.layout, c.micro_batch_size, c.peak_bytes) for c in auto.candidates] == \
        [(c.layout, c.micro_batch_size, c.peak_bytes) for c in levels.candidates]
    auto = plan(FALCON, gpus=8, recompute="auto", top=3, gpu_memory="24GiB")
    levels = plan(FALCON, gpus=8, top=3, gpu_memory="24GiB")
    assert auto.notes == [] and all(c.recompute == "ops" for c in auto.candidates)
    assert all("mamba.in_proj" in c.recompute_save for c in auto.candidates)
    assert levels.candidates[0].recompute == "full"
    assert (auto.candidates[0].time.tokens_per_s_per_gpu
            > levels.candidates[0].time.tokens_per_s_per_gpu)


def test_estimate_auto_takes_the_levels_where_ops_are_not_modelled() -> None:
    """``estimate --recompute auto`` where the layer's ops are not modelled (Qwen3-Next's
    gated DeltaNet layers) does what ``plan`` does there: of the whole levels in plan's order
    (none, selective, full on an eighth ... seven eighths of the 48 layers: 6, 12, 18, 24,
    30, 36, 42, full) the first that fits, here (64 GPUs, ZeRO-3, 60 GiB, micro-batch 1)
    full on 24 layers, each level estimated on its own below; with a note naming the refusal
    and the level. Where only full recompute fits (micro-batch 3) it is full on every layer;
    where nothing fits (30 GiB, micro-batch 8), full, and the note says none fits."""
    model = "qwen3-next-80b-a3b"
    kw = dict(gpus=64, zero=3, gpu_memory="60GiB", micro_batch_size=1)
    levels = [("none", None), ("selective", None),
              *(("full", 48 * q // 8) for q in range(1, 8)), ("full", None)]
    fits = [estimate(model, **kw, recompute=r, recompute_layers=k).fits for r, k in levels]
    assert fits.index(True) == 5 and levels[5] == ("full", 24)
    auto = estimate(model, **kw, recompute="auto")
    by_hand = estimate(model, **kw, recompute="full", recompute_layers=24)
    assert (auto.workload.recompute.value, auto.workload.recompute_layers) == ("full", 24)
    assert auto.peak_bytes == by_hand.peak_bytes and auto.fits
    note = auto.assumptions[-1]
    assert "linear-attention layers" in note and note.endswith(
        ": full on 24 layers of each stage")
    three = estimate(model, **{**kw, "micro_batch_size": 3}, recompute="auto")
    assert (three.workload.recompute.value, three.workload.recompute_layers) == ("full", None)
    none = estimate(model, gpus=64, zero=3, gpu_memory="30GiB", micro_batch_size=8,
                    recompute="auto")
    assert not none.fits and none.assumptions[-1].endswith("(none fits: full recompute of "
                                                           "every layer)")


def test_mamba_group() -> None:
    """``mamba`` names the mixer's six items (Falcon-H1's block ``mamba``); in Granite 4.0-H
    its Mamba layers' five (``mamba.*``, in their attention block); in a model without a
    Mamba2 mixer it is an unknown name, refused."""
    from test_sac_mamba import GRANITE_H  # noqa: PLC0415 (tests/unit)

    from memplan.model import sac_ops

    items = tuple(_items().values())
    assert [i.name for i in sac_ops.resolve(items, ("mamba",), FALCON)] == [
        "mamba.in_proj", "mamba.mup", "mamba.conv_out", "mamba.act", "mamba.out",
        "mamba.out_proj"]
    wl = make_workload(GRANITE_H, **KW, recompute="ops")
    granite = ops_items(GRANITE_H, wl, Dims.of(GRANITE_H, ParallelConfig(), wl), False,
                        "linear")
    assert [i.name for i in sac_ops.resolve(granite, ("mamba:mamba",), GRANITE_H, "mamba")] == [
        "mamba.in_proj", "mamba.conv_out", "mamba.act", "mamba.out", "mamba.out_proj"]
    with pytest.raises(MemplanError, match="unknown name 'mamba'"):
        estimate("llama-3-8b", seq_len=1024, recompute="ops", recompute_save="mamba")
