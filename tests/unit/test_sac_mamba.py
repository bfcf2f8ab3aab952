"""Op-level checkpointing of Granite 4.0-H's dense Mamba2 layers (``memplan.model.sac_mamba``):
the items' bytes, FLOPs and policy keys derived by hand, the layer kinds a save list scopes,
the emitters and the models that refuse.

granite-4.0-h-tiny's config without its experts (tests/data/hf/heldout/granite-4.0-h-tiny,
num_local_experts 0, as tests/traced/test_hf_heldout.py reads it): 40 layers, attention on 5,
15, 25, 35, Mamba2 on the other 36; h = 1,536; the mixer's H = 48 heads of P = 64 (d = 3,072),
state n = 128, G = 1 group, K = 4 taps; the shared MLP's f = 1,024. At seq 1,024 and
micro-batch 2 in bf16 (mamba_kernel torch: GraniteMoeHybridMambaLayer.torch_forward) a
layer's tokens are T = 2,048:

- in_proj's output: W = 2 d + 2 G n + H = 6,144 + 256 + 48 = 6,448 wide, T x W x 2 =
  26,411,008 B, an ``mm`` 6,448 wide; its rerun 2 x h x W = 19,808,256 FLOPs a token;
- the conv's output over C = d + 2 G n = 3,328 channels, padded by K - 1 = 3: b x C x (s + 3)
  x 2 = 2 x 3,328 x 1,027 x 2 = 13,671,424 B, ``aten.convolution`` of 3,328 channels;
  2 x K x C = 26,624 FLOPs;
- silu's output: T x C x 2 = 13,631,488 B, an ``act`` 3,328 wide; C = 3,328 FLOPs;
- out_proj's input, ``scan_output.to(dtype)``: T x d x 2 = 12,582,912 B, a ``copy`` 3,072 wide,
  the second (the gated norm's ``gate.to(float32)`` the first); d = 3,072 FLOPs;
- out_proj's output: T x h x 2 = 6,291,456 B, the layer's first ``mm`` 1,536 wide (the MLP's
  down projection the second); 2 x d x h = 9,437,184 FLOPs.

In fp32 out_proj's input is the gated norm's last product, ``weight * hidden_states`` (T x d
x 4 = 25,165,824 B), the third ``mul`` 3,072 wide (after ``y * silu(gate)`` and ``y * rstd``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from memplan.api import estimate, make_workload
from memplan.errors import LayoutError, MemplanError
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items, ops_kinds
from memplan.parallel import ParallelConfig
from memplan.report.sac_policy import emit_for
from memplan.spec import load_model, spec_from_hf_dict

_CONFIG = Path(__file__).resolve().parents[1] / "data" / "hf" / "heldout" / "granite-4.0-h-tiny"
GRANITE_H = spec_from_hf_dict({**json.loads((_CONFIG / "config.json").read_text()),
                               "num_local_experts": 0}, "config.json", "granite-4.0-h-dense")
KW = dict(seq_len=1024, micro_batch_size=2, precision="bf16-pure", framework="hf",
          mamba_kernel="torch")


def _mamba_items(precision: str = "bf16-pure", tp: int = 1) -> dict[str, sac_ops.Item]:
    wl = make_workload(GRANITE_H, **{**KW, "precision": precision}, recompute="ops")
    dm = Dims.of(GRANITE_H, ParallelConfig(tp=tp), wl)
    return {i.name: i for i in ops_items(GRANITE_H, wl, dm, False, "linear")
            if i.name.startswith("mamba.")}


def test_mamba_items_by_hand() -> None:
    items = _mamba_items()
    assert [(n, i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.block)
            for n, i in items.items()] == [
        ("mamba.in_proj", 26_411_008, 19_808_256.0, "matmul", 6448, 0, "attn"),
        ("mamba.conv_out", 13_671_424, 26_624.0, "conv", 3328, 0, "attn"),
        ("mamba.act", 13_631_488, 3328.0, "act", 3328, 0, "attn"),
        ("mamba.out", 12_582_912, 3072.0, "copy", 3072, 1, "attn"),
        ("mamba.out_proj", 6_291_456, 9_437_184.0, "matmul", 1536, 0, "attn")]
    # the conv's output is freed once silu has read it: kept, it adds to the mixer's moments
    assert [n for n, i in items.items() if i.own_extra] == ["mamba.conv_out"]


def test_mamba_out_in_fp32() -> None:
    out = _mamba_items("fp32")["mamba.out"]
    assert (out.size_bytes, out.op, out.width, out.nth) == (25_165_824, "mul", 3072, 2)


def test_mamba_items_on_two_tensor_parallel_ranks() -> None:
    """tp 2 (``memplan.model.mamba.sizes``): 24 heads (d = 1,536), the one group on every
    rank (1 is not divisible by 2): W = 1,536 + 1,536 + 256 + 24 = 3,352, in_proj's output
    2,048 x 3,352 x 2 = 13,729,792 B (2 x 1,536 x 3,352 = 10,297,344 FLOPs); C = 1,792, the
    conv's 2 x 1,792 x 1,027 x 2 = 7,361,536 B; out_proj's output the full partial sum,
    6,291,456 B, 2 x 1,536 x 1,536 = 4,718,592 FLOPs."""
    items = _mamba_items(tp=2)
    assert (items["mamba.in_proj"].size_bytes, items["mamba.in_proj"].width,
            items["mamba.in_proj"].flops_per_token) == (13_729_792, 3352, 10_297_344.0)
    assert (items["mamba.conv_out"].size_bytes, items["mamba.conv_out"].width) == \
        (7_361_536, 1792)
    assert (items["mamba.out_proj"].size_bytes, items["mamba.out_proj"].flops_per_token) == \
        (6_291_456, 4_718_592.0)


def test_layer_kinds_and_scopes() -> None:
    """4 attention layers and 36 Mamba layers, each kind its list: ``mamba:`` names add their
    bytes on the 36 Mamba layers alone (the conv's output, 13,671,424 B each)."""
    assert ops_kinds(GRANITE_H) == (("attn", False, 4), ("mamba", False, 36))
    assert [sac_ops.layer_kind_of(GRANITE_H, i) for i in range(4, 7)] == \
        ["mamba", "attn", "mamba"]

    def activations(save: str) -> int:
        return estimate(GRANITE_H, **KW, recompute="ops", recompute_save=save).stages[0] \
            .activations_bytes

    assert activations("mamba:mamba.conv_out") - activations("") == 36 * 13_671_424
    with pytest.raises(MemplanError, match="scope the names of one kind's layers: mamba:"):
        estimate(GRANITE_H, **KW, recompute="ops", recompute_save="mamba.act")


def test_emitted_policies() -> None:
    """The torch policy names in_proj's mm and out_proj's input cast; the attention layers
    (5, 15, 25, 35) run their own op counts. torchtitan and Megatron-LM refuse."""
    est = estimate(GRANITE_H, **KW, recompute="ops",
                   recompute_save="mamba:mamba.in_proj,mamba:mamba.out,attn:attn.q")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("matmul", 6448, 0), ("copy", 3072, 1)}
    # the gate's cast and out_proj's input's; the input, MLP and gated norms' rsqrt (width 1)
    assert space["PER_LAYER"][("copy", 3072)] == 2 and space["PER_LAYER"][("rsqrt", 1)] == 3
    assert sorted(space["LAYER_COUNTS"]) == [5, 15, 25, 35]
    for target in ("torchtitan", "megatron"):
        with pytest.raises(MemplanError, match="Mamba2 layers"):
            emit_for(target, est)


