"""Op-level checkpointing of MoE layers (``memplan.model.sac_moe.moe_items``): transformers'
grouped experts (``moe_impl grouped``), bytes derived by hand.

tiny-moe: tiny (h 64, 4 heads / 2 KV heads, 2 layers) with every feed-forward an MoE of 4
stacked SwiGLU experts of f 96, top-2. At seq 128 and micro-batch 2 in bf16 (e = 2) a layer's
tokens are T = 256 and its routed rows R = T*k = 512: the router's logits T*E*e = 2,048
bytes, its fp32 softmax T*E*4 = 4,096; the sorted gathered rows R*h*e = 65,536; the experts'
gate/up output R*2f*e = 196,608, their SiLU and product R*f*e = 98,304 each; their down
projection's output R*h*e = 65,536.
"""

from __future__ import annotations

import pytest

from memplan.api import estimate, make_layout, make_workload
from memplan.errors import MemplanError
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.spec import ModelSpec, MoESpec, load_model
from memplan.workload import MoeImpl

TINY_MOE = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(num_experts=4, top_k=2,
                                                    expert_ffn_hidden_size=96,
                                                    stacked_experts=True).model_dump()})
FIELDS = dict(seq_len=128, micro_batch_size=2, moe_impl="grouped")


def _stage(**fields):
    return estimate(TINY_MOE, **{**FIELDS, **fields}).stages[0]


def _items(spec: ModelSpec = TINY_MOE, **fields):
    wl = make_workload(spec, **{**FIELDS, **fields}, recompute="ops")
    return ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))


def test_moe_items_by_hand() -> None:
    """The MoE block's items, their bytes (above) and FLOPs per token of the layer: the
    router 2*h*E = 512, its softmax E = 4, the gathered rows none, gate/up k*2*h*2f =
    49,152, SiLU and product k*f = 192 each, down k*2*f*h = 24,576."""
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
           for i in _items() if i.block == "mlp"}
    assert moe == {
        "moe.router": (2_048, 512.0, "matmul", 4, 0),
        "moe.router_probs": (4_096, 4.0, "softmax", 4, 0),
        # transformers 5.23: the pairs sorted first, the rows gathered once in that order
        # (hidden_states[perm // num_top_k]): the layer's first gather of width h
        "moe.dispatched": (65_536, 0.0, "index", 64, 0),
        "moe.expert.gate_up": (196_608, 49_152.0, "grouped_mm", 192, 0),
        "moe.expert.act": (98_304, 192.0, "act", 96, 0),
        "moe.expert.prod": (98_304, 192.0, "mul", 96, 0),
        "moe.expert.down": (65_536, 24_576.0, "grouped_mm", 64, 0)}


def _policy_ops(spec: ModelSpec, impl: str, precision: str = "bf16-pure") -> dict:
    """(family, width) -> how many ops of it the emitted policy counts per MoE layer."""
    from memplan.model.layer import ops_unkept
    from memplan.report.sac_policy import _counts

    wl = make_workload(spec, **{**FIELDS, "moe_impl": impl}, precision=precision,
                       recompute="ops")
    dm = Dims.of(spec, make_layout(1), wl)
    return _counts(ops_items(spec, wl, dm), ops_unkept(spec, wl, dm))


def test_moe_gathers_follow_the_implementation() -> None:
    """The gathers (``aten.index``) a policy counts per MoE layer, as each transformers
    writes integrations/moe.py ``grouped_mm_experts_forward`` (traced: Mixtral's and GLM-4.5's
    blocks, every op the emitted policy sees). 5.23 (grouped): the rows gathered once in
    sorted order (``hidden_states[perm // num_top_k]``, width h = 64: ``moe.dispatched``, the
    1st), the routing weights (``sample_weights[perm]``, width R = 512) and the unsort
    (``weighted_out[inv_perm]``, width h): 2 of width h, 1 of width R. 5.3 (grouped-token):
    the rows by token (``hidden_states[token_idx]``), ``expert_ids[perm]``, ``sample_weights[
    perm]``, the sorted copy (``moe.dispatched``, the 2nd of width h) and the unsort: 3 of
    width h, 2 of width R. Kept, ``moe.dispatched`` is R*h*e = 512*64*2 = 65,536 B per layer
    in both (2 layers: 131,072 B beyond full recompute); a policy keeping the 2nd gather of
    width h on 5.23 kept the fp32 unsort instead (R*h*4 = 131,072 B per layer)."""
    for impl, nth, widths in (("grouped", 0, (2, 1)), ("grouped-token", 1, (3, 2))):
        item = next(i for i in _items(moe_impl=impl) if i.name == "moe.dispatched")
        assert (item.size_bytes, item.op, item.width, item.nth) == (65_536, "index", 64, nth)
        counts = _policy_ops(TINY_MOE, impl)
        assert (counts[("index", 64)], counts[("index", 512)]) == widths
        full = _stage(recompute="full", moe_impl=impl).activations_bytes
        kept = _stage(recompute="ops", recompute_save="moe.dispatched", moe_impl=impl)
        assert kept.activations_bytes - full == 2 * 65_536


def test_moe_casts_follow_the_router() -> None:
    """The ``_to_copy`` ops a policy counts in an MoE layer of width h = 64 (the two upcast
    RMSNorms' two casts each, then the block's): in bf16 the weighted rows are fp32 by type
    promotion (the routing weights fp32), so the block casts its sum back
    (``final_hidden_states.to(hidden_states.dtype)``): 5; where the router cast its top-k
    weights to the logits' dtype (``router_weights_cast``: transformers 5.23's Qwen2-/Qwen3-MoE
    ``TopKRouter.forward``, ``router_top_value.to(router_logits.dtype)``, a copy of width
    k = 2) the rows stay bf16 and that cast is a no-op: 4. In fp32 none casts at all."""
    cast = TINY_MOE.model_copy(update={"moe": TINY_MOE.moe.model_copy(update={
        "router_weights_cast": True})})
    for impl in ("grouped", "grouped-token"):
        plain, with_cast = _policy_ops(TINY_MOE, impl), _policy_ops(cast, impl)
        assert (plain[("copy", 64)], plain.get(("copy", 2), 0)) == (5, 0)
        assert (with_cast[("copy", 64)], with_cast[("copy", 2)]) == (4, 1)
        assert ("copy", 2) not in _policy_ops(cast, impl, "fp32")


def test_moe_save_list_adds_its_bytes_per_layer() -> None:
    """The experts' gate/up output and the router's logits kept in each of the 2 layers:
    2 * (196,608 + 2,048) bytes beyond full recompute's saved activations; the group
    ``mlp`` keeps the whole MoE block: 2 * 530,432."""
    full = _stage(recompute="full").activations_bytes
    kept = _stage(recompute="ops", recompute_save="moe.expert.gate_up,moe.router")
    assert kept.activations_bytes - full == 2 * (196_608 + 2_048)
    whole = _stage(recompute="ops", recompute_save="mlp").activations_bytes - full
    assert whole == 2 * (2_048 + 4_096 + 65_536 + 196_608 + 2 * 98_304 + 65_536)


