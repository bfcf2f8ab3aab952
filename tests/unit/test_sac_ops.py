"""Op-level checkpointing (``--recompute ops``, ``--recompute-save``) and its search
(``--recompute auto``): bytes derived by hand for the tiny spec.

tiny: 2 layers, h 64, 4 heads / 2 KV heads of d 16 (q 64, kv 32), SwiGLU f 176, V 128. At
seq 128 and micro-batch 2 in bf16 (bf16-mixed: compute in bf16, e = 2) a layer's tokens are
T = 256, so per layer: its input T*h*e = 32,768; q T*q*e = 32,768; k and v T*kv*e = 16,384
each; the attention kernel's output T*q*e = 32,768 with its fp32 logsumexp b*heads*s*4 =
2*4*128*4 = 4,096 (36,864 together); the output projection's output T*h*e = 32,768; gate,
act, up and product T*f*e = 256*176*2 = 90,112 each.
"""

from __future__ import annotations

import re
from itertools import combinations

import pytest
from memplan.api import estimate, make_layout, make_workload
from memplan.cli import main
from memplan.errors import LayoutError, MemplanError
from memplan.model import sac_ops
from memplan.model.dims import Dims
from memplan.model.layer import ops_items
from memplan.planning.save_sets import choose, frontier, searchable
from memplan.spec import load_model

TINY = dict(seq_len=128, micro_batch_size=2)


def _stage(**fields):
    return estimate("tiny", **TINY, **fields).stages[0]


def test_keeping_nothing_is_full_recompute() -> None:
    """An empty save list keeps each layer's input alone: the fully recomputed layer."""
    ops, full = _stage(recompute="ops"), _stage(recompute="full")
    assert ops.activations_bytes == full.activations_bytes
    assert ops.steady == full.steady and ops.first_step == full.first_step


def test_kept_outputs_add_their_bytes_per_layer() -> None:
    """q (32,768) and the gate projection (90,112) kept in each of the 2 layers: 245,760
    bytes beyond full recompute's saved activations, and on the backward's peak."""
    kept, full = _stage(recompute="ops", recompute_save="attn.q,mlp.gate"), _stage(
        recompute="full")
    assert kept.activations_bytes - full.activations_bytes == 2 * (32_768 + 90_112)


def test_groups_and_term_names() -> None:
    """``attention``: q, k, v, the kernel's output and logsumexp, the output projection's
    output: 32,768 + 2*16,384 + 36,864 + 32,768 = 135,168 per layer; naming the logsumexp
    keeps the kernel's output with it (one op makes both)."""
    full = _stage(recompute="full").activations_bytes
    assert _stage(recompute="ops", recompute_save="attention").activations_bytes - full \
        == 2 * 135_168
    assert _stage(recompute="ops", recompute_save="attn.lse").activations_bytes - full \
        == 2 * 36_864
    mlp = _stage(recompute="ops", recompute_save="mlp").activations_bytes - full
    assert mlp == 2 * 4 * 90_112


def test_keeping_everything_holds_what_no_recompute_saves_and_more() -> None:
    """Every item kept: what a layer without recompute saves, plus its checkpointed input
    and the output projection's output (32,768 + 32,768 per layer)."""
    every = _stage(recompute="ops", recompute_save="attention,mlp,norms")
    none = _stage(recompute="none")
    assert every.activations_bytes - none.activations_bytes == 2 * (32_768 + 32_768)


def test_unknown_name_is_refused_with_the_valid_names() -> None:
    with pytest.raises(MemplanError, match=r"unknown name 'attn\.x'.*valid: .*attn\.q.*"
                                           r"attention, mlp, norms"):
        _stage(recompute="ops", recompute_save="attn.x")


def test_save_list_needs_ops() -> None:
    with pytest.raises(MemplanError, match="needs recompute ops"):
        _stage(recompute="full", recompute_save="attn.q")


def test_refused_where_not_modelled() -> None:
    with pytest.raises(MemplanError, match="recompute ops with a norm's tensors kept under "
                                           "autocast"):
        _stage(recompute="ops", precision="amp-bf16", recompute_save="attn_norm.output")


