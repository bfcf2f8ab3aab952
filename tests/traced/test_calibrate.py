"""``memplan calibrate``: records, the fit, profiles, and their use by estimate and plan.

- The fit recovers known coefficients exactly from synthetic records built on the analytic
  estimate (every term, the allocator's ratio and rounding, the memory outside it, the FLOP/s and
  fixed seconds of the time model), and leave-one-out exposes a perturbed record.
- Records are written atomically; a crash leaves no partial file and ``resume`` measures only
  what is missing.
- End to end on CPU: ``--device cpu --quick`` (10 real CPU runs of the reference model under the
  exact tracker), ``--resume``, ``--refit``; without a GPU, ``--device cuda`` is a one-line error
  that writes nothing; ``--nproc 2`` through torchrun with gloo.
- User models (tests/data/user_model/: hf_style_llama.py, written the way Hugging Face writes
  Llama, eager attention with a 4-D mask and shifted labels; nanogpt_like.py, nanoGPT's style)
  are traced under fake tensors; an estimate with a profile matches fresh traces at (mbs, seq)
  points outside the fit, and at another depth, within 1%.
- The committed example (calibration/profiles/cpu-example.json) re-fits unchanged from its
  committed records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from calibration_points import cpu_points_traced_once  # tests/traced/calibration_points.py
from typer.testing import CliRunner

import memplan
from memplan.calibrate.calibration_profile import load_profile, save_profile
from memplan.calibrate.features import analytic, analytic_phases, stage_features
from memplan.calibrate.fit import fit_device
from memplan.calibrate.grid import Point, device_grid, reference_spec
from memplan.calibrate.records import (
    Meta,
    PhaseMeasure,
    RankMeasure,
    Record,
    StepMeasure,
    finished_keys,
    read_records,
    write_record,
)
from memplan.calibrate.refit import build_profile, refit_all
from memplan.cli import app, main
from memplan.errors import MemplanError
from memplan.hardware import load_gpu
from memplan.planning.timing import step_flops
from memplan.units import PHASES, GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
USER_MODEL = ROOT / "tests" / "data" / "user_model"

# Known coefficients of the synthetic device (see features.py for their meaning).
KNOWN = {
    "forward.fixed_bytes": 3 * MiB, "forward.saved_none": 0.05, "forward.saved_selective": 0.03,
    "forward.saved_full": 0.10, "forward.eager_scores": 0.20,
    "backward.fixed_bytes": 5 * MiB, "backward.saved_none": 0.08,
    "backward.saved_selective": 0.04, "backward.saved_full": 0.02,
    "backward.eager_scores": -0.10,
    "optimizer.fixed_bytes": 1 * MiB, "optimizer.optimizer_temp": 0.5,
}
RESIDUAL, OUTSIDE = 3 * MiB, 500 * MiB  # reserved beyond the allocator model's; outside it
RATE, T0 = 2.0e14, 0.012


def meta(device: str = "cuda", gpu: str | None = "h100-sxm") -> Meta:
    return Meta(device=device, device_name="NVIDIA H100 80GB HBM3" if gpu else "test cpu",
                gpu=gpu, total_bytes=load_gpu("h100-sxm").memory_bytes if gpu else None,
                torch="2.x", python="3.11", attention_backend="test", date="2026-01-01",
                command="synthetic records (tests/traced/test_calibrate.py)")


def synthetic(point: Point, coef: dict[str, float], scale: float = 1.0,
              m: Meta | None = None) -> Record:
    """A record whose measurements follow the calibration model with ``coef`` exactly: reserved
    is allocated + the caching-allocator model's bytes beyond the tensor peak for the
    configuration + ``RESIDUAL``."""
    from memplan.model.reserved import estimate_reserved

    stage = analytic(point.spec, point.layout, point.workload).stages[0]
    gap = estimate_reserved(analytic(point.spec, point.layout, point.workload), limited=False,
                            with_expandable=False)[0].fragmentation_bytes
    feats, ana = stage_features(stage, point.workload), analytic_phases(stage)
    flops = step_flops(point.spec, point.workload, point.workload.micro_batch_size,
                       pp=point.layout.pp)[1]
    steps = []
    for k, kind in ((1, "first_step"), (2, "steady"), (3, "steady")):
        phases = {}
        for p in PHASES:
            alloc = round(scale * (ana[(kind, p)] + sum(c * feats[p].get(n, 0.0)
                                                        for n, c in coef.items())))
            reserved = alloc + gap + RESIDUAL
            phases[p] = PhaseMeasure(allocated_bytes=alloc, reserved_bytes=reserved,
                                     device_used_bytes=reserved + OUTSIDE, alloc_retries=0,
                                     inactive_split_bytes=0)
        t = flops / RATE + T0
        steps.append(StepMeasure(step=k, time_s=t, hardware_flops=flops,
                                 achieved_flops_per_s=flops / t, phases=phases))
    return Record(kind="grid", key=point.key, status="ok", spec=point.spec, layout=point.layout,
                  workload=point.workload, ranks=[RankMeasure(steps=steps)], meta=m or meta())


@pytest.fixture(scope="module")
def grid() -> list[Point]:
    """The full CUDA grid (42 points: every policy, eager, fp32, bf16-pure, amp-bf16) of a
    4-layer reference model, whose GiB-sized phases make the integer rounding of synthetic
    bytes negligible."""
    return device_grid("cuda", quick=False, spec=reference_spec("cuda", num_layers=4))


# --- the fit -----------------------------------------------------------------------------------

def test_fit_recovers_known_coefficients(grid: list[Point]) -> None:
    terms, errors, points = fit_device([synthetic(p, KNOWN) for p in grid])
    assert set(terms.coefficients) == set(KNOWN)
    for name, value in KNOWN.items():
        if name.endswith("fixed_bytes"):
            assert abs(terms.coefficients[name] - value) <= 1, name  # measurements are ints
        else:
            assert terms.coefficients[name] == pytest.approx(value, rel=1e-6), name
    assert terms.allocator_residual_bytes == RESIDUAL
    assert terms.reserved_ratio is None
    assert terms.outside_allocator_bytes == OUTSIDE
    assert terms.achieved_flops_per_s == pytest.approx(RATE, rel=1e-3)
    assert terms.step_overhead_s == pytest.approx(T0, rel=1e-3)
    assert terms.mfu == pytest.approx(RATE / load_gpu("h100-sxm").bf16_flops, rel=1e-3)
    by = {(e.quantity, e.method): e for e in errors}
    for quantity in ("allocated_peak", "reserved_peak", "device_used_peak", "step_time"):
        assert by[(quantity, "leave-one-out")].max_abs_pct < 1e-4, quantity
        assert by[(quantity, "leave-one-out")].num_points == len(grid)
    assert by[("allocated_peak", "analytic")].max_abs_pct > 5  # the terms matter
    assert len(points) == len(grid)
    assert all(abs(p.fitted_bytes - p.measured_bytes) <= 2 for p in points)


def test_fit_is_deterministic_and_leaves_out_unexercised_terms(grid: list[Point]) -> None:
    flash = [p for p in grid if p.workload.attention.value == "flash"
             and p.workload.recompute.label == "none"]
    records = [synthetic(p, KNOWN) for p in flash]
    a, b = fit_device(records)[0], fit_device(list(reversed(records)))[0]
    assert a == b
    assert "forward.eager_scores" not in a.coefficients  # no eager run: no correction
    assert "backward.saved_full" not in a.coefficients


def test_leave_one_out_exposes_a_perturbed_record(grid: list[Point]) -> None:
    records = [synthetic(p, KNOWN, scale=1.05 if i == 7 else 1.0) for i, p in enumerate(grid)]
    _, errors, points = fit_device(records)
    loo = next(e for e in errors if e.quantity == "allocated_peak" and e.method ==
               "leave-one-out")
    assert loo.max_abs_pct > 3  # the perturbed point is predicted from the others
    worst = max(points, key=lambda p: abs(p.loo_bytes - p.measured_bytes) / p.measured_bytes)
    assert worst.key == grid[7].key


def test_fit_needs_finished_records(grid: list[Point]) -> None:
    oom = Record(kind="grid", key="x", status="oom", error="CUDA out of memory",
                 spec=grid[0].spec, layout=grid[0].layout, workload=grid[0].workload,
                 meta=meta())
    with pytest.raises(MemplanError, match="at least 2 finished records"):
        fit_device([oom, synthetic(grid[0], KNOWN)])


# --- records -----------------------------------------------------------------------------------

def test_records_are_written_atomically(tmp_path: Path, grid: list[Point],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = synthetic(grid[0], KNOWN)
    path = write_record(tmp_path, rec)
    assert read_records(tmp_path) == [rec]
    assert finished_keys(tmp_path) == {rec.key}

    def crash(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr("memplan.outputs.os.replace", crash)
    with pytest.raises(MemplanError, match="disk gone; it is as it was"):
        write_record(tmp_path, synthetic(grid[1], KNOWN))

    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial, no temp


def test_resume_measures_only_missing_points(tmp_path: Path, grid: list[Point],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from memplan.profile import calibrate_run

    calls: list[str] = []
    crash = [True]

    def measure(point, m, steps):
        calls.append(point.key)
        if len(calls) == 3 and crash:
            crash.clear()
            raise KeyboardInterrupt  # a crash while the third point runs
        return synthetic(point, KNOWN, m=m)

    monkeypatch.setattr(calibrate_run, "measure", measure)
    points = grid[:5]
    with pytest.raises(KeyboardInterrupt):
        calibrate_run.run_grid(points, tmp_path, meta(), steps=3, resume=False)
    assert finished_keys(tmp_path) == {p.key for p in points[:2]}
    calls.clear()
    calibrate_run.run_grid(points, tmp_path, meta(), steps=3, resume=True)
    assert calls == [p.key for p in points[2:]]
    assert finished_keys(tmp_path) == {p.key for p in points}


def test_ctrl_c_says_what_is_saved_and_the_command_resumes(tmp_path: Path, capsys,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Ctrl-C after two of the quick CPU grid's ten points: exit 130, one line with the
    records kept and the command that resumes; that command measures the other eight and
    fits the profile."""
    pytest.importorskip("torch")
    import shlex

    from memplan.profile import calibrate_run

    cpu_points_traced_once(monkeypatch)

    real = calibrate_run.run_grid
    measured: list[int] = []

    def two_then_ctrl_c(points, folder, meta, *, steps, resume, progress):
        real(points[:2], folder, meta, steps=steps, resume=resume, progress=progress)
        raise KeyboardInterrupt

    def counted(points, folder, meta, *, steps, resume, progress):
        done = finished_keys(folder)
        measured.append(sum(p.key not in done for p in points))
        real(points, folder, meta, steps=steps, resume=resume, progress=progress)

    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setattr(calibrate_run, "run_grid", two_then_ctrl_c)
    out = tmp_path / "cal"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 130
    lines = capsys.readouterr().err.splitlines()
    folder = out / "records" / "cpu"
    command = (f"memplan calibrate --device cpu --quick --out {out} --resume --name cpu")
    assert [line for line in lines if line.startswith("memplan:")] == [lines[-1]]
    assert lines[-1] == (f"memplan: interrupted: 2 finished records are saved in {folder}; "
                         f"resume with: {command}")
    assert len(finished_keys(folder)) == 2 and not (out / "profiles").exists()
    monkeypatch.setattr(calibrate_run, "run_grid", counted)
    assert main(shlex.split(command)[1:]) == 0
    assert measured == [8] and len(finished_keys(folder)) == 10
    assert load_profile(out / "profiles" / "cpu.json").kind == "device"


