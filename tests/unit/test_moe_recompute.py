"""The grouped MoE block's working set in a checkpointed forward (``memplan.model.moe.MoE.
working_set``, transformers' integrations/moe.py ``grouped_mm_experts_forward`` run without
saving), bytes derived by hand, as transformers 5.3 wrote it (``moe_impl`` grouped-token) and
as 5.23 writes it (grouped, the hf preset's default).

tiny-moe (tests/unit/test_sac_moe.py): h 64, 4 stacked SwiGLU experts of f 96, top-2; seq 128
and micro-batch 2 in bf16 (e = 2): T = 256 tokens, R = T*k = 512 routed rows. Bound to the end
of the block: the routing tensors (probabilities T*E*4 = 4,096, top-k indices R*8 = 4,096 and
weights R*4 + T*4 = 3,072, token, sort and unsort indices 4,096 each, sorted routing weights
R*4 = 2,048: 25,600), the function's index locals (the sorted expert ids R*8 = 4,096 and
their histc copy R*4 = 2,048: 6,144) and the gathered rows with their sorted copy (2 R*h*e =
131,072). At the gate the gate/up output, SiLU and product (4 R*f*e = 393,216): 556,032; at
the unsort the product (98,304), the down output (65,536) and the weighted rows with their
unsorted copy in the weights' fp32 (2 R*h*4 = 262,144): 588,800, the larger (Mixtral's
block).

5.23 sorts the pairs first and gathers the rows once (``hidden_states[perm // num_top_k]``,
its index a temporary: no token index bound, one gathered copy R*h*e = 65,536), makes the
unsort index after the down projection (not bound at the gate) and frees the product there
(``proj_out`` rebound): at the gate 25,600 - 2 * 4,096 + 6,144 + 65,536 + 393,216 = 482,304,
the larger; at the unsort 25,600 - 4,096 + 6,144 + 65,536 + 65,536 + 262,144 = 420,864.
"""

from __future__ import annotations

from memplan.api import make_layout, make_workload
from memplan.model.dims import Dims
from memplan.model.moe import MoE
from memplan.spec import ModelSpec, MoESpec, load_model

MIXTRAL_LIKE = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=96, stacked_experts=True)
# one shared MLP of f 96 and a router on fp32 copies (Hunyuan's HunYuanMoEV1Moe)
SHARED_FP32 = dict(MIXTRAL_LIKE, num_shared_experts=1, shared_expert_ffn_hidden_size=96,
                   router_fp32=True)


def _working_set(impl: str = "grouped-token", **moe) -> int:
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**moe).model_dump()})
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl=impl,
                       precision="bf16-pure", recompute="full")
    dm = Dims.of(spec, make_layout(1), wl)
    (moment,) = MoE().working_set(spec, wl, dm)
    return moment.transient_bytes


def test_routed_experts_alone() -> None:
    assert _working_set(**MIXTRAL_LIKE) == 588_800


def test_shared_expert_first_adds_its_output_only() -> None:
    """The shared MLP ran first (HunYuanMoEV1Moe.forward, Qwen2MoeSparseMoeBlock.forward):
    its output T*h*e = 32,768 waits; its gate/up/product were freed when its down projection
    returned, and the fp32 copies of the router's input (T*h*4 = 65,536) and weight were
    freed once the logits existed: neither is in the working set. 588,800 + 32,768."""
    assert _working_set(**SHARED_FP32) == 621_568


def test_shared_expert_last_adds_nothing() -> None:
    """DeepseekV3MoE.forward runs the shared experts after the routed ones
    (``shared_experts_last``): no shared output exists yet."""
    assert _working_set(**SHARED_FP32, shared_experts_last=True) == 588_800