def test_rerun_flops_by_hand() -> None:
    """Per token, nothing kept: q 2*64*64 = 8,192, k and v 2*64*32 = 4,096 each, the core
    2*s*q = 2*128*64 = 16,384, the output projection 8,192, gate and up 2*64*176 = 22,528
    each, the activation and product 176 each, each norm's 4 saved tensors 64 each (2*256):
    86,880. Keeping q and the gate projection: 86,880 - 8,192 - 22,528 = 56,160."""
    spec = load_model("tiny")
    wl = make_workload(spec, **TINY, recompute="ops")
    items = ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))
    assert sac_ops.rerun_flops_per_token(items, ()) == 86_880
    kept = sac_ops.resolve(items, ("attn.q", "mlp.gate"), spec)
    assert sac_ops.rerun_flops_per_token(items, kept) == 56_160


def test_frontier_is_the_knapsack_optimum_at_every_budget() -> None:
    """Every subset of the searchable items, by brute force: at each subset's bytes the
    frontier's best set keeps at least its FLOPs."""
    spec = load_model("tiny")
    wl = make_workload(spec, **TINY, recompute="ops")
    items = ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))
    pool = searchable(items)
    sets = frontier(items)
    total = sum(i.flops_per_token for i in pool)
    for n in range(len(pool) + 1):
        for subset in combinations(pool, n):
            size = sum(i.size_bytes for i in subset)
            best = min(c.rerun_flops for c in sets if c.kept_bytes <= size)
            assert best <= total - sum(i.flops_per_token for i in subset)