# --- profiles applied ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory: pytest.TempPathFactory, grid: list[Point]) -> Path:
    root = tmp_path_factory.mktemp("h100cal")
    folder = root / "records" / "h100-sxm"
    for p in grid:
        write_record(folder, synthetic(p, KNOWN))
    path = root / "profiles" / "h100-sxm.json"
    save_profile(path, build_profile(folder, path, "h100-sxm"))
    return path


def test_estimate_shows_the_correction_as_its_own_line(gpu_profile: Path) -> None:
    plain = memplan.estimate("llama-2-7b", gpus=8, gpu="h100", zero=1, seq_len=4096)
    est = memplan.estimate("llama-2-7b", gpus=8, gpu="h100", zero=1, seq_len=4096,
                           calibration=str(gpu_profile))
    w, p = est.worst, plain.worst
    # the analytic parts are unchanged
    assert (w.params_bytes, w.activations_bytes, w.tensor_peak_bytes) == \
        (p.params_bytes, p.activations_bytes, p.tensor_peak_bytes)
    # the correction, derived by hand from KNOWN: each phase plus its terms, the largest wins
    act, temp = w.activations_bytes, w.optimizer_temp_bytes

    def by_hand(ph):
        return (ph.forward + 3 * MiB + 0.05 * act, ph.backward + 5 * MiB + 0.08 * act,
                ph.optimizer + 1 * MiB + 0.5 * temp)

    expected = max(*by_hand(p.first_step), *by_hand(p.steady))
    # (the synthetic measurements are whole bytes: the fitted coefficients carry a few bytes
    # of rounding at 65 GB)
    assert abs(w.tensor_peak_bytes + w.calibration_bytes - expected) <= 4
    # the calibrated phase peaks replace the analytic ones, which stay beside them
    assert w.analytic_phases == (p.steady, p.first_step)
    for calibrated, analytic in ((w.first_step, p.first_step), (w.steady, p.steady)):
        got = (calibrated.forward, calibrated.backward, calibrated.optimizer)
        assert all(abs(g - h) <= 4 for g, h in zip(got, by_hand(analytic), strict=True))
    assert max(w.first_step.peak, w.steady.peak) == w.tensor_peak_bytes + w.calibration_bytes
    assert w.cuda_context_bytes == OUTSIDE and w.workspace_bytes == 0
    # the allocator line is the measured residual beyond the caching-allocator model
    assert w.allocator_bytes == RESIDUAL
    assert w.peak_bytes == (w.tensor_peak_bytes + w.calibration_bytes + w.cuda_context_bytes
                            + w.workspace_bytes + w.allocator_bytes)
    assert any("measured: device used minus reserved" in a for a in est.assumptions)


