"""The planner: brute-force agreement, monotonicity, published runs that fit or do not."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memplan
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.planning.planner import DEFAULT_SAFETY, plan
from memplan.report.estimate import check_fits
from memplan.workload import Recompute


def _wl(spec, **kw):
    return memplan.make_workload(spec, **kw)


def test_largest_mbs_equals_brute_force() -> None:
    """For each layout and recompute policy the planner keeps, no larger micro-batch dividing
    the per-replica batch fits, and its own does."""
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("h100")
    wl = _wl(spec, seq_len=4096, global_batch_size=64)
    result = plan(spec, gpu, 8, wl, fixed={"tp": 2, "cp": 1})
    assert result.candidates
    budget = int(gpu.memory_bytes * 0.95)
    for cand in result.candidates:
        per_replica = 64 // cand.layout.dp
        for mbs in [b for b in range(1, 65) if per_replica % b == 0]:
            try:
                est = memplan.model.estimate.estimate(spec, gpu, cand.layout, wl.model_copy(update={
                    "micro_batch_size": mbs, "recompute": cand.recompute,
                    "recompute_layers": cand.recompute_layers}))
            except MemplanError:
                continue
            if mbs <= cand.micro_batch_size:
                assert est.peak_bytes <= budget
            else:
                assert est.peak_bytes > budget, (cand.layout, mbs)


def test_more_capacity_never_loses_candidates() -> None:
    spec = memplan.load_model("llama-2-7b")
    gpu = memplan.load_gpu("h100")
    wl = _wl(spec, seq_len=2048, global_batch_size=32)
    small = plan(spec, gpu, 4, wl, capacity_bytes=48 * 2**30)
    large = plan(spec, gpu, 4, wl, capacity_bytes=80 * 2**30)

    def keys(r):
        return {(c.layout, c.recompute): c.micro_batch_size for c in r.candidates}

    ks, kl = keys(small), keys(large)
    assert ks and set(ks) < set(kl)
    assert all(kl[k] >= ks[k] for k in ks)
    assert large.candidates[0].time.step_s <= small.candidates[0].time.step_s


def test_recompute_is_used_only_when_needed() -> None:
    """A layout where everything fits without recompute ranks 'none' first among its
    policies at equal micro-batch: recompute only adds compute."""
    spec = memplan.load_model("tiny")
    result = plan(spec, memplan.load_gpu("h100"), 1, _wl(spec, seq_len=256, global_batch_size=8))
    best = result.candidates[0]
    assert best.recompute is Recompute.NONE and best.micro_batch_size == 8


def test_gpt3_175b_fits_with_selective_recompute_and_not_without() -> None:
    """Korthikanti et al. 2022 (arXiv 2205.05198), section 6 and Figure 7: GPT-3 175B on 64
    A100-80GB, TP 8 x PP 8 with sequence parallelism, seq 2048, mbs 1, fp16 with fp32 main
    gradients: selective recompute fits; storing all activations does not."""
    kw = dict(gpus=64, gpu="a100-80gb", tp=8, pp=8, sequence_parallel=True, seq_len=2048,
              micro_batch_size=1, global_batch_size=64, precision="bf16-fp32-grads",
              attention="eager", norm_impl="fused")
    check_fits(memplan.estimate("gpt3-175b", recompute="selective", **kw), safety=DEFAULT_SAFETY)
    with pytest.raises(MemplanError, match="does not fit"):
        check_fits(memplan.estimate("gpt3-175b", recompute="none", **kw), safety=DEFAULT_SAFETY)


def test_full_finetune_of_7b_on_one_gpu_does_not_fit() -> None:
    """Mixed-precision AdamW needs 16 bytes per parameter before any activation: Llama-2-7B's
    107.8 GB of states alone exceed one 80 GB H100 (Rajbhandari et al. 2020, section 3.1)."""
    with pytest.raises(MemplanError, match="does not fit.*optimizer"):
        check_fits(memplan.estimate("llama-2-7b", gpus=1, seq_len=512), safety=DEFAULT_SAFETY)


def test_plan_cli_json_contract() -> None:
    out = CliRunner().invoke(app, ["plan", "--model", "llama-2-7b", "--gpus", "8", "--seq",
                                   "2048", "--gbs", "64", "--tp", "2", "--json", "--top", "3"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert 0 < len(data["candidates"]) <= 3
    first = data["candidates"][0]
    assert set(first["layout"]) == {"tp", "pp", "vpp", "dp", "cp", "ep", "etp", "zero", "sp",
                                    "stage_layers", "dp_shard", "offload"}
    assert first["layout"]["offload"] == "none"  # searched under DeepSpeed only
    assert first["layout"]["tp"] == 2
    for key in ("mbs", "recompute", "peak_bytes", "step_time_s", "tokens_per_s_per_gpu", "fits"):
        assert key in first
    assert type(first["peak_bytes"]) is int and first["fits"] is True
    times = [c["step_time_s"] for c in data["candidates"]]
    assert times == sorted(times)
    assert isinstance(data["rejected"], dict)
    # the top candidate re-checked with estimate fits
    lay = first["layout"]
    est = memplan.estimate("llama-2-7b", gpus=8, tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"],
                           cp=lay["cp"], zero=lay["zero"], sequence_parallel=lay["sp"],
                           micro_batch_size=first["mbs"], recompute=first["recompute"],
                           seq_len=2048, global_batch_size=64)
    # the plan fits the caching allocator's reserved peak (memplan.model.reserved), which
    # holds the estimate's tensor peak
    from memplan.model.reserved import reserved_rank

    assert est.peak_bytes <= first["peak_bytes"] == reserved_rank(est).peak_bytes
    assert first["peak_bytes"] <= est.capacity_bytes


def test_plan_cli_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-2-7b", "--safety", "1.5"]) == 2
    assert "safety" in capsys.readouterr().err


def test_api_plan_and_check() -> None:
    result = memplan.plan("llama-2-7b", gpus=8, seq_len=4096, global_batch_size=64, tp=2,
                          recompute=["none"])
    assert result.candidates and all(c.layout.tp == 2 for c in result.candidates)
    assert all(c.recompute is Recompute.NONE for c in result.candidates)
    # something did not fit, and the closest miss is reported in bytes
    assert result.oom_excess_bytes is not None and result.oom_excess_bytes > 0
    best = result.candidates[0]
    assert memplan.check("llama-2-7b", gpus=8, tp=2, pp=best.layout.pp, vpp=best.layout.vpp,
                         zero=int(best.layout.zero), seq_len=4096, global_batch_size=64,
                         micro_batch_size=best.micro_batch_size).peak_bytes == best.peak_bytes


def test_partial_recompute_is_timed_per_pipeline_stage() -> None:
    """llama-2-7b on 8 GPUs at pp 4 (8 layers per stage), 64 x 4096 tokens per step, 40 GiB:
    the plan keeps full recompute of some k of each stage's layers (searched in eighths of
    the stage: every k from 1 to 7) and of all of them.
    Each reruns k layers of every stage, 4k of the 32, at 438,321,152 FLOPs per token each
    (2 * 202,383,360 weights + 2 * 4096 * 4096 attention), on top of the model FLOPs
    3 * 14,288,420,864 * 262,144: 1.2156e16, 1.3995e16 and 1.4914e16 (all 32 layers)."""
    spec = memplan.load_model("llama-2-7b")
    wl = _wl(spec, seq_len=4096, global_batch_size=64)
    result = plan(spec, memplan.load_gpu("h100"), 8, wl, capacity_bytes=40 * 2**30,
                  fixed={"pp": 4, "tp": 1, "vpp": 1, "zero": 1},
                  recompute=[Recompute.NONE, Recompute.FULL])
    tokens = 64 * 4096
    model = 3 * 14_288_420_864 * tokens
    # the even split (the search also keeps 8,9,8,7, which moves the head's share)
    got = {c.recompute_layers: c.time.hardware_flops for c in result.candidates
           if c.layout.stage_layers is None}
    assert None in got and len(got) >= 3
    assert got == {k: model + 4 * (8 if k is None else k) * 438_321_152 * tokens for k in got}
    assert got[None] == 14_913_775_719_153_664


def test_rejections_are_counted_by_rule() -> None:
    """A layout validate refuses is counted under its LayoutError's rule (no numbers), the
    planner's own checks under the rule text of the core's check: gbs 12 over dp 8 is
    replica_batch's rule; pp 4 with 2 chunks each and 2 samples per replica (gbs 4, dp 2)
    leaves micro-batch counts 2 and 1, neither divisible by pp: resolve_batch's rule."""
    from collections import Counter

    from memplan.errors import LayoutError
    from memplan.parallel import replica_batch, resolve_batch
    from memplan.planning.planner import NO_INTERLEAVED_SPLIT, _usable

    spec = memplan.load_model("llama-2-7b")
    wl = _wl(spec, seq_len=4096)
    rejected: Counter = Counter()
    dp8 = memplan.ParallelConfig(dp=8)
    assert not _usable(spec, dp8, wl, 12, rejected)
    with pytest.raises(LayoutError) as err:
        replica_batch(dp8, 12)
    rule = "gbs must be divisible by dp"
    assert rejected == Counter({rule: 1}) and err.value.rule == rule

    chunks = memplan.ParallelConfig(pp=4, vpp=2, dp=2)
    assert not _usable(spec, chunks, wl, 4, rejected)
    with pytest.raises(LayoutError) as err:
        resolve_batch(chunks, wl.model_copy(update={"micro_batch_size": 1,
                                                    "global_batch_size": 4}))
    assert err.value.rule == NO_INTERLEAVED_SPLIT and rejected[NO_INTERLEAVED_SPLIT] == 1

    dense_ep = memplan.ParallelConfig(ep=2, dp=2)  # validate: ep needs an MoE model
    assert not _usable(spec, dense_ep, wl, 4, rejected)
    assert rejected["ep > 1 needs a mixture-of-experts model"] == 1
    assert sum(rejected.values()) == 3