def test_choose_takes_the_most_bytes_that_fit() -> None:
    spec = load_model("tiny")
    wl = make_workload(spec, **TINY, recompute="ops")
    sets = frontier(ops_items(spec, wl, Dims.of(spec, make_layout(1), wl)))
    limit = sets[len(sets) // 2].kept_bytes
    chosen, asked = choose(sets, lambda kept: next(
        c.kept_bytes for c in sets if c.kept == kept) <= limit)
    assert chosen == sets[len(sets) // 2] and asked <= 2 + len(sets).bit_length()
    assert choose(sets, lambda kept: False)[0] is None


def test_auto_fits_and_keeps_the_most_it_can() -> None:
    """On a 7B layer at 4,096 tokens the auto choice fits each budget, and a larger budget
    never reruns more: a save set on 24 and 30 GiB (more kept on 30), no recompute at all on
    40 GiB, where that fits (``api._auto_none``), said in the last assumption."""
    kept = []
    for memory in ("24GiB", "30GiB"):
        est = estimate("llama-2-7b", gpus=8, zero=3, seq_len=4096, gpu_memory=memory,
                       recompute="auto")
        assert est.fits and est.workload.recompute == "ops"
        kept.append(len(est.workload.recompute_save))
    assert kept[0] < kept[1]
    est = estimate("llama-2-7b", gpus=8, zero=3, seq_len=4096, gpu_memory="40GiB",
                   recompute="auto")
    assert est.fits and est.workload.recompute == "none" and est.workload.recompute_save == ()
    assert est.assumptions[-1].startswith("recompute auto: no recompute fits")
    none = estimate("llama-2-7b", gpus=8, zero=3, seq_len=4096, gpu_memory="40GiB",
                    recompute="none")
    assert none.peak_bytes == est.peak_bytes


def test_cli_unknown_name_one_line_exit_2(capsys) -> None:
    code = main(["estimate", "-m", "tiny", "--recompute", "ops", "--recompute-save",
                 "attn.nope"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown name 'attn.nope'" in err and len(err.strip().splitlines()) == 1


def test_plan_auto_ranks_save_sets_per_layout() -> None:
    """plan --recompute ops (auto's save-set search, without its no-recompute option): every
    candidate is op-level checkpointing with the save set chosen at its micro-batch; its peak
    is the estimate's with that set, within the budget, and a layout appears once (its
    fastest micro-batch)."""
    from memplan.api import plan

    # the search's save sets (reserved=False: not re-fitted to the allocator's reserved peak)
    result = plan("llama-2-7b", gpus=8, seq_len=4096, recompute=["ops"], top=3,
                  reserved=False)
    assert result.candidates
    layouts = [c.layout for c in result.candidates]
    assert len(layouts) == len(set(layouts))
    for c in result.candidates[:3]:
        assert c.recompute == "ops" and c.peak_bytes <= result.budget_bytes
        assert c.estimate.peak_bytes == c.peak_bytes
        assert c.estimate.workload.recompute_save == tuple(sorted(c.recompute_save))


@pytest.mark.parametrize("model,gpus", [("tiny", 8), ("gpt2", 4)])
def test_plan_auto_top_ten_are_the_full_search_first_ten(model: str, gpus: int) -> None:
    """plan --recompute ops (auto's save-set search) with --top 10 gives the full search's
    first ten candidates, and ten of them: the search keeps a layout's fastest micro-batch
    only (``_ranked``), so its pruning compares one time a layout (searched before: every
    micro-batch's time counted, 2 candidates of tiny's 24 and of gpt2's 64 given, the rest
    cut as slower than a top ten of duplicates)."""
    from memplan.api import plan

    top = plan(model, gpus=gpus, top=10, recompute=["ops"], reserved=False)
    full = plan(model, gpus=gpus, top=None, recompute=["ops"], reserved=False)
    assert len(top.candidates) == 10 and len(full.candidates) > 10

    def key(c):
        return c.layout, c.micro_batch_size, tuple(c.recompute_save), c.time.step_s

    assert [key(c) for c in top.candidates] == [key(c) for c in full.candidates[:10]]
    assert top.evaluated < full.evaluated


def test_plan_auto_pipeline_set_known_from_a_larger_micro_batch() -> None:
    """Under pipeline parallelism a smaller micro-batch starts from the set a larger one
    fitted (``known``), which the stages' bisection may take without asking it again: its
    peak is evaluated then (before: a KeyError on llama-7b, tp 2, pp 4, dp 1, gbs 64, at
    micro-batch 16, where 32's set was known). Every candidate's peak is its estimate's and
    within the budget."""
    from memplan.api import plan

    result = plan("llama-7b", gpus=8, tp=2, pp=4, zero=0, top=None, recompute=["auto"],
                  reserved=False, seq_len=2048, global_batch_size=64)
    assert result.candidates
    for c in result.candidates:
        assert c.peak_bytes == c.estimate.peak_bytes <= result.budget_bytes


def _emitted(target: str, save: str) -> str:
    from memplan.report.sac_policy import emit_for

    return emit_for(target, estimate("tiny", **TINY, recompute="ops", recompute_save=save))


def test_torch_policy_names_ops_by_family_width_and_index() -> None:
    """tiny's layer runs matmuls of width 64 (q, the output projection and the down projection: h = q = 64),
    32 (k, v) and 176 (gate, up), one SDPA of width heads*d = 64, one silu and one product
    of width 176: q is the 0th 64-wide matmul, the output projection the 1st, the gate the
    0th 176-wide one. Each upcast RMSNorm runs two casts of width 64 (to fp32, back to bf16),
    one rsqrt of width 1 and two products of width 64 (x * rstd, weight * normed): 4, 2 and
    4 per layer."""
    text = _emitted("torch", "attn.q,attn.o_proj,mlp.gate,mlp.prod")
    space: dict = {}
    code = compile(text, "policy.py", "exec")  # a valid module
    names = code.co_names
    assert "policy_fn" in names and "policy_fns" in names and "context_fn" in names
    for line in ("SAVE = {('matmul', 64, 0), ('matmul', 64, 1), ('matmul', 176, 0), "
                 "('mul', 176, 0)}",
                 "PER_LAYER = {('copy', 64): 4, ('rsqrt', 1): 2, ('mul', 64): 4, "
                 "('matmul', 64): 3, ('matmul', 32): 2, ('sdpa', 64): 1, "
                 "('matmul', 176): 2, ('act', 176): 1, ('mul', 176): 1}"):
        assert line in text
    assert space == {}


def test_upcast_norms_are_named_by_their_ops() -> None:
    """tiny's norms (RMSNorm, upcast, bf16): the attention norm's rsqrt is the layer's 0th of
    width 1, its cast back to bf16 the 1st 64-wide ``_to_copy`` (after the cast to fp32),
    its output weight * normed the 1st 64-wide ``mul`` (after x * rstd); the MLP norm's
    input cast the 2nd 64-wide ``_to_copy``."""
    text = _emitted("torch", "attn_norm.stats,attn_norm.normed,attn_norm.output,"
                    "mlp_norm.input_fp32")
    assert "SAVE = {('copy', 64, 1), ('copy', 64, 2), ('mul', 64, 1), ('rsqrt', 1, 0)}" in text
    assert "Not expressible" not in text


@pytest.mark.parametrize(("fields", "save", "refused"), [
    ({"norm_impl": "fused"}, "attn_norm.stats", "attn_norm.stats"),
    ({"precision": "fp32"}, "attn_norm.stats", "attn_norm.stats"),
    ({"norm_impl": "upcast-fp32"}, "attn_norm.normed,attn.q", "attn_norm.normed"),
    ({"norm_impl": "upcast-fp32"}, "attn_norm.normed,mlp_norm.normed",
     "attn_norm.normed, mlp_norm.normed")])
def test_norm_tensors_no_policy_names_are_refused(fields: dict, save: str, refused: str) -> None:
    """A fused kernel's statistics, fp32's (its casts no ops: rsqrt's index is not the
    norm's alone), an upcast-fp32 norm's fp32 x * rstd (its index among the fp32 products
    differs by implementation: litgpt squares by x * x, the reference model by pow): refused
    in one line naming them. Before, the estimate counted them kept while the emitted policy
    said "Not expressible, recomputed instead" (tiny, upcast-fp32, norms: the trace of the
    emitted policy saved 374,024 B of activations, the estimate 1,034,504 B, +176.6%)."""
    with pytest.raises(LayoutError, match=r"^recompute ops with a norm's tensors no policy "
                                          rf"names kept \({re.escape(refused)}\): ") as err:
        estimate("tiny", **TINY, **fields, recompute="ops", recompute_save=save)
    assert "\n" not in str(err.value)


def test_a_group_keeps_what_a_policy_names_of_it() -> None:
    """A group keeps the tensors of its blocks a policy names: ``norms`` under upcast-fp32
    keeps each norm's input_fp32, stats, weight_fp32 and output but not its fp32 x * rstd
    (``normed``, refused when named), which the emitted policy recomputes too; the
    assumption line says so. The same list by name, without the two, gives the same
    estimate."""
    est = estimate("tiny", **TINY, norm_impl="upcast-fp32", recompute="ops",
                   recompute_save="norms")
    assert est.workload.recompute_save == ("norms",)
    line = next(a for a in est.assumptions if a.startswith("recompute ops"))
    assert "(of the groups named, attn_norm.normed, mlp_norm.normed: no op a policy names " \
           "makes them)" in line
    named = ",".join(f"{n}_norm.{t}" for n in ("attn", "mlp")
                     for t in ("input_fp32", "stats", "weight_fp32", "output"))
    by_name = estimate("tiny", **TINY, norm_impl="upcast-fp32", recompute="ops",
                       recompute_save=named)
    assert by_name.peak_bytes == est.peak_bytes
    assert by_name.stages[0].activations_bytes == est.stages[0].activations_bytes


def test_upcast_fp32_norms_are_named_by_their_casts() -> None:
    """tiny (h 64, 2 x 128 = 256 rows, bf16) under upcast-fp32 (the reference model's
    ``Norm``: x.float(), pow, mean, + eps, rsqrt, x * rstd, weight.float(), the product,
    .to(bf16)): each norm's three 64-wide casts and its rsqrt are named, its products
    neither named nor counted. The attention norm's input cast is the layer's 0th 64-wide
    ``_to_copy`` (256 * 64 * 4 = 65,536 B), its rsqrt the 0th of width 1 (256 * 4 = 1,024
    B), its weight's cast the 1st (64 * 4 = 256 B), its cast back the 2nd (256 * 64 * 2 =
    32,768 B); the MLP norm's the 3rd, 1st, 4th and 5th: 99,584 B a norm, 398,336 B over
    the two layers' two norms (traced: tests/traced/test_sac_policy.py)."""
    save = ("attn_norm.input_fp32,attn_norm.stats,attn_norm.weight_fp32,attn_norm.output,"
            "mlp_norm.input_fp32,mlp_norm.stats,mlp_norm.weight_fp32,mlp_norm.output")
    from memplan.report.sac_policy import emit_for

    fields = dict(**TINY, norm_impl="upcast-fp32", recompute="ops")
    est = estimate("tiny", **fields, recompute_save=save)
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("copy", 64, n) for n in range(6)} | {("rsqrt", 1, 0),
                                                                   ("rsqrt", 1, 1)}
    assert space["PER_LAYER"][("copy", 64)] == 6 and space["PER_LAYER"][("rsqrt", 1)] == 2
    assert ("mul", 64) not in space["PER_LAYER"]
    none = estimate("tiny", **fields, recompute_save="")
    kept = est.stages[0].activations_bytes - none.stages[0].activations_bytes
    assert kept == 2 * 2 * (65_536 + 1_024 + 256 + 32_768) == 398_336


def test_norm_scale_fp32_norms_are_named_by_rsqrt_and_products() -> None:
    """tiny with its RMSNorm scaling in fp32 (``norm_scale_fp32``: Gemma2RMSNorm's,
    Olmo2RMSNorm's pow, rsqrt, x * rstd and weight product in fp32) under upcast-fp32: each
    norm's rsqrt and x * rstd named (the attention norm's the 0th of width 1, 256 * 4 = 1,024
    B, and the 0th 64-wide mul, 256 * 64 * 4 = 65,536 B; the MLP norm's x * rstd the 2nd
    mul, after the attention norm's weight product), two 64-wide products a norm counted,
    no cast (Gemma 2 casts its weight, OLMo 2 does not: the casts' indices differ), so its
    casts' tensors are refused when kept."""
    from memplan.report.sac_policy import emit_for

    spec = load_model("tiny").model_copy(update={"norm_scale_fp32": True})
    fields = dict(**TINY, norm_impl="upcast-fp32", recompute="ops")
    est = estimate(spec, **fields, recompute_save="attn_norm.stats,attn_norm.normed,"
                                                  "mlp_norm.normed")
    space: dict = {}
    exec(compile(emit_for("torch", est), "<policy>", "exec"), space)  # noqa: S102
    assert space["SAVE"] == {("rsqrt", 1, 0), ("mul", 64, 0), ("mul", 64, 2)}
    assert space["PER_LAYER"][("mul", 64)] == 4 and ("copy", 64) not in space["PER_LAYER"]
    none = estimate(spec, **fields, recompute_save="")
    assert est.stages[0].activations_bytes - none.stages[0].activations_bytes == \
        2 * (1_024 + 2 * 65_536)
    with pytest.raises(LayoutError, match=r"no policy names kept \(attn_norm\.output\)"):
        estimate(spec, **fields, recompute_save="attn_norm.output")


@pytest.mark.parametrize("fields", [{"norm_impl": "upcast-fp32"}, {"norm_impl": "fused"},
                                    {"precision": "fp32"}])
def test_auto_searches_only_norm_tensors_a_policy_names(fields: dict) -> None:
    """``--recompute auto`` never chooses a norm tensor it would have to refuse: the frontier's
    sets hold no ``NORM`` item; under upcast-fp32 the casts and rsqrt are searched."""
    spec = load_model("tiny")
    wl = make_workload(spec, **TINY, **fields, recompute="ops")
    items = ops_items(spec, wl, Dims.of(spec, make_layout(1), wl))
    unnamed = {i.name for i in items if i.op == sac_ops.NORM}
    assert unnamed and not unnamed & {n for c in frontier(items) for n in c.kept}
    if fields.get("norm_impl") == "upcast-fp32":
        assert unnamed == {"attn_norm.normed", "mlp_norm.normed"}
        assert {"attn_norm.stats", "mlp_norm.output"} <= {i.name for i in searchable(items)}


def test_torchtitan_and_megatron_say_what_they_keep() -> None:
    """torchtitan with q and the gate kept: the other projections' shapes forced (k and v
    share a shape, as do gate and up, so forcing up forces the gate too); its every-second
    rule then keeps the 1st of the remaining matmuls (q, 64x64 shared with the output
    projection: forced too, as o_proj is not kept)."""
    titan = _emitted("torchtitan", "attn.q,mlp.gate")
    assert "force_recompute_mm_shapes_by_fqns=['attention.wk', 'attention.wv', " \
           "'attention.wo', 'feed_forward.w3']" in titan
    assert "Not expressible: attn.q, mlp.gate" in titan
    mega = _emitted("megatron", "attn.q,attn.k,attn.v,attn.o_proj")
    assert "--recompute-granularity selective --recompute-modules core_attn mlp layernorm" in mega


def test_plan_auto_top_is_the_full_search_first() -> None:
    """With top, op-level fits are upgraded in order of the fastest they could be and the
    rest skipped: the first top candidates are those of the search without top."""
    from memplan.api import plan

    kwargs = dict(gpus=8, seq_len=4096, recompute=["auto"])
    full = plan("llama-2-7b", **kwargs).candidates[:3]
    cut = plan("llama-2-7b", top=3, reserved=False, **kwargs).candidates[:3]
    assert [(c.layout, c.micro_batch_size, c.recompute_save) for c in cut] == \
        [(c.layout, c.micro_batch_size, c.recompute_save) for c in full]


def test_fused_qkv_is_one_item() -> None:
    """One q/k/v projection (torchtitan's wqkv): its output T x (q + 2 kv) x e = 256 x 128 x 2
    = 65,536 bytes per layer, kept whichever of attn.q, attn.k, attn.v is named."""
    full = _stage(recompute="full", fused_qkv=True).activations_bytes
    for name in ("attn.q", "attn.k", "attn.qkv"):
        kept = _stage(recompute="ops", recompute_save=name, fused_qkv=True).activations_bytes
        assert kept - full == 2 * 65_536


def test_a_kept_norm_output_is_its_readers_input() -> None:
    """The MLP norm's output is the MLP's input, which the checkpointed layer holds while the
    MLP runs (its moments count it: ``forward_moments``' ``stream``): kept, it adds nothing
    to the layer's forward peak; the attention norm's output, kept, adds its T*h*e = 256 x
    64 x 2 = 32,768 B at the MLP's moments, after the attention has let it go (here the
    forward's peak)."""
    from memplan.model.layer import layer_kind
    from memplan.workload import Recompute

    spec = load_model("tiny")
    wl = make_workload(spec, **TINY, recompute="ops")
    dm = Dims.of(spec, make_layout(1), wl)

    def peak(save: str) -> int:
        swl = wl.model_copy(update={"recompute_save": tuple(save.split(",")) if save else ()})
        return layer_kind(spec, swl, dm, False, Recompute.OPS).forward_peak_bytes

    assert peak("mlp_norm.output") == peak("")
    assert peak("attn_norm.output") - peak("") == 32_768


def test_sandwich_norms_make_the_down_projection_an_item() -> None:
    """tiny with Gemma's four norms (``NormPlacement.SANDWICH``, the fp32-scaling RMSNorm of
    norm_impl upcast-fp32): the post norm after the MLP saves an fp32 copy of the down
    projection's output, so the rerun reaches it; ``mlp.down`` kept adds its output, T*h*e =
    256*64*2 = 32,768 B per layer (65,536 over 2 layers), and saves its rerun, 2*176*64 =
    22,528 FLOPs per token. A kept output projection is the post attention norm's input, which
    its moment holds anyway; at the MLP's moments after it (the layer's forward peak) it adds
    its 32,768 B."""
    from memplan.model.layer import layer_kind
    from memplan.spec import ModelSpec
    from memplan.workload import Recompute

    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-sandwich",
                                     "norm_placement": "sandwich", "norm_scale_fp32": True})
    kw = dict(**TINY, norm_impl="upcast-fp32")
    full = estimate(spec, recompute="full", **kw).stages[0].activations_bytes
    down = estimate(spec, recompute="ops", recompute_save="mlp.down", **kw).stages[0]
    assert down.activations_bytes - full == 2 * 32_768
    wl = make_workload(spec, **kw, recompute="ops")
    dm = Dims.of(spec, make_layout(1), wl)
    items = ops_items(spec, wl, dm)
    kept = sac_ops.resolve(items, ("mlp.down",), spec)
    assert sac_ops.rerun_flops_per_token(items, ()) - sac_ops.rerun_flops_per_token(
        items, kept) == 22_528

    def peak(save: str) -> int:
        swl = wl.model_copy(update={"recompute_save": tuple(save.split(",")) if save else ()})
        return layer_kind(spec, swl, dm, False, Recompute.OPS).forward_peak_bytes

    assert peak("attn.o_proj") - peak("") == 32_768
    with pytest.raises(MemplanError, match="unknown name 'mlp.down'"):
        _stage(recompute="ops", recompute_save="mlp.down")


def test_post_norms_refused_where_not_traced() -> None:
    """Post norms are modelled as transformers runs Gemma's and OLMo 2's RMSNorms
    (upcast-fp32) and GLM-4's (upcast); another norm implementation after the mixers is
    refused in one line: a fused norm, or an RMSNorm scaling its fp32 tensor run as Llama's
    upcast."""
    from memplan.spec import ModelSpec

    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-post",
                                     "norm_placement": "post"})
    with pytest.raises(MemplanError, match="recompute ops with post norms of norm_impl "
                                           "fused"):
        estimate(spec, **TINY, recompute="ops", norm_impl="fused")
    scaled = spec.model_copy(update={"norm_scale_fp32": True})
    with pytest.raises(MemplanError, match="recompute ops with post norms of norm_impl "
                                           "upcast "):
        estimate(scaled, **TINY, recompute="ops", norm_impl="upcast")


