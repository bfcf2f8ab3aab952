"""Granite's MoE as transformers 5.23 runs it (the hf preset's moe_impl grouped): its router,
GraniteMoeTopKRouter.forward (models/granitemoe/modeling_granitemoe.py: F.linear(x, w).float(),
topk, softmax of the top-k in fp32, .type_as(x); ``MoESpec.router_logits_fp32``,
``router_topk_softmax``, ``router_weights_cast``), and a shared MLP run after the experts
(``shared_experts_last``: GraniteMoeSharedDecoderLayer.forward), bytes derived by hand.

tiny-moe (tests/unit/test_moe_recompute.py): h 64, 4 stacked SwiGLU experts of f 96, top-2;
seq 128 and micro-batch 2 in bf16 (e = 2): T = 256 tokens, R = T*k = 512 routed rows; with
Granite's shared MLP of 96 (fused gate/up, as GraniteMoeSharedMLP's input_linear).
"""

from __future__ import annotations

from memplan.api import make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.moe import MoE
from memplan.spec import ModelSpec, MoESpec, load_model
from memplan.workload import MoeImpl

GRANITE = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=96, stacked_experts=True,
               router_topk_softmax=True, router_logits_fp32=True, router_weights_cast=True)
SHARED = dict(GRANITE, num_shared_experts=1, shared_expert_ffn_hidden_size=96,
              shared_experts_last=True)


def _setup(recompute: str | None = None, **moe):
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "fused_gate_up": True,
                                     "moe": MoESpec(**moe).model_dump()})
    extra = {"recompute": recompute} if recompute else {}
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl="grouped",
                       precision="bf16-pure", **extra)
    return spec, wl, Dims.of(spec, make_layout(1), wl)


def test_router_saves_the_fp32_top_k_softmax_only() -> None:
    """Saved by the routed block: topk's indices R*8 = 4,096 and the fp32 softmax of the
    top-k logits R*4 = 2,048 (no probability of every expert: the fp32 logits and the top-k
    values are saved by nothing); the token, sort and unsort indices 3 x 4,096; the gathered
    rows and the experts' output (R h e = 65,536 each); gate/up (R 2f e = 196,608), the
    activation and the product (R f e = 98,304 each); the routing weights cast to bf16 (R*2
    = 1,024): 543,744."""
    spec, wl, dm = _setup(**GRANITE)
    saved = {t.name: t.size_bytes for t in MoE().saved(spec, wl, dm, wl.recompute)}
    assert (saved["moe.topk_indices"], saved["moe.topk_weights"]) == (4_096, 2_048)
    assert "moe.router_probs" not in saved and saved["moe.routing_weights"] == 1_024
    assert sum(saved.values()) == 543_744


def test_checkpointed_block_holds_the_fp32_logits() -> None:
    """Under full recompute (nothing saved), as transformers 5.3 wrote the grouped experts
    (``moe_impl`` grouped-token): the routing tensors (19,456: the terms above less the rows
    and the MLP's) but the fp32 softmax of the top-k (R*4 = 2,048), which ``.type_as`` made
    a temporary: 17,408; the index locals (R*12 = 6,144), the router's fp32 logits
    GraniteMoeMoE.forward keeps to its end (T E x 4 = 4,096) and its cast top-k weights (R*2
    = 1,024), the gathered rows and their sorted copy (131,072), at the gate the gate/up
    output, SiLU and product (4 R f e = 393,216): 552,960, above the unsort's 159,744 +
    98,304 + 65,536 + 2 x 65,536 (the weighted rows and their unsorted copy, bf16: the
    weights were cast) = 454,656. As 5.23 writes them (grouped, the default), the rows
    gathered once, no token index bound and the unsort index not yet made at the gate:
    552,960 - 65,536 - 2 x 4,096 = 479,232."""
    spec, wl, dm = _setup("full", **GRANITE)
    (moment,) = MoE().working_set(spec, wl, dm)
    assert wl.moe_impl.value == "grouped" and moment.transient_bytes == 479_232
    token = wl.model_copy(update={"moe_impl": MoeImpl.GROUPED_TOKEN})
    (moment,) = MoE().working_set(spec, token, dm)
    assert moment.transient_bytes == 552_960


def test_shared_mlp_after_the_experts_runs_its_backward_first() -> None:
    """The shared MLP (T f e: gate/up 98,304, activation and product 49,152 each: 196,608
    saved) ran last, so its backward runs first, beside everything the block saved (543,744
    + 196,608 = 740,352): its down projection's, its activation's and its input
    projection's moments own all of it but its own terms at the last (543,744). By the
    experts' down projection its terms are freed, and so are the experts' output and the
    gathered rows' gradient source (R h e = 65,536): 740,352 - 196,608 - 65,536 = 478,208,
    its input's gradient (T h e = 32,768) waiting beside the experts' moments."""
    spec, wl, dm = _setup(**SHARED)
    moments = {m.name: m for m in MoE().backward_moments(spec, wl, dm, wl.recompute)}
    assert [n for n in moments][:3] == ["moe_shared", "moe_shared_act", "moe_shared_in"]
    assert moments["moe_shared"].own_bytes == moments["moe_shared_act"].own_bytes == 740_352
    assert moments["moe_shared_in"].own_bytes == 543_744
    assert moments["mlp"].own_bytes == moments["mlp_act"].own_bytes == 478_208
    spec0, wl0, dm0 = _setup(**GRANITE)
    alone = {m.name: m for m in MoE().backward_moments(spec0, wl0, dm0, wl0.recompute)}
    for name in ("mlp", "mlp_act", "mlp_in"):
        assert moments[name].transient_bytes - alone[name].transient_bytes == 32_768