def test_routing_weights_cast_to_the_compute_dtype() -> None:
    """ERNIE 4.5's router returns routing_weights.to(hidden_states.dtype)
    (``router_weights_cast``): the sorted weights R*2 = 1,024, and the fp32 top-k weights
    and their sum (R*4 + T*4 = 3,072) replaced by the cast, a local of R*2 = 1,024 (routing
    25,600 - 1,024 - 3,072 = 21,504; locals 6,144 + 1,024 = 7,168); the weighted rows and
    their unsorted copy bf16 (2 R*h*2 = 131,072). With the shared output waiting: the unsort
    21,504 + 7,168 + 131,072 + 32,768 + 98,304 + 65,536 + 131,072 = 487,424, under the
    gate's 21,504 + 7,168 + 131,072 + 32,768 + 393,216 = 585,728."""
    assert _working_set(**SHARED_FP32, router_weights_cast=True) == 585_728


def test_5_23_gathers_once() -> None:
    """transformers 5.23's grouped_mm_experts_forward (module docstring): the gate's 482,304;
    with a shared MLP run first its output T*h*e = 32,768 more at both moments (515,072);
    run last, nothing more."""
    assert _working_set("grouped", **MIXTRAL_LIKE) == 482_304
    assert _working_set("grouped", **SHARED_FP32) == 515_072
    assert _working_set("grouped", **SHARED_FP32, shared_experts_last=True) == 482_304


def test_5_23_routing_weights_cast() -> None:
    """ERNIE-like (above) on 5.23: the unsort 21,504 - 4,096 + 7,168 + 65,536 + 32,768 +
    65,536 + 131,072 = 319,488 (no product), under the gate's 21,504 - 8,192 + 7,168 +
    65,536 + 32,768 + 393,216 = 512,000."""
    assert _working_set("grouped", **SHARED_FP32, router_weights_cast=True) == 512_000


# ERNIE 4.5's router and block (models/ernie4_5_moe/modeling_ernie4_5_moe.py): the weights
# cast, the router's weight built in fp32, the renormalisation's sum clamped, the logits bound
ERNIE_LIKE = dict(SHARED_FP32, router_weights_cast=True, router_weight_fp32=True,
                  router_norm_clamped=True, router_logits_held=True)


def test_ernie_router_logits_replace_the_probabilities_in_the_working_set() -> None:
    """Ernie4_5_MoeSparseMoeBlock.forward binds the router's fp32 logits (T*E*4 = 4,096), a
    local, where its softmax's probabilities (the same size) are freed: the gate's 585,728
    (above) - 4,096 + 4,096."""
    assert _working_set(**ERNIE_LIKE) == 585_728


def _saved_and_rerun(impl: str, **moe) -> tuple[int, int, int]:
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**moe).model_dump()})
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl=impl,
                       precision="bf16-pure", recompute="full")
    dm = Dims.of(spec, make_layout(1), wl)
    from memplan.workload import Recompute

    saved = sum(t.size_bytes for t in MoE().saved(spec, wl, dm, Recompute.NONE))
    (moment,) = MoE().rebuild_moments(spec, wl, dm)
    return saved, moment.own_bytes, moment.transient_bytes


# What the ERNIE-like block saves (bf16, T = 256, R = 512, h 64, f 96, E 4): the router's
# fp32 input copy T*h*4 = 65,536 (its weight is fp32 already: no copy), the probabilities
# T*E*4 = 4,096, the top-k indices R*8 = 4,096, the gathered top-k weights R*4 = 2,048 with
# the sum and its clamped copy (2 T*4 = 2,048), the token, sort and unsort indices (3 R*8 =
# 12,288), the gathered rows R*h*2 = 65,536, the experts' gate, SiLU, up and product (4 R*f*2
# = 393,216), their output R*h*2 = 65,536, the sorted weights R*2 = 1,024 and the shared
# MLP's four terms (4 T*f*2 = 196,608): 812,032.
ERNIE_SAVED = 812_032


def test_ernie_saved_terms() -> None:
    saved, _, _ = _saved_and_rerun("grouped-token", **ERNIE_LIKE)
    assert saved == ERNIE_SAVED


