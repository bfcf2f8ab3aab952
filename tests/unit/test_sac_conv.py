"""Op-level checkpointing of LFM2's short-convolution layers (``memplan.model.sac_conv``):
the items' bytes, FLOPs and policy keys derived by hand, the layer kinds a save list scopes
and the emitters that refuse.

lfm2-1.2b (model_specs/models/lfm2-1.2b.toml): 16 layers, attention on 2, 5, 8, 10, 12, 14
(6), short convolutions on the other 10; h = 2,048, K = 3 taps (conv_L_cache), SwiGLU f =
8,192. At seq 1,024 and micro-batch 2 in bf16 a layer's tokens are T = 2,048; on one rank
c = h = 2,048 channels (models/lfm2/modeling_lfm2.py Lfm2ShortConv.slow_forward):

- in_proj's output (B, C, x): T x 3c x 2 = 2,048 x 6,144 x 2 = 25,165,824 B, an ``mm`` 6,144
  wide; its rerun 2 x h x 3c = 25,165,824 FLOPs a token;
- B * x: T x c x 2 = 8,388,608 B, a ``mul`` on (b, c, s) views, so of width s = 1,024; c =
  2,048 FLOPs a token;
- the depthwise conv1d's output, padded by K - 1 = 2: b x c x (s + 2) x 2 = 2 x 2,048 x
  1,026 x 2 = 8,404,992 B, ``aten.convolution`` of 2,048 channels; 2 x K x c = 12,288 FLOPs;
- C * conv_out: 8,388,608 B, the second ``mul`` of width 1,024;
- out_proj's output: T x h x 2 = 8,388,608 B, an ``mm`` 2,048 wide, the layer's first (the
  MLP's down projection the second); 2 x c x h = 8,388,608 FLOPs.

With tp 2 (no sequence parallelism) c = 1,024: in_proj's output 2,048 x 3,072 x 2 =
12,582,912 B (an ``mm`` 3,072 wide), the conv's 2 x 1,024 x 1,026 x 2 = 4,202,496 B, out_proj's
the full partial sum, 8,388,608 B, its FLOPs 2 x 1,024 x 2,048 = 4,194,304.
"""

from __future__ import annotations

import pytest
from memplan.api import estimate, make_workload
from memplan.errors import MemplanError
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_kinds
from memplan.parallel import ParallelConfig
from memplan.report.sac_policy import emit_for
from memplan.spec import load_model

LFM2 = load_model("lfm2-1.2b")
KW = dict(seq_len=1024, micro_batch_size=2, precision="bf16-pure", framework="hf")


def _conv_items(tp: int = 1) -> dict[str, sac_ops.Item]:
    wl = make_workload(LFM2, **KW, recompute="ops")
    dm = Dims.of(LFM2, ParallelConfig(tp=tp), wl)
    return {i.name: i for i in ops_items(LFM2, wl, dm, False, "linear")
            if i.name.startswith("short_conv.")}


def test_short_conv_items_by_hand() -> None:
    items = _conv_items()
    assert [(n, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.block)
            for n, i in items.items()] == [
        ("short_conv.bcx", 25_165_824, 25_165_824.0, "matmul", 6144, 0, "attn"),
        ("short_conv.bx", 8_388_608, 2048.0, "mul", 1024, 0, "attn"),
        ("short_conv.conv_out", 8_404_992, 12_288.0, "conv", 2048, 0, "attn"),
        ("short_conv.out", 8_388_608, 2048.0, "mul", 1024, 1, "attn"),
        ("short_conv.out_proj", 8_388_608, 8_388_608.0, "matmul", 2048, 0, "attn")]
    # C * conv_out is a local the contiguous copy frees: kept, it adds to the block's moments
    assert [n for n, i in items.items() if i.own_extra] == ["short_conv.out"]


def test_short_conv_items_on_two_tensor_parallel_ranks() -> None:
    items = _conv_items(tp=2)
    assert (items["short_conv.bcx"].size_bytes, items["short_conv.bcx"].width) == \
        (12_582_912, 3072)
    assert items["short_conv.conv_out"].size_bytes == 4_202_496
    assert (items["short_conv.out_proj"].size_bytes,
            items["short_conv.out_proj"].flops_per_token) == (8_388_608, 4_194_304.0)


def test_layer_kinds_and_scopes() -> None:
    """6 attention layers and 10 convolution layers, each kind its list: ``conv:`` names
    add their bytes on the 10 convolution layers alone (the conv output, 8,404,992 B each,
    84,049,920 B in all), ``attn:`` on the 6 attention layers."""
    assert ops_kinds(LFM2) == (("attn", False, 6), ("conv", False, 10))
    assert [sac_ops.layer_kind_of(LFM2, i) for i in range(4)] == ["conv", "conv", "attn", "conv"]

    def activations(save: str) -> int:
        return estimate(LFM2, **KW, recompute="ops", recompute_save=save).stages[0] \
            .activations_bytes

    assert activations("conv:short_conv.conv_out") - activations("") == 10 * 8_404_992
    # attn.o_proj's output: T x h x 2 = 8,388,608 B on each of the 6 attention layers
    assert activations("attn:attn.o_proj") - activations("") == 6 * 8_388_608
    with pytest.raises(MemplanError, match="scope the names of one kind"):
        estimate(LFM2, **KW, recompute="ops", recompute_save="short_conv.bx")
    with pytest.raises(MemplanError, match="unknown scope 'dense'"):
        estimate(LFM2, **KW, recompute="ops", recompute_save="dense:mlp.up")


def test_emitted_policies() -> None:
    """The torch policy names the convolution by ``aten.convolution`` and its channels; the
    attention layers (2, 5, 8, 10, 12, 14) run their own op counts. torchtitan and
    Megatron-LM have no model with short convolutions: refused."""
    est = estimate(LFM2, **KW, recompute="ops",
                   recompute_save="conv:short_conv.conv_out,conv:short_conv.out,attn:attn.q")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("conv", 2048, 0), ("mul", 1024, 1)}
    assert space["PER_LAYER"][("conv", 2048)] == 1 and space["PER_LAYER"][("mul", 1024)] == 2
    assert sorted(space["LAYER_COUNTS"]) == [2, 5, 8, 10, 12, 14]
    # q's projection: the layer's first mm 2,048 wide (q = 32 heads of 64)
    assert space["LAYER_SAVE"][2] == {("matmul", 2048, 0)}
    for target, what in (("torchtitan", "no LFM2 model"), ("megatron", "no short-convolution")):
        with pytest.raises(MemplanError, match=what):
            emit_for(target, est)