def test_estimate_cli_json_and_table(gpu_profile: Path) -> None:
    args = ["estimate", "-m", "llama-2-7b", "-n", "8", "--gpu", "h100", "--zero", "1",
            "--calibration", str(gpu_profile)]
    out = json.loads(CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False).stdout)
    cal = out["calibration"]
    assert cal["profiles"] == [str(gpu_profile)]
    assert out["calibration_bytes"] == cal["tensor_peak_bytes"] - out["stages"][0][
        "tensor_peak_bytes"] > 0
    assert out["stages"][0]["calibration_bytes"] == out["calibration_bytes"]
    # stages[].phases are the calibrated figures, the analytic ones beside them
    stage = out["stages"][0]
    assert stage["phases"] == cal["phases"]
    assert max(v for step in stage["phases"].values() for v in step.values()) == \
        cal["tensor_peak_bytes"]
    assert max(v for step in stage["analytic_phases"].values() for v in step.values()) == \
        stage["tensor_peak_bytes"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "200"}, catch_exceptions=False).stdout
    assert "calibration correction" in table and "tensor peak" in table
    assert "steady state (analytic)" in table and "calibrated" in table
    plain = json.loads(CliRunner().invoke(app, ["estimate", "-m", "tiny", "--json"]).stdout)
    assert plain["calibration"] is None and plain["calibration_bytes"] == 0
    assert plain["stages"][0]["analytic_phases"] is None