def test_a_plain_error_is_counted_by_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that raises MemplanError rather than LayoutError keys its whole message."""
    from collections import Counter

    from memplan.planning import planner

    def refuse(*_args: object) -> None:
        raise MemplanError("seq (4096) is odd here")

    monkeypatch.setattr(planner, "validate", refuse)
    rejected: Counter = Counter()
    spec = memplan.load_model("tiny")
    assert not planner._usable(spec, memplan.ParallelConfig(), _wl(spec), 1, rejected)
    assert rejected == Counter({"seq (4096) is odd here": 1})


def test_plan_json_counts_rejections_by_rule() -> None:
    """llama-2-7b on 8 GPUs, gbs 12 (seq 4096): every layout with dp 8 is rejected under one
    key, whatever its tp, pp or ZeRO; dp 8 means tp = pp = 1 here: ZeRO 0-3, 4 layouts."""
    out = CliRunner().invoke(app, ["plan", "-m", "llama-2-7b", "-n", "8", "--gbs", "12",
                                   "--json"])
    assert out.exit_code == 0, out.output
    rejected = json.loads(out.stdout)["rejected"]
    assert rejected["gbs must be divisible by dp"] == 4
    assert not [key for key in rejected if "12" in key]  # the rule, not the numbers


TOP_CASES = [("llama-2-7b", 8, {"seq_len": 4096}), ("llama-2-13b", 16, {"seq_len": 4096}),
             ("mixtral-8x7b", 16, {"seq_len": 2048, "global_batch_size": 256}),
             ("llama-3.1-70b", 64, {"seq_len": 8192, "global_batch_size": 128}),
             # mixtures of experts at the scale they train on: many expert splits per layout
             ("mixtral-8x7b", 64, {}), ("qwen3-30b-a3b", 64, {}), ("deepseek-v3", 2048, {}),
             ("llama-4-scout", 64, {})]


@pytest.mark.parametrize("model,gpus,fields", TOP_CASES)
def test_top_gives_the_full_search_first_candidates(model: str, gpus: int, fields: dict) -> None:
    """With ``top`` recompute policies that cannot beat the top-th fastest fit are skipped:
    the first ``top`` candidates are those of the full search, in its order, with the same
    estimates and fewer evaluations; and no candidate of the full search is faster than its
    policy's bound."""
    from memplan.planning.planner import _Context, _fastest_possible, _with_gbs, default_overheads

    spec, gpu = memplan.load_model(model), memplan.load_gpu("h100")
    wl = _wl(spec, **fields)
    full = plan(spec, gpu, gpus, wl)
    assert len(full.candidates) > 10

    def key(c):
        return (c.layout, c.micro_batch_size, c.recompute, c.recompute_layers, c.time.step_s,
                c.peak_bytes)

    for top in (1, 10):
        cut = plan(spec, gpu, gpus, wl, top=top)
        assert [key(c) for c in cut.candidates[:top]] == [key(c) for c in full.candidates[:top]]
        assert [c.estimate for c in cut.candidates[:top]] == [c.estimate for c in
                                                              full.candidates[:top]]
        assert cut.evaluated < full.evaluated
        assert len(cut.candidates) < len(full.candidates)
    # the bounds are ones: at the candidate's own micro-batch, with no parameters on the rank
    # and with the fewest any of its stages holds (tighter: no larger than its own time)
    ctx = _Context(spec, gpu, _with_gbs(wl, full.global_batch_size), 0,
                   default_overheads(gpu), gpu.memory_bytes)
    rows = [(c.layout, (c.recompute, c.recompute_layers), [c.micro_batch_size])
            for c in full.candidates]
    loose = _fastest_possible(ctx, rows)
    tight = _fastest_possible(ctx, rows, with_params=True)
    assert all(a <= b <= c.time.step_s for a, b, c in zip(loose, tight, full.candidates))
    assert any(a < b for a, b in zip(loose, tight))
    assert any(b < c.time.step_s for b, c in zip(tight, full.candidates))


