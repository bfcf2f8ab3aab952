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
    (dict(moe_impl="loop"), "moe_impl loop"),
    (dict(), "moe_impl loop"),
])
def test_moe_refused_where_not_modelled(fields: dict, why: str) -> None:
    with pytest.raises(MemplanError, match=why):
        estimate(TINY_MOE, seq_len=128, micro_batch_size=2, recompute="ops", **fields)


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


def test_topk_softmax_router_with_expert_biases_still_refused() -> None:
    """GPT-OSS's block (a top-k softmax router in the logits' dtype, biased experts with a
    clamped SwiGLU) stays refused, for its experts' biases."""
    with pytest.raises(MemplanError, match="MoE layers with expert biases"):
        estimate("gpt-oss-20b", seq_len=128, micro_batch_size=1, framework="hf",
                 recompute="ops")
