"""torchtitan 0.3.0's own MoE block (``moe_impl titan``, the torchtitan preset's default:
models/common/moe.py ``MoE.forward``, models/common/token_dispatcher.py
``LocalTokenDispatcher``), bytes derived by hand.

tiny-moe (tests/unit/test_moe_recompute.py's): h 64, 4 stacked SwiGLU experts of f 96, top-2;
seq 128 and micro-batch 2: T = 256 tokens, R = T*k = 512 routed rows; E = 4.
"""

from __future__ import annotations

import pytest

from memplan.api import make_layout, make_workload
from memplan.errors import LayoutError
from memplan.model.dims import Dims
from memplan.model.layer import layer_blocks
from memplan.model.moe import MoE
from memplan.spec import ModelSpec, MoESpec, load_model

TINY_MOE = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=96, stacked_experts=True)


def _setup(precision: str = "bf16-pure", recompute: str | None = None, **moe):
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**(TINY_MOE | moe)).model_dump()})
    extra = {"recompute": recompute} if recompute else {}
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl="titan",
                       precision=precision, **extra)
    return spec, wl, Dims.of(spec, make_layout(1), wl)


def test_saved_terms_in_bf16() -> None:
    """In bf16 (e = 2), per MoE layer: the gate's fp32 copies of its input (T h x 4 = 65,536)
    and weight (E h x 4 = 1,024); the fp32 softmax (T E x 4 = 4,096); the chosen experts' ids
    (T k x 8 = 4,096); route_norm's division operands, the gathered scores and their sum
    (R x 4 + T x 4 = 3,072); the argsort and the token index (R x 8 = 4,096 each); the
    gathered rows (R h x 2 = 65,536); the experts' gate, activation, up and product (4 x R f
    x 2 = 393,216); the grouped matmuls' int32 offsets (E x 4 = 16); the experts' output in
    fp32 and the sorted scores, their product's operands (R h x 4 = 131,072; R x 4 =
    2,048): 677,904. The ffn norm's output is saved by no one (its T h x 2 = 32,768 not
    counted)."""
    spec, wl, dm = _setup()
    saved = {t.name: t.size_bytes for t in MoE().saved(spec, wl, dm, wl.recompute)}
    assert saved["moe.router_input_fp32"] == 65_536 and saved["moe.expert_out"] == 131_072
    assert saved["moe.offsets"] == 16 and saved["moe.expert_weights_bf16"] == 0
    assert sum(saved.values()) == 677_904
    norm = layer_blocks(spec, True)[2]
    names = {t.name for t in norm.saved(spec, wl, dm, wl.recompute)}
    assert norm.name == "mlp_norm" and "mlp_norm.output" not in names


def test_saved_terms_in_fp32() -> None:
    """In fp32 (e = 4) the gate reads the norm's output itself (saved, as a dense layer's):
    no fp32 copies; GroupedExperts' ``.bfloat16()`` casts are new tensors: two of the rows
    (w1's and w3's, 2 x 65,536) and the three weights' (3 x E f h x 2 = 147,456); the rest
    as in bf16: 677,904 - 66,560 + 65,536 + 147,456 = 824,336."""
    spec, wl, dm = _setup("fp32")
    saved = {t.name: t.size_bytes for t in MoE().saved(spec, wl, dm, wl.recompute)}
    assert "moe.router_input_fp32" not in saved
    assert saved["moe.dispatched"] == 131_072 and saved["moe.expert_weights_bf16"] == 147_456
    assert sum(saved.values()) == 824_336


def test_checkpointed_forward_peaks_at_the_combine() -> None:
    """Under full recompute in bf16: the routing's tensors (T E x 5 = 5,120 scores and map,
    T k x 12 = 6,144 ids and scaled scores, R x 12 = 6,144 sorted scores and token index,
    E x 8 = 32 counts; the offsets, E x 4, a local of GroupedExperts.forward, gone by the
    combine: 17,440), the gathered rows and the experts' output (R h x 2 = 65,536 each), the
    combine's zeros (T h x 2 = 32,768) and its fp32 copy of the output with their product
    (2 x R h x 4 = 262,144; the scatter's 65,536 + 32,768 is smaller): 443,424 (traced: the
    shared toy under full AC, 16 B over with the offsets)."""
    spec, wl, dm = _setup(recompute="full")
    (moment,) = MoE().working_set(spec, wl, dm)
    assert moment.transient_bytes == 443_424