def test_shared_mlp_weight_gradients_are_their_own_groups() -> None:
    """The shared MLP's backward runs whole before the experts' (``shared_last_groups``):
    its output_linear (f h = 96 x 64 = 6,144 parameters) is ``moe_shared_out``, made at the
    down projection's moment and alive from there; with its fused input_linear (h 2f = 64 x
    192 = 12,288) ``moe_shared`` = 18,432, made at the input projection's moment. By the
    experts' down projections (``mlp_out``: 4 x 96 x 64 = 24,576) both exist: 24,576 +
    18,432 = 43,008; ``mlp`` all: the router (4 x 64 = 256), the experts' gate/up (4 x 64 x
    192 = 49,152) and down, and the shared MLP: 92,416. Without the shared MLP ``mlp_out``
    is the experts' down projections alone, ``mlp`` 256 + 49,152 + 24,576 = 73,984, and
    there is no shared group. ``moe_after_shared``, what the reference loop's expert
    moments name (its shared MLP always after the loop), is 43,008 too."""
    spec, wl, dm = _setup(**SHARED)
    assert MoE().grad_groups(spec, 1, 1) == {"mlp_out": 43_008, "mlp": 92_416,
                                            "moe_shared_out": 6_144, "moe_shared": 18_432,
                                            "moe_after_shared": 43_008}
    moments = {m.name: m for m in MoE().backward_moments(spec, wl, dm, wl.recompute)}
    assert [(moments[n].grads, moments[n].fresh_params)
            for n in ("moe_shared", "moe_shared_act", "moe_shared_in")] == [
        (("moe_shared_out",), 6_144), (("moe_shared_out",), 0), (("moe_shared",), 12_288)]
    spec0, _, _ = _setup(**GRANITE)
    assert MoE().grad_groups(spec0, 1, 1) == {"mlp_out": 24_576, "mlp": 73_984}


def test_scaled_residual_copy_waits_through_the_shared_backward() -> None:
    """Granite scales the block's output before the residual add (``scaled_residual``:
    residual + hidden_states * residual_multiplier): its backward makes the block output's
    gradient a tensor of its own (T h e = 256 x 64 x 2 = 32,768), which the output sum hands
    to both branches; the routed branch's first node runs after the whole shared MLP's
    backward, so each shared moment holds it beside the stream's: 49,152 (the down
    projection's input gradient, T f e) + 32,768 = 81,920; 98,304 (the activation's two
    gradients) + 32,768 = 131,072; 32,768 + 98,304 (the fused input's gradient, T 2f e)
    + 32,768 = 163,840. The routed moments after them are unchanged (the view's backward
    copied the gradient by then)."""
    spec, wl, dm = _setup(**SHARED)
    scaled = spec.model_copy(update={"scaled_residual": True})
    plain = {m.name: m.transient_bytes for m in MoE().backward_moments(spec, wl, dm, wl.recompute)}
    moved = {m.name: m.transient_bytes for m in MoE().backward_moments(scaled, wl, dm, wl.recompute)}
    assert [plain[n] for n in ("moe_shared", "moe_shared_act", "moe_shared_in")] == [
        49_152, 98_304, 131_072]
    assert [moved[n] for n in ("moe_shared", "moe_shared_act", "moe_shared_in")] == [
        81_920, 131_072, 163_840]
    assert all(moved[n] == plain[n] for n in plain if not n.startswith("moe_shared"))


def test_parallel_experts_run_the_shared_mlp_backward_first_too() -> None:
    """transformers 5.3's GraniteMoeParallelExperts (``moe_impl`` parallel) beside the same
    shared MLP, which GraniteMoeSharedDecoderLayer.forward runs after the block as 5.23 does:
    its backward first (the three shared moments), beside everything saved: the top-k
    indices (R 8 = 4,096), the fp32 top-k softmax (R 4 = 2,048), the sort and token indices
    (4,096 each), the gathered rows, the experts' output and the weighted rows (R h e =
    65,536 each), gate, up, activation and product (R f e = 98,304 each), the gates (R e =
    1,024): 605,184, and the shared MLP's 196,608: 801,792. By the experts' down projection
    the shared MLP's terms are freed, and so are the weighted rows (index_add's backward),
    the experts' output and the gates (the weighting's): 801,792 - 196,608 - 2 x 65,536 -
    1,024 = 473,088."""
    spec, wl, dm = _setup(**SHARED)
    parallel = wl.model_copy(update={"moe_impl": MoeImpl.PARALLEL})
    moments = {m.name: m for m in MoE().backward_moments(spec, parallel, dm, parallel.recompute)}
    assert [n for n in moments][:4] == ["moe_shared", "moe_shared_act", "moe_shared_in", "mlp"]
    assert moments["moe_shared"].own_bytes == 801_792
    assert moments["mlp"].own_bytes == moments["mlp_act"].own_bytes == 473_088