def test_glm4_sandwich_norms_named_by_their_ops() -> None:
    """tiny with GLM-4's four norms (``NormPlacement.SANDWICH``; Glm4RMSNorm.forward, Llama's
    upcast norm: ``weight * x.to(float32) * rsqrt(...)).to(input_dtype)``, norm_impl upcast).
    In bf16 each post norm's ops are the pre norms': ``x.to(float32)`` (``input_fp32``, T*h*4
    = 256*64*4 = 65,536 B), ``rsqrt`` (``stats``, T*4 = 1,024 B), ``x * rstd`` (unkept), the
    cast back (``normed``, T*h*e = 32,768 B) and ``weight * normed`` (the residual add's
    input, saved by no one: no item), in execution order among the layer's casts of width h
    (attn_norm's 2, then attn_post_norm's the 3rd and 4th, mlp_norm's the 5th and 6th,
    mlp_post_norm's the 7th and 8th) and rsqrts (the 2nd and 4th); 8 casts, 4 rsqrts and 8
    products of width h a layer. Kept, attn_post_norm's stats and mlp_post_norm's normed add
    2 * (1,024 + 32,768) = 67,584 B over 2 layers beyond full recompute. In fp32 the casts
    are no ops: the norms' tensors are named by no op (a ``norm`` item each), and the
    layer's items have no cast or product of width h to count."""
    from memplan.model.layer import ops_unkept
    from memplan.report.sac_policy import _counts
    from memplan.spec import ModelSpec

    spec = ModelSpec.model_validate({**load_model("tiny").model_dump(), "name": "tiny-glm4",
                                     "norm_placement": "sandwich"})
    kw = dict(**TINY, norm_impl="upcast")
    wl = make_workload(spec, **kw, recompute="ops")
    dm = Dims.of(spec, make_layout(1), wl)
    items = ops_items(spec, wl, dm)
    post = {i.name: (i.size_bytes, i.op, i.width, i.nth) for i in items
            if "_post_norm." in i.name}
    assert post == {"attn_post_norm.input_fp32": (65_536, "copy", 64, 2),
                    "attn_post_norm.stats": (1_024, "rsqrt", 1, 1),
                    "attn_post_norm.normed": (32_768, "copy", 64, 3),
                    "mlp_post_norm.input_fp32": (65_536, "copy", 64, 6),
                    "mlp_post_norm.stats": (1_024, "rsqrt", 1, 3),
                    "mlp_post_norm.normed": (32_768, "copy", 64, 7)}
    counts = _counts(items, ops_unkept(spec, wl, dm))
    assert (counts[("copy", 64)], counts[("rsqrt", 1)], counts[("mul", 64)]) == (8, 4, 8)
    full = estimate(spec, recompute="full", **kw).stages[0].activations_bytes
    kept = estimate(spec, recompute="ops", **kw,
                    recompute_save="attn_post_norm.stats,mlp_post_norm.normed")
    assert kept.stages[0].activations_bytes - full == 67_584
    wl32 = make_workload(spec, **kw, precision="fp32", recompute="ops")
    items32 = ops_items(spec, wl32, Dims.of(spec, make_layout(1), wl32))
    assert {i.op for i in items32 if "norm." in i.name} == {"norm"}