def test_preset_defaults_torchtitan_moe_to_titan() -> None:
    """The torchtitan preset runs torchtitan's block; where it cannot express the MoE (a
    shared-expert gate: Qwen2-MoE's) memplan's reference loop, as before."""
    from memplan.api import resolve

    spec, _, _ = _setup()
    assert resolve(spec, framework="torchtitan")[2].moe_impl.value == "titan"
    gated, _, _ = _setup(num_shared_experts=1, shared_expert_ffn_hidden_size=96,
                         shared_expert_gate=True)
    assert resolve(gated, framework="torchtitan")[2].moe_impl.value == "loop"


def test_refuses_a_shared_expert_gate() -> None:
    from memplan.parallel import validate

    spec, wl, dm = _setup(num_shared_experts=1, shared_expert_ffn_hidden_size=96,
                          shared_expert_gate=True)
    with pytest.raises(LayoutError, match="moe.shared_expert_gate"):
        validate(spec, make_layout(1), wl)
    with pytest.raises(LayoutError, match="moe.shared_expert_gate"):
        MoE().saved(spec, wl, dm, wl.recompute)


def test_op_level_recompute_is_refused() -> None:
    """Op-level checkpointing (``recompute ops``) and a selective AC other than torchtitan's
    per-op SAC keep ops of the block that are not counted: refused."""
    from memplan.api import estimate
    from memplan.model.sac_ops import moe_refusal

    spec, wl, _ = _setup()
    assert "moe_impl titan" in (moe_refusal(spec, wl) or "")
    with pytest.raises(LayoutError, match="moe_impl titan with recompute ops"):
        estimate(spec, framework="torchtitan", seq_len=128, recompute="ops",
                 recompute_save="mlp")
    with pytest.raises(LayoutError, match="moe_impl titan with recompute selective"):
        estimate(spec, framework="torchtitan", seq_len=128, recompute="selective",
                 selective_impl="core")


@pytest.mark.parametrize(("shared", "experts", "kept_bytes"),
                         [(0, 4, 92_160), (48, 4, 149_504), (0, 32, 75_776)])
def test_per_op_sac_keeps_the_odd_matmuls_and_topk(shared: int, experts: int,
                                                   kept_bytes: int) -> None:
    """torchtitan's per-op SAC (``SelectiveAC._wrap_block``) over its MoE block, in bf16
    (tiny: h 64, q 64, kv 32, 4 heads, q/k/v apart; T = 256): what a MoE layer keeps beyond
    the fully recomputed layer's input. The counted matmuls are q (1st, kept: T q x 2 =
    32,768), k (2nd, rerun), v (3rd, kept: T kv x 2 = 16,384), o (4th, rerun); the router's
    gate is force-recomputed and uncounted, the grouped matmuls are not mm ops (rerun); the
    SDPA output (T q x 2 = 32,768) and its fp32 logsumexp (b heads s x 4 = 4,096); topk's
    outputs (T k x 4 = 2,048 scores, T k x 8 = 4,096 ids): 92,160. With a shared expert of f
    48 its w1 is the 5th (kept: T f x 2 = 24,576), w3 the 6th (rerun), w2 the 7th (kept: T h
    x 2 = 32,768): 149,504. (The dense MLP's w1 and w2, T 176 x 2 + T h x 2 = 122,880, are
    not kept: the block has none.) With 32 experts the gate (h x E = 64 x 32) has k's and
    v's shape, which the policy's shape match reruns uncounted: q the 1st (kept), o the 2nd:
    92,160 - 16,384 (v) = 75,776."""
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute, SelectiveImpl

    moe = {"num_shared_experts": 1, "shared_expert_ffn_hidden_size": shared} if shared else {}
    moe["num_experts"] = experts
    spec, wl, dm = _setup(recompute="selective", **moe)
    wl = wl.model_copy(update={"selective_impl": SelectiveImpl.OP})
    sac = layer_kind(spec, wl, dm, True, Recompute.SELECTIVE)
    full = layer_kind(spec, wl, dm, True, Recompute.FULL)
    assert sac.saved_bytes - full.saved_bytes == kept_bytes
    names = {t.name for t in sac.terms} - {t.name for t in full.terms}
    assert {"sac.attn.q_proj", "sac.moe.topk_scores", "sac.moe.topk_indices"} <= names
    assert ("sac.attn.v_proj" in names) is (experts == 4)
    assert not names & {"sac.mlp.w1", "sac.mlp.w2", "sac.attn.k_proj", "sac.moe.shared.w3"}