def test_top_with_reserved_gives_the_full_search_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``top`` the reserved check (``_fit_reserved``) turns down some of the first
    ``top`` and takes slower candidates, which a search for the first ``top`` alone may have
    skipped: GPT-OSS-120B on 64 GPUs, where the check takes candidates up to 11.2 s a step
    and the search with ``top=10`` alone is sure of those faster than 8.7 s (it showed
    (tp 1, full recompute, 8.84 s) fifth, where the check over the full search gives
    (tp 1, no recompute, 8.65 s)). The plan searches again, keeping what could be as fast
    as the slowest the check took: its ``top`` are the check's over the full search, with
    their reserved peaks."""
    spec, gpu = memplan.load_model("gpt-oss-120b"), memplan.load_gpu("h100")
    wl = _wl(spec)
    cut = plan(spec, gpu, 64, wl, top=10, reserved=True)
    _assert_the_full_search_check(cut, spec, gpu, 64, wl, monkeypatch)


def _assert_the_full_search_check(cut, spec, gpu, gpus: int, wl,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``cut`` (a plan with ``top=10`` and the reserved check) shows the ten the check gives
    over the full search, in its order with the same reserved peaks, from fewer exact
    evaluations."""
    import memplan.planning.planner as planner

    real = planner._fit_reserved

    def first_ten(ctx, ranked, top, result, taken=None):  # the check, stopped at ten
        return real(ctx, ranked, 10, result, taken)

    monkeypatch.setattr(planner, "_fit_reserved", first_ten)
    full = plan(spec, gpu, gpus, wl, reserved=True)  # every candidate searched, then checked

    def key(c):
        return (c.layout, c.micro_batch_size, c.recompute, c.recompute_layers, c.time.step_s,
                c.peak_bytes)

    assert len(cut.candidates) == 10
    assert [key(c) for c in cut.candidates] == [key(c) for c in full.candidates]
    assert cut.evaluated < full.evaluated