def test_plan_auto_reserved_keeps_less_at_the_same_micro_batch() -> None:
    """plan --recompute ops (auto's save-set search) with the reserved check: an op-level
    candidate whose replayed
    reserved peak is over the budget keeps less at the same micro-batch before its micro-batch
    is halved (``_retry_reserved``). llama-7b x 8, seq 4,096: the search's second and third
    (ZeRO 2 at micro-batch 2 keeping 16 items, ZeRO 3 at 4 keeping 11; tensor peaks 72.7 and
    73.8 GiB) reserve 76.8 and 78.7 GiB against a 75.2 GiB budget. Before, both were retried
    at half their micro-batch with the same set; now each is shown at its micro-batch,
    keeping fewer items, its reserved peak replayed within the budget."""
    from memplan.api import plan
    from memplan.model.reserved import reserved_rank

    kwargs = dict(gpus=8, seq_len=4096, recompute=["ops"], top=3)
    raw = plan("llama-7b", reserved=False, **kwargs).candidates
    fit = plan("llama-7b", reserved=True, **kwargs)
    assert [reserved_rank(c.estimate).peak_bytes > fit.budget_bytes for c in raw] == \
        [False, True, True]
    for r, f in zip(raw, fit.candidates, strict=True):
        assert (f.layout, f.micro_batch_size) == (r.layout, r.micro_batch_size)
        assert reserved_rank(f.estimate).peak_bytes == f.peak_bytes <= fit.budget_bytes
    assert [len(f.recompute_save) < len(r.recompute_save)
            for r, f in zip(raw, fit.candidates)] == [False, True, True]


