"""Qwen2-MoE's block as transformers runs it (the hf preset's moe_impl grouped): a gated
shared expert run first, then the router and the grouped experts, then
``sigmoid(shared_expert_gate(x)) * shared_expert_output`` and the sum
(models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock.forward; the experts'
integrations/moe.py grouped_mm_experts_forward), its backward's start, bytes derived by hand.

tiny-moe (tests/unit/test_moe_recompute.py): h 64, 4 stacked SwiGLU experts of f 96, top-2,
a shared expert of 96 behind its gate; seq 128 and micro-batch 2 (T = 256 tokens, R = T*k =
512 routed rows).
"""

from __future__ import annotations

from memplan.api import make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.moe import MoE
from memplan.spec import ModelSpec, MoESpec, load_model

QWEN2 = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=96, stacked_experts=True,
             num_shared_experts=1, shared_expert_ffn_hidden_size=96, shared_expert_gate=True)


def _moments(precision: str) -> dict:
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**QWEN2).model_dump()})
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl="grouped",
                       precision=precision)
    dm = Dims.of(spec, make_layout(1), wl)
    saved = sum(t.size_bytes for t in MoE().saved(spec, wl, dm, wl.recompute))
    return saved, {m.name: m for m in MoE().backward_moments(spec, wl, dm, wl.recompute)}


def test_bf16_unsort_and_weighting() -> None:
    """Saved in bf16 (e = 2): the fp32 probabilities T E x 4 = 4,096, the top-k indices, the
    token, sort and unsort indices (R x 8 = 4,096 each), the top-k weights and their sum (R x
    4 + T x 4 = 3,072), the gathered rows and the experts' output (R h e = 65,536 each), the
    experts' gate/up, activation and product (4 R f e = 393,216), the sorted fp32 routing
    weights (R x 4 = 2,048), the shared MLP's four terms (4 T f e = 196,608), the sigmoid
    (T e = 512) and the shared output (T h e = 32,768): 779,776.

    The gate's product was made last: its backward frees the sigmoid and the shared output
    (746,496 left) and leaves the shared output's gradient and the gate linear's input
    gradient waiting (2 T h e = 65,536). The unsort's backward: the expanded gradient's copy,
    zeros and the index_put, each R h in the weights' fp32 (3 x 131,072 = 393,216): 458,752
    beside. The weighting's, the unsort's index freed (742,400 left): the unsorted rows'
    gradient, the two products' (393,216), the down output's gradient cast to bf16 (R h e =
    65,536) and the waiting 65,536: 524,288; under full recompute the down output and the
    weights were dropped as unpacked (65,536 + 2,048 = 67,584)."""
    saved, moments = _moments("bf16-pure")
    assert saved == 779_776
    unsort, weighting = moments["moe_unsort"], moments["moe_weighting"]
    assert (unsort.own_bytes, unsort.transient_bytes) == (746_496, 458_752)
    assert (weighting.own_bytes, weighting.transient_bytes) == (742_400, 524_288)
    assert weighting.rerun_freed == 67_584


def test_fp32_weighting_casts_nothing() -> None:
    """In fp32 every term above doubles but the indices, probabilities, top-k and routing
    weights (the same in both: 4,096 + 4 x 4,096 + 3,072 + 2,048 = 25,600 of them): 25,600 +
    2 x (779,776 - 25,600) = 1,533,952. Left at the unsort: less the sigmoid (1,024) and the
    shared output (65,536): 1,467,392, beside 3 R h x 4 (393,216) and 2 T h x 4 (131,072).
    The weighting's, the index freed (1,463,296 left): its gradients are in the rows' own
    fp32, no cast (393,216 + 131,072)."""
    saved, moments = _moments("fp32")
    assert saved == 1_533_952
    unsort, weighting = moments["moe_unsort"], moments["moe_weighting"]
    assert (unsort.own_bytes, unsort.transient_bytes) == (1_467_392, 524_288)
    assert (weighting.own_bytes, weighting.transient_bytes) == (1_463_296, 524_288)