def test_profile_is_found_for_the_gpu_and_refused_for_another(gpu_profile: Path,
                                                              capsys) -> None:
    folder = str(gpu_profile.parent)
    est = memplan.estimate("tiny", gpu="h100", calibration=folder)
    assert est.calibration.profiles == (str(gpu_profile),)
    with pytest.raises(MemplanError, match="no calibration profile for GPU a100-80gb"):
        memplan.estimate("tiny", gpu="a100", calibration=folder)
    code = main(["estimate", "-m", "tiny", "--gpu", "a100", "--calibration", str(gpu_profile)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "measured on h100-sxm, not a100-80gb" in err


def test_plan_rechecks_candidates_with_the_profile(tmp_path: Path, gpu_profile: Path) -> None:
    heavy = load_profile(gpu_profile)
    coefs = dict(heavy.device.coefficients, **{"backward.fixed_bytes": 20 * GiB})
    path = tmp_path / "heavy.json"
    save_profile(path, heavy.model_copy(update={
        "device": heavy.device.model_copy(update={"coefficients": coefs})}))
    kwargs = {"gpus": 8, "gpu": "h100", "seq_len": 4096, "tp": 1, "pp": 1, "zero": 1}
    plain = memplan.plan("llama-2-7b", **kwargs)
    cal = memplan.plan("llama-2-7b", calibration=str(path), **kwargs)
    budget = int(load_gpu("h100").memory_bytes * 0.95)
    assert cal.candidates and all(c.peak_bytes <= budget for c in cal.candidates)
    assert all(c.estimate.worst.calibration_bytes >= 20 * GiB - 4 * MiB for c in cal.candidates)
    mbs = {(c.recompute, c.recompute_layers): c.micro_batch_size for c in plain.candidates}
    for c in cal.candidates:
        assert c.micro_batch_size <= mbs[(c.recompute, c.recompute_layers)]
    assert sum(c.micro_batch_size for c in cal.candidates) < sum(mbs.values())


def test_plan_cli_takes_the_calibration(gpu_profile: Path) -> None:
    out = CliRunner().invoke(app, ["plan", "-m", "llama-2-7b", "-n", "8", "--gpu", "h100",
                                   "--tp", "1", "--pp", "1", "--zero", "1", "--calibration",
                                   str(gpu_profile), "--json"], catch_exceptions=False)
    cands = json.loads(out.stdout)["candidates"]
    assert cands and all(c["peak_bytes"] <= 0.95 * c["capacity_bytes"] for c in cands)
    # the synthetic device's measured rate replaces the assumed utilisation
    assert cands[0]["mfu"] < RATE / load_gpu("h100").bf16_flops


def test_device_names_match_the_catalog() -> None:
    pytest.importorskip("torch")
    from memplan.profile.calibrate_run import match_gpu

    assert match_gpu("NVIDIA H100 80GB HBM3", 85_029_158_912) == "h100-sxm"
    assert match_gpu("NVIDIA H100 PCIe", 85_029_158_912) == "h100-pcie"
    assert match_gpu("NVIDIA H200", 150_109_945_856) == "h200"
    assert match_gpu("NVIDIA A100-SXM4-40GB", 42_298_834_944) == "a100-40gb"
    assert match_gpu("NVIDIA A100-SXM4-80GB", 84_987_740_160) == "a100-80gb"
    assert match_gpu("NVIDIA H100 NVL", 100_485_038_080) is None  # no catalog memory agrees
    assert match_gpu("NVIDIA L4", 23_034_003_456) is None


# --- end to end on CPU ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("cpucal")
    with pytest.MonkeyPatch.context() as monkeypatch:
        cpu_points_traced_once(monkeypatch)
        result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--quick", "--out",
                                          str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_cpu_quick_records_and_profile(cpu_run: Path) -> None:
    import torch

    records = read_records(cpu_run / "records" / "cpu")
    assert [r.key for r in records] == sorted(p.key for p in device_grid("cpu", quick=True))
    for rec in records:
        assert rec.status == "ok" and len(rec.ranks[0].steps) == 3
        steady = rec.ranks[0].steps[-1]
        assert steady.saved_activations_bytes > 0 and steady.time_s > 0
        assert steady.phases["backward"].reserved_bytes is None  # the tracker sees tensors
    assert not list((cpu_run / "records" / "cpu").glob(".*"))  # no temporary files left
    prof = load_profile(cpu_run / "profiles" / "cpu.json")
    assert prof.kind == "device" and prof.schema_version == 1 and prof.num_records == 10
    assert prof.meta.device == "cpu" and prof.meta.torch == torch.__version__
    assert prof.records == "../records/cpu"
    by = {(e.quantity, e.method): e for e in prof.errors}
    # the exact tracker and the analytic model agree (README: within 0.5%), so does the fit
    assert by[("allocated_peak", "analytic")].max_abs_pct < 0.5
    assert by[("allocated_peak", "leave-one-out")].max_abs_pct < 0.5
    assert prof.device.outside_allocator_bytes is None and prof.device.reserved_ratio is None
    assert prof.device.allocator_residual_bytes is None


def test_cpu_resume_refit_and_use(cpu_run: Path, capsys) -> None:
    folder = cpu_run / "records" / "cpu"
    before = {p.name: p.read_text() for p in folder.iterdir()}
    code = main(["calibrate", "--device", "cpu", "--quick", "--out", str(cpu_run)])
    err = capsys.readouterr().err
    assert code == 2 and "already holds 10 records; pass --resume" in err
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--quick", "--resume",
                                      "--out", str(cpu_run), "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    assert {p.name: p.read_text() for p in folder.iterdir()} == before  # nothing re-measured
    assert json.loads(result.stdout)["profile"]["num_records"] == 10
    refit = CliRunner().invoke(app, ["calibrate", "--refit", "--out", str(cpu_run)])
    assert refit.exit_code == 0 and "unchanged" in refit.stdout
    out = json.loads(CliRunner().invoke(app, [
        "estimate", "-m", "llama-7b", "-n", "8", "--calibration",
        str(cpu_run / "profiles" / "cpu.json"), "--json"]).stdout)
    assert abs(out["calibration_bytes"]) < 0.005 * out["stages"][0]["tensor_peak_bytes"]
    assert out["stages"][0]["cuda_context_bytes"] == 400 * MiB  # a CPU profile keeps defaults
    assert any("tensor terms only" in a for a in out["assumptions"])


def test_no_gpu_is_a_clear_error_that_writes_nothing(tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code = main(["calibrate", "--quick", "--out", str(tmp_path / "cal")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("memplan: error: no CUDA device") and err.count("\n") == 1
    assert "--device cpu" in err
    assert not (tmp_path / "cal").exists()


def test_gloo_two_ranks(tmp_path: Path) -> None:
    """Each rank's measures against that rank's deterministic expectation: the same point
    traced through the fake process group, where collectives return at once and free their
    buffers when the main thread drops them. Every parameter's first dimension divides by the
    two ranks, so rank 1 holds exactly rank 0's bytes and the rank-0 trace is both ranks'
    expectation. A real gloo rank counts at least that, and may count more by the collective
    buffers a gloo worker thread still holds (``gloo_late_bytes``: the two workers race the
    main thread), so the two ranks are never compared with each other byte for byte."""
    pytest.importorskip("torch")
    from memplan.profile.distributed import gloo_late_bytes, trace_parallel
    from memplan.profile.reference import ReferenceModel, RefOptions

    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--quick", "--nproc", "2",
                                      "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = read_records(tmp_path / "records" / "cpu-nproc2")
    assert len(records) == 6 and all(r.ok and len(r.ranks) == 2 for r in records)
    assert {r.layout.tp for r in records} == {1, 2} and {r.layout.dp for r in records} == {1, 2}
    spec = records[0].spec
    assert all(p.shape[0] % 2 == 0 for p in
               ReferenceModel(spec, RefOptions(), device="meta").parameters())
    for rec in records:
        want = trace_parallel(rec.spec, rec.layout, rec.workload,
                              steps=len(rec.ranks[0].steps))
        late = gloo_late_bytes(rec.spec, rec.layout, rec.workload)
        for rank in rec.ranks:
            assert [s.step for s in rank.steps] == [s.step for s in want.steps]
            for got, exp in zip(rank.steps, want.steps, strict=True):
                where = (rec.key, rank.rank, got.step)
                saved = got.saved_activations_bytes - exp.saved_activations_bytes
                assert 0 <= saved <= late, (*where, saved)
                for phase in PHASES:
                    extra = got.phases[phase].allocated_bytes - exp.phases[phase].total_bytes
                    assert 0 <= extra <= late, (*where, phase, extra)
    prof = load_profile(tmp_path / "profiles" / "cpu-nproc2.json")
    assert prof.device.world_size == 2
    by = {(e.quantity, e.method): e.max_abs_pct for e in prof.errors}
    # real gloo collectives hold buffers the analytic model does not count; the fit learns them.
    # The late buffers above only add to a measured peak the analytic model already undercounts,
    # so they widen its error at least as much as the fit's.
    assert by[("allocated_peak", "leave-one-out")] < by[("allocated_peak", "analytic")]


# --- a user's own model ---------------------------------------------------------------------------

FACTORY = f"{USER_MODEL / 'hf_style_llama.py'}:build"
SPEC_TOML = USER_MODEL / "hf_style_llama.toml"


@pytest.fixture(scope="module")
def user_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("usercal")
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--module", FACTORY,
                                      "--model", str(SPEC_TOML), "--seq", "128", "--out",
                                      str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out / "profiles" / "model-build.json"


def _trace(b: int, s: int, layers: int, monkeypatch: pytest.MonkeyPatch):
    from memplan.profile.user_model import load_factory, trace_point

    monkeypatch.setenv("HF_STYLE_LAYERS", str(layers))
    spec = memplan.load_model(str(SPEC_TOML)).model_copy(update={"num_layers": layers})
    steps, _ = trace_point(load_factory(FACTORY), spec, memplan.make_workload(
        spec, micro_batch_size=b, seq_len=s))
    peak = max(st.phases[p].allocated_bytes for st in steps for p in PHASES)
    return spec, peak, steps[-1].saved_activations_bytes


def test_user_model_profile(user_profile: Path) -> None:
    prof = load_profile(user_profile)
    assert prof.kind == "model" and prof.num_records == 15
    assert set(prof.model.regimes) == {"b=1", "b>=2"}
    by = {(e.quantity, e.method): e for e in prof.errors}
    assert by[("peak", "analytic")].max_abs_pct > 10  # this implementation is not the reference
    for q in ("peak", "saved", "steady.backward", "first_step.forward"):
        assert by[(q, "held-out")].max_abs_pct < 1 and by[(q, "held-out")].num_points == 3
        assert by[(q, "leave-one-out")].max_abs_pct < 1


@pytest.mark.parametrize("b, s, layers", [(1, 80, 3), (2, 40, 3), (5, 100, 3), (3, 200, 3),
                                          (2, 72, 5)])
def test_user_model_estimate_matches_unseen_traces(user_profile: Path, b: int, s: int,
                                                   layers: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fitted = {(x, y) for r in load_profile(user_profile).model.regimes.values()
              for x, y in r.points}
    assert (b, s) not in fitted
    spec, peak, saved = _trace(b, s, layers, monkeypatch)
    est = memplan.estimate(spec, micro_batch_size=b, seq_len=s, calibration=str(user_profile))
    cal = est.calibration.stage(0)
    assert abs(cal.tensor_peak_bytes - peak) <= 0.01 * peak
    assert abs(cal.activations_bytes - saved) <= 0.01 * saved
    assert est.worst.tensor_peak_bytes + est.worst.calibration_bytes == cal.tensor_peak_bytes


def test_user_model_profile_refuses_other_models(user_profile: Path) -> None:
    with pytest.raises(MemplanError, match="was fitted for hf-style-llama"):
        memplan.estimate("gpt2", calibration=str(user_profile))
    # tiny has the same widths at another depth: the profile applies, scaled per block
    assert memplan.estimate("tiny", seq_len=64, calibration=str(user_profile)).calibration
    with pytest.raises(MemplanError, match="reference with attention flash"):
        memplan.estimate(str(SPEC_TOML), attention="eager", calibration=str(user_profile))
    with pytest.raises(MemplanError, match="tp=pp=cp=1"):
        memplan.estimate(str(SPEC_TOML), gpus=2, tp=2, calibration=str(user_profile))


def test_a_second_implementation(tmp_path: Path) -> None:
    """nanoGPT's style: a tuple (logits, loss) from forward(idx, targets), a tied head, dropout
    inside SDPA (which the CPU kernel materialises as an s^2 mask and probabilities)."""
    pytest.importorskip("torch")
    from memplan.profile.user_model import load_factory, trace_point

    factory, toml = f"{USER_MODEL / 'nanogpt_like.py'}:build", USER_MODEL / "nanogpt_like.toml"
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--module", factory,
                                      "--model", str(toml), "--out", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    path = tmp_path / "profiles" / "model-build.json"
    prof = load_profile(path)
    assert prof.model.num_params == prof.model.analytic_num_params  # the spec describes it
    assert prof.error("peak", "analytic").max_abs_pct > 10
    assert prof.error("peak", "held-out").max_abs_pct < 1
    spec = memplan.load_model(str(toml))
    for b, s in ((3, 100), (1, 50)):
        steps, _ = trace_point(load_factory(factory), spec,
                               memplan.make_workload(spec, micro_batch_size=b, seq_len=s))
        peak = max(st.phases[p].allocated_bytes for st in steps for p in PHASES)
        est = memplan.estimate(spec, micro_batch_size=b, seq_len=s, calibration=str(path))
        assert abs(est.calibration.stage(0).tensor_peak_bytes - peak) <= 0.01 * peak


def test_user_model_real_tensors_trace_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from memplan.profile.user_model import load_factory, trace_point

    monkeypatch.setenv("HF_STYLE_LAYERS", "3")
    spec = memplan.load_model(str(SPEC_TOML))
    wl = memplan.make_workload(spec, micro_batch_size=2, seq_len=48)
    fake, _ = trace_point(load_factory(FACTORY), spec, wl)
    real, _ = trace_point(load_factory(FACTORY), spec, wl, fake=False)
    assert [s.phases for s in real] == [s.phases for s in fake]
    assert [s.layer_saved_bytes for s in real] == [s.layer_saved_bytes for s in fake]


def test_bad_module_is_one_line(tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    code = main(["calibrate", "--device", "cpu", "--module", "no_such_pkg.mod:build",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot import 'no_such_pkg.mod'" in err
    assert not (tmp_path / "records").exists()


@pytest.fixture(scope="module")
def hf_example_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``calibrate --device cpu --module`` of the README's factory for a Hugging Face model
    (calibration/examples/hf_factory.py) at --seq 64, the generic workload: its profile, run
    once for the tests that read it."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("hfcal")
    factory = out / "hf_factory.py"
    factory.write_text((ROOT / "calibration" / "examples" / "hf_factory.py").read_text())
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--module",
                                      f"{factory}:build", "--seq", "64", "--out",
                                      str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out / "profiles" / "model-build.json"


def test_transformers_example_factory(hf_example_profile: Path) -> None:
    """The README's factory for a Hugging Face model built from its config (no weights)."""
    prof = load_profile(hf_example_profile)
    assert prof.error("peak", "held-out").max_abs_pct < 1


# --- committed data -------------------------------------------------------------------------------

def test_committed_profiles_refit_unchanged() -> None:
    results = refit_all(ROOT / "calibration", write=False)
    assert results and not [p for p, changed in results if changed]


def test_refit_command_documented_in_readme() -> None:
    readme = (ROOT / "calibration" / "README.md").read_text()
    assert "memplan calibrate --refit" in readme
    proc = subprocess.run([sys.executable, "-m", "memplan.calibrate.refit", "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "cpu-example.json: unchanged" in proc.stdout


def test_estimate_with_a_profile_stays_light() -> None:
    code = ("import sys, memplan.cli\n"
            "code = memplan.cli.main(['estimate', '-m', 'llama-7b', '-n', '8', '--calibration',"
            " 'calibration/profiles/cpu-example.json', '--json'])\n"
            "heavy = [m for m in ('torch', 'scipy') if m in sys.modules]\n"
            "print(code, heavy, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr.strip().splitlines()[-1] == "0 []"
    assert json.loads(proc.stdout)["calibration"]["profiles"]


# --- on a GPU ------------------------------------------------------------------------------------

def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_cuda_quick_calibration(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--out", str(tmp_path), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    prof = json.loads(result.stdout)["profile"]
    folder = tmp_path / prof["records"].replace("../", "")
    records = read_records(folder)
    assert len(records) == 10 and all(r.status in ("ok", "oom") for r in records)
    for rec in (r for r in records if r.ok):
        ph = rec.ranks[0].steps[-1].phases["backward"]
        assert ph.reserved_bytes >= ph.allocated_bytes > 0
        assert ph.device_used_bytes > ph.reserved_bytes
        assert ph.alloc_retries is not None and ph.inactive_split_bytes is not None
    probes = json.loads((folder / "probes.json").read_text())["probes"]
    assert probes["context"] > 0 and probes["cublas"] >= 0
    dev = prof["device"]
    assert dev["allocator_residual_bytes"] is not None and dev["outside_allocator_bytes"] > 0
    assert 0 < dev["mfu"] < 1


# --- calibrate --module: the options, the sequence, the containers ---------------------------

HF_EXAMPLE = ROOT / "calibration" / "examples" / "hf_factory.py"


def _hf_example(tmp_path: Path) -> str:
    factory = tmp_path / "hf_factory.py"
    factory.write_text(HF_EXAMPLE.read_text())
    return f"{factory}:build"


def test_module_workload_follows_the_framework_and_the_config(tmp_path: Path,
                                                              hf_example_profile: Path) -> None:
    """--framework hf traces the transformers model with the Trainer's defaults (fused
    AdamW, upcast norms, logits held by the output during the loss, KV cache) and the config's
    eager attention: memplan's analytic model of that workload matches the trace of the
    library's own code to within 0.1% at every point, where the generic workload (the same
    factory and --seq without --framework: ``hf_example_profile``) is far off; the profile
    then applies to that workload only."""
    pytest.importorskip("transformers")
    factory = _hf_example(tmp_path)
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--module", factory,
                                      "--seq", "64", "--out", str(tmp_path), "--name", "hf",
                                      "--framework", "hf"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    hf = load_profile(tmp_path / "profiles" / "hf.json")
    generic = load_profile(hf_example_profile)
    wl = hf.model.workload
    assert (wl.framework.value, wl.optimizer_impl.value, wl.attention.value,
            wl.norm_impl.value, wl.logits_held.value, wl.kv_cache) == \
        ("hf", "fused", "eager", "upcast", "loss", True)
    assert generic.model.workload.attention.value == "eager"  # read from the config
    assert hf.error("peak", "analytic").max_abs_pct < 0.1
    assert hf.error("saved", "analytic").max_abs_pct < 0.1
    assert generic.error("peak", "analytic").max_abs_pct > 5
    spec = hf.model.spec
    path = str(tmp_path / "profiles" / "hf.json")
    est = memplan.estimate(spec, framework="hf", attention="eager", micro_batch_size=2,
                           seq_len=48, calibration=path)
    assert est.calibration is not None
    with pytest.raises(MemplanError, match="framework hf"):
        memplan.estimate(spec, attention="eager", calibration=path)
    with pytest.raises(MemplanError, match="optimizer_impl"):
        memplan.estimate(spec, framework="hf", attention="eager", optimizer_impl="foreach",
                         calibration=path)


def test_module_optimizer_impl_and_norm_are_traced_and_recorded(tmp_path: Path) -> None:
    """--optimizer-impl fused runs torch.optim.AdamW(fused=True) in the traces, and --norm
    names the norm the analytic side assumes: an estimate with both takes the profile, one
    with the generic defaults (foreach, upcast) is refused by name."""
    pytest.importorskip("transformers")
    result = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--module",
                                      _hf_example(tmp_path), "--seq", "32", "--optimizer-impl",
                                      "fused", "--norm", "fused", "--out", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    path = tmp_path / "profiles" / "model-build.json"
    prof = load_profile(path)
    wl = prof.model.workload
    assert (wl.optimizer_impl.value, wl.norm_impl.value) == ("fused", "fused")
    # the fused step makes no parameter-sized intermediate: the optimizer phase is analytic
    assert prof.error("steady.optimizer", "analytic").max_abs_pct < 0.01
    spec = prof.model.spec
    assert memplan.estimate(spec, attention="eager", optimizer_impl="fused", norm_impl="fused",
                            calibration=str(path)).calibration
    with pytest.raises(MemplanError, match="optimizer_impl fused"):
        memplan.estimate(spec, attention="eager", norm_impl="fused", calibration=str(path))
    with pytest.raises(MemplanError, match="norm_impl fused"):
        memplan.estimate(spec, attention="eager", optimizer_impl="fused", calibration=str(path))


def test_module_attention_contradicting_the_config_is_refused(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    code = main(["calibrate", "--device", "cpu", "--module", _hf_example(tmp_path),
                 "--attention", "flash", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "config runs 'eager' attention" in err and "not flash" in err
    assert not (tmp_path / "records").exists()


def test_module_seq_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """--seq sets the longest traced sequence, beyond 1,024 tokens too, up to the model's
    positions; without it the traces stop at min(positions, 1,024)."""
    from memplan.profile.user_model import user_points

    spec = memplan.load_model("llama-2-7b")  # 4,096 positions
    assert max(s for _, s, _ in user_points(spec)) == 1024
    assert max(s for _, s, _ in user_points(spec, 2048)) == 2048
    assert max(s for _, s, _ in user_points(spec, 4096)) == 4096
    with pytest.raises(MemplanError, match=r"seq \(8192\) is longer than .* 4096 positions"):
        user_points(spec, 8192)
    with pytest.raises(MemplanError, match=r"seq \(8\) must be at least 16"):
        user_points(spec, 8)


def test_module_seq_reaches_the_records(tmp_path: Path) -> None:
    """A traced run at --seq 2048 records points at 2,048 tokens (the factory's config has
    2,048 positions)."""
    pytest.importorskip("transformers")
    text = HF_EXAMPLE.read_text().replace("max_position_embeddings=256",
                                          "max_position_embeddings=2048")
    assert text != HF_EXAMPLE.read_text()
    factory = tmp_path / "hf_long.py"
    factory.write_text(text.replace("num_hidden_layers=4", "num_hidden_layers=1"))
    from memplan.profile.user_model import load_factory, resolve_spec, user_points

    spec, _ = resolve_spec(load_factory(f"{factory}:build"), None)
    assert spec.max_seq_len == 2048
    assert max(s for _, s, _ in user_points(spec, 2048)) == 2048


def test_grid_refuses_module_options(tmp_path: Path, capsys) -> None:
    """--seq, --framework, --attention, --norm and --optimizer-impl describe the traced user
    model: without --module they would be ignored, so they are refused."""
    for extra in (["--seq", "2048"], ["--framework", "hf"], ["--norm", "fused"],
                  ["--optimizer-impl", "fused"], ["--attention", "eager"]):
        code = main(["calibrate", "--device", "cpu", "--quick", "--out", str(tmp_path), *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "only apply with --module" in err, extra
    assert not (tmp_path / "records").exists()


def test_blocks_in_a_module_dict_are_found() -> None:
    """torchtitan keeps its blocks in an nn.ModuleDict: they are found, in order, and each
    block's saved bytes are recorded."""
    pytest.importorskip("torchtitan")
    import torch

    from memplan.profile.frameworks import torchtitan_spec
    from memplan.profile.user_model import find_blocks, load_factory, trace_point

    target = f"{USER_MODEL / 'torchtitan_llama.py'}:build"
    factory = load_factory(target)
    model = factory(dtype=torch.float32)
    assert isinstance(model.layers, torch.nn.ModuleDict)
    blocks = find_blocks(model)
    assert blocks == list(model.layers.values()) and len(blocks) == 3
    mod = sys.modules["torchtitan_llama"]
    spec = torchtitan_spec(mod.config(), "torchtitan-toy")
    steps, num = trace_point(factory, spec, memplan.make_workload(
        spec, micro_batch_size=2, seq_len=32, precision="fp32", framework="torchtitan"),
        fake=False)
    assert num == spec.num_params
    saved = steps[-1].layer_saved_bytes
    assert len(saved) == 3 and len(set(saved)) == 1 and saved[0] > 0


def test_reference_trace_keeps_zeroed_gradients() -> None:
    """keep_grads (zero_grad(set_to_none=False), torchtitan's default) in the traced loop:
    the gradients stay allocated into the next forward, as memplan's estimate has them,
    byte for byte."""
    from memplan.model.estimate import estimate
    from memplan.overheads import no_overheads
    from memplan.parallel import ParallelConfig
    from memplan.profile.trace import trace

    spec = memplan.load_model("tiny")
    forward = {}
    for keep in (False, True):
        wl = memplan.make_workload(spec, micro_batch_size=2, seq_len=64, keep_grads=keep)
        traced = trace(spec, ParallelConfig(), wl, steps=3)
        est = estimate(spec, load_gpu("h100"), ParallelConfig(), wl, overheads=no_overheads())
        steady = est.stages[0].steady
        for phase in PHASES:
            assert traced.steady.phases[phase].total_bytes == getattr(steady, phase)
        forward[keep] = traced.steady.phases["forward"].total_bytes
    assert forward[True] - forward[False] == est.stages[0].grads_bytes > 0


def test_loop_held_logits_are_traced(tmp_path: Path) -> None:
    """logits_held step (litgpt's loop variable): the traced loop keeps the logits through
    backward and the optimizer step, so the steady optimizer phase holds them."""
    pytest.importorskip("transformers")
    from memplan.profile.user_model import load_factory, resolve_spec, trace_point

    factory = load_factory(_hf_example(tmp_path))
    spec, _ = resolve_spec(factory, None)
    peaks = {}
    for held in ("none", "step"):
        wl = memplan.make_workload(spec, micro_batch_size=2, seq_len=32, precision="fp32",
                                   attention="eager", logits_held=held)
        steps, _ = trace_point(factory, spec, wl)
        peaks[held] = steps[-1].phases["optimizer"].allocated_bytes
    logits = 2 * 32 * spec.vocab_size * 4  # (b, s, V) fp32
    assert peaks["step"] - peaks["none"] == logits