def test_moe_term_names_and_scope() -> None:
    """A saved term's name keeps the item that makes it (``moe.expert.up``: the gate/up
    output; ``moe.expert_out``: the down projection's); ``moe:`` scopes the MoE layers."""
    full = _stage(recompute="full").activations_bytes
    assert _stage(recompute="ops", recompute_save="moe.expert.up").activations_bytes - full \
        == 2 * 196_608
    assert _stage(recompute="ops", recompute_save="moe:moe.expert_out").activations_bytes \
        - full == 2 * 65_536


def test_moe_forward_peak_at_the_unsort() -> None:
    """The checkpointed MoE block's two moments as transformers 5.23 writes the grouped
    experts, beside the routing tensors bound to the end (probabilities T*E*4 = 4,096, top-k
    indices R*8 = 4,096 and weights R*4 + T*4 = 3,072, the sort index 4,096, the unsort index
    4,096 from the down projection on, routing weights R*4 = 2,048: 17,408 at the gate, 21,504
    at the unsort), the function's index locals (the sorted expert ids R*8 = 4,096 and their
    histc copy R*4 = 2,048) and the rows gathered once (65,536): at the gate the gate/up
    output, SiLU and product (4 * R*f*e = 393,216): 482,304, the larger; at the unsort the
    down output (65,536), the weighted rows and their unsorted copy in fp32 (2 * R*h*4 =
    262,144), the product freed: 420,864. Keeping the gate/up output (R*2f*e = 196,608) adds it
    at the unsort (the rerun had freed it there): 617,472, 135,168 above keeping nothing;
    keeping the product (98,304) adds it there too: 519,168, 36,864 above. As 5.3 wrote them
    (grouped-token: a token index bound, the rows gathered by token and copied sorted, the
    product alive at the unsort) 556,032 and 588,800."""
    from memplan.model.layer import layer_kind
    from memplan.model.moe import grouped_kept_moments
    from memplan.workload import Recompute

    wl = make_workload(TINY_MOE, **FIELDS, recompute="ops")
    dm = Dims.of(TINY_MOE, make_layout(1), wl)
    assert [value for value, _ in grouped_kept_moments(TINY_MOE, dm)] == [482_304, 420_864]
    assert [value for value, _ in grouped_kept_moments(TINY_MOE, dm, MoeImpl.GROUPED_TOKEN)
            ] == [556_032, 588_800]

    def peak(save: str) -> int:
        swl = wl.model_copy(update={"recompute_save": tuple(save.split(",")) if save else ()})
        return layer_kind(TINY_MOE, swl, dm, True, Recompute.OPS).forward_peak_bytes

    assert peak("moe.expert.gate_up") - peak("") == 135_168
    assert peak("moe.expert.prod") - peak("") == 36_864


def test_moe_rerun_flops_by_hand() -> None:
    """Keeping nothing, an MoE layer reruns its attention and norms (8,192 + 2*4,096 +
    16,384 + 8,192 + 8*64 = 41,472, as a dense tiny layer) and the MoE block's 512 + 4 +
    49,152 + 2*192 + 24,576 = 74,628: the experts' down projection reruns (the routing
    weights' product saves its output)."""
    items = _items()
    assert sac_ops.rerun_flops_per_token(items, ()) == 41_472 + 74_628


@pytest.mark.parametrize(("fields", "why"), [
    (dict(moe_impl="parallel"), "moe_impl parallel"),
    (dict(moe_impl="every"), "moe_impl every"),
    # 1 x 1 token routes k = 2 rows to 4 experts: two receive none and skip their ops
    (dict(moe_impl="loop", seq_len=1, micro_batch_size=1), "2 routed rows a micro-batch"),
])
def test_moe_refused_where_not_modelled(fields: dict, why: str) -> None:
    with pytest.raises(MemplanError, match=why):
        estimate(TINY_MOE, **{"seq_len": 128, "micro_batch_size": 2, **fields},
                 recompute="ops")


def test_loop_items_by_hand() -> None:
    """memplan's reference loop (``moe_impl loop``, the default: memplan/profile/reference.py
    MoE.forward; ``sac_moe._loop_ops``), R = 512 routed rows over 4 experts. The router's
    logits T*E*e = 2,048 B and fp32 softmax T*E*4 = 4,096 B, once; each expert's ops once per
    expert (``repeat`` 4), their bytes over all R rows: the gathered rows ``flat[rows]``
    R*h*e = 65,536, gate, SiLU, up, product R*f*e = 98,304 each, the down projection's output
    65,536, the weights' gather ``weights[rows, slot, None]`` (width 1) R*e = 1,024 and the
    weighted rows 65,536. Indices: the expert's first gather of width h is the layer's 1st;
    its gate and up the 1st and 2nd 96-wide matmuls, 2 an expert (``stride``); its down the
    layer's 3rd 64-wide matmul (after q and the output projection; k and v are 32 wide); its
    weighting the 5th 64-wide product (after the two upcast RMSNorms' two each). FLOPs per
    token: router 2*h*E = 512, softmax E = 4, gate, up and down k*2*h*f = 24,576, SiLU and
    product k*f = 192, the weighting k*h = 128."""
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.repeat, i.stride)
           for i in _items(moe_impl="loop", precision="bf16-pure") if i.block == "mlp"}
    assert moe == {
        "moe.router": (2_048, 512.0, "matmul", 4, 0, 1, 0),
        "moe.router_probs": (4_096, 4.0, "softmax", 4, 0, 1, 0),
        "moe.dispatched": (65_536, 0.0, "index", 64, 0, 4, 1),
        "moe.expert.gate": (98_304, 24_576.0, "matmul", 96, 0, 4, 2),
        "moe.expert.act": (98_304, 192.0, "act", 96, 0, 4, 1),
        "moe.expert.up": (98_304, 24_576.0, "matmul", 96, 1, 4, 2),
        "moe.expert.prod": (98_304, 192.0, "mul", 96, 0, 4, 1),
        "moe.expert.down": (65_536, 24_576.0, "matmul", 64, 2, 4, 1),
        "moe.routing_weights": (1_024, 0.0, "index", 1, 0, 4, 1),
        "moe.combine_in": (65_536, 128.0, "mul", 64, 4, 4, 1)}


def test_loop_policy_names_each_expert() -> None:
    """The emitted policy keeps each expert's run of a kept op: the up projection is the
    2nd, 4th, 6th and 8th 96-wide matmul (indices 1, 3, 5, 7); per layer it counts 8 of
    them, 4 SiLUs, 4 gathers of width h and of width 1, and in bf16 the router's two casts
    (its logits to fp32, width E = 4; the top-k weights back, width k = 2). Kept, the up
    projections add R*f*e = 98,304 B a layer beyond full recompute (2 layers)."""
    from memplan.report.sac_policy import _save_set

    items = _items(moe_impl="loop", precision="bf16-pure")
    up = tuple(i for i in items if i.name == "moe.expert.up")
    assert _save_set(up) == "{('matmul', 96, 1), ('matmul', 96, 3), ('matmul', 96, 5), " \
        "('matmul', 96, 7)}"
    counts = _policy_ops(TINY_MOE, "loop")
    assert [counts[k] for k in (("matmul", 96), ("act", 96), ("index", 64), ("index", 1),
                                ("copy", 4), ("copy", 2))] == [8, 4, 4, 4, 1, 1]
    full = _stage(recompute="full", moe_impl="loop", precision="bf16-pure").activations_bytes
    kept = _stage(recompute="ops", recompute_save="moe.expert.up", moe_impl="loop",
                  precision="bf16-pure").activations_bytes
    assert kept - full == 2 * 98_304