def test_top_with_reserved_searches_again_when_too_few_fit() -> None:
    """Llama 2 7B on 8 GPUs at tp 4, pp 2, vpp 8 with 22 GiB, ``top=3``: the reserved check
    turns down every configuration the search for the first three fits; fewer than three
    fit, so the plan searches again for twice as many, until three fit (mbs 2, full
    recompute of 12 layers, ZeRO 0 to 2: the same configuration but for ZeRO, one step
    time)."""
    r = memplan.plan("llama-2-7b", gpus=8, tp=4, pp=2, vpp=8, top=3, gpu_memory="22GiB",
                     seq_len=2048, global_batch_size=64)
    assert [(c.layout.zero, c.micro_batch_size, c.recompute, c.recompute_layers)
            for c in r.candidates] == [(z, 2, Recompute.FULL, 12) for z in (0, 1, 2)]
    assert all(c.peak_bytes <= r.budget_bytes for c in r.candidates)


def test_too_few_through_the_check_searches_twice_as_many(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo 2 7B on 8 GPUs, ``top=10``: the reserved check passes fewer than ten of the
    first search's fits (the others' allocator bytes put them over the budget). The plan
    searches again for twice as many, not everything: its ten are the check's over the
    full search (stopped at ten), in the same order with the same reserved peaks, from
    fewer exact evaluations."""
    import memplan.planning.planner as planner

    spec, gpu = memplan.load_model("olmo-2-7b"), memplan.load_gpu("h100")
    wl = _wl(spec)
    wanted: list[int | None] = []
    real_once = planner._plan_once

    def once(*args, **kwargs):
        wanted.append(args[7] if len(args) > 7 else kwargs.get("wanted"))
        return real_once(*args, **kwargs)

    monkeypatch.setattr(planner, "_plan_once", once)
    cut = plan(spec, gpu, 8, wl, top=10, reserved=True)
    assert wanted == [10, 20]
    _assert_the_full_search_check(cut, spec, gpu, 8, wl, monkeypatch)


def test_top_with_calibration_searches_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibrated plan re-times every candidate, so the analytic bound must skip none: the
    planner is asked for every candidate then, and for the top ones otherwise."""
    import memplan.calibrate.apply as apply
    import memplan.planning.planner as planner

    asked = []
    real = planner.plan

    def recording(*args, **kwargs):
        asked.append(kwargs["top"])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", recording)
    monkeypatch.setattr(apply, "resolve", lambda paths, gpu: ["profile"])
    monkeypatch.setattr(apply, "calibrate_plan", lambda result, *a, **k: result)
    memplan.plan("llama-2-7b", gpus=8, top=3)
    memplan.plan("llama-2-7b", gpus=8, top=3, calibration="profile.json")
    assert asked == [3, None]