def test_estimate_auto_with_reserved_fits_the_replay() -> None:
    """estimate --recompute auto --reserved (API: ``fit_reserved``): llama-7b x 8, ZeRO 2,
    micro-batch 4, seq 4,096 on an 80 GB H100. Chosen against the tensor peak alone the set
    (ten items) peaks at 78.31 GiB of 79.19, and the replayed allocator runs out of memory in
    step 2; chosen against the replay, the set keeps less and every stage fits once
    replayed."""
    from memplan.errors import LayoutError, MemplanError
    from memplan.model.reserved import estimate_reserved

    kwargs = dict(gpus=8, zero=2, micro_batch_size=4, seq_len=4096, recompute="auto")
    tensors = estimate("llama-7b", **kwargs)
    replayed = estimate("llama-7b", fit_reserved="", **kwargs)
    assert tensors.fits and estimate_reserved(tensors)[0].oom_step == 2
    assert set(replayed.workload.recompute_save) < set(tensors.workload.recompute_save)
    for s, r in zip(replayed.stages, estimate_reserved(replayed), strict=True):
        assert r.oom_step is None
        assert s.peak_bytes + r.reserved_peak_bytes - s.tensor_peak_bytes <= replayed.capacity_bytes
    with pytest.raises(MemplanError, match="fit_reserved chooses recompute auto's save set"):
        estimate("llama-7b", gpus=8, recompute="full", fit_reserved="")