def test_compiled_in_bf16_without_shared_experts_only() -> None:
    """torchtitan's compiled block (``memplan.model.compiled.titan_moe_terms``) is traced in
    bf16 with routed experts alone: its saved set there is the eager one less the softmax,
    route_norm's operands, SiLU(gate) and the sorted scores (2,048 + 3,072 + 98,304 + 2,048
    recomputed: ``moe.router_probs`` stands as the fp32 logits, the same T E x 4), the
    experts' output bf16 (R h x 2 = 65,536, not its fp32 copy) and the combine's zeros (T h
    x 2 = 32,768) kept: 677,904 - 2,048 - 3,072 - 98,304 - 2,048 - 131,072 + 2,048 + 65,536
    + 32,768 = 541,712. fp32 is refused; shared experts under full AC are estimated."""
    from memplan.parallel import validate

    spec, wl, _ = _setup()
    compiled = wl.model_copy(update={"compile": True})
    validate(spec, make_layout(1), compiled)
    dm = Dims.of(spec, make_layout(1), compiled)
    saved = {t.name: t.size_bytes for t in MoE().saved(spec, compiled, dm, compiled.recompute)}
    assert saved["moe.expert_out"] == 65_536 and "moe.expert.act" not in saved
    assert sum(saved.values()) == 541_712
    with pytest.raises(LayoutError, match="in fp32"):
        validate(_setup("fp32")[0], make_layout(1),
                 _setup("fp32")[1].model_copy(update={"compile": True}))
    # shared experts under full AC: estimated, the forward over (TITAN_MOE_FULL_AC_LINE)
    shared, full, _ = _setup(num_shared_experts=1, shared_expert_ffn_hidden_size=96,
                             recompute="full")
    validate(shared, make_layout(1), full.model_copy(update={"compile": True}))


def test_compiled_shared_expert_saved_set_and_forward() -> None:
    """torchtitan's compiled block with a shared expert of f = 96, T = 256, h = 64, bf16,
    without recompute (validated): the shared expert saves what a compiled
    SwiGLU saves, w1's and w3's outputs and their product (3 x T f x 2 = 147,456; SiLU(w1 x)
    recomputed), beside the routed block's 541,712: 689,168. Forward
    (``moe_titan_compiled.compiled_forward``): at the combine the shared terms are not made yet
    (689,168 - 147,456 = 541,712 alive) beside the scatter output (T h x 2 = 32,768), the
    weighted rows cast back (R h x 2 = 65,536) and the sorted scores (R x 4 = 2,048):
    100,352; at the shared w2's matmul the whole saved set beside the routed output and w2's
    (2 x 32,768 = 65,536). Backward (``moe_titan_compiled.compiled_backward``) first the scores'
    gradient beside the whole saved set: two R x 4 = 4,096 B; then the shared expert's SiLU
    backward (``moe_titan_compiled._compiled_shared``) without the experts' bf16 output (R h x 2 =
    65,536), its product (T f x 2 = 49,152) and the router's tensors its backward freed
    (the fp32 input copy T h x 4 = 65,536, the logits T E x 4 = 4,096, the expert ids T k x
    8 = 4,096): 689,168 - 65,536 - 49,152 - 73,728 = 500,752, beside two T f x 2 gradients
    (98,304). At the routed experts' input gradients (``moe_titan_compiled._compiled_routed``): the
    shared terms and the block's input freed (147,456 + T h x 2 = 32,768), and as without a
    shared expert the experts' output, ids, sort index and fp32 input copy (65,536 + 8,192
    + 65,536 = 139,264), the gate's output, the product (2 x 98,304) and the rows (65,536):
    107,536, beside the shared expert's two input gradients (2 x 32,768) and w1's and w3's
    (2 x 65,536)."""
    from memplan.model import moe_titan_compiled
    from memplan.parallel import validate

    spec, wl, _ = _setup(num_shared_experts=1, shared_expert_ffn_hidden_size=96)
    compiled = wl.model_copy(update={"compile": True})
    validate(spec, make_layout(1), compiled)
    dm = Dims.of(spec, make_layout(1), compiled)
    terms = MoE().saved(spec, compiled, dm, compiled.recompute)
    saved = {t.name: t.size_bytes for t in terms}
    assert "moe.shared.act" not in saved
    assert sum(v for k, v in saved.items() if k.startswith("moe.shared.")) == 147_456
    assert sum(saved.values()) == 689_168
    moments = moe_titan_compiled.compiled_forward(spec, dm, terms, 32_768)
    assert [(m.name, m.own_bytes, m.transient_bytes) for m in moments] == [
        ("moe_combine", 541_712, 100_352), ("moe_shared_out", 689_168, 65_536)]
    backward = MoE().backward_moments(spec, compiled, dm, compiled.recompute)
    assert backward[0][:3] == ("moe_scores_grad", 689_168, 4_096)
    assert backward[1][:3] == ("moe_shared_act", 500_752, 98_304)
    assert backward[-1][:4] == ("mlp_in", 107_536, 65_536 + 131_072, ("mlp",))