def test_loop_refused_with_what_the_reference_does_not_run() -> None:
    """The loop refuses a router it does not run (ERNIE 4.5's fp32 weight: the reference
    builds the router's weight in the model's dtype); shared experts as wide as the hidden
    size share the norms' products' width."""
    shared = {"num_shared_experts": 1, "shared_expert_ffn_hidden_size": 128}
    for update, why in (({**shared, "shared_expert_ffn_hidden_size": 64},
                         "shared experts as wide as the hidden size"),
                        ({"router_fp32": True, "router_weight_fp32": True},
                         "moe_impl loop and a router")):
        spec = TINY_MOE.model_copy(update={"moe": TINY_MOE.moe.model_copy(update=update)})
        with pytest.raises(MemplanError, match=why):
            estimate(spec, seq_len=128, micro_batch_size=2, moe_impl="loop", recompute="ops")


LOOP_SHARED = TINY_MOE.model_copy(update={"name": "tiny-moe-loop-shared",
                                          "moe": TINY_MOE.moe.model_copy(update={
                                              "num_shared_experts": 1,
                                              "shared_expert_ffn_hidden_size": 96})})


def test_loop_shared_items_by_hand() -> None:
    """The reference loop's shared MLP (memplan/profile/reference.py MoE.forward: ``out = out +
    self.shared(flat)`` after the loop; ``sac_moe._loop_shared_ops``), f_s 96 over T = 256
    tokens in bf16: gate, SiLU, up and product T*f_s*e = 49,152 B each, once (``repeat`` 1).
    FLOPs per token: gate and up 2*h*f_s = 12,288, SiLU and product f_s = 96. Indices after
    every expert's (4 experts): its gate and up the 9th and 10th 96-wide matmuls (indices 8,
    9: each expert runs two), its SiLU the 5th 96-wide act, its product the 5th 96-wide
    product. The policy counts per layer 10 96-wide matmuls, 5 SiLUs, 5 96-wide products and
    7 64-wide matmuls (q, the output projection, 4 experts' and the shared down projection)."""
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.repeat, i.stride)
           for i in _items(LOOP_SHARED, moe_impl="loop", precision="bf16-pure")
           if i.name.startswith("moe.shared")}
    assert moe == {
        "moe.shared.gate": (49_152, 12_288.0, "matmul", 96, 8, 1, 0),
        "moe.shared.act": (49_152, 96.0, "act", 96, 4, 1, 0),
        "moe.shared.up": (49_152, 12_288.0, "matmul", 96, 9, 1, 0),
        "moe.shared.prod": (49_152, 96.0, "mul", 96, 4, 1, 0)}
    counts = _policy_ops(LOOP_SHARED, "loop")
    assert [counts[k] for k in (("matmul", 96), ("act", 96), ("mul", 96), ("matmul", 64))] \
        == [10, 5, 5, 7]


def test_loop_shared_forward_moments_by_hand() -> None:
    """The checkpointed forward at the shared MLP (``moe._loop_shared_moments``), bf16, T =
    256, r = T*k/E = 128 rows an expert: beside the last expert's weighted rows ``y`` (r*h*e =
    16,384) at its product SiLU's, up's and the product's outputs (3*T*f_s*e = 147,456):
    163,840; at its down projection the product and the output (49,152 + T*h*e = 32,768):
    98,304; at ``out + shared`` the output and the new sum (2*32,768): 81,920. The loop's
    locals bound beside them (``_loop_locals``): the fp32 probabilities T*E*4 = 4,096, ``out``
    32,768, the top-k indices and cast weights T*k*(8 + 2) = 5,120 and the last expert's row
    and slot indices 2*r*8 = 2,048: 44,032. The largest expert moment (its product: ``y``
    before, ``flat[rows]``, 3*r*f*e: 16,384 + 16,384 + 73,728 = 106,496) is below the shared
    product's, so the block's working set is 44,032 + 163,840 = 207,872. Kept, the shared
    gate's output is alive beyond the product's moment; at the sum all four are."""
    from memplan.model.moe import MoE, _loop_shared_moments, loop_kept_moments

    wl = make_workload(LOOP_SHARED, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(LOOP_SHARED, make_layout(1), wl)
    assert _loop_shared_moments(LOOP_SHARED, dm) == (163_840, 98_304, 81_920)
    assert MoE().working_set(LOOP_SHARED, wl, dm)[0].transient_bytes == 207_872
    moments = loop_kept_moments(LOOP_SHARED, dm)[-3:]
    assert [value for value, _ in moments] == [207_872, 142_336, 125_952]
    shared = [{n for n in adds if n.startswith("moe.shared")} for _, adds in moments]
    assert shared == [{"moe.shared.gate"}, {"moe.shared.gate", "moe.shared.act", "moe.shared.up"},
                      {"moe.shared.gate", "moe.shared.act", "moe.shared.up", "moe.shared.prod"}]


LOOP_GATED = LOOP_SHARED.model_copy(update={"name": "tiny-moe-loop-gated",
                                            "moe": LOOP_SHARED.moe.model_copy(update={
                                                "shared_expert_gate": True})})


def test_loop_shared_gate_items_by_hand() -> None:
    """The reference loop's shared MLP behind Qwen2-MoE's gate (``torch.sigmoid(self.
    shared_gate(flat)) * shared`` after the shared MLP; ``sac_moe._loop_shared_ops``), bf16,
    T = 256, f_s 96: the shared down projection's output, saved by the gate's product,
    T*h*e = 32,768 B (``moe.shared.down``: the layer's 7th 64-wide matmul, after q, the
    output projection and the 4 experts' down projections; 2*h*f_s = 12,288 FLOPs a token);
    the gate's h -> 1 projection T*1*e = 512 B (2*h = 128 FLOPs) and its sigmoid 512 B (1
    FLOP), the layer's first ops of width 1 of their families. The policy counts per layer 7
    64-wide matmuls and 9 64-wide products (the two upcast RMSNorms' two each, the 4
    experts' weightings and the gate's product)."""
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.repeat)
           for i in _items(LOOP_GATED, moe_impl="loop", precision="bf16-pure")
           if i.name in ("moe.shared.down", "moe.shared_gate_proj", "moe.shared_gate")}
    assert moe == {"moe.shared.down": (32_768, 12_288.0, "matmul", 64, 6, 1),
                   "moe.shared_gate_proj": (512, 128.0, "matmul", 1, 0, 1),
                   "moe.shared_gate": (512, 1.0, "act", 1, 0, 1)}
    counts = _policy_ops(LOOP_GATED, "loop")
    assert (counts[("matmul", 64)], counts[("mul", 64)]) == (7, 9)