def test_cli_auto_with_reserved_chooses_against_the_replay(capsys) -> None:
    """The command passes --reserved on to the choice: the set it reports is the one the
    API chooses with ``fit_reserved``, not the tensor-peak one (the test above)."""
    import json

    args = ["estimate", "-m", "llama-7b", "-n", "8", "--zero", "2", "--mbs", "4", "--seq",
            "4096", "--recompute", "auto", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--reserved"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    save = estimate("llama-7b", gpus=8, zero=2, micro_batch_size=4, seq_len=4096,
                    recompute="auto", fit_reserved="").workload.recompute_save
    assert replayed["workload"]["recompute_save"] == list(save)
    assert plain["workload"]["recompute_save"] != list(save)


def test_plan_auto_json_names_each_candidates_set(capsys) -> None:
    """plan --recompute ops --json: each candidate's recompute is "ops" with the list it
    keeps (checked against the published schema, which before had no "ops"); --recompute
    auto on the same tiny model fits without recompute (``api._auto_none``): "none", no
    list."""
    import json

    assert main(["plan", "-m", "tiny", "-n", "8", "--recompute", "ops", "--top", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["recompute"] for c in out["candidates"]] == ["ops", "ops"]
    assert all(c["recompute_save"] for c in out["candidates"])
    assert main(["plan", "-m", "tiny", "-n", "8", "--recompute", "auto", "--top", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["recompute"] for c in out["candidates"]] == ["none", "none"]
    assert not any(c.get("recompute_save") for c in out["candidates"])