def test_einsum_scan_policy_by_hand() -> None:
    """transformers 5.23's forward (mamba_kernel torch-einsum: ``sac_mamba.mamba_items``):
    ``causal_conv1d_fn``'s silu runs on the conv's (b, C, s) output, so its key is s = 1,024
    wide, the shared MLP's silu's width too (f = 1,024): the mixer's is the first of two;
    out_proj's input is the layer's second cast d = 48 x 64 = 3,072 wide (the gated norm's
    ``gate.to(float32)`` first). No item is a bmm, so the scan's einsums are not counted."""
    est = estimate(GRANITE_H, **{**KW, "mamba_kernel": "torch-einsum"}, recompute="ops",
                   recompute_save="mamba:mamba.act,mamba:mamba.out")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("act", 1024, 0), ("copy", 3072, 1)}
    assert space["PER_LAYER"][("act", 1024)] == 2 and space["PER_LAYER"][("copy", 3072)] == 2
    assert not any(op == "bmm" for op, _ in space["PER_LAYER"])


def test_the_scan_reruns_whatever_is_kept() -> None:
    """Every item of both kinds kept, the rerun spends the 36 Mamba layers' scans alone
    (``memplan.planning.timing.ops_rerun_flops``, per layer over the 40): chunks of c = 256,
    2 x (c H (n + 1 + P) + 2 H P n) = 2 x (256 x 48 x 193 + 2 x 48 x 64 x 128) = 2 x
    (2,371,584 + 786,432) = 6,316,032 FLOPs a token; 36 x 6,316,032 / 40 = 5,684,428.8."""
    from memplan.planning.timing import ops_rerun_flops

    every = ",".join(f"{k}:{g}" for k in ("mamba", "attn") for g in ("attention", "mlp", "norms"))
    wl = make_workload(GRANITE_H, **KW, recompute="ops", recompute_save=every)
    assert ops_rerun_flops(GRANITE_H, wl) == pytest.approx(5_684_428.8)