def test_loop_shared_gate_forward_moments_by_hand() -> None:
    """The gate's product in the checkpointed forward (``moe._loop_shared_moments``), bf16,
    T = 256: beside the last expert's ``y`` (16,384) the shared output and the product (2 *
    T*h*e = 65,536) and the sigmoid (T*e = 512): 82,432, between the down projection's
    98,304 and the sum's 81,920 (``test_loop_shared_forward_moments_by_hand``); with the
    loop's bound locals (44,032) 126,464. Kept, the gate projection's output is alive beyond
    the product's moment; at the sum the sigmoid's and the down projection's too."""
    from memplan.model.moe import _loop_shared_moments, loop_kept_moments

    wl = make_workload(LOOP_GATED, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(LOOP_GATED, make_layout(1), wl)
    assert _loop_shared_moments(LOOP_GATED, dm) == (163_840, 98_304, 82_432, 81_920)
    moments = loop_kept_moments(LOOP_GATED, dm)[-2:]
    assert [value for value, _ in moments] == [126_464, 125_952]
    gate = [{n for n in adds if n.startswith("moe.shared_") or n == "moe.shared.down"}
            for _, adds in moments]
    assert gate == [{"moe.shared_gate_proj"},
                    {"moe.shared_gate_proj", "moe.shared_gate", "moe.shared.down"}]


def test_loop_fp32_router_by_hand() -> None:
    """The reference loop behind an fp32 router (``router_fp32``: memplan/profile/reference.py
    Fp32Linear, DeepseekV3TopkRouter.forward's F.linear on fp32 copies; ``sac_moe.
    _loop_fp32_casts``), bf16, T = 256: the input's copy T*h*4 = 65,536 B (h = 64 FLOPs a
    token) and the weight's E*h*4 = 1,024 B (E*h/T = 1 FLOP a token), the layer's 5th and
    6th 64-wide copies (after the two upcast RMSNorms' two each), both kept beyond the
    block's working set; the logits fp32, T*E*4 = 4,096 B, and no cast of them (the
    policy counts no 4-wide copy, the weights' cast back still). In the checkpointed
    forward the linear's moment holds the two copies and the logits, 70,656 B, nothing of
    the loop made yet; the last expert's product (44,032 B of the loop's locals and 106,496
    of the expert's: ``test_loop_shared_forward_moments_by_hand``) stays the working set's,
    150,528."""
    from memplan.model.moe import BEFORE_LOOP, MoE, loop_kept_moments

    spec = TINY_MOE.model_copy(update={"name": "tiny-moe-fp32-router", "moe": TINY_MOE.moe
                                       .model_copy(update={"router_fp32": True})})
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.own_extra)
           for i in _items(spec, moe_impl="loop", precision="bf16-pure")
           if i.name.startswith("moe.router")}
    assert moe == {"moe.router_input_fp32": (65_536, 64.0, "copy", 64, 4, True),
                   "moe.router_weight_fp32": (1_024, 1.0, "copy", 64, 5, True),
                   "moe.router": (4_096, 512.0, "matmul", 4, 0, True),
                   "moe.router_probs": (4_096, 4.0, "softmax", 4, 0, False)}
    counts = _policy_ops(spec, "loop")
    assert (counts[("copy", 64)], counts.get(("copy", 4), 0), counts[("copy", 2)]) == (6, 0, 1)
    wl = make_workload(spec, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(spec, make_layout(1), wl)
    assert loop_kept_moments(spec, dm)[0] == (70_656, frozenset({BEFORE_LOOP}))
    assert MoE().working_set(spec, wl, dm)[0].transient_bytes == 150_528


def test_loop_topk_softmax_router_by_hand() -> None:
    """The reference loop behind a softmax of the top-k logits (``router_topk_softmax``:
    memplan/profile/reference.py MoE._route), bf16, T = 256, R = T*k = 512. Granite's
    (``router_logits_fp32``, ``router_weights_cast``): the logits T*E*e = 2,048 B, their
    ``.float()`` (a 4-wide copy), the softmax of the k (``moe.topk_weights``, width 2, fp32:
    R*4 = 2,048 B, k = 2 FLOPs a token), its cast back (a 2-wide copy); the held fp32 logits
    T*E*4 = 4,096 B take the place of Mixtral's probabilities among the loop's locals
    (44,032 B). GPT-OSS's (biased, its softmax in the logits' dtype): no copies, nothing
    held: the locals 4,096 B fewer, 39,936. Kept below fp32, Granite's fp32 softmax output
    is alive beyond the experts' moments (its cast is the weights the loop reads)."""
    from memplan.model.moe import _loop_locals, loop_kept_moments

    def variant(**update) -> ModelSpec:
        return TINY_MOE.model_copy(update={"name": "tiny-moe-topk", "moe": TINY_MOE.moe
                                           .model_copy(update={"router_topk_softmax": True,
                                                               **update})})

    granite = variant(router_logits_fp32=True, router_weights_cast=True)
    gpt_oss = variant(router_bias=True)
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
           for i in _items(granite, moe_impl="loop", precision="bf16-pure")
           if i.name in ("moe.router", "moe.topk_weights")}
    assert moe == {"moe.router": (2_048, 512.0, "matmul", 4, 0),
                   "moe.topk_weights": (2_048, 2.0, "softmax", 2, 0)}
    ops = [{k: v for k, v in _policy_ops(spec, "loop").items() if k in (
        ("copy", 4), ("copy", 2), ("softmax", 2), ("softmax", 4))} for spec in (granite, gpt_oss)]
    assert ops == [{("copy", 4): 1, ("copy", 2): 1, ("softmax", 2): 1}, {("softmax", 2): 1}]
    wl = make_workload(granite, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(granite, make_layout(1), wl)
    assert [_loop_locals(spec, dm, 128)[0] for spec in (granite, gpt_oss)] == [44_032, 39_936]
    assert all("moe.topk_weights" in adds for _, adds in loop_kept_moments(granite, dm))


def test_loop_held_logits_and_clamped_sum_by_hand() -> None:
    """ERNIE 4.5's router variants in the reference loop (memplan/profile/reference.py
    MoE._route), bf16, T = 256, E = 4: the sum clamped from below (``router_norm_clamped``)
    adds an ``aten.clamp`` of width 1 the policy counts; the held logits
    (``router_logits_held``) stay bound beside Mixtral's fp32 probabilities (4,096 B): of the
    model's dtype behind a plain linear, T*E*e = 2,048 B (the loop's locals 44,032 + 2,048 =
    46,080), fp32 behind an fp32 linear (``router_fp32``), T*E*4 = 4,096 B (48,128), beside
    the rerun's stop too. Held, the logits are the linear's own output: kept, ``moe.router``
    adds nothing beyond the block's moments (not among any moment's kept names)."""
    from memplan.model.moe import MoE, _loop_locals, loop_kept_moments

    def variant(**update) -> ModelSpec:
        return TINY_MOE.model_copy(update={"name": "tiny-moe-held", "moe": TINY_MOE.moe
                                           .model_copy(update={"router_logits_held": True,
                                                               **update})})

    held, ernie = variant(), variant(router_fp32=True, router_norm_clamped=True,
                                     router_weights_cast=True)
    assert _policy_ops(ernie, "loop")[("clamp", 1)] == 1
    assert ("clamp", 1) not in _policy_ops(held, "loop")
    wl = make_workload(held, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(held, make_layout(1), wl)
    assert [_loop_locals(spec, dm, 128)[0] for spec in (held, ernie)] == [46_080, 48_128]
    assert all("moe.router" not in adds for spec in (held, ernie)
               for _, adds in loop_kept_moments(spec, dm))
    plain = MoE().rebuild_moments(TINY_MOE, wl, dm)
    rerun = MoE().rebuild_moments(ernie, wl, dm)
    assert [m.transient_bytes - p.transient_bytes for m, p in zip(rerun, plain)] == [4_096] * 2


SHARED = TINY_MOE.model_copy(update={"name": "tiny-moe-shared", "moe": TINY_MOE.moe.model_copy(
    update={"num_shared_experts": 1, "shared_expert_ffn_hidden_size": 128,
            "shared_expert_gate": True})})


def _shared_items(spec: ModelSpec) -> dict:
    wl = make_workload(spec, **FIELDS, recompute="ops")
    items = ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))
    return {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
            for i in items if "shared" in i.name}