def test_compiled_routed_experts_backward_in_inductors_order() -> None:
    """torchtitan's compiled block without a shared expert (tiny-moe, bf16, saved 541,712),
    its routed experts' backward as Inductor's lpmf order runs it
    (``moe_titan_compiled._compiled_routed``). Freed before the experts: their output (R h x 2 =
    65,536), the expert ids and the sort index (2 x R x 8 = 8,192) and the gate's fp32 input
    copy (T h x 4 = 65,536): 402,448 left. The router's input gradient after the experts
    (``router_grad_first``: T (h - E) x 4 - E h x 4 = 61,440 - 1,024 = 60,416 against the
    gather's R h x 2 - R x 12 = 65,536 - 6,144 = 59,392). w2's weight gradient (E f h x 2
    = 49,152, freeing the product, R f x 2 = 98,304) before the product's gradient (98,304
    B, freeing nothing): -49,152 < 98,304; so at the product's gradient 402,448 - 98,304 =
    304,144 alive beside the rows' gradient (R h x 2 = 65,536) and its own (98,304). The
    SiLU backward: the gate's output gradient (98,304) beside the product's. The input
    gradients: the gate's output, the product and the rows freed (304,144 - 98,304 -
    65,536 = 140,304), beside the gate's output gradient and w1's input gradient (98,304 +
    65,536), then w1's and w3's (2 x 65,536), written into the combine's zeros (saved):
    no T h tensor of their own."""
    from memplan.parallel import validate

    spec, wl, _ = _setup()
    compiled = wl.model_copy(update={"compile": True})
    validate(spec, make_layout(1), compiled)
    dm = Dims.of(spec, make_layout(1), compiled)
    backward = MoE().backward_moments(spec, compiled, dm, compiled.recompute)
    assert [m[:4] for m in backward] == [
        ("moe_scores_grad", 541_712, 4_096, ()),
        ("mlp", 304_144, 163_840, ("mlp_out",)),
        ("mlp_act", 304_144, 196_608, ("mlp_out",)),
        ("mlp_in_gate", 140_304, 163_840, ("mlp",)),
        ("mlp_in", 140_304, 131_072, ("mlp",))]


