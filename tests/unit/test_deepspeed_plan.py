"""``plan --framework deepspeed``: the ZeRO stages the preset offers, the reduce bucket sizes
DeepSpeed users run with and its offload (optimizer, and the weights at stage 3), searched and
reported in the candidates.

The bucket sizes (``memplan.api._bucket_choices``): DeepSpeedZeroConfig's default
``reduce_bucket_size`` = 5e8 elements (deepspeed/runtime/zero/config.py, 0.19.8) and the
transformers Trainer's ``"auto"`` = hidden x hidden (transformers/integrations/deepspeed.py
HfTrainerDeepSpeedConfig.trainer_config_finalize).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from typer.testing import CliRunner

from memplan import api, presets
from memplan.cli import app
from memplan.planning.planner import PlanResult, merge
from memplan.report.plan import _elements
from memplan.spec import load_model


def test_bucket_choices_by_hand() -> None:
    """Llama-7B (hidden 4096): 5e8 and 4096^2 = 16,777,216 elements, largest first. A hidden
    of 32768 gives 32768^2 = 1,073,741,824 > 5e8, first. None searched outside the deepspeed
    preset or with a bucket given (a ds_config's reduce_bucket_size)."""
    spec = load_model("llama-7b")
    ds = presets.Framework.DEEPSPEED
    assert api._bucket_choices(ds, spec, {}) == [{"zero_bucket_numel": 500_000_000},
                                                 {"zero_bucket_numel": 16_777_216}]
    wide = spec.model_copy(update={"hidden_size": 32768})
    assert [c["zero_bucket_numel"] for c in api._bucket_choices(ds, wide, {})] == [
        1_073_741_824, 500_000_000]
    assert api._bucket_choices(ds, spec, {"zero_bucket_numel": 200_000_000}) == [{}]
    assert api._bucket_choices(presets.Framework.HF, spec, {}) == [{}]


def _cand(layout: str, mbs: int, peak: int, step_s: float, bucket: int) -> SimpleNamespace:
    return SimpleNamespace(layout=layout, micro_batch_size=mbs, recompute="none",
                           recompute_layers=None, peak_bytes=peak,
                           time=SimpleNamespace(step_s=step_s), bucket=bucket)


def test_merge_keeps_the_lower_peak_of_a_configuration() -> None:
    """Two plans (bucket a, bucket b): layout L at mbs 2 in both, peaks 10 and 8: the 8 is
    kept; L at mbs 4 only in b (it fits with the smaller bucket alone); M at mbs 1 equal in
    both: the first plan's. Ranked by step time, then peak: L4 (1.0 s), M1 (1.5 s), L2
    (2.0 s). Rejections add up (3 + 4 of one rule), evaluations too (5 + 6); the closest
    miss is the smaller peak (12 against 11: 11), 11 - 9 = 2 over the budget."""
    a, b = PlanResult([_cand("L", 2, 10, 2.0, 1), _cand("M", 1, 7, 1.5, 1)], budget_bytes=9,
                      evaluated=5, global_batch_size=64), \
        PlanResult([_cand("L", 2, 8, 2.0, 2), _cand("L", 4, 9, 1.0, 2),
                    _cand("M", 1, 7, 1.5, 2)], budget_bytes=9, evaluated=6,
                   global_batch_size=64)
    a.rejected["rule"], b.rejected["rule"] = 3, 4
    a.closest_miss, b.closest_miss = SimpleNamespace(peak_bytes=12), SimpleNamespace(peak_bytes=11)
    out = merge([a, b])
    assert [(c.layout, c.micro_batch_size, c.peak_bytes, c.bucket) for c in out.candidates] == [
        ("L", 4, 9, 2), ("M", 1, 7, 1), ("L", 2, 8, 2)]
    assert out.rejected["rule"] == 7 and out.evaluated == 11
    assert out.closest_miss.peak_bytes == 11 and out.oom_excess_bytes == 2
    assert merge([a]) is a


def test_bucket_written_as_a_ds_config_does() -> None:
    assert _elements(500_000_000) == "5e8"
    assert _elements(200_000_000) == "2e8"
    assert _elements(16_777_216) == "16,777,216"
    assert _elements(100) == "100"


def _plan(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "-m", "llama-7b", "-n", "8", "--seq", "4096",
                                      "--framework", "deepspeed", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_searches_stages_and_buckets() -> None:
    """Llama-7B on 8 A100 80GB, 8 sequences of 4096 per step (one micro-batch per rank, no
    accumulation, so stage 1 is offered: the preset refuses it with accumulation): stage 1,
    2 and 3 candidates (stage 3 with DeepSpeed's default coordinator), each naming its reduce
    bucket (one buffer: overlap_comm off by default below stage 3, adding none at stage 3),
    and each candidate's peak is the estimate of the same configuration with that bucket."""
    out = _plan("--gpu", "a100-80gb", "--gbs", "8", "--offload", "none")
    assert {c["layout"]["zero"] for c in out["candidates"]} == {1, 2, 3}
    assert not any(k.startswith("out of memory") for k in out["rejected"])
    for c in out["candidates"]:
        assert c["reduce_bucket_numel"] in (500_000_000, 16_777_216) and c["reduce_buckets"] == 1
        est = api.estimate("llama-7b", gpus=8, gpu="a100-80gb", seq_len=4096,
                           global_batch_size=8, framework="deepspeed", zero=c["layout"]["zero"],
                           micro_batch_size=c["mbs"], recompute=c["recompute"],
                           recompute_layers=c["recompute_layers"],
                           zero_bucket_numel=c["reduce_bucket_numel"])
        # the plan's peak is the caching allocator's reserved one, which holds the estimate's
        assert est.peak_bytes <= c["peak_bytes"]


def test_plan_keeps_the_bucket_with_the_lower_peak() -> None:
    """On 8 A100 40GB with 64 sequences of 4096 per step at ZeRO-2 (the plan searches full
    recompute of k in eighths of a stage and fits the allocator's reserved peak): the two
    plans with the bucket fixed (a ds_config's reduce_bucket_size), each reporting only its
    own bucket, and the plan that searches both. Its fastest candidate (mbs 1, 20 of 32
    layers recomputed) fits only with DeepSpeed's default bucket of 5e8 elements; the next
    (mbs 1, 28 layers) fits with either, and the plan keeps the bucket with the lower peak,
    the smaller of the two plans' peaks for it."""
    out = _plan("--gpu", "a100-40gb", "--gbs", "64", "--zero", "2",
                "--offload", "none")["candidates"]
    peaks: dict[int, dict[tuple, int]] = {}
    for bucket in (500_000_000, 16_777_216):
        fixed = api.plan("llama-7b", gpus=8, gpu="a100-40gb", seq_len=4096,
                         global_batch_size=64, framework="deepspeed", zero_bucket_numel=bucket,
                         zero=2, top=3, offload="none")
        assert {c.workload.zero_bucket_numel for c in fixed.candidates} == {bucket}
        peaks[bucket] = {(c.micro_batch_size, c.recompute.label, c.recompute_layers):
                         c.peak_bytes for c in fixed.candidates}
    first, second = ((c["mbs"], c["recompute"], c["recompute_layers"]) for c in out[:2])
    assert first == (1, "full", 20) and second == (1, "full", 28)
    assert first in peaks[500_000_000] and first not in peaks[16_777_216]
    assert (out[0]["reduce_bucket_numel"], out[0]["peak_bytes"]) == (
        500_000_000, peaks[500_000_000][first])
    both = {bucket: got[second] for bucket, got in peaks.items()}
    assert len(set(both.values())) == 2  # the buckets' peaks differ
    assert out[1]["peak_bytes"] == min(both.values()) == both[out[1]["reduce_bucket_numel"]]


def test_cli_diagnose_takes_a_deepspeed_config(tmp_path) -> None:
    """`diagnose --deepspeed-config`: the config's stage 2 with overlap_comm (two buckets of
    5e8 elements) on 8 V100 32GB proposes DeepSpeed's levers as ds_config keys: overlap_comm
    false (one bucket: 5e8 x 2 B = 1e9 B off the backward peak, 1.05e9 B with the allocator's
    assumed 5% of the tensor peak, as test_diagnose_proposes_deepspeeds_bucket_levers) and a
    bucket of hidden^2 = 4096^2 = 16,777,216 elements."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 2, "overlap_comm": True}}))
    result = CliRunner().invoke(app, ["diagnose", "-m", "llama-7b", "-n", "8", "--gpu",
                                      "v100-sxm2-32gb", "--seq", "2048", "--json",
                                      "--deepspeed-config", str(path)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    fixes = {f["flags"]: f for f in out["fixes"]}
    one = fixes["ds_config zero_optimization.overlap_comm = false"]
    assert one["saved_bytes"] == 1_000_000_000
    assert "ds_config zero_optimization.reduce_bucket_size = 16777216" in fixes


def test_plan_searches_deepspeeds_offload() -> None:
    """Llama-7B full fine-tuning on one A100 80GB: without offload no stage fits (its fp32
    partition and Adam states alone are 6.74e9 x 12 B = 80.9 GB, more than the device), and
    the plan's candidates keep the optimizer on the host (stage 2 or 3, ZeRO-Offload), and at
    stage 3 the weights too, each named in the layout; a given --offload is kept. Weights on
    the host are copied to the GPU at each of a micro-batch's gathers, so of two candidates
    alike but for them, the one that keeps them on the GPU is faster."""
    none = CliRunner().invoke(app, ["plan", "-m", "llama-7b", "-n", "1", "--seq", "2048",
                                    "--framework", "deepspeed", "--json", "--gpu", "a100-80gb",
                                    "--gbs", "64", "--offload", "none"])
    assert not json.JSONDecoder().raw_decode(none.output)[0]["candidates"]  # then "nothing fits"
    out = _plan("-n", "1", "--gpu", "a100-80gb", "--seq", "2048", "--gbs", "64", "--top", "10")
    seen = {(c["layout"]["zero"], c["layout"]["offload"]) for c in out["candidates"]}
    assert seen <= {(2, "optimizer"), (3, "optimizer"), (3, "optimizer,params")}
    assert (2, "optimizer") in seen and (3, "optimizer,params") in seen
    times = {}
    for c in out["candidates"]:
        key = (c["layout"]["zero"], c["mbs"], c["recompute"], c["recompute_layers"],
               c["reduce_bucket_numel"])
        times.setdefault(key, {})[c["layout"]["offload"]] = c["step_time_s"]
    pairs = [t for t in times.values() if len(t) == 2]
    assert pairs and all(t["optimizer"] < t["optimizer,params"] for t in pairs)
    fixed = _plan("-n", "1", "--gpu", "a100-80gb", "--seq", "2048", "--gbs", "64",
                  "--offload", "optimizer")
    assert {c["layout"]["offload"] for c in fixed["candidates"]} == {"optimizer"}


def test_stage_1_is_searched_without_accumulation_only() -> None:
    """DeepSpeed's stage 1 is modelled with one micro-batch per step (the preset refuses it
    with accumulation, ``presets.accumulation_refused``): with 2,048 sequences on one GPU no
    micro-batch up to 64 makes one per step, so stage 1 is a rejection of the plan, counted
    by its rule, not an error of the command (the closest miss and its savers never name a
    refused configuration); with 16 sequences on 8 GPUs it is searched at micro-batch 2
    alone (not refused for its accumulation at micro-batch 1)."""
    many = _plan("-n", "1", "--gpu", "a100-80gb", "--seq", "2048", "--gbs", "2048",
                 "--top", "3")
    rule = ("framework deepspeed does not offer --zero 1 with overlap_comm, without "
            "contiguous_gradients or with gradient accumulation at any micro-batch: gbs = mbs "
            "x dp with mbs at most 64")
    assert many["rejected"][rule] > 0
    assert all(c["layout"]["zero"] != 1 for c in many["candidates"])
    few = _plan("--gpu", "a100-80gb", "--seq", "1024", "--gbs", "16", "--zero", "1",
                "--offload", "none", "--top", "3")
    assert [(c["layout"]["dp"], c["mbs"]) for c in few["candidates"]] == [(8, 2)]
