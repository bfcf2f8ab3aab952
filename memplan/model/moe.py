"""The mixture-of-experts feed-forward block, with its output's dropout. Routing is taken as
balanced: each rank's experts see T*k tokens, T*k/(E/ep) each.

What it saves (``Workload.moe_impl``): router probabilities (fp32), top-k indices and
renormalised weights, the gathered rows and their index, the MLP terms over them, the experts'
outputs and the routing weights; the reference's loop (``loop``) also the weighted outputs its
out-of-place combine keeps; transformers' grouped experts (``grouped``) the sort permutation
and its inverse instead (the per-token sum saves nothing); Granite's own experts
(``parallel``): ``memplan.model.moe_parallel``. Shared experts are a dense MLP over
all tokens, behind a sigmoid gate that saves their output where the model has one; a router
on fp32 copies (``router_fp32``) saves them.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.model import (compiled, float8_grouped, linear, mlp, moe_parallel, moe_titan,
                           moe_titan_compiled)
from memplan.model.block import BackwardMoment, Moment
from memplan.model.dims import FP32_BYTES, INDEX_BYTES, Dims, Term, residual_dropout_mask, total
from memplan.model.linear import Linear, Split
from memplan.parallel import ExpertSplit
from memplan.spec import ModelSpec, MoESpec
from memplan.workload import MoeImpl, Recompute, Workload


# the name prefix of a routed expert's projections (not stacked)
_EXPERT_MLP = "expert."


def _moe(spec: ModelSpec) -> MoESpec:
    assert spec.moe is not None, "an MoE block needs spec.moe"
    return spec.moe


def every_expert_terms(spec: ModelSpec, dm: Dims) -> list[Term]:
    """Llama 4's MoE as its own code runs it (``MoeImpl.EVERY``; models/llama4/
    modeling_llama4.py): the router's top-k indices (Llama4Router.forward: topk, and the
    scatter_ into a -inf tensor of every expert, which saves them too) and its fp32 sigmoid
    (saved by sigmoid's backward); Llama4TextMoe.forward's input repeated per expert
    (E*T rows) and the scores, transposed into one column per row (a copy), both saved by
    their product; Llama4TextExperts.forward's bmm over gate_up_proj saving that product,
    its gate/up output (silu saves the gate half, a view that keeps it whole), the activation
    and the product the down bmm saves (a gated MLP's terms over E*T rows); the shared
    expert, a dense MLP over the T tokens. The experts' output sum saves nothing."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = moe.num_experts * dm.tokens
    return [Term("moe.topk_indices", dm.tokens * moe.top_k * INDEX_BYTES),
            Term("moe.router_scores", dm.tokens * moe.num_experts * FP32_BYTES),
            Term("moe.repeated_in", rows * h * e), Term("moe.scores_column", rows * e),
            Term("moe.dispatched", rows * h * e),
            *mlp.mlp_terms("moe.expert", spec, dm.experts(), moe.expert_ffn_hidden_size, rows),
            *mlp.mlp_terms("moe.shared", spec, dm,
                           moe.num_shared_experts * moe.shared_expert_ffn_hidden_size,
                           dm.tokens)]


def _grouped_moments(spec: ModelSpec, dm: Dims,
                     impl: MoeImpl = MoeImpl.GROUPED) -> tuple[int, int]:
    """transformers' grouped_mm_experts_forward (integrations/moe.py) without saving, over the
    R = T*k routed rows: what is alive at the gate (its gate/up output, R 2f, the activation
    and the product, R f each) and at the unsort (the product, the down projection's output,
    R h, the weighted rows and their unsorted copy, R h each in the routing weights' fp32 by
    type promotion), beside what stays bound to the end: the routing's tensors
    (``_routing_bytes``) and the function's index locals (``_grouped_locals``), the gathered
    rows and a shared expert's output where it ran first. The block's output does not exist
    yet. As transformers 5.3 wrote it (``impl`` grouped-token) the rows are gathered by token
    and then copied sorted (2 R h), the token and unsort indices made first (traced on 5.3:
    transformers' Mixtral, fp32 and bf16; Hunyuan's block in bf16); as 5.23 writes it
    (grouped) the pairs are sorted first and the rows gathered once in that order
    (``hidden_states[perm // num_top_k]``, its index a temporary), the unsort index made
    after the down projection (``inv_perm[perm] = arange``) and the product freed there
    (``proj_out`` rebound to the down projection's output): R h and an R-long int64 index
    fewer at the gate, R h, the product and an index fewer at the unsort (traced on 5.23:
    tests/traced/test_hf_granite_moe.py, Hunyuan's, dots1's and ERNIE's blocks in
    test_hf_heldout.py)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = dm.tokens * moe.top_k
    inner = rows * moe.expert_ffn_hidden_size // dm.experts().tp * e
    weighted = rows * h * max(e, weights_width(moe, dm))
    common = _routing_bytes(spec, dm) + _grouped_locals(spec, dm) + 2 * rows * h * e
    late, product = 0, inner  # the unsort index from the down projection on; the product
    if impl is MoeImpl.GROUPED:
        common -= rows * h * e + 2 * rows * INDEX_BYTES
        # 5.23 rebinds proj_out to the down projection's output: the product is freed
        late, product = rows * INDEX_BYTES, 0
    if moe.num_shared_experts and not moe.shared_experts_last:
        common += dm.rows * h * e  # the shared expert ran first: its output waits
    gate = 4 * inner
    if moe.clamped_swiglu:
        # GPT-OSS (GptOssExperts._apply_gate): the gate/up output beside the clamped gate,
        # the clamped up, glu, up + 1 and their product (gate * alpha and its sigmoid freed
        # by then); the biases gathered per row (selected_biases, R 2f, then R h for the
        # down projection: ``down_biases_bytes``) are bound until the next selection
        # (traced: GPT-OSS fp32 under full recompute, 9 R f at the gate)
        gate = 7 * inner + (2 * inner if spec.mlp_bias else 0)
    return (common + gate, common + late + product + rows * h * e + 2 * weighted
            + down_biases_bytes(spec, dm))


def down_biases_bytes(spec: ModelSpec, dm: Dims) -> int:
    """Biased experts (GPT-OSS: GptOssExperts' down_proj_bias, ``ModelSpec.mlp_bias``):
    grouped_mm_experts_forward gathers the down projection's bias per routed row
    (``selected_biases = self.down_proj_bias[expert_ids_g]``, R h in the compute dtype, a
    new tensor) and keeps it bound until it returns, so it is alive at the unsort (5.3 and
    5.23 alike: integrations/moe.py)."""
    moe = _moe(spec)
    if not (moe.clamped_swiglu and spec.mlp_bias):
        return 0
    return dm.tokens * moe.top_k * spec.hidden_size * dm.e


# the grouped block's saved terms still bound when its experts run without saving
_ROUTING = frozenset({"moe.router_probs", "moe.topk_indices", "moe.topk_weights",
                      "moe.token_index", "moe.sort_index", "moe.unsort_index",
                      "moe.routing_weights"})


def _routing_bytes(spec: ModelSpec, dm: Dims) -> int:
    """The grouped block's routing tensors, bound to the end of its forward: the router's
    probabilities (Mixtral's softmax; Hunyuan's fp32 logits, the same size), the top-k
    indices and weights, the token, sort and unsort indices and the sorted routing weights.
    Not the terms only a saving forward keeps: the fp32 copies an fp32 router's linear
    reads (HunYuanMoEV1Gate.forward's ``hidden_states.float()``, DeepseekV3TopkRouter's
    ``.type(torch.float32)`` of input and weight), freed once its logits exist, nor a
    shared expert's MLP terms, freed when its down projection returns (traced: transformers'
    Hunyuan MoE, bf16, under gradient checkpointing: its float input freed after the
    router's mm, its gate/up/product before the router runs). Nor, where the router casts
    its top-k weights (``router_weights_cast``, below fp32), the fp32 weights and sums the
    cast replaced (the cast is a local, ``_grouped_locals``), nor where the block holds the
    router's logits (``router_logits_held``, locals too) the probabilities, which no one
    keeps then (traced: ERNIE 4.5's block, bf16, under gradient checkpointing: its logits,
    top-k indices and cast weights alive at the unsort, not its softmax, gather or sums)."""
    moe = _moe(spec)
    gone = {"moe.topk_weights"} if moe.router_weights_cast and dm.e < FP32_BYTES else set()
    if moe.router_logits_held:
        gone.add("moe.router_probs")
    return sum(t.size_bytes for t in moe_terms(spec, dm, MoeImpl.GROUPED)
               if t.name in _ROUTING and t.name not in gone)


def _grouped_locals(spec: ModelSpec, dm: Dims) -> int:
    """grouped_mm_experts_forward's locals no backward saves, bound until it returns: the
    sorted expert ids (``expert_ids[perm]``, R int64) and their copy for histc (R, float on
    CPU, int32 on CUDA: 4 bytes either way); and the router's fp32 logits where it returns
    them to the block, which keeps them to its end (``router_logits_fp32``: GraniteMoeMoE.
    forward's ``_, top_k_weights, top_k_index = self.router(hidden_states)``, T E x 4 B;
    ``router_logits_held``: ERNIE 4.5's), and the top-k weights the router cast to the
    block's dtype (``router_weights_cast``: a new R-long tensor below fp32, which the block
    hands the experts; they save their sorted copy, ``moe.routing_weights``)."""
    moe = _moe(spec)
    rows = dm.tokens * moe.top_k
    held = moe.router_logits_fp32 or moe.router_logits_held
    logits = dm.tokens * moe.num_experts * FP32_BYTES if held else 0
    cast = rows * dm.e if moe.router_weights_cast and dm.e < FP32_BYTES else 0
    return rows * (INDEX_BYTES + FP32_BYTES) + logits + cast


def grouped_kept_moments(spec: ModelSpec, dm: Dims,
                         impl: MoeImpl = MoeImpl.GROUPED) -> list[tuple[int, frozenset[str]]]:
    """The grouped block's working set (``_grouped_moments``) as its two moments under
    op-level checkpointing (``memplan.model.sac_moe.moe_items``), each with the kept items
    alive then beyond it: at the gate the router's projection, kept; at the unsort also
    the gate/up output and the activation, which the checkpointed forward had freed, and as
    transformers 5.23 writes the experts (``impl`` grouped) the product too. The router's
    probabilities and the gathered rows are in both anyway."""
    gate, unsort = _grouped_moments(spec, dm, impl)
    moe = _moe(spec)
    # a shared MLP that ran first freed its tensors when its down projection returned; its
    # output is alive at both moments anyway (``_grouped_moments``)
    shared = ({"moe.shared.gate", "moe.shared.act", "moe.shared.up", "moe.shared.prod",
               "moe.shared.gate_up"}
              if moe.num_shared_experts and not moe.shared_experts_last else set())
    # an fp32 router's input and weight copies, freed once its logits exist (_routing_bytes)
    router = {"moe.router", "moe.router_input_fp32", "moe.router_weight_fp32"}
    if moe.router_topk_softmax and moe.router_weights_cast and dm.e < FP32_BYTES:
        # the fp32 softmax of the top-k, a temporary once ``.type_as`` cast it
        # (``_routing_bytes``): kept, it is alive at both moments beyond them
        router.add("moe.topk_weights")
    freed = {"moe.expert.gate_up", "moe.expert.act"} | (
        {"moe.expert.prod"} if impl is MoeImpl.GROUPED else set())
    at_gate = set()
    if moe.clamped_swiglu:
        at_gate, more = _clamped_kept(spec)
        freed |= more
    return [(gate, frozenset(router | shared | at_gate)),
            (unsort, frozenset(router | freed | shared))]


def loop_kept_moments(spec: ModelSpec, dm: Dims) -> list[tuple[int, frozenset[str]]]:
    """memplan's reference loop (``MoeImpl.LOOP``: memplan/profile/reference.py
    ``MoE.forward``) in a checkpointed forward, its last expert's moments (the kept outputs
    of the experts before it alive: ``memplan.model.layer.ops_forward_peak`` adds each
    repeated item's earlier shares), each with the kept items of the running expert alive
    beyond it (``memplan.model.sac_moe._loop_ops``' names; the router's logits, freed once
    softmaxed, in all). Beside the router's fp32 probabilities, the top-k indices and cast
    weights and the combined output (``out``, stream-sized) bound to the block's end, and
    the expert's row and slot indices, over its r = T k / (E / ep) rows (the rank's T k
    routed rows among its experts, balanced routing; the rows h wide, the MLP's f): at its
    product ``flat[rows]``, the SiLU's and up projection's outputs and the product (the
    gate's output freed by SiLU); at its down projection ``flat[rows]``, the product and
    the output; at the weighting the down projection's output, the weights' gather and the
    weighted rows (``flat[rows]`` freed as the expert returned); at each of the three the
    expert before's weighted rows, bound to ``y`` until the weighting rebinds it; at
    ``out.index_add`` (out of place) the weighted rows and the new output beside the old.
    Traced: the reference model with a Mixtral-like block, fp32, 2 x 128 tokens, the last
    expert's product the forward's peak, exact (tests/traced/test_sac_policy.py)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = dm.tokens * moe.top_k * dm.ep // moe.num_experts  # a local expert's
    rh, inner = rows * h * e, rows * moe.expert_ffn_hidden_size // dm.experts().tp * e
    bound, before = _loop_locals(spec, dm, rows)
    # the router's logits, freed once softmaxed; an fp32 router's casts, once it ran; a top-k
    # softmax's fp32 output below fp32, once cast to the block's dtype
    router = {"moe.router_input_fp32", "moe.router_weight_fp32"} | (
        {"moe.topk_weights"} if moe.router_topk_softmax and e < FP32_BYTES
        and (moe.router_logits_fp32 or moe.router_fp32) else set()) | (
        set() if _loop_logits_are_held(moe, dm) else {"moe.router"})
    at_prod, at_down, made = _loop_expert_kept(spec)
    done = made | {"moe.dispatched"}
    loop = router | done | {"moe.expert.down", "moe.routing_weights"}
    first = _loop_router_moment(spec, dm)
    prod, down = _loop_expert_inner(spec)
    return [(first, frozenset({BEFORE_LOOP}))] * bool(first) + [
        (bound + before + rh + prod * inner, frozenset(router | at_prod)),
            (bound + before + 2 * rh + down * inner, frozenset(router | at_down)),
            (bound + before + 2 * rh + rows * e, frozenset(router | done)),
            (bound + dm.rows * h * e + rh, frozenset(loop))] + _loop_shared_kept(
                spec, dm, bound, loop)


# a moment of the loop's before its first expert ran (``loop_kept_moments``): the kept
# experts' shares are not made yet (``memplan.model.layer.ops_forward_peak``)
BEFORE_LOOP = "moe.loop.before"


def _loop_router_moment(spec: ModelSpec, dm: Dims) -> int:
    """The reference loop's fp32 router below fp32 (``MoESpec.router_fp32``: memplan/profile/
    reference.py ``Fp32Linear.forward``, DeepseekV3TopkRouter.forward's) in a checkpointed
    forward, at its linear: the input's fp32 copy (T h x 4 B), the weight's (E h x 4 B) and
    a bias's (E x 4 B), and the fp32 logits (T E x 4 B); nothing of the loop's made yet (its
    probabilities, ``out``). 0 otherwise (Mixtral's router, or fp32: the casts return their
    input), where the experts' moments are larger. Traced: the reference model with a
    Mixtral-like block and an fp32 router, bf16, 2 x 128 tokens
    (tests/traced/test_sac_policy.py)."""
    moe, h = _moe(spec), spec.hidden_size
    if not moe.router_fp32 or dm.e >= FP32_BYTES:
        return 0
    E = moe.num_experts
    return (dm.tokens * h + E * h + (E if moe.router_bias else 0) + dm.tokens * E) * FP32_BYTES


def _loop_shared_kept(spec: ModelSpec, dm: Dims, bound: int, loop: set[str]
                      ) -> list[tuple[int, frozenset[str]]]:
    """The reference loop's shared MLP in a checkpointed forward (``_loop_shared_moments``:
    at its product, its down projection and ``out + shared``, beside ``bound``), each with the
    kept items alive beyond it: every expert's (``loop``: the experts' kept outputs all made
    by then; the last expert's weighted rows are ``y``, which the moments hold, so of
    ``moe.combine_in`` only the experts before's shares: ``layer.ops_forward_peak``) and the
    shared MLP's own the checkpointed forward had freed: at the product its gate
    projection's output (freed by SiLU), at the down projection also the SiLU's and up
    projection's outputs, at the sum also the product. None without shared experts."""
    if not _moe(spec).num_shared_experts:
        return []
    prod, down, *gated, add = _loop_shared_moments(spec, dm)
    gate = {"moe.shared.gate"}
    inputs = gate | {"moe.shared.act", "moe.shared.up"}
    made = loop | inputs | {"moe.shared.prod"}
    if gated:
        # the gate's product: its h -> 1 projection's output freed by the sigmoid; at the
        # sum also the sigmoid's and the down projection's, freed by the product
        return [(bound + prod, frozenset(loop | gate)),
                (bound + down, frozenset(loop | inputs)),
                (bound + gated[0], frozenset(made | {"moe.shared_gate_proj"})),
                (bound + add, frozenset(made | {"moe.shared_gate_proj", "moe.shared_gate",
                                                "moe.shared.down"}))]
    return [(bound + prod, frozenset(loop | gate)), (bound + down, frozenset(loop | inputs)),
            (bound + add, frozenset(made))]


def _loop_locals(spec: ModelSpec, dm: Dims, rows: int) -> tuple[int, int]:
    """The reference loop's tensors beside its running expert's own, over that expert's
    ``rows`` (memplan/profile/reference.py ``MoE.forward``): bound to the block's end, the
    router's fp32 probabilities, the combined output (``out``, stream-sized), the top-k
    indices and cast weights, and the expert's row and slot indices (``torch.where``); and
    the expert before's weighted rows, bound to ``y`` until the running expert's weighting
    rebinds it (none on a rank of one expert). Traced: the reference model with a
    Mixtral-like block, fp32, 2 x 128 tokens (tests/traced/test_sac_policy.py)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    bound = (_loop_router_bound(moe, dm) + dm.rows * h * e
             + dm.tokens * moe.top_k * (INDEX_BYTES + e) + 2 * rows * INDEX_BYTES)
    return bound, (rows * h * e if moe.num_experts // dm.ep > 1 else 0)


def _loop_router_bound(moe: MoESpec, dm: Dims) -> int:
    """What the reference loop's router binds to the block's end beside its top-k (memplan/
    profile/reference.py ``MoE._route``): the fp32 probabilities of Mixtral's softmax (none
    behind a top-k softmax, ``router_topk_softmax``: GPT-OSS's logits and top-k values are
    freed by it) and the logits it holds (``_loop_held_logits``)."""
    probs = 0 if moe.router_topk_softmax else dm.tokens * moe.num_experts * FP32_BYTES
    return probs + _loop_held_logits(moe, dm)


def _loop_held_logits(moe: MoESpec, dm: Dims) -> int:
    """The router's logits the reference loop binds to the block's end, saved by no one:
    cast to fp32 (``router_logits_fp32``: GraniteMoeMoE.forward's ``_``) or as the linear
    made them (``router_logits_held``: Ernie4_5_MoeSparseMoeBlock.forward's ``_``, fp32
    behind an fp32 router); T E x (4 or e) B, 0 otherwise."""
    if not (moe.router_logits_fp32 or moe.router_logits_held):
        return 0
    fp32 = moe.router_logits_fp32 or moe.router_fp32
    return dm.tokens * moe.num_experts * (FP32_BYTES if fp32 else dm.e)


def _loop_logits_are_held(moe: MoESpec, dm: Dims) -> bool:
    """Whether the logits the loop holds (``_loop_held_logits``) are the router linear's own
    output (``moe.router``; no cast between: ``router_logits_held``, or fp32 logits where
    the linear runs in fp32), which kept adds nothing then."""
    if not (moe.router_logits_fp32 or moe.router_logits_held):
        return False
    return (moe.router_logits_held or moe.router_fp32 or dm.e >= FP32_BYTES)


def _loop_shared_moments(spec: ModelSpec, dm: Dims) -> tuple[int, ...]:
    """The reference loop's shared MLP (memplan/profile/reference.py ``MoE.forward``: ``out =
    out + self.shared(flat)`` after the loop; ``MLP.forward``: ``self.down(self._act(self.
    gate(x)) * self.up(x))``) run without saving, beside the loop's locals (``_loop_locals``'
    bound ones) and the last expert's weighted rows (``y``, r h, bound to the block's end):
    at its product the activation, the up projection's output and the product (the gate's
    output freed by the activation; ungated, the up projection's and the activation's
    outputs), at its down projection the product and the output, at ``out + shared`` the
    shared output and the new sum beside the old ``out`` (T rows, the shared experts' widths
    together over TP; (0, 0, 0) without shared experts). With a shared-expert gate (``torch.
    sigmoid(self.shared_gate(flat)) * shared``, Qwen2MoeSparseMoeBlock.forward's) a moment
    before the sum: at the gate's product the shared output, the sigmoid (T x 1) and the
    product (the gate projection's output freed by the sigmoid), then the sum as without.
    Traced: the reference model with a Mixtral-like block and two shared experts, fp32, 2 x
    128 tokens, under full recompute, gated and not (tests/traced/test_sac_policy.py)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    if not moe.num_shared_experts:
        return 0, 0, 0
    rows = dm.tokens * moe.top_k * dm.ep // moe.num_experts
    y = rows * h * e
    inner = dm.tokens * moe.num_shared_experts * moe.shared_expert_ffn_hidden_size // dm.tp * e
    stream = dm.rows * h * e
    gated = (y + 2 * stream + dm.tokens * e,) if moe.shared_expert_gate else ()
    return (y + (3 if spec.mlp.gated else 2) * inner, y + inner + stream, *gated,
            y + 2 * stream)


def _loop_expert_inner(spec: ModelSpec, ops: bool = True) -> tuple[int, int]:
    """How many of its r x f tensors the reference loop's expert holds at its product and at
    its down projection (beside ``flat[rows]``, and there its output, r x h): a gated MLP's
    activation, up projection and product (the gate's output freed by the activation; ``ops``
    False, the working set under full recompute: an ungated one's up projection and
    activation), then the product; GPT-OSS's clamped expert (memplan/profile/reference.py
    ``ClampedExpert``, ``clamped_swiglu``) at ``(up + 1) * glu`` its gate/up output (2 f,
    a local), the clamped gate and up, glu, up + 1 and the product (``gate * alpha`` and the
    sigmoid freed by glu's product; the biases' adds are the linears' own: ``addmm``), then
    all but up + 1 (the locals bound until the expert returns). Traced: the reference model
    with a GPT-OSS-like block, fp32 and bf16, 2 x 128 tokens, under full recompute and
    op-level checkpointing (tests/traced/test_sac_policy.py; before, 3 f at the product:
    196,608 B under in fp32, -13.3% of the first step's forward under full recompute)."""
    if _moe(spec).clamped_swiglu:
        return 7, 6
    return (3 if spec.mlp.gated or ops else 2), 1


def _loop_expert_kept(spec: ModelSpec) -> tuple[set[str], set[str], set[str]]:
    """The running expert's kept items alive beyond the checkpointed forward's moments at
    its product and at its down projection (``_loop_expert_inner``), which it had freed: a
    gated MLP's gate projection output (freed by the activation), then also the
    activation's and up projection's (freed by the product); GPT-OSS's clamped expert's
    sigmoid (freed by glu's product), then also up + 1 (freed by the product); and all its
    MLP's items before the down projection (freed as the expert returns)."""
    if _moe(spec).clamped_swiglu:
        return ({"moe.expert.sigmoid"}, {"moe.expert.sigmoid", "moe.expert.up_plus_one"},
                {"moe.expert.gate_up", "moe.expert.gate_clamped", "moe.expert.sigmoid",
                 "moe.expert.glu", "moe.expert.up_plus_one", "moe.expert.prod"})
    mlp_in = {"moe.expert.gate", "moe.expert.act", "moe.expert.up"}
    return {"moe.expert.gate"}, mlp_in, mlp_in | {"moe.expert.prod"}


def _loop_shared_working(spec: ModelSpec, dm: Dims) -> int:
    """The largest of the loop's shared MLP moments (``_loop_shared_moments``)."""
    return max(_loop_shared_moments(spec, dm))


def _clamped_kept(spec: ModelSpec) -> tuple[set[str], set[str]]:
    """GPT-OSS's clamped experts under op-level checkpointing (``sac_moe._clamped_ops``):
    the kept items alive beyond the checkpointed block's gate moment (``(up + 1) * glu``,
    ``_grouped_moments``: the biased gate/up output, its gathered bias, the clamped gate and
    up, glu, up + 1 and the product), and beyond its unsort, once ``_apply_gate`` returned
    and ``_grouped_linear`` rebound its output to the biased sum. At the gate: the gate/up
    projection's own output (with biases, freed by ``out = out + bias``) and the sigmoid
    (freed by ``gate * sigmoid``); at the unsort also the clamped gate, glu and up + 1 (the
    product is ``proj_out``'s, the unsort moment's own as transformers 5.3 wrote it) and,
    with biases, the down projection's own output."""
    gate = {"moe.expert.sigmoid"} | ({"moe.expert.gate_up"} if spec.mlp_bias else set())
    unsort = {"moe.expert.gate_up", "moe.expert.gate_clamped", "moe.expert.sigmoid",
              "moe.expert.glu", "moe.expert.up_plus_one"}
    return gate, unsort | ({"moe.expert.down"} if spec.mlp_bias else set())


def _gated_shared_unsort(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """Grouped experts beside a gated shared expert that runs first (Qwen2MoeSparseMoeBlock
    and Qwen3NextSparseMoeBlock.forward: shared_expert, then the router and the experts, then
    ``sigmoid(shared_expert_gate(x)) * shared_expert_output`` and the sum): the gate's
    product was made last, so its backward runs first and frees what it saved (the shared
    output and the sigmoid), leaving the shared output's gradient to wait for the shared
    expert's backward (made first, it runs last) beside the block input's from the gate's
    linear (T h each); then the routed branch from the unsort (``_unsort``) and the
    weighting (``_weighting``), in the routing weights' width (traced: transformers' Qwen2-
    MoE, 2 x 256 tokens, bf16 and fp32, the unsort's index_put the backward's peak)."""
    moe = _moe(spec)
    if moe.num_shared_experts and moe.shared_experts_last:
        return _shared_last_unsort(spec, dm, saved)
    if not (moe.shared_expert_gate and moe.num_shared_experts):
        # alone, or an ungated shared MLP that ran first (HunYuanMoEV1Moe.forward,
        # Ernie4_5_MoeSparseMoeBlock.forward): the output sum's backward hands both
        # branches the one incoming gradient, and the shared MLP's backward runs last
        return _unsort(spec, dm, saved)
    gated = dm.tokens * spec.hidden_size * dm.e + dm.tokens * dm.e  # shared_out, shared_gate
    waiting = 2 * dm.rows * spec.hidden_size * dm.e
    return [m._replace(transient_bytes=m.transient_bytes + waiting)
            for m in _unsort(spec, dm, saved - gated)]


def _shared_last_backward(spec: ModelSpec, dm: Dims, saved: int,
                          impl: MoeImpl = MoeImpl.GROUPED) -> list[BackwardMoment]:
    """The shared experts' MLP backward where they ran after the routed experts
    (``shared_after``), so before the routed experts' backward: an MLP backward over
    the T tokens (its down projection's, its activation's, its input projection's) beside
    everything the block saved, the routed experts' terms all alive (traced: transformers
    5.23's granitemoeshared under full recompute, where the rerun rebuilt them all: the
    shared MLP's product backward the step's backward peak). Their weights' gradients are
    their own groups (``shared_last_groups``): the down projection's from its moment on, all
    of theirs at the input projection's, each just made there (``fresh_params``).

    Where the layer scales the block's output before the residual add (``ModelSpec.
    scaled_residual``: GraniteMoeSharedDecoderLayer.forward's ``residual + hidden_states *
    self.residual_multiplier``), the product's backward made the block output's gradient
    a tensor of its own (T h), beside the stream's; the output sum's backward hands it to
    both branches, and the routed branch's first node (the view of the per-token sum, after
    the shared MLP's whole backward) holds it through these moments (traced: transformers
    5.23's granitemoeshared under full recompute, 2 x 256 tokens: the scaled copy and the
    shared output_linear's weight gradient alive at the shared product's backward, the
    step's backward peak)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    if not shared_after(spec, impl):
        return []
    ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
    shared, _ = _shared_ran_first(spec, dm, impl)
    linears = mlp.mlp_linears(spec, ffn)
    down, inputs = linear.params(linears[-1:], dm.tp), linear.params(linears[:-1], dm.tp)
    moments = mlp.backward_moments(
        spec, dm, saved=saved, freed=mlp.dropout_mask_bytes(spec, dm), run_tokens=dm.tokens,
        # (the reference loop's MLP runs gate and up apart whatever ``fused_gate_up`` says)
        ffn=ffn, grad_inputs=dm.rows * h * e, fresh=0,
        fused_in=spec.fused_gate_up and impl is not MoeImpl.LOOP,
        in_saved=saved - shared)
    scaled = dm.rows * h * e if spec.scaled_residual else 0
    names = {"mlp_out": "moe_shared_out", "mlp": "moe_shared"}
    fresh = {"mlp": down, "mlp_in": inputs}  # the weight gradient each moment just made
    return [m._replace(name=f"moe_shared{m.name[3:]}",
                       transient_bytes=m.transient_bytes + scaled,
                       grads=tuple(names[g] for g in m.grads), fresh_params=fresh.get(m.name, 0))
            for m in moments]


def shared_last_groups(spec: ModelSpec, t: int, groups: dict[str, int]) -> dict[str, int]:
    """The gradient groups of shared experts that ran after the routed experts
    (``shared_experts_last``: GraniteMoeSharedDecoderLayer.forward's ``moe_hidden_states +
    self.shared_mlp(hidden_states)``, DeepseekV3MoE.forward's ``hidden_states +
    self.shared_experts(residuals)``), whose whole backward runs before the routed experts':
    ``moe_shared_out`` their down projection (its backward first), ``moe_shared`` all of
    theirs; and ``mlp_out`` (the experts' down projections, ``groups``, where the shared down
    projection already is) with their input projections too. None otherwise."""
    moe = _moe(spec)
    if not (moe.num_shared_experts and moe.shared_experts_last):
        return {}
    shared = _shared_linears(spec)
    down, every = linear.params(shared[-1:], t), linear.params(shared, t)
    return {"moe_shared_out": down, "moe_shared": every,
            "mlp_out": groups["mlp_out"] + every - down}


# the groups the loop's expert moments name once the shared MLP's backward ran before them
_AFTER_SHARED = {"mlp_out": "moe_after_shared"}


def _loop_shared_groups(spec: ModelSpec, t: int, groups: dict[str, int]) -> dict[str, int]:
    """The shared experts' gradient groups as the reference loop runs them, after the routed
    experts whatever the spec's order (``shared_after``): ``moe_shared_out``, ``moe_shared``
    (``shared_last_groups``) and ``moe_after_shared``, the experts' down projections with
    all the shared MLP's, which the loop's expert moments name (``_AFTER_SHARED``); none
    without shared experts."""
    if not _moe(spec).num_shared_experts:
        return {}
    shared = _shared_linears(spec)
    down, every = linear.params(shared[-1:], t), linear.params(shared, t)
    return {"moe_shared_out": down, "moe_shared": every,
            "moe_after_shared": groups["mlp_out"] + every - down}


def _shared_last_unsort(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """Grouped experts before their shared experts (DeepseekV3MoE.forward, Glm4MoeMoE,
    Dots1MoE: ``hidden_states + self.shared_experts(residuals)``): the shared MLP was made
    last, so its backward runs first; at the unsort's backward (``_unsort``) its saved terms
    are freed, its input's gradient (T h) waits to be summed with the routed branch's and
    its weights' gradients exist (``moe_shared``, ``shared_last_groups``; traced:
    transformers' DeepSeek-V3 narrowed, fp32, 2 x 64 tokens, its dense layer's MLP kept
    under op-level checkpointing, so that the MoE layer's unsort sets the backward's peak:
    98,304 B, the shared expert's three weights' gradients, under before). Below fp32 an
    fp32 router (DeepseekV3TopkRouter.forward: ``F.linear(hidden_states.float(), ...)``)
    saves its own copy of the block's input, and the routed experts gather it by index
    (saving the index): the shared MLP's linears were the input's last holders, and it is
    freed with their terms (traced alike in bf16: the MLP norm's output gone at the unsort,
    32,768 B, which the layer's moment counted among the norm's saved terms)."""
    moe = _moe(spec)
    shared = total(mlp.mlp_terms("moe.shared", spec, dm, moe.num_shared_experts
                                 * moe.shared_expert_ffn_hidden_size, dm.tokens))
    if moe.router_fp32 and dm.e < FP32_BYTES:
        shared += dm.linear_rows * spec.hidden_size * dm.e
    waiting = dm.rows * spec.hidden_size * dm.e
    return [m._replace(transient_bytes=m.transient_bytes + waiting, grads=("moe_shared",))
            for m in _unsort(spec, dm, saved - shared)]


def shared_after(spec: ModelSpec, impl: MoeImpl) -> bool:
    """Whether the block runs its shared experts after the routed experts: where the spec
    says so (``shared_experts_last``: DeepseekV3MoE.forward, GraniteMoeSharedDecoderLayer.
    forward), and always in memplan's reference loop (``MoeImpl.LOOP``: memplan/profile/
    reference.py ``MoE.forward``, ``out = out + self.shared(flat)`` after the expert loop),
    whatever order the spec's own code runs them in."""
    moe = _moe(spec)
    return bool(moe.num_shared_experts) and (moe.shared_experts_last or impl is MoeImpl.LOOP)


def _shared_ran_first(spec: ModelSpec, dm: Dims,
                      impl: MoeImpl = MoeImpl.GROUPED) -> tuple[int, int]:
    """(the shared experts' saved terms, their input's gradient) where they ran after the
    routed experts (``shared_after``: DeepseekV3MoE.forward, GraniteMoeSharedDecoder
    Layer.forward's moe_hidden_states + self.shared_mlp(hidden_states), the reference loop),
    so their backward ran before the routed experts': by the experts' MLP backward their
    terms are freed and their input's gradient (T h) waits to be summed with the experts'
    (traced: transformers 5.23's granitemoeshared, its experts grouped); (0, 0) otherwise."""
    moe = _moe(spec)
    if not shared_after(spec, impl):
        return 0, 0
    shared = total(mlp.mlp_terms("moe.shared", spec, dm, moe.num_shared_experts
                                 * moe.shared_expert_ffn_hidden_size, dm.tokens))
    return shared, dm.rows * spec.hidden_size * dm.e


def _compiled_unsort(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """The compiled block's backward start (``memplan.model.compiled.moe_terms``): Inductor's
    backward graph turns the output's gradient into the unsorted rows' gradient by an
    ``index_put`` into fp32 zeros (R h in the routing weights' width), and from it the
    routing weights' gradient and the down output's in the block's dtype (R h), beside
    everything saved; the expanded copy of the incoming gradient is fused away (traced:
    transformers' Qwen3-MoE layer, its backward graph and the CPU allocator's events)."""
    moe, h = _moe(spec), spec.hidden_size
    rows = dm.tokens * moe.top_k
    width = max(dm.e, weights_width(moe, dm))
    return [BackwardMoment("moe_unsort", saved, rows * h * (width + dm.e), ())]


def _unsort(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """Grouped experts alone (Mixtral's block): the block's backward starts at the per-token
    sum of the weighted rows (integrations/moe.py ``grouped_mm_experts_forward``), in the
    routing weights' fp32 by type promotion: the view's backward copies the sum's expanded
    gradient (R h; the output cast's gradient before it is freed by then), and the unsort's
    (``weighted_out[inv_perm]``) makes zeros and an out-of-place index_put of the rows (R h
    each), beside everything the block saved (traced: transformers' Mixtral; under full
    recompute the rerun runs from the unsort's backward, which needs the permutation, and
    this moment follows it); then the weighting's (``_weighting``)."""
    moe, h = _moe(spec), spec.hidden_size
    width = max(dm.e, weights_width(moe, dm))
    return [BackwardMoment("moe_unsort", saved, 3 * dm.tokens * moe.top_k * h * width, ()),
            _weighting(spec, dm, saved)]


def _weighting(spec: ModelSpec, dm: Dims, saved: int) -> BackwardMoment:
    """The weighting's backward (``proj_out * sample_weights``, integrations/moe.py
    grouped_mm_experts_forward), after the unsort's, whose node freed its index: the
    unsorted rows' gradient (its input), the down output's and the product's for the
    weights' (R h each, the routing weights' width), then the engine casts the down
    output's to its dtype (torch/csrc/autograd/engine.cpp validate_outputs; R h where the
    weights are wider), the node's saved tensors still alive. Under full recompute the
    checkpoint dropped the down output and the weights as the node unpacked them
    (``rerun_freed``) before the cast (traced: transformers' Qwen2-MoE, bf16, 2 x 256
    tokens: without recompute the cast is the backward's peak, 253,952 B above the unsort's;
    Mixtral's at that shape was -2.07% for want of it)."""
    moe, h = _moe(spec), spec.hidden_size
    rows = dm.tokens * moe.top_k
    width = max(dm.e, weights_width(moe, dm))
    cast = rows * h * dm.e if dm.e < width else 0
    return BackwardMoment("moe_weighting", saved - rows * INDEX_BYTES,
                          3 * rows * h * width + cast, (),
                          rerun_freed=rows * h * dm.e + rows * weights_width(moe, dm))


def moe_terms(spec: ModelSpec, dm: Dims, impl: MoeImpl = MoeImpl.LOOP) -> list[Term]:
    """An MoE feed-forward's saved terms, assuming balanced routing."""
    moe = _moe(spec)
    if impl is MoeImpl.EVERY:
        return every_expert_terms(spec, dm)
    if impl is MoeImpl.PARALLEL:
        return moe_parallel.parallel_terms(spec, dm)
    if impl is MoeImpl.TITAN:
        return moe_titan.titan_terms(spec, dm)
    routed = dm.tokens * moe.top_k
    h, e = spec.hidden_size, dm.e
    grouped = impl.grouped
    terms = []
    if moe.router_fp32 and e < FP32_BYTES:
        # DeepseekV3TopkRouter: F.linear(x.type(float32), weight.type(float32)); a weight
        # built in fp32 is its own copy (``router_weight_fp32``)
        terms.append(Term("moe.router_input_fp32", dm.tokens * h * FP32_BYTES))
        if not moe.router_weight_fp32:
            terms.append(Term("moe.router_weight_fp32", moe.num_experts * h * FP32_BYTES))
    terms += _router_terms(moe, dm, routed) + [
        Term("moe.token_index", routed * INDEX_BYTES),  # which rows each expert gathers
    ]
    if grouped:  # the sort by expert (argsort) and its inverse, both indexing saved rows
        terms += [Term("moe.sort_index", routed * INDEX_BYTES),
                  Term("moe.unsort_index", routed * INDEX_BYTES)]
    terms += [
        Term("moe.dispatched", routed * h * e),
        *_expert_terms(spec, dm, routed),
        Term("moe.expert_out", routed * h * e),
        # grouped: the sorted routing weights the outputs are scaled by (``weights_width``)
        Term("moe.routing_weights", routed * (weights_width(moe, dm) if grouped else e)),
    ]
    if not grouped:
        terms.append(Term("moe.combine_in", routed * h * e))  # weighted outputs, index_add's
    if moe.num_shared_experts:
        ffn = moe.num_shared_experts * moe.shared_expert_ffn_hidden_size
        terms += mlp.mlp_terms("moe.shared", spec, dm, ffn, dm.tokens)
        if moe.shared_expert_gate:
            # sigmoid(gate(x)) * shared(x): the product saves the sigmoid and the output
            terms += [Term("moe.shared_gate", dm.tokens * e),
                      Term("moe.shared_out", dm.tokens * h * e)]
    return terms


def weights_width(moe: MoESpec, dm: Dims) -> int:
    """Bytes per element of the routing weights the grouped experts scale their rows by: the
    router's fp32 (Mixtral's and Qwen2-MoE's renormalised softmax; Hunyuan's, cast to its
    fp32 logits' dtype), but the compute dtype where the router softmaxes its top-k logits
    in its own dtype (GPT-OSS, ``router_topk_softmax``) or casts the weights to the block's
    (ERNIE 4.5, ``router_weights_cast``)."""
    return dm.e if moe.router_topk_softmax or moe.router_weights_cast else FP32_BYTES


def _router_terms(moe: MoESpec, dm: Dims, routed: int) -> list[Term]:
    """The router's saved outputs: the top-k indices, and the fp32 probabilities of every
    expert with the renormalised top-k weights and their per-token sum; or the softmax of
    the top-k logits (``router_topk_softmax``), which saves its output: in the router's
    dtype (GPT-OSS's GptOssTopKRouter.forward), in fp32 where the logits were cast to it
    (``router_logits_fp32``: Granite's GraniteMoeTopKRouter.forward, whose fp32 logits and
    top-k values nothing saves: topk's backward keeps the indices, the casts nothing)."""
    indices = Term("moe.topk_indices", routed * INDEX_BYTES)
    if moe.router_topk_softmax:
        width = FP32_BYTES if moe.router_logits_fp32 else dm.e
        return [indices, Term("moe.topk_weights", routed * width)]
    # the sum, and where it is clamped (``router_norm_clamped``) the clamped copy too
    sums = (2 if moe.router_norm_clamped else 1) * dm.tokens * FP32_BYTES
    return [Term("moe.router_probs", dm.tokens * moe.num_experts * FP32_BYTES), indices,
            Term("moe.topk_weights", routed * FP32_BYTES + sums)]


def _expert_terms(spec: ModelSpec, dm: Dims, routed: int) -> list[Term]:
    """The routed rows' MLP terms; GPT-OSS's clamped SwiGLU (``clamped_swiglu``: clamp saves
    its input, views of the gate/up output, which it pins; gate * sigmoid(alpha * gate) saves
    the clamped gate and the sigmoid; (up + 1) * glu both factors; the down projection the
    product)."""
    moe, ex = _moe(spec), dm.experts()
    if not moe.clamped_swiglu:
        return mlp.mlp_terms("moe.expert", spec, ex, moe.expert_ffn_hidden_size, routed)
    f = routed * moe.expert_ffn_hidden_size // ex.tp * ex.e
    return [Term("moe.expert.gate_up", 2 * f), Term("moe.expert.gate_clamped", f),
            Term("moe.expert.sigmoid", f), Term("moe.expert.up_plus_one", f),
            Term("moe.expert.glu", f), Term("moe.expert.prod", f)]


def router_linears(spec: ModelSpec) -> tuple[tuple[Linear, ...], tuple[Linear, ...]]:
    """(the router, the shared experts' gate): projections every rank holds whole (the
    router replicated, as Megatron-LM's TopKRouter), which every token passes."""
    moe, h = _moe(spec), spec.hidden_size
    router = Linear("router", "mlp", h, moe.num_experts, moe.router_bias, Split.NONE)
    gate = Linear("shared_gate", "mlp", h, 1, split=Split.NONE)
    return (router,), ((gate,) if moe.shared_expert_gate else ())


def _shared_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    moe = _moe(spec)
    if not moe.num_shared_experts:
        return ()
    return mlp.mlp_linears(spec, moe.num_shared_experts * moe.shared_expert_ffn_hidden_size)


@lru_cache(maxsize=256)
def moe_linears(spec: ModelSpec, ep: int) -> tuple[Linear, ...]:
    """The block's projections on one EP rank in registration order: the router, this rank's
    experts (each an MLP, or with ``stacked_experts`` two tensors holding all of them: gate and
    up, then down; with ``split_gate_up`` three: gate, down, up), the shared experts and their
    gate."""
    moe, h = _moe(spec), spec.hidden_size
    local, f = moe.num_experts // ep, moe.expert_ffn_hidden_size
    router, gate = router_linears(spec)
    if moe.stacked_experts:
        inputs = 2 if spec.mlp.gated else 1
        bias = spec.mlp_bias  # GPT-OSS's gate_up_proj_bias, down_proj_bias (GptOssExperts)
        experts: tuple[Linear, ...] = (
            Linear("experts_in", "mlp", h, inputs * f, bias, stack=local),
            Linear("experts_down", "mlp_out", f, h, bias, split=Split.ROW, stack=local))
        if moe.split_gate_up and inputs == 2:  # GroupedExperts' w1, w2, w3
            w1 = Linear("experts_gate", "mlp", h, f, bias, stack=local)
            experts = (w1, experts[1], w1._replace(name="experts_up"))
    else:  # each expert an MLP, its projections named as routed (``_routed``)
        experts = tuple(lin._replace(name=_EXPERT_MLP + lin.name)
                        for lin in mlp.mlp_linears(spec, f)) * local
    return router + experts + _shared_linears(spec) + gate


def _grouped_extra(spec: ModelSpec, dm: Dims, impl: MoeImpl = MoeImpl.GROUPED) -> int:
    """Grouped experts' transients beside their saved terms at the unsort: the down
    projection's output scaled by the routing weights (fp32 by type promotion but where
    ``weights_width`` says otherwise) and that product unsorted (a copy), beside the
    function's locals no backward saves: the index locals (``_grouped_locals``) and, as
    transformers 5.3 wrote it (``impl`` grouped-token), the rows gathered by token before
    their sort (``selected_hidden_states``, R h; the sorted copy is saved), which 5.23's
    single gather never makes. Traced: transformers' Mixtral, bf16, 2 x 256 tokens."""
    moe = _moe(spec)
    routed, h = dm.tokens * moe.top_k, spec.hidden_size
    weighted = routed * h * max(dm.e, weights_width(moe, dm))
    by_token = routed * h * dm.e if impl is MoeImpl.GROUPED_TOKEN else 0
    return 2 * weighted + by_token + _grouped_locals(spec, dm) + down_biases_bytes(spec, dm)


def grouped_rerun(spec: ModelSpec, wl: Workload, dm: Dims, saved: int) -> list[Moment]:
    """The grouped block rebuilt in backward under full recompute (``impl`` grouped or
    grouped-token, not compiled): the block's backward starts at the per-token sum, whose
    and the view's backward need no saved tensor, so the view's copy of the expanded
    gradient (R h in the weighted rows' width) is made before the unsort's backward unpacks
    its index and the rerun starts. The rerun stops at that index's pack, made before the
    index runs (``weighted_out[inv_perm]``, integrations/moe.py grouped_mm_experts_forward):
    beside everything the block saves, the weighted rows (R h, the weights' width), the
    function's locals (``_grouped_locals``; biased experts' gathered down biases,
    ``down_biases_bytes``), as 5.3 wrote it the rows gathered by token, the
    shared experts' output where they ran first and the post-attention residual where no
    norm saves it, not their unsorted copy (traced: transformers' ERNIE 4.5 MoE, bf16, 2 x
    256 tokens, 5.3 and 5.23: the rerun's weighting the step's backward peak; GPT-OSS under
    full recompute, 2 x 64 tokens, whose rerun peaks there and at its clamped gate alike:
    step 1's backward read -1.565% (fp32) and -1.435% (bf16) on 5.3 without the biases). Where
    shared experts run last (DeepseekV3MoE.forward, Dots1MoE's) the rerun runs on past the
    unsort to them: at the unsort their terms are not rebuilt yet (traced: transformers'
    DeepSeek-V3 narrowed, bf16, 2 x 256 tokens, the shared MLP's outputs kept under op-level
    checkpointing, alive from the forward: the rerun's unsort the backward's peak, 102,504 B
    under before). Not beside a gated shared expert (Qwen2MoeSparseMoeBlock.forward's sigmoid
    product, ``_gated_shared_unsort``)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    gated = moe.num_shared_experts and moe.shared_expert_gate
    if not wl.moe_impl.grouped or dm.compiled or gated:
        return []
    if moe.num_shared_experts and moe.shared_experts_last:
        # the rerun runs on to the shared MLP, not rebuilt yet at the unsort
        saved -= _shared_ran_first(spec, dm)[0]
    rows = dm.tokens * moe.top_k
    weighted = rows * h * max(e, weights_width(moe, dm))
    by_token = rows * h * e if wl.moe_impl is MoeImpl.GROUPED_TOKEN else 0
    shared = (dm.rows * h * e if moe.num_shared_experts and not moe.shared_experts_last
              else 0)
    residual = (dm.stream(h) if spec.norm_placement.pre_norm and wl.norm_impl.upcast
                and dm.stream_e < FP32_BYTES else 0)
    return [Moment("moe_rerun", saved, 2 * weighted + by_token + shared + residual
                   + _grouped_locals(spec, dm) + down_biases_bytes(spec, dm))]


# the loop's saved terms each expert makes over its own rows (``moe_terms``, loop)
_PER_EXPERT = frozenset({"moe.token_index", "moe.dispatched", "moe.expert.gate",
                         "moe.expert.act", "moe.expert.up", "moe.expert.prod",
                         "moe.expert_out", "moe.routing_weights", "moe.combine_in",
                         # GPT-OSS's clamped expert's (``_expert_terms``)
                         "moe.expert.gate_up", "moe.expert.gate_clamped",
                         "moe.expert.sigmoid", "moe.expert.glu", "moe.expert.up_plus_one"})


def loop_rerun(spec: ModelSpec, wl: Workload, dm: Dims, saved: int) -> list[Moment]:
    """memplan's reference loop (``MoeImpl.LOOP``: memplan/profile/reference.py
    ``MoE.forward``) rebuilt in backward: the rerun stops as the last expert's
    ``out.index_add`` packs its inputs (the weighted rows and the rows' index, the block's
    last saved tensors; autograd saves an op's inputs before it runs: torch/utils/
    checkpoint.py's early stop), beside everything the block saves the combined output
    before it (stream-sized), the router's cast top-k weights (a local, T k in the block's
    dtype; in fp32 the renormalised weights), the running expert's ``torch.where`` output
    (its r x 2 int64 ``nonzero``, of which the index saves the rows) and the post-attention
    residual where no norm saves it (as ``grouped_rerun``); and the expert before's
    ``index_add``, out of place (the output before and after it), the last expert's share
    of the terms not rebuilt yet (its r = T k / (E / ep) rows, balanced routing; under op-level
    checkpointing its kept outputs are in the cache: ``memplan.model.layer.ops_kind``).
    With shared experts (run after the loop: ``shared_after``) the rerun runs on to the
    shared MLP and stops as its down projection packs the product, the loop's output
    (stream-sized) and the same locals beside everything saved; at the last combine the
    shared MLP's terms are not rebuilt yet. Traced: the reference model with a Mixtral-like
    block, bf16 and fp32, 2 x 128 tokens, under full recompute and op-level checkpointing,
    with and without two shared experts (tests/traced/test_sac_policy.py)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    local = moe.num_experts // dm.ep  # the rank's experts, T k rows among them
    rows = dm.tokens * moe.top_k // local
    residual = (dm.stream(h) if spec.norm_placement.pre_norm and wl.norm_impl.upcast
                and dm.stream_e < FP32_BYTES else 0)
    # a top-k softmax's held fp32 logits, bound, not saved (``_loop_router_bound``)
    held = _loop_held_logits(moe, dm)
    beside = dm.tokens * moe.top_k * e + 2 * rows * INDEX_BYTES + residual + held
    last = sum(t.size_bytes for t in moe_terms(spec, dm, MoeImpl.LOOP)
               if t.name in _PER_EXPERT) // local
    # the shared MLP after the loop (``shared_after``): not rebuilt at the last combine; the
    # rerun stops at its down projection's pack, its terms then all saved
    shared, _ = _shared_ran_first(spec, dm, MoeImpl.LOOP)
    stream = dm.rows * h * e
    return [Moment("moe_rerun", saved, stream + beside),
            Moment("moe_rerun_combine", saved - last - shared, 2 * stream + beside)]


def _every_extra(spec: ModelSpec, dm: Dims) -> int:
    """Llama 4's MoE beside its saved terms at the experts' sum (Llama4TextMoe.forward): the
    router's logits (returned with the output), the experts' output over E*T rows, the
    shared expert's output and the per-token sum added into it."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = moe.num_experts * dm.tokens
    return dm.tokens * moe.num_experts * e + rows * h * e + 2 * dm.tokens * h * e


def _attention_out(spec: ModelSpec, dm: Dims) -> int:
    """The attention's output, which Llama4TextDecoderLayer.forward keeps in
    attention_states until it returns (``residual + attention_states`` binds a new name)."""
    return dm.rows * spec.hidden_size * dm.e


def _every_working(spec: ModelSpec, dm: Dims) -> int:
    """Llama 4's MoE in a checkpointed forward (nothing saved): the router's logits and
    scores, the scaled input over E*T rows (Llama4TextMoe.forward keeps it in routed_in),
    and in Llama4TextExperts.forward its gate/up output and product alive while the down
    bmm makes its output (the activation freed by then)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = moe.num_experts * dm.tokens
    inner = rows * moe.expert_ffn_hidden_size // dm.experts().tp * e
    return 2 * dm.tokens * moe.num_experts * e + 2 * rows * h * e + 3 * inner


def _every_backward(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """Llama 4's MoE backward: the experts' sum was made last, its backward runs first: the
    down bmm's backward over E*T rows from the sum's gradient, which the view before it
    copies whole (an expanded tensor's reshape), with everything the block saved (the
    shared expert's backward runs next, made after the experts' other nodes); then the
    experts' other nodes, the shared expert's terms freed; then the scaling's: the input's
    gradient, the scaled copy's and their product for the scores' gradient."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    rows = moe.num_experts * dm.tokens
    shared = total(mlp.mlp_terms("moe.shared", spec, dm, moe.num_shared_experts
                                 * moe.shared_expert_ffn_hidden_size, dm.tokens))
    experts = mlp.backward_moments(
        spec, dm.experts(), saved=saved, freed=shared, run_tokens=rows,
        ffn=moe.expert_ffn_hidden_size, grad_inputs=rows * h * e + dm.rows * h * e, fresh=0,
        out_grad=rows * h * e, fused_in=True, in_saved=2 * rows * h * e + rows * e)
    scale = BackwardMoment("moe_scale", rows * h * e + rows * e,
                           3 * rows * h * e + dm.rows * h * e, ("mlp",))
    return [experts[0]._replace(own_bytes=saved)] + experts[1:] + [scale]



class MoE:
    """Routed experts (split by EP, each by TP) and optional shared experts."""

    name = "mlp"  # the feed-forward's place in the layer, whichever kind it is

    def saved(self, spec: ModelSpec, wl: Workload, dm: Dims, recompute: Recompute) -> list[Term]:
        if wl.moe_impl is MoeImpl.TITAN:
            moe_titan.check(spec)
        terms = moe_terms(spec, dm, wl.moe_impl)
        if dm.compiled and wl.moe_impl is MoeImpl.TITAN:  # (compile_rule: bf16 alone)
            terms = compiled.titan_moe_terms(terms, spec.hidden_size, _moe(spec), dm)
        elif dm.compiled:  # (compile_rule: grouped experts only)
            terms = compiled.moe_terms(terms, _moe(spec), dm, wl.moe_impl)
        return terms + residual_dropout_mask("mlp", spec, dm)

    def forward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                        recompute: Recompute) -> list[Moment]:
        stream = dm.rows * spec.hidden_size * dm.e
        saved = total(self.saved(spec, wl, dm, recompute))
        moments = [Moment("mlp", saved, stream)]
        if dm.compiled and wl.moe_impl is MoeImpl.TITAN:
            terms = self.saved(spec, wl, dm, recompute)
            return moments + moe_titan_compiled.compiled_forward(spec, dm, terms, stream)
        if dm.compiled:
            # Inductor's kernels make the block's output beside what it saves, no eager
            # working set (traced: tests/traced/test_compile_trace.py, the layer's forward
            # peak its saved set and its output)
            return moments
        if wl.moe_impl is MoeImpl.PARALLEL:
            return moe_parallel.forward_moments(spec, dm, saved)
        if wl.moe_impl is MoeImpl.TITAN:  # the shared experts run after the combine
            shared, _ = _shared_ran_first(moe_titan.titan_spec(spec), dm)
            return moments + [Moment("moe_combine", saved - shared,
                                     moe_titan.combine_extra(spec, dm))]
        if wl.moe_impl is MoeImpl.EVERY:
            moments.append(Moment("moe_combine", saved, _every_extra(spec, dm)))
        if wl.moe_impl.grouped:
            moments += float8_grouped.forward_moments(spec, dm, self.saved(spec, wl, dm, recompute))
            moments.append(Moment("moe_combine", saved,
                                  _grouped_extra(spec, dm, wl.moe_impl)))
        return moments

    def working_set(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Experts run one after another over their T*k/(E/ep) rows (the rank's T*k routed
        rows among its E/ep experts, balanced routing, as the saved terms count them; an
        expert-parallel dispatch brings each rank the rows its experts were routed from every
        rank of the group: Megatron-LM's MoEAlltoAllTokenDispatcher before SequentialMLP's
        loop over the local experts), while the router's
        probabilities and the combined output accumulate for all tokens. The loop's
        (memplan/profile/reference.py ``MoE.forward``) at its running expert's peak, beside
        those: the top-k indices and cast weights, the expert's row and slot indices, its
        gathered rows and the expert before's weighted rows (``y``, rebound only at this
        expert's weighting). Traced: the reference model with a Mixtral-like block under
        full recompute, routing held balanced, fp32 2 x 128 tokens: the forward's peak
        exact (1.1% to 2.3% under before the routing's tensors and ``y``;
        tests/traced/test_sac_policy.py ``test_full_recompute_on_the_reference_moe_loop``).
        With shared experts, their MLP after the loop where it is larger
        (``_loop_shared_moments``: before, fp32 114,688 B under, -7.47% of the first step's
        forward on the shared toy); behind an fp32 router below fp32, its linear's moment
        where larger (``_loop_router_moment``). The router's tensors bound to the block's end
        follow its variant (``_loop_router_bound``: before, fp32 on the reference model,
        GPT-OSS's router +0.32%, ERNIE's -0.32% of the first step's forward; exact now)."""
        moe, h, e = _moe(spec), spec.hidden_size, dm.e
        stream = dm.rows * h * e
        if wl.moe_impl is MoeImpl.EVERY:
            return [Moment("mlp", 0, stream + _every_working(spec, dm))]
        if wl.moe_impl is MoeImpl.PARALLEL:
            return [Moment("mlp", 0, moe_parallel.working_bytes(spec, dm))]
        if wl.moe_impl is MoeImpl.TITAN:
            return [Moment("mlp", 0, moe_titan.working_bytes(spec, dm))]
        if wl.moe_impl.grouped:
            # the bf16 working set (``_grouped_moments``, traced on transformers' Mixtral);
            # with torchao's float8 grouped GEMMs their casts at the matmuls (traced on
            # torchtitan's GroupedExperts; 0 without float8)
            f8 = float8_grouped.working_bytes(spec, dm)
            return [Moment("mlp", 0, max(*_grouped_moments(spec, dm, wl.moe_impl),
                                         dm.tokens * moe.num_experts * FP32_BYTES + stream + f8
                                         if f8 else 0))]
        rows_e = dm.tokens * moe.top_k * dm.ep // moe.num_experts  # a local expert's
        inner = rows_e * moe.expert_ffn_hidden_size // dm.experts().tp * e
        bound, before = _loop_locals(spec, dm, rows_e)
        prod, down = _loop_expert_inner(spec, ops=False)
        expert = before + rows_e * h * e + max(rows_e * h * e + down * inner, prod * inner)
        return [Moment("mlp", 0, max(bound + max(expert, _loop_shared_working(spec, dm)),
                                     _loop_router_moment(spec, dm)))]

    def backward_moments(self, spec: ModelSpec, wl: Workload, dm: Dims,
                         recompute: Recompute) -> list[BackwardMoment]:
        """The loop: one expert's MLP backward at a time (the largest working set is one
        expert's); the combine's backward ran first: its weighted outputs are freed, and so is
        the output of the expert whose MLP backward is running (one expert's T*k/(E/ep)
        rows).
        Shared experts ran after the loop (``shared_after``): their MLP backward over the T
        tokens first, everything saved alive (before, fp32 under full recompute on the shared
        toy: 151,552 B under, -4.13% of the first step's backward).
        Grouped: one MLP backward over all routed rows, the experts' outputs freed by the
        weighting's backward."""
        moe, h, e = _moe(spec), spec.hidden_size, dm.e
        routed = dm.tokens * moe.top_k * h * e
        saved = total(self.saved(spec, wl, dm, recompute))
        if wl.moe_impl is MoeImpl.EVERY:
            return _every_backward(spec, dm, saved)
        if wl.moe_impl is MoeImpl.TITAN:
            return _titan_backward(spec, dm, saved)
        if wl.moe_impl is MoeImpl.PARALLEL:
            shared, _ = _shared_ran_first(spec, dm)
            return _shared_last_backward(spec, dm, saved) + moe_parallel.backward_moments(
                spec, dm, saved, shared)
        if wl.moe_impl.grouped:
            shared, waiting = _shared_ran_first(spec, dm)
            grouped = float8_grouped.backward_moments(spec, dm, mlp.backward_moments(
                spec, dm.experts(), saved=saved,
                freed=mlp.dropout_mask_bytes(spec, dm) + routed + shared,
                run_tokens=dm.tokens * moe.top_k, ffn=moe.expert_ffn_hidden_size,
                grad_inputs=2 * dm.rows * h * e + waiting, fresh=0, out_grad=routed,
                fused_in=moe.stacked_experts and spec.mlp.gated, in_saved=routed))
            grouped = [m._replace(transient_bytes=m.transient_bytes + waiting)
                       if m.name in ("mlp", "mlp_act") else m for m in grouped]
            first = (_compiled_unsort(spec, dm, saved) if dm.compiled
                     else _gated_shared_unsort(spec, dm, saved))
            return _shared_last_backward(spec, dm, saved) + first + grouped
        # the shared MLP ran after the loop: its backward first, then its terms are freed
        # and its input's gradient waits (``shared_after``)
        shared, waiting = _shared_ran_first(spec, dm, wl.moe_impl)
        experts = mlp.backward_moments(
            spec, dm.experts(), saved=saved,
            freed=mlp.dropout_mask_bytes(spec, dm) + routed + routed * dm.ep // moe.num_experts
            + shared, run_tokens=dm.tokens * moe.top_k * dm.ep // moe.num_experts,
            ffn=moe.expert_ffn_hidden_size, grad_inputs=2 * dm.rows * h * e + waiting,
            fresh=0)
        if shared:  # the shared MLP's weights' gradients exist (``shared_last_groups``)
            experts = [m._replace(grads=tuple(_AFTER_SHARED.get(g, g) for g in m.grads))
                       for m in experts]
        return _shared_last_backward(spec, dm, saved, wl.moe_impl) + experts

    def rebuild_moments(self, spec: ModelSpec, wl: Workload, dm: Dims) -> list[Moment]:
        """Llama 4's MoE rebuilt in backward: the rerun stops once the shared expert's last
        saved tensor is packed, the experts' output over E*T rows and the router's logits
        alive beside everything the block saved, the attention's output
        (``_attention_out``) and the residual, and beside the gradient of that output:
        the sum's and the view's backward need no saved tensor, so they ran before the down
        bmm's unpacking started the rerun, the view's copying the expanded gradient whole
        (traced: an (E, T, h) clone before the rerun's first op). Grouped experts: the
        rerun's stop at the unsort (``grouped_rerun``)."""
        if wl.moe_impl is MoeImpl.LOOP and not dm.compiled:
            return loop_rerun(spec, wl, dm, total(self.saved(spec, wl, dm, Recompute.NONE)))
        if wl.moe_impl is MoeImpl.TITAN and not dm.compiled:
            return self.forward_moments(spec, wl, dm, Recompute.NONE)[-1:]
        if wl.moe_impl is not MoeImpl.EVERY:
            return grouped_rerun(spec, wl, dm, total(self.saved(spec, wl, dm, Recompute.NONE)))
        moe = _moe(spec)
        rows_h = moe.num_experts * dm.tokens * spec.hidden_size * dm.e
        # the post-attention residual (the layer's residual) where its norm saves an fp32
        # copy of it, not the tensor itself
        residual = (dm.stream(spec.hidden_size)
                    if wl.norm_impl.upcast and dm.stream_e < FP32_BYTES else 0)
        return [Moment("moe_rebuild", total(every_expert_terms(spec, dm)),
                       2 * rows_h + dm.tokens * moe.num_experts * dm.e
                       + _attention_out(spec, dm) + residual)]

    def tensor_sizes(self, spec: ModelSpec, t: int, ep: int | ExpertSplit) -> list[int]:
        """The router, this rank's experts, the shared experts and their gate
        (``moe_linears``); the routed experts split by etp (``ExpertSplit``), the rest by
        ``t``."""
        ep, etp = _split(ep, t)
        linears = moe_linears(spec, ep)
        return [n for lin in linears for n in linear.tensor_sizes(lin, etp if _routed(lin)
                                                                  else t)]

    def tensor_shapes(self, spec: ModelSpec, t: int,
                      ep: int | ExpertSplit) -> list[tuple[int, ...]]:
        ep, etp = _split(ep, t)
        return [shape for lin in moe_linears(spec, ep)
                for shape in linear.tensor_shapes(lin, etp if _routed(lin) else t)]

    def grad_groups(self, spec: ModelSpec, t: int, ep: int | ExpertSplit) -> dict[str, int]:
        """``mlp_out``: the experts' down projections (their backward runs first); ``mlp``:
        all; with shared experts that ran last also theirs (``shared_last_groups``)."""
        ep, etp = _split(ep, t)
        linears, order = moe_linears(spec, ep), ("mlp_out", "mlp")
        if etp == t:
            groups = linear.grad_groups(linears, t, order)
        else:
            routed = linear.grad_groups([lin for lin in linears if _routed(lin)], etp, order)
            rest = linear.grad_groups([lin for lin in linears if not _routed(lin)], t, order)
            groups = {g: routed[g] + rest[g] for g in order}
        return groups | shared_last_groups(spec, t, groups) | _loop_shared_groups(spec, t,
                                                                                  groups)

    def flops_per_token(self, spec: ModelSpec, seq_len: int, every: bool = False) -> float:
        """The router and shared experts, and the top-k of the routed experts; with ``every``
        (``MoeImpl.EVERY``: Llama 4's Llama4TextMoe.forward repeats each token E times and
        Llama4TextExperts.forward runs both bmm over all of them, models/llama4/
        modeling_llama4.py) all E experts, the zero-scored ones included."""
        moe = _moe(spec)
        router, gate = router_linears(spec)
        shared = linear.params(router + gate + _shared_linears(spec))
        experts = moe.num_experts * linear.params(mlp.mlp_linears(spec, moe.expert_ffn_hidden_size))
        routed = experts if every else experts * moe.top_k // moe.num_experts
        return 2.0 * shared + 2.0 * routed


def _titan_backward(spec: ModelSpec, dm: Dims, saved: int) -> list[BackwardMoment]:
    """torchtitan's MoE backward (``MoeImpl.TITAN``, ``memplan.model.moe_titan``): its shared
    experts ran last, so their MLP backward runs first (``_shared_last_backward``); then the
    combine's (``moe_titan.combine_backward``; the shared terms freed by then), its
    terms freed after it; then the grouped experts' MLP backward over the R = T k rows in
    bf16 from their output's gradient (R h, cast back from the fp32 product's), the block's
    incoming gradient and, with shared experts, their input's waiting
    (``_shared_ran_first``), which waits from the combine's backward on, and below fp32 the
    shared experts' input freed with their terms (``moe_titan.shared_input_freed``).
    Traced: torchtitan's Qwen3 MoE toy with and without a shared expert, bf16 and fp32,
    each backward peak exact (in fp32 the combine's the peak: the waiting T h x 4 B).
    Compiled: Inductor's order (``moe_titan_compiled.compiled_backward``; inside full AC
    ``moe_titan_compiled.full_ac_backward``)."""
    moe, h, e = _moe(spec), spec.hidden_size, dm.e
    spec = moe_titan.titan_spec(spec)
    routed = dm.tokens * moe.top_k
    ex = dm.experts()._replace(e=moe_titan.EXPERT_BYTES)
    if dm.compiled and dm.rerun:  # inside full AC: the rerun within Inductor's backward
        return moe_titan_compiled.full_ac_backward(spec, dm)
    if dm.compiled:
        return moe_titan_compiled.compiled_backward(spec, dm, saved)
    shared, waiting = _shared_ran_first(spec, dm)
    shared += moe_titan.shared_input_freed(spec, dm)
    combine = [BackwardMoment(name, saved - shared, size + waiting, rerun_freed=freed)
               for name, size, freed in moe_titan.combine_backward(spec, dm)]
    if shared:
        combine = [m._replace(grads=("moe_shared",)) for m in combine]
    experts = mlp.backward_moments(
        spec, ex, saved=saved, freed=shared + routed * (h + 1) * FP32_BYTES,
        run_tokens=routed, ffn=moe.expert_ffn_hidden_size,
        grad_inputs=2 * routed * h * ex.e + dm.rows * h * e + waiting, fresh=0,
        out_grad=routed * h * ex.e, in_saved=routed * h * ex.e)
    experts = [m._replace(transient_bytes=m.transient_bytes + waiting)
               if m.name in ("mlp", "mlp_act") else m for m in experts]
    cast = moe_titan.weight_grad_cast_bytes(spec, dm)
    experts = [m._replace(transient_bytes=m.transient_bytes + cast)
               if m.name in ("mlp", "mlp_in") else m for m in experts]
    return _shared_last_backward(spec, dm, saved) + combine + experts


def _split(ep: int | ExpertSplit, t: int) -> tuple[int, int]:
    """(ep, the experts' TP degree): an ``ExpertSplit``, or a bare ep with the experts split
    by ``t``."""
    return (ep.ep, ep.etp) if isinstance(ep, ExpertSplit) else (ep, t)


def _routed(lin: Linear) -> bool:
    """Whether a projection of ``moe_linears`` belongs to a routed expert."""
    return lin.name.startswith("experts_") or lin.name.startswith(_EXPERT_MLP)