def test_split_gate_up_holds_three_stacked_tensors() -> None:
    """torchtitan's GroupedExperts (``MoESpec.split_gate_up``): w1 (E, f, h), w2 (E, h, f)
    and w3 (E, f, h), three tensors where transformers' stacked experts hold gate_up (E, 2f,
    h) and down: the same 3 x 4 x 96 x 64 = 73,728 elements, one tensor more (a fused AdamW
    step of 4 B)."""
    spec, _, _ = _setup(split_gate_up=True)
    fused, _, _ = _setup()
    split = [n for n in MoE().tensor_sizes(spec, 1, 1)]
    whole = [n for n in MoE().tensor_sizes(fused, 1, 1)]
    assert len(split) == len(whole) + 1 and sum(split) == sum(whole)
    assert split[1:] == [24_576] * 3


def test_per_op_sac_rerun_flops() -> None:
    """The rerun's forward FLOPs per token of one MoE layer under torchtitan's per-op SAC
    (tiny-moe, q/k/v apart): k (h kv = 2,048) and o (q h = 4,096), the router's gate (h E =
    256), the routed experts' w1, w3 and w2 for k = 2 rows (3 x 2 x h f = 36,864): 43,264
    weights x 2 = 86,528 (a dense layer: k, o and the MLP's up, h 176 = 11,264: 34,816)."""
    from memplan.planning.timing import _sac_rerun_flops
    from memplan.workload import SelectiveImpl

    spec, wl, _ = _setup(recompute="selective")
    wl = wl.model_copy(update={"selective_impl": SelectiveImpl.OP})
    assert _sac_rerun_flops(spec, wl, True) == 86_528
    assert _sac_rerun_flops(spec, wl, False) == 34_816


def test_one_rank_gather_casts_each_parameter_beside_the_previous_cast() -> None:
    """torchtitan's units at shard degree 1 under FSDP2's bf16 ``param_dtype``
    (``memplan.model.one_rank_unshard``): tiny-moe's block in torchtitan's registration order,
    elements: attention q 64 x 64 = 4,096, k and v 2,048 each, o 4,096; the MoE's w1, w2, w3
    (4 x 96 x 64 = 24,576 each, ``MoE.__init__``: the routed experts first), the router's
    gate (4 x 64 = 256); the two norms (64 each): 86,400. At the gate's cast the block but
    the gate and the norms is unsharded (86,016), w3's cast still bound (24,576) beside the
    gate's (256): 110,848 elements x 2 B = 221,696 B, above w3's own instant (61,440 +
    2 x 24,576 = 110,592) and the end's (86,400 + 64). In fp32 nothing is cast, and at two
    ranks the flat all-gather's copy-in counts the casts: 0 (not this moment)."""
    from memplan.api import resolve
    from memplan.model import moe_titan
    from memplan.model.one_rank_unshard import (gather_peak, one_rank_gather_bytes,
                                                unit_tensor_sizes)

    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**TINY_MOE).model_dump()})
    assert moe_titan.unit_tensor_sizes(spec, 1, 1, 1) == [24_576] * 3 + [256]
    _, par, wl = resolve(spec, gpus=1, zero=3, framework="torchtitan", seq_len=128,
                         micro_batch_size=2, precision="fsdp-bf16")
    sizes = unit_tensor_sizes(spec, 1, par.experts, True, True)
    assert sizes == [4_096, 2_048, 2_048, 4_096, 24_576, 24_576, 24_576, 256, 64, 64]
    assert gather_peak(sizes, 2) == 221_696
    assert gather_peak([1, 1, 10], 2) == 44  # the end: all 12 unsharded, the last cast 10
    assert one_rank_gather_bytes(spec, par, wl, [0, 1]) == 221_696
    _, par2, wl2 = resolve(spec, gpus=2, zero=3, framework="torchtitan", seq_len=128,
                           micro_batch_size=2, precision="fsdp-bf16")
    _, _, fp32 = resolve(spec, gpus=1, zero=3, framework="torchtitan", seq_len=128,
                         micro_batch_size=2, precision="fp32")
    assert one_rank_gather_bytes(spec, par2, wl2, [0, 1]) == 0
    assert one_rank_gather_bytes(spec, par, fp32, [0, 1]) == 0