def test_shared_expert_items_by_hand() -> None:
    """Qwen2-MoE's shared expert (Qwen2MoeSparseMoeBlock.forward: the shared MLP first, the
    router and experts, then ``sigmoid(shared_expert_gate(x)) * shared_out``), f_s 128 over
    T = 256 tokens: gate, SiLU, up and product T*f_s*e = 65,536 B each; the down
    projection's output T*h*e = 32,768 B (``moe.shared_out``, which the gate's product
    saves); the gate's h -> 1 projection T*e = 512 B, its sigmoid 512 B. FLOPs per token:
    gate, up, down 2*64*128 = 16,384; SiLU and product 128; the gate projection 2*64 = 128,
    the sigmoid 1. Indices: the shared down is the layer's 3rd 64-wide matmul (after q and
    the output projection)."""
    assert _shared_items(SHARED) == {
        "moe.shared.gate": (65_536, 16_384.0, "matmul", 128, 0),
        "moe.shared.act": (65_536, 128.0, "act", 128, 0),
        "moe.shared.up": (65_536, 16_384.0, "matmul", 128, 1),
        "moe.shared.prod": (65_536, 128.0, "mul", 128, 0),
        "moe.shared.down": (32_768, 16_384.0, "matmul", 64, 2),
        "moe.shared_gate_proj": (512, 128.0, "matmul", 1, 0),
        "moe.shared_gate": (512, 1.0, "act", 1, 0)}


def test_shared_experts_last_run_after_the_routed_ones() -> None:
    """DeepSeek-V3's order (``shared_experts_last``: ``hidden_states +
    self.shared_experts(residuals)`` after the experts), ungated: the shared MLP's four items
    follow the routed experts', and its down projection, last and saved by no one, never reruns
    (early stop): no item."""
    last = SHARED.model_copy(update={"moe": SHARED.moe.model_copy(update={
        "shared_expert_gate": False, "shared_experts_last": True})})
    wl = make_workload(last, **FIELDS, recompute="ops")
    names = [i.name for i in ops_items(last, wl, Dims.of(last, make_layout(1), wl))
             if i.block == "mlp"]
    assert names.index("moe.expert.down") < names.index("moe.shared.gate")
    assert names[-4:] == ["moe.shared.gate", "moe.shared.act", "moe.shared.up",
                          "moe.shared.prod"]


def test_shared_items_add_their_bytes_and_forward() -> None:
    """The shared gate projection and the shared SiLU kept in each of the 2 layers:
    2 x (65,536 + 512) B beyond full recompute. Kept, the SiLU (made before the router)
    adds to both of the MoE block's moments: the forward peak 65,536 B higher; the shared
    down projection's output is there anyway (it waits for the gate: nothing added)."""
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute

    def stage(**fields):
        return estimate(SHARED, **FIELDS, **fields).stages[0]

    full = stage(recompute="full").activations_bytes
    kept = stage(recompute="ops", recompute_save="moe.shared_gate_proj,moe.shared.act")
    assert kept.activations_bytes - full == 2 * (65_536 + 512)
    wl = make_workload(SHARED, **FIELDS, recompute="ops")
    dm = Dims.of(SHARED, make_layout(1), wl)

    def peak(save: str) -> int:
        swl = wl.model_copy(update={"recompute_save": tuple(save.split(",")) if save else ()})
        return layer_kind(SHARED, swl, dm, True, Recompute.OPS).forward_peak_bytes

    assert peak("moe.shared.act") - peak("") == 65_536
    assert peak("moe.shared.down") == peak("")


def test_shared_gate_policy_names_sigmoid() -> None:
    """The torch policy names the shared gate's sigmoid as an activation of width 1."""
    from memplan.report.sac_policy import emit_for

    est = estimate(SHARED, **FIELDS, recompute="ops", recompute_save="moe.shared_gate")
    text = emit_for("torch", est)
    compile(text, "policy.py", "exec")
    assert "SAVE = {('act', 1, 0)}" in text and "_aten.sigmoid.default" in text


def test_sigmoid_router_items_by_hand() -> None:
    """DeepSeek-V3's router (GLM-4.5's: an fp32 router with shared experts last,
    ``sac_moe.sigmoid_router``): ``F.linear`` on fp32 copies of the input (T*h*4 = 65,536 B)
    and the weight (E*h*4 = 1,024 B), its fp32 logits (T*E*4 = 4,096 B) and their sigmoid
    (4,096 B). FLOPs per token: the input cast 64, the weight's E*h/T = 1, the projection
    2*h*E = 512, the sigmoid 4. The casts are the layer's 4th and 5th 64-wide ``_to_copy``
    (after the two norms' two each); a softmax router's fp32 copy refused by name."""
    spec = SHARED.model_copy(update={"moe": SHARED.moe.model_copy(update={
        "shared_expert_gate": False, "shared_experts_last": True, "router_fp32": True})})
    wl = make_workload(spec, **FIELDS, recompute="ops")
    items = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
             for i in ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))
             if i.name.startswith("moe.router")}
    assert items == {"moe.router_input_fp32": (65_536, 64.0, "copy", 64, 4),
                     "moe.router_weight_fp32": (1_024, 1.0, "copy", 64, 5),
                     "moe.router": (4_096, 512.0, "matmul", 4, 0),
                     "moe.router_probs": (4_096, 4.0, "act", 4, 0)}
    first = spec.model_copy(update={"moe": spec.moe.model_copy(update={
        "shared_experts_last": False})})
    with pytest.raises(MemplanError, match="an fp32 softmax router"):
        estimate(first, **FIELDS, recompute="ops")


SHARED_LAST = SHARED.model_copy(update={"moe": SHARED.moe.model_copy(update={
    "shared_expert_gate": False, "shared_experts_last": True, "router_fp32": True})})