def test_cli_plan_counts_skipped_layouts() -> None:
    """The command asks for its --top only; layouts skipped that way are counted by reason,
    not called out of memory."""
    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-70b", "--gpus", "64", "--seq",
                                   "8192", "--gbs", "128", "--json", "--top", "3"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert len(data["candidates"]) == 3
    skipped = [k for k in data["rejected"] if "slower at every micro-batch than the top 3" in k]
    assert skipped and data["rejected"][skipped[0]] > 0
    full = memplan.plan("llama-3.1-70b", gpus=64, seq_len=8192, global_batch_size=128)
    assert data["evaluated"] < full.evaluated
    # the search's first 3 are the full search's (the command then fits them against the
    # allocator's reserved peak, which a plan without top does not)
    top3 = memplan.plan("llama-3.1-70b", gpus=64, seq_len=8192, global_batch_size=128, top=3,
                        reserved=False)
    assert [c.time.step_s for c in top3.candidates[:3]] == pytest.approx(
        [c.time.step_s for c in full.candidates[:3]], rel=1e-12)
    times = [c["step_time_s"] for c in data["candidates"]]
    assert times == sorted(times) and times[0] >= top3.candidates[0].time.step_s


def test_fewest_stage_params_by_hand() -> None:
    """llama-2-7b (hidden 4096, MLP 11008, vocab 32000, untied): a layer holds 4 * 4096^2
    attention + 3 * 4096 * 11008 MLP + 2 * 4096 norm weights = 202,383,360. With pp 2 each
    stage has 16 layers; the first adds the embedding (32000 * 4096 = 131,072,000), the last
    the head (the same) and the final norm (4,096): the first holds fewer. tp 2 halves the
    projections and the vocabulary, not the norms. With one stage, everything: 6,738,415,616."""
    from memplan.model.memo import fewest_stage_params
    from memplan.parallel import ParallelConfig

    spec = memplan.load_model("llama-2-7b")
    assert fewest_stage_params(spec, ParallelConfig(pp=2)) == 16 * 202_383_360 + 131_072_000
    assert fewest_stage_params(spec, ParallelConfig(pp=2, tp=2)) == (
        16 * (202_383_360 - 2 * 4096) // 2 + 16 * 2 * 4096 + 131_072_000 // 2)
    assert fewest_stage_params(spec, ParallelConfig(pp=1)) == (
        32 * 202_383_360 + 2 * 131_072_000 + 4096)


# Published layouts of the catalog's flagship jobs (docs/planning.md): (plan arguments, the
# published layout's estimate arguments beyond them)
_TITAN = {"framework": "torchtitan", "precision": "fsdp-bf16", "seq_len": 8192,
          "gpu_memory": "96GB"}
FLAGSHIP = [
    # Llama 3 405B (Dubey et al. 2024, section 3.3.2, Table 4): TP 8, PP 16 with 8 chunks a
    # rank and the embedding and the output alone on the first and last chunks, DP 128;
    # recompute of 3 of each rank's 8 layers (plan fits 2 against the allocator's reserved
    # peak: docs/planning.md)
    ({"model": "llama-3.1-405b", "gpus": 16384, "seq_len": 8192, "global_batch_size": 2048},
     {"tp": 8, "pp": 16, "vpp": 8, "stage_layers": "0,1x126,0", "zero": 1,
      "micro_batch_size": 1, "recompute": "full", "recompute_layers": 3}),
    # torchtitan's 405B on 512 H100 (benchmarks/llama3_h100_202412_torchtitan.md, Table 5)
    ({"model": "llama-3.1-405b", "gpus": 512, "global_batch_size": 256, **_TITAN},
     {"tp": 8, "pp": 8, "vpp": 2, "zero": 3, "micro_batch_size": 4, "recompute": "full"}),
    # torchtitan's 70B on 256 H100 (Table 4) and 8B on 8 H100 (Table 1)
    ({"model": "llama-3.1-70b", "gpus": 256, "global_batch_size": 512, **_TITAN},
     {"tp": 8, "zero": 3, "micro_batch_size": 16, "recompute": "full"}),
    ({"model": "llama-3.1-8b", "gpus": 8, "global_batch_size": 16, **_TITAN},
     {"zero": 3, "micro_batch_size": 2, "recompute": "selective"}),
    # Llama 3's 405B job again, timed kernel by kernel (the Megatron-LM preset's step model:
    # GEMMs at their measured rates, the fused pointwise kernels by their bytes), whose
    # search refuses ZeRO-2 and 3 (the preset's refusals)
    ({"model": "llama-3.1-405b", "gpus": 16384, "seq_len": 8192, "global_batch_size": 2048,
      "framework": "megatron"},
     {"tp": 8, "pp": 16, "vpp": 8, "stage_layers": "0,1x126,0", "zero": 1,
      "micro_batch_size": 1, "recompute": "full", "recompute_layers": 3}),
]


@pytest.mark.parametrize("job,layout", FLAGSHIP)
def test_plan_is_at_least_as_fast_as_the_published_layout(job: dict, layout: dict) -> None:
    """For the same job and memory budget (no safety margin), ``plan``'s fastest candidate is
    at least as fast, by memplan's own step time, as the published layout estimated by
    ``estimate``."""
    from memplan.planning.timing import estimate_step_time

    est = memplan.estimate(**job, **layout)
    published = estimate_step_time(est).tokens_per_s_per_gpu
    best = memplan.plan(**job, safety=0, top=1).candidates[0]
    assert best.time.tokens_per_s_per_gpu >= published * (1 - 1e-9)


def test_plan_searches_the_llama3_405b_layout() -> None:
    """Llama 3's 405B layout is in the search: 8 chunks a rank (beyond 4, where the 126
    layers and the embedding and loss split evenly: 128 = 16 x 8), the one-layer chunks with
    the embedding and the output alone on the first and last (0,1x126,0), and recompute of 2
    of each rank's 8 layers (Llama 3 recomputed 3). Without a safety margin it is plan's
    fastest (ZeRO-2, its caching allocator's reserved peak with the context and workspace
    79.18 GiB of the H100's 79.19 GiB; docs/planning.md)."""
    job, layout = FLAGSHIP[0]
    best = memplan.plan(**job, safety=0, top=1).candidates[0]
    assert (best.layout.tp, best.layout.pp, best.layout.vpp, best.layout.dp) == (8, 16, 8, 128)
    assert best.layout.stage_layers == (0,) + (1,) * 126 + (0,)
    assert (best.recompute, best.recompute_layers) == ("full", 2)


def test_reserved_rank_stops_at_the_first_stage_over() -> None:
    """With ``above`` the replay ends at the first stage whose reserved peak (with its fixed
    overheads) is over it: that stage's figure, marked inexact; above every stage, the whole
    replay. Each stage's figure is its own replay's reserved peak plus its CUDA context and
    workspace (uncalibrated: no correction, no residual)."""
    from memplan.model.reserved import estimate_reserved, reserved_rank

    est = memplan.estimate("llama-2-7b", gpus=8, pp=2, seq_len=2048, global_batch_size=64)
    rows = [r.reserved_peak_bytes + s.cuda_context_bytes + s.workspace_bytes
            for s, r in zip(est.stages, estimate_reserved(est, with_expandable=False))]
    assert len(rows) == 2 and all(s.calibration_bytes == s.allocator_bytes == 0
                                  for s in est.stages)
    whole = reserved_rank(est)
    assert whole.exact and whole.peak_bytes == max(rows)
    first = reserved_rank(est, above=rows[0] - 1)
    assert (first.peak_bytes, first.stage, first.exact) == (rows[0], 0, False)
    assert reserved_rank(est, above=max(rows)) == whole


def test_reserved_check_closest_miss_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 2 7B on 8 GPUs at tp 1, pp 2 with 22 GiB: the reserved check turns down every
    configuration the search fits (fewer than three fit, so the plan searches everything:
    ``planner._plan_once``). Replaying each only up to its first stage over the budget gives
    the same plan, closest miss and rejections as replaying every stage, with fewer stage
    replays. (At tp 4 the check over every candidate finds three that fit, where the search
    for the first three alone gave none: tp 4, vpp 8, mbs 2, full recompute of 12 layers,
    ZeRO 0 to 2.)"""
    import memplan.model.reserved as reserved
    import memplan.planning.planner as planner

    def plan() -> tuple:
        planner._reserved_peak.cache_clear()
        r = memplan.plan("llama-2-7b", gpus=8, tp=1, pp=2, top=3, gpu_memory="22GiB",
                         seq_len=2048, global_batch_size=64)
        return r.candidates, r.closest_miss, dict(r.rejected), r.oom_excess_bytes

    calls: list[bool] = []
    rank = reserved.reserved_rank

    def counted(est, above=None, done=()):
        got = rank(est, above, done=done)
        calls.append(got.exact)
        return got

    monkeypatch.setattr(reserved, "reserved_rank", counted)
    stopped = plan()
    assert stopped[2][planner.OUT_OF_RESERVED] > 0 and not stopped[0]
    assert False in calls  # some replays ended at their first stage
    monkeypatch.setattr(reserved, "reserved_rank", lambda est, above=None, done=(): counted(est))
    assert plan() == stopped


def test_reserved_miss_replays_in_order_of_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three turned-down configurations with lower bounds 10, 12, 15 and exact peaks 20, 13,
    16: the exact peaks are replayed in order of the bound until the bound reaches the best
    (a, then b; c's bound 15 cannot beat 13), so b is the closest miss at 13. A closer miss
    from the search (11) stays, and only a is replayed (b's bound 12 is not below 11)."""
    from functools import lru_cache

    import memplan.planning.planner as planner
    from memplan.planning.planner import Miss, PlanResult

    exact = {"a": (20, 0), "b": (13, 1), "c": (16, 0)}
    asked: list[str] = []

    bounds = {"a": 10, "b": 12, "c": 15}

    @lru_cache(maxsize=None)
    def peak(name: str, above=None) -> tuple[int, int, bool, bool]:
        if above is not None:  # stopped at a first stage over: the bound, inexact
            return bounds[name], 0, False, False
        asked.append(name)
        return (*exact[name], False, True)

    class Fake:  # what _reserved_miss reads of a candidate
        def __init__(self, name: str) -> None:
            self.name, self.layout, self.micro_batch_size = name, name, 1
            self.recompute, self.recompute_layers = Recompute.NONE, None

    monkeypatch.setattr(planner, "_reserved_peak", peak)
    monkeypatch.setattr(planner, "_replayed", lambda ctx, c: (c.name,))
    misses = [(12, 0, Fake("b")), (10, 1, Fake("a")), (15, 2, Fake("c"))]
    result = PlanResult(candidates=[])
    planner._reserved_miss(None, misses, result)
    assert (result.closest_miss.layout, result.closest_miss.peak_bytes) == ("b", 13)
    assert asked == ["a", "b"] and result.replayed == 2
    asked.clear()
    peak.cache_clear()
    search = Miss("s", 1, Recompute.NONE, None, 11, 0)
    result = PlanResult(candidates=[], closest_miss=search)
    planner._reserved_miss(None, misses, result)
    assert result.closest_miss is search and asked == ["a"]