def test_rerun_stops_at_the_unsort_index() -> None:
    """Under full recompute the rerun stops at the unsort's pack of its index, before
    ``weighted_out[inv_perm]`` runs (moe.grouped_rerun): beside the 812,032 saved, the
    weighted rows and the view's copy of the expanded gradient (2 R*h*2 = 131,072), the rows
    gathered by token (5.3's grouped-token: R*h*2 = 65,536), the shared output (T*h*2 =
    32,768), the post-attention residual no upcast norm saves (T*h*2 = 32,768) and the
    locals: sorted ids and their histc copy (R*12 = 6,144), the bound logits (T*E*4 = 4,096)
    and cast weights (R*2 = 1,024): 273,408. On 5.23 (grouped) no by-token rows: 207,872."""
    assert _saved_and_rerun("grouped-token", **ERNIE_LIKE)[1:] == (ERNIE_SAVED, 273_408)
    _, _, transient = _saved_and_rerun("grouped", **ERNIE_LIKE)
    assert transient == 207_872


def test_biased_experts_rerun_holds_the_down_biases() -> None:
    """GPT-OSS's biased experts (``clamped_swiglu`` with ``mlp_bias``): grouped_mm_experts_
    forward gathers the down projection's bias per routed row (``selected_biases =
    self.down_proj_bias[expert_ids_g]``) and keeps it bound to its return, so the rerun's stop
    at the unsort holds it beside the rest (moe.down_biases_bytes): R*h*2 = 512 * 64 * 2 =
    65,536 B more than the same block unbiased, on 5.3 and 5.23 alike (traced: GPT-OSS under
    full recompute, tests/traced/test_hf_moe_families.py, step 1's backward -1.565% and
    -1.435% on 5.3 without it)."""
    from memplan.model.moe import down_biases_bytes

    biased = dict(MIXTRAL_LIKE, clamped_swiglu=True, router_topk_softmax=True)
    for impl in ("grouped-token", "grouped"):
        spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                         "mlp_bias": True, "moe": MoESpec(**biased).model_dump()})
        plain = spec.model_copy(update={"mlp_bias": False})
        wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl=impl,
                           precision="bf16-pure", recompute="full")
        dm = Dims.of(spec, make_layout(1), wl)
        assert down_biases_bytes(spec, dm) == 65_536 and down_biases_bytes(plain, dm) == 0
        (with_bias,), (without,) = (MoE().rebuild_moments(s, wl, dm) for s in (spec, plain))
        assert with_bias.transient_bytes - without.transient_bytes == 65_536


def test_loop_expert_rows_under_expert_parallelism() -> None:
    """The reference loop under full recompute with ep 2: the rank's R = 512 routed rows
    (balanced, as its saved terms count them) among its E/ep = 2 experts, r = 256 rows
    each, not R/E = 128. Bound to the block's end: the router's probabilities T*E*4 =
    4,096, ``out`` T*h*e = 32,768, the top-k indices and cast weights R*(8 + 2) = 5,120,
    the expert's row and slot indices 2*r*8 = 4,096 (46,080); the expert before's
    weighted rows r*h*e = 32,768, the running expert's gathered rows 32,768 and at its
    product three r*f*e = 49,152 (gate freed by SiLU: SiLU, up, product): 147,456.
    46,080 + 32,768 + 32,768 + 147,456 = 259,072 (150,528 with r = 128)."""
    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-moe",
                                     "moe": MoESpec(**MIXTRAL_LIKE).model_dump()})
    wl = make_workload(spec, seq_len=128, micro_batch_size=2, moe_impl="loop",
                       precision="bf16-pure", recompute="full")
    dm = Dims.of(spec, make_layout(2, ep=2), wl)
    (moment,) = MoE().working_set(spec, wl, dm)
    assert moment.transient_bytes == 259_072