def test_combine_backward_and_the_shared_input() -> None:
    """The combine's backward (R = 512 rows of h 64): the product's two fp32 gradients and
    the cast's fp32 copy, 3 x R h x 4 = 393,216 B; then the scores' gradient summed over h
    (R x 4 = 2,048) with, in a recomputed block, the product's fp32 operand (R h x 4 =
    131,072) freed before it. A shared expert's backward, the block's first, frees the
    block's input below fp32 (T h x 2 = 32,768: the router reads its own fp32 copy); in
    fp32 the router's gate keeps it (0), and without a shared expert there is none."""
    from memplan.model import moe_titan

    spec, _, dm = _setup()
    assert moe_titan.combine_backward(spec, dm) == [("moe_unsort", 393_216, 0),
                                                   ("moe_unsort_sum", 395_264, 131_072)]
    assert moe_titan.shared_input_freed(spec, dm) == 0
    shared = dict(num_shared_experts=1, shared_expert_ffn_hidden_size=96)
    spec, _, dm = _setup(**shared)
    assert moe_titan.shared_input_freed(spec, dm) == 32_768
    spec, _, dm = _setup("fp32", **shared)
    assert moe_titan.shared_input_freed(spec, dm) == 0


def test_weight_gradient_cast_with_fp32_weights() -> None:
    """fp32 weights: a grouped matmul's weight gradient is made in bf16 (E f h x 2 = 4 x 96
    x 64 x 2 = 49,152 B) beside its fp32 copy, and in a checkpointed forward the weight's
    bf16 cast (the same 49,152) is alive beside its matmul. Checkpointed, in fp32: the
    routing's tensors (17,456 as in bf16), the gathered rows (R h x 4 = 131,072), then the
    larger of the experts' at w3's matmul (the rows' bf16 cast R h x 2 = 65,536, the
    activation and w3's output 2 x R f x 2 = 196,608, w3's cast 49,152: 311,296) and the
    combine's (the experts' output R h x 4 = 131,072, the zeros T h x 4 = 65,536, the
    scatter's cast and output 131,072 + 65,536, the offsets gone: 393,200): 541,728. With
    bf16 weights nothing (the cast is the weight)."""
    from memplan.model import moe_titan

    spec, _, dm = _setup()
    assert moe_titan.weight_grad_cast_bytes(spec, dm) == 0
    spec, wl, dm = _setup("fp32", recompute="full")
    assert moe_titan.weight_grad_cast_bytes(spec, dm) == 49_152
    (moment,) = MoE().working_set(spec, wl, dm)
    assert moment.transient_bytes == 541_728


def test_compiled_full_ac_backward_moments() -> None:
    """The compiled block inside full AC (``moe_titan_compiled.full_ac_backward``), T = 256,
    R = 512, h = 64, f = 96, E = 4, kv 2 x 16, bf16. Beside both moments the rerun's wqkv
    value third (T kv x 2 = 16,384). The SiLU backward kernel: own the gate's fp32 input and
    weight copies (65,536 + 1,024), the ids and the sort index (2 x 4,096), the scores (T E x
    4 = 4,096), the gathered rows (R h x 2 = 65,536), the offsets (16), gate's and up's
    outputs (2 x 98,304): 357,392; new the output gradient's rows (65,536) and four R f x 2
    (393,216): 458,752. w1's input gradient: own the router's fp32 input gradient (65,536),
    the combine's zeros (32,768), up's output gradient (98,304), the sort index (4,096), the
    offsets (16): 217,104; new w3's and w1's input gradients (2 x 65,536). A shared expert
    (f 96): its input (T h x 2 = 32,768) freed, its two input gradients (65,536) waiting."""
    from memplan.model import moe_titan_compiled

    for shared, freed, waiting in (({}, 0, 0),
                                   ({"num_shared_experts": 1,
                                     "shared_expert_ffn_hidden_size": 96}, 32_768, 65_536)):
        spec, _, dm = _setup(**shared)
        act, inputs = moe_titan_compiled.full_ac_backward(
            spec, dm._replace(compiled=True, rerun=True))
        assert (act.own_bytes, act.transient_bytes) == (357_392 - freed, 458_752 + waiting)
        assert (inputs.own_bytes, inputs.transient_bytes) == (217_104 - freed,
                                                              131_072 + waiting)
        assert act.grads == (("moe_shared",) if shared else ()) and inputs.grads == ("mlp",)