@pytest.mark.parametrize(("precision", "unsort", "rerun"), [
    # bf16: the shared MLP's gate, SiLU, up and product T*f_s*e = 65,536 B each (262,144)
    # and the block's input T*h*e = 32,768 freed; the unsort's zeros, index_put and the
    # expanded gradient's copy R*h*4 = 131,072 each in the fp32 router's width, with the
    # shared input's gradient T*h*e = 32,768; the rerun's unsort: the weighted rows and their
    # unsorted copy (262,144), the post-attention residual (T*h*e, its norm saves an fp32
    # copy) and the locals R*(8 + 4) = 6,144
    ("bf16-mixed", (705_088, 425_984), (737_856, 301_056)),
    # fp32: the shared terms 4 * 131,072 = 524,288 (the router's F.linear saves the input
    # itself: not freed), the waiting gradient T*h*4 = 65,536, no residual beside the rerun
    ("fp32", (475_712, 458_752), (475_712, 268_288)),
])
def test_shared_experts_last_unsort_by_hand(precision: str, unsort: tuple,
                                            rerun: tuple) -> None:
    """Grouped experts before shared experts run last (DeepseekV3MoE.forward), T = 256, R =
    512, h 64, f_s 128, a block saving 1,000,000 B: at the unsort's backward the shared MLP's
    terms are freed (and below fp32 the block's input, which the fp32 router copied) and its
    weights' gradients exist (``moe_shared``); the rerun's unsort, before the shared MLP is
    rebuilt, is a moment of its own."""
    from memplan.model import moe

    wl = make_workload(SHARED_LAST, **FIELDS, precision=precision, recompute="ops")
    dm = Dims.of(SHARED_LAST, make_layout(1), wl)
    first = moe._shared_last_unsort(SHARED_LAST, dm, 1_000_000)[0]
    assert (first.name, first.own_bytes, first.transient_bytes, first.grads) == (
        "moe_unsort", *unsort, ("moe_shared",))
    (moment,) = moe.grouped_rerun(SHARED_LAST, wl, dm, 1_000_000)
    assert (moment.name, moment.own_bytes, moment.transient_bytes) == ("moe_rerun", *rerun)


@pytest.mark.parametrize(("precision", "added"), [("bf16-mixed", 131_072), ("fp32", 262_144)])
def test_kept_shared_outputs_are_alive_at_the_rerun_unsort(precision: str, added: int) -> None:
    """Kept shared-expert outputs are alive from the forward (the checkpoint's cache) at the
    rerun's unsort, which has not rebuilt them yet: the gate's and up projection's outputs,
    T*f_s*e = 65,536 B each in bf16 (131,072 in fp32), add there and nowhere else."""
    from memplan.model.layer import ops_kind

    def moments(save: tuple[str, ...]) -> dict:
        wl = make_workload(SHARED_LAST, **FIELDS, precision=precision, recompute="ops",
                           recompute_save=",".join(save))
        dm = Dims.of(SHARED_LAST, make_layout(1), wl)
        return {m.name: m.alive_bytes for m in ops_kind(SHARED_LAST, wl, dm, True, "").moments}

    none, kept = moments(()), moments(("moe.shared.gate", "moe.shared.up"))
    assert {n: kept[n] - none[n] for n in none if kept[n] != none[n]} == {"moe_rerun": added}


GRANITE = TINY_MOE.model_copy(update={"name": "tiny-granite", "fused_gate_up": True,
                                      "moe": TINY_MOE.moe.model_copy(update={
                                          "router_topk_softmax": True,
                                          "router_logits_fp32": True,
                                          "router_weights_cast": True})})


@pytest.mark.parametrize(("precision", "router", "casts", "peak_added"), [
    ("bf16-pure", 2_048, {("copy", 4): 1, ("copy", 2): 1}, 2_048),
    ("fp32", 4_096, {}, 0)])
def test_topk_softmax_router_items_by_hand(precision: str, router: int, casts: dict,
                                           peak_added: int) -> None:
    """Granite's router as transformers 5.23 writes it (GraniteMoeTopKRouter.forward:
    ``F.linear(x, w).float()``, ``topk``, the softmax of the k kept, ``.type_as(x)``) in
    tiny-granite (tiny-moe with its fused gate/up and Granite's router flags): its projection's
    logits T*E*e (bf16: 256*4*2 = 2,048 B; fp32: 4,096 B), 2*h*E = 512 FLOPs a token, an mm of
    width E = 4; the softmax of the top-k, saved by itself in fp32 (the logits were cast to
    it): R*4 = 512*4 = 2,048 B, k = 2 FLOPs a token, an ``aten._softmax`` of width k = 2 (the
    layer's only one), where Mixtral's softmaxes every expert (T*E*4 = 4,096 B, width E).
    In bf16 the policy counts the logits' cast to fp32 (``_to_copy``, width E = 4) and the
    weights' cast back (width k = 2); in fp32 neither is an op. Kept, the softmax adds its
    2,048 B per layer (2 layers: 4,096 B beyond full recompute; with the router's logits,
    2 * (2,048 + 2,048) = 8,192 in bf16, 2 * (4,096 + 2,048) = 12,288 in fp32); to the
    layer's forward peak in bf16 its 2,048 B (the checkpointed block had freed it once
    ``.type_as`` cast it), in fp32 nothing (it is the weights the experts read, bound to the
    block's end)."""
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute

    fields = dict(precision=precision)
    router_items = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth)
                    for i in _items(GRANITE, **fields) if i.name.startswith("moe.router")
                    or i.name == "moe.topk_weights"}
    assert router_items == {"moe.router": (router, 512.0, "matmul", 4, 0),
                            "moe.topk_weights": (2_048, 2.0, "softmax", 2, 0)}
    counts = _policy_ops(GRANITE, "grouped", precision)
    assert {k: v for k, v in counts.items() if k in (("copy", 4), ("copy", 2))} == casts
    assert counts[("softmax", 2)] == 1 and ("softmax", 4) not in counts
    full = estimate(GRANITE, **FIELDS, **fields, recompute="full").stages[0].activations_bytes

    def saved(save: str) -> int:
        return estimate(GRANITE, **FIELDS, **fields, recompute="ops",
                        recompute_save=save).stages[0].activations_bytes - full

    assert saved("moe.topk_weights") == 2 * 2_048
    assert saved("moe.topk_weights,moe.router") == 2 * (router + 2_048)
    wl = make_workload(GRANITE, **FIELDS, **fields, recompute="ops")
    dm = Dims.of(GRANITE, make_layout(1), wl)

    def peak(save: str) -> int:
        swl = wl.model_copy(update={"recompute_save": tuple(save.split(",")) if save else ()})
        return layer_kind(GRANITE, swl, dm, True, Recompute.OPS).forward_peak_bytes

    assert peak("moe.topk_weights") - peak("") == peak_added


# GPT-OSS narrowed as tests/traced/test_sac_policy.py's toy: h = f = 128, 4 / 2 heads of 32,
# 4 experts, top-2, a 32-token window on the first layer, the second full
GPT_OSS = load_model("gpt-oss-20b").model_copy(update={
    "name": "gpt-oss-toy", "num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 32, "vocab_size": 512,
    "sliding_window": 32, "moe": load_model("gpt-oss-20b").moe.model_copy(update={
        "num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 128})})
OSS = dict(seq_len=64, micro_batch_size=2, framework="hf", attention="eager",
           moe_impl="grouped", precision="bf16-pure", norm_impl="upcast-fp32")


def _oss(save: str = ""):
    wl = make_workload(GPT_OSS, **OSS, recompute="ops",
                       recompute_save=tuple(save.split(",")) if save else ())
    return wl, Dims.of(GPT_OSS, make_layout(1), wl)


def test_gpt_oss_items_by_hand() -> None:
    """GPT-OSS's MoE block at T = 2 x 64 = 128 tokens, R = T k = 256 rows, bf16: the
    router's addmm (T E e = 1,024 B; 2 h E + 2 E = 1,032 FLOPs a token with its bias), the
    softmax of the top 2 in bf16 (R e = 512), the rows gathered once (R h e = 65,536), the
    gate/up grouped mm (R 2f e = 131,072; k 4 h f = 131,072 FLOPs), the clamped gate,
    sigmoid, glu, up + 1 and product (R f e = 65,536 each, k f = 256 FLOPs), the down grouped
    mm (R h e = 65,536; k 2 f h = 65,536 FLOPs). The index of each among its layer's ops of
    its family and width: the products f = h wide follow the two norms' two fp32 products
    each (4, 5); with biases the projections' own outputs are saved by no one (no term).
    The eager core's softmax over s_kv + 1 = 65 columns, the sink's included: b heads s 65
    e = 66,560 B."""
    wl, dm = _oss()
    items = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.terms)
             for i in ops_items(GPT_OSS, wl, dm)}
    expected = {
        "moe.router": (1_024, 1_032.0, "matmul", 4, 0, ()),
        "moe.topk_weights": (512, 2.0, "softmax", 2, 0, ("moe.topk_weights",)),
        "moe.dispatched": (65_536, 0.0, "index", 128, 0, ("moe.dispatched",)),
        "moe.expert.gate_up": (131_072, 131_072.0, "grouped_mm", 256, 0, ()),
        "moe.expert.gate_clamped": (65_536, 256.0, "clamp", 128, 0,
                                    ("moe.expert.gate_clamped",)),
        "moe.expert.sigmoid": (65_536, 256.0, "act", 128, 0, ("moe.expert.sigmoid",)),
        "moe.expert.glu": (65_536, 256.0, "mul", 128, 4, ("moe.expert.glu",)),
        "moe.expert.up_plus_one": (65_536, 256.0, "shift", 128, 0,
                                   ("moe.expert.up_plus_one",)),
        "moe.expert.prod": (65_536, 256.0, "mul", 128, 5, ("moe.expert.prod",)),
        "moe.expert.down": (65_536, 65_536.0, "grouped_mm", 128, 0, ())}
    assert {k: v for k, v in items.items() if k.startswith("moe.")} == expected
    assert items["attn.softmax"][:5] == (66_560, 256.0, "softmax", 65, 0)


def test_gpt_oss_policy_counts_by_hand() -> None:
    """What the emitted policy counts per GPT-OSS layer (as transformers' GptOssDecoderLayer
    runs, traced: tests/traced/test_sac_policy.py): products 128 wide, the two norms' two
    fp32 products each, glu, the product and the routing weights' (7); two clamps; the
    gathers h wide (the rows, the down projection's bias per row, the unsort) and R = 256
    wide (the sorted weights, and the gate/up bias per row, 2f = 256 wide); the alpha
    scaling, up + 1, the sigmoid; the histc copy of the R sorted ids."""
    from memplan.model.layer import ops_unkept
    from memplan.report.sac_policy import _counts

    wl, dm = _oss()
    counts = _counts(ops_items(GPT_OSS, wl, dm), ops_unkept(GPT_OSS, wl, dm))
    assert {k: counts.get(k) for k in [
        ("mul", 128), ("clamp", 128), ("index", 128), ("index", 256), ("scale", 128),
        ("shift", 128), ("act", 128), ("copy", 256), ("grouped_mm", 256),
        ("grouped_mm", 128)]} == {
        ("mul", 128): 7, ("clamp", 128): 2, ("index", 128): 3, ("index", 256): 2,
        ("scale", 128): 1, ("shift", 128): 1, ("act", 128): 1, ("copy", 256): 1,
        ("grouped_mm", 256): 1, ("grouped_mm", 128): 1}


def test_gpt_oss_forward_moments_by_hand() -> None:
    """The checkpointed block's moments as transformers 5.23 writes the experts, bf16: the
    routing tensors (top-k indices R 8 = 2,048, weights R e = 512, sort and unsort indices
    2,048 each, token index 2,048, sorted weights 512: 9,216 less the unsort's 2,048 before
    the down projection), the index locals R (8 + 4) = 3,072 and the rows gathered once
    (65,536): 73,728; at the gate 9 R f e = 589,824 (the biased gate/up output and its
    gathered bias, 2 each, the clamped gate and up, glu, up + 1, the product): 663,552; at
    the unsort the unsort index 2,048, the down output, the weighted rows and their copy and
    the down bias per row (4 R h e = 262,144): 337,920. Keeping the sigmoid adds R f e =
    65,536 at the gate (the layer's forward peak), the gate/up projection's own output 2 R f e
    = 131,072; glu and the down projection nothing (alive at the gate anyway; at the unsort
    still under it)."""
    from memplan.model.layer import layer_kind
    from memplan.model.moe import grouped_kept_moments
    from memplan.workload import Recompute

    wl, dm = _oss()
    assert [v for v, _ in grouped_kept_moments(GPT_OSS, dm)] == [663_552, 337_920]

    def peak(save: str) -> int:
        swl, _ = _oss(save)
        return layer_kind(GPT_OSS, swl, dm, True, Recompute.OPS).forward_peak_bytes

    base = peak("")
    assert peak("moe.expert.sigmoid") - base == 65_536
    assert peak("moe.expert.gate_up") - base == 131_072
    assert peak("moe.expert.glu") == peak("moe.expert.down") == base


def test_gpt_oss_rerun_moments_by_hand() -> None:
    """The rerun's gate/up bias add and product against its unsort X (``layer.
    _clamped_rerun``): X less the block's saved terms (7 R f e + R h e = 524,288), the down
    biases and the weighted rows (65,536 each), plus 6 R f e = 393,216 at the add (X -
    262,144) and 10 R f e = 655,360 at the product (X); each with the kept outputs the cache
    still holds: keeping the down projection's output (65,536) and up + 1 (65,536), both at
    the add, the down's at the product."""
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute

    swl, dm = _oss("moe.expert.up_plus_one,moe.expert.down")
    moments = {m.name: m.alive_bytes for m in
               layer_kind(GPT_OSS, swl, dm, True, Recompute.OPS).moments}
    x = moments["moe_rerun"]
    assert moments["moe_rerun_gate_up"] - x == -262_144 + 131_072
    assert moments["moe_rerun_prod"] - x == 65_536


def test_gpt_oss_save_lists_add_their_bytes() -> None:
    """Each kept output's bytes in both layers over full recompute: the clamped gate and the
    sigmoid 2 x 65,536 each, the softmax with its sink column 2 x 66,560."""
    def saved(**fields) -> int:
        return estimate(GPT_OSS, **OSS, **fields).stages[0].activations_bytes

    full = saved(recompute="full")
    assert saved(recompute="ops", recompute_save="moe.expert.gate_clamped,moe.expert.sigmoid"
                 ) - full == 4 * 65_536
    assert saved(recompute="ops", recompute_save="attn.softmax") - full == 2 * 66_560


@pytest.mark.parametrize(("update", "attention", "why"), [
    ({}, "flash", "attention sinks with attention flash"),
    ({"mlp_bias": False}, "eager", "clamped SwiGLU without its expert biases"),
    ({"moe": GPT_OSS.moe.model_copy(update={"clamped_swiglu": False})}, "eager",
     "expert biases without GPT-OSS's clamped SwiGLU"),
    ({"attn_sinks": False}, "eager", "eager attention in MoE layers"),
])
def test_gpt_oss_refused_where_not_modelled(update: dict, attention: str, why: str) -> None:
    spec = GPT_OSS.model_copy(update=update)
    with pytest.raises(MemplanError, match=why):
        estimate(spec, **{**OSS, "attention": attention}, recompute="ops")


def test_gpt_oss_20b_auto_runs() -> None:
    """``--recompute auto`` on gpt-oss-20b (eager attention, the hf preset) chooses a save
    list among its items."""
    est = estimate("gpt-oss-20b", seq_len=4096, micro_batch_size=1, framework="hf",
                   attention="eager", recompute="auto", gpus=8, zero=3)
    assert est.workload.recompute_save


# the reference loop with GPT-OSS's experts: biased, clamped (memplan/profile/reference.py
# ClampedExpert), behind its biased top-k softmax router, as tests/traced/test_sac_policy.py's
# toy
LOOP_CLAMPED = TINY_MOE.model_copy(update={
    "name": "tiny-moe-loop-clamped", "mlp_bias": True,
    "moe": TINY_MOE.moe.model_copy(update={"clamped_swiglu": True, "router_topk_softmax": True,
                                           "router_bias": True})})


def test_loop_clamped_items_by_hand() -> None:
    """The reference loop's clamped experts (``sac_moe._loop_clamped_ops``), bf16, T = 256,
    R = T k = 512 over 4 experts (``repeat`` 4), h 64, f 96: the router's addmm T E e =
    2,048 B (2 h E + 2 E = 520 FLOPs a token), the softmax of the top 2 R e = 1,024; each
    expert's gathered rows R h e = 65,536, its biased gate/up addmm R 2f e = 196,608 (k (4 h
    f + 2 x 2f) = 49,920 FLOPs), the clamped gate, sigmoid, glu, up + 1 and product R f e =
    98,304 each (k f = 192), the biased down addmm's output R h e = 65,536 (k (2 f h + 2 h)
    = 24,832), the weights' gather R e = 1,024 and the weighted rows 65,536. Indices: an
    expert runs two 96-wide clamps (the gate's first) and two 96-wide products (glu first,
    then the product: stride 2); its down projection the layer's 3rd 64-wide matmul (after q
    and the output projection). The policy counts per layer 4 192-wide matmuls, 8 clamps, 4
    products by alpha (``scale``), 4 sigmoids, 4 sums with 1 (``shift``) and 8 products, all
    96 wide."""
    moe = {i.name: (i.size_bytes, i.flops_per_token, i.op, i.width, i.nth, i.repeat, i.stride)
           for i in _items(LOOP_CLAMPED, moe_impl="loop", precision="bf16-pure")
           if i.block == "mlp"}
    assert moe == {
        "moe.router": (2_048, 520.0, "matmul", 4, 0, 1, 0),
        "moe.topk_weights": (1_024, 2.0, "softmax", 2, 0, 1, 0),
        "moe.dispatched": (65_536, 0.0, "index", 64, 0, 4, 1),
        "moe.expert.gate_up": (196_608, 49_920.0, "matmul", 192, 0, 4, 1),
        "moe.expert.gate_clamped": (98_304, 192.0, "clamp", 96, 0, 4, 2),
        "moe.expert.sigmoid": (98_304, 192.0, "act", 96, 0, 4, 1),
        "moe.expert.glu": (98_304, 192.0, "mul", 96, 0, 4, 2),
        "moe.expert.up_plus_one": (98_304, 192.0, "shift", 96, 0, 4, 1),
        "moe.expert.prod": (98_304, 192.0, "mul", 96, 1, 4, 2),
        "moe.expert.down": (65_536, 24_832.0, "matmul", 64, 2, 4, 1),
        "moe.routing_weights": (1_024, 0.0, "index", 1, 0, 4, 1),
        "moe.combine_in": (65_536, 128.0, "mul", 64, 4, 4, 1)}
    counts = _policy_ops(LOOP_CLAMPED, "loop")
    assert [counts[k] for k in (("matmul", 192), ("clamp", 96), ("scale", 96), ("act", 96),
                                ("shift", 96), ("mul", 96))] == [4, 8, 4, 4, 4, 8]


def test_loop_clamped_forward_moments_by_hand() -> None:
    """The clamped expert in the loop's checkpointed forward (``moe._loop_expert_inner``,
    ``_loop_expert_kept``), bf16, r = 128 rows an expert: beside the loop's locals (the
    stream-sized output T h e = 32,768, the top-k indices and weights T k (8 + e) = 5,120,
    the expert's row and slot indices 2 r 8 = 2,048: 39,936 B) and the expert before's
    weighted rows r h e = 16,384, with ``flat[rows]`` (16,384): at ``(up + 1) * glu`` the
    gate/up output (2 r f e = 49,152), the clamped gate and up, glu, up + 1 and the product
    (r f e = 24,576 each): 244,736, the sigmoid kept beyond it; at the down projection all
    but up + 1 and its output r h e: 236,544, up + 1 kept beyond it too; at the weighting
    the down projection's output, the weights' gather (r e = 256) and the weighted rows:
    89,344, every MLP item kept beyond it. Under full recompute the working set is the
    product's, 244,736."""
    from memplan.model.moe import MoE, loop_kept_moments

    wl = make_workload(LOOP_CLAMPED, **{**FIELDS, "moe_impl": "loop"}, precision="bf16-pure",
                       recompute="full")
    dm = Dims.of(LOOP_CLAMPED, make_layout(1), wl)
    expert = {"moe.expert.gate_up", "moe.expert.gate_clamped", "moe.expert.sigmoid",
              "moe.expert.glu", "moe.expert.up_plus_one", "moe.expert.prod"}
    moments = [(value, adds - {"moe.router", "moe.router_input_fp32", "moe.router_weight_fp32"})
               for value, adds in loop_kept_moments(LOOP_CLAMPED, dm)]
    assert moments[:3] == [(244_736, {"moe.expert.sigmoid"}),
                           (236_544, {"moe.expert.sigmoid", "moe.expert.up_plus_one"}),
                           (89_344, expert | {"moe.dispatched"})]
    assert MoE().working_set(LOOP_CLAMPED, wl, dm)[0].transient_bytes == 244_736
